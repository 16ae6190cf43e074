"""HF transformers DeepSeek-V3: random-init build from a config, named specs, spec validation (§4.1),
the model adapter of the generic layers (:mod:`~lp_lightning.models.deepseek_v3.adapter`), and the
routed-experts replacement of the low-precision runs (§5.2).

The low-precision part (:mod:`~lp_lightning.models.deepseek_v3.experts`, which imports the format,
functional and op layers) loads only when ``DeepseekV3LowPrecisionExperts`` or
``replace_deepseek_v3_low_precision_experts`` is first used, so a ``bf16`` run that builds the model
from here imports nothing low-precision (design spec §13.1, ``tests/test_bf16_imports.py``).
"""

import importlib
from typing import Any

from lp_lightning.models.deepseek_v3.report import (
    StructureReport,
    expected_structure,
    param_dtype_summary,
    structure_report,
)
from lp_lightning.models.deepseek_v3.spec import (
    SPECS,
    SpecName,
    SpecValidationError,
    build_config,
    build_meta_model,
    from_hf_config,
    inherited_fields,
    resolve_spec,
    validate_spec,
)

__all__ = [
    "DeepseekV3LowPrecisionExperts",
    "replace_deepseek_v3_low_precision_experts",
    "SPECS",
    "SpecName",
    "SpecValidationError",
    "StructureReport",
    "build_config",
    "build_meta_model",
    "expected_structure",
    "from_hf_config",
    "inherited_fields",
    "param_dtype_summary",
    "resolve_spec",
    "structure_report",
    "validate_spec",
]

_LOW_PRECISION_NAMES = frozenset({"DeepseekV3LowPrecisionExperts", "replace_deepseek_v3_low_precision_experts"})


def __getattr__(name: str) -> Any:
    """Loads the low-precision experts on first use (module docstring)."""
    if name in _LOW_PRECISION_NAMES:
        return getattr(importlib.import_module("lp_lightning.models.deepseek_v3.experts"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
