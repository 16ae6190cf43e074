"""FSDP2 parallelisation of a Hugging Face causal LM, in the build order of design spec §12.1 / §14.

:func:`parallelize_causal_lm` takes the plain model that ``configure_model`` built (every rank
holds identical weights) and applies, in this order and nowhere else:

1. **precision conversion** (``convert_module``: the precision plugin's module replacement; a
   no-op for ``bf16``, the low-precision replacement plan from issue 4 on). It must see plain
   ``nn.Linear`` / experts modules and plain Parameters, so it runs before sharding (the field's style;
   Lightning's own ``ModelParallelStrategy`` calls ``convert_module`` *after* ``configure_model``
   has sharded, Lightning issue #19989).
2. **FP32 upcast** of every floating-point Parameter: these become the FP32 master shards that
   AdamW updates (design spec §10). Buffers keep the dtype the model builder gave them.
3. **``fully_shard``** on each decoder layer (the model adapter's ``decoder_layers``) and then on
   the root, over a 1-D ``("dp_shard",)`` mesh with ``MixedPrecisionPolicy(param_dtype=bf16,
   reduce_dtype=fp32)``: the all-gathered compute copies are BF16, gradients are reduce-scattered
   in FP32 and land on the FP32 shards. Modules whose Parameters the model builder deliberately
   kept in FP32 inside a BF16 model (the adapter's ``fp32_compute_modules``, e.g. a MoE router
   that HF keeps in FP32) are sharded first as their own FSDP2 group with ``param_dtype=fp32``, so
   their compute uses FP32 weights exactly as in the unsharded model.
   With low-precision weights (``mxfp8``/``hif8``; the conversion finalized them with unbuilt
   storage) each weight is placed first (:func:`~lp_lightning.fsdp.sharding.plan_low_precision_sharding`):
   ``Shard(0)`` where the format's shard rule of design spec §9.1 holds, else ``Shard(1)`` (the
   input dimension, through FSDP2's ``shard_placement_fn``) where that is legal; a weight no dim
   can shard fails here naming FQN, shape, world size and rules, or, with
   ``fallback_to_unsharded=True``, its module is sharded first over the ``(W, 1)`` replicated
   fallback mesh (one mesh for all of them), so it stays replicated and still computes in low
   precision. ``reshard_after_forward`` is passed explicitly to every ``fully_shard``, the
   root's included (the MXFP8 gather policy depends on it).
4. **refresh** (low precision only): ``refresh_low_precision_weights`` builds every
   low-precision shard once from its FP32 master shard (``fully_shard`` created fresh, unbuilt
   shards; design spec §10).
5. **activation checkpointing** per decoder layer when ``activation_checkpoint="full"``:
   ``checkpoint_wrapper(..., CheckpointImpl.NO_REENTRANT)`` around the sharded layer. The wrapper
   inserts ``_checkpoint_wrapped_module`` into ``named_parameters()`` FQNs, but its state-dict hooks
   strip it, so ``state_dict()`` and ``torch.distributed.checkpoint.state_dict`` keys stay the HF
   names (tested in ``tests/fsdp/test_parallelize.py``).

The optimizer is created afterwards (Lightning's ``setup_optimizers``), over the sharded FP32
Parameters.

What is model-specific (where the decoder layers are, which modules compute in FP32) comes in as
``adapter=`` (a :class:`ModelLayout`: the model's
:class:`~lp_lightning.models.adapter.ModelAdapter` satisfies it); nothing here knows a model.
What is low-precision (placements, the replicated fallback mesh, the first refresh) comes in as
``lifecycle=`` (a :class:`WeightLifecycle`: the low-precision plugin's
:class:`~lp_lightning.fsdp.lifecycle.LowPrecisionLifecycle`; ``None`` in bf16).

Only torch is imported here (no Lightning, no low-precision module): the Trainer strategy and the
Fabric strategy in ``lp_lightning/lightning/strategy.py`` both call these functions, and a
``bf16`` run never imports the format layer.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lp_lightning.config import ActivationCheckpointMode, check_activation_checkpoint

if TYPE_CHECKING:
    from lp_lightning.fsdp.sharding import LowPrecisionShardingPlan

__all__ = [
    "DP_SHARD_DIM",
    "ModelLayout",
    "ParallelizationRecord",
    "WeightLifecycle",
    "apply_activation_checkpointing",
    "build_dp_mesh",
    "clip_gradients_",
    "default_mixed_precision_policy",
    "has_low_precision_weights",
    "is_parallelized",
    "parallelize_causal_lm",
    "process_group_backend_for",
    "total_grad_norm",
    "upcast_parameters_to_fp32",
]

DP_SHARD_DIM = "dp_shard"
"""Name of the single dimension of the data-parallel device mesh."""

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class ModelLayout(Protocol):
    """What :func:`parallelize_causal_lm` asks a model: a model adapter's two layout questions
    (:class:`~lp_lightning.models.adapter.ModelAdapter` provides them)."""

    def decoder_layers(self, causal_lm: nn.Module) -> nn.ModuleList:
        """The decoder layers, each one FSDP2 unit (and one recompute unit)."""
        ...

    def fp32_compute_modules(self, causal_lm: nn.Module) -> tuple[str, ...]:
        """FQNs of the modules whose Parameters the model keeps in FP32 inside a BF16 model (a MoE router)."""
        ...


class WeightLifecycle(Protocol):
    """The low-precision half of :func:`parallelize_causal_lm` (``None`` in bf16).

    :class:`~lp_lightning.fsdp.lifecycle.LowPrecisionLifecycle` implements it; the low-precision
    plugin hands its instance to the strategy (``FSDP2PrecisionPlugin.lifecycle``).
    """

    def plan_sharding(
        self, causal_lm: nn.Module, world_size: int, *, fallback_to_unsharded: bool, input_dim_sharding: bool
    ) -> LowPrecisionShardingPlan | None:
        """The placement of every low-precision weight (design spec §9.1); ``None`` when the model holds none."""
        ...

    def replicated_mesh(self, device_type: str, world_size: int) -> DeviceMesh:
        """The ``(W, 1)`` mesh the replicated fallback modules are sharded over."""
        ...

    def refresh_after_shard(self, parameters: Iterable[torch.Tensor]) -> None:
        """Builds every low-precision shard once from its FP32 master shard (after ``fully_shard``)."""
        ...


def process_group_backend_for(device_type: str) -> str:
    """The torch.distributed backend for a device type: gloo (CPU), nccl (CUDA), hccl (NPU).

    Args:
        device_type: ``torch.device.type`` of this rank's root device.

    Returns:
        The backend name passed to ``init_process_group``.

    Raises:
        ValueError: For any other device type.
    """
    try:
        return _BACKENDS[device_type]
    except KeyError:
        raise ValueError(
            f"no process group backend known for device type {device_type!r}; supported: "
            f"{sorted(_BACKENDS)} -> {sorted(_BACKENDS.values())}. Pass "
            f"process_group_backend=... to the strategy explicitly."
        ) from None


def build_dp_mesh(device_type: str, dp_shard_size: int) -> DeviceMesh:
    """The 1-D data-parallel mesh ``(dp_shard_size,)`` named ``("dp_shard",)``.

    Requires an initialised default process group whose world size is ``dp_shard_size`` (a
    1-rank mesh for a single process, so 1- and N-process runs share one code path).

    Args:
        device_type: ``"cpu"``, ``"cuda"`` or ``"npu"``.
        dp_shard_size: Number of ranks the parameters are sharded over.

    Returns:
        The device mesh.
    """
    return init_device_mesh(device_type, (dp_shard_size,), mesh_dim_names=(DP_SHARD_DIM,))


def default_mixed_precision_policy() -> MixedPrecisionPolicy:
    """BF16 compute copies, FP32 gradient reduction (design spec §10: FP32 master and FP32 reduce).

    Returns:
        ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``.
    """
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def is_parallelized(module: nn.Module) -> bool:
    """Whether ``module`` (or a submodule) was already passed to ``fully_shard``."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


def upcast_parameters_to_fp32(module: nn.Module) -> int:
    """Casts every floating-point Parameter to FP32 in place (same Parameter objects).

    The FP32 values become the FP32 master shards after ``fully_shard`` (design spec §10). BF16 -> FP32
    is exact. Parameter identity (and so tying/sharing) is kept because only ``.data`` changes.

    Args:
        module: Model with plain (not yet sharded) Parameters.

    Returns:
        Number of Parameters whose dtype changed.

    Raises:
        TypeError: A Parameter is already a DTensor (upcast must precede sharding).
    """
    changed = 0
    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            raise TypeError(
                f"parameter {name!r} is already a DTensor: upcast to FP32 must run before "
                f"fully_shard (design spec §12.1)."
            )
        if param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.to(torch.float32)
            changed += 1
    return changed


def apply_activation_checkpointing(layers: nn.ModuleList, mode: ActivationCheckpointMode) -> int:
    """Wraps each decoder layer in a non-reentrant ``checkpoint_wrapper`` when ``mode == "full"``.

    Recompute replays each layer's forward (including FSDP2's pre-forward all-gather, which
    FSDP2 skips while it is already in pre-backward) during backward; no weights are refreshed and
    no persistent copy is made (R10). State-dict keys stay HF-clean (module docstring).

    Args:
        layers: The model's decoder layers (its adapter's ``decoder_layers``), wrapped in place.
        mode: ``"off"`` (nothing happens) or ``"full"``.

    Returns:
        Number of wrapped layers.

    Raises:
        ValueError: ``mode`` is not ``"off"`` or ``"full"``.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        CheckpointWrapper,
        checkpoint_wrapper,
    )

    check_activation_checkpoint(mode)
    if mode == "off":
        return 0
    for i, layer in enumerate(layers):
        if isinstance(layer, CheckpointWrapper):
            raise ValueError(f"decoder layer {i} is already wrapped for activation checkpointing.")
        layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return len(layers)


def _is_low_precision_weight(param: torch.Tensor) -> bool:
    """Whether ``param`` (or a DTensor's local shard) is a ``QuantizedWeightTensor``.

    Checked through ``sys.modules``: when :mod:`lp_lightning.tensor.weight` was never imported no
    such weight can exist, and a ``bf16`` run does not import it here either.
    """
    weight = sys.modules.get("lp_lightning.tensor.weight")
    if weight is None:
        return False
    if isinstance(param, DTensor):
        with torch.no_grad():
            param = param.to_local()
    return isinstance(param, weight.QuantizedWeightTensor)


def has_low_precision_weights(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is a low-precision weight (plain or sharded)."""
    return any(_is_low_precision_weight(p) for p in module.parameters())


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelizationRecord:
    """What :func:`parallelize_causal_lm` did, in order (read-only; for logs, probes and tests).

    Args:
        steps: The build steps in the order they ran, from ``("convert_module", "upcast_fp32",
            "fully_shard", "refresh_low_precision", "activation_checkpoint")``;
            ``"convert_module"`` is absent when the caller converted the module itself (Fabric
            does so before ``setup_module``), ``"refresh_low_precision"`` when the model holds no
            low-precision weight (``bf16``).
        mesh_shape: Shape of the data-parallel mesh, ``(dp_shard_size,)``.
        upcast_params: Number of Parameters cast to FP32.
        sharded_modules: Number of ``fully_shard`` calls (FP32-compute modules + decoder layers +
            root).
        fp32_compute_modules: FQNs of the modules sharded with ``param_dtype=fp32`` (the model
            adapter's ``fp32_compute_modules``).
        checkpointed_layers: Number of decoder layers wrapped for recomputation.
        reshard_after_forward: The FSDP2 flag used.
        param_dtype: FSDP2 compute dtype of the all-gathered parameters (``str``, e.g.
            ``"torch.bfloat16"``).
        reduce_dtype: FSDP2 gradient reduce-scatter dtype.
        low_precision_weights: Number of low-precision weights (0 in ``bf16``).
        replicated_low_precision: ``(fqn, reason)`` of the low-precision weights kept replicated by
            ``fallback_to_unsharded`` (design spec §9.1); their modules were sharded over the ``(W, 1)``
            fallback mesh.
        input_dim_sharded: FQNs of the low-precision weights sharded along their input dimension
            (``Shard(1)``: dim 0 breaks the format's shard rule, docs/architecture.md "Placements").
    """

    steps: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    upcast_params: int
    sharded_modules: int
    fp32_compute_modules: tuple[str, ...]
    checkpointed_layers: int
    reshard_after_forward: bool
    param_dtype: str
    reduce_dtype: str
    low_precision_weights: int = 0
    replicated_low_precision: tuple[tuple[str, str], ...] = field(default=())
    input_dim_sharded: tuple[str, ...] = field(default=())


def parallelize_causal_lm(
    causal_lm: nn.Module,
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool,
    activation_checkpoint: ActivationCheckpointMode,
    convert_module: Callable[[nn.Module], nn.Module] | None = None,
    adapter: ModelLayout,
    lifecycle: WeightLifecycle | None = None,
    fallback_to_unsharded: bool = False,
    input_dim_sharding: bool = True,
) -> tuple[nn.Module, ParallelizationRecord]:
    """Converts, upcasts, shards and (optionally) recompute-wraps a causal LM, in that order.

    Args:
        causal_lm: The plain HF causal LM built on this rank's device with identical weights on
            every rank.
        mesh: The 1-D ``("dp_shard",)`` mesh (:func:`build_dp_mesh`).
        mp_policy: FSDP2 mixed precision policy (the precision plugin provides it).
        reshard_after_forward: FSDP2 ``reshard_after_forward`` for every sharded module.
        activation_checkpoint: ``"off"`` or ``"full"``.
        convert_module: The precision plugin's module conversion, or ``None`` when the caller
            already ran it. It must return a module with the same decoder-layer layout.
        fallback_to_unsharded: ``fsdp_config.fallback_to_unsharded``: keep low-precision weights
            that no dim can shard replicated instead of failing (module docstring).
        adapter: The model's layout (:class:`ModelLayout`: decoder layers, FP32 compute modules),
            e.g. ``lp_lightning.models.adapter_for(causal_lm)``.
        lifecycle: The low-precision lifecycle (:class:`WeightLifecycle`, the low-precision
            plugin's ``lifecycle``); ``None`` for a model without low-precision weights (bf16).
        input_dim_sharding: ``fsdp_config.input_dim_sharding``: ``Shard(1)`` for weights whose
            dim-0 split breaks their format's rule (module docstring).

    Returns:
        ``(model, record)``: the model to use from now on (the object ``convert_module`` returned,
        sharded in place) and what was done.

    Raises:
        TypeError: The model has no decoder layers where its adapter looks, is already sharded,
            ``convert_module`` returned something that is not an ``nn.Module``, or it holds
            low-precision weights and ``lifecycle`` is ``None``.
        ValueError: ``mesh`` is not 1-D, ``activation_checkpoint`` is unknown, or (with
            ``fallback_to_unsharded=False``) a low-precision weight cannot be sharded over the mesh.
    """
    if mesh.ndim != 1:
        raise ValueError(f"expected a 1-D data-parallel mesh, got a mesh of shape {tuple(mesh.shape)}.")
    check_activation_checkpoint(activation_checkpoint)
    _check_plain(causal_lm, adapter)
    steps: list[str] = []
    if convert_module is not None:
        causal_lm = _convert(causal_lm, convert_module)
        steps.append("convert_module")

    if lifecycle is None and has_low_precision_weights(causal_lm):  # before anything else changes the model
        raise TypeError(
            f"{type(causal_lm).__name__} holds low-precision weights but parallelize_causal_lm got no lifecycle: "
            "pass lifecycle=plugin.lifecycle (the low-precision precision plugin's LowPrecisionLifecycle)."
        )
    fp32_compute = adapter.fp32_compute_modules(causal_lm)
    upcast = upcast_parameters_to_fp32(causal_lm)
    steps.append("upcast_fp32")

    sharding = _low_precision_sharding(causal_lm, mesh, lifecycle, fallback_to_unsharded, input_dim_sharding)
    replicated_modules: tuple[str, ...] = () if sharding is None else sharding.replicated_modules
    placement_fn = None if sharding is None else sharding.shard_placement_fn(causal_lm)
    layers = adapter.decoder_layers(causal_lm)
    sharded = _fully_shard_model(
        causal_lm,
        layers,
        mesh,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
        fp32_compute=fp32_compute,
        replicated_modules=replicated_modules,
        replicated_mesh=None if not replicated_modules or lifecycle is None else lifecycle.replicated_mesh,
        shard_placement_fn=placement_fn,
    )
    steps.append("fully_shard")

    if sharding is not None:
        assert lifecycle is not None  # a plan exists only through it
        lifecycle.refresh_after_shard(causal_lm.parameters())
        steps.append("refresh_low_precision")

    wrapped = apply_activation_checkpointing(layers, activation_checkpoint)
    if wrapped:
        steps.append("activation_checkpoint")

    record = ParallelizationRecord(
        steps=tuple(steps),
        mesh_shape=tuple(mesh.shape),
        upcast_params=upcast,
        sharded_modules=sharded,
        fp32_compute_modules=fp32_compute,
        checkpointed_layers=wrapped,
        reshard_after_forward=reshard_after_forward,
        param_dtype=str(mp_policy.param_dtype),
        reduce_dtype=str(mp_policy.reduce_dtype),
        low_precision_weights=0 if sharding is None else len(sharding.sharded) + len(sharding.replicated),
        replicated_low_precision=() if sharding is None else tuple((w.fqn, w.reason) for w in sharding.replicated),
        input_dim_sharded=() if sharding is None else sharding.input_dim_sharded,
    )
    return causal_lm, record


def _check_plain(causal_lm: nn.Module, adapter: ModelLayout) -> None:
    """The model has decoder layers where its adapter looks and is not sharded yet."""
    adapter.decoder_layers(causal_lm)
    if is_parallelized(causal_lm):
        raise TypeError(
            f"{type(causal_lm).__name__} is already sharded with fully_shard; parallelize a plain "
            f"model exactly once."
        )


def _convert(causal_lm: nn.Module, convert_module: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """Step 1: the precision plugin's conversion (module docstring); returns the module to use."""
    converted = convert_module(causal_lm)
    if not isinstance(converted, nn.Module):
        raise TypeError(
            f"convert_module must return an nn.Module, got {type(converted).__name__}."
        )
    return converted


def _low_precision_sharding(
    causal_lm: nn.Module,
    mesh: DeviceMesh,
    lifecycle: WeightLifecycle | None,
    fallback_to_unsharded: bool,
    input_dim_sharding: bool,
) -> LowPrecisionShardingPlan | None:
    """The shard-legality plan of the low-precision weights (design spec §9.1), ``None`` without any (bf16)."""
    if lifecycle is None:  # bf16 (parallelize_causal_lm refused low-precision weights without one)
        return None
    return lifecycle.plan_sharding(
        causal_lm, mesh.size(), fallback_to_unsharded=fallback_to_unsharded, input_dim_sharding=input_dim_sharding
    )


def _fully_shard_model(
    causal_lm: nn.Module,
    layers: nn.ModuleList,
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool,
    fp32_compute: Sequence[str],
    replicated_modules: Sequence[str],
    replicated_mesh: Callable[[str, int], DeviceMesh] | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
) -> int:
    """Step 3: ``fully_shard`` in order — replicated fallback modules, FP32 compute modules, decoder
    layers, root (module docstring); ``shard_placement_fn`` places the input-dim weights of the
    layers and the root; ``replicated_mesh(device_type, world_size)`` builds the fallback mesh (the
    lifecycle's). Returns the number of ``fully_shard`` calls."""
    fp32_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=mp_policy.reduce_dtype)
    modules = dict(causal_lm.named_modules())
    if replicated_modules:  # before the layers that contain them (fsdp.sharding docstring)
        if replicated_mesh is None:
            raise ValueError(f"{len(replicated_modules)} replicated fallback module(s) but no replicated_mesh to build.")
        replicate_mesh = replicated_mesh(mesh.device_type, mesh.size())
        for fqn in replicated_modules:
            fully_shard(
                modules[fqn], mesh=replicate_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward
            )
    for fqn in fp32_compute:
        fully_shard(modules[fqn], mesh=mesh, mp_policy=fp32_policy, reshard_after_forward=reshard_after_forward)
    kwargs = dict(mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward,
                  shard_placement_fn=shard_placement_fn)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(causal_lm, **kwargs)
    return len(replicated_modules) + len(fp32_compute) + len(layers) + 1


def _group_by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors grouped by DTensor device mesh (plain tensors form one group): foreach ops cannot mix meshes."""
    groups: dict[int, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(id(tensor.device_mesh) if isinstance(tensor, DTensor) else 0, []).append(tensor)
    return list(groups.values())


def clip_gradients_(
    parameters: list[nn.Parameter], *, max_value: float, algorithm: str, total_norm: torch.Tensor | None = None
) -> None:
    """Clip gradients in place by global norm (``"norm"``) or element-wise (``"value"``), per device mesh.

    Same result as ``torch.nn.utils.clip_grads_with_norm_`` / ``clip_grad_value_`` over all
    parameters (every shard is scaled by the one global factor ``max_value / (total_norm + 1e-6)``
    when that is < 1), but safe when gradients live on several meshes (the replicated fallback
    modules of :func:`parallelize_causal_lm`).

    Args:
        parameters: Parameters whose ``.grad`` is set.
        max_value: Maximum norm or absolute value.
        algorithm: ``"norm"`` or ``"value"``.
        total_norm: The total norm from :func:`total_grad_norm` (required for ``"norm"``).

    Raises:
        ValueError: Unknown ``algorithm``, or ``"norm"`` without ``total_norm``.
    """
    grads = [p for p in parameters if p.grad is not None]
    if algorithm == "value":
        for group in _group_by_mesh(grads):
            torch.nn.utils.clip_grad_value_(group, max_value)
        return
    if algorithm != "norm":
        raise ValueError(f"gradient clip algorithm must be 'norm' or 'value', got {algorithm!r}.")
    if total_norm is None:
        raise ValueError("clip_gradients_(algorithm='norm') needs total_norm (from total_grad_norm).")
    for group in _group_by_mesh(grads):
        torch.nn.utils.clip_grads_with_norm_(group, max_value, total_norm)


def total_grad_norm(parameters: list[nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
    """Total gradient norm over all ranks of FSDP2-sharded (DTensor) and plain gradients.

    ``torch.nn.utils.get_total_norm`` on DTensor gradients returns a DTensor with a partial
    (not yet reduced) norm placement; ``full_tensor()`` performs the cross-rank reduction, so the
    value equals the norm of the unsharded gradient (up to FP32 summation order). Gradients on
    different device meshes (the ``(W, 1)`` replicated fallback mesh) are normed per mesh first.

    Args:
        parameters: Parameters whose ``.grad`` is set (FP32 DTensor shards under FSDP2).
        norm_type: The p of the p-norm (2.0 for the usual L2 norm).

    Returns:
        A 0-d FP32 tensor (plain, identical on every rank).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    # One norm per device mesh (the replicated fallback modules live on a second mesh, and foreach
    # norms cannot mix meshes), combined as the p-norm of the per-mesh norms.
    norms = []
    for group in _group_by_mesh(grads):
        total = torch.nn.utils.get_total_norm(group, norm_type=norm_type, error_if_nonfinite=False)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        norms.append(total.to(torch.float32))
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack(norms), ord=norm_type)
