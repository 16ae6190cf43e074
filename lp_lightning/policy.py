"""Low-precision configuration and the read-only policy derived from it (design spec §4.2, §13.1; R3).

Three configs each answer one question (design spec §4): the HF model config says *what model* to
build, :class:`LowPrecisionConfig` says *how to compute* (format and scaling algorithm) and the
replacement plan (:mod:`lp_lightning.plan`) says *which modules* compute in low precision. This
file holds the second one. It carries no module FQN and no format constant (format maxima such as
HiF8's 15.0/224.0 or MXFP8's block size of 32 live in the recipe, docs/formats.md "Decisions").

Legal ``format`` + ``scaling`` pairs (design spec §4.2; every other pair fails while the config is
parsed, before any model is built):

- ``mxfp8_e4m3`` + ``mx_block`` -> recipe ``mxfp8_e4m3_mx_block``: E4M3 elements, one E8M0 scale
  per 32-element block (OCP MX v1.0).
- ``hif8`` + ``current`` -> recipe ``hif8_current``: HiFloat8 elements, one FP32 scale from the
  operand's current amax.

``hif8`` + ``delayed`` (amax history) is deliberately not offered (design spec §4.2: HiF8 current
scaling always uses the current amax and exposes no safety-margin knob): ``scaling: delayed`` fails
with "HiF8 delayed scaling is not supported" (:func:`refused_scaling_message`, design spec §17.3.1),
from the config and from the CLI parser alike.

This module is pure Python: importing it, building a config or a policy imports neither torch
nor ``torch_npu`` and runs no capability check (design spec §13.1: ``enabled=false`` must not import
``torch_npu``). Capability checks belong to the backend that the policy later selects.

Example (Trainer YAML section, parsed by jsonargparse from the type hints below)::

    low_precision:
      enabled: true
      format: hif8
      scaling: current
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

from lp_lightning.formats.registry import format_entry, precision_names
from lp_lightning.names import LowPrecisionFormat

__all__ = [
    "LEGAL_PAIRS",
    "REFUSED_SCALINGS",
    "LowPrecisionConfig",
    "LowPrecisionFormat",
    "LowPrecisionPolicy",
    "PrecisionName",
    "RecipeName",
    "ScalingAlgorithm",
    "refused_scaling_message",
]


class ScalingAlgorithm(str, Enum):
    """How the scale of a low-precision operand is computed (design spec §4.2)."""

    MX_BLOCK = "mx_block"
    """One E8M0 power-of-two scale per 32-element block, from that block's amax."""
    CURRENT = "current"
    """One FP32 scale per tensor/group from the operand's *current* amax (no history)."""


class RecipeName(str, Enum):
    """Name of the recipe a legal (format, scaling) pair selects; the recipe owns the constants."""

    MXFP8_E4M3_MX_BLOCK = "mxfp8_e4m3_mx_block"
    HIF8_CURRENT = "hif8_current"


class PrecisionName(str, Enum):
    """Values of the CLI's ``--precision`` flag (see :meth:`LowPrecisionConfig.from_precision`)."""

    BF16 = "bf16"
    """No low-precision GEMM: the model trains in BF16 autocast / FP32 master as usual."""
    MXFP8 = "mxfp8"
    """``mxfp8_e4m3`` + ``mx_block``."""
    HIF8 = "hif8"
    """``hif8`` + ``current``."""


LEGAL_PAIRS: dict[tuple[LowPrecisionFormat, ScalingAlgorithm], RecipeName] = {
    (LowPrecisionFormat(entry.name), ScalingAlgorithm(entry.scaling)): RecipeName(entry.recipe)
    for entry in precision_names().values()
}
"""The only (format, scaling) pairs the config accepts, and the recipe each selects (design spec §4.2):
those of the registered formats a ``--precision`` value selects (``lp_lightning.formats.registry``)."""

_PRECISION_TO_PAIR: dict[PrecisionName, tuple[bool, LowPrecisionFormat, ScalingAlgorithm]] = {
    PrecisionName(precision): (True, LowPrecisionFormat(entry.name), ScalingAlgorithm(entry.scaling))
    for precision, entry in precision_names().items()
}
_PRECISION_TO_PAIR[PrecisionName.BF16] = (False, *next(iter(LEGAL_PAIRS)))  # off: the first pair, unused


def _legal_pairs_text() -> str:
    return ", ".join(f"{fmt.value}+{scaling.value}" for fmt, scaling in LEGAL_PAIRS)


REFUSED_SCALINGS: frozenset[str] = frozenset({"delayed"})
"""Scaling algorithms known but refused in this release (design spec §1: HiF8 delayed scaling is out of
scope; §17.3.1: rejected at startup as unsupported, never mapped to ``current``)."""


def refused_scaling_message(scaling: object, *, owner: str = "low_precision") -> str | None:
    """The error for a refused ``low_precision.scaling`` value (:data:`REFUSED_SCALINGS`), or ``None``.

    Used by :class:`LowPrecisionConfig` and by the CLI, whose parser rejects the value before the
    config exists (it is not one of the ``scaling`` choices).
    """
    if not isinstance(scaling, str) or scaling not in REFUSED_SCALINGS:
        return None
    return (
        f"{owner}.scaling={scaling!r}: HiF8 delayed scaling is not supported (design spec §17.3.1). "
        f"The legal pairs are {_legal_pairs_text()}; for hif8 set `scaling: current`."
    )


def _validate(
    owner: str, enabled: object, format: object, scaling: object
) -> tuple[LowPrecisionFormat, ScalingAlgorithm, RecipeName]:
    """Check the three fields of a config/policy; return the parsed enums and the recipe name.

    Raises:
        TypeError: ``enabled`` is not a ``bool`` (e.g. the string ``"false"``, which is truthy).
        ValueError: ``format`` or ``scaling`` is unknown, or the pair is not in :data:`LEGAL_PAIRS`.
    """
    if not isinstance(enabled, bool):
        raise TypeError(
            f"{owner}.enabled must be a bool, got {enabled!r} ({type(enabled).__name__}); "
            "write `enabled: true` or `enabled: false`."
        )
    refused = refused_scaling_message(scaling, owner=owner)
    if refused is not None:
        raise ValueError(refused)
    pair_text = f"format={format!r} + scaling={scaling!r}"
    try:
        fmt = LowPrecisionFormat(format)
        scl = ScalingAlgorithm(scaling)
    except ValueError:
        raise ValueError(
            f"{owner}: unsupported low-precision pair {pair_text}; known formats are "
            f"{[f.value for f in LowPrecisionFormat]}, known scalings {[s.value for s in ScalingAlgorithm]}, "
            f"and the legal pairs are {_legal_pairs_text()} (design spec §4.2)."
        ) from None
    recipe = LEGAL_PAIRS.get((fmt, scl))
    if recipe is None:
        fix = f"scaling: {format_entry(fmt).scaling}"
        raise ValueError(
            f"{owner}: illegal low-precision pair {fmt.value}+{scl.value}; the legal pairs are "
            f"{_legal_pairs_text()} (design spec §4.2). For format: {fmt.value} set `{fix}`."
        )
    return fmt, scl, recipe


@dataclass(frozen=True, kw_only=True)
class LowPrecisionConfig:
    """The ``low_precision`` section of the Trainer config: which format and scaling to use.

    Validated in ``__post_init__``, i.e. while the config is parsed and before any model exists.
    Build it from YAML/CLI (jsonargparse reads the type hints), directly, or from the CLI's
    ``--precision`` via :meth:`from_precision`. Turn it into the read-only
    :class:`LowPrecisionPolicy` with :meth:`to_policy`; low-precision modules only ever see the
    policy, never this config (design spec §4.2).

    Args:
        enabled: Whether the replacement plan runs and selected GEMMs use low precision. ``False``
            replaces nothing, imports no ``torch_npu`` and runs no capability check (design spec §13.1).
        format: Element format of the GEMM operands: ``"mxfp8_e4m3"`` or ``"hif8"``.
        scaling: Scaling algorithm: ``"mx_block"`` (only with ``mxfp8_e4m3``) or ``"current"``
            (only with ``hif8``).

    Raises:
        TypeError: ``enabled`` is not a bool.
        ValueError: the (format, scaling) pair is not one of :data:`LEGAL_PAIRS` (this includes
            ``hif8`` + ``delayed``, ``mxfp8_e4m3`` + ``current``, ``hif8`` + ``mx_block`` and
            unknown strings). The pair is checked even when ``enabled`` is false, so a config
            that is wrong stays wrong when it is switched on.
    """

    enabled: bool = False
    format: Literal["mxfp8_e4m3", "hif8"] = "mxfp8_e4m3"
    scaling: Literal["mx_block", "current"] = "mx_block"

    def __post_init__(self) -> None:
        fmt, scl, _ = _validate("low_precision", self.enabled, self.format, self.scaling)
        # Store plain strings (a str-Enum member passed in compares equal but reprs/serialises
        # differently), so the config round-trips through YAML/JSON unchanged.
        object.__setattr__(self, "format", fmt.value)
        object.__setattr__(self, "scaling", scl.value)

    @classmethod
    def from_precision(cls, precision: str | PrecisionName) -> LowPrecisionConfig:
        """Map the CLI's ``--precision`` value onto a config.

        Args:
            precision: ``"bf16"`` (``enabled=False``, default pair), ``"mxfp8"``
                (``mxfp8_e4m3`` + ``mx_block``) or ``"hif8"`` (``hif8`` + ``current``).

        Returns:
            The corresponding validated config.

        Raises:
            ValueError: ``precision`` is none of the three names.
        """
        try:
            name = PrecisionName(precision)
        except ValueError:
            raise ValueError(
                f"--precision must be one of {[p.value for p in PrecisionName]}, got {precision!r}."
            ) from None
        enabled, fmt, scaling = _PRECISION_TO_PAIR[name]
        return cls(enabled=enabled, format=fmt.value, scaling=scaling.value)

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> LowPrecisionConfig:
        """Build from an untyped mapping (e.g. a YAML ``low_precision:`` block read without jsonargparse).

        Args:
            section: Mapping with any of the keys ``enabled``, ``format``, ``scaling``.

        Returns:
            The validated config.

        Raises:
            ValueError: an unknown key, or an illegal pair (see the class docstring).
            TypeError: ``section`` is not a mapping, or ``enabled`` is not a bool.
        """
        if not isinstance(section, Mapping):
            raise TypeError(
                f"low_precision must be a mapping with keys enabled/format/scaling, got {type(section).__name__}."
            )
        unknown = sorted(set(section) - {"enabled", "format", "scaling"})
        if unknown:
            raise ValueError(
                f"low_precision: unknown key(s) {unknown}; the section only has enabled, format and "
                "scaling (design spec §4.2: no safety margin or other tuning knobs)."
            )
        return cls(**section)

    @property
    def precision_name(self) -> PrecisionName:
        """The ``--precision`` value this config corresponds to (inverse of :meth:`from_precision`)."""
        if not self.enabled:
            return PrecisionName.BF16
        return PrecisionName(format_entry(self.format).precision)

    def to_policy(self, backend: str = "auto") -> LowPrecisionPolicy:
        """Return the read-only policy handed to the replacement plan and its factories (design spec §4.2).

        Args:
            backend: The op backend the run's recipe carries (the startup gate's choice, e.g.
                ``"emulated"``); ``"auto"`` picks by the operands' device (``lp_lightning.ops.backend``).
        """
        return LowPrecisionPolicy(
            enabled=self.enabled,
            format=LowPrecisionFormat(self.format),
            scaling=ScalingAlgorithm(self.scaling),
            backend=backend,
        )


@dataclass(frozen=True, kw_only=True)
class LowPrecisionPolicy:
    """Read-only "how to compute" handed to replacement factories and low-precision modules.

    Built by :meth:`LowPrecisionConfig.to_policy`; hashable, picklable, immutable. It names the
    recipe (:attr:`recipe_name`) but carries no format constants: the recipe maps each
    quantisation role to its quantizer and owns values such as the HiF8 format maxima or the MX
    block size (design spec §7.1, §13.3).

    Args:
        enabled: Whether low precision is on (see :class:`LowPrecisionConfig`).
        format: Element format.
        scaling: Scaling algorithm.
        backend: The op backend of the run's quantisations and GEMMs: the factories build the
            modules and weights with ``recipe_for(format, backend)``, so the choice travels with
            them (``"auto"``: by the operands' device; a name is checked on the first op call).

    Raises:
        TypeError: ``enabled`` is not a bool, or ``backend`` not a non-empty string.
        ValueError: the (format, scaling) pair is not one of :data:`LEGAL_PAIRS`.
    """

    enabled: bool
    format: LowPrecisionFormat
    scaling: ScalingAlgorithm
    backend: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise TypeError(f"LowPrecisionPolicy.backend must be an op backend name, got {self.backend!r}.")
        fmt, scl, _ = _validate("LowPrecisionPolicy", self.enabled, self.format, self.scaling)
        object.__setattr__(self, "format", fmt)
        object.__setattr__(self, "scaling", scl)

    @property
    def recipe_name(self) -> RecipeName:
        """The recipe the (format, scaling) pair selects, e.g. ``RecipeName.HIF8_CURRENT``."""
        return LEGAL_PAIRS[(self.format, self.scaling)]

    @property
    def precision_name(self) -> PrecisionName:
        """The ``--precision`` value of this policy (``bf16`` when disabled)."""
        if not self.enabled:
            return PrecisionName.BF16
        return PrecisionName(format_entry(self.format).precision)

    @classmethod
    def disabled(cls) -> LowPrecisionPolicy:
        """The policy of ``LowPrecisionConfig()`` (``enabled=False``, default pair)."""
        return LowPrecisionConfig().to_policy()

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready ``{"enabled", "format", "scaling", "recipe_name"}`` for run summaries."""
        return {
            "enabled": self.enabled,
            "format": self.format.value,
            "scaling": self.scaling.value,
            "recipe_name": self.recipe_name.value,
        }

    def describe(self) -> str:
        """One-line text for logs, e.g. ``"low precision on: hif8+current (recipe hif8_current)"``."""
        if not self.enabled:
            return "low precision off (no module replaced)"
        return (
            f"low precision on: {self.format.value}+{self.scaling.value} "
            f"(recipe {self.recipe_name.value})"
        )
