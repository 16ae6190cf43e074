"""HF transformers DeepSeek-V3: random-init build from a config, named specs, spec validation (§4.1),
and the routed-experts adapter of the low-precision replacement (§5.2)."""

from lp_lightning.models.deepseek_v3.experts import (
    DeepseekV3LowPrecisionExperts,
    replace_deepseek_v3_low_precision_experts,
)
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
