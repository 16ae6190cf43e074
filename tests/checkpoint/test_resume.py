"""Which folder a resume loads (lp_lightning.checkpoint.resume): the fallback order and the fix a failure names."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lp_lightning.checkpoint.integrity import DamagedCheckpointError
from lp_lightning.checkpoint.resume import load_with_fallback, older_checkpoints


def _folders(root: Path, steps: list[int]) -> list[Path]:
    """``step-*`` folders whose ``meta.pt`` was written in ``steps`` order (not DCP checkpoints)."""
    out = []
    for i, step in enumerate(steps):
        folder = root / f"step-{step:06d}"
        folder.mkdir(parents=True)
        (folder / "meta.pt").write_bytes(b"")
        os.utime(folder / "meta.pt", (1_000 + i, 1_000 + i))
        out.append(folder)
    return out


def test_fallback_loads_the_newest_older_folder_that_loads(tmp_path):
    one, two, three = _folders(tmp_path, [1, 2, 3])
    assert older_checkpoints(three) == [two, one]
    damaged = {three: "shard '__0_0.distcp' has another digest", two: "NaN/Inf in 'lm_head.weight'"}

    def load(folder: Path) -> str:
        if folder in damaged:
            raise DamagedCheckpointError(folder, damaged[folder])
        return f"state of {folder.name}"

    skipped = []
    assert load_with_fallback(three, load, fallback=True, on_skip=lambda p, e: skipped.append((p, e.problem))) == (
        "state of step-000001", one)
    assert skipped == [(three, damaged[three]), (two, damaged[two])]
    assert load_with_fallback(one, load, fallback=False) == ("state of step-000001", one)


def test_without_fallback_or_with_every_folder_damaged_the_error_says_what_to_do(tmp_path):
    _, two = _folders(tmp_path, [1, 2])

    def load(folder: Path) -> str:
        raise DamagedCheckpointError(folder, "it cannot be read")

    # The siblings are no DCP checkpoints here, so no intact one is left to name.
    for fallback in (False, True):
        with pytest.raises(DamagedCheckpointError, match="no intact checkpoint is left under .*start without --ckpt_path"):
            load_with_fallback(two, load, fallback=fallback)
