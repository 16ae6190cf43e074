"""Low-precision autograd functions: dense linear and grouped SwiGLU experts (design spec §6, §8).

Model-agnostic: modules (``lp_lightning.modules``) and model adapters
(``lp_lightning.models.deepseek_v3.experts``) call these with a persistent low-precision weight
tensor and a recipe; every fprop, dgrad and wgrad GEMM runs through ``lp_lightning.ops``.
"""

from lp_lightning.functional.grouped_linear import low_precision_grouped_swiglu, swiglu_backward
from lp_lightning.functional.linear import is_low_precision_weight, low_precision_linear

__all__ = [
    "is_low_precision_weight",
    "low_precision_grouped_swiglu",
    "low_precision_linear",
    "swiglu_backward",
]
