"""The common driver of the probe callbacks (:mod:`lp_lightning.telemetry.probe_callbacks`).

:class:`ProbeCallback` numbers the optimizer steps (the global step after each), decides which are
sampled, turns the Trainer's hooks and the Fabric loop's ``fabric.call`` hooks into one sequence
(start, step start, micro-batch end, step end, end), sends each probe's scalars to the loggers
and writes its JSON file. The probes and the file formats are described in
:mod:`lp_lightning.telemetry.probe_callbacks`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from typing_extensions import override

from lp_lightning.lightning.precision import FSDP2PrecisionPlugin
from lp_lightning.telemetry.probes import low_precision_recorders
from lp_lightning.telemetry.step_clock import StepClock

__all__ = ["ProbeCallback", "StepInfo"]


@dataclass(frozen=True)
class StepInfo:
    """What the base class knows about an optimizer step when it closes (passed to ``_on_step_end``).

    ``step_time_s`` is the training time: ``step_wall_time_s`` less the ``non_training_s`` inside the
    step (:class:`~lp_lightning.telemetry.step_clock.StepClock`).
    """

    step: int
    loss: float | None
    grad_norm: float | None
    tokens: int | None
    micro_batches: int
    step_time_s: float
    skipped: bool | None
    step_wall_time_s: float = 0.0
    non_training_s: float = 0.0


def _float(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        value = value.detach()
    return None if value is None else float(value)


class ProbeCallback(Callback):
    """Common driver of the probes: step numbering, sampling, Trainer and Fabric hooks, the JSON file.

    Subclasses set ``kind`` and override ``_on_start`` (register observers and hooks with
    :meth:`_keep`), ``_on_step_start``, ``_on_micro_batch_end``, ``_on_step_end`` (returns scalars
    to log), ``_on_stop`` (anything else to close; the kept handles are removed after it) and
    ``_payload`` (their part of the file, see :mod:`lp_lightning.telemetry.probe_callbacks`).

    Args:
        out_dir: Folder of the JSON files; ``null`` = ``<trainer.default_root_dir>/probes``.
        sample_every: A step is sampled when it is the first of the call or a multiple of this.

    Attributes:
        path: The file written by the last run (``None`` before).
        result: The dict written there.

    Raises:
        ValueError: ``sample_every`` is not an int >= 1.
    """

    kind: ClassVar[str] = ""

    def __init__(self, out_dir: str | None = None, sample_every: int = 10) -> None:
        if isinstance(sample_every, bool) or not isinstance(sample_every, int) or sample_every < 1:
            raise ValueError(
                f"{type(self).__name__}: sample_every={sample_every!r} must be an int >= 1 (1 samples every step)."
            )
        self.out_dir = out_dir
        self.sample_every = sample_every
        self.path: Path | None = None
        self.result: dict[str, Any] | None = None
        self._plugin: FSDP2PrecisionPlugin | None = None
        self._model: nn.Module | None = None
        self._dir: Path | None = None
        self._log: Callable[[dict[str, float], int], None] | None = None
        self._low_precision = False
        self._driver = "trainer"
        self._step: int | None = None
        self._sampled = self._paused = False
        self._handles: list[Any] = []
        self._clock = StepClock()

    # -- state shared by the probes ------------------------------------------------------------
    @property
    def in_step(self) -> bool:
        """An optimizer step is open and not paused (events are attributed to it)."""
        return self._step is not None and not self._paused

    @property
    def sampled(self) -> bool:
        """The open step is sampled."""
        return self._sampled and self.in_step

    def _recorders(self) -> Any:
        """:mod:`~lp_lightning.telemetry.low_precision_recorders` (the low-precision event hooks) in a low-precision
        run, else None (a bf16 run imports nothing low-precision)."""
        return low_precision_recorders() if self._low_precision else None

    def _begin(self, *, model: nn.Module | None, rank: int, world_size: int, out_dir: Path, plugin: Any,
               global_step: int, device: torch.device, log: Callable[[dict[str, float], int], None] | None,
               driver: str) -> None:
        self._stop_all()
        self._model, self._rank, self._world_size, self._dir = model, rank, world_size, out_dir
        # The lp-lightning plugin, read through its typed attributes (None under another plugin).
        self._plugin = plugin if isinstance(plugin, FSDP2PrecisionPlugin) else None
        self._device, self._log, self._driver = device, log, driver
        self._low_precision = (self._plugin.policy.enabled if self._plugin is not None
                               else "lp_lightning.ops.trace" in sys.modules)
        self._first_step: int | None = None
        self._start_global_step = global_step
        self._steps, self._sampled_steps = 0, []
        self._step, self._sampled, self._paused = None, False, False
        self._micro, self._local_tokens, self._skipped_before = 0, 0, 0
        self._clock = StepClock(device).start()
        self._on_start()

    def _open_step(self, done: int) -> None:
        number = done + 1
        if self._first_step is None:
            self._first_step = number
        self._step, self._global_before = number, done
        self._sampled = number == self._first_step or number % self.sample_every == 0
        self._micro, self._local_tokens = 0, 0
        self._skipped_before = self._plugin.optimizer_steps_skipped if self._plugin is not None else None
        self._clock.open()
        self._on_step_start()

    def _close_step(self, *, loss: Any, grad_norm: Any, tokens: int | None) -> None:
        assert self._step is not None
        timed = self._clock.close()
        skipped_now = self._plugin.optimizer_steps_skipped if self._plugin is not None else None
        skipped = None if skipped_now is None or self._skipped_before is None else skipped_now > self._skipped_before
        info = StepInfo(self._step, _float(loss), _float(grad_norm), tokens, self._micro, timed.training_s, skipped,
                        step_wall_time_s=timed.wall_s, non_training_s=timed.non_training_s)
        scalars = self._on_step_end(info)
        if self._sampled:
            self._sampled_steps.append(self._step)
        self._steps += 1
        self._step = None
        if scalars and self._log is not None:
            self._log({f"probe/{k}": float(v) for k, v in scalars.items() if v is not None}, info.step)

    def _keep(self, handle: Any) -> Any:
        """Remember an observer or hook handle (``.remove()``) to remove when the probe stops."""
        self._handles.append(handle)
        return handle

    def _release(self) -> None:
        """Remove every kept handle (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _stop_all(self) -> None:
        if self._dir is not None:
            self._on_stop()
        self._release()
        self._clock.stop()

    def _finish(self) -> None:
        if self._dir is None:
            raise RuntimeError(
                f"{type(self).__name__}: the probe was never started; with Fabric call "
                "fabric.call('on_probe_start', model=..., fabric=fabric, out_dir=...) before the first step."
            )
        self._on_stop()
        self._release()
        self._clock.stop()
        self._step = None
        payload = {
            "kind": self.kind,
            "rank": self._rank,
            "world_size": self._world_size,
            "first_step": self._first_step if self._first_step is not None else self._start_global_step + 1,
            "steps": self._steps,
            "sample_every": self.sample_every,
            "sampled_steps": list(self._sampled_steps),
            **self._payload(),
        }
        self._dir.mkdir(parents=True, exist_ok=True)
        self.path = self._dir / f"{self.kind}_rank{self._rank}.json"
        self.path.write_text(json.dumps(payload, indent=1) + "\n")
        self.result = payload
        self._dir = None

    # -- subclass hooks ------------------------------------------------------------------------------
    def _on_start(self) -> None:
        """Register observers (the run's modules are known: ``self._model``, ``self._plugin``)."""

    def _on_step_start(self) -> None:
        """An optimizer step opened (``self._step``, ``self.sampled``)."""

    def _on_micro_batch_end(self, completes_step: bool) -> None:
        """A micro-batch ended (Trainer only); ``completes_step``: its optimizer step ran."""

    def _on_step_end(self, info: StepInfo) -> dict[str, float | None]:
        """The step closed; returns the scalars to log (without the ``probe/`` prefix)."""
        return {}

    def _on_stop(self) -> None:
        """Close what the probe opened besides kept handles (idempotent)."""

    def _payload(self) -> dict[str, Any]:
        """The probe's keys of the JSON file."""
        return {}

    # -- Trainer hooks -------------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loggers = list(trainer.loggers)

        def log(scalars: dict[str, float], step: int) -> None:
            for logger in loggers:
                logger.log_metrics(scalars, step=step)

        out = Path(self.out_dir) if self.out_dir is not None else Path(trainer.default_root_dir) / "probes"
        self._begin(model=pl_module, rank=trainer.global_rank, world_size=trainer.world_size, out_dir=out,
                    plugin=trainer.precision_plugin, global_step=trainer.global_step,
                    device=trainer.strategy.root_device, log=log if loggers else None, driver="trainer")

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._step is None:
            self._open_step(trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._step is None:
            return
        ids = batch.get("input_ids") if isinstance(batch, dict) else None
        if isinstance(ids, torch.Tensor):
            self._local_tokens += int(ids.numel())
        self._micro += 1
        completes = trainer.global_step != self._global_before
        self._on_micro_batch_end(completes)
        if completes:
            tokens = self._local_tokens * self._world_size if self._local_tokens else None
            self._close_step(loss=getattr(pl_module, "last_step_loss", None),
                             grad_norm=getattr(pl_module, "last_grad_norm", None), tokens=tokens)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._paused = True

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._paused = False

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_all()

    # -- Fabric hooks (fabric.call) -----------------------------------------------------------------
    def on_probe_start(self, model: nn.Module | None = None, rank: int | None = None, world_size: int | None = None,
                       out_dir: str | None = None, fabric: Any = None, global_step: int = 0) -> None:
        """Start observing a Fabric run (see the module docstring).

        Args:
            model: The model (``fabric.setup_module``'s result).
            rank, world_size: This process's global rank and the world size (default: ``fabric``'s).
            out_dir: Folder of the JSON files (default: the ``out_dir`` given at construction).
            fabric: The ``Fabric``: scalars go to ``fabric.log_dict``, the precision plugin is read.
            global_step: Optimizer steps done before this run (a resumed run).

        Raises:
            ValueError: no ``out_dir`` here nor at construction, or no rank without ``fabric``.
        """
        folder = out_dir if out_dir is not None else self.out_dir
        if folder is None:
            raise ValueError(f"{type(self).__name__}.on_probe_start: pass out_dir=... (here or to the constructor).")
        if fabric is None and (rank is None or world_size is None):
            raise ValueError(f"{type(self).__name__}.on_probe_start: pass fabric=fabric or both rank= and world_size=.")
        if fabric is not None:
            device = fabric.device
        else:
            device = next(iter(model.parameters()), torch.empty(0)).device if model is not None else torch.device("cpu")
        log = (lambda scalars, step: fabric.log_dict(scalars, step=step)) if fabric is not None else None
        self._begin(model=model, rank=fabric.global_rank if rank is None else rank,
                    world_size=fabric.world_size if world_size is None else world_size, out_dir=Path(folder),
                    plugin=fabric.strategy.precision if fabric is not None else None, global_step=global_step,
                    device=device, log=log, driver="fabric")

    def on_probe_step_start(self, step: int) -> None:
        """An optimizer step begins; ``step`` = optimizer steps done before it (0 for the first)."""
        self._open_step(int(step))

    def on_probe_step_end(self, step: int, loss: Any = None, grad_norm: Any = None, tokens: int | None = None,
                          micro_batches: int = 1) -> None:
        """The step ``step`` ended (after its optimizer step); ``tokens``: its global tokens.

        Raises:
            ValueError: no step is open, or it was opened with another ``step``.
        """
        if self._step is None or self._step != int(step) + 1:
            raise ValueError(
                f"{type(self).__name__}.on_probe_step_end(step={step}): the open step is {self._step}; call "
                "on_probe_step_start(step=...) with the same step first."
            )
        self._micro = int(micro_batches)
        self._close_step(loss=loss, grad_norm=grad_norm, tokens=None if tokens is None else int(tokens))

    def on_probe_end(self) -> None:
        """Stop observing and write the file.

        Raises:
            RuntimeError: ``on_probe_start`` was not called.
        """
        self._finish()
