"""In-process single-rank Trainer runs for fast Lightning-layer tests (1-rank gloo group)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lp_lightning.config import FSDP2Config
from lp_lightning.lightning import (
    BF16Plugin,
    DeepSeekV3LM,
    FSDP2Strategy,
    LowPrecisionPlugin,
    PretrainDataModule,
)
from lp_lightning.telemetry import RunSummaryCallback


def fit_tiny(
    root: Path,
    *,
    datamodule: pl.LightningDataModule,
    max_steps: int = 2,
    accumulate_grad_batches: int = 1,
    activation_checkpoint: str = "off",
    plugin: LowPrecisionPlugin | None = None,
    fsdp_config: FSDP2Config | None = None,
    callbacks: list[pl.Callback] | None = None,
    wire: bool = True,
    **trainer_kwargs: Any,
) -> tuple[pl.Trainer, DeepSeekV3LM, dict[str, Any]]:
    """Trains dsv3-tiny for ``max_steps`` in this process; returns trainer, module, run summary.

    ``trainer_kwargs`` add to or replace the Trainer arguments below (e.g. ``accelerator``, ``logger``);
    ``wire`` is the summary's opt-in wire section (on here: the tests read it).
    """
    module = DeepSeekV3LM(
        activation_checkpoint=activation_checkpoint, warmup_steps=1, lr_decay_steps=max(2, max_steps)
    )
    summary = RunSummaryCallback(path=str(root / "run_summary.json"), wire=wire)
    arguments: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "strategy": FSDP2Strategy(fsdp_config),
        "plugins": [plugin or BF16Plugin()],
        "max_steps": max_steps,
        "accumulate_grad_batches": accumulate_grad_batches,
        "use_distributed_sampler": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "logger": False,
        "deterministic": True,
        "default_root_dir": str(root),
        "callbacks": [summary, *(callbacks or [])],
    }
    trainer = pl.Trainer(**{**arguments, **trainer_kwargs})
    trainer.fit(module, datamodule=datamodule)
    assert summary.summary is not None
    return trainer, module, summary.summary


def tiny_datamodule(cache_dir: str, **kwargs: Any) -> PretrainDataModule:
    """Short sequences so a step takes well under a second on one core."""
    defaults = {"seq_len": 32, "global_batch_size": 4, "val_batches": 1}
    return PretrainDataModule(cache_dir=cache_dir, **{**defaults, **kwargs})
