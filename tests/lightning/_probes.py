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
