"""Shard legality, the replicated fallback and the gather policy of a run (design spec §9.1–9.2, §13.5).

What surrounds the FSDP2 gather extension (:mod:`lp_lightning.fsdp.gather`), through
public APIs only. Every rule comes from the weight's ``FormatSpec``:

**Placements** (:func:`choose_shard_dim`, :class:`WeightPlacement`): FSDP2 shards dim 0 unless a
``shard_placement_fn`` says otherwise; ``FormatSpec.shard_rule_violation(kind, shape, W, dim)``
says whether ``Shard(dim)`` breaks the format. Every weight takes ``Shard(0)`` when the format's
dim-0 rule holds (MXFP8 dense ``[M, K]``: every rank's ``M_local % 64 == 0``; grouped
``[E, D1, D2]``: ``(E_local * D1) % 64 == 0``; HiF8: always), else ``Shard(1)`` — the input
dimension — when that is legal (MXFP8 dense: ``K % W == 0`` and ``K_local % 64 == 0``, so every
row block lies in one shard and col blocks run along the whole ``M`` each rank holds), else it is
impossible to shard. Either shard quantises bit-identically to the full master. Uneven dim-0
sharding (FSDP padding) and empty local shards are handled by the gather layout.

**Fallback** (:func:`plan_low_precision_sharding`): a weight that no dim can shard either fails at
startup (``fallback_to_unsharded=false``; ``ValueError`` naming FQN, shape, world size and rule)
or stays replicated (``true``). :func:`planned_placements` applies the rules to a meta model after
``plan.apply``, so ``lp-lightning fit`` reports every impossible weight once, before launching
(design spec §15), and ``lp-lightning plan`` prints every placement; the per-rank check stays as a
guard. Replicated means: the owning module gets its own ``fully_shard`` over the
Order of calls for the FSDP2 owner (design spec §12.1)::

    plan.apply(model)
    finalize_low_precision_weights(model, recipe=policy, build=False,
                                   gather_policy=gather_policy_for(reshard_after_forward=rafs, activation_checkpoint=ac))
    sharding = plan_low_precision_sharding(model, world_size, fallback_to_unsharded=flag)
    placement_fn = sharding.shard_placement_fn()         # Shard(1) for the input-dim weights, else FSDP2's default
    if sharding.replicated_modules:                      # one (W, 1) mesh, created once on every rank
        replicate_mesh = replicated_fallback_mesh(device_type, world_size)
    for fqn in sharding.replicated_modules:              # before the layers that contain them
        fully_shard(model.get_submodule(fqn), mesh=replicate_mesh, reshard_after_forward=rafs, ...)
    fully_shard(layer, mesh=dp_mesh, reshard_after_forward=rafs, shard_placement_fn=placement_fn, ...) for each
    layer; fully_shard(model, ..., shard_placement_fn=placement_fn)
    refresh_low_precision_weights(model.parameters())    # build the shards (every rank)
    optimizer = AdamW(model.parameters())                # FP32 masters, FP32 moments
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lp_lightning.config import ActivationCheckpointMode
from lp_lightning.formats.spec import FormatSpec, WeightKind, as_spec, shard_rows
from lp_lightning.fsdp.gather import GatherPolicy, current_gather_phase
from lp_lightning.fsdp.weights import (
    declared_low_precision_params,
    iter_low_precision_weights,
    local_low_precision_weight,
)
from lp_lightning.tensor.weight import QuantizedWeightTensor

__all__ = [
    "LowPrecisionShardingPlan",
    "ReplicatedWeight",
    "WeightPlacement",
    "check_shard_legality",
    "choose_shard_dim",
    "current_gather_phase",
    "gather_policy_for",
    "illegal_shards_error",
    "plan_low_precision_sharding",
    "planned_placements",
    "planned_sharding",
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
    dim: int = 0,
) -> str | None:
    """Whether FSDP2 ``Shard(dim)`` over ``world_size`` ranks is legal for one weight (design spec §9.1–9.2).

    Args:
        fqn: Parameter FQN (named in the reason).
        shape: Full logical parameter shape (dense ``[M, K]``, grouped ``[E, D1, D2]``).
        kind: ``"dense"`` or ``"grouped"``.
        world_size: FSDP shard-group size (≥ 1).
        format: A ``FormatSpec`` or a registered format name.
        dim: The sharded dim (0: FSDP2's default; 1: the input dimension of a dense weight).

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
    reason = fmt.shard_rule_violation(kind, tuple(shape), world_size, dim)
    if reason is None:
        return None
    return f"{fqn}: shape {tuple(shape)} over world size {world_size}: {reason}"


SHARD_DIM_CANDIDATES: tuple[int, ...] = (0, 1)
"""Dims tried in order: FSDP2's default, then the input dimension of a dense weight."""


def choose_shard_dim(
    fqn: str,
    shape: tuple[int, ...],
    kind: WeightKind | str,
    world_size: int,
    format: FormatSpec | str,
    *,
    input_dim_sharding: bool = True,
) -> tuple[int | None, str | None, str | None]:
    """The FSDP2 shard dim of one weight (module docstring "Placements"); ``input_dim_sharding=False``
    (``fsdp_config.input_dim_sharding``) tries dim 0 only.

    Returns:
        ``(shard_dim, dim0_violation, reason)``: ``shard_dim`` is 0, 1 or ``None`` (no legal dim:
        replicate or fail); ``dim0_violation`` is the design spec §9.1 dim-0 verdict (``None``: it
        holds); ``reason`` is ``None`` for ``Shard(0)``, else why dim 0 was not taken and, when no
        dim is legal, why each other dim fails.

    Raises:
        ValueError: as :func:`check_shard_legality`.
    """
    kind = WeightKind.parse(kind)
    dim0 = check_shard_legality(fqn, shape, kind, world_size, format, 0)
    if dim0 is None:
        return 0, None, None
    failures = [dim0]
    for dim in SHARD_DIM_CANDIDATES[1:] if input_dim_sharding else ():
        if dim >= len(shape):
            continue
        reason = check_shard_legality(fqn, shape, kind, world_size, format, dim)
        if reason is None:
            return dim, dim0, f"{dim0}; Shard({dim}) is legal"
        failures.append(reason.partition(f"over world size {world_size}: ")[2])
    if not input_dim_sharding:
        failures.append("fsdp_config.input_dim_sharding is false")
    return None, dim0, "; ".join(failures)


@dataclass(frozen=True)
class WeightPlacement:
    """Where one low-precision weight lives under FSDP2 (``lp-lightning plan``, the run summary).

    Attributes:
        fqn: Parameter FQN.
        module_fqn: FQN of the module that owns it.
        shape: Full logical shape.
        kind: ``"dense"`` or ``"grouped"``.
        shard_dim: FSDP2 ``Shard(shard_dim)``, or ``None``: no legal dim (replicated by
            ``fallback_to_unsharded``, else a startup error).
        dim0_violation: The design spec §9.1 dim-0 rule's verdict; ``None`` when it holds.
        reason: ``None`` for ``Shard(0)``; else why not dim 0 and, when replicated, why no dim is legal.
    """

    fqn: str
    module_fqn: str
    shape: tuple[int, ...]
    kind: str
    shard_dim: int | None
    dim0_violation: str | None
    reason: str | None

    @property
    def placement(self) -> str:
        """``"Shard(0)"``, ``"Shard(1)"`` or ``"replicated"``."""
        return "replicated" if self.shard_dim is None else f"Shard({self.shard_dim})"


def _placement(
    fqn: str, shape: tuple[int, ...], kind: WeightKind | str, world_size: int, fmt: Any, input_dim_sharding: bool
) -> WeightPlacement:
    kind = WeightKind.parse(kind)
    dim, dim0, reason = choose_shard_dim(fqn, shape, kind, world_size, fmt, input_dim_sharding=input_dim_sharding)
    return WeightPlacement(fqn, fqn.rpartition(".")[0], shape, kind.value, dim, dim0, reason)


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
        sharded: FQNs of weights FSDP2 shards (``Shard(0)`` or ``Shard(1)``).
        replicated: Weights kept replicated (only with ``fallback_to_unsharded=True``).
        placements: One :class:`WeightPlacement` per low-precision weight, in module order.
    """

    world_size: int
    sharded: tuple[str, ...]
    replicated: tuple[ReplicatedWeight, ...]
    placements: tuple[WeightPlacement, ...] = ()

    @property
    def replicated_modules(self) -> tuple[str, ...]:
        """Module FQNs to ``fully_shard`` over :func:`replicated_fallback_mesh` (deduplicated, in order)."""
        return tuple(dict.fromkeys(w.module_fqn for w in self.replicated))

    @property
    def input_dim_sharded(self) -> tuple[str, ...]:
        """FQNs of the weights sharded along a dim other than 0."""
        return tuple(p.fqn for p in self.placements if p.shard_dim not in (0, None))

    def shard_placement_fn(self, module: nn.Module) -> Callable[[nn.Parameter], Any] | None:
        """FSDP2's ``shard_placement_fn`` for ``module``'s ``fully_shard`` calls: ``Shard(d)`` for the
        weights planned on a dim ``d > 0``, ``None`` (FSDP2's ``Shard(0)``) for every other parameter;
        ``None`` when every weight takes dim 0.

        Raises:
            ValueError: a planned FQN is not a parameter of ``module``.
        """
        from torch.distributed.tensor import Shard

        other = {p.fqn: p.shard_dim for p in self.placements if p.shard_dim not in (0, None)}
        if not other:
            return None
        params = dict(module.named_parameters())
        missing = sorted(set(other) - set(params))
        if missing:
            raise ValueError(f"shard_placement_fn: planned weights {missing[:3]} are not parameters of the module.")
        by_id = {id(params[fqn]): Shard(dim) for fqn, dim in other.items()}

        def placement(param: nn.Parameter) -> Any:
            return by_id.get(id(param))

        return placement


def plan_low_precision_sharding(
    module: nn.Module, world_size: int, *, fallback_to_unsharded: bool, input_dim_sharding: bool = True
) -> LowPrecisionShardingPlan:
    """Place every low-precision weight of ``module`` (module docstring "Placements"), before ``fully_shard``.

    Args:
        module: The model after :func:`~lp_lightning.fsdp.weights.finalize_low_precision_weights`.
        world_size: FSDP shard-group size (the ``dp_shard`` mesh size).
        fallback_to_unsharded: ``fsdp_config.fallback_to_unsharded``.
        input_dim_sharding: ``fsdp_config.input_dim_sharding`` (``False``: dim 0 only).

    Returns:
        The :class:`LowPrecisionShardingPlan`.

    Raises:
        TypeError: ``fallback_to_unsharded`` is not a bool, or a weight is already sharded.
        ValueError: with ``fallback_to_unsharded=False``, listing every weight no dim can shard
            (FQN, shape, world size, rules) and the fix.
    """
    if not isinstance(fallback_to_unsharded, bool):
        raise TypeError(f"fallback_to_unsharded must be a bool, got {fallback_to_unsharded!r}.")
    placements: list[WeightPlacement] = []
    for fqn, param in iter_low_precision_weights(module):
        if not isinstance(param, QuantizedWeightTensor):
            raise TypeError(f"{fqn}: already sharded; plan low-precision sharding before fully_shard.")
        placements.append(_placement(fqn, tuple(param.shape), param.kind, world_size, param.format, input_dim_sharding))
    return _sharding_plan(placements, world_size, fallback_to_unsharded)


def _sharding_plan(
    placements: list[WeightPlacement], world_size: int, fallback_to_unsharded: bool
) -> LowPrecisionShardingPlan:
    impossible = [ReplicatedWeight(p.fqn, p.module_fqn, p.shape, str(p.reason)) for p in placements if p.shard_dim is None]
    if impossible and not fallback_to_unsharded:
        raise illegal_shards_error(impossible, world_size)
    # A replicated module's other low-precision weights go with it (one fully_shard unit per module).
    moved = {w.module_fqn for w in impossible}
    final: list[WeightPlacement] = []
    replicated: list[ReplicatedWeight] = []
    for p in placements:
        if p.shard_dim is not None and p.module_fqn in moved:
            reason = f"{p.fqn}: shares its module with a replicated weight"
            p = WeightPlacement(p.fqn, p.module_fqn, p.shape, p.kind, None, p.dim0_violation, reason)
        if p.shard_dim is None:
            replicated.append(ReplicatedWeight(p.fqn, p.module_fqn, p.shape, str(p.reason)))
        final.append(p)
    sharded = tuple(p.fqn for p in final if p.shard_dim is not None)
    return LowPrecisionShardingPlan(world_size, sharded, tuple(replicated), tuple(final))


def illegal_shards_error(violations: Iterable[ReplicatedWeight], world_size: int) -> ValueError:
    """The error for illegal shards with ``fallback_to_unsharded=false``: each weight, shape, rows per rank, the fix.

    One message for the launch check (:func:`planned_shard_violations`) and the per-rank guard
    (:func:`plan_low_precision_sharding`), so both say the same.
    """
    violations = list(violations)
    lines = "\n  ".join(w.reason for w in violations)
    return ValueError(
        f"{len(violations)} low-precision weight(s) cannot be sharded over {world_size} ranks along any dim "
        f"(design spec §9.1; docs/architecture.md \"Placements\") "
        f"and fsdp_config.fallback_to_unsharded is false:\n  {lines}\nSet `fsdp_config.fallback_to_unsharded: true` "
        "(they stay replicated; their GEMMs stay low precision) or use another data-parallel size "
        "(trainer.devices x trainer.num_nodes)."
    )


def planned_placements(
    module: nn.Module, world_size: int, format: FormatSpec | str, *, input_dim_sharding: bool = True
) -> tuple[WeightPlacement, ...]:
    """The placement of every weight a replacement plan made low precision, before finalize.

    For the launch check (design spec §15 "illegal shard") and ``lp-lightning plan``: run it on the
    meta twin after ``plan.apply`` (structure only; the replaced modules declare their
    low-precision parameters, :func:`~lp_lightning.fsdp.weights.declared_low_precision_params`),
    so an impossible layout fails once, before any process or model exists.
    :func:`plan_low_precision_sharding` applies the same rules to the finalized weights on every rank.

    Args:
        module: A model (any device, meta included) after ``plan.apply``; not finalized.
        world_size: FSDP shard-group size.
        format: The run's format (``FormatSpec`` or registered name).
        input_dim_sharding: ``fsdp_config.input_dim_sharding`` (``False``: dim 0 only).

    Returns:
        One :class:`WeightPlacement` per low-precision weight, in module order (before the
        fallback's "shares its module" step: see :func:`planned_sharding`).

    Raises:
        ValueError: a module declares a low-precision parameter it does not have; see
            :func:`check_shard_legality`.
    """
    placements: list[WeightPlacement] = []
    for module_fqn, _, kind, params in declared_low_precision_params(module):
        for fqn, param in params:
            p = _placement(fqn, tuple(param.shape), kind, world_size, format, input_dim_sharding)
            placements.append(WeightPlacement(p.fqn, module_fqn, p.shape, p.kind, p.shard_dim, p.dim0_violation, p.reason))
    return tuple(placements)


def planned_sharding(
    module: nn.Module,
    world_size: int,
    format: FormatSpec | str,
    *,
    fallback_to_unsharded: bool,
    input_dim_sharding: bool = True,
) -> LowPrecisionShardingPlan:
    """:func:`plan_low_precision_sharding` on a meta twin after ``plan.apply`` (see :func:`planned_placements`).

    Raises:
        ValueError: as :func:`plan_low_precision_sharding`.
    """
    placements = planned_placements(module, world_size, format, input_dim_sharding=input_dim_sharding)
    return _sharding_plan(list(placements), world_size, fallback_to_unsharded)


def planned_shard_violations(
    module: nn.Module, world_size: int, format: FormatSpec | str, *, input_dim_sharding: bool = True
) -> tuple[ReplicatedWeight, ...]:
    """The weights of :func:`planned_placements` that no dim can shard (``ReplicatedWeight``: FQN,
    owning module, shape, the rules that fail); ``()`` when every weight shards legally."""
    return tuple(
        ReplicatedWeight(p.fqn, p.module_fqn, p.shape, str(p.reason))
        for p in planned_placements(module, world_size, format, input_dim_sharding=input_dim_sharding)
        if p.shard_dim is None
    )


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


def gather_policy_for(*, reshard_after_forward: bool, activation_checkpoint: ActivationCheckpointMode) -> GatherPolicy:
    """The :class:`~lp_lightning.fsdp.gather.GatherPolicy` of a run's FSDP2 settings.

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
