"""The format registry: which low-precision formats exist and where each one's code lives.

Pure Python (no torch): the configuration layer (:mod:`lp_lightning.policy`) reads it to derive
the legal ``(format, scaling)`` pairs and the ``--precision`` names, and importing it loads no
format. Each entry names the module attribute holding the format's
:class:`~lp_lightning.formats.spec.FormatSpec`; :func:`format_spec` imports it on first use.

The product ships exactly the design spec's two formats (§3, §4.2)::

    name          scaling    recipe                 --precision   package
    mxfp8_e4m3    mx_block   mxfp8_e4m3_mx_block    mxfp8         lp_lightning.formats.mxfp8
    hif8          current    hif8_current           hif8          lp_lightning.formats.hif8

A new format is one package plus one :func:`register_format` call (the test suite registers an
FP8 per-tensor format this way, ``tests/formats/fp8_tensor/``). Nothing outside a format's own
package and this registry branches on a concrete format: the layers above ask the spec.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FormatEntry",
    "format_entry",
    "format_names",
    "format_spec",
    "legal_pairs",
    "precision_names",
    "register_format",
]


@dataclass(frozen=True, kw_only=True)
class FormatEntry:
    """One registered format (pure data; see the module docstring).

    Attributes:
        name: Format name as written in configs (``"mxfp8_e4m3"``).
        scaling: The one scaling algorithm it is legal with (``"mx_block"``).
        recipe: Versioned recipe name the pair selects (``"mxfp8_e4m3_mx_block"``).
        precision: ``--precision`` value that selects it (``"mxfp8"``), or ``None`` when the format
            is only reachable from Python.
        spec: ``"package.module:ATTRIBUTE"`` of its :class:`~lp_lightning.formats.spec.FormatSpec`.
    """

    name: str
    scaling: str
    recipe: str
    precision: str | None
    spec: str


_LOCK = threading.Lock()
_ENTRIES: dict[str, FormatEntry] = {}
_SPECS: dict[str, Any] = {}


def register_format(entry: FormatEntry, spec: Any = None) -> None:
    """Add a format (idempotent for an identical entry).

    Args:
        entry: The catalogue entry.
        spec: The loaded ``FormatSpec``, when the caller already has it (skips the lazy import).

    Raises:
        ValueError: another entry already uses the name or the ``--precision`` value, or another
            spec object is already loaded for it (a format module imported twice under two names).
    """
    with _LOCK:
        existing = _ENTRIES.get(entry.name)
        if existing is not None and existing != entry:
            raise ValueError(f"format {entry.name!r} is already registered as {existing}; refusing {entry}.")
        loaded = _SPECS.get(entry.name)
        if spec is not None and loaded is not None and loaded is not spec:
            raise ValueError(
                f"format {entry.name!r} already has a loaded spec {loaded!r}; refusing a second object "
                "(import its module under one name only)."
            )
        clash = [e.name for e in _ENTRIES.values() if entry.precision and e.precision == entry.precision]
        if clash and clash != [entry.name]:
            raise ValueError(f"--precision {entry.precision!r} already selects format {clash[0]!r}.")
        _ENTRIES[entry.name] = entry
        if spec is not None:
            _SPECS[entry.name] = spec


def format_names() -> tuple[str, ...]:
    """Names of every registered format, in registration order."""
    return tuple(_ENTRIES)


def format_entry(name: object) -> FormatEntry:
    """The entry of a format name (a ``str`` or a ``str``-valued Enum member).

    Raises:
        ValueError: an unknown name; the message lists the registered ones.
    """
    key = getattr(name, "value", name)
    entry = _ENTRIES.get(key) if isinstance(key, str) else None
    if entry is None:
        legal = ", ".join(repr(n) for n in _ENTRIES)
        raise ValueError(f"format={name!r} is not a low-precision format; legal values: {legal}.")
    return entry


def format_spec(name: object) -> Any:
    """The :class:`~lp_lightning.formats.spec.FormatSpec` of a registered format name.

    Args:
        name: A format name, or a ``str``-valued Enum member (``lp_lightning.formats.spec.as_spec``
            also accepts a spec).

    Raises:
        ValueError: an unknown name.
    """
    entry = format_entry(name)
    spec = _SPECS.get(entry.name)
    if spec is None:
        module_name, _, attribute = entry.spec.partition(":")
        spec = getattr(importlib.import_module(module_name), attribute)
        with _LOCK:
            spec = _SPECS.setdefault(entry.name, spec)
    return spec


def legal_pairs() -> dict[tuple[str, str], str]:
    """``{(format, scaling): recipe}`` of every registered format (design spec §4.2)."""
    return {(e.name, e.scaling): e.recipe for e in _ENTRIES.values()}


def precision_names() -> dict[str, FormatEntry]:
    """``{--precision value: entry}`` of the formats a ``--precision`` value selects."""
    return {e.precision: e for e in _ENTRIES.values() if e.precision is not None}


register_format(
    FormatEntry(
        name="mxfp8_e4m3",
        scaling="mx_block",
        recipe="mxfp8_e4m3_mx_block",
        precision="mxfp8",
        spec="lp_lightning.formats.mxfp8:SPEC",
    )
)
register_format(
    FormatEntry(
        name="hif8",
        scaling="current",
        recipe="hif8_current",
        precision="hif8",
        spec="lp_lightning.formats.hif8:SPEC",
    )
)
