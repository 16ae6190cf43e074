"""The HiF8 ``FormatSpec`` (design spec §3, §7.3, §9.2; arXiv 2409.16626, docs/formats.md §1).

- Operands: ``uint8`` HiFloat8 codes (``torch_npu.hifloat8`` bytes) and an FP32 scale, 0-d for
  1-D/2-D data, ``[E]`` for a 3-D grouped weight; the orientation is metadata (one data serves
  both GEMM directions).
- Numerics: a decoded code has at most 4 significant bits, so the exact GEMM emulation multiplies
  the decoded codes in FP32 and applies the product of the two scales to the FP32 result, the
  order of the hardware formula ``out = (Σ x1·x2) · x1Scale · x2Scale`` (aclnnQuantMatmulV5.md).
- Weights: a dense weight has one scale per tensor, so its shards MAX-reduce the amax over the
  FSDP shard group (design spec §9.2); a grouped weight has one scale per expert, local to the
  shard (dim-0 sharding never splits an expert). Any dim-0 split is legal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lp_lightning.formats.hif8 import codec
from lp_lightning.formats.spec import AmaxScope, FormatSpec, Orientation, WeightKind

if TYPE_CHECKING:
    from lp_lightning.formats.operand import QuantizedOperand
    from lp_lightning.formats.recipe import LowPrecisionRecipe

__all__ = ["SPEC", "HiF8Spec"]


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
        # Imported here: the quantizer module imports this spec: resolved at call time.
        from lp_lightning.formats.hif8.quantizer import HIF8_CURRENT

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
