"""Read-only probe callbacks of a training run: the evidence files of design spec §16.6 and §17.

Each probe is a Lightning ``Callback`` that observes through the public event hooks
(``lp_lightning.ops.add_gemm_observer`` / ``add_quantize_observer``,
``lp_lightning.fsdp.gather.add_gather_observer``, ``lp_lightning.tensor.add_refresh_observer``) and
Lightning's hooks. None replaces, quantises, gathers or refreshes anything: tensors are read
(an amax, a SHA-1, a histogram) only on *sampled* steps. A bf16 run registers no observer and
imports nothing low-precision (the modules are looked up only when the precision plugin's policy
is enabled).

**Steps.** An optimizer step is numbered by the global step after it (the first step of a fresh
run is 1). A step is *sampled* when it is the first step of the fit call or its number is a
multiple of ``sample_every``; events are kept in full for sampled steps and counted for all.
Events outside a step (validation, checkpointing, setup) are not attributed.

**Driving.** With a Trainer the hooks drive it (``trainer.callbacks`` or the CLI's
``trainer.callbacks`` list). With Fabric the same objects go in ``Fabric(callbacks=[...])`` and the
loop calls::

    fabric.call("on_probe_start", model=model, fabric=fabric, out_dir="runs/x/probes")
    for i in range(steps):                  # i = optimizer steps done before this one
        fabric.call("on_probe_step_start", step=i)
        ...                                 # forward, backward, optimizer step (refresh)
        fabric.call("on_probe_step_end", step=i, loss=loss, grad_norm=norm, tokens=global_tokens)
    fabric.call("on_probe_end")

(``rank=`` / ``world_size=`` may replace ``fabric=``; with ``fabric`` the scalars go to
``fabric.log_dict`` and the plugin's counters are read from ``fabric.strategy.precision``.)
Validation is excluded (paused). Scalars go to every logger of the Trainer (``trainer.loggers``),
names prefixed ``probe/``: ``refreshes``, ``gemms``, ``gathers_pre`` / ``gathers_post`` per step;
``scale/<role>/amax_max`` and ``scale/<role>/scale_max`` (float32 scales) or
``scale/<role>/byte_min`` / ``byte_max`` (1-byte scales) on sampled steps; ``loss``, ``grad_norm``,
``step_time_s``, ``tokens_per_s``, ``peak_memory_bytes`` per step; ``profile/<category>_share``
once the profiled window closes.

The common driver is :class:`~lp_lightning.telemetry.probe_base.ProbeCallback`;
:class:`ScaleStatsProbe` lives in :mod:`~lp_lightning.telemetry.scale_probe`,
:class:`ProfilerProbe` in :mod:`~lp_lightning.telemetry.profile_probe` and
:class:`TensorMemoryProbe` in :mod:`~lp_lightning.telemetry.memory_probe` (all exported here).

**Files.** Each probe writes, on every rank at the end of training, one JSON file
``<out_dir>/<kind>_rank<r>.json`` (``out_dir`` default ``<default_root_dir>/probes``), top level
``{"kind", "rank", "world_size", "first_step", "steps", "sample_every", "sampled_steps", ...}``
(``first_step``: number of the first step of this call; ``steps``: steps of this call):

============================ ===================================================================
probe (kind)                 what it adds
============================ ===================================================================
:class:`RefreshProbe`        ``per_step`` ``[{"step", "refreshes", "weights", "max_per_weight",
(``refresh``)                "skipped"}]`` (storage builds per optimizer step; ``skipped``: the
                             plugin skipped the step, ``null`` if unknown), ``micro_step_refreshes``
                             (builds during a micro-batch that did not complete a step; ``null``
                             with Fabric, which marks no micro-batches), ``forward_backward_refreshes``
                             (builds while a module forward, incl. recompute, or the autograd
                             engine ran), ``outside_steps``, ``startup`` / ``resume`` (the plugin's
                             full rebuilds), ``low_precision_weights``, ``micro_batches_per_step``
:class:`GemmTraceProbe`      ``counts`` ``{"<role>|<format>|<backend>": n}`` (role ``dense_fprop``
(``gemm_trace``)             ..., ``unlabelled``), ``per_step`` ``[{"step", "gemms"}]``, ``events``
                             of sampled steps ``[{"step", "micro_batch", "weight_fqn", "role",
                             "backend", "format", "layout", "left_shape", "right_shape",
                             "output_shape", "output_dtype", "num_groups", "device"}]``,
                             ``unlabelled``, ``weight_fqns`` ``{"<role>": [FQNs]}``
:class:`GatherTraceProbe`    ``per_step`` ``[{"step", "pre", "post"}]``, ``events`` (every gather of
(``gather_trace``)           sampled steps) ``[{"step", "fqn", "stage", "phase", "orientations",
                             "local", "tensors": [[name, dtype, shape]], "bytes", "logical_shape",
                             "logical_dtype", "scale_values", "sha1"}]``; ``scale_values``: the
                             values of float32 scale tensors with at most 256 elements (HiF8),
                             else ``null``; ``sha1`` ``{name: hex}`` of each rebuilt storage tensor
                             (post events; ``null`` for pre)
:class:`ScaleStatsProbe`     ``records`` (sampled steps, one per float32 scale of a quantize event:
(``scales``)                 ``{"step", "role", "weight_fqn", "op", "format", "gemm_role",
                             "input_shape", "format_max", "amax", "amax_source", "scale",
                             "expected_scale", "scale_dtype", "finite", "positive", "matches"}``),
                             ``histograms`` ``{"<role>": {"<scale byte>": n}}`` of 1-byte scales
                             (MXFP8 E8M0) with ``scale_dtype``, and the summary ``hif8``
                             ``{"<role>": {"events", "format_max", "all_match",
                             "all_finite_positive", "amax_max", "scale_min", "scale_max"}}``
:class:`StepRecordProbe`     ``records`` ``[{"step", "loss", "grad_norm", "step_time_s",
(``steps``)                  "step_wall_time_s", "non_training_s", "tokens", "tokens_per_s",
                             "peak_memory_bytes", "peak_memory_source", "micro_batches",
                             "skipped"}]`` (``step_time_s``: the training time, the wall time less
                             the non-training work inside the step: ``StepClock``), ``threads``,
                             ``load_average`` ``{"start", "end"}``
:class:`ProfilerProbe`       see :mod:`lp_lightning.telemetry.profile_probe` (``window``,
(``profile``)                ``wall_s``, ``categories_s``, ``shares``, ``top_ops``)
:class:`TensorMemoryProbe`   see :mod:`lp_lightning.telemetry.memory_probe` (``peak_bytes``: peak
(``tensor_memory``)          live tensor bytes of the measured steps, ``by_category``,
                             ``by_component``, ``phase``, ``per_step``); also fills the
                             ``peak_tensor_bytes*`` keys of ``run_summary.json``
============================ ===================================================================

``amax`` is the event's precomputed amax (the cross-rank MAX of a HiF8 dense weight) when the
caller passed one (``amax_source: "event"``), else max |x| of the input (``"input"``: 0-d, or
per leading group ``[E]`` of a 3-D weight); ``expected_scale = amax / format_max`` in FP32 and
``matches`` compares the scale with it bit for bit, where docs/formats.md's rule gives 1.0 for a
non-finite or zero quotient. ``role`` is the ``QuantizationRole`` value (``"weight"`` for a
refresh). ``tokens`` of a step is this rank's tokens × world size (every rank gets an equal batch).
``peak_memory_bytes`` is this rank's peak so far: the device's ``max_memory_allocated`` or, on the
CPU, the process's peak RSS (``ru_maxrss``); probes never reset it.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from typing import Any

import torch

from lp_lightning.observers import non_training
from lp_lightning.telemetry.summary import _load_average, _peak_memory_bytes, _threads
from lp_lightning.telemetry.memory_probe import TensorMemoryProbe
from lp_lightning.telemetry.probe_base import ProbeCallback, StepInfo
from lp_lightning.telemetry.probes import _dtype_name
from lp_lightning.telemetry.profile_probe import ProfilerProbe
from lp_lightning.telemetry.scale_probe import ScaleStatsProbe

__all__ = [
    "GatherTraceProbe",
    "GemmTraceProbe",
    "ProbeCallback",
    "ProfilerProbe",
    "RefreshProbe",
    "ScaleStatsProbe",
    "StepInfo",
    "StepRecordProbe",
    "TensorMemoryProbe",
]


# ------------------------------------------------------------------------------------------------
# Refreshes


class RefreshProbe(ProbeCallback):
    """Storage builds of the low-precision weights per optimizer step (``refresh_rank<r>.json``)."""

    kind = "refresh"

    def _on_start(self) -> None:
        self._per_step: list[dict[str, Any]] = []
        self._counts: Counter[str] = Counter()
        self._micro_refreshes = self._micro_total = 0
        self._fwd_bwd = self._outside = 0
        self._depth = 0
        self._micro_counts: list[int] = []
        hooks = self._recorders()
        if hooks is None:
            return
        self._keep(hooks.add_refresh_observer(self._observe))
        if self._model is not None:  # "a module forward is running" (also the recompute of checkpointing)
            for module in self._model.modules():
                self._keep(module.register_forward_pre_hook(self._enter))
                self._keep(module.register_forward_hook(self._exit, always_call=True))

    def _enter(self, *_: Any) -> None:
        self._depth += 1

    def _exit(self, *_: Any) -> None:
        self._depth -= 1

    def _observe(self, weight: Any) -> None:
        if not self.in_step:
            self._outside += 1
            return
        self._counts[weight.fqn] += 1
        self._micro_refreshes += 1
        if self._depth > 0 or torch._C._current_graph_task_id() != -1:
            self._fwd_bwd += 1

    def _on_micro_batch_end(self, completes_step: bool) -> None:
        if not completes_step:
            self._micro_total += self._micro_refreshes
        self._micro_refreshes = 0

    def _on_step_end(self, info: StepInfo) -> dict[str, float | None]:
        total = sum(self._counts.values())
        self._per_step.append({"step": info.step, "refreshes": total, "weights": len(self._counts),
                               "max_per_weight": max(self._counts.values(), default=0), "skipped": info.skipped})
        self._micro_counts.append(info.micro_batches)
        self._counts, self._micro_refreshes = Counter(), 0
        return {"refreshes": total}

    def _payload(self) -> dict[str, Any]:
        refreshes = self._plugin.refreshes if self._plugin is not None else {}
        return {
            "per_step": self._per_step,
            "micro_step_refreshes": self._micro_total if self._driver == "trainer" else None,
            "forward_backward_refreshes": self._fwd_bwd,
            "outside_steps": self._outside,
            "startup": refreshes.get("startup", 0),
            "resume": refreshes.get("resume", 0),
            "low_precision_weights": len(self._plugin.low_precision_weights) if self._plugin is not None else 0,
            "micro_batches_per_step": max(self._micro_counts, default=None),
        }


# ------------------------------------------------------------------------------------------------
# GEMM events


class GemmTraceProbe(ProbeCallback):
    """Every low-precision GEMM: counts per role/format/backend, events of sampled steps (``gemm_trace_rank<r>.json``)."""

    kind = "gemm_trace"

    def _on_start(self) -> None:
        self._counts: Counter[str] = Counter()
        self._per_step: list[dict[str, int]] = []
        self._events: list[dict[str, Any]] = []
        self._fqns: defaultdict[str, set[str]] = defaultdict(set)
        self._unlabelled = self._step_gemms = 0
        hooks = self._recorders()
        if hooks is not None:
            self._keep(hooks.add_gemm_observer(self._observe))

    def _observe(self, event: Any) -> None:
        if not self.in_step:
            return
        role = event.gemm_role.value if event.gemm_role is not None else "unlabelled"
        self._counts[f"{role}|{event.format}|{event.backend}"] += 1
        self._step_gemms += 1
        if event.gemm_role is None:
            self._unlabelled += 1
        if event.weight_fqn:
            self._fqns[role].add(event.weight_fqn)
        if self._sampled:
            self._events.append({
                "step": self._step, "micro_batch": self._micro, "weight_fqn": event.weight_fqn,
                "role": None if event.gemm_role is None else role, "backend": event.backend, "format": event.format,
                "layout": event.layout, "left_shape": list(event.left_shape), "right_shape": list(event.right_shape),
                "output_shape": list(event.output_shape), "output_dtype": event.output_dtype,
                "num_groups": event.num_groups, "device": event.device,
            })  # fmt: skip

    def _on_step_end(self, info: StepInfo) -> dict[str, float | None]:
        self._per_step.append({"step": info.step, "gemms": self._step_gemms})
        gemms, self._step_gemms = self._step_gemms, 0
        return {"gemms": gemms}

    def _payload(self) -> dict[str, Any]:
        return {
            "counts": dict(sorted(self._counts.items())),
            "per_step": self._per_step,
            "events": self._events,
            "unlabelled": self._unlabelled,
            "weight_fqns": {role: sorted(fqns) for role, fqns in sorted(self._fqns.items())},
        }


# ------------------------------------------------------------------------------------------------
# FSDP2 gathers


def _sha1(t: torch.Tensor) -> str:
    # A copy: numpy() would pin the storage (FSDP2 resizes the gathered buffers at reshard).
    raw = t.detach().reshape(-1).contiguous().view(torch.uint8).to("cpu", copy=True)
    return hashlib.sha1(raw.numpy().tobytes()).hexdigest()


class GatherTraceProbe(ProbeCallback):
    """Every FSDP2 gather of a low-precision weight, pre and post (``gather_trace_rank<r>.json``)."""

    kind = "gather_trace"

    def _on_start(self) -> None:
        self._per_step: list[dict[str, int]] = []
        self._events: list[dict[str, Any]] = []
        self._pre = self._post = 0
        hooks = self._recorders()
        if hooks is not None:
            self._keep(hooks.add_gather_observer(self._observe))

    def _observe(self, event: Any) -> None:
        if not self.in_step:
            return
        post = event.stage == "post_all_gather"
        if post:
            self._post += 1
        else:
            self._pre += 1
        if not self._sampled:
            return
        with non_training("probe_sample"):  # hashes and copies to host: no step time (observers)
            self._record(event, post)

    def _record(self, event: Any, post: bool) -> None:
        tensors = list(zip(event.names, event.tensors))
        scales = [t for _, t in tensors if t.dtype == torch.float32 and t.numel() <= 256]
        self._events.append({
            "step": self._step, "fqn": event.fqn, "stage": event.stage, "phase": event.phase,
            "orientations": list(event.orientations), "local": event.local,
            "tensors": [[name, _dtype_name(t.dtype), list(t.shape)] for name, t in tensors],
            "bytes": sum(t.numel() * t.element_size() for _, t in tensors),
            "logical_shape": None if event.logical_shape is None else list(event.logical_shape),
            "logical_dtype": None if event.logical_dtype is None else _dtype_name(event.logical_dtype),
            "scale_values": [v for t in scales for v in t.detach().reshape(-1).cpu().tolist()] if scales else None,
            "sha1": {name: _sha1(t) for name, t in tensors} if post else None,
        })  # fmt: skip

    def _on_step_end(self, info: StepInfo) -> dict[str, float | None]:
        self._per_step.append({"step": info.step, "pre": self._pre, "post": self._post})
        scalars = {"gathers_pre": self._pre, "gathers_post": self._post}
        self._pre = self._post = 0
        return scalars

    def _payload(self) -> dict[str, Any]:
        return {"per_step": self._per_step, "events": self._events}


# ------------------------------------------------------------------------------------------------
# Step records


class StepRecordProbe(ProbeCallback):
    """Loss, gradient norm, time, tokens and this rank's peak memory per optimizer step (``steps_rank<r>.json``)."""

    kind = "steps"

    def _on_start(self) -> None:
        self._records: list[dict[str, Any]] = []
        self._load_start = _load_average()

    def _on_step_end(self, info: StepInfo) -> dict[str, float | None]:
        peak, source = _peak_memory_bytes(self._device)
        tokens_per_s = info.tokens / info.step_time_s if info.tokens and info.step_time_s > 0 else None
        self._records.append({
            "step": info.step, "loss": info.loss, "grad_norm": info.grad_norm, "step_time_s": info.step_time_s,
            "step_wall_time_s": info.step_wall_time_s, "non_training_s": info.non_training_s, "tokens": info.tokens, "tokens_per_s": tokens_per_s, "peak_memory_bytes": peak,
            "peak_memory_source": source, "micro_batches": info.micro_batches, "skipped": info.skipped,
        })  # fmt: skip
        return {"loss": info.loss, "grad_norm": info.grad_norm, "step_time_s": info.step_time_s,
                "tokens_per_s": tokens_per_s, "peak_memory_bytes": peak}

    def _payload(self) -> dict[str, Any]:
        return {"records": self._records, "threads": _threads(),
                "load_average": {"start": self._load_start, "end": _load_average()}}
