"""The notebooks under ``notebooks/`` are committed with their outputs and still execute top to bottom.

A committed notebook is a document: every code cell that prints or plots carries its saved
output and each notebook holds at least one rendered plot (an ``image/png`` output), kept small
(the file under :data:`MAX_NOTEBOOK_BYTES`). The slow test executes a copy top to bottom in a temporary
folder (the committed file is never rewritten): a copy of ``notebooks/`` next to a link to
``docs/``, so the relative paths the notebooks use (``fabric_walkthrough.py``,
``../docs/acceptance/dsv3_tiny``) resolve; it fails on any error output, on a run without a plot,
and when the cells that produce output differ from the cells that have saved output.

The kernel is ``python3`` pinned to the interpreter running pytest (a kernelspec written to a
temporary directory), so the notebooks and the subprocesses they start see the same environment and
``lp_lightning``, whatever ``python`` resolves to on PATH.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 120
MAX_NOTEBOOK_BYTES = 600_000
_IDS = [p.name for p in NOTEBOOKS]


def _code_cells(nb) -> list:
    return [cell for cell in nb.cells if cell.cell_type == "code"]


def test_notebooks_exist():
    assert NOTEBOOKS, f"no notebooks found under {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_IDS)
def test_notebook_is_committed_with_outputs(path: Path):
    size = path.stat().st_size
    assert size < MAX_NOTEBOOK_BYTES, (
        f"{path.name} is {size} bytes (limit {MAX_NOTEBOOK_BYTES}); lower the figures' dpi or shorten printed output"
    )
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    counts = [cell.get("execution_count") for cell in _code_cells(nb)]
    assert counts == list(range(1, len(counts) + 1)), (
        f"{path.name}: execution counts {counts}; restart the kernel, run all cells top to bottom and save the "
        "notebook with its outputs"
    )
    outputs = [out for cell in _code_cells(nb) for out in cell.get("outputs", [])]
    errors = [out for out in outputs if out.get("output_type") == "error"]
    assert not errors, f"{path.name} is committed with {len(errors)} error outputs: {errors[0].get('ename')}"
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert images, f"{path.name} has no rendered plot (no image/png output); run it with %matplotlib inline"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_IDS)
def test_notebook_executes(path: Path, tmp_path: Path):
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    committed = path.read_bytes()
    nb = nbformat.reads(committed.decode(), as_version=4)
    for cell in _code_cells(nb):
        cell.outputs, cell.execution_count = [], None
    spec_dir = tmp_path / "kernels" / "python3"
    write_kernel_spec(spec_dir)  # argv uses sys.executable
    ksm = KernelSpecManager(kernel_dirs=[str(spec_dir.parent)], ensure_native_kernel=False)
    assert ksm.get_kernel_spec("python3").argv[0] == sys.executable
    km = KernelManager(kernel_name="python3", kernel_spec_manager=ksm)
    workdir = tmp_path / "repo" / NOTEBOOK_DIR.name  # a copy of notebooks/ next to a link to docs/
    shutil.copytree(NOTEBOOK_DIR, workdir, ignore=shutil.ignore_patterns("*.ipynb", ".ipynb_checkpoints"))
    (workdir.parent / "docs").symlink_to(NOTEBOOK_DIR.parent / "docs", target_is_directory=True)
    client = nbclient.NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(workdir)}})
    # raises CellExecutionError with the failing cell's traceback; TMPDIR keeps the runs' folders in tmp_path
    client.execute(env={**os.environ, "TMPDIR": str(tmp_path)})
    nbformat.write(nb, workdir / path.name)  # the executed copy, for inspection
    produced = [out for cell in _code_cells(nb) for out in cell.get("outputs", [])]
    errors = [out for out in produced if out.get("output_type") == "error"]
    assert not errors, f"{path.name}: {len(errors)} error outputs, first {errors[0].get('ename')}"
    assert any("image/png" in out.get("data", {}) for out in produced), f"{path.name}: no plot was rendered"
    saved = nbformat.reads(committed.decode(), as_version=4)
    stale = [i for i, (ran, kept) in enumerate(zip(_code_cells(nb), _code_cells(saved)))
             if bool(ran.get("outputs")) != bool(kept.get("outputs"))]
    assert not stale, (
        f"{path.name}: code cells {stale} (0-based among code cells) produce output now but the committed file "
        "has none there, or the reverse; re-execute the notebook and save it with its outputs"
    )
    assert path.read_bytes() == committed, f"{path.name} was rewritten by the test"
