"""The ``npu`` accelerator (lp_lightning/lightning/accelerator.py) with a recording fake torch_npu.

No NPU is needed. ``fake_npu`` (tests/lightning/conftest.py) installs the fake device API of
tests/lightning/fake_npu_device.py as ``torch_npu``; ``fake_npu_on_cpu`` also maps the accelerator's
devices to CPU memory so Trainer, Fabric and the CLI can fit the tiny model in this process (the
strategies then choose gloo and a ``cpu`` mesh by device type). ``torch.device("npu", i)`` only
exists once torch_npu renamed PyTorch's PrivateUse1 device type, which breaks ``torch.distributed``
in a process without torch_npu's device hooks; the tests that need real ``npu`` devices (placement
under ``torchrun``, hccl, the ``npu`` mesh, the run summary's peak memory) therefore run in a fresh
subprocess that does that rename and never starts a process group.
"""

from __future__ import annotations

import csv
import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _inprocess import fit_tiny, tiny_datamodule
from fake_npu_device import FakeTorchNpu, add_device_apis, device_calls, install
from lightning.fabric import Fabric
from lightning.fabric.accelerators import ACCELERATOR_REGISTRY
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.callbacks import DeviceStatsMonitor
from lightning.pytorch.loggers import CSVLogger

import lp_lightning.models.deepseek_v3 as deepseek_v3
from lp_lightning.cli import main
from lp_lightning.cli.fit import parse_config
from lp_lightning.lightning import (
    BF16FabricPlugin,
    FSDP2FabricStrategy,
    FSDP2Strategy,
    NPUAccelerator,
    NPUFabricAccelerator,
    register_npu_accelerator,
)
from lp_lightning.lightning.accelerator import parse_npu_devices
from lp_lightning.models.deepseek_v3 import from_hf_config

REPO = Path(__file__).resolve().parents[2]
CPU0 = torch.device("cpu", 0)


def _registered() -> tuple[object, object]:
    """The classes registered as ``"npu"`` in the Trainer and the Fabric registry (``None`` if absent)."""
    return tuple(dict.get(r, "npu", {}).get("accelerator") for r in (AcceleratorRegistry, ACCELERATOR_REGISTRY))


# -- registration -------------------------------------------------------------------------------


def test_not_registered_without_torch_npu(npu_unregistered, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu fails: not installed
    assert register_npu_accelerator() is False
    assert _registered() == (None, None)
    FSDP2Strategy()  # building a strategy tries again
    assert _registered() == (None, None)


def test_registered_when_importable_without_importing_torch_npu(npu_unregistered, monkeypatch, tmp_path):
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('torch_npu was imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    importlib.invalidate_caches()

    assert register_npu_accelerator() is True
    assert _registered() == (NPUAccelerator, NPUFabricAccelerator)
    entries = [dict.get(r, "npu") for r in (AcceleratorRegistry, ACCELERATOR_REGISTRY)]
    assert register_npu_accelerator() is True  # idempotent: the same entries, no "already present" error
    assert [dict.get(r, "npu") for r in (AcceleratorRegistry, ACCELERATOR_REGISTRY)] == entries
    assert "torch_npu" not in sys.modules


def test_an_npu_accelerator_registered_by_another_package_is_kept(fake_npu):
    class OtherNPUAccelerator(NPUAccelerator):
        pass

    AcceleratorRegistry.register("npu", OtherNPUAccelerator)
    register_npu_accelerator()
    assert _registered() == (OtherNPUAccelerator, NPUFabricAccelerator)


def test_a_strategy_registers_a_torch_npu_installed_after_import(fake_npu):
    assert _registered() == (None, None)  # lp_lightning.lightning was imported before the fake existed
    FSDP2FabricStrategy()
    assert _registered() == (NPUAccelerator, NPUFabricAccelerator)
    assert NPUAccelerator.name() == NPUFabricAccelerator.name() == "npu"


# -- devices ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        (1, [0]), (3, [0, 1, 2]), ([2, 5], [2, 5]), ("0,3", [0, 3]), ("2", [0, 1]),
        (-1, list(range(8))), ("-1", list(range(8))), ("auto", list(range(8))), ((), None),
        (0, None), ("0", None), ([], None),
    ],
)  # fmt: skip
def test_parse_devices(fake_npu, devices, expected):
    assert NPUAccelerator.parse_devices(devices) == expected == NPUFabricAccelerator.parse_devices(devices)


@pytest.mark.parametrize(
    ("devices", "error", "message"),
    [
        ([1, 1], MisconfigurationException, "must be unique"),
        (9, MisconfigurationException, r"devices=9 selects NPU\(s\) \[8\], but torch_npu.npu.device_count\(\) is 8"),
        ([0, 8], MisconfigurationException, r"selects NPU\(s\) \[8\]"),
        (-2, MisconfigurationException, "devices=-2 is not valid for the npu accelerator"),
        (1.5, TypeError, "must be an int, a string, a sequence of ints"),
    ],
)
def test_parse_devices_errors(fake_npu, devices, error, message):
    with pytest.raises(error, match=message):
        parse_npu_devices(devices)


def test_parse_devices_without_a_visible_npu(npu_unregistered, monkeypatch):
    install(monkeypatch, add_device_apis(FakeTorchNpu(), device_count=0))
    with pytest.raises(MisconfigurationException, match=r"asks for every NPU, but torch_npu.npu.device_count\(\) is 0"):
        parse_npu_devices("auto")


def test_torchrun_process_may_see_only_its_own_npu(npu_unregistered, monkeypatch):
    """As Lightning's CUDA parsing: under torchrun one visible device does not refuse ``devices=8``."""
    install(monkeypatch, add_device_apis(FakeTorchNpu(), device_count=1))
    with pytest.raises(MisconfigurationException, match="device_count"):
        parse_npu_devices(8)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert parse_npu_devices(8) == list(range(8))


def test_device_calls_go_to_torch_npu(fake_npu_on_cpu):
    fake = fake_npu_on_cpu
    accelerator = NPUAccelerator()
    assert accelerator.get_parallel_devices([0, 3]) == [CPU0, torch.device("cpu", 3)]  # mapped to CPU memory
    accelerator.setup_device(torch.device("cpu", 3))
    fake.npu.peak_allocated_bytes = 4096
    assert accelerator.get_device_stats(CPU0)["allocated_bytes.all.peak"] == 4096
    accelerator.teardown()
    assert NPUAccelerator.auto_device_count() == 8 and NPUAccelerator.is_available()
    assert [(c.name, c.args["args"]) for c in fake.calls] == [
        ("npu.set_device", (torch.device("cpu", 3),)), ("npu.memory_stats", (CPU0,)), ("npu.empty_cache", ()),
        ("npu.device_count", ()), ("npu.is_available", ()),
    ]  # fmt: skip


def test_setup_device_refuses_another_device_type(fake_npu):
    with pytest.raises(ValueError, match="the npu accelerator sets up npu devices; got cpu"):
        NPUFabricAccelerator().setup_device(torch.device("cpu"))
    assert device_calls(fake_npu, "set_device") == []


def test_is_available_false_without_an_npu_or_torch_npu(npu_unregistered, monkeypatch):
    install(monkeypatch, add_device_apis(FakeTorchNpu(), available=False))
    assert NPUAccelerator.is_available() is False
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    assert NPUAccelerator.is_available() is False


_NPU_DEVICE_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import pytest, torch
    sys.path.insert(0, sys.argv[1])
    from fake_npu_device import FakeTorchNpu, add_device_apis, install, name_npu_device_type

    mp = pytest.MonkeyPatch()
    fake = install(mp, add_device_apis(FakeTorchNpu()))
    name_npu_device_type()
    # Process 11 of 16: node 1, LOCAL_RANK 3, started by torchrun.
    os.environ.update(TORCHELASTIC_RUN_ID="job", LOCAL_RANK="3", RANK="11", GROUP_RANK="1", WORLD_SIZE="16",
                      LOCAL_WORLD_SIZE="8", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")

    import lightning.fabric.strategies.model_parallel as fabric_mp
    import lightning.pytorch as pl
    import lightning.pytorch.strategies.model_parallel as trainer_mp
    from lightning.fabric import Fabric
    import lp_lightning.lightning.strategy as strategy_module
    from lp_lightning.lightning import BF16FabricPlugin, BF16Plugin, FSDP2FabricStrategy, FSDP2Strategy, NPUAccelerator
    from lp_lightning.telemetry.summary import _peak_memory_bytes

    calls = []
    init = lambda env, backend, **kwargs: calls.append(["init_process_group", backend, str(kwargs["device_id"])])
    mp.setattr(trainer_mp, "_init_dist_connection", init)
    mp.setattr(fabric_mp, "_init_dist_connection", init)
    mp.setattr(strategy_module, "build_dp_mesh", lambda device_type, size: calls.append(["mesh", device_type, size]))

    out = {"parallel_devices": [str(d) for d in NPUAccelerator.get_parallel_devices([0, 3])]}
    trainer = pl.Trainer(accelerator="npu", devices=8, num_nodes=2, strategy=FSDP2Strategy(),
                         plugins=[BF16Plugin()], logger=False)
    strategy = trainer.strategy
    out["trainer"] = [type(trainer.accelerator).__name__, type(strategy.cluster_environment).__name__,
                      str(strategy.root_device), strategy.global_rank, strategy.world_size]
    strategy._setup_distributed()
    strategy._build_dp_shard_mesh()
    fabric = Fabric(accelerator="npu", devices=8, num_nodes=2, strategy=FSDP2FabricStrategy(),
                    plugins=[BF16FabricPlugin()])
    out["fabric"] = [type(fabric.accelerator).__name__, str(fabric.device), fabric.global_rank, fabric.world_size]
    fabric.strategy.setup_environment()
    fake.npu.peak_allocated_bytes = 123456789
    out["peak"] = list(_peak_memory_bytes(torch.device("npu", 3)))
    out["stats"] = NPUAccelerator().get_device_stats(torch.device("npu", 3))["allocated_bytes.all.peak"]
    out["calls"] = calls
    out["torch_npu_calls"] = [[c.name, [str(a) for a in c.args["args"]]] for c in fake.calls
                              if c.name in ("npu.set_device", "npu.max_memory_allocated", "npu.memory_stats")]
    print(json.dumps(out))
    """
)


def test_npu_devices_hccl_and_mesh_per_torchrun_rank(tmp_path):
    """``torchrun`` on 2 nodes x 8 NPUs, process LOCAL_RANK=3 of node 1: ``npu:3``, hccl, an ``npu`` mesh.

    Trainer and Fabric, in a fresh process with real ``npu`` devices (module docstring); the process
    group and the mesh are recorded instead of created.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", _NPU_DEVICE_SCRIPT, str(Path(__file__).parent)],
                            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["parallel_devices"] == ["npu:0", "npu:3"]
    assert out["trainer"] == ["NPUAccelerator", "TorchElasticEnvironment", "npu:3", 11, 16]
    assert out["fabric"] == ["NPUFabricAccelerator", "npu:3", 11, 16]
    assert out["calls"] == [["init_process_group", "hccl", "npu:3"], ["mesh", "npu", 16]] * 2
    assert out["peak"] == [123456789, "max_memory_allocated"] and out["stats"] == 123456789
    assert out["torch_npu_calls"] == [
        ["npu.set_device", ["npu:3"]], ["npu.set_device", ["npu:3"]], ["npu.max_memory_allocated", ["npu:3"]],
        ["npu.memory_stats", ["npu:3"]],
    ]  # fmt: skip


# -- fit on the fake NPU (mapped to CPU memory) ----------------------------------------------------


def test_trainer_fits_on_the_npu_accelerator(fake_npu_on_cpu, token_cache_dir, tmp_path, isolated_dist):
    fake = fake_npu_on_cpu
    fake.npu.peak_allocated_bytes = 777
    trainer, _, summary = fit_tiny(
        tmp_path, datamodule=tiny_datamodule(token_cache_dir), accelerator="npu", log_every_n_steps=1,
        logger=CSVLogger(tmp_path, name="logs"), callbacks=[DeviceStatsMonitor(cpu_stats=True)],
    )  # fmt: skip
    assert isinstance(trainer.accelerator, NPUAccelerator) and isinstance(trainer.strategy, FSDP2Strategy)
    assert trainer.strategy.root_device == CPU0 and trainer.strategy._process_group_backend == "gloo"
    assert summary["steps"] == 2
    # fit_tiny is deterministic: the strategy set HCCL_DETERMINISTIC before the process group.
    assert summary["determinism"]["hccl"] == {"requested": True, "variable": "HCCL_DETERMINISTIC", "value": "true",
                                              "set_by": "lp-lightning", "deterministic": True}
    assert [c.args["args"] for c in device_calls(fake, "set_device")] == [(CPU0,)]
    assert len(device_calls(fake, "memory_stats")) == 4  # DeviceStatsMonitor: start and end of 2 batches
    assert len(device_calls(fake, "empty_cache")) == 1  # teardown
    with open(trainer.logger.experiment.metrics_file_path) as handle:
        rows = list(csv.DictReader(handle))
    logged = [r["DeviceStatsMonitor.on_train_batch_end/allocated_bytes.all.peak"] for r in rows]
    assert [v for v in logged if v] == ["777", "777"]


def test_fabric_fits_on_the_npu_accelerator(fake_npu_on_cpu, isolated_dist):
    fabric = Fabric(accelerator="npu", devices=1, strategy=FSDP2FabricStrategy(),
                    plugins=[BF16FabricPlugin()])
    fabric.launch()
    assert isinstance(fabric.accelerator, NPUFabricAccelerator) and fabric.device == CPU0
    model = fabric.setup_module(from_hf_config("dsv3-tiny", seed=0))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids_BT = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(0), device=fabric.device)
    losses = []
    for _ in range(2):
        logits = model(input_ids=ids_BT[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids_BT[:, 1:].flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert fabric.strategy.precision.optimizer_steps_applied == 2 and losses[1] < losses[0]
    fabric.accelerator.teardown()  # (Fabric's ModelParallelStrategy.teardown raises on its checkpoint_io)
    # launch() sets the device up, and Fabric again when it moves the module (fabric.to_device).
    names = [c.name for c in fake_npu_on_cpu.calls if c.name in ("npu.set_device", "npu.empty_cache")]
    assert names == ["npu.set_device", "npu.set_device", "npu.empty_cache"]
    assert {c.args["args"] for c in device_calls(fake_npu_on_cpu, "set_device")} == {(CPU0,)}


def test_cli_fit_with_trainer_accelerator_npu(fake_npu_on_cpu, token_cache_dir, tmp_path, isolated_dist):
    root = tmp_path / "run"
    status = main([
        "fit", "--trainer.accelerator", "npu", "--trainer.default_root_dir", str(root),
        "--data.cache_dir", token_cache_dir, "--data.seq_len", "32", "--data.global_batch_size", "4",
        "--data.val_batches", "1", "--trainer.max_steps", "1", "--checkpoint.every_n_steps", "100",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false", "--trainer.logger", "false",
    ])  # fmt: skip
    assert status == 0
    assert _registered() == (NPUAccelerator, NPUFabricAccelerator)  # registered by the CLI run
    assert [c.args["args"] for c in device_calls(fake_npu_on_cpu, "set_device")] == [(CPU0,)]
    assert json.loads((root / "run_summary.json").read_text())["steps"] == 1


# -- clear errors while parsing ----------------------------------------------------------------------


@pytest.fixture
def no_model_build(monkeypatch):
    calls = []
    monkeypatch.setattr(deepseek_v3, "from_hf_config", lambda *a, **k: calls.append(a))
    return calls


def _broken_torch_npu(monkeypatch, tmp_path) -> None:
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ImportError('libascendcl.so: cannot open shared object file: No such file or directory')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    importlib.invalidate_caches()


@pytest.mark.parametrize(
    ("torch_npu", "message"),
    [
        ("missing", "trainer.accelerator='npu' needs torch_npu, which is not installed; install it with "
                    "pip install torch==2.13.0 torch-npu==2.13.0 (a torch/torch_npu pair; source CANN's set_env.sh)."),
        ("broken", "trainer.accelerator='npu': torch_npu is installed but fails to import (libascendcl.so: cannot "
                   "open shared object file"),
        ("no_device", "trainer.accelerator='npu': torch_npu.npu.is_available() is False"),
    ],
)  # fmt: skip
def test_npu_without_a_usable_torch_npu_fails_while_parsing(
    npu_unregistered, monkeypatch, tmp_path, capsys, no_model_build, torch_npu, message
):
    if torch_npu == "missing":
        monkeypatch.setitem(sys.modules, "torch_npu", None)
    elif torch_npu == "broken":
        _broken_torch_npu(monkeypatch, tmp_path)
    else:
        install(monkeypatch, add_device_apis(FakeTorchNpu(), available=False))
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--trainer.accelerator", "npu"])
    assert exc.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert message in err and "Traceback" not in err and "Available names are" not in err
    assert no_model_build == []
    # Checked at launch only: a YAML for the NPU node still validates on a machine without one.
    assert parse_config(["--config", str(REPO / "configs" / "dsv3_16b_bf16.yaml")]).trainer.accelerator == "npu"
