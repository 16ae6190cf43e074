"""Shard legality, the replicated fallback and the gather policy of a run (design spec §9.1–9.2, §13.5).

What surrounds the FSDP2 gather extension (:mod:`lp_lightning.integration.gather`), through
public APIs only. Every rule comes from the weight's ``FormatSpec``:

**Shard legality** (:func:`check_shard_legality`): FSDP2 shards dim 0; ``FormatSpec.shard_rule_violation``
says whether a split breaks the format. MXFP8 dense ``[M, K]`` needs every rank's
``M_local % 64 == 0``; MXFP8 grouped ``[E, D1, D2]`` needs ``(E_local * D1) % 64 == 0``; HiF8 has no
tile rule (its scale is per tensor, MAX-reduced, or per expert, and dim-0 sharding never splits an
expert). Uneven sharding (FSDP padding) and empty local shards are handled by the gather layout.

**Fallback** (:func:`plan_low_precision_sharding`): an illegal weight either fails at startup
(``fallback_to_unsharded=false``; ``ValueError`` naming FQN, shape, world size and rule) or stays
replicated (``true``). :func:`planned_shard_violations` applies the rule to a meta model after
``plan.apply``, so ``lp-lightning fit`` reports every illegal weight once, before launching (design
spec §15); the per-rank check stays as a guard. Replicated means: the owning module gets its own ``fully_shard`` over the
2-D mesh of :func:`replicated_fallback_mesh` — shape ``(W, 1)``, dims ``("dp_replicate",
"dp_shard")`` — i.e. HSDP with a shard group of one rank. Every rank then holds the full master and
the full low-precision storage, gradients are all-reduced over the replicate dim by FSDP2 (unlike
``ignored_params``, which would leave replicas to diverge), the extension still runs (a one-rank
"gather" of the low-precision bytes), and the module's GEMMs stay low precision. That
``fully_shard`` call must come before the one of the enclosing decoder layer so the parameters
are not also claimed by the layer's group.

Order of calls for the FSDP2 owner (design spec §12.1)::

    plan.apply(model)
    finalize_low_precision_weights(model, recipe=policy, build=False,
                                   gather_policy=gather_policy_for(reshard_after_forward=rafs, activation_checkpoint=ac))
    sharding = plan_low_precision_sharding(model, world_size, fallback_to_unsharded=flag)
    if sharding.replicated_modules:                      # one (W, 1) mesh, created once on every rank
        replicate_mesh = replicated_fallback_mesh(device_type, world_size)
    for fqn in sharding.replicated_modules:              # before the layers that contain them
        fully_shard(model.get_submodule(fqn), mesh=replicate_mesh, reshard_after_forward=rafs, ...)
    fully_shard(layer, mesh=dp_mesh, reshard_after_forward=rafs, ...) for each layer; fully_shard(model, ...)
    refresh_low_precision_weights(model.parameters())    # build the shards (every rank)
    optimizer = AdamW(model.parameters())                # FP32 masters, FP32 moments
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lp_lightning.formats.spec import FormatSpec, WeightKind, as_spec, shard_rows
from lp_lightning.integration.gather import GatherPolicy, current_gather_phase
from lp_lightning.integration.weights import (
    declared_low_precision_params,
    iter_low_precision_weights,
    local_low_precision_weight,
)
from lp_lightning.tensor.weight import QuantizedWeightTensor

__all__ = [
    "LowPrecisionShardingPlan",
    "ReplicatedWeight",
    "check_shard_legality",
    "current_gather_phase",
    "gather_policy_for",
    "illegal_shards_error",
    "plan_low_precision_sharding",
    "planned_shard_violations",
    "replicated_fallback_mesh",
    "set_gather_policy",
    "shard_rows",
]


def check_shard_legality(
    fqn: str,
    shape: tuple[int, ...],
    kind: WeightKind | str,
    world_size: int,
    format: FormatSpec | str,
) -> str | None:
    """Whether FSDP2 dim-0 sharding over ``world_size`` ranks is legal for one weight (design spec §9.1–9.2).

    Args:
        fqn: Parameter FQN (named in the reason).
        shape: Full logical parameter shape (dense ``[M, K]``, grouped ``[E, D1, D2]``).
        kind: ``"dense"`` or ``"grouped"``.
        world_size: FSDP shard-group size (≥ 1).
        format: A ``FormatSpec`` or a registered format name.

    Returns:
        ``None`` when legal, else a sentence naming the FQN, shape, world size and rule.

    Raises:
        ValueError: ``world_size < 1``, or a shape of the wrong rank for ``kind``.
    """
    kind, fmt = WeightKind.parse(kind), as_spec(format)
    if world_size < 1:
        raise ValueError(f"check_shard_legality({fqn!r}): world_size must be >= 1, got {world_size}.")
    want = 2 if kind is WeightKind.DENSE else 3
    if len(shape) != want:
        raise ValueError(f"check_shard_legality({fqn!r}): a {kind.value} weight is {want}-D, got shape {tuple(shape)}.")
    reason = fmt.shard_rule_violation(kind, tuple(shape), world_size)
    if reason is None:
        return None
    return f"{fqn}: shape {tuple(shape)} over world size {world_size}: {reason}"


@dataclass(frozen=True)
class ReplicatedWeight:
    """A weight kept replicated by ``fallback_to_unsharded`` (design spec §9.1).

    Attributes:
        fqn: Parameter FQN.
        module_fqn: FQN of the module that owns it (gets its own replicated ``fully_shard``).
        shape: Logical shape.
        reason: The violated rule.
    """

    fqn: str
    module_fqn: str
    shape: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class LowPrecisionShardingPlan:
    """How every low-precision weight will be placed (for the FSDP2 owner and the run summary).

    Attributes:
        world_size: FSDP shard-group size checked.
        sharded: FQNs of weights sharded on dim 0.
        replicated: Weights kept replicated (only with ``fallback_to_unsharded=True``).
    """

    world_size: int
    sharded: tuple[str, ...]
    replicated: tuple[ReplicatedWeight, ...]

    @property
    def replicated_modules(self) -> tuple[str, ...]:
        """Module FQNs to ``fully_shard`` over :func:`replicated_fallback_mesh` (deduplicated, in order)."""
        return tuple(dict.fromkeys(w.module_fqn for w in self.replicated))


def plan_low_precision_sharding(
    module: nn.Module, world_size: int, *, fallback_to_unsharded: bool
) -> LowPrecisionShardingPlan:
    """Check every low-precision weight of ``module`` against the shard rules, before ``fully_shard``.

    Args:
        module: The model after :func:`~lp_lightning.integration.weights.finalize_low_precision_weights`.
        world_size: FSDP shard-group size (the ``dp_shard`` mesh size).
        fallback_to_unsharded: ``fsdp_config.fallback_to_unsharded``.

    Returns:
        The :class:`LowPrecisionShardingPlan`.

    Raises:
        TypeError: ``fallback_to_unsharded`` is not a bool, or a weight is already sharded.
        ValueError: with ``fallback_to_unsharded=False``, listing every illegal weight (FQN, shape,
            world size, rule) and the fix.
    """
    if not isinstance(fallback_to_unsharded, bool):
        raise TypeError(f"fallback_to_unsharded must be a bool, got {fallback_to_unsharded!r}.")
    sharded: list[str] = []
    replicated: list[ReplicatedWeight] = []
    for fqn, param in iter_low_precision_weights(module):
        if not isinstance(param, QuantizedWeightTensor):
            raise TypeError(f"{fqn}: already sharded; plan low-precision sharding before fully_shard.")
        reason = check_shard_legality(fqn, tuple(param.shape), param.kind, world_size, param.format)
        if reason is None:
            sharded.append(fqn)
        else:
            module_fqn = fqn.rpartition(".")[0]
            replicated.append(ReplicatedWeight(fqn, module_fqn, tuple(param.shape), reason))
    if replicated and not fallback_to_unsharded:
        raise illegal_shards_error(replicated, world_size)
    # A replicated module's other low-precision weights go with it (one fully_shard unit per module).
    moved = {w.module_fqn for w in replicated}
    keep = [fqn for fqn in sharded if fqn.rpartition(".")[0] not in moved]
    for fqn, param in iter_low_precision_weights(module):
        if fqn in sharded and fqn not in keep:
            reason = f"{fqn}: shares its module with a replicated weight"
            replicated.append(ReplicatedWeight(fqn, fqn.rpartition(".")[0], tuple(param.shape), reason))
    return LowPrecisionShardingPlan(world_size=world_size, sharded=tuple(keep), replicated=tuple(replicated))


def illegal_shards_error(violations: Iterable[ReplicatedWeight], world_size: int) -> ValueError:
    """The error for illegal shards with ``fallback_to_unsharded=false``: each weight, shape, rows per rank, the fix.

    One message for the launch check (:func:`planned_shard_violations`) and the per-rank guard
    (:func:`plan_low_precision_sharding`), so both say the same.
    """
    violations = list(violations)
    lines = "\n  ".join(w.reason for w in violations)
    return ValueError(
        f"{len(violations)} low-precision weight(s) cannot be sharded over {world_size} ranks (design spec §9.1) "
        f"and fsdp_config.fallback_to_unsharded is false:\n  {lines}\nSet `fsdp_config.fallback_to_unsharded: true` "
        "(they stay replicated; their GEMMs stay low precision) or use another data-parallel size "
        "(trainer.devices x trainer.num_nodes)."
    )


def planned_shard_violations(
    module: nn.Module, world_size: int, format: FormatSpec | str
) -> tuple[ReplicatedWeight, ...]:
    """The shard-rule violations of the weights a replacement plan made low precision, before finalize.

    For the launch check (design spec §15 "illegal shard"): run it on the meta twin after
    ``plan.apply`` (structure only; the replaced modules declare their low-precision parameters,
    :func:`~lp_lightning.integration.weights.declared_low_precision_params`), so an illegal layout fails
    once, before any process or model exists. :func:`plan_low_precision_sharding` applies the same
    rule to the finalized weights on every rank.

    Args:
        module: A model (any device, meta included) after ``plan.apply``; not finalized.
        world_size: FSDP shard-group size.
        format: The run's format (``FormatSpec`` or registered name).

    Returns:
        One :class:`ReplicatedWeight` per illegal weight (FQN, owning module, shape, rule), in module
        order; ``()`` when every weight shards legally.

    Raises:
        ValueError: a module declares a low-precision parameter it does not have; see
            :func:`check_shard_legality`.
    """
    violations: list[ReplicatedWeight] = []
    for module_fqn, _, kind, params in declared_low_precision_params(module):
        for fqn, param in params:
            shape = tuple(param.shape)
            reason = check_shard_legality(fqn, shape, kind, world_size, format)
            if reason is not None:
                violations.append(ReplicatedWeight(fqn, module_fqn, shape, reason))
    return tuple(violations)


def replicated_fallback_mesh(device_type: str, world_size: int) -> torch.distributed.device_mesh.DeviceMesh:
    """The ``(W, 1)`` HSDP mesh ``("dp_replicate", "dp_shard")`` for replicated fallback weights.

    Creating a mesh creates process groups (a collective on every rank): call it once and reuse
    the mesh for every replicated module.

    Args:
        device_type: ``"cpu"``, ``"cuda"`` or ``"npu"``.
        world_size: Number of ranks (the default process group's size).

    Returns:
        A 2-D ``DeviceMesh``; pass it to ``fully_shard`` of the modules in
        ``LowPrecisionShardingPlan.replicated_modules``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world_size, 1), mesh_dim_names=("dp_replicate", "dp_shard"))


def gather_policy_for(*, reshard_after_forward: bool, activation_checkpoint: Literal["off", "full"]) -> GatherPolicy:
    """The :class:`~lp_lightning.integration.gather.GatherPolicy` of a run's FSDP2 settings.

    Args:
        reshard_after_forward: ``fsdp_config.reshard_after_forward`` (passed explicitly to every
            ``fully_shard`` call, including the root's).
        activation_checkpoint: ``"off"`` or ``"full"``.

    Returns:
        The policy (MXFP8 gathers one orientation per pass only for ``True`` + ``"off"``).
    """
    return GatherPolicy(reshard_after_forward=reshard_after_forward, activation_checkpoint=activation_checkpoint)


def set_gather_policy(params: Iterable[torch.Tensor] | nn.Module, policy: GatherPolicy) -> int:
    """Set the gather policy of every low-precision weight (plain or sharded) before the first forward.

    Args:
        params: A module or an iterable of parameters.
        policy: The new policy.

    Returns:
        Number of weights updated.

    Raises:
        ValueError: a weight was already all-gathered with another policy (FSDP2 fixed its buffers).
    """
    if isinstance(params, nn.Module):
        params = [p for _, p in iter_low_precision_weights(params)]
    count = 0
    for param in params:
        local = local_low_precision_weight(param)
        if local is not None:
            local.gather_policy = policy
            count += 1
    return count
