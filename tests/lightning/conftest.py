"""Fixtures of the Lightning-layer tests: a shared token cache and a fake NPU (``isolated_dist`` is in ``tests/conftest.py``)."""

from __future__ import annotations

import pytest

from lp_lightning.data import build_token_cache


@pytest.fixture(scope="session")
def token_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A token cache of the default stdlib corpus (byte tokenizer), built once per session."""
    path = tmp_path_factory.mktemp("tokens")
    build_token_cache(None, "byte", path)
    return str(path)


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
