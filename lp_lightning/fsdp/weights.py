"""Model-level handling of low-precision weights: finalize, traversal, state dict (design spec §11, §12.1).

- :func:`finalize_low_precision_weights` swaps each replaced module's declared parameters for a
  ``QuantizedWeightTensor`` (FP32 master; the gather policy of the run), before ``fully_shard``;
- :func:`register_low_precision_params` / :func:`low_precision_param_names` say which parameters
  of a module class are low-precision weights (modules may declare them as class attributes);
- :func:`iter_low_precision_weights` / :func:`local_low_precision_weight` find them again, plain
  or FSDP2-sharded;
- a state-dict post hook makes ``state_dict()`` expose the plain FP32 master (DCP checkpoints hold
  high-precision weights under the HF keys, never derived bytes; design spec §11).

Generic: nothing here names a format; the recipe (``LowPrecisionRecipe``) and its ``FormatSpec``
carry everything format-specific.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lp_lightning.formats.recipe import LowPrecisionRecipe, recipe_for
from lp_lightning.formats.spec import FormatSpec, WeightKind
from lp_lightning.fsdp.gather import GatherPolicy
from lp_lightning.tensor.base import is_low_precision_weight
from lp_lightning.tensor.weight import QuantizedWeightTensor, check_master

__all__ = [
    "LowPrecisionWeightRecord",
    "declared_low_precision_params",
    "finalize_low_precision_weights",
    "iter_low_precision_weights",
    "local_low_precision_weight",
    "low_precision_param_names",
    "register_low_precision_params",
]


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


def declared_low_precision_params(
    module: nn.Module,
) -> Iterator[tuple[str, nn.Module, WeightKind, list[tuple[str, nn.Parameter]]]]:
    """Every module of ``module`` that declares low-precision parameters, with those parameters.

    Yields ``(module_fqn, submodule, kind, [(param_fqn, param), ...])`` in ``named_modules`` order; a
    parameter object shared under several names is listed once, at its first FQN.

    Raises:
        ValueError: a module declares a low-precision parameter it does not have.
    """
    seen: set[int] = set()
    for module_fqn, sub in module.named_modules():
        found = low_precision_param_names(sub)
        if found is None:
            continue
        names, kind = found
        own = dict(sub.named_parameters(recurse=False))
        params = []
        for name in names:
            fqn = f"{module_fqn}.{name}" if module_fqn else name
            param = own.get(name)
            if param is None:
                raise ValueError(f"{fqn}: {type(sub).__name__} declares low-precision parameter {name!r} but has none.")
            if id(param) not in seen:
                seen.add(id(param))
                params.append((fqn, param))
        yield module_fqn, sub, kind, params


@dataclass(frozen=True)
class LowPrecisionWeightRecord:
    """One parameter :func:`finalize_low_precision_weights` converted.

    Attributes:
        fqn: Parameter FQN (the state-dict key).
        kind: ``"dense"`` or ``"grouped"``.
        format: Format name (``"mxfp8_e4m3"``, ``"hif8"``).
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
        gather_policy: FSDP2 gather policy (see :class:`~lp_lightning.fsdp.gather.GatherPolicy`).
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
    for mod_fqn, mod, kind, params in declared_low_precision_params(module):
        own = getattr(mod, "recipe", None)
        if isinstance(own, LowPrecisionRecipe) and own.format is not resolved.format:
            raise ValueError(
                f"{mod_fqn or type(mod).__name__}: the module computes with recipe {own.name!r} but the weights "
                f"would be {resolved.name!r}; pass the same recipe."
            )
        for fqn, param in params:
            if is_low_precision_weight(param):
                raise TypeError(f"{fqn}: already a low-precision weight; finalize_low_precision_weights runs once.")
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
            check_master(master, kind, fqn)
            weight = QuantizedWeightTensor(master, recipe=resolved, kind=kind, fqn=fqn, gather_policy=gather_policy)
            if build:
                weight.refresh_from_master()
            replaced[id(param)] = nn.Parameter(weight, requires_grad=param.requires_grad)
            records.append(
                LowPrecisionWeightRecord(
                    fqn=fqn,
                    kind=kind.value,
                    format=resolved.format.name,
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
    if isinstance(recipe, (str, FormatSpec)):
        return recipe_for(recipe)
    fmt = getattr(recipe, "format", None)  # a LowPrecisionPolicy carries .format and .enabled
    if fmt is None:
        raise TypeError(
            f"finalize_low_precision_weights: recipe must be a LowPrecisionRecipe, a format name or a "
            f"LowPrecisionPolicy, got {type(recipe).__name__}."
        )
    if getattr(recipe, "enabled", True) is False:
        raise ValueError("finalize_low_precision_weights: the policy has enabled=False; nothing is low precision.")
    return recipe_for(getattr(fmt, "value", fmt), backend=getattr(recipe, "backend", "auto"))


def iter_low_precision_weights(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(fqn, parameter)`` for every parameter of ``module`` holding a ``QuantizedWeightTensor``
    (directly, or as the local tensor of a DTensor)."""
    for fqn, param in module.named_parameters():
        with torch.no_grad():
            local = param.to_local() if isinstance(param, DTensor) else param
        if isinstance(local, QuantizedWeightTensor):
            yield fqn, param


def local_low_precision_weight(param: torch.Tensor) -> QuantizedWeightTensor | None:
    """This rank's ``QuantizedWeightTensor`` behind ``param`` (itself, or a DTensor's local shard).

    The DTensor case uses the public ``DTensor.to_local()``, whose result is an alias of the
    shard (same weight state: storage, counters, gather policy).

    Args:
        param: A parameter or tensor.

    Returns:
        The local weight, or ``None`` for any other tensor.
    """
    if isinstance(param, DTensor):
        with torch.no_grad():
            param = param.to_local()
    return param if isinstance(param, QuantizedWeightTensor) else None
