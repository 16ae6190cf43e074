"""The lifecycle layer: low-precision weights in FSDP2, the optimizer step and DCP (design spec §6 ``integration/``, §9–§11).

It sees only the generic protocol (``FormatSpec``, ``QuantizedWeightTensor``), never a concrete
format:

- :mod:`~lp_lightning.integration.gather` — the FSDP2 gather extension (schema, phase, hooks) and
  gather events; importing it installs the extension on the weight class;
- :mod:`~lp_lightning.integration.sharding` — shard legality, the replicated fallback, the gather
  policy of a run;
- :mod:`~lp_lightning.integration.refresh` — one refresh per successful optimizer step, with the
  cross-rank amax of per-tensor scales;
- :mod:`~lp_lightning.integration.weights` — finalize, traversal and the state-dict hook (DCP
  checkpoints hold FP32 masters under the HF keys).
"""

from lp_lightning.integration.gather import (
    GatherEvent,
    GatherLayout,
    GatherMetadata,
    GatherPolicy,
    GatherStage,
    add_gather_observer,
    current_gather_phase,
    gather_layout,
)
from lp_lightning.integration.refresh import (
    RefreshRecorder,
    RefreshReport,
    refresh_count,
    refresh_low_precision_weights,
    shard_group,
)
from lp_lightning.integration.sharding import (
    LowPrecisionShardingPlan,
    ReplicatedWeight,
    WeightPlacement,
    check_shard_legality,
    choose_shard_dim,
    gather_policy_for,
    illegal_shards_error,
    plan_low_precision_sharding,
    planned_placements,
    planned_shard_violations,
    planned_sharding,
    replicated_fallback_mesh,
    set_gather_policy,
)
from lp_lightning.integration.weights import (
    LowPrecisionWeightRecord,
    finalize_low_precision_weights,
    iter_low_precision_weights,
    local_low_precision_weight,
    low_precision_param_names,
    register_low_precision_params,
)

__all__ = [
    "GatherEvent",
    "GatherLayout",
    "GatherMetadata",
    "GatherPolicy",
    "GatherStage",
    "LowPrecisionShardingPlan",
    "LowPrecisionWeightRecord",
    "RefreshRecorder",
    "RefreshReport",
    "ReplicatedWeight",
    "WeightPlacement",
    "add_gather_observer",
    "check_shard_legality",
    "choose_shard_dim",
    "current_gather_phase",
    "finalize_low_precision_weights",
    "gather_layout",
    "gather_policy_for",
    "illegal_shards_error",
    "iter_low_precision_weights",
    "local_low_precision_weight",
    "low_precision_param_names",
    "plan_low_precision_sharding",
    "planned_placements",
    "planned_shard_violations",
    "planned_sharding",
    "refresh_count",
    "refresh_low_precision_weights",
    "register_low_precision_params",
    "replicated_fallback_mesh",
    "set_gather_policy",
    "shard_group",
]
