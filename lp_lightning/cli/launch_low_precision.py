"""The launch check of an mxfp8/hif8 ``lp-lightning fit``: the replacement plan compiled once on the meta
model, and the shard rule over the launch's world size (design spec §15).

It imports the plan and the FSDP2 shard rules at module top;
:func:`lp_lightning.cli.launch.check_launch` loads it for a low-precision launch only, so a bf16 run
imports none of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jsonargparse import Namespace
from torch import nn

from lp_lightning.fsdp.sharding import illegal_shards_error, planned_shard_violations
from lp_lightning.models.replacement import replacement_plan
from lp_lightning.policy import LowPrecisionConfig

__all__ = ["check_low_precision_launch"]


def check_low_precision_launch(
    section: Namespace, plan_rules: Sequence[Any] | None, world_size: int | None, meta: nn.Module
) -> None:
    """Compiles the plan once on the meta model of ``model.*`` and checks the shard rule (design spec §15).

    The plan of every rank (:func:`~lp_lightning.models.replacement.replacement_plan`) compiled and applied on the
    structure-only model: a target FQN naming no module, a module that is not the rule's
    ``module_type``, rule conflicts and unimportable ``module_type``/factory paths fail here. Then, with
    ``fsdp_config.fallback_to_unsharded: false`` and a known world size, every weight that breaks the
    format's shard rule along every dim it may take (dim 0, then the input dim: docs/architecture.md
    "Placements") is listed in one error (FQN, shape, rows per rank, the fix) instead of one
    traceback per rank; the strategy's per-rank check stays as a guard.

    ``meta`` is the meta model of ``model.*`` (:func:`lp_lightning.cli.launch.check_launch` builds it); the plan is
    applied to it.

    Raises:
        TypeError, ValueError, ImportError: from the plan, or the illegal shards.
    """
    policy = LowPrecisionConfig.from_precision(section["precision"]).to_policy()
    replacement_plan(meta, policy, plan_rules).apply(meta)
    fallback = section["fsdp_config"].get("fallback_to_unsharded")
    if world_size is not None and not fallback:
        violations = planned_shard_violations(
            meta, world_size, policy.format.value,
            input_dim_sharding=section["fsdp_config"].get("input_dim_sharding", True),
        )
        if violations:
            raise illegal_shards_error(violations, world_size)
