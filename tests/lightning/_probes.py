"""Test-only callback that records FSDP2 facts from inside a CLI run (passed with
``--trainer.callbacks+=_probes.ShardingProbe``; ``tests/lightning`` must be on ``PYTHONPATH``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor


class ShardingProbe(Callback):
    """Writes ``<out_dir>/probe_rank<r>.json`` at the start of training on every rank.

    Args:
        out_dir: Folder for the JSON files.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = {}
        for name, param in pl_module.model.named_parameters():
            entry = {"dtensor": isinstance(param, DTensor), "dtype": str(param.dtype)}
            if isinstance(param, DTensor):
                entry.update(
                    placements=[repr(p) for p in param.placements],
                    mesh_shape=list(param.device_mesh.shape),
                    mesh_dim_names=list(param.device_mesh.mesh_dim_names or ()),
                    global_shape=list(param.shape),
                    local_shape=list(param.to_local().shape),
                )
            params[name] = entry
        facts = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "parallelization": dataclasses.asdict(trainer.strategy.parallelization),
            "state_dict_keys": sorted(trainer.strategy.lightning_module_state_dict()),
            "params": params,
        }
        path = Path(self.out_dir) / f"probe_rank{trainer.global_rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(facts, indent=1, default=list))


class StateDump(Callback):
    """Saves this rank's low-precision storage and optimizer state to ``<out_dir>/state_step<N>_rank<r>.pt``.

    At ``on_train_start`` (after a checkpoint restore and the rebuild of the 8-bit weights) and after
    every optimizer step listed in ``steps``. Tensors are this rank's local shards, cloned.

    Args:
        out_dir: Folder for the files.
        steps: Global steps after which to dump (comma-separated string from the CLI, or a list).
    """

    def __init__(self, out_dir: str, steps: str = "") -> None:
        self.out_dir = out_dir
        self.steps = {int(s) for s in str(steps).split(",") if s.strip()}
        self._last = None

    def _dump(self, trainer: pl.Trainer, pl_module: pl.LightningModule, tag: str) -> None:
        import torch

        from lp_lightning.fsdp.refresh import local_low_precision_weight

        storage, optim = {}, {}
        names = {}
        for name, param in pl_module.model.named_parameters():
            fqn = name.replace("_checkpoint_wrapped_module.", "")
            names[id(param)] = fqn
            local = local_low_precision_weight(param)
            if local is not None:
                storage[fqn] = {k: v.clone() for k, v in local.low_precision_storage.items()}
        for param, state in trainer.optimizers[0].state.items():
            optim[names[id(param)]] = {
                k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in state.items()
            }
        path = Path(self.out_dir) / f"state_{tag}_rank{trainer.global_rank}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"storage": storage, "optimizer": optim, "global_step": trainer.global_step}, path)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = trainer.global_step
        self._dump(trainer, pl_module, f"start{trainer.global_step}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self._last:
            self._last = trainer.global_step
            if trainer.global_step in self.steps:
                self._dump(trainer, pl_module, f"step{trainer.global_step}")


class ImportedModules(Callback):
    """Writes ``<out_dir>/imported_rank<r>.json``: which of ``WATCHED`` were imported by the end of training.

    A cheap check inside the multi-process CLI runs; the full bf16 guard (every low-precision module
    of the source tree) is ``tests/test_bf16_imports.py``.
    """

    WATCHED = ("lp_lightning.tensor.weight", "lp_lightning.plan", "lp_lightning.fsdp.refresh",
               "lp_lightning.fsdp.sharding", "torch_npu")

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import sys

        path = Path(self.out_dir) / f"imported_rank{trainer.global_rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(sorted(m for m in self.WATCHED if m in sys.modules)))


class KillRank(Callback):
    """Fault injection: SIGKILLs rank ``rank`` as the batch of optimizer step ``step + 1`` starts (a dead node)."""

    def __init__(self, rank: int = 1, step: int = 4) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
