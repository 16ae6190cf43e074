"""The startup gate's choice of backend and its checks (lp_lightning/ops/gate.py, design spec §15 rows 1–3).

The npu rows use the recording fake torch_npu of tests/ops/fake_torch_npu.py (``install_fake_npu`` fixture of
tests/ops/conftest.py); the same gate through the CLI is tested in tests/lightning/test_startup_gate.py.
"""

from __future__ import annotations

import sys

import pytest
from lp_lightning.formats import recipe_for
from lp_lightning.lightning.low_precision import LowPrecisionFabricPlugin
from lp_lightning.lightning.precision import BACKEND_CHOICES, BF16FabricPlugin
from lp_lightning.ops import backend_names, get_backend
from lp_lightning.ops.gate import StartupGateError, run_startup_gate


def test_backend_choices_are_auto_and_the_registered_backends():
    assert BACKEND_CHOICES == ("auto", *backend_names())


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "hif8"])
def test_auto_off_npu_is_the_emulation(device_type, fmt):
    result = run_startup_gate(fmt, device_type=device_type)
    assert (result.requested, result.backend, result.format, result.ok) == ("auto", "emulated", fmt, True)
    assert [c.name for c in result.checks] == [f"emulated {fmt} kernels"]
    assert "backend 'auto' -> 'emulated' (exact software emulation)" in result.describe()


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "hif8"])
def test_auto_on_npu_is_npu_with_every_check_listed(install_fake_npu, fmt):
    install_fake_npu()
    result = run_startup_gate(fmt, device_type="npu")
    assert result.backend == "npu" and result.ok
    names = [c.name for c in result.checks]
    assert names[:4] == ["torch_npu installed", "torch_npu version", "torch_npu matches torch", names[3]]
    assert "SoC Ascend950" in names and any(name.startswith("op ") for name in names)
    assert result.as_dict()["checks"][0] == {"name": "torch_npu installed", "seen": "installed", "ok": True,
                                             "message": None}


def test_auto_on_npu_with_a_failing_check_is_an_error_never_the_emulation(install_fake_npu):
    install_fake_npu(device_name="Ascend910B3")
    with pytest.raises(StartupGateError, match=r"needs an Ascend950 \(Ascend A5\) SoC.*'Ascend910B3'") as info:
        run_startup_gate("mxfp8_e4m3", device_type="npu")
    assert info.value.result.backend == "npu" and not info.value.result.ok
    assert "[FAILED] SoC Ascend950: Ascend910B3" in info.value.result.describe()


def test_npu_without_torch_npu_fails_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu -> ImportError
    with pytest.raises(StartupGateError, match="startup gate: .*torch_npu, which is not installed: pip install"):
        run_startup_gate("hif8", device_type="npu", backend="npu")


def test_npu_backend_off_the_npu_accelerator_fails_even_with_a_working_npu(install_fake_npu):
    """torch_npu and an Ascend 950 present, but the run's accelerator is the CPU: its tensors never reach the NPU."""
    install_fake_npu()
    with pytest.raises(StartupGateError, match=r"backend 'npu' computes on npu devices, but this run's accelerator "
                                               r"is cpu; pass --trainer.accelerator npu, or --backend emulated\.$"):
        run_startup_gate("mxfp8_e4m3", device_type="cpu", backend="npu")


def test_emulated_on_npu_only_when_asked(install_fake_npu):
    install_fake_npu(missing=("npu_quant_matmul",))
    result = run_startup_gate("hif8", device_type="npu", backend="emulated")
    assert (result.requested, result.backend) == ("emulated", "emulated")
    with pytest.raises(StartupGateError, match="torch_npu.npu_quant_matmul"):
        run_startup_gate("hif8", device_type="npu")


def test_bf16_checks_only_the_format_independent_rows(install_fake_npu):
    install_fake_npu(device_name="Ascend910B3")  # any SoC: no low-precision op runs
    result = run_startup_gate(None, device_type="npu")
    assert result.backend == "none" and [c.name for c in result.checks] == [
        "torch_npu installed", "torch_npu version", "torch_npu matches torch", "NPU device",
    ]  # fmt: skip
    assert run_startup_gate(None, device_type="cpu").checks == ()


def test_unknown_backend_fails_naming_the_legal_values():
    with pytest.raises(ValueError, match=r"backend='cuda'; legal values: 'auto', 'emulated', 'npu'"):
        run_startup_gate("hif8", device_type="cpu", backend="cuda")
    with pytest.raises(ValueError, match=r"backend='cuda' is not an op backend; choose one of"):
        LowPrecisionFabricPlugin("hif8", backend="cuda")


def test_the_gate_backend_travels_in_the_policy_not_in_a_process_global(install_fake_npu):
    """The gate's choice becomes the plugin policy's backend, which the factories put into every recipe."""
    install_fake_npu()
    plugin = LowPrecisionFabricPlugin("mxfp8")
    assert plugin.policy.backend == "auto"
    assert plugin.startup_gate("npu").backend == "npu"
    assert plugin.policy.backend == "npu" and plugin.backend == "npu" and get_backend() == "auto"
    assert plugin.startup_gate("npu") is plugin.gate_result  # once
    assert recipe_for(plugin.policy.format.value, plugin.policy.backend).backend == "npu"
    plugin.teardown()
    assert plugin.backend == "npu" and get_backend() == "auto"  # the run's record stays; nothing to restore


def test_a_bf16_plugin_off_npu_runs_no_check():
    plugin = BF16FabricPlugin()
    assert plugin.startup_gate("cpu") is None and plugin.backend == "none"
