"""The HiF8 format: ``HiF8Spec``, ``HiF8Quantizer`` and the v1 recipe ``hif8_current`` (design spec
§3, §7.1, §7.3, §9.2, §13.3; arXiv 2409.16626, docs/formats.md §1).

One module, as the three refer to each other: the quantizer's operands carry ``SPEC``, the recipe
holds the quantizers, and ``SPEC.recipe`` is the recipe.

- Operands: ``uint8`` HiFloat8 codes (``torch_npu.hifloat8`` bytes) and an FP32 scale, 0-d for
  1-D/2-D data, ``[E]`` for a 3-D grouped weight; the orientation is metadata (one data serves
  both GEMM directions).
- Numerics: a decoded code has at most 4 significant bits, so the exact GEMM emulation multiplies
  the decoded codes in FP32 and applies the product of the two scales to the FP32 result, the
  order of the hardware formula ``out = (Σ x1·x2) · x1Scale · x2Scale`` (aclnnQuantMatmulV5.md).
- Weights: a dense weight has one scale per tensor, so its shards MAX-reduce the amax over the
  FSDP shard group (design spec §9.2); a grouped weight has one scale per expert, local to the
  shard (dim-0 sharding never splits an expert). Any dim-0 split is legal.

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
from lp_lightning.formats.operand import QuantizationRole, QuantizedOperand
from lp_lightning.formats.quantizer import check_quantize_args
from lp_lightning.formats.recipe import LowPrecisionRecipe
from lp_lightning.formats.spec import AmaxScope, FormatSpec, Orientation, WeightKind

__all__ = ["HIF8_CURRENT", "SPEC", "HiF8Quantizer", "HiF8Spec"]


class HiF8Spec(FormatSpec):
    """HiF8 with FP32 current scaling (module docstring)."""

    name = "hif8"
    label = "HiF8"
    scaling = "current"
    data_dtype = torch.uint8
    scale_dtype = torch.float32
    physical_orientation = False
    uses_format_max = True
    gemm_values_dtype = torch.float32

    def scale_shape(
        self, data_shape: tuple[int, ...], orientation: Orientation, group_counts: list[int] | None = None
    ) -> tuple[int, ...]:
        shape = tuple(int(d) for d in data_shape)
        if len(shape) in (1, 2):
            return ()
        if len(shape) == 3:
            return (shape[0],)
        raise ValueError(
            f"QuantizedOperand(hif8): data must be 1-D, 2-D (per-tensor scale) or 3-D (per-group scale), "
            f"got shape {shape}."
        )

    def dequantize(self, operand: QuantizedOperand) -> torch.Tensor:
        scale = operand.scale.reshape(-1, 1, 1) if operand.data.dim() == 3 else operand.scale
        return codec.decode(operand.data, torch.float32) * scale

    def cast_saturated(self, operand: QuantizedOperand, source: torch.Tensor) -> torch.Tensor:
        """Codes at ±32768 (``codec.HIF8_MAX``) whose source exceeds 32768 × the scale (none while the
        current scale maps amax to ``format_max`` 15 or 224)."""
        at_max = codec.decode(operand.data, torch.float32).abs() == codec.HIF8_MAX
        return at_max & (source.to(torch.float32).abs() > self.dequantize(operand).abs())

    def gemm_factors(
        self, operand: QuantizedOperand, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if operand.values is not None and operand.values.dtype == dtype:  # decoded by the encode kernel
            return operand.values, operand.scale
        return codec.decode(operand.data, dtype), operand.scale

    def exact_gemm_dtype(self, operand: QuantizedOperand) -> torch.dtype:
        """Always BF16: every HiF8 value has at most 4 significant bits in [2^-22, 2^15] (``codec.decode``)."""
        return torch.bfloat16

    @property
    def recipe(self) -> LowPrecisionRecipe:
        return HIF8_CURRENT

    def weight_amax_scope(self, kind: WeightKind) -> AmaxScope:
        return AmaxScope.TENSOR if WeightKind.parse(kind) is WeightKind.DENSE else AmaxScope.GROUP

    # Derivation in lp_lightning.formats.recipe: format_max 15 tops the 3-bit band (≈ 31.5 dB),
    # 224 the 2-bit band (≈ 25.5 dB); a GEMM of two operands adds their noise powers.
    sqnr_table = {
        # key: (measured dB with seed 0, floor dB = measured − 2 dB rounded down to 0.5 dB)
        ("hif8_15", "gaussian", "quantize"): (31.55, 29.5),
        ("hif8_15", "student_t3", "quantize"): (31.48, 29.0),
        ("hif8_15", "outliers", "quantize"): (31.47, 29.0),
        ("hif8_15", "outliers_bulk", "quantize"): (26.60, 24.5),
        ("hif8_224", "gaussian", "quantize"): (25.62, 23.5),
        ("hif8_224", "student_t3", "quantize"): (28.84, 26.5),
        ("hif8_224", "outliers", "quantize"): (25.49, 23.0),
        ("hif8_224", "outliers_bulk", "quantize"): (31.52, 29.5),
        ("hif8", "gaussian", "fprop"): (28.57, 26.5),
        ("hif8", "gaussian", "dgrad"): (24.64, 22.5),
        ("hif8", "gaussian", "wgrad"): (24.60, 22.5),
        ("hif8", "student_t3", "fprop"): (28.55, 26.5),
        ("hif8", "student_t3", "dgrad"): (25.63, 23.5),
        ("hif8", "student_t3", "wgrad"): (25.60, 23.5),
        ("hif8", "outliers", "fprop"): (27.96, 25.5),
        ("hif8", "outliers", "dgrad"): (23.99, 21.5),
        ("hif8", "outliers", "wgrad"): (24.10, 22.0),
    }


SPEC = HiF8Spec()
"""The HiF8 format (registered as ``"hif8"``)."""


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
