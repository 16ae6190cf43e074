"""Per-rank memory of a training run, predicted on the meta model: :func:`plan_memory` (docs/planner.md).

Components (bytes on the most loaded rank, rank 0; :class:`~lp_lightning.planner.layout.ParamRecord`
for the shard sizes):

==============================  ================================================================
``master``                      FP32 master shards (design spec §10): ``4 · local numel``
``optimizer``                   AdamW ``exp_avg`` + ``exp_avg_sq``, FP32: ``8 · local numel``
``gradients``                   FP32 sharded gradients (reduce-scatter output): ``4 · local numel``
``low_precision_storage``       8-bit shards and scales of the low-precision weights
                                (``storage_spec`` of each local shard; 0 in bf16)
``buffers``                     model buffers (not sharded)
``all_gather_buffers``          gathered copies in flight: with ``reshard_after_forward`` the
                                root unit plus two copies of the largest decoder-layer group
                                (the current layer's buffers and the prefetched/flat all-gather
                                output); otherwise every unit (ZeRO-2) plus one flat output
``unsharded_gradients``         the root's early gradients (LM head, final norm; reduce-scattered
                                last) and the largest layer group's gradients before
                                reduce-scatter plus its FP32 reduce-scatter input
``activations``                 saved for backward (the model adapter's ``activation_terms``, summed
                                by :func:`saved_activation_bytes`)
``loss_logits``                 logits-sized tensors around the loss (``12 · T · V``)
``optimizer_step_temporaries``  AdamW's multi-tensor (foreach) step: one FP32 temporary of the
                                largest parameter group's local size
==============================  ================================================================

They do not all coexist. ``total`` is the largest of three phases (``MemoryPlan.phases``), each
``master + optimizer + low_precision_storage + buffers`` plus: **loss** (end of forward, start of
backward) ``gradients + activations + loss_logits`` (+ every gathered unit without
``reshard_after_forward``); **backward** (the last decoder layer) ``activations +
all_gather_buffers + unsharded_gradients``; **optimizer step** ``gradients +
optimizer_step_temporaries``. The previous step's sharded gradients are alive through the forward
and the loss: Lightning's automatic optimization runs ``training_step``, then ``zero_grad`` (to
``None``), then ``backward`` (``Closure.closure`` in ``lightning/pytorch/loops/optimization/
automatic.py``), so they are freed only when backward starts; ``accumulate_grad_batches: 1``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lp_lightning.formats.spec import as_spec
from lp_lightning.lightning.precision import SUPPORTED_PRECISIONS
from lp_lightning.models.adapter import ActivationTerms, adapter_for
from lp_lightning.planner.layout import (
    ROOT,
    ModelLayout,
    ParamRecord,
    build_layout,
    check_run_options,
    reference_low_precision_weights,
    storage_nbytes,
)
from lp_lightning.policy import LowPrecisionConfig

__all__ = ["COMPONENTS", "DEFAULT_BUDGET_BYTES", "RECIPES", "MemoryPlan", "plan_memory", "saved_activation_bytes"]

DEFAULT_BUDGET_BYTES = 96 * 2**30
"""One card of the design spec's node (96 GiB)."""

COMPONENTS: tuple[str, ...] = (
    "master", "optimizer", "gradients", "low_precision_storage", "buffers", "all_gather_buffers",
    "unsharded_gradients", "activations", "loss_logits", "optimizer_step_temporaries",
)
"""The keys of ``MemoryPlan.per_rank_bytes`` besides ``total`` (module docstring)."""

RECIPES: tuple[str, ...] = SUPPORTED_PRECISIONS
"""The recipes of the bytes-per-parameter table (every ``--precision``)."""

_MASTER = torch.float32.itemsize  # FP32 master, FP32 moments, FP32 sharded gradient (design spec §10)


def saved_activation_bytes(terms: ActivationTerms, activation_checkpoint: str) -> int:
    """Bytes saved for backward at the end of forward (the layers' and the outside terms).

    ``"off"``: every layer's terms; ``"full"``: each layer's input, plus the terms of the one layer
    being recomputed in backward.
    """
    per_layer = [sum(layer.values()) for layer in terms.layers]
    outside = sum(terms.outside.values())
    if activation_checkpoint == "off":
        return sum(per_layer) + outside
    return len(per_layer) * terms.layer_input + max(per_layer, default=0) + outside


@dataclass(frozen=True)
class MemoryPlan:
    """The predicted per-rank memory of one configuration (module docstring; docs/planner.md).

    Attributes:
        run: The configuration (spec, precision, format, world size, seq_len, micro batch, FSDP settings).
        per_rank_bytes: ``{component: bytes}`` for :data:`COMPONENTS` and ``total`` (the peak phase).
        phases: ``{phase: bytes}``; ``total`` is their maximum.
        peak_phase: The phase of ``total``.
        budget_bytes: The device budget.
        fits: ``total <= budget_bytes``.
        launchable: ``False`` when ``fallback_to_unsharded=false`` and a weight no dim can shard
            (the run stops at startup; the memory is then the fallback's).
        startup_error: That startup error, else ``None``.
        shard_violations: ``{fqn, shape, reason}`` of every weight breaking the format's dim-0 rule
            (design spec §9.1).
        placements: Per low-precision weight: ``fqn``, ``module_fqn``, ``shape``, ``kind``,
            ``placement`` (``Shard(0)``, ``Shard(1)``, ``replicated``, or ``unshardable`` when the run
            cannot start), ``dim0_rule`` (``holds``/``breaks``), ``dim0_violation``, ``reason``,
            ``replicated_by_fallback`` (what ``fallback_to_unsharded: true`` replicates).
        bytes_per_parameter: One row per recipe of :data:`RECIPES`: training-state bytes per parameter.
        parameters: Parameter counts (``total``, ``low_precision``, ``local`` on rank 0).
        in_flight: The FSDP2 units assumed gathered at the backward peak and their bytes.
        activation_terms: ``{"per_layer": [{term: bytes}], "outside": {term: bytes}, ...}``.
    """

    run: dict[str, Any]
    per_rank_bytes: dict[str, int]
    phases: dict[str, int]
    peak_phase: str
    budget_bytes: int
    fits: bool
    launchable: bool
    startup_error: str | None
    shard_violations: list[dict[str, Any]]
    placements: list[dict[str, Any]]
    bytes_per_parameter: list[dict[str, Any]]
    parameters: dict[str, int]
    in_flight: dict[str, Any]
    activation_terms: dict[str, Any] = field(repr=False)

    @property
    def headroom_bytes(self) -> int:
        """``budget_bytes - total`` (negative when it does not fit)."""
        return self.budget_bytes - self.per_rank_bytes["total"]

    def as_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready (shapes as lists)."""
        return {**asdict(self), "headroom_bytes": self.headroom_bytes}

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`as_dict` as JSON."""
        return json.dumps(self.as_dict(), indent=indent)


def plan_memory(
    spec: str,
    precision: str,
    world_size: int,
    *,
    seq_len: int,
    micro_batch_size: int,
    activation_checkpoint: str = "off",
    reshard_after_forward: bool = True,
    fallback_to_unsharded: bool = False,
    config_overrides: dict | None = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    input_dim_sharding: bool = True,
) -> MemoryPlan:
    """Predict the per-rank memory of ``lp-lightning fit`` for a spec, precision and world size, on meta.

    Nothing is allocated: the model is built on the meta device and the precision plugin's plan is
    applied to it (docs/planner.md; design spec §9.1 shard rules, §10 FP32 masters, §12.1 build order).

    Args:
        spec: A built-in model spec (``dsv3-16b``, ``dsv3-tiny``).
        precision: ``bf16``, ``mxfp8`` or ``hif8``.
        world_size: FSDP2 shard-group size (``fsdp_config.dp_shard_size`` / ranks).
        seq_len: Tokens per sequence (``data.seq_len``).
        micro_batch_size: Sequences per rank per micro-batch (``global_batch_size // (accumulation · W)``).
        activation_checkpoint: ``"off"`` or ``"full"``.
        reshard_after_forward: ``fsdp_config.reshard_after_forward``.
        fallback_to_unsharded: ``fsdp_config.fallback_to_unsharded``.
        input_dim_sharding: ``fsdp_config.input_dim_sharding`` (``False``: dim 0 only, as ``fit``).
        config_overrides: DeepseekV3Config fields applied on top of the spec (no spec validation).
        budget_bytes: The device memory budget (default 96 GiB).

    Returns:
        The :class:`MemoryPlan`.

    Raises:
        ValueError: an unknown spec or precision, a size < 1, a bad ``activation_checkpoint``, a
            non-positive budget, or config overrides the model config rejects.
    """
    check_run_options(spec, precision, world_size, seq_len, micro_batch_size, activation_checkpoint)
    flags = (("reshard_after_forward", reshard_after_forward), ("fallback_to_unsharded", fallback_to_unsharded),
             ("input_dim_sharding", input_dim_sharding))
    for name, value in flags:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}.")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}.")
    layout, meta = build_layout(
        spec, precision, world_size, reshard_after_forward=reshard_after_forward,
        activation_checkpoint=activation_checkpoint, fallback_to_unsharded=fallback_to_unsharded,
        config_overrides=config_overrides, input_dim_sharding=input_dim_sharding,
    )
    acts = adapter_for(meta).activation_terms(
        layout.config, micro_batch_size=micro_batch_size, seq_len=seq_len,
        low_precision_modules=layout.low_precision_modules, format=layout.format,
        activation_dtype=layout.param_dtype,
    )
    saved = saved_activation_bytes(acts, activation_checkpoint)
    components, in_flight, gathered_at_loss = _components(layout, acts, saved)
    steady = sum(components[k] for k in ("master", "optimizer", "low_precision_storage", "buffers"))
    phases = {
        # the previous step's gradients: Lightning zeroes them after training_step (module docstring)
        "loss": steady + components["gradients"] + components["activations"] + components["loss_logits"]
        + gathered_at_loss,
        "backward": steady + components["activations"] + components["all_gather_buffers"]
        + components["unsharded_gradients"],
        "optimizer_step": steady + components["gradients"] + components["optimizer_step_temporaries"],
    }
    peak = max(phases, key=phases.__getitem__)
    run = {
        "spec": spec, "precision": precision, "format": None if layout.format is None else layout.format.name,
        "world_size": world_size, "seq_len": seq_len, "micro_batch_size": micro_batch_size,
        "activation_checkpoint": activation_checkpoint, "reshard_after_forward": reshard_after_forward,
        "fallback_to_unsharded": fallback_to_unsharded, "input_dim_sharding": input_dim_sharding,
        "config_overrides": dict(config_overrides or {}),
    }
    total = phases[peak]
    return MemoryPlan(
        run=run,
        per_rank_bytes={**components, "total": total},
        phases=phases,
        peak_phase=peak,
        budget_bytes=budget_bytes,
        fits=total <= budget_bytes,
        launchable=layout.startup_error is None,
        startup_error=layout.startup_error,
        shard_violations=[
            {"fqn": p.fqn, "shape": list(p.shape), "reason": p.dim0_violation}
            for p in layout.placements
            if p.dim0_violation is not None
        ],
        placements=_placements(layout),
        bytes_per_parameter=bytes_per_parameter(layout, spec, config_overrides),
        parameters={
            "total": sum(p.numel for p in layout.params),
            "low_precision": sum(p.numel for p in layout.params if p.kind is not None),
            "local": sum(p.local_numel for p in layout.params),
        },
        in_flight=in_flight,
        activation_terms={
            "per_layer": [dict(t) for t in acts.layers],
            "outside": dict(acts.outside),
            "layer_input": acts.layer_input,
            "saved_bytes": saved,
        },
    )


def _components(
    layout: ModelLayout, acts: ActivationTerms, saved_activations: int
) -> tuple[dict[str, int], dict[str, Any], int]:
    """The component bytes, the in-flight units, and the bytes gathered at the loss phase."""
    params = layout.params
    local = sum(p.local_numel for p in params)
    groups = {layer: layout.layer_group(layer) for layer in layout.layers}
    gathered = {layer: _gathered(layout, group) for layer, group in groups.items()}
    root = _gathered(layout, layout.unit_params(ROOT))
    largest = max(gathered, key=lambda layer: gathered[layer][0] + gathered[layer][1], default=None)
    slots, scratch = gathered[largest] if largest is not None else (0, 0)
    if layout.reshard_after_forward:
        all_gather = sum(root) + 2 * slots + scratch
        units = {"root": sum(root), f"{largest} (current)": slots + scratch, f"{largest} (prefetched)": slots}
        at_loss = 0
    else:
        everything = sum(root) + sum(s + c for s, c in gathered.values())
        all_gather = everything + slots
        units = {"every unit": everything, f"{largest} (flat all-gather output)": slots}
        at_loss = all_gather
    early = [p for p in layout.unit_params(ROOT) if p.fqn != layout.input_embeddings]
    reduce = layout.reduce_dtype.itemsize
    layer_grads = max(
        (sum(p.numel * p.gather_dtype.itemsize + p.padded_numel * reduce for p in group) for group in groups.values()),
        default=0,
    )
    decay = [p for p in params if len(p.shape) >= 2]  # LPLightningModule.configure_optimizers: ndim >= 2 decays
    no_decay = [p for p in params if len(p.shape) < 2]
    components = {
        "master": _MASTER * local,
        "optimizer": 2 * _MASTER * local,
        "gradients": _MASTER * local,
        "low_precision_storage": sum(layout.storage_bytes(p) for p in params),
        "buffers": layout.buffer_bytes,
        "all_gather_buffers": all_gather,
        "unsharded_gradients": sum(p.numel * p.gather_dtype.itemsize for p in early) + layer_grads,
        "activations": saved_activations,
        "loss_logits": acts.loss_logits,
        "optimizer_step_temporaries": _MASTER * max(sum(p.local_numel for p in g) for g in (decay, no_decay)),
    }
    in_flight = {
        "reshard_after_forward": layout.reshard_after_forward,
        "largest_layer_group": largest,
        "units": units,
    }
    return components, in_flight, at_loss


def _gathered(layout: ModelLayout, group: list[ParamRecord]) -> tuple[int, int]:
    """``(slot bytes, scratch bytes)`` of a group of parameters while gathered."""
    pairs = [layout.gathered_bytes(p) for p in group]
    return sum(s for s, _ in pairs), sum(c for _, c in pairs)


def _placements(layout: ModelLayout) -> list[dict[str, Any]]:
    final = {p.fqn: p for p in (layout.sharding.placements if layout.sharding is not None else ())}
    rows = []
    for p in layout.placements:
        placement = final[p.fqn].placement
        if layout.startup_error is not None and p.shard_dim is None:
            placement = "unshardable"
        rows.append({
            "fqn": p.fqn, "module_fqn": p.module_fqn, "shape": list(p.shape), "kind": p.kind,
            "placement": placement, "dim0_rule": "holds" if p.dim0_violation is None else "breaks",
            "dim0_violation": p.dim0_violation, "reason": final[p.fqn].reason,
            "replicated_by_fallback": p.fqn in layout.replicated_if_fallback,
        })
    return rows


def bytes_per_parameter(
    layout: ModelLayout, spec: str, config_overrides: Mapping[str, Any] | None
) -> list[dict[str, Any]]:
    """Training-state bytes per parameter of each recipe (master 4 + moments 8 + gradient 4 + storage).

    The storage column is exact for this model: the 8-bit data and scales (``storage_spec`` of every
    whole low-precision weight) over their parameter count.
    """
    if layout.format is not None:
        weights = [(p.kind, p.shape) for p in layout.params if p.kind is not None]
    else:
        weights = [(kind, shape) for _, kind, shape in reference_low_precision_weights(spec, config_overrides)]
    lp_params = sum(math.prod(shape) for _, shape in weights)
    all_params = sum(p.numel for p in layout.params)
    rows = []
    for recipe in RECIPES:
        config = LowPrecisionConfig.from_precision(recipe)
        fmt = as_spec(config.format) if config.enabled else None
        storage = sum(storage_nbytes(fmt, kind, shape) for kind, shape in weights) if fmt is not None else 0
        per_param = storage / lp_params if lp_params else 0.0
        rows.append({
            "recipe": recipe, "format": None if fmt is None else fmt.name,
            "master": _MASTER, "adamw_moments": 2 * _MASTER, "gradient": _MASTER,
            "low_precision_storage": per_param,
            "total_low_precision_weights": 4 * _MASTER + per_param,
            "total_model": (4 * _MASTER * all_params + storage) / all_params if all_params else 0.0,
        })
    return rows
