"""``HiF8Quantizer`` and the v1 recipe ``hif8_current`` (design spec §7.1, §7.3, §13.3).

Current scaling (docs/formats.md "Decisions", §1.7): ``scale = amax / format_max`` in FP32 when
amax is finite and > 0, else 1.0; ``data = encode(x / scale)`` with ``x / scale`` computed in FP32
(the input is converted to FP32 first, then divided — a division, not a multiply by a rounded
reciprocal, as the NPU's DynamicQuant formula ``y = round(x / scale)``, ops-nn
aclnnDynamicQuantV4.md). The scale is one 0-d value for 1-D/2-D tensors and one per leading group
``[E]`` for 3-D grouped weights. One ``data`` serves both orientations: ``orientation`` is
recorded as metadata only. This is the portable codec, bit-exact to the binding decision on any
device; the ``npu`` op backend computes the same amax and scale and takes the codes from
torch_npu's ``npu_quantize`` with that scale (``npu_dynamic_quant``'s own scale rule differs;
docs/formats.md §3.3 and open question 7).

========================  ===========================  ==========================================
recipe                    roles                        quantizer
========================  ===========================  ==========================================
``hif8_current``          INPUT_FWD, WEIGHT_FWD,       ``HiF8Quantizer(format_max=15.0)``
                          INPUT_BWD, WEIGHT_BWD
``hif8_current``          GRAD_OUTPUT                  ``HiF8Quantizer(format_max=224.0)``
========================  ===========================  ==========================================

Tensor-name legend: ``x`` the input (any floating dtype), ``x32`` its FP32 copy, ``amax`` /
``amax_E`` per-tensor / per-group max |x|, ``scale`` / ``scale_E`` the FP32 scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lp_lightning.formats.amax import abs_max
from lp_lightning.formats.hif8 import codec
from lp_lightning.formats.hif8.spec import SPEC, HiF8Spec
from lp_lightning.formats.operand import QuantizationRole, QuantizedOperand
from lp_lightning.formats.quantizer import check_quantize_args
from lp_lightning.formats.recipe import LowPrecisionRecipe
from lp_lightning.formats.spec import Orientation

__all__ = ["HIF8_CURRENT", "HiF8Quantizer"]


@dataclass(frozen=True, slots=True)
class HiF8Quantizer:
    """HiF8 current-scaling quantizer for one ``format_max`` (15.0 input/weight, 224.0 gradient).

    Attributes:
        format_max: The value amax is scaled to (docs/formats.md §1.7). Must be finite, > 0 and at most
            the largest finite HiF8 value 32768. The recipe owns it; users do not configure it.

    Raises:
        ValueError: for an illegal ``format_max``.
    """

    format_max: float
    format: ClassVar[HiF8Spec] = SPEC

    def __post_init__(self) -> None:
        value = self.format_max
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value <= codec.HIF8_MAX):
            raise ValueError(
                f"HiF8Quantizer: format_max={value!r} must be a number in (0, {codec.HIF8_MAX}] "
                f"(recipe v1 uses {codec.FORMAT_MAX_INPUT_WEIGHT} and {codec.FORMAT_MAX_GRADIENT})."
            )
        object.__setattr__(self, "format_max", float(value))

    @staticmethod
    def compute_amax(tensor: torch.Tensor) -> torch.Tensor:
        """max |x| in FP32: 0-d for 1-D/2-D tensors, ``[E]`` (over dims 1, 2) for 3-D tensors.

        NaN anywhere in a group gives NaN for that group (``torch.amax`` propagates NaN); an
        empty tensor or group gives 0. Use it to MAX-reduce amax over a process group before
        ``quantize(..., amax=...)`` so every shard uses the same scale (requirement R7 (docs/design.md)).

        Args:
            tensor: float32/bfloat16/float16 tensor with 1 to 3 dims.

        Returns:
            ``torch.float32`` amax on ``tensor``'s device.
        """
        return abs_max(tensor, per_group=tensor.dim() == 3)

    def scale_from_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """``amax / format_max`` in FP32 where that is finite and > 0, else 1.0 (docs/formats.md).

        The "> 0" test is on the quotient, so an amax so small that ``amax / format_max``
        underflows FP32 to 0 also falls back to 1.0 (it would otherwise divide by zero).

        Args:
            amax: FP32 tensor (0-d or ``[E]``).

        Returns:
            FP32 scale with ``amax``'s shape.
        """
        amax32 = amax.to(torch.float32)
        scale = amax32 / self.format_max
        valid = torch.isfinite(amax32) & (scale > 0)
        return torch.where(valid, scale, torch.ones_like(scale))

    def quantize(
        self,
        tensor: torch.Tensor,
        *,
        orientation: Orientation,
        group_list: torch.Tensor | None = None,
        amax: torch.Tensor | None = None,
        values_dtype: torch.dtype | None = None,
    ) -> QuantizedOperand:
        """Current-scaling quantize: ``scale`` from amax, ``data = encode(x32 / scale)``.

        Args:
            tensor: float32/bfloat16/float16. 1-D or 2-D → one 0-d scale (activations must be
                flattened to ``[M, K]`` first); 3-D ``[E, D1, D2]`` → one scale per leading group
                ``[E]`` (stacked expert weights).
            orientation: ``"row"`` or ``"col"``; metadata only (one ``data`` serves both).
            group_list: Optional ``int64 [G]`` row counts of a token-sorted 2-D tensor, kept as
                metadata (HiF8 scales are per tensor, so groups do not change the bits).
            amax: Optional precomputed FP32 amax (0-d, or ``[E]`` for 3-D), e.g. the MAX over an
                FSDP group; default: ``compute_amax(tensor)``.
            values_dtype: ``torch.float32`` (``SPEC.gemm_values_dtype``) to also return the decoded
                codes as ``QuantizedOperand.values`` (emulation; docs/performance.md); default None.

        Returns:
            ``QuantizedOperand`` with ``uint8`` HiF8 codes (``tensor``'s shape), ``float32``
            scale, ``format_max`` recorded.

        Raises:
            TypeError: for a non-tensor, a non-float input or a malformed ``group_list``/``amax``.
            ValueError: for an illegal orientation or a tensor that is not 1-D/2-D/3-D.
        """
        check_quantize_args("HiF8Quantizer", tensor, orientation, group_list)
        if tensor.dim() not in (1, 2, 3):
            raise ValueError(
                f"HiF8Quantizer.quantize: tensor must be 1-D/2-D (per-tensor scale) or 3-D [E, D1, D2] "
                f"(per-group scale), got shape {tuple(tensor.shape)}; flatten activations to [M, K] first."
            )
        expected_amax_shape = (tensor.shape[0],) if tensor.dim() == 3 else ()
        if amax is None:
            amax = self.compute_amax(tensor)
        elif not isinstance(amax, torch.Tensor) or tuple(amax.shape) != expected_amax_shape:
            got = tuple(amax.shape) if isinstance(amax, torch.Tensor) else type(amax).__name__
            raise TypeError(f"HiF8Quantizer.quantize: amax must be a tensor of shape {expected_amax_shape}, got {got}.")
        if values_dtype not in (None, torch.float32):
            raise ValueError(f"HiF8Quantizer.quantize: values_dtype must be None or torch.float32, got {values_dtype}.")
        scale = self.scale_from_amax(amax.to(tensor.device))
        values = None
        if tensor.dim() == 3:  # one scale per leading group
            x = tensor.detach()
            transposed = not x.is_contiguous() and x.mT.is_contiguous()
            if transposed:  # a grouped weight's w_EKN view of its w_ENK master: encode it in place
                x = x.mT
            data = codec.encode(x.to(torch.float32) / scale.reshape(-1, 1, 1))
            if transposed:  # transpose the 1-byte codes, not the FP32 input
                data = data.mT.contiguous()
            if values_dtype is not None:
                values = codec.decode(data, torch.float32)
        else:
            data, values = codec.encode_scaled(tensor, scale, with_values=values_dtype is not None)
        return QuantizedOperand(
            data=data,
            scale=scale,
            logical_dtype=tensor.dtype,
            format=self.format,
            orientation=orientation,
            group_list=group_list,
            format_max=self.format_max,
            values=values,
        )

    def quantize_dual(
        self, tensor: torch.Tensor, *, amax: torch.Tensor | None = None
    ) -> tuple[QuantizedOperand, QuantizedOperand]:
        """Both orientations from one quantization: the col operand shares the row one's tensors.

        Args:
            tensor: As ``quantize``.
            amax: As ``quantize``.

        Returns:
            ``(row_operand, col_operand)`` with ``col.data is row.data``.
        """
        row = self.quantize(tensor, orientation="row", amax=amax)
        return row, row.with_orientation("col")


_HIF8_INPUT_WEIGHT = HiF8Quantizer(format_max=codec.FORMAT_MAX_INPUT_WEIGHT)
_HIF8_GRADIENT = HiF8Quantizer(format_max=codec.FORMAT_MAX_GRADIENT)

HIF8_CURRENT = LowPrecisionRecipe(
    name="hif8_current",
    format=SPEC,
    scaling="current",
    quantizers={
        QuantizationRole.INPUT_FWD: _HIF8_INPUT_WEIGHT,
        QuantizationRole.WEIGHT_FWD: _HIF8_INPUT_WEIGHT,
        QuantizationRole.INPUT_BWD: _HIF8_INPUT_WEIGHT,
        QuantizationRole.WEIGHT_BWD: _HIF8_INPUT_WEIGHT,
        QuantizationRole.GRAD_OUTPUT: _HIF8_GRADIENT,
    },
)
"""HiF8 current-scaling recipe v1: amax → 15.0 for inputs/weights, → 224.0 for gradients."""
