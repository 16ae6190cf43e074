"""``QuantizedOperand``: one low-precision GEMM input (data + scale + metadata), design spec §7.4.

A ``QuantizedOperand`` is the short-lived thing a GEMM consumes: an activation or gradient
quantized for one matmul, or a view of a persistent low-precision weight. It always carries the
*logical* (untransposed) shape of the tensor it came from; which operand of the GEMM is transposed
is said by the GEMM ``layout`` (``"NN"``/``"NT"``/``"TN"``, see ``lp_lightning.ops``), never by
reshaping the data.

Its ``format`` is a :class:`~lp_lightning.formats.spec.FormatSpec`, which fixes the data and
scale dtypes, the scale shape of each data shape and orientation, and whether the orientation is
physical. The two product formats (requirement R1, docs/design.md):

- ``mxfp8_e4m3``: ``data`` is ``torch.float8_e4m3fn`` and ``scale`` is ``torch.float8_e8m0fnu``,
  one scale per 32-element block (OCP MX v1.0). The block direction is physical:
  ``orientation="row"`` means blocks of 32 along the last dim (1×32), ``"col"`` means blocks of 32
  along dim −2 (32×1). A row operand and a col operand of the same tensor are different bytes.
- ``hif8``: ``data`` holds HiFloat8 codes as ``torch.uint8`` (``torch_npu.hifloat8`` bytes) and
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
from dataclasses import dataclass
from enum import Enum

import torch

from lp_lightning.formats.spec import ORIENTATIONS, FormatSpec, Orientation, as_spec
from lp_lightning.names import parse_enum

__all__ = ["Orientation", "QuantizationRole", "QuantizedOperand", "StaleOperandError", "freed_storage"]


class StaleOperandError(RuntimeError):
    """A low-precision operand views memory that was freed: an FSDP2 all-gather buffer after reshard.

    FSDP2 frees a gathered weight's buffers with ``untyped_storage().resize_(0)`` when the layer
    reshards; a ``QuantizedOperand`` taken from that weight (``select``), or a tensor of a post
    all-gather event, still points there. Reading it would read freed memory, so the GEMM entry
    points and ``select`` raise this instead (issue 13, docs/architecture.md "The path of one weight").
    """


def freed_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (non-empty) views a storage too small for it — freed by ``resize_(0)``."""
    if tensor.numel() == 0:
        return False
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.untyped_storage().nbytes() < (tensor.storage_offset() + span) * tensor.element_size()


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


_LOGICAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
        format: The :class:`~lp_lightning.formats.spec.FormatSpec` of ``data``/``scale`` (a
            registered format name is converted).
        orientation: ``"row"`` (blocks along the last dim) or ``"col"`` (blocks along dim −2).
            Physical for block formats (MXFP8), metadata only otherwise (HiF8).
        group_list: Optional ``int64 [G]`` per-group row counts (torch_npu ``group_list_type=1``)
            the operand was quantized with. Required for an MXFP8 ``"col"`` operand whose blocks
            stop at group boundaries (the wgrad operands of a grouped GEMM), where it also fixes
            the scale's first dim ``sum_g ceil(n_g/32)``; informative otherwise. Default None.
        format_max: Current-scaling formats only: the value the operand's amax was scaled to
            (HiF8: 15.0 for input/weight roles, 224.0 for gradients; docs/formats.md §1.7). None for
            block formats (default None).
        values: Emulation only, optional: the operand's ``gemm_factors`` values (data's shape, in
            the format's ``gemm_values_dtype``), written by the quantise kernel that made ``data``
            so that a GEMM consuming the operand at once need not decode it again
            (docs/performance.md). Never saved for backward, gathered or checkpointed; not
            part of the operand's bytes. Default None.

    Raises:
        TypeError: if a field has the wrong type or dtype.
        ValueError: if ``orientation`` is illegal or ``scale``'s shape does not match ``data``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    logical_dtype: torch.dtype
    format: FormatSpec
    orientation: Orientation
    group_list: torch.Tensor | None = None
    format_max: float | None = None
    values: torch.Tensor | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        spec = as_spec(self.format)
        object.__setattr__(self, "format", spec)
        who = f"QuantizedOperand({spec.name}, {self.orientation})"
        if self.orientation not in ORIENTATIONS:
            raise ValueError(f"QuantizedOperand: orientation={self.orientation!r}; legal values: 'row', 'col'.")
        for name in ("data", "scale"):
            if not isinstance(getattr(self, name), torch.Tensor):
                got = type(getattr(self, name)).__name__
                raise TypeError(f"QuantizedOperand: {name} must be a torch.Tensor, got {got}.")
        if self.data.dtype != spec.data_dtype or self.scale.dtype != spec.scale_dtype:
            raise TypeError(
                f"{who}: data/scale dtypes must be {spec.data_dtype}/{spec.scale_dtype}, "
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
        counts = None
        if self.group_list is not None:
            gl = self.group_list
            if not isinstance(gl, torch.Tensor) or gl.dtype != torch.int64 or gl.dim() != 1:
                got = f"{gl.dtype} {tuple(gl.shape)}" if isinstance(gl, torch.Tensor) else type(gl).__name__
                raise TypeError(
                    f"QuantizedOperand: group_list must be a 1-D torch.int64 tensor of per-group row counts, got {got}."
                )
            if gl.device.type == "cpu":  # host counts: checked without a device sync
                counts = gl.tolist()
        if not spec.uses_format_max and self.format_max is not None:
            raise ValueError(f"{who}: format_max is a current-scaling field; leave it None.")
        if self.format_max is not None and not (isinstance(self.format_max, float) and self.format_max > 0):
            raise ValueError(f"{who}: format_max must be a positive float, got {self.format_max!r}.")
        shape, scale_shape = tuple(self.data.shape), tuple(self.scale.shape)
        if self.values is not None and (
            not isinstance(self.values, torch.Tensor) or tuple(self.values.shape) != shape
            or self.values.dtype != spec.gemm_values_dtype
        ):
            got = (self.values.dtype, tuple(self.values.shape)) if isinstance(self.values, torch.Tensor) else self.values
            raise ValueError(f"{who}: values must be a {spec.gemm_values_dtype} tensor of shape {shape}, got {got}.")
        grouped = self.group_list is not None and spec.physical_orientation and self.orientation == "col"
        if grouped and counts is None:  # device counts: the scale's row count is not checked here
            if len(shape) != 2 or len(scale_shape) != 2 or scale_shape[1] != shape[1]:
                raise ValueError(f"{who}, grouped: data must be [T, C] and scale [blocks, C]; got {shape}, {scale_shape}.")
            return
        expected = spec.scale_shape(shape, self.orientation, counts if grouped else None)
        if scale_shape != expected:
            raise ValueError(f"{who}: data {shape} needs scale shape {expected}, got {scale_shape}.")

    def check_alive(self, who: str) -> None:
        """Raise :class:`StaleOperandError` when ``data`` or ``scale`` views freed memory.

        Args:
            who: The caller, named in the message.
        """
        for name, tensor in (("data", self.data), ("scale", self.scale)):
            if freed_storage(tensor):
                raise StaleOperandError(
                    f"{who}: the {self.format.label} operand's {name} {tuple(tensor.shape)} views a freed buffer "
                    f"({tensor.untyped_storage().nbytes()} bytes left): FSDP2 resharded the weight it came from. Use "
                    "select() inside the layer's forward/backward, or clone the operand's tensors before reshard."
                )

    @property
    def shape(self) -> torch.Size:
        """Logical shape of the quantized tensor (= ``data.shape``)."""
        return self.data.shape

    @property
    def device(self) -> torch.device:
        """Device of ``data`` and ``scale``."""
        return self.data.device

    def with_orientation(self, orientation: Orientation) -> QuantizedOperand:
        """The same quantized values described for the other GEMM direction.

        For a format whose orientation is metadata (HiF8: one scale per tensor or leading group),
        both orientations share ``data`` and ``scale`` (design spec §7.3): the result is a new
        descriptor over the same storage.

        Args:
            orientation: ``"row"`` or ``"col"``.

        Returns:
            ``self`` if the orientation is unchanged, else a new operand sharing the tensors.

        Raises:
            ValueError: for a block format (MXFP8), whose row and col blocks are different bytes —
                quantize the source with the other orientation (or take the weight's other copy).
        """
        if orientation not in ORIENTATIONS:
            raise ValueError(f"with_orientation: orientation={orientation!r}; legal values: 'row', 'col'.")
        if orientation == self.orientation:
            return self
        if self.format.physical_orientation:
            raise ValueError(
                f"with_orientation: an {self.format.label} {self.orientation} operand cannot serve as {orientation} (its "
                f"blocks run along another dim). Quantize the high-precision tensor with orientation={orientation!r}."
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
        return self.format.dequantize(self).to(output_dtype)  # FP32 → FP64 is exact; to BF16/FP16 one rounding

    def __repr__(self) -> str:
        extra = ""
        if self.group_list is not None:
            extra += f", groups={self.group_list.numel()}"
        if self.format_max is not None:
            extra += f", format_max={self.format_max}"
        return (
            f"QuantizedOperand({self.format.name}, {self.orientation}, shape={tuple(self.data.shape)}, "
            f"scale={tuple(self.scale.shape)}, logical_dtype={self.logical_dtype}, device={self.device}{extra})"
        )
