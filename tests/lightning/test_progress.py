"""The step progress bars on a real Trainer (BoringModel on CPU, seconds per fit).

Each fit records, after every micro-batch, what the training bar shows (n, total, description)
next to ``trainer.global_step``; the checks are on those records, the resume from a mid-epoch
Lightning checkpoint and the metrics shown.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

from lp_lightning.lightning import progress
from lp_lightning.lightning.progress import StepRichProgressBar, StepTQDMProgressBar, default_progress_bar

BARS = [StepTQDMProgressBar, StepRichProgressBar]


def _shown(bar: StepTQDMProgressBar | StepRichProgressBar) -> tuple[int, float | None, str]:
    """(n, total, description) of the training bar; an unknown total is ``None``."""
    if isinstance(bar, StepTQDMProgressBar):
        tqdm_bar = bar.train_progress_bar
        return int(tqdm_bar.n), tqdm_bar.total, tqdm_bar.desc
    task = bar.train_progress_bar
    total = None if task.total == float("inf") else task.total
    return int(task.completed), total, task.description


class _Recorder(Callback):
    """After the bar's hook, records ``(global_step, n, total, description)`` per micro-batch."""

    def __init__(self, bar: StepTQDMProgressBar | StepRichProgressBar) -> None:
        self.bar = bar
        self.rows: list[tuple[int, int, float | None, str]] = []
        self.metrics: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.rows.append((trainer.global_step, *_shown(self.bar)))
        self.metrics = self.bar.get_metrics(trainer, pl_module)


def _fit(bar_cls: type, root: Path, ckpt_path: str | None = None, **trainer_kwargs: Any) -> tuple[Trainer, _Recorder]:
    bar = bar_cls()
    recorder = _Recorder(bar)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=[bar, recorder],
        logger=CSVLogger(root, name="logs"),
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
        log_every_n_steps=1,
        **trainer_kwargs,
    )
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    return trainer, recorder


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
@pytest.mark.parametrize("bar_cls", BARS, ids=lambda c: c.__name__)
def test_counts_optimizer_steps_with_accumulation_and_resume(bar_cls: type, tmp_path: Path) -> None:
    # 3 optimizer steps of 4 micro-batches; a validation run in between (the bar must survive it).
    common = dict(accumulate_grad_batches=4, val_check_interval=4, limit_val_batches=2)
    trainer, rec = _fit(bar_cls, tmp_path, max_steps=3, **common)
    assert trainer.progress_bar_callback is rec.bar and trainer.logger.version == 0
    assert len(rec.rows) == 12
    # n advances only on the micro-batch that completes an optimizer step: never per micro-batch.
    assert [n for _, n, _, _ in rec.rows] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert all(step == n and total == 3 and desc.strip() == "Step" for step, n, total, desc in rec.rows)
    assert "v_num" not in rec.metrics  # the CSVLogger has a version, but the bar does not show it

    # Resume mid-epoch (batch 12 of 32) and train to step 5: the bar continues at 3, total 5.
    ckpt = tmp_path / "step3.ckpt"
    trainer.save_checkpoint(ckpt)
    trainer, rec = _fit(bar_cls, tmp_path, ckpt_path=str(ckpt), max_steps=5, **common)
    assert trainer.global_step == 5
    assert [n for _, n, _, _ in rec.rows] == [3, 3, 3, 4, 4, 4, 4, 5]
    assert all(step == n and total == 5 for step, n, total, _ in rec.rows)
    assert _shown(rec.bar)[:2] == (5, 5)


@pytest.mark.parametrize("bar_cls", BARS, ids=lambda c: c.__name__)
def test_one_bar_across_epochs_without_max_steps(bar_cls: type, tmp_path: Path) -> None:
    # max_epochs instead of max_steps: the total is unknown and the bar does not restart per epoch.
    _, rec = _fit(bar_cls, tmp_path, max_epochs=2, limit_train_batches=3, limit_val_batches=0)
    assert [n for _, n, _, _ in rec.rows] == [1, 2, 3, 4, 5, 6]
    assert all(total is None for _, _, total, _ in rec.rows)


def test_default_matches_lightnings_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    lightning_default = type(Trainer(accelerator="cpu", logger=False).progress_bar_callback)
    ours = default_progress_bar()
    expected_parent = RichProgressBar if isinstance(ours, StepRichProgressBar) else TQDMProgressBar
    assert issubclass(lightning_default, expected_parent)
    monkeypatch.setattr(progress, "_RICH_AVAILABLE", False)
    assert isinstance(default_progress_bar(), StepTQDMProgressBar)
