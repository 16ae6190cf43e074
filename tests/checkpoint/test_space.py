"""A checkpoint save that runs out of disk space: one clear error, no partial folder, the previous checkpoint loads.

A full disk shows up in torch as ``OSError(ENOSPC)`` or, from the zip writer inside DCP, as
``RuntimeError: ... unexpected pos`` with no errno: both are injected here; a real 2 MB tmpfs is used
too where this process may mount one (root), else that test is skipped.
"""

from __future__ import annotations

import errno
from collections import namedtuple
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lp_lightning.checkpoint import space
from lp_lightning.checkpoint.dcp import (
    CheckpointSpaceError,
    load_dcp_checkpoint,
    model_state_dict,
    optimizer_state_dict,
    save_dcp_checkpoint,
)


_Usage = namedtuple("_Usage", "total used free")


def _trained_linear(width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(width, width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, width)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(model, optimizer, path: Path, step: int) -> Path:
    return save_dcp_checkpoint(
        path, model_state=model_state_dict(model),
        optimizer_states={"optimizer": optimizer_state_dict(model, optimizer)}, metadata={"global_step": step}, rank=0,
    )


def _check_outcome(info, checkpoints: Path, first: Path, model, optimizer) -> None:
    message = str(info.value)
    assert "\n" not in message and len(message) - len(str(checkpoints)) < 220, message
    assert f"checkpoint step-000002 not written: no space left in {str(checkpoints)!r} (it needs " in message
    assert f"free); the partial folder was removed, {first.name} is untouched. Free space, then rerun" in message
    assert info.value.needed > 12 * sum(p.numel() for p in model.parameters())  # masters + both moments
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000001"]  # no .step-000002.partial
    fresh, fresh_optimizer = _trained_linear(model.in_features)
    with torch.no_grad():
        fresh.weight.zero_()
    assert load_dcp_checkpoint(first, model=fresh, optimizers={"optimizer": fresh_optimizer}) == {"global_step": 1}
    assert torch.equal(fresh.weight, model.weight)


@pytest.mark.parametrize("failure", ["enospc", "unexpected_pos"])
def test_an_injected_full_disk_gives_one_line_and_keeps_the_last_checkpoint(tmp_path, single_rank_group, monkeypatch,
                                                                              failure):
    model, optimizer = _trained_linear(64)
    checkpoints = tmp_path / "checkpoints"
    first = _save(model, optimizer, checkpoints / "step-000001", 1)
    real_save = dcp.save

    def filling_save(state, *, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)  # shards written into the staging folder, then the disk is full
        if failure == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(dcp, "save", filling_save)
    if failure == "unexpected_pos":  # torch's zip writer: no errno, no word about space; the disk has 4 kB left
        def full_zip(*args, **kwargs):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

        monkeypatch.setattr(torch, "save", full_zip)
        monkeypatch.setattr(space.shutil, "disk_usage", lambda path: _Usage(10**9, 10**9 - 4096, 4096))
    with pytest.raises(CheckpointSpaceError) as info:
        _save(model, optimizer, checkpoints / "step-000002", 2)
    monkeypatch.undo()
    _check_outcome(info, checkpoints, first, model, optimizer)


def test_other_save_failures_are_not_called_a_full_disk(tmp_path, single_rank_group, monkeypatch):
    model, _ = _trained_linear(8)

    real_save = torch.save

    def broken(obj, target, *args, **kwargs):
        if str(target).endswith("meta.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return real_save(obj, target, *args, **kwargs)

    monkeypatch.setattr(torch, "save", broken)  # the disk has room: the error is passed on as it is
    with pytest.raises(RuntimeError, match="unexpected pos") as info:
        save_dcp_checkpoint(tmp_path / "step-000001", model_state=model_state_dict(model), optimizer_states={},
                            metadata={}, rank=0)
    assert not isinstance(info.value, CheckpointSpaceError)


@pytest.fixture
def tmpfs_2mb(tmp_path):
    """A real 2 MB tmpfs (needs root, as in this project's CI container); skipped where mounting is refused."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"mount refused: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_2mb_tmpfs_gives_one_line_and_keeps_the_last_checkpoint(tmpfs_2mb, single_rank_group):
    model, optimizer = _trained_linear(320)  # 102 k parameters: one checkpoint ~1.2 MB, the second does not fit
    checkpoints = tmpfs_2mb / "checkpoints"
    first = _save(model, optimizer, checkpoints / "step-000001", 1)
    with pytest.raises(CheckpointSpaceError) as info:
        _save(model, optimizer, checkpoints / "step-000002", 2)
    _check_outcome(info, checkpoints, first, model, optimizer)
    assert info.value.free < info.value.needed
