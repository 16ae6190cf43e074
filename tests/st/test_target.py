"""N-1/N-2 on the run's device and backend (``lp_lightning.st.target``, ``st.numerics``; docs/acceptance.md).

- The YAML's accelerator and backend resolve as the startup gate resolves them (npu → ``npu:0`` and
  backend ``npu``; cpu → ``emulated``; an explicit backend is kept).
- An NPU target without torch_npu stops with the fix named, before anything runs.
- On the CPU the explicit target reproduces the default figures bit for bit (the default is what
  ``st`` computed before it took a target; the rows record device and backend).
- On the npu backend (the recording fake torch_npu, which answers through the emulation) every GEMM
  of N-1 and N-2 goes through torch_npu calls, the rows say ``npu``, and N-1's figures equal the
  emulation's.
"""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

import pytest
import torch

from lp_lightning.ops.npu import clear_capability_cache
from lp_lightning.st.numerics import one_layer_comparison, operator_numerics
from lp_lightning.st.target import check_target_device, emulated_on_npu_error, run_target

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ops"))  # the op fake lives with the op tests
from fake_torch_npu import FakeTorchNpu


@pytest.mark.parametrize(("accelerator", "backend", "device", "resolved"), [
    ("cpu", "auto", "cpu", "emulated"),
    ("npu", "auto", "npu:0", "npu"),
    ("npu", "emulated", "npu:0", "emulated"),
    ("cpu", "npu", "cpu", "npu"),
])
def test_the_yaml_accelerator_and_backend_name_the_target(accelerator, backend, device, resolved):
    target = run_target(accelerator, backend)
    assert (target.device, target.backend) == (device, resolved)
    assert target.as_meta() == {"target": {"accelerator": accelerator, "device": device, "backend": resolved,
                                           "backend_requested": backend,
                                           "emulated_on_npu": (accelerator, resolved) == ("npu", "emulated")}}
    assert (emulated_on_npu_error(target.emulated_on_npu, allow_emulated=False) is None) != target.emulated_on_npu


def test_an_unknown_accelerator_and_an_npu_without_torch_npu_are_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"trainer.accelerator='tpu': st cannot place the numerics and conformance"):
        run_target("tpu")
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # `import torch_npu` fails as if not installed
    with pytest.raises(RuntimeError, match=r"st on npu:0 \(trainer.accelerator npu\) needs torch_npu.*"
                                           r"install lp-lightning\[npu\]"):
        check_target_device("npu:0")
    with pytest.raises(RuntimeError, match=r"st on npu:0 .* needs torch_npu"):  # the Python entry points too
        operator_numerics(device="npu:0", precisions=["mxfp8"])
    assert check_target_device(run_target("cpu").device) == torch.device("cpu")


@pytest.fixture(scope="module")
def mxfp8_rows():
    return operator_numerics(seed=0, precisions=["mxfp8"])


def test_the_cpu_target_reproduces_the_default_figures_bit_for_bit(mxfp8_rows):
    explicit = operator_numerics(seed=0, precisions=["mxfp8"], device="cpu", backend="emulated")
    assert explicit == mxfp8_rows
    assert {(r["device"], r["backend"]) for r in explicit} == {("cpu", "emulated")}


@pytest.fixture
def fake_npu(monkeypatch):
    """The recording fake torch_npu in ``sys.modules`` (with a module spec: transformers looks it up)."""
    fake = FakeTorchNpu()
    fake.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    clear_capability_cache()
    yield fake
    clear_capability_cache()


def test_on_the_npu_backend_every_gemm_is_a_torch_npu_call_with_the_emulations_figures(mxfp8_rows, fake_npu):
    fake = fake_npu
    rows = operator_numerics(seed=0, precisions=["mxfp8"], device="cpu", backend="npu")
    assert {r["backend"] for r in rows} == {"npu"}
    calls = [c.name for c in fake.calls]
    # dense: 3 GEMMs; grouped: 3 GEMMs; every operand quantised by a torch_npu MX quant op
    assert calls.count("npu_quant_matmul") == 3 and calls.count("npu_grouped_matmul") == 3, calls
    assert set(calls) - {"npu_quant_matmul", "npu_grouped_matmul"} <= {
        "npu_dynamic_mx_quant", "npu_dynamic_mx_quant_with_dual_axis", "npu_grouped_dynamic_mx_quant"}, calls
    assert any("mx_quant" in name for name in calls), calls
    figures = ("sqnr_db", "cosine", "max_abs", "mse", "nonfinite", "pass")
    assert [{k: r[k] for k in figures} for r in rows] == [{k: r[k] for k in figures} for r in mxfp8_rows]


def test_the_one_layer_model_runs_its_gemms_through_torch_npu_on_the_npu_backend(fake_npu):
    result = one_layer_comparison(seed=0, precisions=["mxfp8"], device="cpu", backend="npu")
    case, comparison = result["cases"]["mxfp8"], result["comparisons"]["mxfp8"]
    assert case["backend"] == "npu" and case["gemm_backends"] == ["npu"] and case["device"] == "cpu"
    gemm_calls = [c.name for c in fake_npu.calls if c.name in ("npu_quant_matmul", "npu_grouped_matmul")]
    assert len(gemm_calls) == comparison["bands"]["k_all"] == 27  # every low-precision GEMM of the step
    assert result["cases"]["bf16"]["gemm_backends"] == [] and comparison["pass"] is True
