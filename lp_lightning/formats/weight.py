"""Persistent low-precision weights: ``QuantizedWeightTensor`` and its FSDP2 gather.

Seed §7.2–7.3, §9–§10, §13.4–13.5; requirement R1 (docs/design.md), R7, R8.

A replaced module's weight Parameter holds a ``QuantizedWeightTensor``: a tensor with the
parameter's *logical* shape, dtype and ``requires_grad`` that owns

- the **high-precision master** (``master``, FP32 after :func:`finalize_low_precision_weights`):
  the authoritative value. The optimizer updates it through in-place ops on the wrapper, the model
  state dict exposes it (never the derived bytes), and it is never recovered by dequantising.
- the **derived low-precision storage**, rebuilt from the master only by
  :meth:`QuantizedWeightTensor.refresh_from_master` (called by
  ``lp_lightning.distributed.refresh.refresh_low_precision_weights`` once per successful
  optimizer step, design spec §10):

  ============  =====================================================================
  MXFP8 (§7.2)  ``row_data``/``row_scale`` and ``col_data``/``col_scale`` (E4M3 + E8M0)
  HiF8 (§7.3)   one ``data`` (HiFloat8 codes, ``uint8``) and an FP32 ``scale``:
                0-d for a dense weight, ``[E]`` for a grouped (3-D) weight
  ============  =====================================================================

``select(orientation)`` returns a ``QuantizedOperand`` *viewing* that storage (no quantisation,
no copy). The GEMM views (design spec §8, the contract of ``lp_lightning.functional``):

- **dense** weight ``w_NK`` (``nn.Linear.weight``): operands are of ``[N, K]``; fprop uses
  ``"row"`` (blocks along K), dgrad ``"col"`` (blocks along N).
- **grouped** weight: the HF parameter is ``[E, N, K]`` (e.g. ``gate_up_proj [E, 2F, H]``) but the
  GMM consumes its transpose ``w_EKN``; storage and operands are of the GMM view ``[E, K, N]``
  (contiguous): fprop uses ``"col"`` (blocks along K), dgrad ``"row"`` (blocks along N).

Dispatch rule (``__torch_dispatch__``; one ``@_implements`` table per class, duplicate
registration rejected). For a ``QuantizedWeightTensor``:

1. *Aliases of the same region* — ``detach``, ``alias``, and ``view``/``_unsafe_view``/
   ``as_strided`` that keep shape and strides (``DTensor.to_local`` is such a view) — return a
   wrapper sharing the weight state (storage and refresh count): an alias *is* the same weight.
2. *Region-changing structural ops FSDP2 uses to carve and pad shards* — ``slice`` (``narrow``),
   ``split``/``split_with_sizes`` (``chunk``) — and *allocations* — ``new_zeros``,
   ``new_empty``, ``new_empty_strided``, ``empty_like`` — return wrappers over the master's
   result whose storage is **not built**: a new shard is quantised by the next refresh
   (``refresh_low_precision_weights`` after ``fully_shard``), never from its parent's bytes.
3. ``clone`` copies master and storage; ``_to_copy`` to another device keeps the subclass (master
   and storage move), ``_to_copy`` to another dtype returns the master's values as a plain tensor.
4. ``copy_`` and every other in-place op mutating a wrapper (AdamW's ``mul_``/``addcdiv_``/
   ``lerp_`` and their ``_foreach_*_`` forms, ``nn.init`` fills) run on the master and return the
   wrapper; the storage keeps the last refreshed bytes until the next refresh (design spec §10).
   In-place ops that change metadata (``inplace_view`` tag, ``resize_``, ``set_``) raise.
5. GEMMs on the wrapper (``mm``, ``addmm``, ``bmm``, ``linear``, ``_grouped_mm``, ...) raise
   ``TypeError``: they would be a silent high-precision GEMM; consume the weight via ``select``.
6. Any other op returning an alias of its input (an unknown structural op: ``t``, ``transpose``,
   ``permute``, a reshaping ``view`` is the exception below) raises ``NotImplementedError(op, cls)``.
   A ``view``/``_unsafe_view`` to a *different* shape returns the plain view of the master
   (FSDP2 keeps a flat 1-D view of the padded shard as raw bytes; a low-precision storage is
   tied to its logical shape, so a reshaped view cannot carry one).
7. Everything else is a compute op: it runs on the master and returns plain tensors
   (``zeros_like`` too: AdamW's ``exp_avg``/``exp_avg_sq`` must be plain FP32 tensors).

A :class:`GatheredWeightTensor` (what ``fsdp_post_all_gather`` builds) has no master: only
aliases (rule 1) and ``zeros_like``/``empty_like``/``new_zeros`` (FSDP2's zero gradient for an
unused parameter; plain results) are allowed, everything else raises.

FSDP2 gather schema (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, torch's public
tensor-subclass extension; see ``lp_lightning.distributed.fsdp_extension`` for the why). FSDP2
allocates a parameter's all-gather output buffers once, from the first call's (count, numel,
dtype), so the schema of the physical tensors is fixed per parameter (:class:`GatherLayout`):
every slot is ``uint8`` (gloo cannot all-gather float8), data slots come first
(``[S0, *rest]``, ``S0 = ceil(D0 / W)`` rows of the padded shard), then scale slots:

====================================  ========================================================
weight                                slots (in order)
====================================  ========================================================
HiF8 dense / grouped                  ``data``, ``scale`` (dense: 4 bytes per rank, checked equal)
MXFP8, one orientation per gather     ``data``, ``scale`` — forward fills the fprop orientation
(``GatherPolicy`` single)             (dense row / grouped col), backward the dgrad orientation
                                      (dense col / grouped row); the scale slot is sized to the
                                      larger of the two
MXFP8, both orientations              ``row_data``, ``col_data``, ``row_scale``, ``col_scale``
====================================  ========================================================

With uneven dim-0 sharding (``D0 % W != 0``), FSDP2 requires every all-gather input to have the
padded shard shape ``[S0, *rest]``, so the scale bytes travel packed in ``ceil(scale_bytes /
shard_bytes)`` slots of that shape instead (one extra data-sized message per uneven weight).

Tensor-name legend: ``w_NK`` dense weight (N out-features, K in-features), ``w_ENK`` grouped HF
parameter, ``w_EKN`` its GMM view, ``D0`` the sharded (first) dim of the parameter, ``W`` the
FSDP shard-group size, ``S0`` rows per rank of the padded shard, ``L`` this rank's rows.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any, ClassVar, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from lp_lightning.formats.operand import (
    MX_BLOCK_SIZE,
    LowPrecisionFormat,
    Orientation,
    QuantizationRole,
    QuantizedOperand,
)
from lp_lightning.formats.recipe import LowPrecisionRecipe, recipe_for
from lp_lightning.names import parse_enum

__all__ = [
    "GatherLayout",
    "GatherMetadata",
    "GatherPhase",
    "GatherPolicy",
    "GatheredWeightTensor",
    "LowPrecisionWeightRecord",
    "QuantizedWeightTensor",
    "WeightKind",
    "add_refresh_observer",
    "current_gather_phase",
    "finalize_low_precision_weights",
    "gather_layout",
    "is_master_of",
    "iter_low_precision_weights",
    "low_precision_param_names",
    "mx_shard_rule_violation",
    "register_low_precision_params",
    "shard_rows",
    "storage_spec",
    "total_refresh_count",
]

aten = torch.ops.aten

GatherPhase = Literal["forward", "backward"]
"""Which pass an FSDP2 all-gather serves (see :func:`current_gather_phase`)."""

_ORIENTATIONS: tuple[Orientation, ...] = ("row", "col")
_MX_ROW_MULTIPLE = 2 * MX_BLOCK_SIZE
"""MXFP8 shard rule (design spec §9.1): local rows a multiple of 64 = two 32-row col blocks, so no col
block crosses a shard boundary and the Ascend scale layout (pairs of blocks) stays aligned."""


class WeightKind(str, Enum):
    """How the GEMMs consume a weight (design spec §5, §8)."""

    DENSE = "dense"
    """2-D ``nn.Linear`` weight ``[N, K]``; operands of ``[N, K]``."""
    GROUPED = "grouped"
    """3-D stacked expert weight ``[E, N, K]``; operands of the GMM view ``[E, K, N]``."""

    @classmethod
    def parse(cls, value: WeightKind | str) -> WeightKind:
        """Accept the enum or its string value.

        Raises:
            ValueError: naming the legal values.
        """
        return parse_enum(cls, value, argument="kind", what="a weight kind")


@dataclass(frozen=True, kw_only=True, slots=True)
class GatherPolicy:
    """What an FSDP2 all-gather of an MXFP8 weight must carry (design spec §9.1). HiF8 ignores it.

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
    activation_checkpoint: Literal["off", "full"] = "off"

    def __post_init__(self) -> None:
        if not isinstance(self.reshard_after_forward, bool):
            raise TypeError(f"GatherPolicy.reshard_after_forward must be a bool, got {self.reshard_after_forward!r}.")
        if self.activation_checkpoint not in ("off", "full"):
            raise ValueError(
                f"GatherPolicy.activation_checkpoint={self.activation_checkpoint!r}; legal values: 'off', 'full'."
            )

    @property
    def gathers_both_orientations(self) -> bool:
        """Whether every MXFP8 gather carries row and col (see the class docstring)."""
        return (not self.reshard_after_forward) or self.activation_checkpoint == "full"


def current_gather_phase() -> GatherPhase:
    """``"backward"`` while the autograd engine runs a backward pass on this thread, else ``"forward"``.

    FSDP2's pre-backward unshard (and its backward prefetch, and the forward re-run of
    ``activation_checkpoint="full"``) execute inside the engine, where
    ``torch._C._current_graph_task_id()`` is the running graph task; forward unshards (including
    explicit forward prefetch) run outside it (-1). This is public autograd state, not FSDP state.
    """
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


# ------------------------------------------------------------------------------------------------
# Storage declaration: names, shapes and dtypes of the physical tensors (one place for all users).

_ALL_STORAGE_NAMES: tuple[str, ...] = ("row_data", "row_scale", "col_data", "col_scale", "data", "scale")
"""Every storage name of :func:`storage_spec` (MXFP8: the first four; HiF8: the last two)."""


def _num_blocks(extent: int) -> int:
    return math.ceil(extent / MX_BLOCK_SIZE)


def _gemm_view_shape(kind: WeightKind, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(shape) if kind is WeightKind.DENSE else (shape[0], shape[2], shape[1])


def storage_spec(
    format: LowPrecisionFormat | str, kind: WeightKind | str, shape: tuple[int, ...]
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of a weight's low-precision storage (the declaration every user reads).

    Args:
        format: ``"mxfp8_e4m3"`` or ``"hif8"``.
        kind: ``"dense"`` (``shape`` ``[N, K]``) or ``"grouped"`` (``shape`` ``[E, N, K]``).
        shape: Logical parameter shape (of the whole weight or of one shard).

    Returns:
        ``{name: (shape, dtype)}`` in declaration order. MXFP8 dense: ``row_data [N, K]``,
        ``row_scale [N, nb(K)]``, ``col_data [N, K]``, ``col_scale [nb(N), K]``; MXFP8 grouped
        (GMM view): ``row_data [E, K, N]``, ``row_scale [E, K, nb(N)]``, ``col_data [E, K, N]``,
        ``col_scale [E, nb(K), N]``; HiF8: ``data`` (GMM view, ``uint8``), ``scale`` (``[]`` or
        ``[E]``, FP32). ``nb(d) = ceil(d / 32)``.
    """
    fmt, kind = LowPrecisionFormat.parse(format), WeightKind.parse(kind)
    gemm = _gemm_view_shape(kind, tuple(shape))
    if fmt is LowPrecisionFormat.MXFP8_E4M3:
        return {
            "row_data": (gemm, torch.float8_e4m3fn),
            "row_scale": (gemm[:-1] + (_num_blocks(gemm[-1]),), torch.float8_e8m0fnu),
            "col_data": (gemm, torch.float8_e4m3fn),
            "col_scale": (gemm[:-2] + (_num_blocks(gemm[-2]), gemm[-1]), torch.float8_e8m0fnu),
        }
    return {"data": (gemm, torch.uint8), "scale": (() if kind is WeightKind.DENSE else (gemm[0],), torch.float32)}


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def shard_rows(rows: int, world_size: int) -> list[int]:
    """Rows of dim 0 each rank holds under FSDP2 ``Shard(0)`` (``torch.chunk`` + empty tail ranks).

    Args:
        rows: Size of the parameter's dim 0.
        world_size: FSDP shard-group size.

    Returns:
        ``[L_0, ..., L_{W-1}]`` with ``L_r = clamp(rows - r * ceil(rows / W), 0, ceil(rows / W))``.
    """
    per_rank = math.ceil(rows / world_size) if rows else 0
    return [max(0, min(per_rank, rows - r * per_rank)) for r in range(world_size)]


def mx_shard_rule_violation(kind: WeightKind | str, shape: tuple[int, ...], world_size: int) -> str | None:
    """The MXFP8 shard rule of design spec §9.1 for dim-0 sharding, or ``None`` when it holds.

    Dense ``[M, K]``: every rank's ``M_local % 64 == 0``. Grouped ``[E, D1, D2]``: every rank's
    ``(E_local * D1) % 64 == 0``. Empty shards satisfy both. (A grouped weight sharded on dim 0
    never splits an expert.) A one-rank group (a single process, or the replicated fallback's
    ``(W, 1)`` mesh) has no shard boundary and is always legal.

    Args:
        kind: ``"dense"`` or ``"grouped"``.
        shape: Logical parameter shape.
        world_size: FSDP shard-group size.

    Returns:
        A sentence naming the rule and the per-rank rows when violated, else ``None``.
    """
    kind = WeightKind.parse(kind)
    if world_size == 1:
        return None
    rows = shard_rows(shape[0], world_size)
    if kind is WeightKind.DENSE:
        bad = [r for r in rows if r % _MX_ROW_MULTIPLE]
        if bad:
            return (
                f"MXFP8 2-D rule M_local % {_MX_ROW_MULTIPLE} == 0 fails: rows per rank {rows} "
                f"(dim 0 = {shape[0]} over {world_size} ranks)"
            )
        return None
    bad = [r for r in rows if (r * shape[1]) % _MX_ROW_MULTIPLE]
    if bad:
        return (
            f"MXFP8 3-D rule (E_local * D1) % {_MX_ROW_MULTIPLE} == 0 fails: experts per rank {rows}, "
            f"D1 = {shape[1]} (E = {shape[0]} over {world_size} ranks)"
        )
    return None


# ------------------------------------------------------------------------------------------------
# Refresh accounting (read-only observers; lp_lightning.distributed.refresh builds probes on it).

_REFRESH_LOCK = threading.Lock()
_REFRESH_TOTAL = 0
_REFRESH_OBSERVERS: dict[int, Callable[[QuantizedWeightTensor], None]] = {}
_NEXT_OBSERVER_ID = 0


class _ObserverHandle:
    """Removes an observer added by :func:`add_refresh_observer`."""

    def __init__(self, key: int) -> None:
        self._key = key

    def remove(self) -> None:
        with _REFRESH_LOCK:
            _REFRESH_OBSERVERS.pop(self._key, None)


def add_refresh_observer(observer: Callable[[QuantizedWeightTensor], None]) -> _ObserverHandle:
    """Call ``observer(weight)`` after every storage (re)build. Observers must not mutate the weight.

    Returns:
        A handle whose ``remove()`` unregisters the observer.
    """
    global _NEXT_OBSERVER_ID
    with _REFRESH_LOCK:
        key = _NEXT_OBSERVER_ID
        _NEXT_OBSERVER_ID += 1
        _REFRESH_OBSERVERS[key] = observer
    return _ObserverHandle(key)


def total_refresh_count() -> int:
    """Storage builds of every ``QuantizedWeightTensor`` in this process since import."""
    return _REFRESH_TOTAL


def _note_refresh(weight: QuantizedWeightTensor) -> None:
    global _REFRESH_TOTAL
    with _REFRESH_LOCK:
        _REFRESH_TOTAL += 1
        observers = list(_REFRESH_OBSERVERS.values())
    for observer in observers:
        observer(weight)


# ------------------------------------------------------------------------------------------------
# Shared machinery of the two wrapper classes.


class _WeightState:
    """Mutable state shared by a weight and its aliases (rule 1): storage tensors and counters."""

    __slots__ = ("gather_layout", "gather_policy", "orientations", "refresh_count", "scale_scratch", "storage")

    def __init__(
        self,
        storage: dict[str, torch.Tensor] | None = None,
        refresh_count: int = 0,
        orientations: tuple[Orientation, ...] = _ORIENTATIONS,
        scale_scratch: torch.Tensor | None = None,
        gather_policy: GatherPolicy | None = None,
    ) -> None:
        self.storage = storage
        self.refresh_count = refresh_count
        self.orientations = orientations
        self.scale_scratch = scale_scratch
        self.gather_policy = gather_policy if gather_policy is not None else GatherPolicy()
        self.gather_layout: GatherLayout | None = None  # the schema of this weight's first FSDP2 gather


_OpHandler = Callable[[type, Any, tuple, dict], Any]


def _implements(table: dict[Any, _OpHandler], ops: Iterable[Any]) -> Callable[[_OpHandler], _OpHandler]:
    """Register ``fn`` for ``ops`` in ``table``; registering an op twice raises."""

    def decorator(fn: _OpHandler) -> _OpHandler:
        for op in ops:
            if op in table:
                raise RuntimeError(f"{op} is already registered to {table[op].__name__}; refusing {fn.__name__}.")
            table[op] = fn
        return fn

    return decorator


_GEMM_OPS = frozenset(
    {
        aten.mm,
        aten.addmm,
        aten.bmm,
        aten.baddbmm,
        aten.matmul,
        aten.linear,
        aten.mv,
        aten.dot,
        aten.addmv,
        aten.addbmm,
        aten._grouped_mm,
        aten._scaled_mm,
        aten.convolution,
        aten._convolution,
        aten.einsum,
    }
)


class _LowPrecisionWeightBase(torch.Tensor):
    """Declarations and behaviour shared by the persistent and the gathered weight.

    Subclasses declare ``tensor_data_names`` (required inner tensors), ``storage_names`` (optional
    inner tensors: the low-precision storage) and ``tensor_attribute_names`` once; flatten,
    unflatten and repr are generated from them.
    """

    tensor_data_names: ClassVar[tuple[str, ...]] = ()
    storage_names: ClassVar[tuple[str, ...]] = _ALL_STORAGE_NAMES
    tensor_attribute_names: ClassVar[tuple[str, ...]] = ()
    _op_table: ClassVar[dict[Any, _OpHandler]]

    __torch_function__ = torch._C._disabled_torch_function_impl

    recipe: LowPrecisionRecipe
    kind: WeightKind
    fqn: str
    _state: _WeightState

    # -- declared storage -------------------------------------------------------------------
    @property
    def format(self) -> LowPrecisionFormat:
        """The weight's ``LowPrecisionFormat`` (the recipe's)."""
        return self.recipe.format

    def _storage_tensor(self, name: str) -> torch.Tensor | None:
        storage = self._state.storage
        return None if storage is None else storage.get(name)

    @property
    def low_precision_storage(self) -> Mapping[str, torch.Tensor]:
        """Read-only ``{name: tensor}`` of the built storage (names of :func:`storage_spec`); empty if unbuilt."""
        return MappingProxyType(dict(self._state.storage or {}))

    @property
    def is_built(self) -> bool:
        """Whether the low-precision storage exists (see the module docstring, rule 2)."""
        return self._state.storage is not None

    @property
    def refresh_count(self) -> int:
        """How many times this weight's storage was built from its master."""
        return self._state.refresh_count

    # -- flatten / unflatten / repr from the declaration ---------------------------------------
    def __tensor_flatten__(self) -> tuple[list[str], tuple[Any, ...]]:
        names = [n for n in self.tensor_data_names]
        names += [f"storage_{n}" for n in self.storage_names if self._storage_tensor(n) is not None]
        ctx = tuple(getattr(self, a) for a in self.tensor_attribute_names)
        return names, (ctx, self._state.refresh_count, self._state.orientations)

    @classmethod
    def __tensor_unflatten__(
        cls, inner_tensors: dict[str, torch.Tensor], ctx: tuple[Any, ...], outer_size: Any, outer_stride: Any
    ) -> _LowPrecisionWeightBase:
        attrs, refresh_count, orientations = ctx
        storage = {n: inner_tensors[f"storage_{n}"] for n in cls.storage_names if f"storage_{n}" in inner_tensors}
        state = _WeightState(storage or None, refresh_count, orientations)
        kwargs = dict(zip(cls.tensor_attribute_names, attrs))
        required = {n: inner_tensors[n] for n in cls.tensor_data_names}
        return cls._rebuild(required, kwargs, state, tuple(outer_size), tuple(outer_stride))

    @classmethod
    def _rebuild(
        cls,
        required: dict[str, torch.Tensor],
        attrs: dict[str, Any],
        state: _WeightState,
        shape: tuple[int, ...],
        stride: tuple[int, ...],
    ) -> _LowPrecisionWeightBase:
        raise NotImplementedError(cls)

    def __repr__(self) -> str:  # type: ignore[override]
        parts = [f"shape={tuple(self.shape)}", f"dtype={self.dtype}"]
        for name in self.tensor_attribute_names:
            value = getattr(self, name)
            if isinstance(value, LowPrecisionRecipe):
                value = value.name
            elif isinstance(value, Enum):
                value = value.value
            parts.append(f"{name}={value!r}" if isinstance(value, str) else f"{name}={value}")
        for name in self.tensor_data_names:
            t = getattr(self, name)
            parts.append(f"{name}={t.dtype}{list(t.shape)}")
        if self.is_built:
            for name in self.storage_names:
                t = self._storage_tensor(name)
                if t is not None:
                    parts.append(f"{name}={t.dtype}{list(t.shape)}")
        else:
            parts.append("storage=<not built>")
        parts.append(f"refresh_count={self.refresh_count}")
        return f"{type(self).__name__}({', '.join(parts)})"

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        """An independent copy via ``clone`` (recipe and policy are immutable and shared)."""
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()
        if getattr(self, "_is_param", False):
            new = nn.Parameter(new, requires_grad=self.requires_grad)
        elif self.requires_grad:
            new.requires_grad_(True)
        memo[id(self)] = new
        return new

    # -- select ----------------------------------------------------------------------------
    def select(self, orientation: Orientation, *args: Any) -> QuantizedOperand:  # type: ignore[override]
        """The operand of one GEMM direction: a view of the storage plus orientation metadata.

        No quantisation and no copy happen here (design spec §7.2–7.3): MXFP8 picks the row or col
        copy, HiF8 describes its single ``data`` for the orientation. Shapes are those of the
        GEMM view (dense ``[N, K]``; grouped ``[E, K, N]``).

        Args:
            orientation: ``"row"`` (blocks along the GEMM view's last dim) or ``"col"`` (along
                dim −2). This overrides ``torch.Tensor.select(dim, index)``, which a
                low-precision weight does not support.

        Returns:
            ``QuantizedOperand`` with ``logical_dtype`` = this tensor's dtype.

        Raises:
            TypeError: for ``select(dim, index)``-style arguments.
            ValueError: for an illegal orientation, an unbuilt storage, or an orientation this
                (gathered) copy does not carry.
        """
        if args or not isinstance(orientation, str):
            raise TypeError(
                f"{type(self).__name__}.select takes one orientation ('row' or 'col'), got "
                f"{(orientation, *args)!r}; integer indexing (torch.Tensor.select) is not defined on a "
                "low-precision weight — index its master instead."
            )
        if orientation not in _ORIENTATIONS:
            raise ValueError(f"{type(self).__name__}.select: orientation={orientation!r}; legal values: 'row', 'col'.")
        if not self.is_built:
            raise ValueError(
                f"{type(self).__name__}.select({orientation!r}) on weight {self.fqn!r}: the low-precision storage "
                "is not built (a fresh FSDP2 shard or a copy). Call "
                "lp_lightning.distributed.refresh.refresh_low_precision_weights(model.parameters()) after "
                "fully_shard / load, before the first forward."
            )
        if orientation not in self._state.orientations:
            raise ValueError(
                f"{type(self).__name__}.select({orientation!r}) on weight {self.fqn!r}: this all-gathered copy "
                f"carries only {self._state.orientations}. The weight's GatherPolicy promised that FSDP2 re-gathers "
                "before the other pass; it did not (root module without an explicit reshard_after_forward, "
                "set_reshard_after_backward(False), or activation checkpointing). Finalize with "
                "GatherPolicy(reshard_after_forward=False) or activation_checkpoint='full'."
            )
        if self.format is LowPrecisionFormat.MXFP8_E4M3:
            data, scale = self._storage_tensor(f"{orientation}_data"), self._storage_tensor(f"{orientation}_scale")
            return QuantizedOperand(
                data=data, scale=scale, logical_dtype=self.dtype, format=self.format, orientation=orientation
            )
        return QuantizedOperand(
            data=self._storage_tensor("data"),
            scale=self._storage_tensor("scale"),
            logical_dtype=self.dtype,
            format=self.format,
            orientation=orientation,
            format_max=_hif8_weight_format_max(self.recipe),
        )

    # -- dispatch --------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        handler = cls._op_table.get(func)
        if handler is not None:
            return handler(cls, func, args, kwargs)
        if func.overloadpacket in _GEMM_OPS:
            raise TypeError(
                f"{func} on a {cls.__name__} would run a high-precision GEMM on the weight; low-precision "
                "modules consume it through weight.select(orientation) and lp_lightning.ops (no silent "
                "BF16/FP32 fallback, requirement R6 (docs/design.md))."
            )
        return cls._generic(func, args, kwargs)

    @classmethod
    def _generic(cls, func: Any, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError(func, cls)


for _name in _ALL_STORAGE_NAMES:  # ``storage_<name>`` attributes: what __tensor_flatten__ names
    setattr(
        _LowPrecisionWeightBase,
        f"storage_{_name}",
        property(lambda self, _n=_name: self._storage_tensor(_n), doc=f"Storage tensor {_name!r} (None if absent)."),
    )


_STRUCTURAL_HINT = (
    "a low-precision weight supports no reshaping/transposing view (F.linear and matmul transpose their "
    "weight); GEMMs consume it through select(orientation), the master is available as .master"
)


def _hif8_weight_format_max(recipe: LowPrecisionRecipe) -> float:
    q_fwd = recipe.quantizer(QuantizationRole.WEIGHT_FWD)
    q_bwd = recipe.quantizer(QuantizationRole.WEIGHT_BWD)
    fmax_fwd, fmax_bwd = getattr(q_fwd, "format_max", None), getattr(q_bwd, "format_max", None)
    if fmax_fwd != fmax_bwd or fmax_fwd is None:
        raise ValueError(
            f"recipe {recipe.name!r}: the HiF8 weight keeps one data copy for fprop and dgrad (design spec §7.3), so "
            f"WEIGHT_FWD and WEIGHT_BWD must share format_max; got {fmax_fwd} and {fmax_bwd}."
        )
    return float(fmax_fwd)


def _mutated_args(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The argument values the op writes to (schema ``Tensor(a!)``)."""
    mutated = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            if arg.kwarg_only or i >= len(args):
                if arg.name in kwargs:
                    mutated.append(kwargs[arg.name])
            else:
                mutated.append(args[i])
    return mutated


def _contains(values: Iterable[Any], cls: type) -> bool:
    for value in values:
        if isinstance(value, cls):
            return True
        if isinstance(value, (list, tuple)) and any(isinstance(v, cls) for v in value):
            return True
    return False


# ------------------------------------------------------------------------------------------------
# QuantizedWeightTensor: master + derived storage.

_QWT_OPS: dict[Any, _OpHandler] = {}


class QuantizedWeightTensor(_LowPrecisionWeightBase):
    """A persistent low-precision weight: FP32 master plus derived storage (design spec §7.2–7.3, §13.4).

    Build with :meth:`from_master` (or :func:`finalize_low_precision_weights` for a whole model).
    The module docstring states the dispatch rule and the FSDP2 gather schema.

    Attributes:
        master: The high-precision master (plain tensor of the logical shape and dtype).
        recipe: The ``LowPrecisionRecipe`` whose WEIGHT quantizer builds the storage.
        kind: ``WeightKind.DENSE`` or ``WeightKind.GROUPED``.
        fqn: Parameter FQN (for messages and probes; ``""`` if unknown).
        gather_policy: :class:`GatherPolicy` for FSDP2 gathers (MXFP8 only).
    """

    tensor_data_names: ClassVar[tuple[str, ...]] = ("master",)
    tensor_attribute_names: ClassVar[tuple[str, ...]] = ("recipe", "kind", "fqn", "gather_policy")
    _op_table: ClassVar[dict[Any, _OpHandler]] = _QWT_OPS

    master: torch.Tensor

    @staticmethod
    def __new__(
        cls,
        master: torch.Tensor,
        *,
        recipe: LowPrecisionRecipe,
        kind: WeightKind,
        fqn: str = "",
        gather_policy: GatherPolicy | None = None,
        state: _WeightState | None = None,
        requires_grad: bool = False,
    ) -> QuantizedWeightTensor:
        if isinstance(master, _LowPrecisionWeightBase) or not isinstance(master, torch.Tensor):
            raise TypeError(f"QuantizedWeightTensor: master must be a plain torch.Tensor, got {type(master).__name__}.")
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            master.shape,
            strides=master.stride(),
            storage_offset=master.storage_offset(),
            dtype=master.dtype,
            device=master.device,
            layout=master.layout,
            requires_grad=requires_grad,
        )
        self.master = master
        self.recipe = recipe
        self.kind = kind
        self.fqn = fqn
        self._state = state if state is not None else _WeightState()
        if gather_policy is not None:
            if not isinstance(gather_policy, GatherPolicy):
                raise TypeError(f"gather_policy must be a GatherPolicy, got {type(gather_policy).__name__}.")
            self._state.gather_policy = gather_policy
        return self

    @property
    def gather_policy(self) -> GatherPolicy:
        """The :class:`GatherPolicy` (shared by aliases; fixed once FSDP2 gathered the weight)."""
        return self._state.gather_policy

    @gather_policy.setter
    def gather_policy(self, policy: GatherPolicy) -> None:
        if not isinstance(policy, GatherPolicy):
            raise TypeError(f"gather_policy must be a GatherPolicy, got {type(policy).__name__}.")
        if self._state.gather_layout is not None and policy != self._state.gather_policy:
            raise ValueError(
                f"{self.fqn!r}: the gather policy cannot change after the first FSDP2 all-gather (FSDP2 sized the "
                "all-gather buffers from the first call); set it before the first forward."
            )
        self._state.gather_policy = policy

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # all work is in __new__
        super().__init__()

    @classmethod
    def _rebuild(cls, required, attrs, state, shape, stride):  # noqa: ANN001, ANN206 - see base
        return cls(required["master"], state=state, **attrs)

    def _derive(self, master: torch.Tensor, state: _WeightState | None = None) -> QuantizedWeightTensor:
        if state is None:
            state = _WeightState(gather_policy=self.gather_policy)
        return QuantizedWeightTensor(master, recipe=self.recipe, kind=self.kind, fqn=self.fqn, state=state)

    @classmethod
    def from_master(
        cls,
        master: torch.Tensor,
        *,
        recipe: LowPrecisionRecipe | str,
        kind: WeightKind | str,
        fqn: str = "",
        gather_policy: GatherPolicy | None = None,
        requires_grad: bool = False,
    ) -> QuantizedWeightTensor:
        """Wrap ``master`` and build its storage once (a refresh, counted).

        Args:
            master: Plain floating tensor: ``[N, K]`` for ``kind="dense"``, ``[E, N, K]`` for
                ``"grouped"``. Kept by reference (no copy); the optimizer updates it.
            recipe: A ``LowPrecisionRecipe`` or a format name (``"mxfp8_e4m3"``, ``"hif8"``).
            kind: ``"dense"`` or ``"grouped"``.
            fqn: Parameter FQN for messages and probes.
            gather_policy: FSDP2 gather policy (MXFP8).
            requires_grad: ``requires_grad`` of the wrapper.

        Returns:
            A built ``QuantizedWeightTensor`` with ``refresh_count == 1``.

        Raises:
            TypeError: for a non-float or subclass master.
            ValueError: for a shape that does not fit ``kind`` or has an empty dimension.
        """
        recipe = recipe if isinstance(recipe, LowPrecisionRecipe) else recipe_for(recipe)
        kind = WeightKind.parse(kind)
        _check_master(master, kind, fqn)
        weight = cls(
            master.detach(), recipe=recipe, kind=kind, fqn=fqn, gather_policy=gather_policy, requires_grad=requires_grad
        )
        weight.refresh_from_master()
        return weight

    # -- refresh ---------------------------------------------------------------------------
    @torch.no_grad()
    def refresh_from_master(
        self, master_shard: torch.Tensor | None = None, *, amax: torch.Tensor | None = None
    ) -> None:
        """(Re)build the low-precision storage from the master: the only way it changes (design spec §10, §13.4).

        MXFP8: one dual quantisation (``quantize_dual``) of the dense weight or of the grouped
        GMM view. HiF8: current scaling of the master with the WEIGHT quantizer; a dense weight
        may take a precomputed ``amax`` (the MAX over its FSDP group, design spec §9.2), a grouped weight
        uses its own per-expert amax.

        Args:
            master_shard: Optional; if given it must alias this weight's master (the same tensor,
                or a plain view with the same storage, offset, shape and strides) — a guard that
                the storage is never rebuilt from anything else (e.g. a dequantised weight).
            amax: HiF8 dense only: FP32 0-d amax to use instead of the local one.

        Raises:
            ValueError: ``master_shard`` is not this weight's master, or ``amax`` is given for an
                MXFP8 or grouped weight.
        """
        if master_shard is not None and not _aliases(master_shard, self.master):
            raise ValueError(
                f"refresh_from_master({self.fqn!r}): master_shard (shape {tuple(master_shard.shape)}, dtype "
                f"{master_shard.dtype}) is not this weight's master; the storage is only rebuilt from the "
                "authoritative FP32 master (design spec §10), never from a copy or a dequantised weight."
            )
        if amax is not None and (self.format is not LowPrecisionFormat.HIF8 or self.kind is not WeightKind.DENSE):
            raise ValueError(
                f"refresh_from_master({self.fqn!r}): amax is only used by HiF8 dense weights (per-tensor scale), "
                f"this is {self.format.value} {self.kind.value}."
            )
        self._state.storage = _quantize_storage(self.master, self.recipe, self.kind, amax)
        self._state.refresh_count += 1
        _note_refresh(self)

    def local_amax(self) -> torch.Tensor:
        """HiF8: the master's amax as the WEIGHT quantizer computes it (0-d dense, ``[E]`` grouped)."""
        quantizer = self.recipe.quantizer(QuantizationRole.WEIGHT_FWD)
        return quantizer.compute_amax(self.master)  # type: ignore[attr-defined]

    def untyped_storage(self) -> torch.UntypedStorage:  # type: ignore[override]
        """The master's storage: a weight's bytes in memory are its master's (FSDP2 compares it)."""
        return self.master.untyped_storage()

    # -- FSDP2 extension -------------------------------------------------------------------
    def fsdp_pre_all_gather(
        self,
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
            ValueError: storage not built, not a dim-0 shard, an MXFP8 shard breaking §9.1, or
                storage tensors that disagree with the declared schema.
        """
        world_size, rank = mesh.size(), mesh.get_local_rank()
        layout = gather_layout(self.format, self.kind, tuple(outer_size), world_size, self.gather_policy)
        local_rows = layout.local_rows[rank]
        expected_local = (local_rows, *layout.outer_shape[1:])
        if tuple(self.shape) != expected_local:
            raise ValueError(
                f"fsdp_pre_all_gather({self.fqn!r}): local shard {tuple(self.shape)} is not the dim-0 shard "
                f"{expected_local} of {layout.outer_shape} on rank {rank} of {world_size}; low-precision weights "
                "only support FSDP2 Shard(0) (do not pass a shard_placement_fn for them)."
            )
        if not self.is_built:
            raise ValueError(
                f"fsdp_pre_all_gather({self.fqn!r}): the low-precision shard was never built; call "
                "refresh_low_precision_weights(model.parameters()) after fully_shard (design spec §10)."
            )
        if self._state.gather_layout is None:
            self._state.gather_layout = layout
        elif self._state.gather_layout != layout:
            raise ValueError(
                f"fsdp_pre_all_gather({self.fqn!r}): the gather schema changed since the first all-gather "
                f"({self._state.gather_layout} -> {layout}); FSDP2 sized its buffers from the first call."
            )
        phase = current_gather_phase()
        orientations = layout.orientations_for(phase)
        slots = layout.pack(self._state.storage, orientations, local_rows, fqn=self.fqn)
        return slots, GatherMetadata(fqn=self.fqn, phase=phase, orientations=orientations, layout=layout)

    def fsdp_post_all_gather(
        self,
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
                f"fsdp_post_all_gather({self.fqn!r}): metadata must be the GatherMetadata of fsdp_pre_all_gather, "
                f"got {type(metadata).__name__}."
            )
        layout = metadata.layout
        expected = gather_layout(self.format, self.kind, layout.outer_shape, layout.world_size, self.gather_policy)
        if layout != expected or metadata.fqn != self.fqn:
            raise ValueError(
                f"fsdp_post_all_gather({self.fqn!r}): metadata describes {metadata.fqn!r} with {layout}, this weight "
                f"expects {expected}."
            )
        scratch = None
        if out is not None:
            if not isinstance(out, GatheredWeightTensor):
                raise TypeError(
                    f"fsdp_post_all_gather({self.fqn!r}): out must be a GatheredWeightTensor, got {type(out).__name__}."
                )
            scratch = out._state.scale_scratch
        storage, scratch = layout.unpack(tuple(all_gather_outputs), metadata.orientations, scratch, fqn=self.fqn)
        if out is not None:
            if tuple(out.shape) != layout.outer_shape or out.dtype != param_dtype:
                raise ValueError(
                    f"fsdp_post_all_gather({self.fqn!r}): out is {tuple(out.shape)} {out.dtype}, expected "
                    f"{layout.outer_shape} {param_dtype}."
                )
            out._state.storage = storage
            out._state.orientations = metadata.orientations
            out._state.scale_scratch = scratch
            return None
        gathered = GatheredWeightTensor(
            layout.outer_shape,
            logical_dtype=param_dtype,
            recipe=self.recipe,
            kind=self.kind,
            fqn=self.fqn,
            state=_WeightState(storage, 0, metadata.orientations, scratch),
            device=all_gather_outputs[0].device if all_gather_outputs else self.device,
        )
        inner = tuple(all_gather_outputs) + ((scratch,) if scratch is not None else ())
        return gathered, inner

    # -- dispatch rules 4, 6, 7 --------------------------------------------------------------
    @classmethod
    def _generic(cls, func: Any, args: tuple, kwargs: dict) -> Any:
        mutated = _mutated_args(func, args, kwargs)
        unwrap = lambda t: t.master  # noqa: E731
        if _contains(mutated, cls):
            name = func.overloadpacket.__name__
            if torch.Tag.inplace_view in func.tags or name in ("resize_", "set_", "resize_as_", "detach_"):
                raise NotImplementedError(func, cls, _STRUCTURAL_HINT)
            wrappers = {}
            for value in mutated:
                for v in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(v, cls):
                        wrappers[id(v.master)] = v
            out = func(*tree_map_only(cls, unwrap, args), **tree_map_only(cls, unwrap, kwargs))
            return tree_map_only(torch.Tensor, lambda t: wrappers.get(id(t), t), out)
        if any(r.alias_info is not None for r in func._schema.returns):
            raise NotImplementedError(func, cls, _STRUCTURAL_HINT)
        return func(*tree_map_only(cls, unwrap, args), **tree_map_only(cls, unwrap, kwargs))


def is_master_of(candidate: torch.Tensor, weight: QuantizedWeightTensor) -> bool:
    """Whether ``candidate`` is ``weight``'s master: the master itself, an alias wrapper of the
    weight, or a plain tensor viewing the same memory with the same shape, strides and dtype."""
    return _aliases(candidate, weight.master)


def _aliases(candidate: torch.Tensor, master: torch.Tensor) -> bool:
    if candidate is master:
        return True
    if isinstance(candidate, QuantizedWeightTensor):
        candidate = candidate.master
    if isinstance(candidate, _LowPrecisionWeightBase) or not isinstance(candidate, torch.Tensor):
        return False
    return (
        candidate.device == master.device
        and candidate.dtype == master.dtype
        and tuple(candidate.shape) == tuple(master.shape)
        and candidate.stride() == master.stride()
        and (candidate.numel() == 0 or candidate.data_ptr() == master.data_ptr())
    )


def _check_master(master: torch.Tensor, kind: WeightKind, fqn: str) -> None:
    if not isinstance(master, torch.Tensor) or isinstance(master, _LowPrecisionWeightBase):
        raise TypeError(f"{fqn or 'weight'}: the master must be a plain tensor, got {type(master).__name__}.")
    if master.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{fqn or 'weight'}: master dtype {master.dtype} is not float32/bfloat16/float16.")
    want = 2 if kind is WeightKind.DENSE else 3
    if master.dim() != want or 0 in master.shape:
        raise ValueError(
            f"{fqn or 'weight'}: a {kind.value} weight must be a {want}-D tensor with no empty dimension "
            f"({'[N, K]' if want == 2 else '[E, N, K]'}), got shape {tuple(master.shape)}."
        )


def _quantize_storage(
    master: torch.Tensor, recipe: LowPrecisionRecipe, kind: WeightKind, amax: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Quantise ``master`` (``[L, K]`` or ``[L, N, K]``, ``L`` possibly 0) into the declared storage."""
    spec = storage_spec(recipe.format, kind, tuple(master.shape))
    if master.numel() == 0:  # an empty FSDP2 shard: nothing to quantise, keep the declared schema
        storage = {n: torch.empty(s, dtype=d, device=master.device) for n, (s, d) in spec.items()}
        if recipe.format is LowPrecisionFormat.HIF8 and kind is WeightKind.DENSE:
            q = recipe.quantizer(QuantizationRole.WEIGHT_FWD)
            zero = torch.zeros((), dtype=torch.float32, device=master.device)
            storage["scale"] = q.scale_from_amax(zero if amax is None else amax)  # type: ignore[attr-defined]
        return storage
    view = master if kind is WeightKind.DENSE else master.transpose(-1, -2)
    quantizer = recipe.quantizer(QuantizationRole.WEIGHT_FWD)
    if recipe.format is LowPrecisionFormat.MXFP8_E4M3:
        row, col = quantizer.quantize_dual(view)  # type: ignore[attr-defined]
        storage = {
            "row_data": row.data.contiguous(),
            "row_scale": row.scale.contiguous(),
            "col_data": col.data.contiguous(),
            "col_scale": col.scale.contiguous(),
        }
    else:
        _hif8_weight_format_max(recipe)
        kwargs = {"amax": amax.to(device=master.device, dtype=torch.float32)} if amax is not None else {}
        op = quantizer.quantize(view, orientation="row", **kwargs)  # type: ignore[call-arg]
        storage = {"data": op.data.contiguous(), "scale": op.scale.contiguous()}
    for name, (shape, dtype) in spec.items():
        t = storage[name]
        assert tuple(t.shape) == shape and t.dtype == dtype, (name, tuple(t.shape), t.dtype, shape, dtype)
    return storage


@_implements(_QWT_OPS, [aten.detach.default, aten.alias.default])
def _qwt_alias(cls: type, func: Any, args: tuple, kwargs: dict) -> QuantizedWeightTensor:
    (self,) = args
    return self._derive(func(self.master), self._state)


@_implements(_QWT_OPS, [aten.view.default, aten._unsafe_view.default])
def _qwt_view(cls: type, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    self, size = args[0], args[1]
    out = func(self.master, size)
    if tuple(out.shape) == tuple(self.shape):
        return self._derive(out, self._state)
    return out  # rule 6: a reshaped view is the master's (FSDP2's flat byte view of the padded shard)


@_implements(_QWT_OPS, [aten.as_strided.default])
def _qwt_as_strided(cls: type, func: Any, args: tuple, kwargs: dict) -> QuantizedWeightTensor:
    self = args[0]
    out = func(self.master, *args[1:], **kwargs)
    if (tuple(out.shape), out.stride(), out.storage_offset()) == (
        tuple(self.master.shape),
        self.master.stride(),
        self.master.storage_offset(),
    ):
        return self._derive(out, self._state)
    raise NotImplementedError(func, cls)


@_implements(
    _QWT_OPS,
    [
        aten.slice.Tensor,
        aten.split.Tensor,
        aten.split_with_sizes.default,
        aten.narrow.default,
        aten.chunk.default,
        aten.new_zeros.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
        aten.empty_like.default,
    ],
)
def _qwt_fresh(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    self = args[0]
    out = func(self.master, *args[1:], **kwargs)
    return tree_map_only(torch.Tensor, lambda t: self._derive(t), out)


@_implements(_QWT_OPS, [aten.clone.default])
def _qwt_clone(cls: type, func: Any, args: tuple, kwargs: dict) -> QuantizedWeightTensor:
    self = args[0]
    state = self._state
    storage = None if state.storage is None else {n: t.clone() for n, t in state.storage.items()}
    cloned_state = _WeightState(storage, state.refresh_count, gather_policy=state.gather_policy)
    return self._derive(func(self.master, *args[1:], **kwargs), cloned_state)


@_implements(_QWT_OPS, [aten._to_copy.default])
def _qwt_to_copy(cls: type, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    self = args[0]
    out = func(self.master, *args[1:], **kwargs)
    if out.dtype != self.master.dtype:
        return out  # rule 3: a dtype conversion is a value conversion of the master
    state = self._state
    storage = None
    if state.storage is not None:
        non_blocking = bool(kwargs.get("non_blocking", False))
        storage = {n: t.to(device=out.device, non_blocking=non_blocking) for n, t in state.storage.items()}
    return self._derive(out, _WeightState(storage, state.refresh_count, gather_policy=state.gather_policy))


@_implements(_QWT_OPS, [aten.copy_.default])
def _qwt_copy_(cls: type, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    dst, src = args[0], args[1]
    src_plain = src.master if isinstance(src, QuantizedWeightTensor) else src
    if isinstance(src_plain, _LowPrecisionWeightBase):
        raise TypeError(f"copy_ from a {type(src_plain).__name__}: a gathered weight has no high-precision values.")
    if isinstance(dst, QuantizedWeightTensor):
        func(dst.master, src_plain, *args[2:], **kwargs)
        return dst
    return func(dst, src_plain, *args[2:], **kwargs)


# ------------------------------------------------------------------------------------------------
# GatheredWeightTensor: the unsharded compute weight FSDP2 rebuilds (no master).

_GATHERED_OPS: dict[Any, _OpHandler] = {}


class GatheredWeightTensor(_LowPrecisionWeightBase):
    """The full logical weight rebuilt by ``fsdp_post_all_gather``: storage views, no master.

    It lives only inside FSDP2's unshard window (design spec §9.3); its storage points into the
    all-gather buffers FSDP2 frees at reshard and refills in place on the next gather. Use
    ``select``; compute ops raise (there are no high-precision values to compute with).

    Attributes:
        recipe, kind, fqn: As the sharded :class:`QuantizedWeightTensor`.
        orientations: The orientations this gather carried (see :class:`GatherPolicy`).
    """

    tensor_attribute_names: ClassVar[tuple[str, ...]] = ("recipe", "kind", "fqn", "logical_dtype")
    _op_table: ClassVar[dict[Any, _OpHandler]] = _GATHERED_OPS

    @staticmethod
    def __new__(
        cls,
        shape: tuple[int, ...],
        *,
        logical_dtype: torch.dtype,
        recipe: LowPrecisionRecipe,
        kind: WeightKind,
        fqn: str,
        state: _WeightState,
        device: torch.device,
        stride: tuple[int, ...] | None = None,
        requires_grad: bool = False,
    ) -> GatheredWeightTensor:
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            shape,
            strides=stride if stride is not None else _contiguous_strides(shape),
            dtype=logical_dtype,
            device=device,
            requires_grad=requires_grad,
        )
        self.recipe = recipe
        self.kind = kind
        self.fqn = fqn
        self._state = state
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    @property
    def orientations(self) -> tuple[Orientation, ...]:
        """Orientations the current gather carried."""
        return self._state.orientations

    @property
    def logical_dtype(self) -> torch.dtype:
        """The gathered weight's dtype (FSDP2's ``param_dtype``)."""
        return self.dtype

    @classmethod
    def _rebuild(cls, required, attrs, state, shape, stride):  # noqa: ANN001, ANN206 - see base
        device = next(iter(state.storage.values())).device if state.storage else torch.device("cpu")
        return cls(shape, state=state, device=device, stride=stride, **attrs)

    def _alias(self) -> GatheredWeightTensor:
        return GatheredWeightTensor(
            tuple(self.shape),
            logical_dtype=self.dtype,
            recipe=self.recipe,
            kind=self.kind,
            fqn=self.fqn,
            state=self._state,
            device=self.device,
            stride=self.stride(),
        )

    @classmethod
    def _generic(cls, func: Any, args: tuple, kwargs: dict) -> Any:
        if any(r.alias_info is not None for r in func._schema.returns):
            raise NotImplementedError(func, cls, _STRUCTURAL_HINT)
        raise TypeError(
            f"{func} on a GatheredWeightTensor: the all-gathered low-precision weight has no high-precision "
            "values; consume it through select(orientation) (the FP32 master lives in the sharded parameter)."
        )


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


@_implements(_GATHERED_OPS, [aten.detach.default, aten.alias.default])
def _gathered_alias(cls: type, func: Any, args: tuple, kwargs: dict) -> GatheredWeightTensor:
    return args[0]._alias()


@_implements(_GATHERED_OPS, [aten.view.default, aten._unsafe_view.default, aten.as_strided.default])
def _gathered_view(cls: type, func: Any, args: tuple, kwargs: dict) -> GatheredWeightTensor:
    self = args[0]
    size = tuple(args[1])
    same = size == tuple(self.shape)
    if func is aten.as_strided.default:
        stride = tuple(args[2])
        offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
        same = same and stride == self.stride() and not offset
    if not same:
        raise NotImplementedError(func, cls)
    return self._alias()


@_implements(_GATHERED_OPS, [aten.zeros_like.default, aten.empty_like.default, aten.new_zeros.default])
def _gathered_alloc(cls: type, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    self = args[0]
    kwargs = dict(kwargs)
    kwargs.pop("memory_format", None)
    if func is aten.new_zeros.default:
        return torch.zeros(tuple(args[1]), dtype=kwargs.get("dtype") or self.dtype, device=self.device)
    maker = torch.zeros if func is aten.zeros_like.default else torch.empty
    return maker(tuple(self.shape), dtype=kwargs.get("dtype") or self.dtype, device=kwargs.get("device") or self.device)


# ------------------------------------------------------------------------------------------------
# FSDP2 gather layout: the fixed schema of the physical tensors (see the module docstring).


@dataclass(frozen=True)
class GatherMetadata:
    """What ``fsdp_pre_all_gather`` tells the matching post hook (FSDP2 passes it through as is).

    Attributes:
        fqn: Parameter FQN.
        phase: ``"forward"`` or ``"backward"`` (:func:`current_gather_phase`).
        orientations: Orientations in this gather (HiF8: both, from one ``data``).
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
        format: Weight format.
        kind: Dense or grouped.
        outer_shape: Full logical parameter shape ``(D0, *rest)``.
        world_size: FSDP shard-group size ``W``.
        both_orientations: MXFP8: every gather carries row and col.
    """

    format: LowPrecisionFormat
    kind: WeightKind
    outer_shape: tuple[int, ...]
    world_size: int
    both_orientations: bool
    local_rows: tuple[int, ...] = field(init=False)
    rows_per_rank: int = field(init=False)
    uneven: bool = field(init=False)
    data_payloads: tuple[str, ...] = field(init=False)
    scale_payloads: tuple[str, ...] = field(init=False)
    scale_capacity: tuple[int, ...] = field(init=False)
    slots: tuple[tuple[str, tuple[int, ...]], ...] = field(init=False)
    scratch_offsets: tuple[tuple[str, int], ...] = field(init=False)
    scratch_bytes: int = field(init=False)
    packed_offsets: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        rows = shard_rows(self.outer_shape[0], self.world_size)
        set_ = functools.partial(object.__setattr__, self)
        set_("local_rows", tuple(rows))
        set_("rows_per_rank", rows[0])
        set_("uneven", self.outer_shape[0] % self.world_size != 0)
        if self.format is LowPrecisionFormat.HIF8:
            data_p, scale_p = ("data",), ("scale",)
        elif self.both_orientations:
            data_p, scale_p = ("row_data", "col_data"), ("row_scale", "col_scale")
        else:
            data_p, scale_p = ("data",), ("scale",)
        set_("data_payloads", data_p)
        set_("scale_payloads", scale_p)
        shard_spec = self._spec(self.rows_per_rank)
        caps = tuple(max(_nbytes(*shard_spec[n]) for n in self.candidates(p)) for p in scale_p)
        set_("scale_capacity", caps)
        shard_shape = (self.rows_per_rank, *self.outer_shape[1:])
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
        elif self.uneven:
            shard_bytes = math.prod(shard_shape)
            slots += [(f"scales[{i}]", shard_shape) for i in range(math.ceil(sum(caps) / shard_bytes))]
        else:
            slots += [(p, (cap,)) for p, cap in zip(scale_p, caps)]
        set_("slots", tuple(slots))
        set_("packed_offsets", tuple(packed))
        # Scale tensors that cannot be zero-copy views of one gathered slot are copied into a
        # scratch buffer (uneven sharding, or a single-orientation slot sized to the larger scale).
        full_spec = self._spec(self.outer_shape[0])
        offsets, total = [], 0
        for p, cap in zip(scale_p, caps):
            for name in self.candidates(p):
                if self.world_size > 1 and (self.uneven or _nbytes(*shard_spec[name]) != cap):
                    shape, dtype = full_spec[name]
                    replicated = name == "scale" and self.kind is WeightKind.DENSE  # one FP32 per rank
                    nbytes = 4 * self.world_size if replicated else _nbytes(shape, dtype)
                    offsets.append((name, total))
                    total += -(-nbytes // 16) * 16
        set_("scratch_offsets", tuple(offsets))
        set_("scratch_bytes", total)

    def _spec(self, rows: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return storage_spec(self.format, self.kind, (rows, *self.outer_shape[1:]))

    def candidates(self, payload: str) -> tuple[str, ...]:
        """Storage names that may fill ``payload`` (MXFP8 single-orientation slots serve two)."""
        if self.format is LowPrecisionFormat.MXFP8_E4M3 and not self.both_orientations:
            return ("row_data", "col_data") if payload == "data" else ("row_scale", "col_scale")
        return (payload,)

    def orientations_for(self, phase: GatherPhase) -> tuple[Orientation, ...]:
        """Orientations a gather in ``phase`` carries (design spec §9.1 direction table)."""
        if self.format is LowPrecisionFormat.HIF8 or self.both_orientations:
            return _ORIENTATIONS
        fprop: Orientation = "row" if self.kind is WeightKind.DENSE else "col"
        dgrad: Orientation = "col" if self.kind is WeightKind.DENSE else "row"
        return (fprop,) if phase == "forward" else (dgrad,)

    def _active(self, payload: str, orientations: tuple[Orientation, ...]) -> str:
        if self.format is LowPrecisionFormat.MXFP8_E4M3 and not self.both_orientations:
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
        shard_shape = (self.rows_per_rank, *self.outer_shape[1:])
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
        if self.uneven:
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
        full_spec = self._spec(d0)
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
            storage[name] = gathered[:d0].view(shape).view(dtype)
        if self.scratch_bytes and (scratch is None or scratch.numel() != self.scratch_bytes):
            scratch = torch.empty(self.scratch_bytes, dtype=torch.uint8, device=outputs[0].device)
        offsets = dict(self.scratch_offsets)
        scale_outputs = outputs[len(self.data_payloads) :]
        if self.uneven:
            per_rank_slots = [g.reshape(world, -1) for g in scale_outputs]  # rank r's region = row r
            regions = torch.cat(per_rank_slots, dim=1) if len(per_rank_slots) > 1 else per_rank_slots[0]
        region_offset = 0
        for i, (payload, cap) in enumerate(zip(self.scale_payloads, self.scale_capacity)):
            name = self._active(payload, orientations)
            shape, dtype = full_spec[name]
            per_rank = [_nbytes(*self._spec(rows)[name]) for rows in self.local_rows]
            if not self.uneven and all(b == cap for b in per_rank):
                flat = scale_outputs[i]  # rank-major and gap-free: the full tensor's bytes in order
            else:
                if self.uneven:
                    ranks = regions[:, region_offset : region_offset + cap]
                else:
                    ranks = scale_outputs[i].view(world, cap)
                assert scratch is not None
                start = offsets[name]
                total = sum(per_rank)
                flat = scratch[start : start + total]
                torch.cat([ranks[r, :b] for r, b in enumerate(per_rank)], out=flat)
            region_offset += cap
            if name == "scale" and self.kind is WeightKind.DENSE:  # HiF8 per-tensor scale, one copy per rank
                scales_W = flat.view(torch.float32)
                if not bool(torch.all(scales_W == scales_W[0])):
                    raise ValueError(
                        f"fsdp_post_all_gather({fqn!r}): HiF8 dense scales differ across ranks {scales_W.tolist()}; "
                        "refresh with refresh_low_precision_weights on every rank (it MAX-reduces the amax over the "
                        "FSDP group, design spec §9.2)."
                    )
                storage[name] = scales_W[0]
            else:
                storage[name] = flat.view(dtype).view(shape)
        return storage, scratch


@functools.lru_cache(maxsize=4096)
def _gather_layout_cached(
    fmt: LowPrecisionFormat, kind: WeightKind, outer_shape: tuple[int, ...], world_size: int, both: bool
) -> GatherLayout:
    return GatherLayout(fmt, kind, outer_shape, world_size, both)


def gather_layout(
    format: LowPrecisionFormat | str,
    kind: WeightKind | str,
    outer_shape: tuple[int, ...],
    world_size: int,
    policy: GatherPolicy = GatherPolicy(),
) -> GatherLayout:
    """The fixed FSDP2 gather schema of a weight (cached; identical on every rank and call).

    Args:
        format: Weight format.
        kind: Dense or grouped.
        outer_shape: Full logical parameter shape.
        world_size: FSDP shard-group size.
        policy: Gather policy (MXFP8 orientation choice).

    Returns:
        The :class:`GatherLayout`.

    Raises:
        ValueError: an MXFP8 layout that breaks the shard rule of design spec §9.1.
    """
    fmt, kind = LowPrecisionFormat.parse(format), WeightKind.parse(kind)
    if fmt is LowPrecisionFormat.MXFP8_E4M3:
        reason = mx_shard_rule_violation(kind, tuple(outer_shape), world_size)
        if reason is not None:
            raise ValueError(
                f"cannot all-gather an MXFP8 {kind.value} weight of shape {tuple(outer_shape)} over {world_size} "
                f"ranks: {reason}. Keep it replicated (fallback_to_unsharded=true) or change the world size."
            )
    both = fmt is LowPrecisionFormat.MXFP8_E4M3 and policy.gathers_both_orientations
    return _gather_layout_cached(fmt, kind, tuple(int(s) for s in outer_shape), int(world_size), both)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1) if t.dim() != 0 else t.reshape(1)
    return flat.contiguous().view(torch.uint8)


# ------------------------------------------------------------------------------------------------
# Model-level finalize: swap each replaced module's parameter for a QuantizedWeightTensor.


@dataclass(frozen=True)
class _ParamRule:
    names: tuple[str, ...]
    kind: WeightKind


_REGISTRY_BY_CLASS: dict[type, _ParamRule] = {}


def register_low_precision_params(module_cls: type, names: Iterable[str], kind: WeightKind | str) -> None:
    """Declare which parameters of ``module_cls`` are low-precision weights, and of which kind.

    Modules may instead carry class attributes ``low_precision_weight_names`` (tuple of names) and
    ``low_precision_weight_kind`` (``"dense"``/``"grouped"``), which take precedence; the library's
    ``LowPrecisionLinear`` (dense ``weight``) and ``DeepseekV3LowPrecisionExperts`` (grouped
    ``gate_up_proj``, ``down_proj``) do. Use this function for module classes you cannot edit.

    Args:
        module_cls: An ``nn.Module`` subclass.
        names: Parameter names on that class.
        kind: ``"dense"`` or ``"grouped"``.

    Raises:
        TypeError: ``module_cls`` is not an ``nn.Module`` subclass.
        ValueError: empty ``names`` or a conflicting earlier registration.
    """
    if not (isinstance(module_cls, type) and issubclass(module_cls, nn.Module)):
        raise TypeError(f"register_low_precision_params: module_cls must be an nn.Module subclass, got {module_cls!r}.")
    rule = _ParamRule(tuple(names), WeightKind.parse(kind))
    if not rule.names:
        raise ValueError(f"register_low_precision_params({module_cls.__name__}): names must not be empty.")
    existing = _REGISTRY_BY_CLASS.get(module_cls)
    if existing is not None and existing != rule:
        raise ValueError(
            f"register_low_precision_params({module_cls.__name__}): already registered as {existing}, refusing {rule}."
        )
    _REGISTRY_BY_CLASS[module_cls] = rule


def low_precision_param_names(module: nn.Module) -> tuple[tuple[str, ...], WeightKind] | None:
    """``(names, kind)`` of ``module``'s low-precision parameters, or ``None`` if it has none.

    Resolution order: class attributes ``low_precision_weight_names``/``low_precision_weight_kind``,
    then :func:`register_low_precision_params` (for the class or a base class).
    """
    cls = type(module)
    names = getattr(cls, "low_precision_weight_names", None)
    if names is not None:
        return tuple(names), WeightKind.parse(getattr(cls, "low_precision_weight_kind"))
    for klass in cls.__mro__:
        if klass in _REGISTRY_BY_CLASS:
            rule = _REGISTRY_BY_CLASS[klass]
            return rule.names, rule.kind
    return None


@dataclass(frozen=True)
class LowPrecisionWeightRecord:
    """One parameter :func:`finalize_low_precision_weights` converted.

    Attributes:
        fqn: Parameter FQN (the state-dict key).
        kind: ``"dense"`` or ``"grouped"``.
        format: ``"mxfp8_e4m3"`` or ``"hif8"``.
        shape: Logical shape.
        master_dtype: dtype of the master (the parameter's dtype from now on).
    """

    fqn: str
    kind: str
    format: str
    shape: tuple[int, ...]
    master_dtype: str


def _plain_state_dict_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """State-dict post hook: low-precision weights appear as their plain master (design spec §11)."""
    for name, _ in module.named_parameters(recurse=False):
        key = prefix + name
        value = state_dict.get(key)
        if value is None or isinstance(value, nn.Parameter):  # keep_vars=True asks for the variables
            continue
        state_dict[key] = _plain_master_view(value)


def _plain_master_view(value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, QuantizedWeightTensor):
        return value.master.detach()
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = value.to_local()
        if isinstance(local, QuantizedWeightTensor):
            return DTensor.from_local(
                local.master.detach(),
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
    return value


def finalize_low_precision_weights(
    module: nn.Module,
    *,
    recipe: LowPrecisionRecipe | str | Any,
    gather_policy: GatherPolicy = GatherPolicy(),
    master_dtype: torch.dtype = torch.float32,
    build: bool = True,
) -> list[LowPrecisionWeightRecord]:
    """Swap every low-precision parameter of ``module`` for a built ``QuantizedWeightTensor`` (design spec §12.1 step 6).

    Run after the replacement plan and high-precision initialisation, before ``fully_shard``.
    Each converted parameter keeps its FQN, state-dict key, ``requires_grad`` and sharing (a
    parameter registered under two names stays one object). The master is the parameter's value
    cast to ``master_dtype`` (exact for BF16 → FP32). A state-dict post hook on each owning module
    makes ``state_dict()`` return the plain master (FP32 tensors, loadable with
    ``torch.load(weights_only=True)``; sharded: a DTensor over the master shard).

    Args:
        module: The model (or any module) after replacement.
        recipe: A ``LowPrecisionRecipe``, a format name, or a ``LowPrecisionPolicy`` (its
            ``format``); one recipe for every weight (design spec §4.2: one policy per run). A module
            carrying its own ``recipe`` attribute must agree.
        gather_policy: FSDP2 gather policy of the MXFP8 weights (see :class:`GatherPolicy`).
        master_dtype: dtype of the masters (default FP32, design spec §10).
        build: Build the storage now (one counted refresh per weight). Pass ``False`` when
            ``fully_shard`` follows: FSDP2 replaces every parameter by fresh unbuilt shards that
            ``refresh_low_precision_weights`` builds anyway, and skipping the full-weight storage
            lowers the start-up memory peak by 1–2 bytes per element.

    Returns:
        One :class:`LowPrecisionWeightRecord` per converted parameter, in module order.

    Raises:
        TypeError: a parameter is already sharded (DTensor), already converted, or not floating.
        ValueError: a declared parameter is missing, on the meta device, of the wrong rank, or a
            module's own recipe disagrees.
    """
    resolved = _resolve_recipe(recipe)
    replaced: dict[int, nn.Parameter] = {}
    records: list[LowPrecisionWeightRecord] = []
    hooked: set[int] = set()
    for mod_fqn, mod in module.named_modules():
        found = low_precision_param_names(mod)
        if found is None:
            continue
        names, kind = found
        own = getattr(mod, "recipe", None)
        if isinstance(own, LowPrecisionRecipe) and own.format is not resolved.format:
            raise ValueError(
                f"{mod_fqn or type(mod).__name__}: the module computes with recipe {own.name!r} but the weights "
                f"would be {resolved.name!r}; pass the same recipe."
            )
        for name in names:
            fqn = f"{mod_fqn}.{name}" if mod_fqn else name
            param = dict(mod.named_parameters(recurse=False)).get(name)
            if param is None:
                raise ValueError(f"{fqn}: {type(mod).__name__} declares low-precision parameter {name!r} but has none.")
            if id(param) in replaced:
                continue
            if isinstance(param, _LowPrecisionWeightBase):
                raise TypeError(f"{fqn}: already a low-precision weight; finalize_low_precision_weights runs once.")
            from torch.distributed.tensor import DTensor

            if isinstance(param, DTensor):
                raise TypeError(
                    f"{fqn}: the parameter is already sharded (DTensor); finalize low-precision weights before "
                    "fully_shard (design spec §12.1: step 6 before step 7)."
                )
            if param.is_meta:
                raise ValueError(f"{fqn}: the parameter is on the meta device; materialise and initialise it first.")
            if not param.is_floating_point():
                raise TypeError(f"{fqn}: parameter dtype {param.dtype} is not floating point.")
            master = param.detach().to(master_dtype).contiguous()  # reuses the memory when already FP32
            _check_master(master, kind, fqn)
            weight = QuantizedWeightTensor(master, recipe=resolved, kind=kind, fqn=fqn, gather_policy=gather_policy)
            if build:
                weight.refresh_from_master()
            replaced[id(param)] = nn.Parameter(weight, requires_grad=param.requires_grad)
            records.append(
                LowPrecisionWeightRecord(
                    fqn=fqn,
                    kind=kind.value,
                    format=resolved.format.value,
                    shape=tuple(master.shape),
                    master_dtype=str(master_dtype).removeprefix("torch."),
                )
            )
    for mod in module.modules():  # swap every registration (keeps sharing) and hook the owners
        for name, param in list(mod.named_parameters(recurse=False, remove_duplicate=False)):
            if id(param) in replaced:
                setattr(mod, name, replaced[id(param)])  # same key, same position in _parameters
                if id(mod) not in hooked:
                    mod.register_state_dict_post_hook(_plain_state_dict_hook)
                    hooked.add(id(mod))
    return records


def _resolve_recipe(recipe: Any) -> LowPrecisionRecipe:
    if isinstance(recipe, LowPrecisionRecipe):
        return recipe
    if isinstance(recipe, (str, LowPrecisionFormat)):
        return recipe_for(recipe)
    fmt = getattr(recipe, "format", None)  # a LowPrecisionPolicy carries .format and .enabled
    if fmt is None:
        raise TypeError(
            f"finalize_low_precision_weights: recipe must be a LowPrecisionRecipe, a format name or a "
            f"LowPrecisionPolicy, got {type(recipe).__name__}."
        )
    if getattr(recipe, "enabled", True) is False:
        raise ValueError("finalize_low_precision_weights: the policy has enabled=False; nothing is low precision.")
    return recipe_for(getattr(fmt, "value", fmt))


def iter_low_precision_weights(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(fqn, parameter)`` for every parameter of ``module`` holding a ``QuantizedWeightTensor``
    (directly, or as the local tensor of a DTensor)."""
    from torch.distributed.tensor import DTensor

    for fqn, param in module.named_parameters():
        with torch.no_grad():
            local = param.to_local() if isinstance(param, DTensor) else param
        if isinstance(local, QuantizedWeightTensor):
            yield fqn, param
