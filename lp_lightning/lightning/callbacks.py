"""Callbacks of the pretraining job: periodic DCP checkpoints, the stop on a signal, and the marker of ``fit``'s CPU thread default.

``PeriodicCheckpoint`` saves ``<dirpath>/step-000050/`` DCP folders (see
:mod:`lp_lightning.checkpoint.dcp`) every ``every_n_steps`` optimizer steps and at the end
of training. ``Preemption`` stops every rank at the same optimizer step on SIGTERM, SIGUSR1 or
SIGINT and saves that step (:mod:`lp_lightning.lightning.preemption`). ``run_summary.json`` is
written by :class:`~lp_lightning.telemetry.summary.RunSummaryCallback`.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.callbacks import Callback, Checkpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lp_lightning.checkpoint.finite import NonFiniteStateError
from lp_lightning.lightning.precision import FSDP2PrecisionPlugin
from lp_lightning.lightning.preemption import (
    DEFAULT_TIMEOUT_S,
    SignalStop,
    StopRequest,
    outlive_launcher,
    signal_name,
)
from lp_lightning.observers import non_training

__all__ = ["PeriodicCheckpoint", "Preemption", "checkpoint_dirname"]


def checkpoint_dirname(global_step: int) -> str:
    """Folder name of the checkpoint after ``global_step`` optimizer steps: ``step-000050``."""
    return f"step-{global_step:06d}"


class PeriodicCheckpoint(Checkpoint):
    """Saves a DCP checkpoint every ``every_n_steps`` optimizer steps, at the end and on a stop signal.

    A fresh run (step 0) whose folder already holds ``step-*`` checkpoints of another run gets a
    warning. On a stop signal the step every rank stopped after is saved (:meth:`save_at_stop`,
    called by :class:`Preemption`; Lightning's own SIGTERM stop: :meth:`on_exception`).

    It is a Lightning ``Checkpoint`` callback, so the Trainer adds no default ``ModelCheckpoint``
    next to it. Saving goes through ``trainer.save_checkpoint`` and hence through
    :meth:`~lp_lightning.lightning.strategy.FSDP2Strategy.save_checkpoint` (HF-keyed DCP folder).

    Args:
        every_n_steps: Save after every ``every_n_steps``-th optimizer step; ``0`` saves only at
            the end.
        dirpath: Parent folder of the checkpoints; ``null`` = ``<default_root_dir>/checkpoints``.
        save_last: Also save after the last step of training (when it is not already saved).

    Attributes:
        saved: Checkpoint folders written by this callback during the current ``fit``.
        last_checkpoint: The newest checkpoint of this run: the last one saved, else the one the
            run resumed from (``None`` if neither); named when the non-finite guard stops the run.
    """

    def __init__(self, every_n_steps: int = 50, dirpath: str | None = None, save_last: bool = True) -> None:
        if every_n_steps < 0:
            raise ValueError(f"checkpoint.every_n_steps must be >= 0, got {every_n_steps}.")
        self.every_n_steps = every_n_steps
        self.dirpath = dirpath
        self.save_last = save_last
        self.saved: list[str] = []
        self._last_saved_step: int | None = None
        self._resumed_from: str | None = None

    def _dir(self, trainer: pl.Trainer) -> Path:
        return Path(self.dirpath) if self.dirpath is not None else Path(trainer.default_root_dir) / "checkpoints"

    def _save(self, trainer: pl.Trainer) -> None:
        path = self._dir(trainer) / checkpoint_dirname(trainer.global_step)
        with non_training("checkpoint_save"):  # the state gathering and barrier too: no step time (observers)
            trainer.save_checkpoint(path, weights_only=False)
        self._last_saved_step = trainer.global_step
        self.saved.append(str(path))

    @property
    def last_checkpoint(self) -> str | None:
        return self.saved[-1] if self.saved else self._resumed_from

    def save_at_stop(self, trainer: pl.Trainer, reason: str) -> bool:
        """Saves the current optimizer step unless it is on disk already or is step 0 (collective).

        Call it at a step boundary on every rank (``on_train_batch_end`` of the step's last
        micro-batch). Returns whether it saved; :attr:`last_checkpoint` is then the resume point.
        """
        step = trainer.global_step
        if step == 0 or step == self._last_saved_step:
            return False
        self._save(trainer)
        rank_zero_info(f"{reason}: saved the checkpoint of step {step} to {self.saved[-1]!r}.")
        return True

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.saved = []
        self._last_saved_step = trainer.global_step  # the restored step is already on disk
        restored = getattr(trainer.strategy, "loaded_checkpoint", None) or trainer.ckpt_path
        self._resumed_from = None if restored is None else str(restored)
        folder = self._dir(trainer)
        earlier = sorted(p.name for p in folder.glob("step-*")) if folder.is_dir() else []
        if trainer.global_step == 0 and earlier:
            shown = ", ".join(earlier[:4]) + (f" ... ({len(earlier)} folders)" if len(earlier) > 4 else "")
            rank_zero_warn(
                f"{str(folder)!r} already holds checkpoints of an earlier run ({shown}). This new run "
                f"overwrites folders of the same step and leaves the others, so `--ckpt_path last` could "
                f"later resume the other run. Use a fresh --trainer.default_root_dir, delete them, or "
                f"resume that run with --ckpt_path last."
            )

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """On Lightning's own SIGTERM stop, saves the last completed optimizer step if it is not on disk.

        Under :class:`Preemption` (``lp-lightning fit``) the step was saved before
        :class:`~lp_lightning.lightning.preemption.SignalStop` was raised, and nothing is done here.
        Without it, Lightning raises ``SIGTERMException`` on every rank at the same batch boundary
        (rank 0's signal is broadcast), so the collective save is safe. Mid-accumulation (some
        micro-batches of the next step already ran) nothing is saved — a checkpoint there would
        hold a data position inside a step whose partial gradients are lost — so the resume point
        is the last checkpoint on disk, and the message says which step that is.

        When the non-finite guard stopped the run
        (:class:`~lp_lightning.checkpoint.finite.NonFiniteStateError`), nothing is saved and the
        error is told :attr:`last_checkpoint`, the resume point.
        """
        if isinstance(exception, NonFiniteStateError) and exception.resume_checkpoint is None:
            exception.resume_checkpoint = self.last_checkpoint
        if not isinstance(exception, SIGTERMException) or isinstance(exception, SignalStop) or not trainer.training:
            return
        step = trainer.global_step
        micro_batches_done = trainer.fit_loop.epoch_loop.batch_progress.total.completed
        at_step_boundary = micro_batches_done % trainer.accumulate_grad_batches == 0
        if at_step_boundary:
            self.save_at_stop(trainer, "SIGTERM")
        elif step != self._last_saved_step:
            rank_zero_warn(
                f"SIGTERM inside the gradient accumulation of step {step + 1}: nothing saved; the resume "
                f"point is the last checkpoint on disk (step {self._last_saved_step}), steps after it are "
                f"trained again."
            )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_saved_step:
            return  # inside gradient accumulation, or already saved
        periodic = self.every_n_steps > 0 and step % self.every_n_steps == 0
        last = self.save_last and trainer.max_steps is not None and step >= trainer.max_steps
        if periodic or last:
            self._save(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save_last and trainer.global_step != self._last_saved_step:
            self._save(trainer)


class Preemption(Callback):
    """Stops training on SIGTERM, SIGUSR1 or SIGINT to any rank: every rank after the same optimizer step, saved.

    From ``on_train_start`` (after Lightning registered its own handlers, which its teardown puts
    back) to ``on_train_end``, the stop signals go to the precision plugin's
    :class:`~lp_lightning.lightning.preemption.StopRequest` (the handler records the signal;
    the guard's reduce of each optimizer step tells every rank). At the end of the step whose
    reduce carried a signal, every rank saves that step through :class:`PeriodicCheckpoint` and
    raises :class:`~lp_lightning.lightning.preemption.SignalStop`; ``RunSummaryCallback`` writes
    ``run_summary.json`` on the way out and ``lp-lightning fit`` prints the resume command and
    exits 143 (SIGTERM, SIGUSR1) or 130 (SIGINT). A stop agreed at ``max_steps`` lets the run
    finish. Module docstring of :mod:`lp_lightning.lightning.preemption`: the bounds (a second
    signal, the watchdog, a dead peer).

    Place it after ``RunSummaryCallback`` (the CLI does), whose ``on_train_batch_end`` then records
    the stopping step first. It needs the lp-lightning precision plugin.

    Args:
        timeout_s: A rank still running this many seconds after the first signal it received (or
            after the agreed stop) exits with the stop's status and one line; a step, its save and
            the run summary must fit in it.
    """

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"preemption.timeout_s must be > 0, got {timeout_s}.")
        self.timeout_s = timeout_s
        self._stop: StopRequest | None = None
        self._launcher_parent: int | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plugin = trainer.precision_plugin
        if not isinstance(plugin, FSDP2PrecisionPlugin):
            raise TypeError(
                f"Preemption needs the lp-lightning precision plugin (its optimizer step exchanges the stop "
                f"signal), got {type(plugin).__name__}. Pass plugins=[precision_plugin(...)], or drop Preemption."
            )
        # Lightning's launcher runs ranks > 0 as children of rank 0: such a rank exits after rank 0
        # (outlive_launcher). One broadcast of rank 0's pid, at the start.
        rank0_pid = trainer.strategy.broadcast(os.getpid(), src=0) if trainer.world_size > 1 else os.getpid()
        self._launcher_parent = rank0_pid if trainer.global_rank > 0 and os.getppid() == rank0_pid else None
        self._stop = plugin.stop
        self._stop.install(rank=trainer.global_rank, timeout_s=self.timeout_s)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        signum = None if self._stop is None else self._stop.agreed
        if signum is None:
            return
        if trainer.max_steps is not None and 0 <= trainer.max_steps <= trainer.global_step:
            return  # the last step: the run ends as it would have
        checkpoint = next((c for c in trainer.checkpoint_callbacks if isinstance(c, PeriodicCheckpoint)), None)
        saved = checkpoint is not None and checkpoint.save_at_stop(trainer, signal_name(signum))
        raise SignalStop(signum, step=trainer.global_step, checkpoint=None if checkpoint is None else
                         checkpoint.last_checkpoint, saved=saved)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._stop is not None:
            self._stop.restore()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """After a stop, a child of rank 0 exits only once rank 0 has (``atexit``); other errors put the handlers back.

        On a stop the handlers stay (a second signal still exits at once) until Lightning's teardown
        restores the ones it found.
        """
        if isinstance(exception, SignalStop):
            if self._launcher_parent is not None:
                atexit.register(outlive_launcher, self._launcher_parent)
        elif self._stop is not None:
            self._stop.restore()


THREADS_DEFAULTED_ENV = "LP_LIGHTNING_THREADS_DEFAULTED"
"""Set to ``1`` by the entry point when it chose the CPU thread default (:func:`lp_lightning.cli.default_cpu_threads`);
the rank processes inherit it, and ``run_summary.json`` ``threads.set_by`` reads it."""
