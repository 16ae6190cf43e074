"""Test-only fault injectors for CLI runs (``--trainer.callbacks+=_faults.PoisonBatches``; ``tests/lightning``
must be on ``PYTHONPATH``). Used by ``tests/lightning/test_faults.py``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback


def _ints(value: str | int) -> set[int]:
    return {int(s) for s in str(value).split(",") if s.strip()}


class PoisonBatches(Callback):
    """Makes the listed optimizer steps see a NaN in their batch: the embedding's output of that step is NaN.

    Token ids cannot hold a NaN, so the fault enters where the batch becomes numbers (a forward hook on
    ``model.embed_tokens``); the loss, and every gradient, of that step is then NaN.

    Args:
        steps: 1-based optimizer steps to poison (comma-separated, e.g. ``"2,3"``).
        ranks: Ranks whose batch is poisoned (comma-separated); empty = every rank.
    """

    def __init__(self, steps: str = "", ranks: str = "") -> None:
        self.steps = _ints(steps)
        self.ranks = _ints(ranks)
        self._handle: Any = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step + 1 not in self.steps or (self.ranks and trainer.global_rank not in self.ranks):
            return
        embed = pl_module.model.get_input_embeddings()
        self._handle = embed.register_forward_hook(lambda module, args, out: out * float("nan"))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class InfIntoMaster(Callback):
    """Writes +Inf into one element of a master weight after optimizer step ``step`` (one-process runs).

    Args:
        step: After this many optimizer steps (``global_step``).
        fqn: The parameter (HF name).
        row: Row of the element (default 32: the byte tokenizer's space, present in every batch).
        when: ``"start"``: before the next step's forward (the checkpoint of ``step`` is already
            written); ``"end"``: at the end of step ``step``, before its checkpoint is written.
    """

    def __init__(self, step: int, fqn: str = "model.embed_tokens.weight", row: int = 32, when: str = "start") -> None:
        self.step, self.fqn, self.row, self.when = step, fqn, row, when

    def _write(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step != self.step:
            return
        params = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in pl_module.model.named_parameters()}
        local = params[self.fqn].to_local()
        with torch.no_grad():
            local[self.row, 0] = float("inf")
        self.step = -1  # once

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.when == "start":
            self._write(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.when == "end":
            self._write(trainer, pl_module)


class Heartbeat(Callback):
    """Writes ``<out_dir>/rank<r>.json`` = ``{"pid", "step"}`` at the start and after every optimizer step, then
    sleeps ``sleep_s`` (so a test can find each rank's pid, see the run's progress and signal it mid-run).

    Args:
        out_dir: Folder of the files.
        sleep_s: Seconds to sleep after writing (a slower step, same numbers).
    """

    def __init__(self, out_dir: str, sleep_s: float = 0.0) -> None:
        self.out_dir, self.sleep_s = out_dir, sleep_s

    def _beat(self, trainer: pl.Trainer) -> None:
        import json
        import os
        from pathlib import Path

        folder = Path(self.out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        part = folder / f".rank{trainer.global_rank}.json"
        part.write_text(json.dumps({"pid": os.getpid(), "step": trainer.global_step}))
        part.replace(folder / f"rank{trainer.global_rank}.json")  # readers never see a half-written file

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._beat(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        import time

        self._beat(trainer)
        time.sleep(self.sleep_s)
