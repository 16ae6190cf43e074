"""Peak live tensor bytes per rank and per category over the measured steps: ``tensor_memory_rank<r>.json``.

:class:`TensorMemoryProbe` (a :class:`~lp_lightning.telemetry.probe_base.ProbeCallback`) measures
the memory the training state and the step's tensors occupy, the same way for bf16 and 8-bit runs
and on any device: the bytes of the **live untyped storages** of the rank's tensors, each storage
counted once however many views, parameters or tensor-subclass wrappers (a
``QuantizedWeightTensor``'s FP32 master and its 8-bit storage, a ``GatheredWeightTensor``'s
gathered buffers, FSDP2's ``DTensor`` shards) share it. It is not the process RSS of
``peak_memory_bytes`` (Python, libraries, allocator caches and fragmentation are not in it) and, on
a device, not ``max_memory_allocated`` (no allocator rounding or caching is added).

The tracker is PyTorch's ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` (torch
2.13): a ``TorchDispatchMode`` that records the storage of every op result (descending into
traceable tensor subclasses through ``__tensor_flatten__``), follows FSDP2's ``storage.resize_``
of unsharded buffers, drops a storage when it is freed (weak references), and seeds itself on
entry with the sharded parameters, their gradients, the buffers and the optimizer state. It
labels every storage with a category: ``Sharded Param``, ``Unsharded Param``, ``Buffer``,
``Sharded Grad``, ``Unsharded Grad``, ``Activation``, ``Temp`` (backward temporaries such as
activation gradients), ``All Gather``, ``Reduce Scatter``, ``OptState`` (including temporaries of
``optimizer.step``), ``Inputs`` (the batch). The probe enters it at the start of every optimizer
step and leaves it after the step (optimizer step and low-precision refresh included); it clears the
tracker's per-module statistics before each forward of the root module (the tracker refuses a second
root forward otherwise: gradient accumulation) and re-labels a low-precision weight's new storage as
``Sharded Param`` after each refresh (through the public refresh observers). The probe's subclass of
the tracker (``_Tracker``) only adds the two peaks below to it.

**Two peaks** per step, each the largest sum of live storages seen after an op:

- ``all_ops``: after every op;
- ``outside_emulation``: after the ops outside the backend calls of the ops layer (``quantize``,
  ``quantize_dual``, ``low_precision_matmul``, ``low_precision_grouped_matmul``; told by
  ``lp_lightning.ops.add_range_observer``). Their results are counted from the op after the call
  on; the working buffers they allocate and free inside (the emulated codec's FP32/int
  intermediates, the emulated GEMM's decoded FP32 operands) are not. These buffers belong to the
  CPU emulation, not to the training state: an NPU quantises and multiplies in fused kernels with
  their own workspace. In bf16 the two peaks are equal.

A ``TorchDispatchMode`` disables ``torch.compile``, so while the probe runs the codec kernels run
their eager reference (bit-identical results); the probe turns the fused kernels off itself for the
run and restores the setting. The eager kernels' working buffers are several times the fused
ones' (HiF8 encode of a grouped weight: about 85 bytes per element eager, 9 fused; MXFP8: 18 and 6,
``torch.profiler`` memory timeline), which is why ``all_ops`` is not a production figure for 8-bit
runs and ``outside_emulation`` is the one to compare with a memory plan.

``phase`` says where a peak was: ``forward`` (inside the FSDP2 root module's forward),
``backward`` (the autograd backward, the loss's included), ``optimizer_step``,
``after_optimizer_step`` (the low-precision refresh), ``other`` (the loss computed outside the root
module, gradient clipping, ``zero_grad``).

**Measured steps.** Steps ``warmup_steps + 1`` … of the fit call (default: all but the first: the
first optimizer step allocates the AdamW moments). Warm-up steps are tracked too (what they
allocate and keep is counted later) but their peaks are not used. With Fabric the optimizer is
found when it first steps (``torch.optim`` step hooks) and its state is labelled ``OptState`` from
the next step on (until then, as what allocated it).

**Components.** ``by_component`` maps the categories onto the memory planner's components: master
= ``Sharded Param`` minus the rank's low-precision storage (FP32 masters and the plain sharded
parameters), ``low_precision_storage`` = the built 8-bit data and scales of this rank's weights
(FSDP2 parameters), ``optimizer`` = ``OptState``, ``gradients`` = ``Sharded Grad``,
``all_gather_buffers`` = ``Unsharded Param`` + ``All Gather``, ``unsharded_gradients`` =
``Unsharded Grad`` + ``Reduce Scatter``, ``activations`` = ``Activation`` + ``Temp`` + ``Inputs``
(saved activations, backward, loss and refresh temporaries), ``buffers`` = ``Buffer``.

**Limits.** Tensors created outside the tracked steps and not held by the parameters, gradients,
buffers or optimizer are not seen (none besides the previous batch in a DeepSeek run:
``tests/telemetry/test_memory_probe.py`` checks the tracker against every tensor the garbage
collector sees). Steps run several times slower under the mode: measure a few steps, not a long run.

File keys (besides the common ones of :mod:`~lp_lightning.telemetry.probe_callbacks`):
``source``, ``counted`` (the sentence above), ``warmup_steps``, ``device``, ``per_step``
``[{"step", "end_bytes", "measured", "all_ops_bytes", "all_ops_phase", "outside_emulation_bytes",
"outside_emulation_phase"}]`` (``end_bytes``: live bytes when the step closed: masters, 8-bit
storage, moments, the step's gradients), and for each peak (``all_ops``, ``outside_emulation``)
``{"peak_bytes", "peak_step", "phase", "by_category" (the tool's categories at that peak),
"by_component", "low_precision_storage_bytes"}`` over the measured steps (``null`` values if none
ran).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook
from typing_extensions import override

from lp_lightning.telemetry.probe_base import ProbeCallback, StepInfo

__all__ = ["COMPONENTS", "COUNTED", "PEAKS", "SOURCE", "TensorMemoryProbe", "components_of"]

SOURCE = "torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker"
"""The tracker behind the numbers (``tensor_memory_source`` of ``run_summary.json``)."""

COUNTED = (
    "live untyped tensor storages of this rank, each storage once (views, parameters and tensor-subclass "
    "inner tensors share it); no allocator caching or rounding, no Python objects, no RSS"
)
"""What ``peak_bytes`` counts."""

COMPONENTS: tuple[str, ...] = (
    "master", "low_precision_storage", "optimizer", "gradients", "all_gather_buffers", "unsharded_gradients",
    "activations", "buffers",
)
"""The keys of ``by_component`` (the first seven are the memory planner's components)."""

_COMPONENT_OF_CATEGORY = {
    "Sharded Param": "master",
    "Unsharded Param": "all_gather_buffers",
    "All Gather": "all_gather_buffers",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "unsharded_gradients",
    "Reduce Scatter": "unsharded_gradients",
    "OptState": "optimizer",
    "Activation": "activations",
    "Temp": "activations",
    "Inputs": "activations",
    "Buffer": "buffers",
}
PEAKS: tuple[str, ...] = ("all_ops", "outside_emulation")
"""The two peaks of a step: over every op, and over the ops outside the emulated low-precision
backend calls (module docstring, **Two peaks**)."""

_SHARDED_PARAM = "Sharded Param"
_TOTAL = "Total"


def components_of(by_category: dict[str, int], low_precision_storage_bytes: int) -> dict[str, int]:
    """The planner's components from the tracker's categories (module docstring, **Components**).

    Raises:
        ValueError: an unknown category, or more low-precision storage than ``Sharded Param`` bytes.
    """
    out = dict.fromkeys(COMPONENTS, 0)
    for category, value in by_category.items():
        if category == _TOTAL:
            continue
        if category not in _COMPONENT_OF_CATEGORY:
            raise ValueError(f"components_of: unknown tracker category {category!r}; known: "
                             f"{sorted(_COMPONENT_OF_CATEGORY)}.")
        out[_COMPONENT_OF_CATEGORY[category]] += value
    if low_precision_storage_bytes > by_category.get(_SHARDED_PARAM, 0):
        raise ValueError(
            f"components_of: low-precision storage {low_precision_storage_bytes} B exceeds the tracked "
            f"'Sharded Param' {by_category.get(_SHARDED_PARAM, 0)} B; the weights were not tracked as parameters."
        )
    out["master"] -= low_precision_storage_bytes
    out["low_precision_storage"] = low_precision_storage_bytes
    return out


def _label(key: Any) -> str:
    return str(getattr(key, "value", key))


def _fsdp_root(model: nn.Module | None) -> FSDPModule:
    for module in model.modules() if model is not None else ():
        if isinstance(module, FSDPModule):
            return module  # modules() is pre-order: the first is the outermost
    raise ValueError(
        f"TensorMemoryProbe: no FSDP2 module (fully_shard) in {type(model).__name__}; train with "
        "FSDP2Strategy / FSDP2FabricStrategy (the probe measures FSDP2 ranks)."
    )


class _Tracker(FSDPMemTracker):
    """``FSDPMemTracker`` that keeps, per entry, the peak over all ops and the peak over the ops
    outside the emulated low-precision backend calls, each with its phase and categories."""

    def __init__(self, root: FSDPModule, optimizer: torch.optim.Optimizer | None, device: torch.device) -> None:
        super().__init__(root, optimizer)
        self.device = device
        self.emulation_depth = 0
        self.after_optimizer_step = False
        self.peaks: dict[str, tuple[int, str, dict[str, int]]] = {}

    def _phase(self) -> str:
        if self._in_opt:
            return "optimizer_step"
        if self.after_optimizer_step:
            return "after_optimizer_step"
        if self._mod_tracker.is_bw:
            return "backward"
        root = self._mod_tracker.get_known_fqn(self._root_mod)
        return "forward" if root is not None and root in self._mod_tracker.parents else "other"

    def _update_peak_stats(self, peak_state: Any) -> None:
        super()._update_peak_stats(peak_state)
        snapshot = self._curr_mem_snap.get(self.device)
        if snapshot is None:
            return
        total = snapshot[_TOTAL]
        for key in PEAKS if self.emulation_depth == 0 else PEAKS[:1]:
            if total > self.peaks.get(key, (-1,))[0]:
                self.peaks[key] = (total, self._phase(), {_label(k): int(v) for k, v in snapshot.items()})


class TensorMemoryProbe(ProbeCallback):
    """Peak live tensor bytes per rank, by category, over the measured steps (``tensor_memory_rank<r>.json``).

    Args:
        warmup_steps: Steps at the start of the fit call whose peaks are not used (>= 0; 1 leaves
            out the step that allocates the optimizer state).
        out_dir, sample_every: As :class:`~lp_lightning.telemetry.probe_base.ProbeCallback`
            (every step is measured; ``sample_every`` only numbers the sampled steps).

    Raises:
        ValueError: ``warmup_steps`` is not an int >= 0; at the start of training, a model with no
            FSDP2 module; at a step, more than one optimizer.
    """

    kind = "tensor_memory"

    def __init__(self, warmup_steps: int = 1, out_dir: str | None = None, sample_every: int = 10) -> None:
        super().__init__(out_dir=out_dir, sample_every=sample_every)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"TensorMemoryProbe: warmup_steps={warmup_steps!r} must be an int >= 0.")
        self.warmup_steps = warmup_steps
        self._trainer_optimizers: list[torch.optim.Optimizer] = []
        self._tracker: _Tracker | None = None
        self._active = False
        self._best: dict[str, dict[str, Any]] = {}

    # -- what the run summary reads -----------------------------------------------------------
    def measurement(self) -> dict[str, dict[str, Any]] | None:
        """This rank's result so far, ``{peak: {"peak_bytes", "peak_step", "phase", "by_category",
        "by_component"}}`` for each key of :data:`PEAKS`, or ``None`` before a measured step."""
        return {key: dict(value) for key, value in self._best.items()} if self._best else None

    # -- probe hooks ----------------------------------------------------------------------------
    def _on_start(self) -> None:
        self._root = _fsdp_root(self._model)
        self._optimizers: list[torch.optim.Optimizer] = list(self._trainer_optimizers)
        self._tracker, self._active, self._best = None, False, {}
        self._per_step: list[dict[str, Any]] = []
        self._keep(register_optimizer_step_post_hook(self._note_optimizer))
        hooks = self._recorders()
        self._compiled_before: bool | None = None
        if hooks is not None:
            self._keep(hooks.add_refresh_observer(self._relabel_refreshed))
            self._keep(hooks.add_range_observer(self._note_range))
            # A dispatch mode disables torch.compile: say so by running eager.
            self._compiled_before = hooks.compiled_kernels_enabled()
            hooks.set_compiled_kernels(False)

    def _note_optimizer(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if not any(optimizer is known for known in self._optimizers):
            self._optimizers.append(optimizer)
        if self._active and self._tracker is not None:
            self._tracker.after_optimizer_step = True

    def _note_range(self, event: tuple[str, bool]) -> None:
        if self._active and self._tracker is not None:
            self._tracker.emulation_depth += 1 if event[1] else -1

    def _relabel_refreshed(self, weight: Any) -> None:
        if self._active and self._tracker is not None:  # the new 8-bit storage is parameter state
            self._tracker._update_and_maybe_create_winfos(weight, self._sharded_param_type)

    def _tracker_for_step(self) -> _Tracker:
        if len(self._optimizers) > 1:
            raise ValueError(
                f"TensorMemoryProbe: {len(self._optimizers)} optimizers stepped; FSDPMemTracker tracks one. "
                "Use one optimizer (DeepSeekV3LM has one AdamW)."
            )
        optimizer = self._optimizers[0] if self._optimizers else None
        if self._tracker is None:
            self._tracker = _Tracker(self._root, optimizer, self._device)
            self._sharded_param_type = next(t for t in self._tracker._ref_class if t.value == _SHARDED_PARAM)
        elif optimizer is not None and self._tracker._optm is None:
            # Fabric: found at its first step; the tracker labels its state on the next entry and
            # keeps every storage it already tracks (a new tracker would forget them)
            self._tracker._optm = optimizer
        return self._tracker

    def _on_step_start(self) -> None:
        tracker = self._tracker_for_step()
        tracker.reset_mod_stats()
        tracker.peaks, tracker.after_optimizer_step, tracker.emulation_depth = {}, False, 0
        tracker.__enter__()
        self._active = True
        # after the tracker's own (prepended) FSDP hook, so this one runs before it
        self._forward_hook = self._root.register_forward_pre_hook(self._new_root_forward, prepend=True)

    def _new_root_forward(self, *_: Any) -> None:
        assert self._tracker is not None
        self._tracker.reset_mod_stats()  # one more forward of the root in this step (accumulation)

    def _leave(self) -> None:
        if not self._active:
            return
        self._forward_hook.remove()
        assert self._tracker is not None
        self._tracker.__exit__(None, None, None)
        self._active = False

    def track_inputs(self, batch: Any) -> None:
        """Count the tensors of ``batch`` (made by the data loader, outside the tracker) as ``Inputs``."""
        if self._active and self._tracker is not None:
            self._tracker.track_inputs((batch,))

    def _low_precision_storage_bytes(self) -> int:
        hooks = self._recorders()
        if hooks is None:
            return 0
        storages: dict[int, int] = {}
        for param in self._root.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            if hooks.is_low_precision_weight(local):
                for t in local.low_precision_storage.values():
                    storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return sum(storages.values())

    def _on_step_end(self, info: StepInfo) -> dict[str, float | None]:
        self._leave()
        assert self._tracker is not None
        peaks = self._tracker.peaks
        end = self._tracker.get_tracker_snapshot("current").get(self._device, {}).get(_TOTAL, 0)
        measured = self._steps + 1 > self.warmup_steps
        record: dict[str, Any] = {"step": info.step, "end_bytes": end, "measured": measured}
        for key in PEAKS:
            total, phase, _ = peaks.get(key, (0, None, {}))
            record[f"{key}_bytes"], record[f"{key}_phase"] = total, phase
        self._per_step.append(record)
        if measured:
            low = None
            for key, (total, phase, by_category) in peaks.items():
                if key in self._best and total <= self._best[key]["peak_bytes"]:
                    continue
                low = self._low_precision_storage_bytes() if low is None else low
                categories = {k: v for k, v in by_category.items() if k != _TOTAL}
                self._best[key] = {"peak_bytes": total, "peak_step": info.step, "phase": phase,
                                   "by_category": categories, "by_component": components_of(categories, low),
                                   "low_precision_storage_bytes": low}
        return {f"tensor_{key}_peak_bytes": record[f"{key}_bytes"] for key in PEAKS}

    def _on_stop(self) -> None:
        self._leave()
        if getattr(self, "_compiled_before", None) is not None:
            self._recorders().set_compiled_kernels(self._compiled_before)
            self._compiled_before = None

    def _payload(self) -> dict[str, Any]:
        empty = dict.fromkeys(("peak_bytes", "peak_step", "phase", "by_category", "by_component",
                               "low_precision_storage_bytes"))
        return {"source": SOURCE, "counted": COUNTED, "warmup_steps": self.warmup_steps, "device": str(self._device),
                "per_step": self._per_step, **{key: self._best.get(key, empty) for key in PEAKS}}

    # -- Trainer hooks: the optimizer and the batch --------------------------------------------
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer_optimizers = list(trainer.optimizers)
        super().on_train_start(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self.track_inputs(batch)
