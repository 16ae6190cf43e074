"""The MXFP8 ``FormatSpec`` (design spec §3, §7.2, §9.1; OCP MX v1.0 §5).

- Operands: ``float8_e4m3fn`` data and ``float8_e8m0fnu`` scales, one per 32-element block along
  the orientation's dim; row and col are different bytes (physical orientation), col blocks of a
  token-sorted operand stop at group ends (``group_list``).
- Numerics: an E4M3 value times a power-of-two scale is exact in FP32, so the exact GEMM
  emulation multiplies fully dequantized operands (scales differ along the contraction).
- Weights: per-block scales, computed locally; FSDP2's shards must hold whole pairs of blocks:
  dim-0 shards of 32-row col blocks, dim-1 (input-dim) shards of 32-column row blocks (the shard
  rule below).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lp_lightning.formats.mxfp8 import codec
from lp_lightning.formats.spec import AmaxScope, FormatSpec, Orientation, WeightKind, shard_rows

if TYPE_CHECKING:
    from lp_lightning.formats.operand import QuantizedOperand
    from lp_lightning.formats.recipe import LowPrecisionRecipe

__all__ = ["MIN_BF16_EXACT_CODE", "MX_ROW_MULTIPLE", "SPEC", "MXFP8Spec"]

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
        # Imported here: the quantizer module imports this spec: resolved at call time.
        from lp_lightning.formats.mxfp8.quantizer import MXFP8_E4M3_MX_BLOCK

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
