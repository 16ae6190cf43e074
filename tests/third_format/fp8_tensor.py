"""A third, test-only low-precision format: FP8 E4M3 with FP32 per-tensor current scaling.

What this module proves: a new format is *one package* — its ``FormatSpec``, its quantizer, its
v1 recipe and one :func:`~lp_lightning.formats.registry.register_format` call, all in this file —
and the product (operand, op backends, autograd functions, persistent weights, refresh, FSDP2
gather extension) runs it with **no change to any file outside ``tests/third_format/``**. The
tests next to it (``test_third_format.py``) exercise every layer with it.

Format ``fp8_e4m3_tensor`` (scaling ``current``, recipe ``fp8_e4m3_tensor_current``, no
``--precision`` value: the configuration layer keeps offering exactly ``mxfp8_e4m3`` and
``hif8``):

- **Operands.** ``data`` is ``torch.float8_e4m3fn`` in the tensor's logical shape; ``scale`` is
  one FP32 0-d value for *every* data rank — 1-D, 2-D and also a 3-D grouped weight ``[E, K, N]``
  (one scale per tensor, unlike HiF8's per-expert ``[E]``). The scale does not depend on a block
  direction, so ``orientation`` is metadata (``physical_orientation = False``): one ``data``
  serves both GEMM directions and ``with_orientation`` shares the storage.
- **Quantize** (portable codec, the bit-exact reference). ``amax = max |x|`` in FP32 (NaN
  propagates; an empty tensor gives 0); ``scale = amax / 448`` in FP32 when amax is finite and the
  quotient is > 0, else ``1.0``; ``data = cast_e4m3(clamp(x32 / scale, -448, 448))`` with
  round-to-nearest-even (subnormals down to 2^-9 kept, smaller values flush to ±0).
  *Saturation (decision).* E4M3fn has no infinity and the cast's overflow behaviour is not a
  stable contract (torch 2.13's CPU cast saturates, even ±inf → ±448; ``ml_dtypes``, older torch
  and the OCP "non-saturating" mode give NaN), so the codec clamps to ±448 *before* the cast:
  finite values beyond ±448·scale (only reachable with an explicit ``amax`` smaller than the
  tensor's, or next to a ±inf whose non-finite amax fell back to scale 1.0) and ±inf become
  ±448; NaN stays NaN (``clamp`` propagates it; code 0x7F/0xFF).
- **Numerics.** ``dequantize = data.float() * scale`` (one FP32 rounding). The exact GEMM
  emulation consumes ``gemm_factors = (data.float(), scale)``: E4M3 values (4 significant bits)
  are exact in FP32, the FP32 matmul accumulates them, and the product of the two operands'
  scales multiplies the FP32 result — the order of a per-tensor-scaled FP8 GEMM
  (``out = (Σ a·b) · scale_a · scale_b``).
- **Weights.** One scale per tensor for both kinds, so ``weight_amax_scope`` is
  ``AmaxScope.TENSOR`` for dense *and* grouped weights: the generic refresh MAX-reduces the local
  amax over the FSDP shard group for every weight of this format, and the gather extension
  checks that every rank sent the same 0-d scale. No dim-0 shard rule (any split is legal).
- **Recipe.** One quantizer, ``format_max = 448.0`` (amax → the top of E4M3's range), serves all
  five roles: gradients get no extra headroom (E4M3's 15 binades of normals below 448 already
  cover small gradients; the per-tensor amax follows the tensor).

Importing this module registers the format for the rest of the process (the registry has no
unregister). It has no ``--precision`` value, so the config layer and the merged product SQNR
tables (``lp_lightning.formats.recipe.SQNR_FLOORS_DB``) do not see it; its floors are its spec's
``sqnr_table``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lp_lightning.formats.operand import QuantizationRole, QuantizedOperand
from lp_lightning.formats.quantizer import check_quantize_args
from lp_lightning.formats.recipe import LowPrecisionRecipe
from lp_lightning.formats.registry import FormatEntry, register_format
from lp_lightning.formats.spec import AmaxScope, FormatSpec, Orientation, WeightKind

__all__ = ["E4M3_MAX", "ENTRY", "FP8_RECIPE", "SPEC", "Fp8TensorQuantizer", "Fp8TensorSpec"]

E4M3_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value (1.75 · 2^8, code 0x7E)."""


class Fp8TensorSpec(FormatSpec):
    """FP8 E4M3 with one FP32 current-scaling scale per tensor (module docstring)."""

    name = "fp8_e4m3_tensor"
    label = "FP8-E4M3/tensor"
    scaling = "current"
    data_dtype = torch.float8_e4m3fn
    scale_dtype = torch.float32
    physical_orientation = False
    uses_format_max = True

    def scale_shape(
        self, data_shape: tuple[int, ...], orientation: Orientation, group_counts: list[int] | None = None
    ) -> tuple[int, ...]:
        shape = tuple(int(d) for d in data_shape)
        if len(shape) in (1, 2, 3):
            return ()  # one scale per tensor, also for a 3-D grouped weight
        raise ValueError(f"QuantizedOperand(fp8_e4m3_tensor): data must be 1-D, 2-D or 3-D, got shape {shape}.")

    def dequantize(self, operand: QuantizedOperand) -> torch.Tensor:
        return operand.data.to(torch.float32) * operand.scale

    def gemm_factors(self, operand: QuantizedOperand) -> tuple[torch.Tensor, torch.Tensor]:
        return operand.data.to(torch.float32), operand.scale

    @property
    def recipe(self) -> LowPrecisionRecipe:
        return FP8_RECIPE

    def weight_amax_scope(self, kind: WeightKind) -> AmaxScope:
        WeightKind.parse(kind)  # validates
        return AmaxScope.TENSOR  # dense and grouped: one scale per tensor → MAX over the shard group

    # Derivation (the one of lp_lightning.formats.recipe for m = 3 mantissa bits): amax ↦ 448 =
    # 1.75·2^8 tops E4M3's range; a Gaussian then has σ ≈ 448 / 4.5 ≈ 100 and practically all its
    # power in normal binades (≥ 2^-6), each with 3 mantissa bits: SQNR ≈ 10·log10(12/ε²) +
    # 10·log10(E[μ²]) ≈ 31.5 dB with ε = 2^-3. Unlike HiF8 (tapered precision), E4M3 keeps 3 bits in
    # all 15 normal binades, so heavy tails and 0.1 % outliers ×100 (bulk σ ↦ ≈ 1, still ≫ 2^-6)
    # cost the bulk nothing: ``outliers_bulk`` measures 31.5 dB (HiF8-15 drops to 26.6 dB there).
    # ``outliers`` (all elements) depends on the 65 ×100 values, which carry ≈ 90 % of the power:
    # its score is set by where their few significands fall (30.9–32.6 dB over seeds 0–3; the other
    # rows move < 0.2 dB).
    # A GEMM of two such operands adds the two noise powers: ≈ 31.5 − 3 = 28.5 dB.
    # Values measured by test_third_format.py (seed 0, the conventions of formats.recipe:
    # quantize on [256, 256]; GEMMs x[256, 512]·W[384, 512]ᵀ, dy[256, 384]·W, dy[256, 384]ᵀ·x).
    sqnr_table = {
        # key: (measured dB with seed 0, floor dB = measured − 2 dB rounded down to 0.5 dB)
        ("fp8_tensor", "gaussian", "quantize"): (31.52, 29.5),
        ("fp8_tensor", "student_t3", "quantize"): (31.88, 29.5),
        ("fp8_tensor", "outliers", "quantize"): (32.57, 30.5),
        ("fp8_tensor", "outliers_bulk", "quantize"): (31.53, 29.5),
        ("fp8_tensor", "gaussian", "fprop"): (28.53, 26.5),
        ("fp8_tensor", "gaussian", "dgrad"): (28.49, 26.0),
        ("fp8_tensor", "gaussian", "wgrad"): (28.50, 26.5),
    }


SPEC = Fp8TensorSpec()
"""The format (registered as ``"fp8_e4m3_tensor"``)."""


@dataclass(frozen=True, slots=True)
class Fp8TensorQuantizer:
    """Per-tensor current-scaling E4M3 quantizer (the ``Quantizer`` protocol; module docstring).

    Attributes:
        format_max: The value amax is scaled to; in ``(0, 448]`` (the recipe uses 448.0).
    """

    format_max: float
    format: ClassVar[Fp8TensorSpec] = SPEC

    def __post_init__(self) -> None:
        value = self.format_max
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value <= E4M3_MAX):
            raise ValueError(f"Fp8TensorQuantizer: format_max={value!r} must be a number in (0, {E4M3_MAX}].")
        object.__setattr__(self, "format_max", float(value))

    @staticmethod
    def compute_amax(tensor: torch.Tensor) -> torch.Tensor:
        """``max |x|`` in FP32 over the whole tensor (0-d for every rank); NaN propagates, empty → 0."""
        x32 = tensor.detach().to(torch.float32)
        if x32.numel() == 0:
            return torch.zeros((), dtype=torch.float32, device=tensor.device)
        return x32.abs().amax()

    def scale_from_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """``amax / format_max`` in FP32 where amax is finite and the quotient > 0, else 1.0."""
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
        """``data = e4m3(clamp(x32 / scale, ±448))`` with one 0-d FP32 ``scale`` (module docstring).

        Args:
            tensor: float32/bfloat16/float16, 1-D to 3-D (a 3-D grouped weight gets one scale too).
            orientation: ``"row"`` or ``"col"``; metadata only.
            group_list: Optional ``int64 [G]`` row counts of a token-sorted 2-D tensor (metadata).
            amax: Optional precomputed 0-d amax (e.g. the MAX over an FSDP shard group).

        Raises:
            TypeError: a bad tensor, ``group_list`` or ``amax``.
            ValueError: an illegal orientation or a tensor that is not 1-D/2-D/3-D.
        """
        check_quantize_args("Fp8TensorQuantizer", tensor, orientation, group_list)
        if tensor.dim() not in (1, 2, 3):
            raise ValueError(
                f"Fp8TensorQuantizer.quantize: tensor must be 1-D, 2-D or 3-D, got shape {tuple(tensor.shape)}."
            )
        if amax is None:
            amax = self.compute_amax(tensor)
        elif not isinstance(amax, torch.Tensor) or amax.dim() != 0:
            got = tuple(amax.shape) if isinstance(amax, torch.Tensor) else type(amax).__name__
            raise TypeError(f"Fp8TensorQuantizer.quantize: amax must be a 0-d tensor (one per tensor), got {got}.")
        scale = self.scale_from_amax(amax.to(tensor.device))
        x32 = tensor.detach().to(torch.float32)
        data = torch.clamp(x32 / scale, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return QuantizedOperand(
            data=data,
            scale=scale,
            logical_dtype=tensor.dtype,
            format=self.format,
            orientation=orientation,
            group_list=group_list,
            format_max=self.format_max,
        )

    def quantize_dual(
        self, tensor: torch.Tensor, *, amax: torch.Tensor | None = None
    ) -> tuple[QuantizedOperand, QuantizedOperand]:
        """``(row, col)`` from one quantisation: the col operand shares the row one's tensors."""
        row = self.quantize(tensor, orientation="row", amax=amax)
        return row, row.with_orientation("col")


FP8_QUANTIZER = Fp8TensorQuantizer(format_max=E4M3_MAX)

FP8_RECIPE = LowPrecisionRecipe(
    name="fp8_e4m3_tensor_current",
    format=SPEC,
    scaling="current",
    quantizers={role: FP8_QUANTIZER for role in QuantizationRole},
)
"""The v1 recipe: one quantizer (amax → 448) for all five roles."""

ENTRY = FormatEntry(
    name=SPEC.name,
    scaling="current",
    recipe="fp8_e4m3_tensor_current",
    precision=None,  # not selectable from the CLI / config: the product offers exactly two formats
    spec=f"{__name__}:SPEC",
)

register_format(ENTRY, SPEC)
