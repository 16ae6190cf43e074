"""The FSDP2 lifecycle of one low-precision run, as one object (design spec §9–§12.1).

The low-precision precision plugin owns one :class:`LowPrecisionLifecycle` (``plugin.lifecycle``)
and the FSDP2 strategy hands it to :func:`~lp_lightning.fsdp.parallelize.parallelize_causal_lm`,
which knows it only as the :class:`~lp_lightning.fsdp.parallelize.WeightLifecycle` protocol; a
bf16 plugin's ``lifecycle`` is ``None`` and nothing here is imported. In run order::

    configure(reshard_after_forward=..., activation_checkpoint=...)   # the MXFP8 gather policy
    finalize(causal_lm, recipe=policy)      # FP32 masters + gather spec, storage unbuilt
    plan_sharding(causal_lm, W, ...)        # parallelize: Shard(0) / Shard(1) / replicated fallback
    replicated_mesh(device_type, W)         #   the (W, 1) mesh of the fallback modules
    refresh_after_shard(parameters)         #   one refresh: fully_shard made fresh, unbuilt shards
    after_step(params)                      # the plugin: ONE refresh per applied optimizer step
    after_load(causal_lm)                   # the strategy: ONE refresh after a DCP load

Each refresh rebuilds every weight once from its FP32 master; :attr:`LowPrecisionLifecycle.refreshes`
counts the calls by reason (run_summary.json ``refreshes``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lp_lightning.config import ActivationCheckpointMode
from lp_lightning.fsdp.gather import GatherPolicy
from lp_lightning.fsdp.refresh import refresh_low_precision_weights
from lp_lightning.fsdp.sharding import (
    LowPrecisionShardingPlan,
    gather_policy_for,
    plan_low_precision_sharding,
    replicated_fallback_mesh,
)
from lp_lightning.fsdp.weights import (
    LowPrecisionWeightRecord,
    finalize_low_precision_weights,
    iter_low_precision_weights,
    local_low_precision_weight,
)
from lp_lightning.policy import LowPrecisionPolicy
from lp_lightning.tensor.weight import QuantizedWeightTensor

__all__ = ["LowPrecisionLifecycle"]


class LowPrecisionLifecycle:
    """Gather policy, finalize, placement, replicated mesh and refreshes of one run (module docstring).

    Attributes:
        gather_policy: The run's :class:`~lp_lightning.fsdp.gather.GatherPolicy` once :meth:`configure`
            ran (``None`` before: a model finalized without a strategy builds its storage at once).
        refreshes: Refresh calls by reason: ``"startup"`` (after ``fully_shard``), ``"step"`` (per
            applied optimizer step), ``"resume"`` (after a checkpoint load).
    """

    def __init__(self) -> None:
        self.gather_policy: GatherPolicy | None = None
        self.refreshes: dict[str, int] = {"startup": 0, "step": 0, "resume": 0}

    def configure(self, *, reshard_after_forward: bool, activation_checkpoint: ActivationCheckpointMode) -> None:
        """Fixes the gather policy of the strategy's FSDP2 settings (before :meth:`finalize`: FSDP2 sizes each
        gather once)."""
        self.gather_policy = gather_policy_for(
            reshard_after_forward=reshard_after_forward, activation_checkpoint=activation_checkpoint
        )

    def finalize(self, causal_lm: nn.Module, *, recipe: LowPrecisionPolicy) -> list[LowPrecisionWeightRecord]:
        """Turns the replaced modules' declared parameters into FP32-master weights carrying the gather spec.

        With a configured gather policy the storage stays unbuilt (``fully_shard`` replaces each
        parameter by a shard that :meth:`refresh_after_shard` builds); without one it is built at once.
        """
        sharded_later = self.gather_policy is not None
        return finalize_low_precision_weights(
            causal_lm,
            recipe=recipe,
            gather_policy=self.gather_policy if sharded_later else GatherPolicy(),
            master_dtype=torch.float32,
            build=not sharded_later,
        )

    @staticmethod
    def holds_weights(module: nn.Module) -> bool:
        """Whether ``module`` holds a low-precision weight already (a second conversion)."""
        return any(True for _ in iter_low_precision_weights(module))

    @staticmethod
    def local_weight(param: torch.Tensor) -> QuantizedWeightTensor | None:
        """The local low-precision weight of a parameter (plain or DTensor shard), ``None`` for a plain one."""
        return local_low_precision_weight(param)

    # -- WeightLifecycle: what parallelize_causal_lm calls ----------------------------------------
    def plan_sharding(
        self, causal_lm: nn.Module, world_size: int, *, fallback_to_unsharded: bool, input_dim_sharding: bool
    ) -> LowPrecisionShardingPlan | None:
        """:func:`~lp_lightning.fsdp.sharding.plan_low_precision_sharding`; ``None`` when ``causal_lm`` holds no
        low-precision weight.

        Raises:
            ValueError: A weight no dim can shard and ``fallback_to_unsharded`` is off (FQN, shape, world size, rules).
        """
        if not any(self.local_weight(p) is not None for p in causal_lm.parameters()):
            return None
        return plan_low_precision_sharding(
            causal_lm, world_size, fallback_to_unsharded=fallback_to_unsharded, input_dim_sharding=input_dim_sharding
        )

    def replicated_mesh(self, device_type: str, world_size: int) -> DeviceMesh:
        """:func:`~lp_lightning.fsdp.sharding.replicated_fallback_mesh`: the ``(W, 1)`` mesh."""
        return replicated_fallback_mesh(device_type, world_size)

    def refresh_after_shard(self, parameters: Iterable[torch.Tensor]) -> None:
        """Builds every low-precision shard once from its FP32 master shard (counted as ``"startup"``)."""
        refresh_low_precision_weights(parameters)
        self.refreshes["startup"] += 1

    # -- the plugin's and the strategy's refreshes ------------------------------------------------
    def after_step(self, params: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Refreshes the weights among ``params``; returns each weight's master amax (the non-finite guard reads it)."""
        amax = refresh_low_precision_weights(params).master_amax
        self.refreshes["step"] += 1
        return amax

    def after_load(self, causal_lm: nn.Module) -> None:
        """Refreshes every weight of ``causal_lm`` after a DCP load (collective: HiF8 MAX-reduces its amax)."""
        refresh_low_precision_weights(causal_lm.parameters())
        self.refreshes["resume"] += 1
