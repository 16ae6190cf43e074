"""The MXFP8 format: ``MXFP8Spec``, ``MXFP8Quantizer`` and the v1 recipe ``mxfp8_e4m3_mx_block``
(design spec §3, §7.1, §7.2, §9.1, §13.3; OCP MX v1.0 §5).

One module, as the three refer to each other: the quantizer's operands carry ``SPEC``, the recipe
holds the quantizer, and ``SPEC.recipe`` is the recipe.

- Operands: ``float8_e4m3fn`` data and ``float8_e8m0fnu`` scales, one per 32-element block along
  the orientation's dim; row and col are different bytes (physical orientation), col blocks of a
  token-sorted operand stop at group ends (``group_list``).
- Numerics: an E4M3 value times a power-of-two scale is exact in FP32, so the exact GEMM
  emulation multiplies fully dequantized operands (scales differ along the contraction).
- Weights: per-block scales, computed locally; FSDP2's shards must hold whole pairs of blocks:
  dim-0 shards of 32-row col blocks, dim-1 (input-dim) shards of 32-column row blocks (the shard
  rule below).
- Quantizer: stateless, scale rule RCEIL (docs/formats.md "Decisions"); ``orientation`` picks the
  block direction (row: along the last dim, col: along dim −2), ``group_list`` keeps col blocks
  inside each group (grouped wgrad). One quantizer serves every role. This is the portable codec;
  the ``npu`` op backend runs torch_npu's ``npu_dynamic_mx_quant`` family instead
  (``lp_lightning.ops.npu``), bit-identical by contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lp_lightning.formats.mxfp8 import codec
from lp_lightning.formats.mxfp8.e8m0 import E4M3_MAX
from lp_lightning.formats.operand import QuantizationRole, QuantizedOperand
from lp_lightning.formats.quantizer import check_quantize_args
from lp_lightning.formats.recipe import LowPrecisionRecipe
from lp_lightning.formats.spec import AmaxScope, FormatSpec, Orientation, WeightKind, shard_rows

__all__ = ["MIN_BF16_EXACT_CODE", "MXFP8_E4M3_MX_BLOCK", "MX_ROW_MULTIPLE", "SPEC", "MXFP8Quantizer", "MXFP8Spec"]

MX_ROW_MULTIPLE = 2 * codec.BLOCK_SIZE
"""MXFP8 shard rule (design spec §9.1): local rows a multiple of 64 = two 32-row col blocks, so no
col block crosses a shard boundary and the Ascend scale layout (pairs of blocks) stays aligned."""

MIN_BF16_EXACT_CODE = 3
"""Smallest E8M0 code whose decoded block values are all exact in BF16 (see ``exact_gemm_dtype``)."""


class MXFP8Spec(FormatSpec):
    """MXFP8: E4M3 + E8M0 per 32-element block, RCEIL (module docstring)."""

    name = "mxfp8_e4m3"
    label = "MXFP8"
    scaling = "mx_block"
    data_dtype = torch.float8_e4m3fn
    scale_dtype = torch.float8_e8m0fnu
    physical_orientation = True
    uses_format_max = False
    values_carry_scale = True
    gemm_values_dtype = torch.bfloat16

    def scale_shape(
        self, data_shape: tuple[int, ...], orientation: Orientation, group_counts: list[int] | None = None
    ) -> tuple[int, ...]:
        shape = tuple(int(d) for d in data_shape)
        if group_counts is None or orientation == "row":
            return codec.scale_shape(shape, orientation)
        if len(shape) != 2:
            raise ValueError(f"MXFP8 col+groups: data must be [T, C], got {shape}.")
        rows = sum(group_counts)
        if rows != shape[0] or min(group_counts, default=0) < 0:
            raise ValueError(f"MXFP8 col+groups: group_list {group_counts} needs {rows} data rows, got {shape}.")
        return (sum(-(-c // codec.BLOCK_SIZE) for c in group_counts), shape[1])

    def dequantize(self, operand: QuantizedOperand) -> torch.Tensor:
        if operand.orientation == "col" and operand.group_list is not None:
            return codec.dequantize_grouped(operand.data, operand.scale, operand.group_list, orientation="col")
        return codec.dequantize(operand.data, operand.scale, orientation=operand.orientation)

    def cast_saturated(self, operand: QuantizedOperand, source: torch.Tensor) -> torch.Tensor:
        """E4M3 elements at ±448 whose source exceeds 448 × the block scale (none under the RCEIL scale rule,
        which maps a block's amax to at most 448: a non-zero count is a defect)."""
        at_max = operand.data.to(torch.float32).abs() == E4M3_MAX
        return at_max & (source.to(torch.float32).abs() > self.dequantize(operand).abs())

    def gemm_factors(self, operand: QuantizedOperand, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, None]:
        if operand.values is not None and operand.values.dtype == dtype:  # decoded by the quantise kernel
            return operand.values, None
        if operand.orientation == "col" and operand.group_list is not None:
            values = codec.dequantize_grouped(
                operand.data, operand.scale, operand.group_list, orientation="col", output_dtype=dtype
            )
        else:
            values = codec.dequantize(operand.data, operand.scale, orientation=operand.orientation, output_dtype=dtype)
        return values, None

    def exact_gemm_dtype(self, operand: QuantizedOperand) -> torch.dtype:
        """BF16 unless a block scale is below 2^-124 (code < 3).

        A value is ``e4m3 · 2^(code-127)``: 4 significant bits, BF16 holds 8, and BF16 has FP32's
        exponent range, so it is exact in BF16 unless it falls below BF16's subnormal step 2^-133,
        which needs ``code < 3`` (the smallest E4M3 step is 2^-9). Overflow (code 254) gives ±Inf
        in both. Such tiny scales (block amax below 448·2^-125, or all-zero blocks) take FP32.
        """
        codes = operand.scale.view(torch.uint8)
        if codes.numel() == 0 or int(codes.min()) >= MIN_BF16_EXACT_CODE:
            return torch.bfloat16
        return torch.float32

    @property
    def recipe(self) -> LowPrecisionRecipe:
        return MXFP8_E4M3_MX_BLOCK

    def weight_amax_scope(self, kind: WeightKind) -> AmaxScope:
        return AmaxScope.BLOCK

    def shard_rule_violation(
        self, kind: WeightKind, shape: tuple[int, ...], world_size: int, dim: int = 0
    ) -> str | None:
        """The MXFP8 shard rule of design spec §9.1 for ``Shard(dim)``, or ``None`` when it holds.

        ``dim=0``, dense ``[M, K]``: every rank's ``M_local % 64 == 0``; grouped ``[E, D1, D2]``:
        every rank's ``(E_local * D1) % 64 == 0``. ``dim=1``, dense only (the input dimension,
        docs/architecture.md "Placements"): ``K % W == 0`` (FSDP2 shards dims other than 0 evenly)
        and ``K_local % 64 == 0``, so every row block and every pair of them stays on one rank; col
        blocks run along ``M``, which every rank holds whole. Empty shards satisfy the dim-0 rules;
        a one-rank group (one process, or the replicated fallback's ``(W, 1)`` mesh) is always legal.
        """
        kind = WeightKind.parse(kind)
        if world_size == 1:
            return None
        if dim == 0:
            rows = shard_rows(shape[0], world_size)
            if kind is WeightKind.DENSE:
                if any(r % MX_ROW_MULTIPLE for r in rows):
                    return (
                        f"MXFP8 2-D rule M_local % {MX_ROW_MULTIPLE} == 0 fails: rows per rank {rows} "
                        f"(dim 0 = {shape[0]} over {world_size} ranks)"
                    )
                return None
            if any((r * shape[1]) % MX_ROW_MULTIPLE for r in rows):
                return (
                    f"MXFP8 3-D rule (E_local * D1) % {MX_ROW_MULTIPLE} == 0 fails: experts per rank {rows}, "
                    f"D1 = {shape[1]} (E = {shape[0]} over {world_size} ranks)"
                )
            return None
        if kind is not WeightKind.DENSE or dim != 1:
            return f"MXFP8 {kind.value} weights shard along dim 0{' or 1' if kind is WeightKind.DENSE else ''} only"
        cols = shape[1]
        if cols % world_size:
            return f"Shard(1) needs K % W == 0 (FSDP2 shards dim 1 evenly): K = {cols} over {world_size} ranks"
        if (cols // world_size) % MX_ROW_MULTIPLE:
            return (
                f"MXFP8 Shard(1) rule K_local % {MX_ROW_MULTIPLE} == 0 fails: K_local = {cols // world_size} "
                f"(K = {cols} over {world_size} ranks)"
            )
        return None

    # Derivation in lp_lightning.formats.recipe: every value keeps 3 mantissa bits (≈ 31.5 dB per
    # quantisation, ≈ 28.5 dB per GEMM of two quantized operands), on every input distribution.
    sqnr_table = {
        # key: (measured dB with seed 0, floor dB = measured − 2 dB rounded down to 0.5 dB)
        ("mxfp8", "gaussian", "quantize"): (31.52, 29.5),
        ("mxfp8", "student_t3", "quantize"): (31.34, 29.0),
        ("mxfp8", "outliers", "quantize"): (31.62, 29.5),
        ("mxfp8", "outliers_bulk", "quantize"): (31.52, 29.5),
        ("mxfp8", "gaussian", "fprop"): (28.55, 26.5),
        ("mxfp8", "gaussian", "dgrad"): (28.51, 26.5),
        ("mxfp8", "gaussian", "wgrad"): (28.50, 26.5),
        ("mxfp8", "student_t3", "fprop"): (28.54, 26.5),
        ("mxfp8", "student_t3", "dgrad"): (28.53, 26.5),
        ("mxfp8", "student_t3", "wgrad"): (28.48, 26.0),
        ("mxfp8", "outliers", "fprop"): (28.39, 26.0),
        ("mxfp8", "outliers", "dgrad"): (29.14, 27.0),
        ("mxfp8", "outliers", "wgrad"): (29.03, 27.0),
    }


SPEC = MXFP8Spec()
"""The MXFP8 format (registered as ``"mxfp8_e4m3"``)."""


def _no_amax(who: str, amax: object) -> None:
    if amax is not None:
        raise ValueError(f"{who}: MXFP8 computes one scale per 32-block from the block itself; amax must be None.")


@dataclass(frozen=True, slots=True)
class MXFP8Quantizer:
    """Stateless MXFP8 (E4M3 + E8M0, 32-element blocks, RCEIL) quantizer; one serves every role."""

    format: ClassVar[MXFP8Spec] = SPEC

    def quantize(
        self,
        tensor: torch.Tensor,
        *,
        orientation: Orientation,
        group_list: torch.Tensor | None = None,
        amax: torch.Tensor | None = None,
        values_dtype: torch.dtype | None = None,
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
            amax: Must be None (block scales come from each block).
            values_dtype: ``torch.bfloat16`` (``SPEC.gemm_values_dtype``) to also attach the decoded
                values as ``QuantizedOperand.values`` where the cast produces them in the same pass:
                row blocks (emulation; docs/performance.md). Col operands get none (a second pass
                costs what the GEMM's own decode costs). Default None.

        Returns:
            ``QuantizedOperand`` with ``float8_e4m3fn`` data (same shape as ``tensor``) and
            ``float8_e8m0fnu`` scale (shapes in ``lp_lightning.formats.operand``).

        Raises:
            TypeError: for a non-tensor, a non-float input or a malformed ``group_list``.
            ValueError: for an illegal orientation, too few dims, or an ``amax``.
        """
        check_quantize_args("MXFP8Quantizer", tensor, orientation, group_list)
        _no_amax("MXFP8Quantizer.quantize", amax)
        if tensor.dim() < (1 if orientation == "row" else 2):
            raise ValueError(
                f"MXFP8Quantizer.quantize: orientation={orientation!r} needs a tensor with at least "
                f"{1 if orientation == 'row' else 2} dims, got shape {tuple(tensor.shape)}."
            )
        values = None
        if orientation == "col" and group_list is not None:
            data, scale = codec.quantize_grouped(tensor, group_list, orientation="col")
        elif orientation == "row" and values_dtype is not None:
            data, scale, values = codec.quantize_with_values(tensor, orientation="row", values_dtype=values_dtype)
        else:
            data, scale = codec.quantize(tensor, orientation=orientation)
        return QuantizedOperand(
            data=data,
            scale=scale,
            logical_dtype=tensor.dtype,
            format=self.format,
            orientation=orientation,
            group_list=group_list,
            values=values,
        )

    def quantize_dual(
        self, tensor: torch.Tensor, *, amax: torch.Tensor | None = None
    ) -> tuple[QuantizedOperand, QuantizedOperand]:
        """Quantize once into both orientations (a persistent weight keeps both, design spec §7.2).

        Bit-identical to ``quantize(tensor, orientation="row")`` and ``(..., "col")``.

        Args:
            tensor: float32/bfloat16/float16, ≥ 2-D (e.g. ``w_NK`` or ``w_EKN``).
            amax: Must be None.

        Returns:
            ``(row_operand, col_operand)``.

        Raises:
            TypeError, ValueError: as ``quantize``.
        """
        check_quantize_args("MXFP8Quantizer", tensor, "col", None)
        _no_amax("MXFP8Quantizer.quantize_dual", amax)
        if tensor.dim() < 2:
            raise ValueError(
                f"MXFP8Quantizer.quantize_dual: needs a tensor with at least 2 dims, got shape {tuple(tensor.shape)}."
            )
        (row_data, row_scale), (col_data, col_scale) = codec.quantize_dual(tensor)
        return self.operands_from_dual(tensor.dtype, (row_data, row_scale), (col_data, col_scale))

    def operands_from_dual(
        self,
        logical_dtype: torch.dtype,
        row: tuple[torch.Tensor, torch.Tensor],
        col: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[QuantizedOperand, QuantizedOperand]:
        """Wrap ``(data, scale)`` pairs of both orientations (from the codec or a device kernel)."""
        make = lambda pair, o: QuantizedOperand(  # noqa: E731
            data=pair[0], scale=pair[1], logical_dtype=logical_dtype, format=self.format, orientation=o
        )
        return make(row, "row"), make(col, "col")

    def compute_amax(self, tensor: torch.Tensor) -> torch.Tensor:
        """Not defined for MXFP8 (every 32-block has its own scale).

        Raises:
            TypeError: always.
        """
        raise TypeError("MXFP8Quantizer has no tensor amax: every 32-element block computes its own E8M0 scale.")


_MX_QUANTIZER = MXFP8Quantizer()

MXFP8_E4M3_MX_BLOCK = LowPrecisionRecipe(
    name="mxfp8_e4m3_mx_block",
    format=SPEC,
    scaling="mx_block",
    quantizers={role: _MX_QUANTIZER for role in QuantizationRole},
)
"""MXFP8 recipe v1: E4M3 + E8M0 per 32-block, RCEIL, one stateless quantizer for every role."""
