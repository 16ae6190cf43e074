"""The FSDP2 lifecycle of a run (design spec §9, §10, §12.1): parallelize, placement, gather, refresh, finalize.

One package, two halves. What every run uses (torch only; a bf16 run imports nothing else):

- :mod:`~lp_lightning.fsdp.parallelize` — ``parallelize_causal_lm``: convert → FP32 masters →
  ``fully_shard`` → first refresh → recompute, the dp mesh, gradient norm and clipping;
- :mod:`~lp_lightning.fsdp.optimizer` — ``check_optimizer``: AdamW over FP32 masters (design spec §15).

The low-precision half, imported by its module path and only on a low-precision path (the
low-precision plugin and its :class:`~lp_lightning.fsdp.lifecycle.LowPrecisionLifecycle`, the
low-precision launch check, the planner, the low-precision recorders); a bf16 run loads none of it:

- :mod:`~lp_lightning.fsdp.weights` — finalize (FP32 master + the weight's gather spec), traversal,
  the state-dict hook (DCP holds FP32 masters under the HF keys);
- :mod:`~lp_lightning.fsdp.gather` — the gather spec (``GatherPolicy``: ``fsdp_pre_all_gather`` /
  ``fsdp_post_all_gather``), its layout and phase, gather events;
- :mod:`~lp_lightning.fsdp.sharding` — placement: ``Shard(0)``, ``Shard(1)`` or the replicated
  fallback per weight, the gather policy of a run;
- :mod:`~lp_lightning.fsdp.refresh` — one refresh per successful optimizer step, the cross-rank amax
  of per-tensor scales;
- :mod:`~lp_lightning.fsdp.lifecycle` — the object the low-precision plugin hands the strategy:
  placement, replicated mesh and refreshes of one run, with their counts.

It sees only the generic protocol (``FormatSpec``, ``QuantizedWeightTensor``), never a concrete
format, and never a model: the model's layout comes in as a :class:`~lp_lightning.fsdp.parallelize.ModelLayout`.
"""

from lp_lightning.fsdp.optimizer import check_optimizer
from lp_lightning.fsdp.parallelize import (
    DP_SHARD_DIM,
    ModelLayout,
    ParallelizationRecord,
    WeightLifecycle,
    build_dp_mesh,
    clip_gradients_,
    default_mixed_precision_policy,
    is_parallelized,
    parallelize_causal_lm,
    total_grad_norm,
)

__all__ = [
    "DP_SHARD_DIM",
    "ModelLayout",
    "ParallelizationRecord",
    "WeightLifecycle",
    "build_dp_mesh",
    "check_optimizer",
    "clip_gradients_",
    "default_mixed_precision_policy",
    "is_parallelized",
    "parallelize_causal_lm",
    "total_grad_norm",
]
