"""Quantizers: high-precision tensor → ``QuantizedOperand`` (design spec §7, §13.3; requirement R1 (docs/design.md)–R2).

A quantizer is immutable and holds no running state: everything it needs comes from the tensor
it is given (MX block amax, HiF8 current amax). It never traverses a model, runs a collective or
touches an optimizer (design spec §13.3).

- ``MXFP8Quantizer`` — stateless. E4M3 elements, one E8M0 scale per 32-element block, scale rule
  RCEIL (docs/formats.md "Decisions"); ``orientation`` picks the block direction (row: along the last
  dim, col: along dim −2), ``group_list`` keeps col blocks inside each group (grouped wgrad).
- ``HiF8Quantizer(format_max)`` — current scaling (docs/formats.md "Decisions", §1.7):
  ``scale = amax / format_max`` in FP32 when amax is finite and > 0, else 1.0;
  ``data = hif8.encode(x / scale)`` with ``x / scale`` computed in FP32 (the input is converted
  to FP32 first, then divided — a division, not a multiply by a rounded reciprocal, as the NPU's
  DynamicQuant formula ``y = round(x / scale)``, ops-nn aclnnDynamicQuantV4.md). The scale is one
  0-d value for 1-D/2-D tensors and one per leading group ``[E]`` for 3-D grouped weights. One
  ``data`` serves both orientations: ``orientation`` is recorded as metadata only.

Where the quantize runs: on the ``npu`` op backend (see ``lp_lightning.ops.resolve_backend``) the
MXFP8 quantizer calls torch_npu's ``npu_dynamic_mx_quant`` family with ``scale_alg=1`` (RCEIL);
everywhere else — and for HiF8 on every backend — the portable torch codecs in
``lp_lightning.formats.mxfp8`` / ``hif8`` produce the bits (HiF8 stays portable because
``npu_dynamic_quant``'s rounding, overflow and zero-amax behaviour are open questions 2 and 4 of
docs/formats.md; the portable encoder is bit-exact to the binding decision on any device).

Tensor-name legend: ``x`` the input (any floating dtype), ``x32`` its FP32 copy, ``amax`` /
``amax_E`` per-tensor / per-group max |x|, ``scale`` / ``scale_E`` the FP32 scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch

from lp_lightning.formats import hif8
from lp_lightning.formats.operand import LowPrecisionFormat, Orientation, QuantizedOperand

__all__ = ["HiF8Quantizer", "MXFP8Quantizer", "Quantizer"]

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@runtime_checkable
class Quantizer(Protocol):
    """How one role's tensors become a ``QuantizedOperand`` (design spec §13.3)."""

    format: LowPrecisionFormat

    def quantize(
        self,
        tensor: torch.Tensor,
        *,
        orientation: Orientation,
        group_list: torch.Tensor | None = None,
    ) -> QuantizedOperand:
        """Quantize ``tensor`` for one GEMM direction.

        Args:
            tensor: High-precision tensor (float32/bfloat16/float16).
            orientation: ``"row"`` or ``"col"`` (the GEMM contract of design spec §8 picks it).
            group_list: Optional ``int64 [G]`` per-group row counts of a token-sorted 2-D tensor.

        Returns:
            The quantized operand.
        """
        ...


def _check_common(who: str, tensor: torch.Tensor, orientation: str, group_list: torch.Tensor | None) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{who}.quantize: tensor must be a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.dtype not in _INPUT_DTYPES:
        raise TypeError(
            f"{who}.quantize: tensor dtype {tensor.dtype} is not a high-precision dtype; "
            "legal values: float32, bfloat16, float16."
        )
    if orientation not in ("row", "col"):
        raise ValueError(f"{who}.quantize: orientation={orientation!r}; legal values: 'row', 'col'.")
    if group_list is not None:
        if not isinstance(group_list, torch.Tensor) or group_list.dtype != torch.int64 or group_list.dim() != 1:
            got = (
                f"{group_list.dtype} {tuple(group_list.shape)}"
                if isinstance(group_list, torch.Tensor)
                else type(group_list).__name__
            )
            raise TypeError(f"{who}.quantize: group_list must be a 1-D torch.int64 tensor of row counts, got {got}.")
        if tensor.dim() != 2:
            raise ValueError(
                f"{who}.quantize: group_list applies to a token-sorted 2-D tensor [T, C], got shape "
                f"{tuple(tensor.shape)}."
            )


def _on_npu_backend(fmt: LowPrecisionFormat, tensor: torch.Tensor) -> bool:
    """Whether the op backend in force for ``tensor`` is ``npu`` (import kept local: ops sits below)."""
    from lp_lightning.ops import resolve_backend

    return resolve_backend(fmt, tensor.device) == "npu"


@dataclass(frozen=True, slots=True)
class MXFP8Quantizer:
    """Stateless MXFP8 (E4M3 + E8M0, 32-element blocks, RCEIL) quantizer; one serves every role."""

    format: ClassVar[LowPrecisionFormat] = LowPrecisionFormat.MXFP8_E4M3

    def quantize(
        self,
        tensor: torch.Tensor,
        *,
        orientation: Orientation,
        group_list: torch.Tensor | None = None,
    ) -> QuantizedOperand:
        """Quantize with 32-element blocks along the orientation's dim.

        Args:
            tensor: float32/bfloat16/float16, ≥ 1-D for ``"row"`` (blocks along the last dim),
                ≥ 2-D for ``"col"`` (blocks along dim −2). E.g. an activation ``x_MK``, a dense
                weight ``w_NK``, a grouped weight ``w_EKN``.
            orientation: ``"row"`` or ``"col"``.
            group_list: For a token-sorted 2-D ``[T, C]`` tensor, ``int64 [G]`` per-group row
                counts. With ``"col"`` the blocks restart at every group boundary (each group is
                padded logically to a multiple of 32 rows) so the grouped wgrad never mixes two
                experts in one scale; the scale is ``[sum_g ceil(n_g/32), C]``. With ``"row"``
                blocks never cross rows, so the layout is the plain row one; the list is kept as
                metadata. Default None.

        Returns:
            ``QuantizedOperand`` with ``float8_e4m3fn`` data (same shape as ``tensor``) and
            ``float8_e8m0fnu`` scale (shapes in ``lp_lightning.formats.operand``).

        Raises:
            TypeError: for a non-tensor, a non-float input or a malformed ``group_list``.
            ValueError: for an illegal orientation or too few dims.
        """
        _check_common("MXFP8Quantizer", tensor, orientation, group_list)
        if tensor.dim() < (1 if orientation == "row" else 2):
            raise ValueError(
                f"MXFP8Quantizer.quantize: orientation={orientation!r} needs a tensor with at least "
                f"{1 if orientation == 'row' else 2} dims, got shape {tuple(tensor.shape)}."
            )
        grouped_col = orientation == "col" and group_list is not None
        if _on_npu_backend(self.format, tensor):
            from lp_lightning.ops import npu as npu_ops

            if grouped_col:
                data, scale = npu_ops.mx_quantize_grouped_col(tensor, group_list)
            else:
                data, scale = npu_ops.mx_quantize(tensor, orientation=orientation)
        else:
            from lp_lightning.formats import mxfp8

            if grouped_col:
                data, scale = mxfp8.quantize_grouped(tensor, group_list, orientation="col")
            else:
                data, scale = mxfp8.quantize(tensor, orientation=orientation)
        return QuantizedOperand(
            data=data,
            scale=scale,
            logical_dtype=tensor.dtype,
            format=self.format,
            orientation=orientation,
            group_list=group_list,
        )

    def quantize_dual(self, tensor: torch.Tensor) -> tuple[QuantizedOperand, QuantizedOperand]:
        """Quantize once into both orientations (a persistent weight keeps both, design spec §7.2).

        Bit-identical to ``quantize(tensor, orientation="row")`` and ``(..., "col")``; on the npu
        backend it is one ``npu_dynamic_mx_quant_with_dual_axis`` call.

        Args:
            tensor: float32/bfloat16/float16, ≥ 2-D (e.g. ``w_NK`` or ``w_EKN``).

        Returns:
            ``(row_operand, col_operand)``.

        Raises:
            TypeError, ValueError: as ``quantize``.
        """
        _check_common("MXFP8Quantizer", tensor, "col", None)
        if tensor.dim() < 2:
            raise ValueError(
                f"MXFP8Quantizer.quantize_dual: needs a tensor with at least 2 dims, got shape {tuple(tensor.shape)}."
            )
        if _on_npu_backend(self.format, tensor):
            from lp_lightning.ops import npu as npu_ops

            (row_data, row_scale), (col_data, col_scale) = npu_ops.mx_quantize_dual(tensor)
        else:
            from lp_lightning.formats import mxfp8

            (row_data, row_scale), (col_data, col_scale) = mxfp8.quantize_dual(tensor)
        make = lambda d, s, o: QuantizedOperand(  # noqa: E731
            data=d, scale=s, logical_dtype=tensor.dtype, format=self.format, orientation=o
        )
        return make(row_data, row_scale, "row"), make(col_data, col_scale, "col")


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
    format: ClassVar[LowPrecisionFormat] = LowPrecisionFormat.HIF8

    def __post_init__(self) -> None:
        value = self.format_max
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value <= hif8.HIF8_MAX):
            raise ValueError(
                f"HiF8Quantizer: format_max={value!r} must be a number in (0, {hif8.HIF8_MAX}] "
                f"(recipe v1 uses {hif8.FORMAT_MAX_INPUT_WEIGHT} and {hif8.FORMAT_MAX_GRADIENT})."
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
        x32 = tensor.detach().to(torch.float32)
        if tensor.dim() == 3:
            if x32.numel() == 0:
                return torch.zeros(tensor.shape[0], dtype=torch.float32, device=tensor.device)
            return x32.abs().amax(dim=(1, 2))
        if x32.numel() == 0:
            return torch.zeros((), dtype=torch.float32, device=tensor.device)
        return x32.abs().amax()

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

        Returns:
            ``QuantizedOperand`` with ``uint8`` HiF8 codes (``tensor``'s shape), ``float32``
            scale, ``format_max`` recorded.

        Raises:
            TypeError: for a non-tensor, a non-float input or a malformed ``group_list``/``amax``.
            ValueError: for an illegal orientation or a tensor that is not 1-D/2-D/3-D.
        """
        _check_common("HiF8Quantizer", tensor, orientation, group_list)
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
        scale = self.scale_from_amax(amax.to(tensor.device))
        x32 = tensor.detach().to(torch.float32)
        divisor = scale.reshape(-1, 1, 1) if tensor.dim() == 3 else scale
        data = hif8.encode(x32 / divisor)
        return QuantizedOperand(
            data=data,
            scale=scale,
            logical_dtype=tensor.dtype,
            format=self.format,
            orientation=orientation,
            group_list=group_list,
            format_max=self.format_max,
        )

    def quantize_dual(self, tensor: torch.Tensor) -> tuple[QuantizedOperand, QuantizedOperand]:
        """Both orientations from one quantization: the col operand shares the row one's tensors.

        Args:
            tensor: As ``quantize``.

        Returns:
            ``(row_operand, col_operand)`` with ``col.data is row.data``.
        """
        row = self.quantize(tensor, orientation="row")
        return row, row.with_orientation("col")
