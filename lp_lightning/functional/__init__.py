"""Low-precision autograd functions: dense linear, grouped linear and grouped SwiGLU experts (design spec §6, §8).

Model-agnostic: modules (``lp_lightning.modules``) and model adapters
(``lp_lightning.models.deepseek_v3.experts``) call these with a persistent low-precision weight
tensor and a recipe; every fprop, dgrad and wgrad GEMM runs through ``lp_lightning.ops``.
"""

from lp_lightning.functional.grouped_linear import (
    _GroupedLinearFunction,
    _GroupedSwiGLUFunction,
    low_precision_grouped_linear,
    low_precision_grouped_swiglu,
    swiglu_backward,
)
from lp_lightning.functional.linear import _LowPrecisionLinearFunction, low_precision_linear, selects_low_precision_operand

LOW_PRECISION_BACKWARD_NODES: frozenset[str] = frozenset(
    f"{fn.__name__}Backward" for fn in (_LowPrecisionLinearFunction, _GroupedLinearFunction, _GroupedSwiGLUFunction)
)
"""Names of the autograd backward nodes of the low-precision functions (``torch._C._current_autograd_node().name()``):
probes attribute GEMMs inside them to a replaced module."""

__all__ = [
    "LOW_PRECISION_BACKWARD_NODES",
    "low_precision_grouped_linear",
    "low_precision_grouped_swiglu",
    "low_precision_linear",
    "selects_low_precision_operand",
    "swiglu_backward",
]
