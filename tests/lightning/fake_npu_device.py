"""The device side of a fake ``torch_npu`` for tests of the ``npu`` accelerator (no NPU needed).

:func:`add_device_apis` gives a :class:`FakeTorchNpu` (``tests/ops/fake_torch_npu.py``, the op
fake) the ``torch_npu.npu`` device API the accelerator, the strategies and the run summary call:
``is_available``, ``device_count``, ``set_device``, ``current_device``, ``memory_stats``,
``max_memory_allocated``, ``reset_peak_memory_stats``, ``empty_cache``, ``synchronize``,
``get_device_name``. Each call is appended to ``fake.calls`` as ``CallRecord("npu.<name>", args)``.
The memory numbers are the fake's own bookkeeping (``fake.npu.allocated_bytes`` /
``peak_allocated_bytes``, set by the test), never a statement about a device.

:func:`install` puts the fake in ``sys.modules["torch_npu"]`` with a module spec (so
``importlib.util.find_spec("torch_npu")`` finds it) and renames PyTorch's PrivateUse1 device type
to ``"npu"`` as the real torch_npu does on import, so ``torch.device("npu", i)`` exists. That rename
is process-wide and cannot be undone (creating such a device allocates nothing); every other change
is undone by the test's ``monkeypatch``.

:func:`map_devices_to_cpu` is the acceptance's "fake device mapped to CPU memory": the accelerator
places on ``cpu`` devices, so tensors live in CPU memory and the strategies pick the gloo
backend and a ``cpu`` mesh by device type, while every device call still goes to the fake.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.accelerators import ACCELERATOR_REGISTRY
from lightning.pytorch.accelerators import AcceleratorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ops"))  # the op fake lives with the op tests
from fake_torch_npu import CallRecord, FakeTorchNpu  # noqa: E402

from lp_lightning.lightning import accelerator  # noqa: E402

__all__ = [
    "CallRecord", "FakeTorchNpu", "add_device_apis", "device_calls", "install", "map_devices_to_cpu", "npu_unregistered",
]


def add_device_apis(fake: FakeTorchNpu, *, device_count: int = 8, available: bool = True) -> FakeTorchNpu:
    """Replaces ``fake.npu`` by a recording device API over ``device_count`` NPUs (module docstring).

    ``available=False`` makes ``npu.is_available()`` answer False (no usable NPU).
    """
    device_name = fake.npu.get_device_name()
    state = {"current": 0}

    def recorded(name: str, result: Any = None):
        def call(*args: Any, **kwargs: Any) -> Any:
            fake.calls.append(CallRecord(f"npu.{name}", {"args": args, **kwargs}))
            return result(*args, **kwargs) if callable(result) else result

        return call

    def set_device(device: torch.device | int) -> None:
        state["current"] = device if isinstance(device, int) else (device.index or 0)

    def memory_stats(device: Any = None) -> dict[str, int]:
        return {"allocated_bytes.all.current": npu.allocated_bytes, "allocated_bytes.all.peak": npu.peak_allocated_bytes}

    npu = types.SimpleNamespace(allocated_bytes=0, peak_allocated_bytes=0)
    npu.is_available = recorded("is_available", available)
    npu.device_count = recorded("device_count", device_count)
    npu.get_device_name = recorded("get_device_name", device_name)
    npu.set_device = recorded("set_device", set_device)
    npu.current_device = recorded("current_device", lambda: state["current"])
    npu.memory_stats = recorded("memory_stats", memory_stats)
    npu.max_memory_allocated = recorded("max_memory_allocated", lambda device=None: npu.peak_allocated_bytes)
    npu.reset_peak_memory_stats = recorded("reset_peak_memory_stats")
    npu.empty_cache = recorded("empty_cache")
    npu.synchronize = recorded("synchronize")
    fake.npu = npu
    return fake


def device_calls(fake: FakeTorchNpu, name: str) -> list[CallRecord]:
    """The recorded calls of ``torch_npu.npu.<name>``."""
    return [c for c in fake.calls if c.name == f"npu.{name}"]


def install(monkeypatch: pytest.MonkeyPatch, fake: FakeTorchNpu) -> FakeTorchNpu:
    """Makes ``fake`` the importable ``torch_npu`` for one test (module docstring)."""
    fake.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


def name_npu_device_type() -> None:
    """Renames PyTorch's PrivateUse1 device type to ``"npu"``, as ``import torch_npu`` does, so that
    ``torch.device("npu", i)`` exists. Only for a fresh subprocess: the rename is process-wide and
    final, and without torch_npu's device hooks ``torch.distributed`` collectives then fail."""
    torch.utils.rename_privateuse1_backend("npu")


@contextlib.contextmanager
def npu_unregistered() -> Iterator[None]:
    """Both Lightning accelerator registries without ``"npu"`` inside, as they were after.

    (``monkeypatch.delitem`` cannot be used: the registries' ``get`` instantiates the accelerator.)
    """
    registries = (AcceleratorRegistry, ACCELERATOR_REGISTRY)
    saved = [dict.pop(registry, accelerator.NAME, None) for registry in registries]
    try:
        yield
    finally:
        for registry, entry in zip(registries, saved):
            dict.pop(registry, accelerator.NAME, None)
            if entry is not None:
                registry[accelerator.NAME] = entry


def map_devices_to_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerator's devices become ``cpu`` devices for one test (module docstring)."""
    monkeypatch.setattr(accelerator, "DEVICE_TYPE", "cpu")
