"""Execute every ``notebooks/*.ipynb`` top to bottom (outputs are not written back).

The kernel is ``python3`` pinned to the interpreter running pytest (a kernelspec written to a
temporary directory), so the notebooks see the same environment and the editable
``lp_lightning`` install, whatever ``python`` resolves to on PATH.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from ipykernel.kernelspec import write_kernel_spec  # noqa: E402
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 120


def test_notebooks_exist():
    assert NOTEBOOKS, f"no notebooks found under {NOTEBOOK_DIR}"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path: Path, tmp_path: Path):
    nb = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), (
        f"{path.name} is committed with outputs; clear them (Kernel > Restart & Clear Output)"
    )
    spec_dir = tmp_path / "kernels" / "python3"
    write_kernel_spec(spec_dir)  # argv uses sys.executable
    ksm = KernelSpecManager(kernel_dirs=[str(spec_dir.parent)], ensure_native_kernel=False)
    assert ksm.get_kernel_spec("python3").argv[0] == sys.executable
    km = KernelManager(kernel_name="python3", kernel_spec_manager=ksm)
    client = nbclient.NotebookClient(
        nb, km=km, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(NOTEBOOK_DIR)}}
    )
    client.execute()  # raises CellExecutionError with the failing cell's traceback
    produced = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]
    errors = [out for out in produced if out.get("output_type") == "error"]
    assert not errors and produced, f"{path.name}: {len(errors)} error outputs, {len(produced)} outputs"
