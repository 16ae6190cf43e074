"""The FSDP2 layout of a run, read off the meta model: units, per-parameter placement, bytes (``lp-lightning plan``).

What :func:`~lp_lightning.fsdp.parallelize.parallelize_causal_lm` would build, derived without
allocating anything (design spec §12.1 build order):

- the model is built on the meta device by its adapter (``adapter_for_config(spec).build_meta_model``)
  and, in mxfp8/hif8, the run's replacement plan is compiled and applied on it
  (``models.replacement.replacement_plan``), as
  ``lp-lightning fit`` does at launch;
- every low-precision weight gets its placement from the shard rules of design spec §9.1
  (:func:`~lp_lightning.fsdp.sharding.planned_placements` / ``planned_sharding``): ``Shard(0)``,
  ``Shard(1)`` or, with ``fallback_to_unsharded``, replicated;
- the ``fully_shard`` units, innermost first: the replicated fallback modules (a ``(W, 1)`` mesh: a
  shard group of one rank), the model adapter's FP32-compute modules (the MoE routers, gathered in
  FP32), the decoder layers, the root (embedding, final norm, LM head). A parameter belongs to the
  innermost unit whose module contains it.

Per parameter on the most loaded rank (rank 0): FSDP2 cuts ``Shard(d)`` with ``torch.chunk`` into
``ceil(D_d / G)`` slices (``G``: the unit's shard-group size) and allocates that padded size on
every rank, so the local shard is ``ceil(D0 / G) × rest`` for ``Shard(0)``, ``D0 × D1 / G × rest``
for ``Shard(1)`` (the rule asks ``D1 % G == 0``) and the whole tensor for a one-rank group.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lp_lightning.config import check_activation_checkpoint
from lp_lightning.fsdp.parallelize import default_mixed_precision_policy
from lp_lightning.formats.spec import FormatSpec, as_spec
from lp_lightning.fsdp.gather import gather_layout
from lp_lightning.fsdp.sharding import LowPrecisionShardingPlan, WeightPlacement, gather_policy_for, planned_placements, planned_sharding
from lp_lightning.lightning.precision import SUPPORTED_PRECISIONS
from lp_lightning.models.adapter import adapter_for, adapter_for_config, registered_specs
from lp_lightning.models.replacement import replacement_plan
from lp_lightning.policy import LowPrecisionConfig
from lp_lightning.tensor.storage import nbytes, storage_spec

__all__ = [
    "ModelLayout",
    "ParamRecord",
    "build_layout",
    "check_run_options",
    "reference_low_precision_weights",
    "storage_nbytes",
]

ROOT = ""
"""Unit name of the root ``fully_shard`` (the causal LM itself)."""


@dataclass(frozen=True)
class ParamRecord:
    """One parameter as FSDP2 will hold it.

    Attributes:
        fqn: Parameter FQN.
        shape: Full logical shape.
        unit: FQN of its ``fully_shard`` unit (``""``: the root).
        group_size: Shard-group size of the unit (the world size; 1 for a replicated fallback unit).
        shard_dim: FSDP2 ``Shard(shard_dim)``.
        gather_dtype: The unit's ``MixedPrecisionPolicy.param_dtype`` (the gathered copy's dtype).
        kind: ``"dense"``/``"grouped"`` for a low-precision weight, ``None`` otherwise.
    """

    fqn: str
    shape: tuple[int, ...]
    unit: str
    group_size: int
    shard_dim: int
    gather_dtype: torch.dtype
    kind: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Rank 0's shard (FSDP2's padded shard size, allocated on every rank)."""
        if not self.shape:
            return self.shape
        dim, size = self.shard_dim, list(self.shape)
        size[dim] = math.ceil(size[dim] / self.group_size)
        return tuple(size)

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def padded_numel(self) -> int:
        """Elements FSDP2 all-gathers and reduce-scatters: ``G`` padded shards."""
        return self.local_numel * self.group_size


@dataclass(frozen=True)
class ModelLayout:
    """The meta model of a run and its FSDP2 layout (module docstring).

    Attributes:
        config: The model's HF config.
        precision: ``bf16``, ``mxfp8`` or ``hif8``.
        format: The run's ``FormatSpec`` (``None`` in bf16).
        world_size: FSDP shard-group size ``W``.
        params: Every parameter, in ``named_parameters`` order.
        buffer_bytes: Bytes of the model's buffers (not sharded: every rank holds them).
        layers: Decoder-layer FQNs (the recompute units).
        placements: One ``WeightPlacement`` per low-precision weight (the rule's verdict, before the
            fallback); ``()`` in bf16.
        sharding: The placements after ``fallback_to_unsharded`` (``None`` in bf16); when the run
            cannot start, the layout the fallback would give.
        replicated_if_fallback: FQNs ``fallback_to_unsharded: true`` keeps replicated.
        startup_error: The launch error of ``fallback_to_unsharded: false`` with unshardable weights.
        input_embeddings: FQN of the input-embedding weight (its gradient comes last in backward).
        reshard_after_forward: FSDP2 ``reshard_after_forward``.
        activation_checkpoint: ``"off"`` or ``"full"``.
        reduce_dtype: The policy's gradient reduce-scatter dtype.
        param_dtype: The policy's compute dtype (activations and gathered copies).
    """

    config: Any
    precision: str
    format: FormatSpec | None
    world_size: int
    params: tuple[ParamRecord, ...]
    buffer_bytes: int
    layers: tuple[str, ...]
    placements: tuple[WeightPlacement, ...]
    sharding: LowPrecisionShardingPlan | None
    replicated_if_fallback: frozenset[str]
    startup_error: str | None
    input_embeddings: str
    reshard_after_forward: bool
    activation_checkpoint: str
    reduce_dtype: torch.dtype
    param_dtype: torch.dtype

    @property
    def low_precision_modules(self) -> frozenset[str]:
        """Module FQNs whose GEMMs run in low precision."""
        return frozenset(p.module_fqn for p in self.placements)

    def unit_params(self, unit: str) -> list[ParamRecord]:
        return [p for p in self.params if p.unit == unit]

    def layer_group(self, layer: str) -> list[ParamRecord]:
        """Parameters of a decoder layer's unit and of the units nested in it (router, replicated modules)."""
        return [p for p in self.params if p.unit == layer or p.unit.startswith(layer + ".")]

    def gathered_bytes(self, param: ParamRecord) -> tuple[int, int]:
        """``(slot bytes, scratch bytes)`` of the gathered copy of ``param`` while its unit is unsharded.

        Plain parameters: ``G`` padded shards in the unit's ``param_dtype``, no scratch. Low-precision
        weights: the exact ``uint8`` slots of their ``GatherLayout`` over ``G`` ranks under the run's
        gather policy (design spec §9.1), and the layout's scale scratch buffer (allocated with the
        gathered weight, freed at reshard).
        """
        if param.kind is None:
            return param.padded_numel * param.gather_dtype.itemsize, 0
        policy = gather_policy_for(
            reshard_after_forward=self.reshard_after_forward, activation_checkpoint=self.activation_checkpoint
        )
        shard_dim = param.shard_dim if param.group_size > 1 else 0
        layout = gather_layout(self.format, param.kind, param.shape, param.group_size, policy, shard_dim)
        return param.group_size * sum(math.prod(shape) for _, shape in layout.slots), layout.scratch_bytes

    def storage_bytes(self, param: ParamRecord) -> int:
        """Bytes of a low-precision weight's 8-bit storage and scales on rank 0; 0 for a plain parameter."""
        if param.kind is None or self.format is None:
            return 0
        return storage_nbytes(self.format, param.kind, param.local_shape)


def storage_nbytes(format: FormatSpec, kind: str, shape: tuple[int, ...]) -> int:
    """Bytes of the low-precision storage (data and scales, ``storage_spec``) of a weight of ``shape``."""
    return sum(nbytes(s, dtype) for s, dtype in storage_spec(format, kind, shape).values())


def check_run_options(
    spec: str, precision: str, world_size: int, seq_len: int, micro_batch_size: int, activation_checkpoint: str
) -> None:
    """The plan's arguments (exit status 2 in the CLI).

    Raises:
        ValueError: an unknown spec or precision, ``world_size``/``seq_len``/``micro_batch_size`` < 1,
            or ``activation_checkpoint`` other than ``off``/``full``.
    """
    if spec not in registered_specs():
        raise ValueError(f"--spec {spec!r} is not a built-in spec; choose one of {list(registered_specs())}.")
    if precision not in SUPPORTED_PRECISIONS:
        raise ValueError(f"--precision {precision!r} is not supported; choose one of {list(SUPPORTED_PRECISIONS)}.")
    for name, value in (("world_size", world_size), ("seq_len", seq_len), ("micro_batch_size", micro_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name} must be an integer >= 1, got {value!r}.")
    check_activation_checkpoint(activation_checkpoint, "--activation_checkpoint")


def _meta_model(spec: str, config_overrides: Mapping[str, Any] | None) -> nn.Module:
    adapter = adapter_for_config(spec)
    model = adapter.build_meta_model(spec, config_overrides=dict(config_overrides or {}), attn_implementation="sdpa")
    bad = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != "meta"]
    if bad:  # the planner must never hold real weights (docs/planner.md)
        raise RuntimeError(f"build_meta_model returned tensors off the meta device: {bad[:3]}.")
    return model


def reference_low_precision_weights(
    spec: str, config_overrides: Mapping[str, Any] | None
) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(fqn, kind, shape)`` of the weights the default plan makes low precision (the same in every
    low-precision recipe), for a bf16 run's bytes-per-parameter table."""
    meta = _meta_model(spec, config_overrides)
    policy = LowPrecisionConfig.from_precision(next(p for p in SUPPORTED_PRECISIONS if p != "bf16")).to_policy()
    replacement_plan(meta, policy).apply(meta)
    return [(p.fqn, p.kind, p.shape) for p in planned_placements(meta, 1, policy.format.value)]


def build_layout(
    spec: str,
    precision: str,
    world_size: int,
    *,
    reshard_after_forward: bool,
    activation_checkpoint: str,
    fallback_to_unsharded: bool,
    config_overrides: Mapping[str, Any] | None,
    input_dim_sharding: bool = True,
) -> tuple[ModelLayout, nn.Module]:
    """Build the meta model of a run, apply its plan and place every parameter (module docstring).

    Returns:
        ``(layout, meta_model)``; the model stays on the meta device.

    Raises:
        ValueError: bad options (:func:`check_run_options`) or config overrides the config rejects.
    """
    meta = _meta_model(spec, config_overrides)
    adapter = adapter_for(meta)
    fp32_units = adapter.fp32_compute_modules(meta)
    layer_ids = {id(layer) for layer in adapter.decoder_layers(meta)}
    layers = tuple(name for name, module in meta.named_modules() if id(module) in layer_ids)
    fmt: FormatSpec | None = None
    placements: tuple[WeightPlacement, ...] = ()
    sharding = None
    startup_error = None
    replicated_if_fallback: frozenset[str] = frozenset()
    if precision != "bf16":
        policy = LowPrecisionConfig.from_precision(precision).to_policy()
        replacement_plan(meta, policy).apply(meta)
        fmt = as_spec(policy.format.value)
        placements = planned_placements(meta, world_size, fmt, input_dim_sharding=input_dim_sharding)
        with_fallback = planned_sharding(
            meta, world_size, fmt, fallback_to_unsharded=True, input_dim_sharding=input_dim_sharding
        )
        replicated_if_fallback = frozenset(w.fqn for w in with_fallback.replicated)
        try:
            sharding = planned_sharding(
                meta, world_size, fmt, fallback_to_unsharded=fallback_to_unsharded, input_dim_sharding=input_dim_sharding
            )
        except ValueError as err:
            startup_error, sharding = str(err), with_fallback
    policy = default_mixed_precision_policy()
    replicated_units = sharding.replicated_modules if sharding is not None else ()
    inner_units = (*replicated_units, *fp32_units)
    by_fqn = {p.fqn: p for p in (sharding.placements if sharding is not None else ())}
    records = []
    for fqn, param in meta.named_parameters():
        unit = _innermost_unit(fqn, inner_units, layers)
        lp = by_fqn.get(fqn)
        replicated = unit in replicated_units
        records.append(
            ParamRecord(
                fqn=fqn,
                shape=tuple(param.shape),
                unit=unit,
                group_size=1 if replicated else world_size,
                shard_dim=0 if lp is None or lp.shard_dim is None else lp.shard_dim,
                gather_dtype=torch.float32 if unit in fp32_units else policy.param_dtype,
                kind=None if lp is None else lp.kind,
            )
        )
    embeddings = meta.get_input_embeddings().weight
    input_embeddings = next(n for n, p in meta.named_parameters() if p is embeddings)
    layout = ModelLayout(
        config=meta.config,
        precision=precision,
        format=fmt,
        world_size=world_size,
        params=tuple(records),
        buffer_bytes=sum(b.numel() * b.element_size() for b in meta.buffers()),
        layers=layers,
        placements=placements,
        sharding=sharding,
        replicated_if_fallback=replicated_if_fallback,
        startup_error=startup_error,
        input_embeddings=input_embeddings,
        reshard_after_forward=reshard_after_forward,
        activation_checkpoint=activation_checkpoint,
        reduce_dtype=policy.reduce_dtype,
        param_dtype=policy.param_dtype,
    )
    return layout, meta


def _innermost_unit(fqn: str, inner_units: tuple[str, ...], layers: tuple[str, ...]) -> str:
    """The ``fully_shard`` unit owning ``fqn``: a nested unit first, then its layer, else the root."""
    for unit in (*inner_units, *layers):
        if fqn.startswith(unit + "."):
            return unit
    return ROOT
