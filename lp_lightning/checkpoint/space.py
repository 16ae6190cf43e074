"""Disk space for checkpoints: the size of one, and a save that runs out of room (design spec §11, §15).

One checkpoint holds the FP32 masters and both FP32 AdamW moments: :data:`BYTES_PER_PARAMETER` (12)
bytes per parameter, plus ``.metadata``, ``meta.pt`` and ``digests.json`` (an allowance:
:data:`SMALL_FILES_BYTES`, and :data:`BYTES_PER_TENSOR` per saved tensor). ``lp-lightning fit``
warns at launch when the checkpoint folder's file system has less free than :func:`checkpoint_bytes`;
:func:`~lp_lightning.checkpoint.dcp.save_dcp_checkpoint` turns a save that runs out of room
(:func:`out_of_space`) into one :class:`CheckpointSpaceError`, after removing its staging folder.
torch's writers do not always say so: a full disk inside DCP's ``torch.save`` surfaces as
``RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos`` with no errno, so the
free space left is read as well.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "BYTES_PER_PARAMETER",
    "BYTES_PER_TENSOR",
    "SMALL_FILES_BYTES",
    "CheckpointSpaceError",
    "checkpoint_bytes",
    "existing_ancestor",
    "format_bytes",
    "free_bytes",
    "out_of_space",
]

BYTES_PER_PARAMETER = 12
"""FP32 master + FP32 AdamW ``exp_avg`` + ``exp_avg_sq`` (docs/outputs.md "Checkpoints")."""

SMALL_FILES_BYTES = 1 << 16
"""Allowance for ``meta.pt`` and ``digests.json`` beside the tensor bytes."""

BYTES_PER_TENSOR = 1 << 10
"""Allowance per saved tensor for its ``.metadata`` entry (key, shape, chunk of every rank)."""

_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_SPACE_TEXTS = ("No space left on device", "Disk quota exceeded")


def checkpoint_bytes(n_parameters: int, n_tensors: int = 0) -> int:
    """Bytes one training checkpoint of ``n_parameters`` parameters in ``n_tensors`` Parameters takes (an estimate)."""
    return BYTES_PER_PARAMETER * int(n_parameters) + SMALL_FILES_BYTES + 3 * BYTES_PER_TENSOR * int(n_tensors)


def existing_ancestor(path: str | Path) -> Path:
    """``path`` itself when it exists, else its nearest existing parent (what a ``mkdir -p`` would write into)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | Path) -> int:
    """Bytes free for this user on the file system that holds (or would hold) ``path``."""
    return shutil.disk_usage(existing_ancestor(path)).free


def format_bytes(count: int) -> str:
    """``1.2 GB``, ``340.0 kB``, ``512 B`` (decimal units, as ``df -H``)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def _folder_bytes(folder: Path) -> int:
    try:
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    except OSError:
        return 0


def _chain(err: BaseException) -> Iterable[BaseException]:
    """``err``, its causes and contexts, and the per-rank failures a DCP ``CheckpointException`` carries."""
    seen: set[int] = set()
    stack = [err]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        stack.extend((current.__cause__, current.__context__))
        for failure in (getattr(current, "failures", None) or {}).values():  # {rank: (exception, traceback)}
            stack.append(failure[0] if isinstance(failure, tuple) else failure)


def out_of_space(err: BaseException, staging: str | Path, needed: int) -> bool:
    """Whether a failed save into ``staging`` ran out of room.

    Yes when ``ENOSPC``/``EDQUOT`` (or its text) is anywhere in the error's chain, or when the file
    system holds less free than the save still had to write (``needed`` minus what ``staging``
    holds, plus 1 MiB): torch's zip writer reports a full disk only as "unexpected pos".
    """
    for current in _chain(err):
        if isinstance(current, OSError) and current.errno in _SPACE_ERRNOS:
            return True
        if any(text in str(current) for text in _SPACE_TEXTS):
            return True
    staging = Path(staging)
    try:
        free = free_bytes(staging)
    except OSError:
        return False
    return free < max(needed - _folder_bytes(staging), 0) + (1 << 20)


class CheckpointSpaceError(RuntimeError):
    """A checkpoint save ran out of disk space; its staging folder is removed, earlier checkpoints are untouched.

    Raised on every rank alike; ``lp-lightning fit`` prints it as one line and exits with status 1.

    Args:
        path: The checkpoint folder that was not written.
        needed: Bytes the checkpoint needs (its tensors plus the small files' allowance).
        free: Bytes free on that file system after the staging folder was removed.
        newest: The newest ``step-*`` checkpoint left beside it (``None``: none).
    """

    def __init__(self, path: str | Path, *, needed: int, free: int, newest: str | None) -> None:
        self.path, self.needed, self.free, self.newest = str(path), int(needed), int(free), newest
        folder = Path(self.path).parent
        kept = f"{Path(newest).name} is untouched" if newest else "no earlier checkpoint exists"
        super().__init__(
            f"checkpoint {Path(self.path).name} not written: no space left in {str(folder)!r} (it needs "
            f"{format_bytes(self.needed)}, {format_bytes(self.free)} free); the partial folder was removed, {kept}. "
            "Free space, then rerun with --ckpt_path last."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.path, self.needed, self.free, self.newest))


def _rebuild(path: str, needed: int, free: int, newest: str | None) -> CheckpointSpaceError:
    return CheckpointSpaceError(path, needed=needed, free=free, newest=newest)
