"""Model builders. ``deepseek_v3``: HF transformers DeepSeek-V3 from a config (design spec §4.1)."""

from lp_lightning.models.deepseek_v3 import SPECS, from_hf_config

__all__ = ["SPECS", "from_hf_config"]
