"""Refresh of low-precision weight shards from their FP32 masters (design spec §9.2, §10, §13.6; R7, R8).

:func:`refresh_low_precision_weights` is the one entry point that rebuilds the derived
low-precision storage of ``QuantizedWeightTensor`` parameters, plain or FSDP2-sharded
(``DTensor`` over a ``QuantizedWeightTensor`` shard). Call it

- once after ``fully_shard`` (FSDP2 creates fresh, unbuilt shards; design spec §10 "FSDP 完成本地分片后,
  用对应高精 shard 创建" the low-precision shard),
- once after each *successful* ``optimizer.step()`` (never on micro-steps, ``zero_grad``,
  activation recompute, or a skipped/non-finite step — the caller decides success),
- once after a checkpoint load has restored the masters (design spec §11).

Every rank must call it with the same parameters in the same order: a weight whose scale is per
tensor (``AmaxScope.TENSOR``: HiF8 dense) has its local master-shard amax MAX-reduced over its FSDP
shard group first (every rank joins, also ranks
whose shard is empty), so all ranks quantise with one scale and the all-gathered weight equals
quantising the full master with that scale (design spec §9.2). The reduction is batched: one
``all_reduce(MAX)`` per shard group per call. Non-finite local amaxes are reduced as ``+inf``
(the scale then falls back to 1.0 on every rank, as the quantizer's rule for a non-finite amax),
so ranks never disagree because a NaN compared differently. Per-block (MXFP8) and per-group
(HiF8 grouped; experts never split) scales are local and need no communication.

Finiteness: the report carries each refreshed weight's local master amax (the per-tensor amax
computed for the reduction above where there is one, else one ``max |master|`` per weight), so the
non-finite guard learns whether a master holds NaN/Inf without reading the masters again
(:func:`lp_lightning.checkpoint.finite.first_nonfinite`; docs/architecture.md "The non-finite guard").

Counting (for tests and the ST probe's ``refresh.per_step``): each weight keeps
``refresh_count``; :class:`RefreshRecorder` records every storage build in the process while
active; ``lp_lightning.tensor.storage.total_refresh_count()`` is the process-wide total.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lp_lightning.formats.amax import abs_max
from lp_lightning.formats.spec import AmaxScope
from lp_lightning.fsdp.weights import local_low_precision_weight
from lp_lightning.observers import notify_collective
from lp_lightning.tensor.storage import add_refresh_observer, total_refresh_count
from lp_lightning.tensor.weight import QuantizedWeightTensor, is_master_of

__all__ = [
    "RefreshRecorder",
    "RefreshReport",
    "local_low_precision_weight",
    "refresh_count",
    "refresh_low_precision_weights",
    "shard_group",
    "total_refresh_count",
]


def shard_group(param: torch.Tensor) -> dist.ProcessGroup | None:
    """The process group ``param`` is sharded over (FSDP2 shard dim of its mesh), or ``None``.

    Args:
        param: A parameter; plain tensors and meshes whose shard dim has size 1 (replicated
            fallback, design spec §9.1) give ``None``.

    Returns:
        The shard-dim process group or ``None``.

    Raises:
        ValueError: the DTensor is sharded over more than one mesh dimension (TP/EP are
            unsupported, design spec §15).
    """
    if not isinstance(param, DTensor):
        return None
    shard_dims = [i for i, placement in enumerate(param.placements) if placement.is_shard()]
    if len(shard_dims) > 1:
        raise ValueError(
            f"a low-precision weight is sharded over mesh dims {shard_dims} ({param.placements}); only one "
            "FSDP shard dimension is supported (TP/CP/EP/PP must be 1, design spec §15)."
        )
    if not shard_dims or param.device_mesh.size(shard_dims[0]) == 1:
        return None
    return param.device_mesh.get_group(shard_dims[0])


@dataclass(frozen=True)
class RefreshReport:
    """What one :func:`refresh_low_precision_weights` call did.

    Attributes:
        refreshed: FQNs rebuilt, in call order (each exactly once).
        skipped: Number of parameters that hold no low-precision weight (left untouched).
        amax_all_reduces: Number of ``all_reduce(MAX)`` collectives issued (per-tensor scales).
        master_amax: One FP32 0-d tensor per ``refreshed`` weight: ``max |x|`` of this rank's master
            shard before the refresh (0 for an empty shard; NaN/Inf when the shard holds one).
    """

    refreshed: tuple[str, ...]
    skipped: int
    amax_all_reduces: int
    master_amax: tuple[torch.Tensor, ...] = ()


@torch.no_grad()
def refresh_low_precision_weights(
    params: Iterable[torch.Tensor],
    master_params: Iterable[torch.Tensor] | None = None,
) -> RefreshReport:
    """Rebuild every low-precision weight in ``params`` exactly once from its master (design spec §13.6).

    Args:
        params: Parameters (e.g. ``model.parameters()`` or an optimizer's params); those without a
            low-precision weight are skipped.
        master_params: Optional, same length as ``params``: the tensors the optimizer updated.
            With FP32 master weights kept *inside* the parameter (this package's design) each must
            be the parameter itself or alias its master; anything else (a copy, a dequantised
            weight) raises — the storage is only ever rebuilt from the authoritative master.

    Returns:
        A :class:`RefreshReport`.

    Raises:
        ValueError: a weight appears twice, ``master_params`` has another length or holds a tensor
            that is not the corresponding master.
    """
    params = list(params)
    masters = None if master_params is None else list(master_params)
    if masters is not None and len(masters) != len(params):
        raise ValueError(
            f"refresh_low_precision_weights: {len(params)} params but {len(masters)} master_params; pass one "
            "master per parameter (or none)."
        )
    entries: list[tuple[torch.Tensor, QuantizedWeightTensor]] = []
    seen: dict[int, str] = {}
    skipped = 0
    for i, param in enumerate(params):
        local = local_low_precision_weight(param)
        if local is None:
            skipped += 1
            continue
        key = local.state_key
        if key in seen:
            raise ValueError(
                f"refresh_low_precision_weights: weight {local.fqn!r} appears twice (also as {seen[key]!r}); each "
                "weight is refreshed exactly once per call."
            )
        seen[key] = local.fqn
        if masters is not None:
            master = masters[i]
            candidate = master
            if isinstance(master, DTensor):
                with torch.no_grad():
                    candidate = master.to_local()
            if master is not param and not is_master_of(candidate, local):
                raise ValueError(
                    f"refresh_low_precision_weights: master_params[{i}] (shape {tuple(master.shape)}, dtype "
                    f"{master.dtype}) is not the master of {local.fqn!r}; pass the FP32 masters the optimizer "
                    "updated (design spec §10)."
                )
        entries.append((param, local))

    # Per-tensor scales (HiF8 dense): MAX-reduce the local amaxes per shard group (one collective per group).
    amax_for: dict[int, torch.Tensor] = {}
    local_amax: dict[int, torch.Tensor] = {}  # before the reduction: what this rank's master holds
    by_group: dict[int, tuple[dist.ProcessGroup, list[QuantizedWeightTensor]]] = {}
    for param, local in entries:
        if local.amax_scope is AmaxScope.TENSOR:
            group = shard_group(param)
            if group is not None:
                by_group.setdefault(id(group), (group, []))[1].append(local)
    reduces = 0
    for group, weights in by_group.values():
        amax = torch.stack([w.local_amax() for w in weights])
        local_amax.update((w.state_key, value) for w, value in zip(weights, amax.unbind(0)))
        amax = torch.where(torch.isfinite(amax), amax, torch.full_like(amax, math.inf))
        notify_collective("all_reduce", amax, "refresh.amax")
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        reduces += 1
        for w, value in zip(weights, amax.unbind(0)):
            amax_for[w.state_key] = value
    master_amax = tuple(
        local_amax[local.state_key] if local.state_key in local_amax else _master_amax(local) for _, local in entries
    )
    for _, local in entries:
        local.refresh_from_master(amax=amax_for.get(local.state_key))
    return RefreshReport(
        refreshed=tuple(local.fqn for _, local in entries), skipped=skipped, amax_all_reduces=reduces,
        master_amax=master_amax,
    )


def _master_amax(weight: QuantizedWeightTensor) -> torch.Tensor:
    return abs_max(weight.master)


def refresh_count(param: torch.Tensor) -> int:
    """How many times ``param``'s low-precision storage (this rank's shard) was built.

    Raises:
        TypeError: ``param`` holds no low-precision weight.
    """
    local = local_low_precision_weight(param)
    if local is None:
        raise TypeError(
            f"refresh_count: {type(param).__name__} of shape {tuple(param.shape)} is not a low-precision weight."
        )
    return local.refresh_count


class RefreshRecorder:
    """Context manager recording every low-precision storage build in this process (read-only).

    Example::

        with RefreshRecorder() as rec:
            trainer_step()
        assert rec.counts == {"model.layers.0.mlp.gate_proj.weight": 1, ...}

    Attributes:
        events: FQNs in build order.
    """

    def __init__(self) -> None:
        self.events: list[str] = []
        self._handle: Any = None

    def __enter__(self) -> RefreshRecorder:
        if self._handle is not None:
            raise RuntimeError("RefreshRecorder is already active; use one `with` block per recorder.")
        self._handle = add_refresh_observer(lambda weight: self.events.append(weight.fqn))
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()
        self._handle = None

    @property
    def counts(self) -> dict[str, int]:
        """Builds per FQN."""
        return dict(Counter(self.events))

    @property
    def total(self) -> int:
        """Total builds recorded."""
        return len(self.events)
