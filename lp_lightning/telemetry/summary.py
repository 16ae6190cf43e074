"""``RunSummaryCallback``: times every optimizer step and writes ``run_summary.json``, the
machine-readable summary whose keys are a public contract (later issues add keys, never remove them).

The keys, their types, units and meanings are :class:`~lp_lightning.telemetry.schema.RunSummary`
(docs/run_summary.md is generated from it). ``build_summary`` fills every field of that dataclass,
so a key cannot be added here without its documented field.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import statistics
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lp_lightning.checkpoint.finite import NonFiniteStateError
from lp_lightning.lightning.callbacks import THREADS_DEFAULTED_ENV, PeriodicCheckpoint
from lp_lightning.lightning.precision import FSDP2PrecisionPlugin
from lp_lightning.lightning.preemption import SignalStop, exit_status
from lp_lightning.lightning.strategy import FSDP2Strategy
from lp_lightning.telemetry.loss_plot import finished_line, loss_plot_path, write_loss_plot
from lp_lightning.telemetry.memory_probe import COMPONENTS, SOURCE, TensorMemoryProbe
from lp_lightning.telemetry.profile_probe import ProfilerProbe
from lp_lightning.telemetry.layer_numerics import LayerNumericsProbe
from lp_lightning.telemetry.probes import GEMM_ROLE_KEYS, HighPrecisionGemmProbe, WireRecorder, low_precision_recorders
from lp_lightning.telemetry.schema import RunSummary
from lp_lightning.telemetry.step_clock import StepClock
from lp_lightning.versions import software_versions

__all__ = ["LOSS_MEAN_STEPS", "WARMUP_STEPS", "RunSummaryCallback"]


LOSS_MEAN_STEPS = 10
"""``loss_last_mean`` averages the last this many steps (one batch's loss is noisy)."""

WARMUP_STEPS = 5
"""``step_time_s_steady_median`` leaves out the first this many steps (allocator and thread warm-up,
compilation), at most all but one."""


_NO_TENSOR_MEMORY: dict[str, Any] = {
    **{f"{prefix}{suffix}": None for prefix in ("peak_tensor_bytes", "peak_tensor_bytes_outside_emulation")
       for suffix in ("", "_per_rank", "_by_category")},
    "tensor_memory_source": None,
}
"""The ``peak_tensor_bytes*`` keys of a run without a measured :class:`TensorMemoryProbe` step."""


def _threads() -> dict[str, Any]:
    return {
        "torch_intra_op": torch.get_num_threads(),
        "torch_inter_op": torch.get_num_interop_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "set_by": "lp-lightning default" if os.environ.get(THREADS_DEFAULTED_ENV) else "user",
        "cpu_count": os.cpu_count(),
    }


def _compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (dynamo's ``unique_graphs`` counter)."""
    if "torch._dynamo" not in sys.modules:  # nothing compiled (a BF16 run never imports dynamo)
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _determinism(trainer: pl.Trainer) -> dict[str, Any]:
    strategy = trainer.strategy
    hccl = strategy.hccl_determinism if isinstance(strategy, FSDP2Strategy) else None
    return {
        "algorithms": torch.are_deterministic_algorithms_enabled(),
        "fill_uninitialized_memory": bool(torch.utils.deterministic.fill_uninitialized_memory),
        "hccl": None if hccl is None else hccl.as_dict(),
    }


def _load_average() -> list[float] | None:
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:  # not available on this platform
        return None


def _peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "max_memory_allocated"
    if device.type == "npu":
        import torch_npu  # noqa: PLC0415 - an npu device exists only once torch_npu is imported

        return int(torch_npu.npu.max_memory_allocated(device)), "max_memory_allocated"
    # Linux reports ru_maxrss in KiB (macOS in bytes).
    scale = 1 if sys.platform == "darwin" else 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale, "ru_maxrss"


def _reduce(trainer: pl.Trainer, value: int, op: dist.ReduceOp) -> int:
    """``value`` reduced over the ranks with ``op`` (collective)."""
    if trainer.world_size == 1 or not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=trainer.strategy.root_device)
    dist.all_reduce(tensor, op=op)
    return int(tensor.item())


def _gather(trainer: pl.Trainer, value: int) -> list[int]:
    """``value`` of every rank, in rank order (collective)."""
    if trainer.world_size == 1 or not dist.is_initialized():
        return [value]
    tensor = torch.tensor([value], dtype=torch.int64, device=trainer.strategy.root_device)
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return [int(t.item()) for t in gathered]


def lp_plugin(trainer: pl.Trainer) -> FSDP2PrecisionPlugin | None:
    """The run's lp-lightning precision plugin (``None`` under another plugin: the summary then holds no
    precision state)."""
    plugin = trainer.precision_plugin
    return plugin if isinstance(plugin, FSDP2PrecisionPlugin) else None


def _startup_gate(trainer: pl.Trainer) -> dict[str, Any] | None:
    plugin = lp_plugin(trainer)
    result = None if plugin is None else plugin.gate_result
    return None if result is None else result.as_dict()


def _sharding(trainer: pl.Trainer) -> dict[str, Any] | None:
    strategy = trainer.strategy
    record = strategy.parallelization if isinstance(strategy, FSDP2Strategy) else None
    if record is None:
        return None
    sharding = dataclasses.asdict(record)
    sharding["replicated_low_precision"] = [
        {"fqn": fqn, "reason": reason} for fqn, reason in record.replicated_low_precision
    ]
    return sharding


def _time_shares(trainer: pl.Trainer) -> dict[str, Any] | None:
    """Rank 0's profiled time shares from a :class:`ProfilerProbe` among the callbacks (``None`` without one, or
    before its window closed)."""
    probe = next((c for c in trainer.callbacks if isinstance(c, ProfilerProbe)), None)  # type: ignore[attr-defined]
    result = probe.result if probe is not None else None
    if not result or result.get("source") is None:
        return None
    return {key: result[key] for key in ("window", "source", "source_reason", "shares", "categories_s", "device_s",
                                         "host_shares")}


def _write_wire_trace(trainer: pl.Trainer, wire: Any, summary_path: Path) -> None:
    """``wire_trace_rank<r>.json`` next to the summary, when the wire was recorded (every rank)."""
    if wire is None:
        return
    trace = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "summary": wire.summary(),
        "gathers_per_weight": {k: dict(v) for k, v in sorted(wire.gathers_per_weight.items())},
        "events": wire.trace,
    }
    path = summary_path.parent / f"wire_trace_rank{trainer.global_rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace, indent=1) + "\n")


class RunSummaryCallback(Callback):
    """Times optimizer steps, logs ``tokens_per_s`` and writes ``run_summary.json`` (rank 0).

    Reads the step loss and gradient norm from the LightningModule's ``last_step_loss`` /
    ``last_grad_norm`` (:class:`~lp_lightning.lightning.module.DeepSeekV3LM`) and the precision
    and backend from the precision plugin. The keys: :class:`~lp_lightning.telemetry.schema.RunSummary`.

    Args:
        path: Output file; ``null`` = ``<default_root_dir>/run_summary.json``.
        precision: The run's ``--precision`` value (the CLI fills it in); ``null`` = the precision
            plugin's ``mode``.
        wire: Record what crosses the wire (``--run_summary.wire true``): the ``wire`` section and
            ``wire_trace_rank<r>.json`` (:class:`~lp_lightning.telemetry.probes.WireRecorder`,
            FSDP2's public comm hooks). Off by default: ``wire`` is then ``null`` and no trace is
            written; the st harness turns it on.
        plot: Draw the per-step training loss into ``loss.png`` beside the summary
            (:mod:`~lp_lightning.telemetry.loss_plot`; ``loss_plot`` in the summary).

    At the end of ``fit`` rank 0 prints one line: the steps, loss first -> last, the steady tokens/s
    and where the summary and the plot went.

    Attributes:
        summary: The dict written last (``None`` before the end of ``fit``).
    """

    def __init__(
        self, path: str | None = None, precision: str | None = None, wire: bool = False, plot: bool = True
    ) -> None:
        self.path = path
        self.precision = precision
        self.wire = wire
        self.plot = plot
        self.summary: dict[str, Any] | None = None
        self._finished_line: str | None = None
        self._gemms = self._refresh = self._wire = None
        self._clock = StepClock()
        self._reset(0)

    def _stop_recorders(self) -> None:
        for name in ("_gemms", "_refresh", "_wire"):
            recorder = getattr(self, name, None)
            if recorder is None:
                continue
            if name == "_wire":
                recorder.stop()
            else:
                recorder.__exit__(None, None, None)

    def _reset(self, first_step: int) -> None:
        self._stop_recorders()
        self._gemms: Any = None
        self._refresh: Any = None
        self._wire: Any = None
        self._skipped_at_start = 0
        self._events_at_start = 0
        self._stop: NonFiniteStateError | None = None
        self._signal_stop: SIGTERMException | None = None
        self._first_step = first_step
        self._last_step = first_step
        self._clock.stop()
        self._losses: list[float] = []
        self._grad_norms: list[float | None] = []
        self._step_times: list[float] = []  # training time: wall time less the non-training ranges inside it
        self._wall_times: list[float] = []
        self._non_training: list[float] = []
        self._local_tokens = 0
        self._peak: tuple[list[int], str] = ([], "ru_maxrss")
        self._tensor_memory: dict[str, Any] = {}
        self._load_start: list[float] | None = None
        self._graphs_at_start = _compiled_graphs()
        self._graphs_after_first_step: int | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset(trainer.global_step)
        self._clock = StepClock(trainer.strategy.root_device).start()
        self._load_start = _load_average()
        plugin = lp_plugin(trainer)
        self._skipped_at_start = plugin.optimizer_steps_skipped if plugin is not None else 0
        self._events_at_start = len(plugin.guard.events) if plugin is not None else 0
        if plugin is not None and plugin.policy.enabled:  # bf16 imports nothing of the low-precision stack
            recorders = low_precision_recorders()
            self._gemms = recorders.GemmRoleCounter().__enter__()
            self._refresh = recorders.RefreshCounter().__enter__()
        if self.wire:
            mp_policy = plugin.fsdp_mixed_precision_policy() if plugin is not None else None
            self._wire = WireRecorder(plain_dtype=(mp_policy.param_dtype if mp_policy is not None else None)
                                      or torch.bfloat16)
            self._wire.start(getattr(pl_module, "model", None))

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._wire is not None:
            self._wire.pause()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._wire is not None:
            self._wire.resume()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Stops the recorders; when the non-finite guard or a stop signal stopped the run, writes the summary now.

        Both raise on every rank after the same step, so the summary's collectives are safe here.
        """
        if isinstance(exception, (NonFiniteStateError, SIGTERMException)) and trainer.training:
            if isinstance(exception, NonFiniteStateError):
                self._stop = exception
            else:
                self._signal_stop = exception
            self.on_train_end(trainer, pl_module)
            self.on_fit_end(trainer, pl_module)
            self._print_finished_line()  # Lightning calls no teardown hook after an exception
        self._stop_recorders()
        self._clock.stop()
        self._gemms = self._refresh = self._wire = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._clock.is_open:
            self._clock.open()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._local_tokens += int(batch["input_ids"].numel())
        if trainer.global_step == self._last_step:
            return  # gradient accumulation: the optimizer step is not complete yet
        timed = self._clock.close()
        elapsed = timed.training_s
        self._last_step = trainer.global_step
        loss = getattr(pl_module, "last_step_loss", None)
        if loss is None:
            raise TypeError(
                f"RunSummaryCallback needs a LightningModule that sets `last_step_loss` after each "
                f"optimizer step (DeepSeekV3LM); {type(pl_module).__name__} does not."
            )
        self._losses.append(float(loss))
        grad_norm = getattr(pl_module, "last_grad_norm", None)
        self._grad_norms.append(None if grad_norm is None else float(grad_norm))
        self._step_times.append(elapsed)
        self._wall_times.append(timed.wall_s)
        self._non_training.append(timed.non_training_s)
        if len(self._step_times) == 1:
            self._graphs_after_first_step = _compiled_graphs()
        if self._refresh is not None:
            self._refresh.close_step()
        if self._wire is not None:
            self._wire.close_step()
        tokens_per_step = self._local_tokens * trainer.world_size / len(self._step_times)
        pl_module.log("tokens_per_s", tokens_per_step / elapsed if elapsed > 0 else 0.0, on_step=True, on_epoch=False)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Collectives run here on every rank; the file is written in on_fit_end, after the
        # checkpoint callbacks' on_train_end saved the last checkpoint.
        self._stop_recorders()
        peak, source = _peak_memory_bytes(trainer.strategy.root_device)
        self._peak = (_gather(trainer, peak), source)
        self._tensor_memory = self._gather_tensor_memory(trainer)
        self._local_tokens = _reduce(trainer, self._local_tokens, dist.ReduceOp.SUM)

    def _gather_tensor_memory(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The ``peak_tensor_bytes*`` keys from a :class:`TensorMemoryProbe` among the callbacks (collective)."""
        probe = next((c for c in trainer.callbacks if isinstance(c, TensorMemoryProbe)), None)  # type: ignore[attr-defined]
        if probe is None:
            return dict(_NO_TENSOR_MEMORY)
        result = probe.measurement() or {}
        keys: dict[str, Any] = {"tensor_memory_source": SOURCE}
        for peak, prefix in (("all_ops", "peak_tensor_bytes"), ("outside_emulation", "peak_tensor_bytes_outside_emulation")):
            local = result.get(peak)
            peaks = _gather(trainer, -1 if local is None else local["peak_bytes"])
            parts = {name: _gather(trainer, 0 if local is None else local["by_component"][name])
                     for name in COMPONENTS}
            measured = min(peaks) >= 0  # else some rank measured no step (max_steps <= warmup_steps)
            keys[prefix] = max(peaks) if measured else None
            keys[f"{prefix}_per_rank"] = peaks if measured else None
            keys[f"{prefix}_by_category"] = (
                [{name: parts[name][r] for name in COMPONENTS} for r in range(len(peaks))] if measured else None
            )
        return keys

    def _precision_and_backend(self, trainer: pl.Trainer) -> tuple[str, str]:
        plugin = lp_plugin(trainer)
        precision = self.precision or (plugin.mode if plugin is not None else None) or str(trainer.precision)
        backend = (plugin.backend if plugin is not None else None) or "none"
        return precision, backend

    def build_summary(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The summary dict of the finished ``fit`` call (:class:`~lp_lightning.telemetry.schema.RunSummary`)."""
        precision, backend = self._precision_and_backend(trainer)
        steps = len(self._losses)
        median = statistics.median(self._step_times) if self._step_times else None
        warmup = min(WARMUP_STEPS, steps - 1) if steps > 1 else 0
        steady = statistics.median(self._step_times[warmup:]) if steps else None
        last = self._losses[-LOSS_MEAN_STEPS:]
        tokens = self._local_tokens
        val_loss = trainer.callback_metrics.get("val/loss")
        checkpoints: list[str] = []
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, PeriodicCheckpoint):
                checkpoints.extend(callback.saved)
        return RunSummary(**{
            "precision": precision,
            "backend": backend,
            "startup_gate": _startup_gate(trainer),
            "world_size": trainer.world_size,
            "steps": steps,
            "tokens": tokens,
            "loss_first": self._losses[0] if steps else None,
            "loss_last": self._losses[-1] if steps else None,
            "loss_last_mean": statistics.fmean(last) if last else None,
            "loss_last_mean_steps": len(last),
            "val_loss_last": None if val_loss is None else float(val_loss),
            "tokens_per_s": (tokens / steps / steady) if steps and steady else None,  # warm-up left out
            "step_time_s_median": median,
            "step_time_s_steady_median": steady,
            "warmup_steps_excluded": warmup,
            "threads": _threads(),
            "determinism": _determinism(trainer),
            "compile": {
                "compiled_graphs": _compiled_graphs() - self._graphs_at_start,
                "recompiles_after_first_step": (
                    None if self._graphs_after_first_step is None else _compiled_graphs() - self._graphs_after_first_step
                ),
            },
            "load_average": {"start": self._load_start, "end": _load_average()},
            "peak_memory_bytes": max(self._peak[0], default=0),
            "peak_memory_bytes_per_rank": list(self._peak[0]),
            "peak_memory_source": self._peak[1],
            **(self._tensor_memory or _NO_TENSOR_MEMORY),
            "checkpoints": checkpoints,
            "loss_plot": None,  # rank 0 draws it in on_fit_end
            "versions": software_versions(),
            "global_step": trainer.global_step,
            "first_step": self._first_step,
            "losses": list(self._losses),
            "grad_norms": list(self._grad_norms),
            "step_times_s": list(self._step_times),
            "step_wall_times_s": list(self._wall_times),
            "non_training_s": list(self._non_training),
            "non_training": {
                "timing": "subtracted",
                **self._clock.totals(),
                "steps_with_non_training": [
                    self._first_step + i + 1 for i, seconds in enumerate(self._non_training) if seconds > 0
                ],
            },
            "time_shares": _time_shares(trainer),
            "nonfinite": self._nonfinite(trainer),
            "stop_signal": self._stop_signal(trainer),
            **self._low_precision_sections(trainer),
            "layer_numerics": next((c.summary() for c in trainer.callbacks  # type: ignore[attr-defined]
                                    if isinstance(c, LayerNumericsProbe)), None),
        }).as_dict()

    def _stop_signal(self, trainer: pl.Trainer) -> dict[str, Any] | None:
        stop = self._signal_stop
        if stop is None or isinstance(stop, SignalStop):
            return None if stop is None else stop.as_dict()
        # Lightning's own SIGTERM stop (a Trainer without Preemption): PeriodicCheckpoint saves after this.
        return {"signal": "SIGTERM", "step": trainer.global_step, "checkpoint": None, "saved": False,
                "exit_status": exit_status(15)}

    def _nonfinite(self, trainer: pl.Trainer) -> dict[str, Any] | None:
        plugin = lp_plugin(trainer)
        if plugin is None:
            return None
        guard = plugin.guard
        stopped = None
        if self._stop is not None:
            stopped = self._stop.as_dict()
            if stopped["step"] is None:  # raised by a save: the step it was saving
                stopped["step"] = trainer.global_step
            if stopped["resume_checkpoint"] is None:
                callbacks = trainer.callbacks  # type: ignore[attr-defined]
                saved = [c.last_checkpoint for c in callbacks if isinstance(c, PeriodicCheckpoint)]
                stopped["resume_checkpoint"] = saved[0] if saved else None
        return {
            "max_consecutive_skips": guard.max_consecutive_skips,
            "skipped_steps": int(plugin.optimizer_steps_skipped) - self._skipped_at_start,
            "consecutive_skips": guard.consecutive_skips,
            "skips": [dict(event) for event in guard.events[self._events_at_start:]],
            "stopped": stopped,
        }

    def _low_precision_sections(self, trainer: pl.Trainer) -> dict[str, Any]:
        plugin = lp_plugin(trainer)
        if plugin is None or not plugin.policy.enabled:  # bf16: no low-precision weight, GEMM, refresh or gather
            wire = self._wire.summary() if self._wire is not None else None
            if wire is not None:
                wire = {k: wire[k] for k in ("all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes",
                                             "steps", "bytes_are")}
            return {"low_precision": None, "replacement": None, "sharding": _sharding(trainer),
                    "kernels": None, "refresh": None, "wire": wire}
        report = plugin.replacement_report
        kernels: dict[str, Any] = dict.fromkeys(GEMM_ROLE_KEYS, 0)
        kernels.update(backends={}, formats={}, unlabelled=0)
        if self._gemms is not None:
            kernels.update(self._gemms.roles)
            kernels.update(
                backends=dict(self._gemms.backends), formats=dict(self._gemms.formats), unlabelled=self._gemms.unlabelled
            )
        kernels.update(high_precision_gemms_in_replaced_modules=None, high_precision_gemms_elsewhere=None)
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, HighPrecisionGemmProbe):
                kernels.update(callback.summary())
        refreshes = plugin.refreshes
        refresh = {
            "per_step": list(self._refresh.per_step) if self._refresh is not None else [0] * len(self._losses),
            "per_weight_per_step": {
                "min": self._refresh.min_per_weight if self._refresh is not None else None,
                "max": self._refresh.max_per_weight if self._refresh is not None else None,
            },
            "weights": len(plugin.low_precision_weights),
            "skipped_steps": plugin.optimizer_steps_skipped - self._skipped_at_start,
            "startup": refreshes.get("startup", 0),
            "resume": refreshes.get("resume", 0),
        }
        return {
            "low_precision": plugin.policy.as_dict(),
            "replacement": report.as_dict() if report is not None else None,
            "sharding": _sharding(trainer),
            "kernels": kernels,
            "refresh": refresh,
            "wire": self._wire.summary() if self._wire is not None else None,
        }

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clock.stop()  # after the checkpoint callbacks' on_train_end: their last save is in the totals
        self.summary = self.build_summary(trainer)
        path = Path(self.path) if self.path is not None else Path(trainer.default_root_dir) / "run_summary.json"
        _write_wire_trace(trainer, self._wire, path)
        if trainer.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            if self.plot and self.summary["steps"]:
                self.summary["loss_plot"] = self._write_loss_plot(path)
            path.write_text(json.dumps(self.summary, indent=2) + "\n")
            self._finished_line = finished_line(self.summary, path)  # printed by teardown, after the progress bar

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._print_finished_line()

    def _print_finished_line(self) -> None:
        if self._finished_line is not None:
            rank_zero_info(self._finished_line)
            self._finished_line = None

    def _write_loss_plot(self, summary_path: Path) -> str | None:
        """``loss.png`` beside the summary; a plot that cannot be drawn costs one warning, not the finished run."""
        plot = loss_plot_path(summary_path)
        try:
            return str(write_loss_plot(self.summary or {}, plot))
        except Exception as err:  # noqa: BLE001 - matplotlib missing or broken, a full disk: the run itself is done
            rank_zero_warn(f"run_summary: the loss plot {str(plot)!r} was not written ({type(err).__name__}: {err}); "
                           "run_summary.json holds the losses. Pass --run_summary.plot false to skip it.")
            return None
