"""State digests: what Q3-09 compares between the continuous and the resumed run (design spec §16.6, §17.2).

:class:`StateDigestProbe` is a read-only Lightning callback. On every rank it records the SHA-1 of
this rank's local shard of every parameter and of every optimizer-state tensor, with their dtypes,
at the start of training (after a checkpoint restore and the rebuild of the 8-bit weights from the
FP32 masters) and after each optimizer step listed in ``steps`` (after that step's refresh). For a
low-precision weight it digests the FP32 master and each derived storage tensor (``row_data`` …
``scale``) separately.

A resumed run is correct when its start digests equal the continuous run's digests after the saved
step: same masters and moments (the checkpoint round trip is exact) and same 8-bit storage (rebuilt
from the FP32 master, not from a BF16 copy). The file is ``<out_dir>/digest_rank<r>.json``::

    {"rank": r, "world_size": W, "snapshots": [
        {"when": "train_start" | "after_step", "global_step": s,
         "params": {fqn: {"dtype", "shape", "sha1", "storage": {name: sha1}}},   # storage: low-precision only
         "optimizer": {fqn: {state key: {"dtype", "sha1"}}}}]}

FQNs are the LightningModule's parameter names (``model.layers.0...``). Hashing copies each local
shard to host memory once per snapshot; it is for acceptance runs, not for production. Each snapshot
is a ``non_training("state_digest")`` range (:mod:`lp_lightning.observers`) ending in a barrier, so the
step timers of ``run_summary.json`` leave it out of the step's training time (Q3-11) in whatever
order the callbacks run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from typing_extensions import override

from lp_lightning.observers import non_training

__all__ = ["StateDigestProbe", "tensor_sha1"]


def tensor_sha1(tensor: torch.Tensor) -> str:
    """SHA-1 of a tensor's bytes (shape and dtype not included; a 0-d tensor as one element)."""
    flat = tensor.detach().reshape(-1).contiguous().cpu()
    return hashlib.sha1(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # a DTensor's shard on this rank
    return to_local() if callable(to_local) else tensor


def _param_entry(param: torch.Tensor) -> dict[str, Any]:
    local = _local(param)
    master = getattr(local, "master", None)
    storage = getattr(local, "low_precision_storage", None)
    if master is not None and storage is not None:  # a low-precision weight: FP32 master + derived storage
        return {
            "dtype": str(master.dtype).removeprefix("torch."),
            "shape": list(master.shape),
            "sha1": tensor_sha1(master),
            "storage": {name: tensor_sha1(t) for name, t in sorted(storage.items())},
        }
    return {"dtype": str(local.dtype).removeprefix("torch."), "shape": list(local.shape), "sha1": tensor_sha1(local)}


def state_snapshot(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """Digests of ``model``'s parameters and the optimizers' state (see the module docstring)."""
    names = {id(p): name for name, p in model.named_parameters()}
    params = {name: _param_entry(p) for name, p in model.named_parameters()}
    optimizer: dict[str, Any] = {}
    for opt in optimizers:
        for param, state in opt.state.items():
            fqn = names.get(id(param), f"<unnamed {id(param)}>")
            optimizer[fqn] = {
                key: {"dtype": str(value.dtype).removeprefix("torch."), "sha1": tensor_sha1(_local(value))}
                for key, value in sorted(state.items())
                if isinstance(value, torch.Tensor)
            }
    return {"params": params, "optimizer": optimizer}


class StateDigestProbe(Callback):
    """Digests parameters and optimizer state at train start and after the listed steps (read-only).

    Args:
        out_dir: Folder of ``digest_rank<r>.json``; ``None`` = ``<default_root_dir>/probes``.
        steps: Global steps after whose optimizer step (and refresh) a snapshot is taken.
    """

    def __init__(self, out_dir: str | None = None, steps: list[int] | None = None) -> None:
        self.out_dir = out_dir
        self.steps = sorted(set(steps or ()))
        self.snapshots: list[dict[str, Any]] = []
        self._last_step: int | None = None

    def _snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule, when: str) -> None:
        snapshot = state_snapshot(pl_module, list(trainer.optimizers))
        self.snapshots.append({"when": when, "global_step": trainer.global_step, **snapshot})

    def _timed_snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule, when: str) -> None:
        """:meth:`_snapshot` as a ``non_training("state_digest")`` range that ends when every rank is done.

        The barrier keeps a rank that hashes faster from waiting for its peers inside the next step's
        first collective: that wait is the digest's, and lands in the range the step timers subtract.
        """
        with non_training("state_digest"):
            self._snapshot(trainer, pl_module, when)
            trainer.strategy.barrier("StateDigestProbe")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.snapshots = []
        self._last_step = trainer.global_step
        self._timed_snapshot(trainer, pl_module, "train_start")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step:
            return  # inside gradient accumulation
        self._last_step = trainer.global_step
        if trainer.global_step in self.steps:
            self._timed_snapshot(trainer, pl_module, "after_step")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        folder = Path(self.out_dir) if self.out_dir is not None else Path(trainer.default_root_dir) / "probes"
        folder.mkdir(parents=True, exist_ok=True)
        record = {"rank": trainer.global_rank, "world_size": trainer.world_size, "snapshots": self.snapshots}
        (folder / f"digest_rank{trainer.global_rank}.json").write_text(json.dumps(record) + "\n")
