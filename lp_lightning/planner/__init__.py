"""``lp-lightning plan``: per-rank memory of a run, predicted on the meta model (docs/planner.md).

:func:`plan_memory` builds the model of a spec on the meta device, applies the precision plugin's
replacement plan, places every weight with the shard rules of design spec §9.1 and adds up, per
rank, the FP32 masters, AdamW moments, gradients, 8-bit storage, all-gather buffers, unsharded
gradients and saved activations against a device budget. Nothing is allocated.
"""

from lp_lightning.planner.memory import COMPONENTS, DEFAULT_BUDGET_BYTES, RECIPES, MemoryPlan, plan_memory

__all__ = ["COMPONENTS", "DEFAULT_BUDGET_BYTES", "RECIPES", "MemoryPlan", "plan_memory"]
