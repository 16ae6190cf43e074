"""Software versions of a run, as recorded in ``run_summary.json`` ``versions`` (design spec §17.1).

The acceptance records of design spec §17.1 name the code and software a result came from: the
lp-lightning git commit, torch, torch_npu, CANN, Lightning and transformers. Versions are read from
the installed distributions' metadata (:mod:`importlib.metadata`), so nothing is imported to learn
them: a CPU run never imports ``torch_npu``. The CANN version is asked from ``torch_npu`` only when
the run has imported it already (the ``npu`` backend or accelerator did).
"""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import sys
from pathlib import Path

import lp_lightning

__all__ = ["git_commit", "software_versions"]

_DISTRIBUTIONS = {"torch": "torch", "torch_npu": "torch-npu", "lightning": "lightning", "transformers": "transformers"}


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The commit of the lp-lightning source tree, ``"<sha>-dirty"`` with uncommitted changes.

    Returns:
        The 40-hex commit (plus ``-dirty``), or ``None`` when the package is not run from a git
        checkout (a wheel install) or ``git`` is unavailable.
    """
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}-dirty" if dirty else sha


def _cann_version() -> str | None:
    """``torch_npu.utils.get_cann_version()`` (defined in ``torch_npu/npu/utils.py`` of torch_npu 2.13.0,
    re-exported by ``torch_npu.utils``, not by ``torch_npu.npu``), when torch_npu is imported."""
    torch_npu = sys.modules.get("torch_npu")
    owners = (getattr(torch_npu, "utils", None), getattr(getattr(torch_npu, "npu", None), "utils", None))
    get = next((g for g in (getattr(owner, "get_cann_version", None) for owner in owners) if callable(g)), None)
    if get is None:
        return None
    try:
        return str(get())
    except Exception:  # a driver/runtime failure: the version is unknown, the run goes on  # noqa: BLE001
        return None


def software_versions() -> dict[str, str | None]:
    """What ``run_summary.json`` records under ``versions``.

    Returns:
        ``{"lp_lightning", "git_commit", "python", "torch", "torch_npu", "cann", "lightning",
        "transformers"}``; ``None`` for what is not installed or not known (``torch_npu`` and
        ``cann`` off Ascend, ``git_commit`` outside a git checkout).
    """
    versions: dict[str, str | None] = {
        "lp_lightning": lp_lightning.__version__,
        "git_commit": git_commit(),
        "python": platform.python_version(),
    }
    versions.update({key: _distribution_version(dist) for key, dist in _DISTRIBUTIONS.items()})
    versions["cann"] = _cann_version()
    return versions
