"""Peak live tensor bytes per rank and per category over the measured steps: ``tensor_memory_rank<r>.json``.

:class:`TensorMemoryProbe` (a :class:`~lp_lightning.lightning.probe_base.ProbeCallback`) measures
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
step and leaves it after the step (optimizer step and low-precision refresh included), so the peak
of a step is the largest sum of live storages at any op of that step; it clears the tracker's
per-module statistics before each forward of the root module (the tracker refuses a second root
forward otherwise: gradient accumulation) and re-labels a low-precision weight's new storage as
``Sharded Param`` after each refresh (through the public refresh observers).

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
(saved activations, backward and refresh temporaries), ``buffers`` = ``Buffer``. ``phase`` says
where the step's peak was: ``forward`` / ``backward`` (inside the FSDP2 root module's forward or
backward) or ``outside_forward_backward`` (a loss computed outside the root module and its
backward, gradient clipping, the optimizer step, the refresh).

**Limits.** A ``TorchDispatchMode`` disables ``torch.compile``, so while the probe runs the codec
kernels run their eager reference (bit-identical results; their transient buffers are the eager
kernels', an upper bound for the fused ones); the probe turns the fused kernels off itself for the
run and restores the setting. Tensors created outside the tracked steps and not held by the
parameters, gradients, buffers or optimizer are not seen (none besides the previous batch in a
DeepSeek run: ``tests/lightning/test_memory_probe.py`` checks the tracker against every tensor the
garbage collector sees). Steps run several times slower under the mode: measure a few steps, not a long run.

File keys (besides the common ones of :mod:`~lp_lightning.lightning.probe_callbacks`):
``source``, ``counted`` (the sentence above), ``warmup_steps``, ``device``, ``per_step``
``[{"step", "peak_bytes", "end_bytes", "measured", "phase"}]`` (``end_bytes``: live bytes when the
step closed, e.g. masters, 8-bit storage, moments and the step's gradients), ``peak_bytes`` (max over measured steps,
``null`` if none ran), ``peak_step``, ``phase``, ``by_category`` (the tool's categories at that
peak), ``by_component``, ``low_precision_storage_bytes``.
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

from lp_lightning.lightning.probe_base import ProbeCallback, StepInfo

__all__ = ["COMPONENTS", "COUNTED", "SOURCE", "TensorMemoryProbe", "components_of"]

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


class TensorMemoryProbe(ProbeCallback):
    """Peak live tensor bytes per rank, by category, over the measured steps (``tensor_memory_rank<r>.json``).

    Args:
        warmup_steps: Steps at the start of the fit call whose peaks are not used (>= 0; 1 leaves
            out the step that allocates the optimizer state).
        out_dir, sample_every: As :class:`~lp_lightning.lightning.probe_base.ProbeCallback`
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
        self._tracker: FSDPMemTracker | None = None
        self._active = False
        self._best: dict[str, Any] | None = None

    # -- what the run summary reads -----------------------------------------------------------
    def measurement(self) -> dict[str, Any] | None:
        """This rank's result so far: ``{"peak_bytes", "peak_step", "phase", "by_category",
        "by_component", "low_precision_storage_bytes"}``, or ``None`` before a measured step."""
        return None if self._best is None else dict(self._best)

    # -- probe hooks ----------------------------------------------------------------------------
    def _on_start(self) -> None:
        self._root = _fsdp_root(self._model)
        self._optimizers: list[torch.optim.Optimizer] = list(self._trainer_optimizers)
        self._tracker, self._active = None, False
        self._best = None
        self._per_step: list[dict[str, Any]] = []
        self._keep(register_optimizer_step_post_hook(self._note_optimizer))
        tensor = self._module("lp_lightning.tensor")
        if tensor is not None:
            self._keep(tensor.add_refresh_observer(self._relabel_refreshed))
        formats = self._module("lp_lightning.formats")
        self._compiled_before: bool | None = None
        if formats is not None:  # a dispatch mode disables torch.compile: say so by running eager
            self._compiled_before = formats.compiled_kernels_enabled()
            formats.set_compiled_kernels(False)

    def _note_optimizer(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if not any(optimizer is known for known in self._optimizers):
            self._optimizers.append(optimizer)

    def _relabel_refreshed(self, weight: Any) -> None:
        if self._active and self._tracker is not None:  # the new 8-bit storage is parameter state
            self._tracker._update_and_maybe_create_winfos(weight, self._sharded_param_type)

    def _tracker_for_step(self) -> FSDPMemTracker:
        if len(self._optimizers) > 1:
            raise ValueError(
                f"TensorMemoryProbe: {len(self._optimizers)} optimizers stepped; FSDPMemTracker tracks one. "
                "Use one optimizer (DeepSeekV3LM has one AdamW)."
            )
        optimizer = self._optimizers[0] if self._optimizers else None
        if self._tracker is None:
            self._tracker = FSDPMemTracker(self._root, optimizer)
            self._sharded_param_type = next(t for t in self._tracker._ref_class if t.value == _SHARDED_PARAM)
        elif optimizer is not None and self._tracker._optm is None:
            # Fabric: found at its first step; the tracker labels its state on the next entry and
            # keeps every storage it already tracks (a new tracker would forget them)
            self._tracker._optm = optimizer
        return self._tracker

    def _on_step_start(self) -> None:
        tracker = self._tracker_for_step()
        tracker.reset_mod_stats()
        self._phase_peaks = {"forward": -1, "backward": -1}
        tracker.__enter__()
        self._active = True
        # after the tracker's own (prepended) FSDP hook, so this one runs before it
        self._forward_hook = self._root.register_forward_pre_hook(self._new_root_forward, prepend=True)

    def _harvest_phase_peaks(self) -> None:
        stats = self._tracker.memory_tracking.get(self._root) if self._tracker is not None else None
        if stats is None:
            return
        for state, snapshots in stats.snapshots.items():
            phase = {"Peak Forward": "forward", "Peak Backward": "backward"}.get(_label(state))
            for snapshot in snapshots if phase else ():
                total = snapshot.get(self._device, {}).get(_TOTAL, -1)
                self._phase_peaks[phase] = max(self._phase_peaks[phase], total)

    def _new_root_forward(self, *_: Any) -> None:
        assert self._tracker is not None
        self._harvest_phase_peaks()
        self._tracker.reset_mod_stats()  # one more forward of the root in this step (accumulation)

    def _leave(self) -> None:
        if not self._active:
            return
        self._forward_hook.remove()
        self._harvest_phase_peaks()
        assert self._tracker is not None
        self._tracker.__exit__(None, None, None)
        self._active = False

    def track_inputs(self, batch: Any) -> None:
        """Count the tensors of ``batch`` (made by the data loader, outside the tracker) as ``Inputs``."""
        if self._active and self._tracker is not None:
            self._tracker.track_inputs((batch,))

    def _low_precision_storage_bytes(self) -> int:
        tensor = self._module("lp_lightning.tensor")
        if tensor is None:
            return 0
        storages: dict[int, int] = {}
        for param in self._root.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            if tensor.is_low_precision_weight(local):
                for t in local.low_precision_storage.values():
                    storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return sum(storages.values())

    def _on_step_end(self, info: StepInfo) -> dict[str, float | None]:
        self._leave()
        assert self._tracker is not None
        peak = {_label(k): int(v) for k, v in self._tracker.get_tracker_snapshot("peak").get(self._device, {}).items()}
        total = peak.get(_TOTAL, 0)
        end = self._tracker.get_tracker_snapshot("current").get(self._device, {}).get(_TOTAL, 0)
        phase = next((p for p, v in self._phase_peaks.items() if v == total), "outside_forward_backward")
        measured = self._steps + 1 > self.warmup_steps
        self._per_step.append({"step": info.step, "peak_bytes": total, "end_bytes": end, "measured": measured,
                               "phase": phase})
        if measured and (self._best is None or total > self._best["peak_bytes"]):
            low = self._low_precision_storage_bytes()
            self._best = {
                "peak_bytes": total, "peak_step": info.step, "phase": phase,
                "by_category": {k: v for k, v in peak.items() if k != _TOTAL},
                "by_component": components_of(peak, low), "low_precision_storage_bytes": low,
            }  # fmt: skip
        return {"tensor_peak_bytes": total}

    def _on_stop(self) -> None:
        self._leave()
        if getattr(self, "_compiled_before", None) is not None:
            self._module("lp_lightning.formats").set_compiled_kernels(self._compiled_before)
            self._compiled_before = None

    def _payload(self) -> dict[str, Any]:
        best = self._best or {}
        return {
            "source": SOURCE, "counted": COUNTED, "warmup_steps": self.warmup_steps, "device": str(self._device),
            "per_step": self._per_step, "peak_bytes": best.get("peak_bytes"), "peak_step": best.get("peak_step"),
            "phase": best.get("phase"), "by_category": best.get("by_category"),
            "by_component": best.get("by_component"),
            "low_precision_storage_bytes": best.get("low_precision_storage_bytes"),
        }  # fmt: skip

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
