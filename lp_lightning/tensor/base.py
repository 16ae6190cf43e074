"""Shared machinery of the low-precision weight classes: state, dispatch table, the gather spec protocol.

``_LowPrecisionWeightBase`` declares the inner tensors once (flatten/unflatten/repr are generated
from the declaration), implements ``select(orientation)`` over the declared storage, and routes
``__torch_dispatch__`` through a per-class ``@_implements`` table that rejects duplicate
registration; a GEMM on a weight raises (no silent high-precision GEMM). The dispatch rules are in
:mod:`lp_lightning.tensor.weight`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from enum import Enum
from types import MappingProxyType
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from lp_lightning.formats.operand import QuantizationRole, QuantizedOperand, StaleOperandError, freed_storage
from lp_lightning.formats.quantizer import Quantizer
from lp_lightning.formats.recipe import LowPrecisionRecipe
from lp_lightning.formats.spec import ORIENTATIONS, Orientation, WeightKind
from lp_lightning.tensor.storage import ALL_STORAGE_NAMES, storage_names

__all__ = ["GatherSpec", "is_low_precision_weight", "weight_quantizer"]

aten = torch.ops.aten

_ORIENTATIONS = ORIENTATIONS


@runtime_checkable
class GatherSpec(Protocol):
    """How FSDP2 all-gathers one low-precision weight: the two hooks its ``fsdp_*_all_gather`` forward to.

    A weight carries its spec (``QuantizedWeightTensor.gather_policy``), set when the lifecycle layer
    finalizes it (``lp_lightning.fsdp.weights.finalize_low_precision_weights``; the implementation is
    ``lp_lightning.fsdp.gather.GatherPolicy``); a weight without one refuses to be gathered. The spec
    may keep per-weight notes (the first gather's schema, scratch buffers) in the weight's
    :attr:`~_LowPrecisionWeightBase.gather_memo`.
    """

    def pre_all_gather(
        self, weight: Any, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        """The all-gather inputs of the local shard (``uint8`` slots) and their metadata."""
        ...

    def post_all_gather(
        self, weight: Any, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype,
        *, out: torch.Tensor | None = None,
    ) -> tuple[Any, tuple[torch.Tensor, ...]] | None:
        """The gathered weight over the all-gather outputs (``None`` when ``out`` was refilled in place)."""
        ...


# ------------------------------------------------------------------------------------------------
# Shared machinery of the two wrapper classes.


class _WeightState:
    """Mutable state shared by a weight and its aliases (rule 1): storage tensors and counters."""

    __slots__ = ("gather_memo", "gather_policy", "orientations", "refresh_count", "storage")

    def __init__(
        self,
        storage: dict[str, torch.Tensor] | None = None,
        refresh_count: int = 0,
        orientations: tuple[Orientation, ...] = _ORIENTATIONS,
        gather_policy: GatherSpec | None = None,
        gather_memo: dict[str, Any] | None = None,
    ) -> None:
        self.storage = storage
        self.refresh_count = refresh_count
        self.orientations = orientations
        self.gather_policy = gather_policy  # the weight's GatherSpec (None: never finalized for FSDP2)
        self.gather_memo: dict[str, Any] = {} if gather_memo is None else gather_memo  # the spec's notes


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
    storage_names: ClassVar[tuple[str, ...]] = ALL_STORAGE_NAMES
    tensor_attribute_names: ClassVar[tuple[str, ...]] = ()
    _op_table: ClassVar[dict[Any, _OpHandler]]

    __torch_function__ = torch._C._disabled_torch_function_impl

    recipe: LowPrecisionRecipe
    kind: WeightKind
    fqn: str
    _state: _WeightState

    # -- declared storage -------------------------------------------------------------------
    @property
    def format(self) -> Any:
        """The weight's ``FormatSpec`` (the recipe's)."""
        return self.recipe.format

    def _storage_tensor(self, name: str) -> torch.Tensor | None:
        storage = self._state.storage
        return None if storage is None else storage.get(name)

    @property
    def low_precision_storage(self) -> Mapping[str, torch.Tensor]:
        """Read-only ``{name: tensor}`` of the built storage (names of :func:`storage_spec`); empty if unbuilt."""
        return MappingProxyType(dict(self._state.storage or {}))

    @property
    def state_key(self) -> int:
        """Identity of the state this weight shares with its aliases (views, FSDP2's shard wrappers)."""
        return id(self._state)

    @property
    def gather_memo(self) -> dict[str, Any]:
        """The gather spec's per-weight notes (shared by aliases; empty until the first all-gather)."""
        return self._state.gather_memo

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
                f"{type(self).__name__}.select({orientation!r}) on weight {self.fqn!r}: storage not built. Call "
                "lp_lightning.fsdp.refresh.refresh_low_precision_weights(model.parameters()) after "
                "fully_shard / load."
            )
        if orientation not in self._state.orientations:
            raise ValueError(
                f"{type(self).__name__}.select({orientation!r}) on weight {self.fqn!r}: this all-gathered copy "
                f"carries only {self._state.orientations}. Finalize with GatherPolicy(reshard_after_forward=False) "
                "or activation_checkpoint='full'."
            )
        data_name, scale_name = storage_names(self.format, orientation)
        format_max = getattr(weight_quantizer(self.recipe), "format_max", None) if self.format.uses_format_max else None
        for name in (data_name, scale_name):
            if freed_storage(self._storage_tensor(name)):
                raise StaleOperandError(
                    f"{type(self).__name__}.select({orientation!r}) on weight {self.fqn!r}: its {name} views an "
                    "all-gather buffer FSDP2 freed at reshard. Select inside the layer's forward/backward (where "
                    "FSDP2 keeps the weight gathered), not after it."
                )
        return QuantizedOperand(
            data=self._storage_tensor(data_name),
            scale=self._storage_tensor(scale_name),
            logical_dtype=self.dtype,
            format=self.format,
            orientation=orientation,
            format_max=format_max,
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
                f"{func} on a {cls.__name__} would run a high-precision GEMM on the weight; use "
                "weight.select(orientation) with lp_lightning.ops (requirement R6, docs/design.md)."
            )
        return cls._generic(func, args, kwargs)

    @classmethod
    def _generic(cls, func: Any, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError(func, cls)


for _name in ALL_STORAGE_NAMES:  # ``storage_<name>`` attributes: what __tensor_flatten__ names
    setattr(
        _LowPrecisionWeightBase,
        f"storage_{_name}",
        property(lambda self, _n=_name: self._storage_tensor(_n), doc=f"Storage tensor {_name!r} (None if absent)."),
    )


_STRUCTURAL_HINT = (
    "a low-precision weight supports no reshaping/transposing view (F.linear and matmul transpose their "
    "weight); GEMMs consume it through select(orientation), the master is available as .master"
)


def weight_quantizer(recipe: LowPrecisionRecipe) -> Quantizer:
    """The quantizer that builds a persistent weight's storage for both fprop and dgrad.

    A weight is quantized once per refresh and serves both passes (design spec §7.2–7.3), so the
    recipe's WEIGHT_FWD and WEIGHT_BWD quantizers must be equal.

    Raises:
        ValueError: they differ (naming both).
    """
    q_fwd = recipe.quantizer(QuantizationRole.WEIGHT_FWD)
    q_bwd = recipe.quantizer(QuantizationRole.WEIGHT_BWD)
    if q_fwd != q_bwd:
        raise ValueError(
            f"recipe {recipe.name!r}: a weight is quantized once for fprop and dgrad (design spec §7.3), so "
            f"WEIGHT_FWD and WEIGHT_BWD must be equal; got {q_fwd!r} and {q_bwd!r}."
        )
    return q_fwd


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


def is_low_precision_weight(tensor: object) -> bool:
    """Whether ``tensor`` is one of this package's low-precision weight classes, persistent or all-gathered.

    The public type check for probes; the GEMM functions ask the duck-typed
    :func:`lp_lightning.functional.linear.selects_low_precision_operand` instead.
    """
    return isinstance(tensor, _LowPrecisionWeightBase)
