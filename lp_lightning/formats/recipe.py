"""Recipes: the immutable map from ``QuantizationRole`` to ``Quantizer`` (design spec §7.1, §13.3; R2).

Each format package builds its v1 recipe (``lp_lightning.formats.mxfp8.MXFP8_E4M3_MX_BLOCK``,
``lp_lightning.formats.hif8.HIF8_CURRENT``); :func:`recipe_for` finds it through the registry. A
recipe owns every numeric constant of its format; nothing here is user configuration (design spec
§3.2: the values are part of an operator- and accuracy-validated recipe, and a contract change
ships as a new recipe version, never as a different meaning of the same name).

========================  ===========================  ==========================================
recipe                    roles                        quantizer
========================  ===========================  ==========================================
``mxfp8_e4m3_mx_block``   all five                     one stateless ``MXFP8Quantizer``
``hif8_current``          INPUT_FWD, WEIGHT_FWD,       ``HiF8Quantizer(format_max=15.0)``
                          INPUT_BWD, WEIGHT_BWD
``hif8_current``          GRAD_OUTPUT                  ``HiF8Quantizer(format_max=224.0)``
========================  ===========================  ==========================================

Expected quantisation quality (``SQNR_FLOORS_DB``)
--------------------------------------------------

SQNR = 10·log10(Σ ref² / Σ (q − ref)²) in dB (``lp_lightning.evidence.numerics.sqnr_db``). Each
format's ``FormatSpec.sqnr_table`` (``formats/mxfp8/spec.py``, ``formats/hif8/spec.py``; merged for
the product formats in ``SQNR_FLOORS_DB`` / ``SQNR_MEASURED_DB`` below) holds, per quantizer/recipe,
input distribution and case, the value measured on the reference inputs of ``sqnr_reference_input`` (65 536 samples, seed 0; GEMMs
of ``[256, 512] × [512, 384]``) and the floor the tests enforce: the measurement minus 2 dB,
rounded down to 0.5 dB. Over seeds 0–3 the Gaussian and Student-t values move by < 0.3 dB; the
``outliers_bulk`` values by up to 2 dB (they depend on the largest outlier), which the margin covers.

*Derivation (docs/numerics.md §2.1, §3, §9: a mantissa of m bits has ε = 2^-m, unit roundoff u = ε/2).* With
round-to-nearest, a value x = 2^e·μ (μ ∈ [1, 2)) gets an error uniform in ±2^(e−m)/2, of variance
2^(2e)·ε²/12, independent of μ; its signal power is 2^(2e)·μ². Hence SQNR_m = 10·log10(12/ε²) +
10·log10(E[μ²]), between 28.9 dB (all μ = 1) and 34.9 dB (μ → 2) for m = 3, and 32.2 dB for μ
log-uniform (E[μ²] = 1.5/ln 2). A Gaussian puts more of its power at small μ inside each binade and
measures 31.5 dB, the working value for m = 3: **≈ 31.5 dB (m = 3), 25.5 dB (m = 2), 19.5 dB
(m = 1)**, 6.02 dB per mantissa bit.

- **MXFP8 (E4M3, m = 3).** RCEIL puts each block's amax in (224, 448], the top binade; the other
  31 values of a block stay E4M3 normals (≥ 2^-6) unless they are > 2^14 times smaller, so every
  value keeps 3 bits: ≈ 31.5 dB on Gaussian, heavy-tailed and outlier inputs alike (an outlier only
  coarsens its own block). Measured 31.3–31.6 dB.
- **HiF8, format_max = 15 (input/weight).** 15 = 1.875·2^3 tops the 3-bit band [2^-3, 16). A
  Gaussian has amax ≈ 4.5σ, so σ ↦ 3.3 and nearly all its power lies in that band: ≈ 31.5 dB.
  With heavy tails the total SQNR stays ≈ 31.5 dB because the largest values carry the power and
  keep 3 bits — but 0.1 % outliers ×100 push the amax up 100× and the *bulk* down to σ ↦ 0.04,
  into the 2-bit band (|E| 4..7): the bulk measures 26.6 dB (``outliers_bulk``), ≈ 6 dB lower, where
  MXFP8 keeps 31.5 dB. This is the per-tensor-scale weakness design spec §3.1 anticipates.
- **HiF8, format_max = 224 (gradients).** 224 = 1.75·2^7 tops the 2-bit band [16, 256): a Gaussian's
  power sits there (σ ↦ 50): ≈ 25.5 dB, 6 dB under the input/weight roles — the price of ~30 binades
  of headroom for small gradients. Heavy tails scale the bulk down into the 3-bit band and *raise*
  the SQNR (Student-t 28.8 dB, outlier bulk 31.5 dB).
- **GEMMs vs an FP64 product of the unquantized operands.** Each product term carries the relative
  errors of both operands, independent and zero-mean, so the noise powers add:
  SQNR_gemm ≈ −10·log10(10^(−S_left/10) + 10^(−S_right/10)): 31.5 − 3 ≈ 28.5 dB when both operands
  have 3 bits (MXFP8, HiF8 fprop), ≈ 24.6 dB for HiF8 dgrad/wgrad (gradient 25.5 dB × 31.5 dB).
  Random-sign dot products grow signal and noise alike (√k), so k does not enter; FP32
  accumulation (2^-24·√k) and the final BF16 rounding (≈ 55 dB) are negligible. Measured:
  28.4–29.1 dB (MXFP8), 28.0–28.6 dB (HiF8 fprop), 24.0–25.6 dB (HiF8 dgrad/wgrad).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from types import MappingProxyType
from typing import Literal

import torch

from lp_lightning.formats.operand import QuantizationRole
from lp_lightning.formats.quantizer import Quantizer
from lp_lightning.formats.registry import precision_names
from lp_lightning.formats.spec import FormatSpec, as_spec

__all__ = [
    "SQNR_FLOORS_DB",
    "SQNR_MEASURED_DB",
    "LowPrecisionRecipe",
    "SqnrCase",
    "SqnrDistribution",
    "recipe_for",
    "sqnr_reference_input",
]


@dataclass(frozen=True, eq=False)
class LowPrecisionRecipe:
    """An immutable role → quantizer map for one format (design spec §13.3 ``LowPrecisionRecipe``).

    Attributes:
        name: Versioned recipe name, as selected by the policy (``"mxfp8_e4m3_mx_block"``,
            ``"hif8_current"``).
        format: The :class:`~lp_lightning.formats.spec.FormatSpec` every quantizer produces (a
            registered name is converted).
        scaling: The format's scaling algorithm (``"mx_block"``, ``"current"``).
        quantizers: One ``Quantizer`` per ``QuantizationRole`` (all five); stored read-only.
        backend: The op backend that runs this recipe's quantisations and GEMMs (``"emulated"``,
            ``"npu"``), chosen when the run is configured (the startup gate); ``"auto"`` (the
            format's v1 recipe) picks by the operands' device (``lp_lightning.ops.backend``). The
            recipe, the modules and the weights built with it carry the choice: there is no
            process-wide backend. Get a recipe with another backend from :func:`recipe_for`.

    Raises:
        ValueError: if a role is missing, a quantizer produces another format, or ``backend`` is
            not a non-empty string.
    """

    name: str
    format: FormatSpec
    scaling: str
    quantizers: Mapping[QuantizationRole, Quantizer] = field(repr=False)
    backend: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"LowPrecisionRecipe {self.name!r}: backend must be an op backend name, got {self.backend!r}.")
        fmt = as_spec(self.format)
        object.__setattr__(self, "format", fmt)
        quantizers = {QuantizationRole.parse(role): q for role, q in self.quantizers.items()}
        missing = [role.value for role in QuantizationRole if role not in quantizers]
        if missing:
            raise ValueError(
                f"LowPrecisionRecipe {self.name!r}: no quantizer for roles {missing}; every role needs one."
            )
        wrong = {role.value: q.format.name for role, q in quantizers.items() if q.format is not fmt}
        if wrong:
            raise ValueError(f"LowPrecisionRecipe {self.name!r} is {fmt.name} but quantizers produce {wrong}.")
        object.__setattr__(self, "quantizers", MappingProxyType(quantizers))

    def quantizer(self, role: QuantizationRole | str) -> Quantizer:
        """The quantizer for ``role`` (enum or its string value).

        Raises:
            ValueError: for an unknown role, naming the legal values.
        """
        return self.quantizers[QuantizationRole.parse(role)]

    def __repr__(self) -> str:
        roles = ", ".join(f"{role.value}={q!r}" for role, q in self.quantizers.items())
        backend = "" if self.backend == "auto" else f", backend {self.backend}"
        return f"LowPrecisionRecipe({self.name!r}, {self.format.name}+{self.scaling}{backend}: {roles})"


_WITH_BACKEND: dict[tuple[str, str], LowPrecisionRecipe] = {}


def recipe_for(format: FormatSpec | str, backend: str = "auto") -> LowPrecisionRecipe:
    """The v1 recipe of a format, run by ``backend``.

    Args:
        format: A ``FormatSpec`` or a registered format name (``"mxfp8_e4m3"``, ``"hif8"``; a
            ``str``-valued Enum member works too).
        backend: The op backend name the recipe carries (:attr:`LowPrecisionRecipe.backend`);
            checked by the op entry points on first use.

    Returns:
        The format's recipe (e.g. ``MXFP8_E4M3_MX_BLOCK``, ``HIF8_CURRENT``) for ``"auto"``, else
        one shared copy of it per backend (the same object on every call).

    Raises:
        ValueError: for an unknown format, naming the legal values.
    """
    recipe = as_spec(format).recipe
    if backend == recipe.backend:
        return recipe
    key = (recipe.name, backend)
    if key not in _WITH_BACKEND:
        _WITH_BACKEND[key] = replace(recipe, backend=backend)
    return _WITH_BACKEND[key]


# ------------------------------------------------------------------------------------------------
# Expected quantisation quality (see the module docstring for the derivation).


class SqnrCase(str, Enum):
    """What an SQNR floor is measured on."""

    QUANTIZE = "quantize"
    """quantize → dequantize of one ``[256, 256]`` tensor vs the tensor itself."""
    FPROP = "fprop"
    """Dense fprop ``x[256, 512] · W[384, 512]ᵀ`` (x from the distribution, W Gaussian) vs FP64."""
    DGRAD = "dgrad"
    """Dense dgrad ``dy[256, 384] · W[384, 512]`` (dy from the distribution) vs FP64."""
    WGRAD = "wgrad"
    """Dense wgrad ``dy[256, 384]ᵀ · x[256, 512]`` (dy from the distribution) vs FP64."""


SqnrDistribution = Literal["gaussian", "student_t3", "outliers", "outliers_bulk"]
"""Reference inputs: N(0, 1); Student-t with ν = 3 (heavy tails, infinite kurtosis); N(0, 1) with
0.1 % of the elements multiplied by 100, scored on all elements (``outliers``) or only on the
99.9 % that were not multiplied (``outliers_bulk``: what per-tensor scaling does to the bulk)."""

SqnrKey = tuple[str, str, str]
"""``(quantizer, distribution, case)``. quantizer: ``"mxfp8"``, ``"hif8_15"`` or ``"hif8_224"`` for
``quantize``; the recipe (``"mxfp8"``, ``"hif8"``) for the GEMM cases, whose operands get the roles
of design spec §8 (fprop INPUT_FWD × WEIGHT_FWD, dgrad GRAD_OUTPUT × WEIGHT_BWD, wgrad GRAD_OUTPUT ×
INPUT_BWD)."""


def sqnr_reference_input(
    distribution: SqnrDistribution, shape: tuple[int, ...], *, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A reference input of ``SQNR_FLOORS_DB`` and the mask of the elements it is scored on.

    Args:
        distribution: One of ``SqnrDistribution``.
        shape: Tensor shape.
        seed: CPU generator seed (the table's values use seed 0).

    Returns:
        ``(x, scored)``: FP32 ``x`` of ``shape`` on the CPU and a bool mask of the same shape.

    Raises:
        ValueError: for an unknown distribution.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    scored = torch.ones(shape, dtype=torch.bool)
    if distribution == "gaussian":
        return x, scored
    if distribution == "student_t3":
        chi2 = torch.randn((3, *shape), generator=g).square().sum(0)
        return x / (chi2 / 3).sqrt(), scored
    if distribution in ("outliers", "outliers_bulk"):
        picked = torch.randperm(x.numel(), generator=g)[: x.numel() // 1000]
        x.view(-1)[picked] *= 100.0
        if distribution == "outliers_bulk":
            scored.view(-1)[picked] = False
        return x, scored
    raise ValueError(
        f"sqnr_reference_input: distribution={distribution!r}; legal values: "
        "'gaussian', 'student_t3', 'outliers', 'outliers_bulk'."
    )


class _SqnrTable(Mapping[SqnrKey, float]):
    """One column of the product formats' ``sqnr_table`` (those a ``--precision`` value selects),
    read when looked up; another registered format's table is its spec's ``sqnr_table``."""

    def __init__(self, column: int) -> None:
        self._column = column

    def _merged(self) -> dict[SqnrKey, float]:
        merged: dict[SqnrKey, float] = {}
        for name in precision_names().values():
            merged.update({k: v[self._column] for k, v in as_spec(name.name).sqnr_table.items()})
        return merged

    def __getitem__(self, key: SqnrKey) -> float:
        return self._merged()[key]

    def __iter__(self) -> Iterator[SqnrKey]:
        return iter(self._merged())

    def __len__(self) -> int:
        return len(self._merged())


SQNR_MEASURED_DB: Mapping[SqnrKey, float] = _SqnrTable(0)
"""SQNR measured on the reference inputs with seed 0 (the tests re-measure and compare)."""

SQNR_FLOORS_DB: Mapping[SqnrKey, float] = _SqnrTable(1)
"""Floors the tests enforce: the measurement minus a 2 dB margin, rounded down to 0.5 dB."""
