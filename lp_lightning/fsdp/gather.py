"""The FSDP2 gather extension of low-precision weights (design spec §9, §13.5).

torch's FSDP2 calls ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on a sharded parameter's
local tensor; a ``QuantizedWeightTensor`` forwards both to its own gather spec
(``lp_lightning.tensor.GatherSpec``), the :class:`GatherPolicy` that finalize set on it (no
process-wide slot: what a weight does when gathered is in the weight). Only public
arguments of the hooks are read (no private FSDP state), and only the generic ``FormatSpec``
protocol: whether the format's orientation is physical, the scale shapes, the shard rule.

**Why a fixed schema.** FSDP2 sizes a parameter's all-gather output buffers once, from the first
call's (count, numel, dtype) of the physical tensors, and re-uses them. The design spec's direction
table (§9.1: MXFP8 forward with ``reshard_after_forward=true`` gathers one orientation, otherwise two)
is therefore realised as one schema per weight: ``(data, scale)`` slots whose contents are the
forward orientation in forward and the dgrad orientation in backward, or four slots (both
orientations) in every gather when the gathered copy must serve both passes.

**Why the phase comes from autograd.** FSDP2 passes no phase argument. A gather runs in backward
exactly when the autograd engine is executing a graph task on this thread
(``torch._C._current_graph_task_id() != -1``): pre-backward unshard, backward prefetch, and the
forward re-run of ``activation_checkpoint="full"``. Whether the forward copy survives into backward
is configuration (``reshard_after_forward``, activation checkpointing), which the weight is told at
finalize time as a :class:`GatherPolicy` — see :func:`gather_policy_for`.

**The schema** (:class:`GatherLayout`, fixed per parameter): every slot is ``uint8`` (gloo cannot
all-gather float8), data slots come first (``[S0, *rest]``, ``S0 = ceil(D0 / W)`` rows of the
padded shard), then scale slots. It follows from the format's ``FormatSpec``:

=======================================  =====================================================
weight                                   slots (in order)
=======================================  =====================================================
orientation is metadata (HiF8)           ``data``, ``scale`` (a 0-d scale: once per rank,
                                         checked equal; a per-expert scale: sharded with E)
physical orientation (MXFP8), one        ``data``, ``scale`` — forward fills the fprop orientation
orientation per gather                   (dense row / grouped col), backward the dgrad one
                                         (dense col / grouped row); the scale slot is sized to
                                         the larger of the two
physical orientation, both orientations  ``row_data``, ``col_data``, ``row_scale``, ``col_scale``
=======================================  =====================================================

With uneven dim-0 sharding (``D0 % W != 0``), FSDP2 requires every all-gather input to have the
padded shard shape ``[S0, *rest]``, so the scale bytes travel packed in ``ceil(scale_bytes /
shard_bytes)`` slots of that shape instead (one extra data-sized message per uneven weight).

**Input-dim shards** (``Shard(1)``, a dense weight whose dim 0 breaks the format's shard rule;
docs/architecture.md "Placements"): every rank holds ``[D0, D1 / W]`` and every storage tensor
(``[D0, D1/W]`` data, ``[D0, D1/W/32]`` row scale, ``[nb(D0), D1/W]`` col scale) is split along its
dim 1. FSDP2 views each gathered slot as ``W`` shard-shaped pieces and concatenates them along dim 1,
so every slot must be shard-shaped: the data slots arrive as the full ``[D0, D1]`` bytes (zero
copy), the scale bytes travel packed in shard-shaped slots as above and are reassembled (column
concatenation of the ranks' scale tensors) in the post hook. The scale slots make such a weight's
gather one data-sized message larger than its bytes; the alternative, replication, gathers nothing
but keeps the full master, moments and gradient on every rank and all-reduces the gradient.

Gather events: every pre-all-gather calls the observers of :func:`add_gather_observer` with a
:class:`GatherEvent` of stage ``"pre_all_gather"`` (FQN, phase, orientations, the ``uint8`` slots,
whether the shard group has one rank); probes count wire bytes through it. Every post-all-gather
(the first call and each ``out=`` refill) sends one of stage ``"post_all_gather"`` with the rebuilt
storage tensors (views of the gathered buffers, named ``row_data`` / ``col_scale`` / ``data`` /
``scale`` ...) and the logical shape and dtype of the gathered weight, built only while an
observer is registered.

Tensor-name legend: ``D0`` the first dim of the parameter, ``D1`` its second, ``W`` the FSDP
shard-group size, ``S0`` rows per rank of the padded dim-0 shard, ``L`` this rank's rows.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from lp_lightning.config import ActivationCheckpointMode, check_activation_checkpoint
from lp_lightning.formats.spec import ORIENTATIONS, FormatSpec, Orientation, WeightKind, as_spec, shard_rows
from lp_lightning.observers import ObserverHandle, Observers
from lp_lightning.tensor.gathered import GatheredWeightTensor
from lp_lightning.tensor.storage import nbytes as _nbytes
from lp_lightning.tensor.storage import storage_spec
from lp_lightning.tensor.weight import QuantizedWeightTensor

__all__ = [
    "GatherEvent",
    "GatherLayout",
    "GatherMetadata",
    "GatherPhase",
    "GatherPolicy",
    "GatherStage",
    "add_gather_observer",
    "current_gather_phase",
    "gather_layout",
]

GatherPhase = Literal["forward", "backward"]
"""Which pass an FSDP2 all-gather serves (see :func:`current_gather_phase`)."""

_ORIENTATIONS: tuple[Orientation, ...] = ORIENTATIONS


@dataclass(frozen=True, kw_only=True, slots=True)
class GatherPolicy:
    """What an FSDP2 all-gather of a weight must carry (design spec §9.1); only formats with a
    physical orientation (MXFP8) read it, the others always carry their one data.

    FSDP2 gives the hooks no phase argument, so the weight is told at finalize time how the
    gathered copy will be used:

    - ``reshard_after_forward=True`` and ``activation_checkpoint="off"``: every forward gather is
      freed after the layer's forward and backward gathers again, so forward carries only the
      fprop orientation (dense row / grouped col) and backward only the dgrad one (dense col /
      grouped row; wgrad reads no weight).
    - otherwise both orientations travel in every gather: ``reshard_after_forward=False`` keeps
      the forward copy for backward, and ``activation_checkpoint="full"`` re-runs the forward
      (fprop orientation) inside backward next to dgrad.

    Caveat: FSDP2 keeps the *root* module's parameters unsharded after forward when
    ``fully_shard`` is called without an explicit ``reshard_after_forward``, and
    ``set_reshard_after_backward(False)`` keeps a backward copy for the next forward; configure
    such weights with ``reshard_after_forward=False``. A missing orientation is never requantised:
    ``select`` raises naming this policy.

    Args:
        reshard_after_forward: The FSDP2 ``reshard_after_forward`` in force for the module.
        activation_checkpoint: ``"off"`` or ``"full"`` (design spec §15).

    Raises:
        TypeError: ``reshard_after_forward`` is not a bool.
        ValueError: ``activation_checkpoint`` is not ``"off"``/``"full"``.
    """

    reshard_after_forward: bool = True
    activation_checkpoint: ActivationCheckpointMode = "off"

    def __post_init__(self) -> None:
        if not isinstance(self.reshard_after_forward, bool):
            raise TypeError(f"GatherPolicy.reshard_after_forward must be a bool, got {self.reshard_after_forward!r}.")
        check_activation_checkpoint(self.activation_checkpoint, "GatherPolicy.activation_checkpoint")

    @property
    def gathers_both_orientations(self) -> bool:
        """Whether every MXFP8 gather carries row and col (see the class docstring)."""
        return (not self.reshard_after_forward) or self.activation_checkpoint == "full"

    # -- the GatherSpec of lp_lightning.tensor: FSDP2's two hooks, forwarded by the weight ------
    def pre_all_gather(
        self, weight: QuantizedWeightTensor, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...],
        module: nn.Module, mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], GatherMetadata]:
        """The low-precision storage of this shard as ``uint8`` all-gather slots (:func:`_pre_all_gather`)."""
        return _pre_all_gather(self, weight, mesh, outer_size, outer_stride, module, mp_policy)

    def post_all_gather(
        self, weight: QuantizedWeightTensor, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
        param_dtype: torch.dtype, *, out: torch.Tensor | None = None,
    ) -> tuple[GatheredWeightTensor, tuple[torch.Tensor, ...]] | None:
        """The full logical weight over the gathered slots (:func:`_post_all_gather`)."""
        return _post_all_gather(self, weight, all_gather_outputs, metadata, param_dtype, out=out)


def current_gather_phase() -> GatherPhase:
    """``"backward"`` while the autograd engine runs a backward pass on this thread, else ``"forward"``.

    FSDP2's pre-backward unshard (and its backward prefetch, and the forward re-run of
    ``activation_checkpoint="full"``) execute inside the engine, where
    ``torch._C._current_graph_task_id()`` is the running graph task; forward unshards (including
    explicit forward prefetch) run outside it (-1). This is public autograd state, not FSDP state.
    """
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


# ------------------------------------------------------------------------------------------------
# FSDP2 gather layout: the fixed schema of the physical tensors (see the module docstring).


@dataclass(frozen=True)
class GatherMetadata:
    """What ``fsdp_pre_all_gather`` tells the matching post hook (FSDP2 passes it through as is).

    Attributes:
        fqn: Parameter FQN.
        phase: ``"forward"`` or ``"backward"`` (:func:`current_gather_phase`).
        orientations: Orientations in this gather (metadata-orientation formats: both, from one ``data``).
        layout: The parameter's fixed :class:`GatherLayout`.
    """

    fqn: str
    phase: GatherPhase
    orientations: tuple[Orientation, ...]
    layout: GatherLayout


@dataclass(frozen=True)
class GatherLayout:
    """The fixed all-gather schema of one low-precision parameter (per shape, world size, policy).

    Attributes:
        format: Weight format (``FormatSpec``).
        kind: Dense or grouped.
        outer_shape: Full logical parameter shape ``(D0, *rest)``.
        world_size: FSDP shard-group size ``W``.
        both_orientations: Physical-orientation formats: every gather carries row and col.
        shard_dim: FSDP2's ``Shard(shard_dim)``: 0, or 1 for an input-dim shard (module docstring).
    """

    format: FormatSpec
    kind: WeightKind
    outer_shape: tuple[int, ...]
    world_size: int
    both_orientations: bool
    shard_dim: int = 0
    local_rows: tuple[int, ...] = field(init=False)
    rows_per_rank: int = field(init=False)
    uneven: bool = field(init=False)
    data_payloads: tuple[str, ...] = field(init=False)
    scale_payloads: tuple[str, ...] = field(init=False)
    scale_capacity: tuple[int, ...] = field(init=False)
    shard_shape: tuple[int, ...] = field(init=False)
    slots: tuple[tuple[str, tuple[int, ...]], ...] = field(init=False)
    scratch_offsets: tuple[tuple[str, int], ...] = field(init=False)
    scratch_bytes: int = field(init=False)
    packed_offsets: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)
        d0 = self.outer_shape[0]
        if self.shard_dim == 0:
            rows = shard_rows(d0, self.world_size)
            set_("shard_shape", (rows[0], *self.outer_shape[1:]))
        elif self.shard_dim == 1 and len(self.outer_shape) >= 2 and self.outer_shape[1] % self.world_size == 0:
            rows = [d0] * self.world_size
            set_("shard_shape", (d0, self.outer_shape[1] // self.world_size, *self.outer_shape[2:]))
        else:
            raise ValueError(
                f"GatherLayout: Shard({self.shard_dim}) of shape {self.outer_shape} over {self.world_size} ranks is "
                "not supported (dim 0, or dim 1 split evenly)."
            )
        set_("local_rows", tuple(rows))
        set_("rows_per_rank", rows[0])
        set_("uneven", self.shard_dim == 0 and d0 % self.world_size != 0)
        if not self.format.physical_orientation:
            data_p, scale_p = ("data",), ("scale",)
        elif self.both_orientations:
            data_p, scale_p = ("row_data", "col_data"), ("row_scale", "col_scale")
        else:
            data_p, scale_p = ("data",), ("scale",)
        set_("data_payloads", data_p)
        set_("scale_payloads", scale_p)
        shard_spec = self._spec(self.rows_per_rank)
        if self.shard_dim != 0:
            self._check_split_along_dim1(shard_spec)
        caps = tuple(max(_nbytes(*shard_spec[n]) for n in self.candidates(p)) for p in scale_p)
        set_("scale_capacity", caps)
        shard_shape = self.shard_shape
        slots = [(p, shard_shape) for p in data_p]
        packed: list[int] = []
        if self.world_size == 1:
            # FSDP2 does not all-gather over a one-rank group: it copies only the *first* input
            # into the unsharded buffer (FSDPParamGroup.wait_for_unshard). Everything travels in
            # one slot: each payload at a 16-byte aligned offset (FP32 scale views need 4).
            total = 0
            for cap in [math.prod(shard_shape)] * len(data_p) + list(caps):
                packed.append(total)
                total += -(-cap // 16) * 16
            slots = [("packed", (total,))]
        elif self.scales_packed:
            shard_bytes = math.prod(shard_shape)
            slots += [(f"scales[{i}]", shard_shape) for i in range(math.ceil(sum(caps) / shard_bytes))]
        else:
            slots += [(p, (cap,)) for p, cap in zip(scale_p, caps)]
        set_("slots", tuple(slots))
        set_("packed_offsets", tuple(packed))
        # Scale tensors that cannot be zero-copy views of one gathered slot are copied into a
        # scratch buffer (uneven sharding, or a single-orientation slot sized to the larger scale).
        full_spec = self._spec_full()
        offsets, total = [], 0
        for p, cap in zip(scale_p, caps):
            for name in self.candidates(p):
                if self.world_size > 1 and (self.scales_packed or _nbytes(*shard_spec[name]) != cap):
                    shape, dtype = full_spec[name]
                    replicated = len(shape) == 0  # a per-tensor scale: one copy per rank
                    nbytes = _nbytes(shape, dtype) * self.world_size if replicated else _nbytes(shape, dtype)
                    offsets.append((name, total))
                    total += -(-nbytes // 16) * 16
        set_("scratch_offsets", tuple(offsets))
        set_("scratch_bytes", total)

    @property
    def scales_packed(self) -> bool:
        """Scale bytes travel in shard-shaped slots (uneven dim-0 or input-dim shards: FSDP2 needs it)."""
        return self.uneven or self.shard_dim != 0

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """The logical shape of rank ``rank``'s shard."""
        if self.shard_dim == 0:
            return (self.local_rows[rank], *self.outer_shape[1:])
        return self.shard_shape

    def _spec(self, rows: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if self.shard_dim != 0 and rows == self.rows_per_rank:
            return storage_spec(self.format, self.kind, self.shard_shape)
        return storage_spec(self.format, self.kind, (rows, *self.outer_shape[1:]))

    def _check_split_along_dim1(self, shard_spec: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Every storage tensor of an input-dim shard is its full tensor split evenly along dim 1."""
        for name, (full, _) in self._spec_full().items():
            local = shard_spec[name][0]
            if len(full) == 0:
                continue
            if len(full) < 2 or local[1] * self.world_size != full[1] or local[:1] + local[2:] != full[:1] + full[2:]:
                raise ValueError(
                    f"GatherLayout: {self.format.name} storage {name!r} {full} is not split along dim 1 by "
                    f"Shard(1) over {self.world_size} ranks (local {local}); keep dim-0 sharding."
                )

    def _spec_full(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return storage_spec(self.format, self.kind, self.outer_shape)

    def candidates(self, payload: str) -> tuple[str, ...]:
        """Storage names that may fill ``payload`` (MXFP8 single-orientation slots serve two)."""
        if self.format.physical_orientation and not self.both_orientations:
            return ("row_data", "col_data") if payload == "data" else ("row_scale", "col_scale")
        return (payload,)

    def orientations_for(self, phase: GatherPhase) -> tuple[Orientation, ...]:
        """Orientations a gather in ``phase`` carries (design spec §9.1 direction table)."""
        if not self.format.physical_orientation or self.both_orientations:
            return _ORIENTATIONS
        return (self.kind.fprop_orientation,) if phase == "forward" else (self.kind.dgrad_orientation,)

    def _active(self, payload: str, orientations: tuple[Orientation, ...]) -> str:
        if self.format.physical_orientation and not self.both_orientations:
            (orientation,) = orientations
            return f"{orientation}_{payload}"
        return payload

    # -- pre ---------------------------------------------------------------------------------
    def pack(
        self,
        storage: dict[str, torch.Tensor],
        orientations: tuple[Orientation, ...],
        local_rows: int,
        *,
        fqn: str = "",
    ) -> tuple[torch.Tensor, ...]:
        """This rank's ``uint8`` slots (zero-copy views where the bytes already have slot shape).

        Raises:
            ValueError: a storage tensor's shape or dtype differs from the declared schema.
        """
        local_spec = self._spec(local_rows)
        for name, (shape, dtype) in local_spec.items():
            t = storage.get(name)
            if t is None or tuple(t.shape) != shape or t.dtype != dtype:
                got = "missing" if t is None else f"{tuple(t.shape)} {t.dtype}"
                raise ValueError(
                    f"fsdp_pre_all_gather({fqn!r}): storage {name!r} is {got}, the schema says {shape} {dtype}."
                )
        shard_shape = self.shard_shape
        if self.world_size == 1:
            packed = torch.zeros(self.slots[0][1], dtype=torch.uint8, device=next(iter(storage.values())).device)
            payloads = self.data_payloads + self.scale_payloads
            for payload, offset in zip(payloads, self.packed_offsets):
                raw = _as_bytes(storage[self._active(payload, orientations)])
                packed[offset : offset + raw.numel()].copy_(raw)
            return (packed,)
        out: list[torch.Tensor] = []
        for payload in self.data_payloads:
            raw = _as_bytes(storage[self._active(payload, orientations)])
            if local_rows == self.rows_per_rank:
                out.append(raw.view(shard_shape))
            else:
                slot = raw.new_zeros(shard_shape)
                slot.view(-1)[: raw.numel()].copy_(raw)
                out.append(slot)
        scale_bytes = [_as_bytes(storage[self._active(p, orientations)]) for p in self.scale_payloads]
        if self.scales_packed:
            shard_bytes = math.prod(shard_shape)
            n = len(self.slots) - len(self.data_payloads)
            region = torch.zeros(n * shard_bytes, dtype=torch.uint8, device=scale_bytes[0].device)
            offset = 0
            for raw, cap in zip(scale_bytes, self.scale_capacity):
                region[offset : offset + raw.numel()].copy_(raw)
                offset += cap
            out.extend(region.view(n, *shard_shape).unbind(0))
        else:
            for raw, cap in zip(scale_bytes, self.scale_capacity):
                if raw.numel() == cap:
                    out.append(raw)
                else:
                    slot = raw.new_zeros(cap)
                    slot[: raw.numel()].copy_(raw)
                    out.append(slot)
        return tuple(out)

    # -- post --------------------------------------------------------------------------------
    def check_outputs(self, outputs: tuple[torch.Tensor, ...], *, fqn: str = "") -> None:
        """Raise unless ``outputs`` match the slots in count, order, shape and dtype (design spec §13.5).

        Raises:
            ValueError: naming the first disagreement.
        """
        if len(outputs) != len(self.slots):
            raise ValueError(
                f"fsdp_post_all_gather({fqn!r}): got {len(outputs)} all-gather outputs, the layout has "
                f"{len(self.slots)} slots {[name for name, _ in self.slots]}."
            )
        for i, (t, (name, shape)) in enumerate(zip(outputs, self.slots)):
            want = (self.world_size * shape[0], *shape[1:])
            if t.dtype != torch.uint8 or tuple(t.shape) != want:
                raise ValueError(
                    f"fsdp_post_all_gather({fqn!r}): output {i} ({name!r}) is {tuple(t.shape)} {t.dtype}, "
                    f"expected {want} torch.uint8."
                )

    def unpack(
        self,
        outputs: tuple[torch.Tensor, ...],
        orientations: tuple[Orientation, ...],
        scratch: torch.Tensor | None,
        *,
        fqn: str = "",
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """Full-weight storage from the gathered slots: views where possible, else copies into ``scratch``.

        Returns:
            ``(storage, scratch)``; ``scratch`` is the (possibly new) scale buffer or ``None``.

        Raises:
            ValueError: as :meth:`check_outputs`, or HiF8 dense scales that differ across ranks.
        """
        self.check_outputs(outputs, fqn=fqn)
        d0, world = self.outer_shape[0], self.world_size
        full_spec = self._spec_full()
        storage: dict[str, torch.Tensor] = {}
        if world == 1:
            for payload, offset in zip(self.data_payloads + self.scale_payloads, self.packed_offsets):
                name = self._active(payload, orientations)
                shape, dtype = full_spec[name]
                storage[name] = outputs[0][offset : offset + _nbytes(shape, dtype)].view(dtype).view(shape)
            return storage, None
        for payload, gathered in zip(self.data_payloads, outputs):
            name = self._active(payload, orientations)
            shape, dtype = full_spec[name]
            # dim 0: drop the padding rows; dim 1: FSDP2 already concatenated the shards along dim 1
            rows = gathered[:d0] if self.shard_dim == 0 else gathered
            storage[name] = rows.view(shape).view(dtype)
        if self.scratch_bytes and (scratch is None or scratch.numel() != self.scratch_bytes):
            scratch = torch.empty(self.scratch_bytes, dtype=torch.uint8, device=outputs[0].device)
        offsets = dict(self.scratch_offsets)
        scale_outputs = outputs[len(self.data_payloads) :]
        if self.scales_packed:
            if self.shard_dim == 0:
                per_rank_slots = [g.reshape(world, -1) for g in scale_outputs]  # rank r's region = row r
            else:  # FSDP2 laid the W shard-shaped slots side by side along dim 1: [D0, W, D1/W] bytes
                rows, cols = self.shard_shape[0], math.prod(self.shard_shape[1:])
                per_rank_slots = [g.reshape(rows, world, cols).transpose(0, 1).reshape(world, -1) for g in scale_outputs]
            regions = torch.cat(per_rank_slots, dim=1) if len(per_rank_slots) > 1 else per_rank_slots[0]
        region_offset = 0
        for i, (payload, cap) in enumerate(zip(self.scale_payloads, self.scale_capacity)):
            name = self._active(payload, orientations)
            shape, dtype = full_spec[name]
            per_rank = [_nbytes(*self._spec(rows)[name]) for rows in self.local_rows]
            if not self.scales_packed and all(b == cap for b in per_rank):
                flat = scale_outputs[i]  # rank-major and gap-free: the full tensor's bytes in order
            else:
                if self.scales_packed:
                    ranks = regions[:, region_offset : region_offset + cap]
                else:
                    ranks = scale_outputs[i].view(world, cap)
                assert scratch is not None
                start = offsets[name]
                total = sum(per_rank)
                flat = scratch[start : start + total]
                if self.shard_dim == 0 or len(shape) == 0:
                    torch.cat([ranks[r, :b] for r, b in enumerate(per_rank)], out=flat)
                else:  # the ranks' scale tensors side by side along dim 1
                    local = self._spec(self.rows_per_rank)[name][0]
                    pieces = [ranks[r, :b].view(dtype).view(local) for r, b in enumerate(per_rank)]
                    torch.cat(pieces, dim=1, out=flat.view(dtype).view(shape))
            region_offset += cap
            if len(shape) == 0:  # a per-tensor scale, one copy per rank: all must agree
                scales_W = flat.view(dtype)
                if not bool(torch.all(scales_W == scales_W[0])):
                    raise ValueError(
                        f"fsdp_post_all_gather({fqn!r}): per-tensor scales differ across ranks {scales_W.tolist()}; "
                        "refresh with refresh_low_precision_weights on every rank (MAX-reduced amax, design spec §9.2)."
                    )
                storage[name] = scales_W[0]
            else:
                storage[name] = flat.view(dtype).view(shape)
        return storage, scratch


@functools.lru_cache(maxsize=4096)
def _gather_layout_cached(
    fmt: FormatSpec, kind: WeightKind, outer_shape: tuple[int, ...], world_size: int, both: bool, shard_dim: int
) -> GatherLayout:
    return GatherLayout(fmt, kind, outer_shape, world_size, both, shard_dim)


def gather_layout(
    format: FormatSpec | str,
    kind: WeightKind | str,
    outer_shape: tuple[int, ...],
    world_size: int,
    policy: GatherPolicy = GatherPolicy(),
    shard_dim: int = 0,
) -> GatherLayout:
    """The fixed FSDP2 gather schema of a weight (cached; identical on every rank and call).

    Args:
        format: Weight format (``FormatSpec``).
        kind: Dense or grouped.
        outer_shape: Full logical parameter shape.
        world_size: FSDP shard-group size.
        policy: Gather policy (orientation choice of physical-orientation formats).
        shard_dim: FSDP2's ``Shard(shard_dim)`` of the weight (0, or 1 for an input-dim shard).

    Returns:
        The :class:`GatherLayout`.

    Raises:
        ValueError: a layout that breaks the format's shard rule for ``shard_dim`` (MXFP8: design
            spec §9.1, docs/architecture.md "Placements").
    """
    fmt, kind = as_spec(format), WeightKind.parse(kind)
    reason = fmt.shard_rule_violation(kind, tuple(outer_shape), world_size, shard_dim)
    if reason is not None:
        raise ValueError(
            f"cannot all-gather a {fmt.name} {kind.value} weight of shape {tuple(outer_shape)} as Shard({shard_dim}) "
            f"over {world_size} ranks: {reason}. Keep it replicated (fallback_to_unsharded=true) or change the world size."
        )
    both = fmt.physical_orientation and policy.gathers_both_orientations
    return _gather_layout_cached(fmt, kind, tuple(int(s) for s in outer_shape), int(world_size), both, int(shard_dim))


def _shard_dim(local_shape: tuple[int, ...], outer_shape: tuple[int, ...]) -> int:
    """FSDP2's shard dim of a local tensor: 1 when only dim 1 is smaller than the full shape, else 0
    (dim 0, and a one-rank group whose shard is the whole tensor)."""
    if (
        len(local_shape) >= 2
        and local_shape[0] == outer_shape[0]
        and local_shape[1] != outer_shape[1]
        and local_shape[2:] == outer_shape[2:]
    ):
        return 1
    return 0


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1) if t.dim() != 0 else t.reshape(1)
    return flat.contiguous().view(torch.uint8)


# ------------------------------------------------------------------------------------------------
# Gather events (public observers; probes count wire bytes with them).


GatherStage = Literal["pre_all_gather", "post_all_gather"]
"""Which FSDP2 hook a :class:`GatherEvent` comes from."""


@dataclass(frozen=True)
class GatherEvent:
    """One low-precision weight's all-gather on this rank: its inputs (pre) or its rebuilt storage (post).

    Attributes:
        fqn: Parameter FQN.
        phase: ``"forward"`` or ``"backward"``.
        orientations: Orientations carried.
        tensors: Pre: the ``uint8`` slots handed to FSDP2; post: the full-weight storage tensors
            (views of the gathered buffers). Read them inside the callback, never write: FSDP2
            frees the buffers at reshard (``formats.operand.freed_storage`` tells).
        local: The shard group has one rank: FSDP2 copies instead of issuing a collective.
        stage: ``"pre_all_gather"`` or ``"post_all_gather"``.
        names: One name per tensor: the slot names of the :class:`GatherLayout` (pre), or the
            storage names (post: ``"row_data"``, ``"col_scale"``, ``"data"``, ``"scale"`` ...).
        logical_shape: Shape of the whole logical weight.
        logical_dtype: Post: the gathered weight's logical dtype (FSDP2's ``param_dtype``); pre: None.
    """

    fqn: str
    phase: GatherPhase
    orientations: tuple[Orientation, ...]
    tensors: tuple[torch.Tensor, ...]
    local: bool
    stage: GatherStage = "pre_all_gather"
    names: tuple[str, ...] = ()
    logical_shape: tuple[int, ...] | None = None
    logical_dtype: torch.dtype | None = None


_GATHER_OBSERVERS: Observers[GatherEvent] = Observers("add_gather_observer")


def add_gather_observer(observer: Callable[[GatherEvent], None]) -> ObserverHandle:
    """Call ``observer(event)`` at every low-precision pre- and post-all-gather (``event.stage``);
    returns a handle with ``remove()``."""
    return _GATHER_OBSERVERS.add(observer)


# ------------------------------------------------------------------------------------------------
# The extension the weights forward FSDP2's hooks to.


def _pre_all_gather(
    policy: GatherPolicy,
    weight: QuantizedWeightTensor,
    mesh: Any,
    outer_size: torch.Size,
    outer_stride: tuple[int, ...],
    module: nn.Module,
    mp_policy: Any,
) -> tuple[tuple[torch.Tensor, ...], GatherMetadata]:
    """The low-precision physical tensors of this shard, as ``uint8`` slots (design spec §9, §13.5).

    Called by FSDP2 on the sharded local tensor before each all-gather. Only public
    arguments are read: ``mesh`` (shard-group size and rank), ``outer_size`` (full logical
    shape). The phase comes from :func:`current_gather_phase`, the orientation choice from
    ``gather_policy`` (see :class:`GatherPolicy`).

    Args:
        mesh: The FSDP shard mesh (1-D; ``size()`` = W, ``get_local_rank()`` = this rank).
        outer_size: Logical shape of the whole (unsharded) parameter.
        outer_stride: Its contiguous strides (unused: the schema depends on the shape only).
        module: The module owning the parameter (unused).
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` (unused: low-precision bytes are not cast;
            the gathered weight takes ``param_dtype`` as its logical dtype in the post hook).

    Returns:
        ``(slots, metadata)``: ``uint8`` tensors in :class:`GatherLayout` order and a
        :class:`GatherMetadata` for the matching post hook.

    Raises:
        ValueError: storage not built, not a Shard(0)/Shard(1) shard, a shard breaking the format's
            rule (MXFP8: §9.1), or
            storage tensors that disagree with the declared schema.
    """
    world_size, rank = mesh.size(), mesh.get_local_rank()
    shard_dim = _shard_dim(tuple(weight.shape), tuple(outer_size))
    layout = gather_layout(weight.format, weight.kind, tuple(outer_size), world_size, policy, shard_dim)
    local_rows = layout.local_rows[rank]
    expected_local = layout.local_shape(rank)
    if tuple(weight.shape) != expected_local:
        raise ValueError(
            f"fsdp_pre_all_gather({weight.fqn!r}): local shard {tuple(weight.shape)} is not the Shard({shard_dim}) "
            f"shard {expected_local} of {layout.outer_shape} on rank {rank} of {world_size}; low-precision weights "
            "support FSDP2 Shard(0) and, where their format allows it, Shard(1) (fsdp.sharding.plan_low_precision_sharding)."
        )
    if not weight.is_built:
        raise ValueError(
            f"fsdp_pre_all_gather({weight.fqn!r}): the low-precision shard was never built; call "
            "lp_lightning.fsdp.refresh.refresh_low_precision_weights(model.parameters()) after fully_shard (design spec §10)."
        )
    first = weight.gather_memo.setdefault("layout", layout)
    if first != layout:
        raise ValueError(
            f"fsdp_pre_all_gather({weight.fqn!r}): the gather schema changed since the first all-gather "
            f"({first} -> {layout}); FSDP2 sized its buffers from the first call."
        )
    phase = current_gather_phase()
    orientations = layout.orientations_for(phase)
    slots = layout.pack(dict(weight.low_precision_storage), orientations, local_rows, fqn=weight.fqn)
    if _GATHER_OBSERVERS:
        _GATHER_OBSERVERS.notify(
            GatherEvent(
                fqn=weight.fqn, phase=phase, orientations=orientations, tensors=slots, local=world_size == 1,
                names=tuple(name for name, _ in layout.slots), logical_shape=layout.outer_shape,
            )
        )
    return slots, GatherMetadata(fqn=weight.fqn, phase=phase, orientations=orientations, layout=layout)

def _post_all_gather(
    policy: GatherPolicy,
    weight: QuantizedWeightTensor,
    all_gather_outputs: tuple[torch.Tensor, ...],
    metadata: Any,
    param_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> tuple[GatheredWeightTensor, tuple[torch.Tensor, ...]] | None:
    """Rebuild the full logical weight from the gathered slots (views; refill ``out`` in place).

    Args:
        all_gather_outputs: One tensor per slot, ``[W * S0, *rest]`` or ``[W * capacity]``.
        metadata: The :class:`GatherMetadata` the pre hook returned on this rank.
        param_dtype: Logical dtype of the gathered weight (FSDP2's ``param_dtype``).
        out: The gathered weight of an earlier call: its storage is re-pointed, nothing
            returned.

    Returns:
        ``(weight, inner_tensors)`` on the first call (``inner_tensors``: the buffers FSDP2
        frees at reshard and re-allocates before the next gather), ``None`` with ``out``.

    Raises:
        ValueError: metadata of another weight/layout; slot count, order, shape or dtype
            disagreeing with the layout; HiF8 dense scales differing between ranks.
        TypeError: ``out`` is not a :class:`GatheredWeightTensor`.
    """
    if not isinstance(metadata, GatherMetadata):
        raise ValueError(
            f"fsdp_post_all_gather({weight.fqn!r}): metadata must be the GatherMetadata of fsdp_pre_all_gather, "
            f"got {type(metadata).__name__}."
        )
    layout = metadata.layout
    expected = gather_layout(
        weight.format, weight.kind, layout.outer_shape, layout.world_size, policy, layout.shard_dim
    )
    if layout != expected or metadata.fqn != weight.fqn:
        raise ValueError(
            f"fsdp_post_all_gather({weight.fqn!r}): metadata describes {metadata.fqn!r} with {layout}, this weight "
            f"expects {expected}."
        )
    scratch = None
    if out is not None:
        if not isinstance(out, GatheredWeightTensor):
            raise TypeError(
                f"fsdp_post_all_gather({weight.fqn!r}): out must be a GatheredWeightTensor, got {type(out).__name__}."
            )
        scratch = out.gather_memo.get("scale_scratch")
    storage, scratch = layout.unpack(tuple(all_gather_outputs), metadata.orientations, scratch, fqn=weight.fqn)
    if out is not None and (tuple(out.shape) != layout.outer_shape or out.dtype != param_dtype):
        raise ValueError(
            f"fsdp_post_all_gather({weight.fqn!r}): out is {tuple(out.shape)} {out.dtype}, expected "
            f"{layout.outer_shape} {param_dtype}."
        )
    if _GATHER_OBSERVERS:
        _GATHER_OBSERVERS.notify(
            GatherEvent(
                fqn=weight.fqn, phase=metadata.phase, orientations=metadata.orientations,
                tensors=tuple(storage.values()), local=layout.world_size == 1, stage="post_all_gather",
                names=tuple(storage), logical_shape=layout.outer_shape, logical_dtype=param_dtype,
            )
        )
    if out is not None:
        out.repoint(storage, metadata.orientations)
        out.gather_memo["scale_scratch"] = scratch
        return None
    gathered = GatheredWeightTensor.from_gathered(
        layout.outer_shape,
        logical_dtype=param_dtype,
        recipe=weight.recipe,
        kind=weight.kind,
        fqn=weight.fqn,
        storage=storage,
        orientations=metadata.orientations,
        device=all_gather_outputs[0].device if all_gather_outputs else weight.device,
        gather_memo={"scale_scratch": scratch},
    )
    inner = tuple(all_gather_outputs) + ((scratch,) if scratch is not None else ())
    return gathered, inner
