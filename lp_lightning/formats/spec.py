"""The ``FormatSpec`` protocol: everything the layers above need to know about one format.

A format package (``lp_lightning.formats.mxfp8``, ``lp_lightning.formats.hif8``) holds its codec,
its quantizers, its v1 recipe and one ``FormatSpec`` instance ``SPEC``, registered in
:mod:`lp_lightning.formats.registry`. The operand, the GEMM backends, the persistent weight
tensor and the FSDP2/optimizer/DCP lifecycle read the spec's attributes and call its methods;
none of them compares a format with a concrete one (design spec §2: the lifecycle layer knows
only a generic protocol).

What a spec declares (design spec §3, §7, §9):

- **operands**: element and scale dtypes, the scale shape of a data shape and orientation, and
  whether ``orientation`` is *physical* (block scales along one axis, so a row and a col operand
  of one tensor are different bytes, MXFP8) or metadata (one scale per tensor or leading group,
  one data serves both directions, HiF8);
- **numerics**: exact dequantisation, and how an exact GEMM emulation consumes an operand
  (values to multiply in FP32, and a scale applied to the FP32 product, or none);
- **weights**: the amax scope of a persistent weight (per block: local; per tensor: the MAX over
  the FSDP shard group, so every shard quantises with one scale; per leading group: local, dim-0
  shards never split a group) and the dim-0 shard rule (MXFP8's ``M_local % 64``);
- **quality**: the expected SQNR of its quantizers and GEMMs (``sqnr_table``).

Tensor-name legend: ``w_NK`` dense weight, ``w_EKN`` grouped weight in the GMM view.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from enum import Enum
from typing import TYPE_CHECKING, Literal

import torch

from lp_lightning.formats.registry import format_spec
from lp_lightning.names import parse_enum

if TYPE_CHECKING:
    from lp_lightning.formats.operand import QuantizedOperand
    from lp_lightning.formats.recipe import LowPrecisionRecipe

__all__ = ["AmaxScope", "FormatSpec", "Orientation", "WeightKind", "as_spec", "shard_rows"]

Orientation = Literal["row", "col"]
"""``"row"``: blocks along the last dim (1×32); ``"col"``: blocks along dim −2 (32×1)."""

ORIENTATIONS: tuple[Orientation, ...] = ("row", "col")


class WeightKind(str, Enum):
    """How the GEMMs consume a weight (design spec §5, §8)."""

    DENSE = "dense"
    """2-D ``nn.Linear`` weight ``[N, K]``; operands of ``[N, K]``."""
    GROUPED = "grouped"
    """3-D stacked expert weight ``[E, N, K]``; operands of the GMM view ``[E, K, N]``."""

    @classmethod
    def parse(cls, value: WeightKind | str) -> WeightKind:
        """Accept the enum or its string value.

        Raises:
            ValueError: naming the legal values.
        """
        return parse_enum(cls, value, argument="kind", what="a weight kind")

    def gemm_view_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the operands: the parameter's for dense, ``[E, K, N]`` for ``[E, N, K]`` grouped."""
        shape = tuple(shape)
        return shape if self is WeightKind.DENSE else (shape[0], shape[2], shape[1])

    @property
    def fprop_orientation(self) -> Orientation:
        """Weight orientation of fprop (design spec §8): dense ``row``, grouped ``col``."""
        return "row" if self is WeightKind.DENSE else "col"

    @property
    def dgrad_orientation(self) -> Orientation:
        """Weight orientation of dgrad (design spec §8): dense ``col``, grouped ``row``."""
        return "col" if self is WeightKind.DENSE else "row"


class AmaxScope(str, Enum):
    """Where the scale of a persistent weight comes from (see the module docstring)."""

    BLOCK = "block"
    """One scale per block of the data: computed locally, dim-0 shards must hold whole blocks."""
    TENSOR = "tensor"
    """One scale per tensor: a sharded weight MAX-reduces its amax over the FSDP shard group."""
    GROUP = "group"
    """One scale per leading group (expert): local, since dim-0 sharding never splits a group."""


def shard_rows(rows: int, world_size: int) -> list[int]:
    """Rows of dim 0 each rank holds under FSDP2 ``Shard(0)`` (``torch.chunk`` + empty tail ranks).

    Args:
        rows: Size of the parameter's dim 0.
        world_size: FSDP shard-group size.

    Returns:
        ``[L_0, ..., L_{W-1}]`` with ``L_r = clamp(rows - r * ceil(rows / W), 0, ceil(rows / W))``.
    """
    per_rank = math.ceil(rows / world_size) if rows else 0
    return [max(0, min(per_rank, rows - r * per_rank)) for r in range(world_size)]


class FormatSpec(abc.ABC):
    """One low-precision format, as the generic layers see it (module docstring).

    Subclasses set the class attributes and implement the abstract methods; a format package
    exposes one instance as ``SPEC`` and registers it.

    Attributes:
        name: Registry name (``"mxfp8_e4m3"``).
        label: Name in messages (``"MXFP8"``).
        scaling: Scaling algorithm (``"mx_block"``, ``"current"``).
        data_dtype: dtype of ``QuantizedOperand.data``.
        scale_dtype: dtype of ``QuantizedOperand.scale``.
        physical_orientation: Row and col operands are different bytes (block scales along one
            axis); ``False``: one data serves both and ``orientation`` is metadata.
        uses_format_max: Operands record the ``format_max`` their amax was scaled to.
        values_carry_scale: :meth:`gemm_factors` returns no product scale (block formats: the
            scales differ along the contraction and are applied while decoding).
        gemm_values_dtype: The dtype in which the format's quantizers can also return the decoded
            GEMM values (``QuantizedOperand.values``, ``values_dtype=``); None: they cannot.
    """

    name: str
    label: str
    scaling: str
    data_dtype: torch.dtype
    scale_dtype: torch.dtype
    physical_orientation: bool
    uses_format_max: bool
    values_carry_scale: bool = False
    gemm_values_dtype: torch.dtype | None = None

    # -- operands -----------------------------------------------------------------------------
    @abc.abstractmethod
    def scale_shape(
        self, data_shape: tuple[int, ...], orientation: Orientation, group_counts: list[int] | None = None
    ) -> tuple[int, ...]:
        """Scale shape of an operand with ``data_shape``.

        Args:
            data_shape: Logical data shape.
            orientation: ``"row"`` or ``"col"``.
            group_counts: Host per-group row counts of a token-sorted ``[T, C]`` operand quantized
                with ``group_list`` (blocks stop at group ends), else ``None``.

        Raises:
            ValueError: a data shape the format cannot hold, naming the rule.
        """

    @abc.abstractmethod
    def dequantize(self, operand: QuantizedOperand) -> torch.Tensor:
        """The FP32 values the operand represents (exact where the format allows; see the package)."""

    @abc.abstractmethod
    def gemm_factors(
        self, operand: QuantizedOperand, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """How an exact GEMM emulation consumes the operand: ``(values, product_scale)``.

        ``values`` are multiplied exactly as they are; ``product_scale`` (0-d FP32, or ``[E]`` for a
        3-D operand) multiplies the FP32 product, or is ``None`` when ``values`` already carry the
        scale (block formats, whose scales differ along the contraction). ``values`` have ``dtype``:
        FP32 always works; BF16 only where :meth:`exact_gemm_dtype` says the values are exact in it
        (the emulated backend asks for nothing else).
        """

    def cast_saturated(self, operand: QuantizedOperand, source: torch.Tensor) -> torch.Tensor | None:
        """Which elements of ``source`` the cast that made ``operand`` clamped: the stored element is the
        format's largest finite magnitude and ``|source|`` exceeds the value it represents (a value that
        merely rounds up to it does not count).

        Args:
            operand: The operand quantized from ``source`` (same logical shape).
            source: The high-precision tensor.

        Returns:
            A bool tensor of ``source``'s shape, or ``None`` where the format cannot tell (the default).
        """
        return None

    def exact_gemm_dtype(self, operand: QuantizedOperand) -> torch.dtype:
        """The narrowest dtype in which this operand's :meth:`gemm_factors` values are exact.

        ``torch.bfloat16`` lets the emulated backend multiply at BF16 GEMM speed with FP32
        accumulation (docs/design.md "Where it runs"); the default, ``torch.float32``, is always
        exact for the 8-bit formats (at most 4 significant bits per value).
        """
        return torch.float32

    # -- recipe and weights ---------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def recipe(self) -> LowPrecisionRecipe:
        """The format's v1 recipe (role → quantizer)."""

    @abc.abstractmethod
    def weight_amax_scope(self, kind: WeightKind) -> AmaxScope:
        """Where a persistent weight's scale comes from (see :class:`AmaxScope`)."""

    def shard_rule_violation(
        self, kind: WeightKind, shape: tuple[int, ...], world_size: int, dim: int = 0
    ) -> str | None:
        """Why FSDP2 ``Shard(dim)`` of a weight over ``world_size`` ranks breaks the format, or ``None``.

        The default accepts every dim-0 split (per-tensor and per-group scales) and refuses other
        dims (a per-group scale would be split); a one-rank group is always legal.
        """
        if dim == 0 or world_size == 1:
            return None
        return f"{self.name} {WeightKind.parse(kind).value} weights shard only along dim 0"

    # -- quality --------------------------------------------------------------------------------
    sqnr_table: Mapping[tuple[str, str, str], tuple[float, float]] = {}
    """``{(quantizer, distribution, case): (measured dB, floor dB)}`` (see ``formats.recipe``)."""

    def __repr__(self) -> str:
        return f"FormatSpec({self.name!r}, scaling={self.scaling!r})"

    def __eq__(self, other: object) -> bool:
        """A spec equals itself and its registered name (a ``str`` or ``str``-valued Enum member)."""
        if isinstance(other, FormatSpec):
            return other is self
        if isinstance(other, str):
            return getattr(other, "value", other) == self.name  # a str-valued Enum member compares by value
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)

    def __reduce__(self) -> tuple[object, tuple[str]]:  # pickles (and deep-copies) as the registered instance
        return (format_spec, (self.name,))


def as_spec(format: FormatSpec | str) -> FormatSpec:
    """``format`` as a :class:`FormatSpec`: a spec as is, a registered name (or ``str`` Enum) looked up.

    Raises:
        ValueError: an unknown name, listing the registered formats.
    """
    return format if isinstance(format, FormatSpec) else format_spec(format)
