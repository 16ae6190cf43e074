"""``lp-lightning st --rows conformance``: not-applicable on the emulation, pass / fail on the fake NPU; no fit run.

The st runs here select only the conformance row and skip the numerics, so they start no ``fit``;
the fakes are ``tests/ops/fake_torch_npu.py`` (faithful) and ``tests/ops/deviant_torch_npu.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ops"))  # the op fakes live with the op tests
from deviant_torch_npu import DEVIATIONS
from fake_torch_npu import FakeTorchNpu

from lp_lightning.cli import main
from lp_lightning.lightning import accelerator
from lp_lightning.ops.npu import clear_capability_cache
from lp_lightning.st.conformance_row import conformance_row
from lp_lightning.st.target import run_target

ONLY_CONFORMANCE = ["--rows", "[conformance]", "--skip", "[numerics]"]


def _install(monkeypatch: pytest.MonkeyPatch, fake: FakeTorchNpu) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    clear_capability_cache()


def test_on_the_emulated_backend_the_row_is_not_applicable(tmp_path, capsys):
    out = tmp_path / "st"
    assert main(["st", "--out", str(out), *ONLY_CONFORMANCE]) == 0
    report = json.loads((out / "report.json").read_text())
    (row,) = report["rows"]
    assert row["id"] == "conformance" and row["verdict"] == "not-applicable"
    assert "compare the emulation with itself" in row["not_applicable_because"]
    assert json.loads((out / "conformance.json").read_text())["backend"] == "emulated"
    assert report["target"] == {"backend": "emulated", "device": "cpu", "accelerator": "cpu", "backend_requested": "auto",
                                "emulated_on_npu": False}
    assert "## Backend conformance: **not-applicable**" in (out / "report.md").read_text()
    assert "conformance Backend conformance against the emulation  not-applicable" in capsys.readouterr().out


def test_a_deviating_npu_fails_the_row_and_st_exits_1(tmp_path, monkeypatch):
    _install(monkeypatch, DEVIATIONS["fp32_out_via_bf16"][0]())
    config = tmp_path / "npu.yaml"
    config.write_text("backend: npu\n")
    out = tmp_path / "st"
    assert main(["st", "--config", str(config), "--out", str(out), *ONLY_CONFORMANCE]) == 1
    (row,) = json.loads((out / "report.json").read_text())["rows"]
    failing = [c for c in row["checks"] if not c["ok"]]
    assert [c["name"] for c in failing] == ["low_precision_matmul mxfp8_e4m3", "low_precision_matmul hif8"]
    assert "fail, first low_precision_matmul mxfp8_e4m3 NN -> float32: out at" in failing[0]["observed"]
    markdown = (out / "report.md").read_text()
    assert "## Backend conformance: **fail**" in markdown and "| low_precision_matmul hif8 TN -> float32 |" in markdown
    assert "- Q7: npu_quantize codes vs encode(x / scale)" in markdown  # the quantisations still conform


def test_on_the_faithful_fake_npu_the_row_passes(tmp_path, monkeypatch):
    _install(monkeypatch, FakeTorchNpu())
    config = tmp_path / "npu.yaml"
    config.write_text("backend: npu\n")
    out = tmp_path / "st"
    assert main(["st", "--config", str(config), "--out", str(out), *ONLY_CONFORMANCE]) == 0  # st --rows conformance
    (row,) = json.loads((out / "report.json").read_text())["rows"]
    assert row["verdict"] == "pass" and len(row["checks"]) == 8  # four operations x two formats
    assert all("of" in str(c["observed"]) and c["ok"] for c in row["checks"])
    markdown = (out / "report.md").read_text()
    assert "## Backend conformance: **pass**" in markdown and "52 cases, 0 failed" in markdown
    assert "| failing case |" not in markdown and "- Q1: the npu backend makes no HR (CAST_HYBRID) cast" in markdown
    assert conformance_row("npu", "cpu", tmp_path).verdict == "pass"  # the Python entry point agrees


def test_a_backend_that_cannot_run_fails_the_row(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # not installed
    clear_capability_cache()
    row = conformance_row("npu", "cpu", tmp_path)
    assert row.verdict == "fail" and row.checks[0].name == "backend conformance ran"
    assert "cannot run mxfp8_e4m3" in row.checks[0].observed
    assert "error" in json.loads((tmp_path / "conformance.json").read_text())


def test_the_target_comes_from_the_accelerator_and_backend_of_the_yaml(monkeypatch):
    def target(accelerator: str, backend: str) -> dict:
        return run_target(accelerator, backend).as_meta()["target"]

    assert target("npu", "auto") == {"backend": "npu", "device": "npu:0", "accelerator": "npu",
                                     "backend_requested": "auto", "emulated_on_npu": False}
    assert target("cpu", "auto")["backend"] == "emulated"
    assert target("npu", "emulated")["backend"] == "emulated"
    monkeypatch.setattr(accelerator, "DEVICE_TYPE", "cpu")  # the fake NPU's devices mapped to CPU memory
    assert target("npu", "auto")["device"] == "cpu"
