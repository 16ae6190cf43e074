"""The design spec §15 startup gate on the ``npu`` accelerator, through the CLI, with a recording fake torch_npu.

``lp-lightning fit --trainer.accelerator npu`` in this process, the accelerator's devices mapped to
CPU memory (``fake_npu_device.map_devices_to_cpu``, the acceptance's "fake device mapped to CPU
memory"): the gate runs in the strategy's ``setup_environment``, before the model is built.

* A fake missing any one op or dtype a format needs stops the run at startup (exit status 1, the
  model never built) with one message naming it; the checks are printed.
* With a complete fake the tiny model trains a step whose every GEMM and every quantisation goes
  through torch_npu calls: the emulated backend is replaced in the backend registry by an object
  that fails on any use, the portable quantizers' ``quantize``/``quantize_dual`` fail when called
  (the fake itself answers through its own reference to the emulation and the codecs), and every
  GEMM event of the step is labelled ``npu``.
* No run on the npu accelerator computes with the emulated backend unless ``--backend emulated``
  was given.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_npu_device import FakeTorchNpu, add_device_apis, install, map_devices_to_cpu, npu_unregistered

import lp_lightning.models.deepseek_v3 as deepseek_v3
from lp_lightning.cli import main
from lp_lightning.formats.hif8 import HiF8Quantizer
from lp_lightning.formats.mxfp8 import MXFP8Quantizer
from lp_lightning.ops import backend as op_backend
from lp_lightning.ops.npu_capability import REQUIRED_DTYPES, REQUIRED_OPS

FORMAT_OF = {"mxfp8": "mxfp8_e4m3", "hif8": "hif8"}
TORCH_NPU_OPS = {"npu_quant_matmul", "npu_grouped_matmul"}


@pytest.fixture
def npu_node(monkeypatch):
    """Installs a fake torch_npu (``missing=`` pieces left out) with the npu accelerator on CPU memory."""
    with npu_unregistered():

        def make(missing: tuple[str, ...] = ()) -> FakeTorchNpu:
            fake = install(monkeypatch, add_device_apis(FakeTorchNpu(missing=missing)))
            map_devices_to_cpu(monkeypatch)
            return fake

        yield make


@pytest.fixture
def model_builds(monkeypatch):
    """Counts the models the run builds (``from_hf_config`` calls)."""
    calls: list[str] = []
    real = deepseek_v3.from_hf_config

    def counted(*args, **kwargs):
        calls.append(args[0] if args else kwargs.get("config_name_or_path"))
        return real(*args, **kwargs)

    monkeypatch.setattr(deepseek_v3, "from_hf_config", counted)
    return calls


class _NoEmulation:
    """Stands in for the emulated backend: any use from lp-lightning's dispatch fails the run."""

    name = "emulated"

    def __getattr__(self, attribute):
        raise AssertionError(f"the emulated backend was used ({attribute}) on the npu accelerator")


def _portable_quantizer_called(*args, **kwargs):
    raise AssertionError("a portable quantizer was called on the npu accelerator")


def _fit(root: Path, cache_dir: str, *options: str) -> int:
    return main([
        "fit", "--trainer.accelerator", "npu", "--trainer.default_root_dir", str(root), "--data.cache_dir", cache_dir,
        "--data.seq_len", "32", "--data.global_batch_size", "4", "--data.val_batches", "1", "--trainer.max_steps", "1",
        "--trainer.val_check_interval", "100", "--checkpoint.every_n_steps", "100", "--trainer.enable_progress_bar",
        "false", "--trainer.enable_model_summary", "false", "--trainer.logger", "false", *options,
    ])  # fmt: skip


def _required(precision: str) -> list[str]:
    fmt = FORMAT_OF[precision]
    dtypes = [name.partition(".")[2] for name in REQUIRED_DTYPES[fmt] if name.startswith("torch_npu.")]
    return [*REQUIRED_OPS[fmt], *dtypes]


@pytest.mark.parametrize(
    ("precision", "piece"), [(p, piece) for p in ("mxfp8", "hif8") for piece in _required(p)]
)
def test_a_fake_missing_any_required_piece_fails_at_startup_naming_it(
    npu_node, model_builds, token_cache_dir, tmp_path, capsys, isolated_dist, precision, piece
):
    npu_node(missing=(piece,))
    assert _fit(tmp_path / "run", token_cache_dir, "--precision", precision) == 1
    err = capsys.readouterr().err
    assert model_builds == []  # stage: startup, before the model is built
    (line,) = [line for line in err.splitlines() if line.startswith("lp-lightning: startup gate:")]
    assert f"torch_npu.{piece}" in line and len(line) < 300
    assert "[FAILED]" in err and "lp-lightning startup gate (design spec §15)" in err
    assert not (tmp_path / "run" / "run_summary.json").exists()


@pytest.mark.parametrize("precision", ["mxfp8", "hif8"])
def test_a_complete_fake_runs_every_quantise_and_gemm_through_torch_npu(
    npu_node, model_builds, token_cache_dir, tmp_path, monkeypatch, isolated_dist, precision
):
    fake = npu_node()
    op_backend.get_backend_impl("emulated")  # loaded, so the stand-in below replaces it
    monkeypatch.setitem(op_backend._LOADED, "emulated", _NoEmulation())
    for quantizer in (MXFP8Quantizer, HiF8Quantizer):  # nor the portable quantizers (the fake uses the codecs)
        for method in ("quantize", "quantize_dual"):
            monkeypatch.setattr(quantizer, method, _portable_quantizer_called)
    root = tmp_path / "run"
    assert _fit(root, token_cache_dir, "--precision", precision) == 0
    assert model_builds == ["dsv3-tiny"]
    summary = json.loads((root / "run_summary.json").read_text())
    assert summary["backend"] == "npu" and summary["startup_gate"]["ok"]
    assert summary["startup_gate"]["requested"] == "auto" and summary["startup_gate"]["device_type"] == "npu"
    kernels = summary["kernels"]
    gemms = sum(kernels[role] for role in kernels if role.startswith(("dense.", "grouped.")))
    assert gemms > 0 and kernels["backends"] == {"npu": gemms}
    ops = [call.name for call in fake.calls if not call.name.startswith("npu.")]
    assert sum(name in TORCH_NPU_OPS for name in ops) == gemms
    quantise_ops = {name for name in ops if name not in TORCH_NPU_OPS}
    assert quantise_ops, "no quantisation reached torch_npu"
    assert quantise_ops <= set(REQUIRED_OPS[FORMAT_OF[precision]])
    assert summary["versions"]["torch_npu"] is None  # the fake is not an installed distribution


def test_backend_emulated_is_the_only_way_to_emulate_on_the_npu_accelerator(
    npu_node, token_cache_dir, tmp_path, isolated_dist
):
    fake = npu_node()
    root = tmp_path / "run"
    assert _fit(root, token_cache_dir, "--precision", "mxfp8", "--backend", "emulated") == 0
    summary = json.loads((root / "run_summary.json").read_text())
    assert summary["backend"] == "emulated" and summary["startup_gate"]["requested"] == "emulated"
    assert set(summary["kernels"]["backends"]) == {"emulated"}
    assert [c.name for c in fake.calls if not c.name.startswith("npu.")] == []


def test_auto_on_an_npu_without_the_ops_is_an_error_not_emulation(
    npu_node, model_builds, token_cache_dir, tmp_path, capsys, isolated_dist
):
    npu_node(missing=("npu_grouped_matmul",))
    assert _fit(tmp_path / "run", token_cache_dir, "--precision", "mxfp8", "--backend", "auto") == 1
    assert model_builds == [] and "torch_npu.npu_grouped_matmul" in capsys.readouterr().err


def test_bf16_on_the_npu_accelerator_checks_the_hardware_rows(npu_node, token_cache_dir, tmp_path, isolated_dist):
    npu_node()
    root = tmp_path / "run"
    assert _fit(root, token_cache_dir) == 0
    gate = json.loads((root / "run_summary.json").read_text())["startup_gate"]
    assert gate["backend"] == "none" and gate["format"] is None
    assert [c["name"] for c in gate["checks"]] == [
        "torch_npu installed", "torch_npu version", "torch_npu matches torch", "NPU device",
    ]  # fmt: skip


def test_bf16_with_a_torch_npu_of_another_torch_line_fails_at_startup(
    monkeypatch, model_builds, token_cache_dir, tmp_path, capsys, isolated_dist
):
    with npu_unregistered():
        install(monkeypatch, add_device_apis(FakeTorchNpu(version="2.9.0")))
        map_devices_to_cpu(monkeypatch)
        assert _fit(tmp_path / "run", token_cache_dir) == 1
    err = capsys.readouterr().err
    assert model_builds == [] and "torch_npu 2.9.0 is built for torch 2.9" in err and "pip install torch==2.13.0 torch-npu==2.13.0" in err
