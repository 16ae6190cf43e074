"""``GatheredWeightTensor``: the unsharded compute weight a weight's gather spec rebuilds after FSDP2's all-gather (no master)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from lp_lightning.formats.recipe import LowPrecisionRecipe
from lp_lightning.formats.spec import Orientation, WeightKind
from lp_lightning.tensor.base import _STRUCTURAL_HINT, _implements, _LowPrecisionWeightBase, _OpHandler, _WeightState

__all__ = ["GatheredWeightTensor"]

aten = torch.ops.aten

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
        orientations: The orientations this gather carried (the gather spec's choice).
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

    @classmethod
    def from_gathered(
        cls,
        shape: tuple[int, ...],
        *,
        logical_dtype: torch.dtype,
        recipe: LowPrecisionRecipe,
        kind: WeightKind,
        fqn: str,
        storage: dict[str, torch.Tensor],
        orientations: tuple[Orientation, ...],
        device: torch.device,
        gather_memo: dict[str, Any] | None = None,
    ) -> GatheredWeightTensor:
        """The gathered weight over ``storage`` (views of FSDP2's all-gather outputs) as a gather spec builds it.

        Args:
            shape: The full logical shape; ``logical_dtype``: FSDP2's ``param_dtype``.
            storage: ``{name: tensor}`` of the declared storage for ``orientations``.
            gather_memo: The gather spec's notes for this gathered weight (e.g. a scratch buffer).
        """
        state = _WeightState(storage, 0, orientations, gather_memo=gather_memo)
        return cls(shape, logical_dtype=logical_dtype, recipe=recipe, kind=kind, fqn=fqn, state=state, device=device)

    def repoint(self, storage: dict[str, torch.Tensor], orientations: tuple[Orientation, ...]) -> None:
        """Points this gathered weight (and its aliases) at the storage of a new all-gather (FSDP2's ``out=`` refill)."""
        self._state.storage = storage
        self._state.orientations = orientations

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
