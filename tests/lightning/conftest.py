"""Fixtures of the Lightning-layer tests: a fake NPU (``isolated_dist`` and ``token_cache_dir`` are in ``tests/conftest.py``)."""

from __future__ import annotations

import pytest


@pytest.fixture
def npu_unregistered():
    """Lightning's accelerator registries without ``"npu"`` for the test (restored after), so a test
    sees lp-lightning register it (``tests/lightning/fake_npu_device.py``)."""
    from fake_npu_device import npu_unregistered

    with npu_unregistered():
        yield


@pytest.fixture
def fake_npu(npu_unregistered, monkeypatch):
    """A recording fake ``torch_npu`` with 8 NPUs as ``sys.modules["torch_npu"]``; ``"npu"`` not yet
    registered with Lightning (``tests/lightning/fake_npu_device.py``)."""
    from fake_npu_device import FakeTorchNpu, add_device_apis, install

    return install(monkeypatch, add_device_apis(FakeTorchNpu()))


@pytest.fixture
def fake_npu_on_cpu(fake_npu, monkeypatch):
    """:func:`fake_npu` with the accelerator's devices mapped to CPU memory (gloo, ``cpu`` mesh)."""
    from fake_npu_device import map_devices_to_cpu

    map_devices_to_cpu(monkeypatch)
    return fake_npu
