"""Low-precision formats: the generic protocol, the registry, and one package per format (design spec §3, §7).

Generic (no format named): :mod:`~lp_lightning.formats.registry` (pure-Python catalogue),
:mod:`~lp_lightning.formats.spec` (``FormatSpec``, ``WeightKind``, ``AmaxScope``),
:mod:`~lp_lightning.formats.operand` (``QuantizedOperand``, ``QuantizationRole``),
:mod:`~lp_lightning.formats.quantizer` (the ``Quantizer`` protocol),
:mod:`~lp_lightning.formats.group_list` (the checked per-group row counts of MoE tensors) and
:mod:`~lp_lightning.formats.recipe` (``LowPrecisionRecipe``, ``recipe_for``, SQNR floors).
Formats: :mod:`lp_lightning.formats.mxfp8`, :mod:`lp_lightning.formats.hif8`.

Attributes load on first use (PEP 562), so ``import lp_lightning.formats.registry`` — what the
configuration layer does — imports no torch and no format::

    from lp_lightning.formats import QuantizationRole, recipe_for

    recipe = recipe_for("hif8")
    x_op = lp_lightning.ops.quantize(recipe.quantizer(QuantizationRole.INPUT_FWD), x_MK, orientation="row")
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "AmaxScope": "lp_lightning.formats.spec",
    "FormatEntry": "lp_lightning.formats.registry",
    "FormatSpec": "lp_lightning.formats.spec",
    "HIF8_CURRENT": "lp_lightning.formats.hif8",
    "HiF8Quantizer": "lp_lightning.formats.hif8",
    "LowPrecisionFormat": "lp_lightning.names",
    "LowPrecisionRecipe": "lp_lightning.formats.recipe",
    "MXFP8Quantizer": "lp_lightning.formats.mxfp8",
    "MXFP8_E4M3_MX_BLOCK": "lp_lightning.formats.mxfp8",
    "Orientation": "lp_lightning.formats.spec",
    "QuantizationRole": "lp_lightning.formats.operand",
    "QuantizedOperand": "lp_lightning.formats.operand",
    "Quantizer": "lp_lightning.formats.quantizer",
    "SQNR_FLOORS_DB": "lp_lightning.formats.recipe",
    "StaleOperandError": "lp_lightning.formats.operand",
    "WeightKind": "lp_lightning.formats.spec",
    "compiled_kernels_enabled": "lp_lightning.formats._compile",
    "format_spec": "lp_lightning.formats.registry",
    "recipe_for": "lp_lightning.formats.recipe",
    "register_format": "lp_lightning.formats.registry",
    "set_compiled_kernels": "lp_lightning.formats._compile",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lp_lightning.formats' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
