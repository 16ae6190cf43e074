"""Fixtures for the op tests: a recording fake ``torch_npu`` and a fresh capability cache."""

from __future__ import annotations

import sys

import pytest

from fake_torch_npu import FakeTorchNpu
from lp_lightning.ops.npu import clear_capability_cache


@pytest.fixture(autouse=True)
def _reset_backend():
    clear_capability_cache()
    yield
    clear_capability_cache()


@pytest.fixture
def install_fake_npu(monkeypatch):
    """Factory: ``install_fake_npu(**FakeTorchNpu kwargs)`` puts a fake in ``sys.modules``."""

    def install(**kwargs) -> FakeTorchNpu:
        fake = FakeTorchNpu(**kwargs)
        monkeypatch.setitem(sys.modules, "torch_npu", fake)
        clear_capability_cache()
        return fake

    return install


@pytest.fixture
def fake_npu(install_fake_npu) -> FakeTorchNpu:
    """A fake Ascend 950 torch_npu with every op, installed for one test."""
    return install_fake_npu()


@pytest.fixture
def no_torch_npu(monkeypatch):
    """Make ``import torch_npu`` fail as if it were not installed."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    clear_capability_cache()
