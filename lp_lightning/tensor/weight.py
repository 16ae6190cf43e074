"""Persistent low-precision weights: ``QuantizedWeightTensor`` and the gathered ``GatheredWeightTensor``.

Design spec §7.2–7.3, §10, §13.4; requirements R1, R8 (docs/design.md). Format-agnostic: a weight
knows its recipe and asks the recipe's ``FormatSpec`` everything format-specific.

A replaced module's weight Parameter holds a ``QuantizedWeightTensor``: a tensor with the
parameter's *logical* shape, dtype and ``requires_grad`` that owns

- the **high-precision master** (``master``, FP32 after finalisation): the authoritative value.
  The optimizer updates it through in-place ops on the wrapper, the model state dict exposes it
  (never the derived bytes), and it is never recovered by dequantising.
- the **derived low-precision storage** (:mod:`lp_lightning.tensor.storage`), rebuilt from the
  master only by :meth:`QuantizedWeightTensor.refresh_from_master`, which quantizes through the op
  backend (``lp_lightning.ops.quantize_dual``). The lifecycle layer calls it once per successful
  optimizer step (``lp_lightning.fsdp.refresh``, design spec §10).

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

A :class:`GatheredWeightTensor` (what the gather extension builds) has no master: only
aliases (rule 1) and ``zeros_like``/``empty_like``/``new_zeros`` (FSDP2's zero gradient for an
unused parameter; plain results) are allowed, everything else raises.

FSDP2. torch's FSDP2 calls ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on the sharded
local tensor. The weight forwards both to its own *gather spec* (:class:`~lp_lightning.tensor.base.GatherSpec`,
``gather_policy``), which the lifecycle layer sets when it finalizes the weight
(``lp_lightning.fsdp.gather.GatherPolicy``) and which owns the gather schema, the phase and the
unpacking (its per-weight notes live in ``gather_memo``). A weight without a spec refuses to be gathered.

Tensor-name legend: ``w_NK`` dense weight (N out-features, K in-features), ``w_ENK`` grouped HF
parameter, ``w_EKN`` its GMM view, ``D0`` the sharded (first) dim of the parameter, ``W`` the
FSDP shard-group size, ``S0`` rows per rank of the padded shard, ``L`` this rank's rows.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from lp_lightning.formats.recipe import LowPrecisionRecipe, recipe_for
from lp_lightning.formats.spec import AmaxScope, WeightKind
from lp_lightning.ops.api import quantize_dual
from lp_lightning.tensor.base import (
    _STRUCTURAL_HINT,
    _contains,
    _implements,
    _LowPrecisionWeightBase,
    _mutated_args,
    _OpHandler,
    _WeightState,
    GatherSpec,
    is_low_precision_weight,
    weight_quantizer,
)
from lp_lightning.tensor.gathered import GatheredWeightTensor
from lp_lightning.tensor.storage import note_refresh, storage_names, storage_spec

__all__ = [
    "GatheredWeightTensor",
    "QuantizedWeightTensor",
    "check_master",
    "is_low_precision_weight",
    "is_master_of",
    "weight_quantizer",
]

aten = torch.ops.aten

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
        gather_policy: The weight's :class:`~lp_lightning.tensor.base.GatherSpec` (``lp_lightning.fsdp.gather.GatherPolicy``,
            set at finalize); ``None``: the weight cannot be all-gathered by FSDP2.
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
        gather_policy: GatherSpec | None = None,
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
            self._state.gather_policy = gather_policy
        return self

    @property
    def gather_policy(self) -> GatherSpec | None:
        """The weight's gather spec (shared by aliases; fixed once FSDP2 gathered the weight)."""
        return self._state.gather_policy

    @gather_policy.setter
    def gather_policy(self, policy: GatherSpec | None) -> None:
        if policy is not None and not isinstance(policy, GatherSpec):
            raise TypeError(f"{self.fqn!r}: gather_policy must be a GatherSpec (pre/post_all_gather), got {type(policy).__name__}.")
        if self._state.gather_memo and policy != self._state.gather_policy:
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
        gather_policy: Any = None,
        requires_grad: bool = False,
    ) -> QuantizedWeightTensor:
        """Wrap ``master`` and build its storage once (a refresh, counted).

        Args:
            master: Plain floating tensor: ``[N, K]`` for ``kind="dense"``, ``[E, N, K]`` for
                ``"grouped"``. Kept by reference (no copy); the optimizer updates it.
            recipe: A ``LowPrecisionRecipe`` or a format name (``"mxfp8_e4m3"``, ``"hif8"``).
            kind: ``"dense"`` or ``"grouped"``.
            fqn: Parameter FQN for messages and probes.
            gather_policy: The weight's gather spec (``lp_lightning.fsdp.gather.GatherPolicy``); ``None``: none yet.
            requires_grad: ``requires_grad`` of the wrapper.

        Returns:
            A built ``QuantizedWeightTensor`` with ``refresh_count == 1``.

        Raises:
            TypeError: for a non-float or subclass master.
            ValueError: for a shape that does not fit ``kind`` or has an empty dimension.
        """
        recipe = recipe if isinstance(recipe, LowPrecisionRecipe) else recipe_for(recipe)
        kind = WeightKind.parse(kind)
        check_master(master, kind, fqn)
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

        One dual quantisation (``lp_lightning.ops.quantize_dual``, on the recipe's backend) of the
        dense weight or of the grouped GMM view with the recipe's weight quantizer. A weight whose
        scale is per tensor (``AmaxScope.TENSOR``, HiF8 dense) may take a precomputed ``amax`` (the
        MAX over its FSDP group, design spec §9.2); per-block and per-group scales are local.

        Args:
            master_shard: Optional; if given it must alias this weight's master (the same tensor,
                or a plain view with the same storage, offset, shape and strides) — a guard that
                the storage is never rebuilt from anything else (e.g. a dequantised weight).
            amax: Per-tensor-scaled weights only: FP32 0-d amax to use instead of the local one.

        Raises:
            ValueError: ``master_shard`` is not this weight's master, or ``amax`` is given for a
                weight whose scale is not per tensor.
        """
        if master_shard is not None and not _aliases(master_shard, self.master):
            raise ValueError(
                f"refresh_from_master({self.fqn!r}): master_shard (shape {tuple(master_shard.shape)}, dtype "
                f"{master_shard.dtype}) is not this weight's master; pass its FP32 master or nothing "
                "(design spec §10)."
            )
        if amax is not None and self.amax_scope is not AmaxScope.TENSOR:
            raise ValueError(
                f"refresh_from_master({self.fqn!r}): amax is only used by per-tensor scales; this "
                f"{self.format.name} {self.kind.value} weight has {self.amax_scope.value} scales."
            )
        self._state.storage = _quantize_storage(self.master, self.recipe, self.kind, amax, fqn=self.fqn)
        self._state.refresh_count += 1
        note_refresh(self)

    @property
    def amax_scope(self) -> AmaxScope:
        """Where this weight's scale comes from (``FormatSpec.weight_amax_scope`` of its kind)."""
        return self.format.weight_amax_scope(self.kind)

    def local_amax(self) -> torch.Tensor:
        """The master's amax as the weight quantizer computes it (current-scaling formats)."""
        return weight_quantizer(self.recipe).compute_amax(self.master)

    def untyped_storage(self) -> torch.UntypedStorage:  # type: ignore[override]
        """The master's storage: a weight's bytes in memory are its master's (FSDP2 compares it)."""
        return self.master.untyped_storage()

    # -- FSDP2 extension (torch calls these on the local shard; the weight's gather spec answers) ----
    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        """FSDP2's pre-all-gather hook: the gather spec's physical tensors (design spec §9, §13.5)."""
        return self._gather_spec().pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[GatheredWeightTensor, tuple[torch.Tensor, ...]] | None:
        """FSDP2's post-all-gather hook: the gather spec rebuilds the full weight."""
        return self._gather_spec().post_all_gather(self, all_gather_outputs, metadata, param_dtype, out=out)

    def _gather_spec(self) -> GatherSpec:
        spec = self._state.gather_policy
        if spec is None:
            raise RuntimeError(
                f"FSDP2 all-gathers low-precision weight {self.fqn!r} {tuple(self.shape)}, which has no gather spec; "
                "finalize it with lp_lightning.fsdp.weights.finalize_low_precision_weights before fully_shard."
            )
        return spec

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


def check_master(master: torch.Tensor, kind: WeightKind, fqn: str) -> None:
    """A master a weight may hold: a plain 2-D (dense) or 3-D (grouped) float tensor with no empty dimension.

    Raises:
        TypeError: A subclass or non-float master; ValueError: another rank or an empty dimension.
    """
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
    master: torch.Tensor, recipe: LowPrecisionRecipe, kind: WeightKind, amax: torch.Tensor | None, *, fqn: str = ""
) -> dict[str, torch.Tensor]:
    """Quantise ``master`` (``[L, K]`` or ``[L, N, K]``, ``L`` possibly 0) into the declared storage.

    The quantize trace event (``lp_lightning.ops.add_quantize_observer``) has role ``"weight"`` and
    ``weight_fqn=fqn``; an empty shard is quantized by the portable codec and emits none.
    """
    spec = recipe.format
    declared = storage_spec(spec, kind, tuple(master.shape))
    view = master if kind is WeightKind.DENSE else master.transpose(-1, -2)
    quantizer = weight_quantizer(recipe)
    if amax is not None:
        amax = amax.to(device=master.device, dtype=torch.float32)
    if master.numel() == 0:  # an empty FSDP2 shard: the portable codec keeps the declared schema
        row, col = quantizer.quantize_dual(view, amax=amax)
    else:
        row, col = quantize_dual(quantizer, view, amax=amax, role="weight", weight_fqn=fqn, backend=recipe.backend)
    storage: dict[str, torch.Tensor] = {}
    for operand in (row, col) if spec.physical_orientation else (row,):
        data_name, scale_name = storage_names(spec, operand.orientation)
        storage[data_name] = operand.data.contiguous()
        storage[scale_name] = operand.scale.contiguous()
    for name, (shape, dtype) in declared.items():
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
