"""Model builders and model adapters.

``deepseek_v3``: HF transformers DeepSeek-V3 from a config (design spec §4.1) and its
:class:`~lp_lightning.models.adapter.ModelAdapter` (:mod:`lp_lightning.models.deepseek_v3.adapter`),
registered here so :func:`adapter_for` finds it.
"""

from lp_lightning.models.adapter import (
    ActivationTerms,
    ModelAdapter,
    adapter_for,
    adapter_for_config,
    register_model_adapter,
    registered_model_adapters,
    registered_specs,
)
from lp_lightning.models.deepseek_v3 import SPECS, from_hf_config
from lp_lightning.models.deepseek_v3.adapter import DEEPSEEK_V3

register_model_adapter(DEEPSEEK_V3)

__all__ = [
    "DEEPSEEK_V3",
    "SPECS",
    "ActivationTerms",
    "ModelAdapter",
    "adapter_for",
    "adapter_for_config",
    "from_hf_config",
    "register_model_adapter",
    "registered_model_adapters",
    "registered_specs",
]
