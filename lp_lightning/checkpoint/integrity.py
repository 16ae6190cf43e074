"""Content digests of checkpoint folders: ``digests.json`` beside DCP's ``.metadata``.

At save, every file of the folder (DCP's ``.metadata``, the ``*.distcp`` shard files, ``meta.pt``)
is hashed once (SHA-256, read back from disk, each rank hashing its share) and recorded with its
size in ``digests.json``, together with the finiteness of the saved tensors::

    {"format": 1, "algorithm": "sha256", "finite": true, "first_nonfinite": null,
     "files": {".metadata": {"bytes": 5120, "sha256": "9f2c..."}, "__0_0.distcp": {...}, "meta.pt": {...}}}

The file is written to ``digests.json.tmp`` and renamed, inside the hidden staging folder that
becomes the checkpoint only when complete (:func:`lp_lightning.checkpoint.dcp.save_dcp_checkpoint`).

At load, :func:`check_files` compares sizes (cheap) and digests (one read of every byte; the
load spreads the files over the ranks) before DCP reads anything, so a flipped byte, a truncated
``.metadata`` or a shard overwritten in place is named by file instead of loading silently.
Costs: SHA-256 runs at roughly 0.5-2 GB/s per core; a checkpoint is read once more at save
(from the page cache, split over the ranks) and once at load, split over the ranks.

A folder without ``digests.json`` was written before digests existed: it is accepted with a
warning (its bytes cannot be verified; the loaded tensors are still checked for NaN/Inf).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "DAMAGED_CHECKPOINT_FIX",
    "DIGESTS_FILENAME",
    "DamagedCheckpointError",
    "check_files",
    "file_records",
    "read_digests",
    "write_digests",
]

DIGESTS_FILENAME = "digests.json"
"""Content record of a checkpoint folder (this module's docstring)."""

DIGEST_ALGORITHM = "sha256"

DAMAGED_CHECKPOINT_FIX = "resume from another checkpoint folder (an earlier step-NNNNNN) or start without --ckpt_path"
"""The generic fix that ends a :class:`DamagedCheckpointError` message when no intact checkpoint is known."""

_CHUNK_BYTES = 8 << 20


class DamagedCheckpointError(ValueError):
    """A checkpoint folder is incomplete, unreadable, changed after its save, or holds NaN/Inf.

    Raised before anything is loaded when the folder's files do not match their record; after
    DCP has read when the loaded masters or AdamW moments hold NaN/Inf.

    Args:
        path: The checkpoint folder.
        problem: What is wrong, naming the file or key.
        fix: What to do (default :data:`DAMAGED_CHECKPOINT_FIX`).

    Attributes:
        path, problem, fix: As given.
    """

    def __init__(self, path: str | Path, problem: str, fix: str = DAMAGED_CHECKPOINT_FIX) -> None:
        self.path = str(path)
        self.problem = problem
        self.fix = fix
        super().__init__(f"checkpoint {self.path!r} is damaged: {problem}; {fix}.")

    def __reduce__(self) -> tuple[Any, ...]:  # pickled across ranks (all_gather_object)
        return (type(self), (self.path, self.problem, self.fix))

    def with_fix(self, fix: str) -> DamagedCheckpointError:
        """The same error with another fix (e.g. naming the newest intact checkpoint)."""
        return DamagedCheckpointError(self.path, self.problem, fix)


def _sha256(path: Path) -> str:
    digest = hashlib.new(DIGEST_ALGORITHM)
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def file_records(folder: str | Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes": size, "sha256": hex digest}}`` of files in ``folder`` (read once each)."""
    folder = Path(folder)
    return {name: {"bytes": (folder / name).stat().st_size, DIGEST_ALGORITHM: _sha256(folder / name)} for name in names}


def write_digests(
    folder: str | Path, files: Mapping[str, Mapping[str, Any]], *, finite: bool, first_nonfinite: str | None
) -> Path:
    """Writes ``digests.json`` atomically (temporary name, ``fsync``, rename); returns its path.

    Args:
        folder: The (staging) checkpoint folder.
        files: :func:`file_records` of every file of the folder.
        finite: Whether every saved floating-point tensor was finite.
        first_nonfinite: The first key holding NaN/Inf (``None`` when ``finite``).
    """
    folder = Path(folder)
    record = {
        "format": 1, "algorithm": DIGEST_ALGORITHM, "finite": bool(finite), "first_nonfinite": first_nonfinite,
        "files": {name: dict(files[name]) for name in sorted(files)},
    }
    target = folder / DIGESTS_FILENAME
    temporary = folder / f"{DIGESTS_FILENAME}.tmp"
    with temporary.open("w") as stream:
        stream.write(json.dumps(record, indent=1) + "\n")
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, target)
    return target


def read_digests(folder: str | Path) -> dict[str, Any] | None:
    """The ``digests.json`` record of ``folder``; ``None`` when the folder has none (written before digests).

    Raises:
        DamagedCheckpointError: The file exists but is not a record this module wrote.
    """
    folder = Path(folder)
    path = folder / DIGESTS_FILENAME
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        problem = f"{DIGESTS_FILENAME} cannot be read ({type(exc).__name__}: {exc})"
        raise DamagedCheckpointError(folder, problem) from exc
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict) or record.get("algorithm") != DIGEST_ALGORITHM or "finite" not in record:
        raise DamagedCheckpointError(folder, f"{DIGESTS_FILENAME} is not a {DIGEST_ALGORITHM} record of its files")
    return record


def check_files(
    folder: str | Path, record: Mapping[str, Any], names: Iterable[str], *, hash_names: Iterable[str] = ()
) -> str | None:
    """The first mismatch between files and their record, or ``None``; reads only ``hash_names`` in full.

    Args:
        folder: The checkpoint folder.
        record: Its :func:`read_digests` record.
        names: Files whose presence and size are checked (in sorted order).
        hash_names: Files (among ``names``) whose SHA-256 is recomputed and compared.

    Returns:
        ``"file '__0_0.distcp' is missing"`` / ``"... holds N bytes, the save wrote M"`` / ``"... does
        not match its SHA-256 digest ..."``, naming the file; ``None`` when all match.
    """
    folder = Path(folder)
    files = record["files"]
    to_hash = set(hash_names)
    for name in sorted(names):
        expected = files[name]
        path = folder / name
        if not path.is_file():
            return f"file {name!r} is missing"
        size = path.stat().st_size
        if size != int(expected["bytes"]):
            return f"file {name!r} holds {size} bytes, the save wrote {int(expected['bytes'])}"
        if name in to_hash and _sha256(path) != expected[DIGEST_ALGORITHM]:
            return f"file {name!r} does not match its SHA-256 digest (its bytes changed after the save)"
    return None
