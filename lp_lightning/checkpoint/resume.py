"""Which checkpoint folder a resume loads (design spec §11, §15): one answer for ``lp-lightning fit`` and both strategies.

A run's checkpoints are ``step-NNNNNN`` folders under one parent (hidden ``.partial`` folders are
saves cut short and never count). Resolution, in the order a resume meets it:

1. **At launch** (``lp-lightning fit``'s launch check, one process, no process group):
   ``ckpt_path: last`` becomes :func:`latest_checkpoint` (the newest folder passing the quick
   check, each skipped one reported); an explicit folder gets the quick check
   (:func:`check_explicit_checkpoint`), whose error names the last good sibling.
2. **At load** (the strategy, every rank, collective): :func:`load_with_fallback` loads the folder;
   when it is damaged (a file not matching its digest, NaN/Inf read) it fails naming the newest
   intact sibling (:func:`damaged_fix`), or, with ``resume_fallback`` (``--ckpt_path last``), warns
   and loads the newest intact folder written before it.

The checks themselves are :func:`~lp_lightning.checkpoint.dcp.checkpoint_problem` and
:func:`~lp_lightning.checkpoint.dcp.verify_dcp_checkpoint`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from lp_lightning.checkpoint.dcp import METADATA_FILENAME, checkpoint_problem, verify_dcp_checkpoint
from lp_lightning.checkpoint.integrity import DamagedCheckpointError

__all__ = [
    "check_explicit_checkpoint",
    "checkpoint_folders",
    "damaged_fix",
    "latest_checkpoint",
    "load_with_fallback",
    "newest_intact_checkpoint",
    "older_checkpoints",
    "sibling_checkpoints",
]

T = TypeVar("T")

OnSkip = Callable[[Path, DamagedCheckpointError], None]
"""``on_skip(folder, error)``: told about each folder a resolution passes over."""

CLI_FALLBACK = "pass --ckpt_path last"
"""How an ``lp-lightning fit`` user asks for the fallback (the fix texts name it)."""

CLI_FRESH = "start without --ckpt_path"
"""How an ``lp-lightning fit`` user starts fresh."""


def checkpoint_folders(folder: str | Path) -> list[Path]:
    """The ``step-*`` checkpoint folders under ``folder``, most recently written first.

    Ordered by the time ``meta.pt`` was written (just before the folder's rename), then by name:
    after a rerun into the same folder, the rerun's ``step-000036`` comes before an earlier run's
    ``step-000040``. Hidden ``.partial`` folders (saves cut short) never appear.
    """
    def written(path: Path) -> tuple[float, str]:
        meta = path / METADATA_FILENAME
        return (meta.stat().st_mtime if meta.is_file() else 0.0, path.name)

    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.glob("step-*") if p.is_dir()), key=written, reverse=True)


def newest_intact_checkpoint(
    candidates: Sequence[str | Path],
    *,
    content: bool,
    on_skip: OnSkip | None = None,
) -> Path | None:
    """The first of ``candidates`` that passes its checks (newest first: see :func:`checkpoint_folders`).

    Collective when a process group exists (``content`` hashes every file, spread over the ranks);
    without one, each call checks alone (``content=False`` is what the CLI runs at launch).

    Args:
        candidates: Checkpoint folders in order of preference.
        content: Also recompute every file's SHA-256 (else: structure, sizes and the small files).
        on_skip: Optional ``on_skip(path, error)`` called for each candidate that fails.

    Returns:
        The first intact folder, or ``None`` when every candidate fails.
    """
    for candidate in map(Path, candidates):
        problem = checkpoint_problem(candidate, content=content)
        if problem is None:
            return candidate
        if on_skip is not None:
            on_skip(candidate, problem)
    return None


def sibling_checkpoints(path: str | Path) -> list[Path]:
    """The ``step-*`` siblings of ``path``, ``path`` itself left out, most recently written first."""
    path = Path(path)
    return [p for p in checkpoint_folders(path.parent) if p.resolve() != path.resolve()]


def older_checkpoints(path: str | Path) -> list[Path]:
    """The ``step-*`` siblings of ``path`` written before it, newest first (all siblings when ``path`` is not one)."""
    path = Path(path)
    folders = checkpoint_folders(path.parent)
    resolved = [p.resolve() for p in folders]
    if path.resolve() in resolved:
        return folders[resolved.index(path.resolve()) + 1:]
    return folders


def damaged_fix(path: str | Path, *, content: bool, fallback: str = CLI_FALLBACK, fresh: str = CLI_FRESH) -> str:
    """The fix for a damaged ``path``: resume from the newest intact sibling (what ``last`` would load), or start fresh.

    Args:
        path: The damaged checkpoint folder.
        content: Check the siblings' file digests too (collective; the load does) or only the quick check (launch).
        fallback, fresh: How the caller's user asks for the fallback / a fresh start (the CLI's by default;
            Fabric's strategy names ``resume_fallback=True``).
    """
    path = Path(path)
    good = newest_intact_checkpoint(sibling_checkpoints(path), content=content)
    if good is None:
        return f"no intact checkpoint is left under {str(path.parent)!r}; {fresh}"
    return f"the last good checkpoint is {str(good)!r}: resume from it (or {fallback})"


def latest_checkpoint(folder: str | Path, *, on_skip: OnSkip | None = None) -> Path | None:
    """What ``ckpt_path: last`` resolves to: the most recently written folder under ``folder`` passing the quick check.

    A folder failing :func:`~lp_lightning.checkpoint.dcp.verify_dcp_checkpoint` with ``content=False``
    (sizes, ``.metadata``/``meta.pt`` digests, saved non-finite, unreadable) is passed over and
    reported to ``on_skip``; the load checks the rest (every file's digest, NaN/Inf) and falls back
    further (:func:`load_with_fallback`). ``None`` when no folder qualifies (a first start).
    """
    return newest_intact_checkpoint(checkpoint_folders(folder), content=False, on_skip=on_skip)


def check_explicit_checkpoint(path: str | Path) -> None:
    """The quick check of an explicit ``ckpt_path`` folder (launch: one process, no digests of the shards).

    Raises:
        FileNotFoundError: ``path`` is not a DCP checkpoint folder.
        DamagedCheckpointError: The folder is damaged; its fix names the newest intact sibling folder.
    """
    try:
        verify_dcp_checkpoint(path, weights_only=False, content=False)
    except DamagedCheckpointError as err:
        raise err.with_fix(damaged_fix(path, content=False)) from err


def load_with_fallback(
    path: str | Path,
    load: Callable[[Path], T],
    *,
    fallback: bool,
    on_skip: OnSkip | None = None,
    hints: tuple[str, str] = (CLI_FALLBACK, CLI_FRESH),
) -> tuple[T, Path]:
    """``load(path)``; on a damaged folder, fail naming the last good one or, with ``fallback``, load an older one.

    Collective like ``load`` (every rank calls it with the same ``path``; a damaged folder fails on every rank).

    Args:
        path: The folder to resume from.
        load: Loads one folder, raising :class:`~lp_lightning.checkpoint.integrity.DamagedCheckpointError`
            when it is damaged.
        fallback: Try the ``step-*`` folders written before ``path``, newest first, until one loads
            (``--ckpt_path last``; the strategies' ``resume_fallback``).
        on_skip: Told about each damaged folder passed over (the strategies warn on rank 0).
        hints: ``(fallback, fresh)`` of :func:`damaged_fix`: how the caller's user asks for either.

    Returns:
        ``(what load returned, the folder it loaded)``.

    Raises:
        DamagedCheckpointError: ``path`` (and, with ``fallback``, every older folder) is damaged; the fix
            names the newest intact sibling, or says none is left.
    """
    path = Path(path)
    candidates = [path, *(older_checkpoints(path) if fallback else ())]
    for index, candidate in enumerate(candidates):
        try:
            return load(candidate), candidate
        except DamagedCheckpointError as err:
            if not fallback:
                raise err.with_fix(damaged_fix(path, content=True, fallback=hints[0], fresh=hints[1])) from err
            if index + 1 == len(candidates):
                raise err.with_fix(f"no intact checkpoint is left under {str(path.parent)!r}; {hints[1]}") from err
            if on_skip is not None:
                on_skip(candidate, err)
    raise AssertionError("unreachable: candidates holds path")
