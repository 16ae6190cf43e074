"""``QuantizedOperand``: one low-precision GEMM input (data + scale + metadata), design spec §7.4.

A ``QuantizedOperand`` is the short-lived thing a GEMM consumes: an activation or gradient
quantized for one matmul, or a view of a persistent low-precision weight. It always carries the
*logical* (untransposed) shape of the tensor it came from; which operand of the GEMM is transposed
is said by the GEMM ``layout`` (``"NN"``/``"NT"``/``"TN"``, see ``lp_lightning.ops``), never by
reshaping the data.

Two formats (requirement R1 (docs/design.md), docs/formats.md "Decisions for recipe v1"):

- ``MXFP8_E4M3``: ``data`` is ``torch.float8_e4m3fn`` and ``scale`` is ``torch.float8_e8m0fnu``,
  one scale per 32-element block (OCP MX v1.0). The block direction is physical:
  ``orientation="row"`` means blocks of 32 along the last dim (1×32), ``"col"`` means blocks of 32
  along dim −2 (32×1). A row operand and a col operand of the same tensor are different bytes.
- ``HIF8``: ``data`` holds HiFloat8 codes as ``torch.uint8`` (``torch_npu.hifloat8`` bytes) and
  ``scale`` is ``torch.float32``: a 0-d per-tensor scale for 1-D/2-D data, one scale per leading
  group ``[E]`` for 3-D grouped weights. The scale does not depend on a block direction, so one
  ``data`` serves both orientations: ``orientation`` is metadata (``with_orientation`` returns a
  view that shares the storage, no requantisation; design spec §7.3).

Scale shapes (``ceil`` = round up, ``nb(d) = ceil(d / 32)``):

=========  ===========  =================  ==============================================
format     orientation  data               scale
=========  ===========  =================  ==============================================
MXFP8      row          ``[..., R, K]``    ``[..., R, nb(K)]``
MXFP8      col          ``[..., M, C]``    ``[..., nb(M), C]``
MXFP8      col+groups   ``[T, C]``         ``[sum_g nb(n_g), C]`` (blocks never cross groups)
HIF8       either       ``[N]``/``[M, K]``  ``[]`` (0-d)
HIF8       either       ``[E, D1, D2]``    ``[E]``
=========  ===========  =================  ==============================================

Tensor-name legend: ``x_MK`` a 2-D tensor of M rows and K columns, ``w_EKN`` a stacked grouped
weight in the GMM view, ``scale_MKb`` a row scale with one entry per 32-block of K, ``group_list_E``
int64 per-group row counts (torch_npu ``group_list_type=1``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import Enum
from typing import Literal, get_args

import torch

from lp_lightning.formats.mxfp8 import BLOCK_SIZE
from lp_lightning.names import LowPrecisionFormat, parse_enum

__all__ = [
    "MX_BLOCK_SIZE",
    "LowPrecisionFormat",
    "Orientation",
    "QuantizationRole",
    "QuantizedOperand",
]

Orientation = Literal["row", "col"]
"""``"row"``: blocks along the last dim (1×32); ``"col"``: blocks along dim −2 (32×1)."""

MX_BLOCK_SIZE: int = BLOCK_SIZE
"""Elements per MX scale block (OCP MX v1.0 §5; docs/formats.md §2); the codec's ``mxfp8.BLOCK_SIZE``."""

_ORIENTATIONS: tuple[str, ...] = get_args(Orientation)


class QuantizationRole(str, Enum):
    """What a quantized tensor is for (design spec §7.1). The role picks dtype and ``format_max``;
    the orientation (row/col) picks the physical layout, and is chosen per GEMM (design spec §8)."""

    INPUT_FWD = "input_fwd"
    """Activation entering a forward GEMM (fprop)."""
    WEIGHT_FWD = "weight_fwd"
    """Weight in a forward GEMM (fprop)."""
    GRAD_OUTPUT = "grad_output"
    """Gradient of the GEMM output, used by dgrad and wgrad."""
    INPUT_BWD = "input_bwd"
    """Saved activation used by wgrad."""
    WEIGHT_BWD = "weight_bwd"
    """Weight used by dgrad."""

    @classmethod
    def parse(cls, value: QuantizationRole | str) -> QuantizationRole:
        """Accept the enum or its string value.

        Raises:
            ValueError: naming the legal roles.
        """
        return parse_enum(cls, value, argument="role", what="a quantization role")


_DATA_DTYPE = {LowPrecisionFormat.MXFP8_E4M3: torch.float8_e4m3fn, LowPrecisionFormat.HIF8: torch.uint8}
_SCALE_DTYPE = {LowPrecisionFormat.MXFP8_E4M3: torch.float8_e8m0fnu, LowPrecisionFormat.HIF8: torch.float32}
_LOGICAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _num_blocks(extent: int) -> int:
    return math.ceil(extent / MX_BLOCK_SIZE)


@dataclass(frozen=True, eq=False)
class QuantizedOperand:
    """One quantized GEMM input (design spec §7.4). Immutable; tensors are shared, never copied.

    Attributes:
        data: Element codes in the tensor's logical shape. MXFP8: ``torch.float8_e4m3fn``;
            HiF8: ``torch.uint8`` HiFloat8 codes.
        scale: Dequantisation scale (multiply ``data`` by it). MXFP8: ``torch.float8_e8m0fnu``,
            one per 32-block along the orientation's dim (shapes in the module docstring); HiF8:
            ``torch.float32``, 0-d for 1-D/2-D data, ``[E]`` for 3-D data.
        logical_dtype: The high-precision dtype the values came from (float32/bfloat16/float16).
        format: ``LowPrecisionFormat`` of ``data``/``scale`` (a legal string is converted).
        orientation: ``"row"`` (blocks along the last dim) or ``"col"`` (blocks along dim −2).
            Physical for MXFP8, metadata only for HiF8.
        group_list: Optional ``int64 [G]`` per-group row counts (torch_npu ``group_list_type=1``)
            the operand was quantized with. Required for an MXFP8 ``"col"`` operand whose blocks
            stop at group boundaries (the wgrad operands of a grouped GEMM), where it also fixes
            the scale's first dim ``sum_g ceil(n_g/32)``; informative otherwise. Default None.
        format_max: HiF8 only: the value the operand's amax was scaled to (15.0 for input/weight
            roles, 224.0 for gradients; docs/formats.md §1.7). None for MXFP8 (default None).

    Raises:
        TypeError: if a field has the wrong type or dtype.
        ValueError: if ``orientation`` is illegal or ``scale``'s shape does not match ``data``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    logical_dtype: torch.dtype
    format: LowPrecisionFormat
    orientation: Orientation
    group_list: torch.Tensor | None = None
    format_max: float | None = None

    def __post_init__(self) -> None:
        fmt = LowPrecisionFormat.parse(self.format)
        object.__setattr__(self, "format", fmt)
        if self.orientation not in _ORIENTATIONS:
            raise ValueError(f"QuantizedOperand: orientation={self.orientation!r}; legal values: 'row', 'col'.")
        for name in ("data", "scale"):
            if not isinstance(getattr(self, name), torch.Tensor):
                got = type(getattr(self, name)).__name__
                raise TypeError(f"QuantizedOperand: {name} must be a torch.Tensor, got {got}.")
        if self.data.dtype != _DATA_DTYPE[fmt] or self.scale.dtype != _SCALE_DTYPE[fmt]:
            raise TypeError(
                f"QuantizedOperand({fmt.value}): data/scale dtypes must be {_DATA_DTYPE[fmt]}/{_SCALE_DTYPE[fmt]}, "
                f"got {self.data.dtype}/{self.scale.dtype}."
            )
        if self.logical_dtype not in _LOGICAL_DTYPES:
            raise TypeError(
                f"QuantizedOperand: logical_dtype={self.logical_dtype!r}; legal values: float32, bfloat16, float16."
            )
        if self.data.device != self.scale.device:
            raise ValueError(
                f"QuantizedOperand: data is on {self.data.device} but scale is on {self.scale.device}; "
                "keep both on one device."
            )
        if self.group_list is not None:
            gl = self.group_list
            if not isinstance(gl, torch.Tensor) or gl.dtype != torch.int64 or gl.dim() != 1:
                got = f"{gl.dtype} {tuple(gl.shape)}" if isinstance(gl, torch.Tensor) else type(gl).__name__
                raise TypeError(
                    f"QuantizedOperand: group_list must be a 1-D torch.int64 tensor of per-group row counts, got {got}."
                )
        if fmt is LowPrecisionFormat.MXFP8_E4M3:
            if self.format_max is not None:
                raise ValueError("QuantizedOperand(mxfp8_e4m3): format_max is a HiF8 field; leave it None.")
            self._check_mx_shapes()
        else:
            if self.format_max is not None and not (isinstance(self.format_max, float) and self.format_max > 0):
                raise ValueError(
                    f"QuantizedOperand(hif8): format_max must be a positive float, got {self.format_max!r}."
                )
            self._check_hif8_shapes()

    def _check_mx_shapes(self) -> None:
        shape, scale_shape = tuple(self.data.shape), tuple(self.scale.shape)
        if self.orientation == "row":
            if len(shape) < 1:
                raise ValueError("QuantizedOperand(mxfp8_e4m3, row): data must have at least 1 dim, got a 0-d tensor.")
            expected = shape[:-1] + (_num_blocks(shape[-1]),)
        elif len(shape) < 2:
            raise ValueError(f"QuantizedOperand(mxfp8_e4m3, col): data must have at least 2 dims, got shape {shape}.")
        elif self.group_list is not None:
            if len(shape) != 2 or len(scale_shape) != 2 or scale_shape[1] != shape[1]:
                raise ValueError(
                    f"QuantizedOperand(mxfp8_e4m3, col, grouped): data must be [T, C] and scale "
                    f"[sum_g ceil(n_g/32), C]; got data {shape}, scale {scale_shape}."
                )
            if self.group_list.device.type == "cpu":  # host counts: check without a device sync
                counts = self.group_list.tolist()
                rows, blocks = sum(counts), sum(_num_blocks(c) for c in counts)
                if rows != shape[0] or blocks != scale_shape[0] or min(counts, default=0) < 0:
                    raise ValueError(
                        f"QuantizedOperand(mxfp8_e4m3, col, grouped): group_list {counts} needs data with "
                        f"{rows} rows and scale with sum_g ceil(n_g/32) = {blocks} rows; got data {shape}, "
                        f"scale {scale_shape}."
                    )
            return
        else:
            expected = shape[:-2] + (_num_blocks(shape[-2]), shape[-1])
        if scale_shape != expected:
            raise ValueError(
                f"QuantizedOperand(mxfp8_e4m3, {self.orientation}): data {shape} needs scale shape {expected} "
                f"(one E8M0 per {MX_BLOCK_SIZE}-block along dim {-1 if self.orientation == 'row' else -2}), "
                f"got {scale_shape}."
            )

    def _check_hif8_shapes(self) -> None:
        shape, scale_shape = tuple(self.data.shape), tuple(self.scale.shape)
        if len(shape) in (1, 2):
            expected: tuple[int, ...] = ()
        elif len(shape) == 3:
            expected = (shape[0],)
        else:
            raise ValueError(
                f"QuantizedOperand(hif8): data must be 1-D, 2-D (per-tensor scale) or 3-D (per-group scale), "
                f"got shape {shape}."
            )
        if scale_shape != expected:
            raise ValueError(f"QuantizedOperand(hif8): data {shape} needs scale shape {expected}, got {scale_shape}.")

    @property
    def shape(self) -> torch.Size:
        """Logical shape of the quantized tensor (= ``data.shape``)."""
        return self.data.shape

    @property
    def device(self) -> torch.device:
        """Device of ``data`` and ``scale``."""
        return self.data.device

    def with_orientation(self, orientation: Orientation) -> QuantizedOperand:
        """The same quantized values described for the other GEMM direction (HiF8 only).

        HiF8's scale is per tensor (or per leading group), so both orientations share ``data`` and
        ``scale`` (design spec §7.3): the result is a new descriptor over the same storage.

        Args:
            orientation: ``"row"`` or ``"col"``.

        Returns:
            ``self`` if the orientation is unchanged, else a new operand sharing the tensors.

        Raises:
            ValueError: for MXFP8, whose row and col blocks are different bytes — quantize the
                source with the other orientation (or take the weight's other copy) instead.
        """
        if orientation not in _ORIENTATIONS:
            raise ValueError(f"with_orientation: orientation={orientation!r}; legal values: 'row', 'col'.")
        if orientation == self.orientation:
            return self
        if self.format is LowPrecisionFormat.MXFP8_E4M3:
            raise ValueError(
                f"with_orientation: an MXFP8 {self.orientation} operand cannot serve as {orientation}: the "
                f"32-element blocks run along a different dim. Quantize the high-precision tensor with "
                f"orientation={orientation!r} (or use the weight's {orientation} copy)."
            )
        return dataclasses.replace(self, orientation=orientation)

    def dequantize(self, output_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Reconstruct the values the operand represents: ``data * scale`` broadcast per block/group.

        MXFP8: an E4M3 value times a power-of-two E8M0 scale is exact in FP32 (NaN for scale
        code 0xFF). HiF8: the decoded code (≤ 4 significant bits) times the FP32 scale is one FP32
        rounding (relative error ≤ 2^-24) — the GEMMs avoid it by applying the scale after the
        FP32 matmul of the decoded codes, as the hardware does.

        Args:
            output_dtype: Floating dtype of the result (default float32).

        Returns:
            Tensor of ``output_dtype`` with ``data``'s shape on ``data``'s device.

        Raises:
            TypeError: if ``output_dtype`` is not a floating dtype.
        """
        if not isinstance(output_dtype, torch.dtype) or not output_dtype.is_floating_point:
            raise TypeError(f"dequantize: output_dtype must be a floating torch.dtype, got {output_dtype!r}.")
        if self.format is LowPrecisionFormat.MXFP8_E4M3:
            from lp_lightning.formats import mxfp8

            if self.orientation == "col" and self.group_list is not None:
                values = mxfp8.dequantize_grouped(self.data, self.scale, self.group_list, orientation="col")
            else:
                values = mxfp8.dequantize(self.data, self.scale, orientation=self.orientation)
        else:
            from lp_lightning.formats import hif8

            scale = self.scale.reshape(-1, 1, 1) if self.data.dim() == 3 else self.scale
            values = hif8.decode(self.data, torch.float32) * scale
        return values.to(output_dtype)  # FP32 → FP64 is exact; to BF16/FP16 one rounding

    def __repr__(self) -> str:
        extra = ""
        if self.group_list is not None:
            extra += f", groups={self.group_list.numel()}"
        if self.format_max is not None:
            extra += f", format_max={self.format_max}"
        return (
            f"QuantizedOperand({self.format.value}, {self.orientation}, shape={tuple(self.data.shape)}, "
            f"scale={tuple(self.scale.shape)}, logical_dtype={self.logical_dtype}, device={self.device}{extra})"
        )
