"""Progress bars that count the run's optimizer steps: ``Step ━━━━ 23/40``.

``lp-lightning fit`` stops on ``trainer.max_steps`` and leaves ``max_epochs`` unset (Lightning
then stores ``max_epochs=-1``). Lightning's own bars count the micro-batches of the current
epoch, which in this setting reads wrong:

* the description is ``Epoch 0/-2`` (``max_epochs - 1``);
* after ``--ckpt_path`` the batch index continues from the checkpoint while the total is the
  *remaining* batches (``6/2``), and with ``accumulate_grad_batches: 4`` the bar counts
  micro-batches against a total of optimizer steps (``8/2``);
* ``v_num`` (the logger version, an int) is printed with the rich bar's ``.3f`` metric format
  (``v_num: 0.000``).

The subclasses here keep Lightning's bars (columns, themes, validation bar, metrics) and change
only the training bar: description ``Step``, ``n = trainer.global_step`` (so it continues after a
resume), ``total = trainer.max_steps``, advanced once per optimizer step (on the micro-batch whose
``on_train_batch_end`` sees ``global_step`` change), one bar for the whole run instead of one per
epoch, and no ``v_num``. With ``max_steps`` unset (``-1``) the total is unknown (``--``).

Which one: :func:`default_progress_bar` makes the same choice as Lightning's default
(``lightning/pytorch/trainer/connectors/callback_connector.py::_configure_progress_bar``:
``RichProgressBar`` when ``rich`` is importable, else ``TQDMProgressBar``). ``rich`` comes with
``transformers`` (through ``typer``), so a plain ``pip install -e .`` gets the rich bar.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBarTheme
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

__all__ = ["StepRichProgressBar", "StepTQDMProgressBar", "default_progress_bar"]


def _max_steps(trainer: pl.Trainer) -> int | None:
    """``trainer.max_steps``, or ``None`` when it is unset (Lightning stores ``-1``)."""
    return trainer.max_steps if trainer.max_steps > 0 else None


class _OptimizerStepBar(ProgressBar):
    """What both step bars share: the description, the once-per-step test and the metrics."""

    _shown_step: int | None = None

    @property
    @override
    def train_description(self) -> str:
        return "Step"

    def _is_new_step(self, trainer: pl.Trainer) -> bool:
        """``True`` once per optimizer step: when ``global_step`` differs from the one shown."""
        if trainer.global_step == self._shown_step:
            return False  # inside gradient accumulation
        self._shown_step = trainer.global_step
        return True

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """Lightning's metrics without ``v_num`` (the logger version; the CSV folder shows it)."""
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items


class StepTQDMProgressBar(_OptimizerStepBar, TQDMProgressBar):
    """``TQDMProgressBar`` whose training bar counts optimizer steps of the whole run.

    The rate and the remaining time count only the steps of this ``fit`` call (tqdm's
    ``initial`` is the restored ``global_step``).

    Args:
        refresh_rate: Redraw the training bar every ``refresh_rate`` optimizer steps (and at the
            last one); the validation bar every ``refresh_rate`` batches. ``0`` disables the bars.
        process_position: Vertical offset of the bars, for several trainers in one terminal.
    """

    def __init__(self, refresh_rate: int = 1, process_position: int = 0) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=False)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)  # creates the bar, described by train_description
        bar = self.train_progress_bar
        bar.reset()
        bar.total = _max_steps(trainer)
        bar.initial = bar.n = self._shown_step = trainer.global_step
        bar.refresh()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        """Nothing: one bar spans all epochs (Lightning's resets it to the epoch's batches)."""

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        if not self._is_new_step(trainer) or self.is_disabled:
            return
        step, bar = trainer.global_step, self.train_progress_bar
        if step % self.refresh_rate == 0 or step == bar.total:
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # redraws


class StepRichProgressBar(_OptimizerStepBar, RichProgressBar):
    """``RichProgressBar`` whose training bar counts optimizer steps of the whole run.

    The speed column (``it/s``) is optimizer steps per second of this ``fit`` call.

    Args:
        refresh_rate: Redraws per second; ``0`` disables the bars.
        theme: Colours and the metrics format (``RichProgressBarTheme``).
        console_kwargs: Keyword arguments of ``rich.console.Console``.
    """

    def __init__(
        self,
        refresh_rate: int = 100,
        theme: RichProgressBarTheme = RichProgressBarTheme(),
        console_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=False, theme=theme, console_kwargs=console_kwargs)

    def _add_train_task(self, trainer: pl.Trainer) -> None:
        assert self.progress is not None
        total = _max_steps(trainer)
        # Padded to the validation bar's description so the columns do not jump (as Lightning does).
        description = f"{self.train_description:<{len(self.validation_description)}}"
        self.train_progress_bar_id = self.progress.add_task(
            description, total=float("inf") if total is None else total, completed=trainer.global_step
        )
        self._shown_step = trainer.global_step

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Adds the training bar in the first epoch; later epochs keep it (no per-epoch reset)."""
        if self.is_disabled or self.progress is None:
            return
        if self.train_progress_bar_id is None:
            self._add_train_task(trainer)
        self.refresh()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        if self.is_disabled or self.progress is None:
            return
        if self.train_progress_bar_id is None:
            self._add_train_task(trainer)
        if not self._is_new_step(trainer):
            return
        self.progress.update(self.train_progress_bar_id, completed=trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()


def default_progress_bar() -> StepRichProgressBar | StepTQDMProgressBar:
    """The step bar matching Lightning's default: rich when ``rich`` is installed, else tqdm."""
    return StepRichProgressBar() if _RICH_AVAILABLE else StepTQDMProgressBar()
