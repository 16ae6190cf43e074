"""``HCCL_DETERMINISTIC`` for a deterministic run on the npu accelerator (lp_lightning/lightning/hccl.py, docs/hccl.md)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from lightning.fabric import Fabric

from lp_lightning.lightning import BF16FabricPlugin, FSDP2FabricStrategy
from lp_lightning.lightning.hccl import HCCL_DETERMINISTIC, apply_hccl_determinism


def _deterministic_algorithms(enabled: bool):
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    yield
    torch.use_deterministic_algorithms(before)


@pytest.fixture
def deterministic():
    """``torch.use_deterministic_algorithms(True)`` for one test (restored after)."""
    yield from _deterministic_algorithms(True)


@pytest.fixture
def not_deterministic():
    """``torch.use_deterministic_algorithms(False)`` for one test (a deterministic fit earlier leaves it on)."""
    yield from _deterministic_algorithms(False)


def test_off_the_npu_accelerator_nothing_is_done(deterministic):
    env: dict[str, str] = {}
    assert apply_hccl_determinism(on_npu=False, environ=env) is None and env == {}


def test_a_deterministic_run_sets_it_when_unset(deterministic):
    env: dict[str, str] = {}
    result = apply_hccl_determinism(on_npu=True, environ=env)
    assert env == {HCCL_DETERMINISTIC: "true"}
    assert result.as_dict() == {"requested": True, "variable": HCCL_DETERMINISTIC, "value": "true",
                                "set_by": "lp-lightning", "deterministic": True}


def test_a_run_that_is_not_deterministic_leaves_it_unset(not_deterministic):
    env: dict[str, str] = {}
    result = apply_hccl_determinism(on_npu=True, environ=env)
    assert env == {} and (result.requested, result.value, result.set_by, result.deterministic) == (
        False, None, "unset", False)


@pytest.mark.parametrize("value, deterministic_value", [("strict", True), ("true", True), ("TRUE", True)])
def test_the_users_value_is_kept(deterministic, value, deterministic_value):
    env = {HCCL_DETERMINISTIC: value}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for a deterministic value
        result = apply_hccl_determinism(on_npu=True, environ=env)
    assert env == {HCCL_DETERMINISTIC: value}
    assert (result.value, result.set_by, result.deterministic) == (value, "user", deterministic_value)


def test_a_user_false_in_a_deterministic_run_is_kept_and_warned_about(deterministic):
    env = {HCCL_DETERMINISTIC: "false"}
    with pytest.warns(UserWarning, match=r"HCCL_DETERMINISTIC='false' with a deterministic run.*set it to true"):
        result = apply_hccl_determinism(on_npu=True, environ=env)
    assert env == {HCCL_DETERMINISTIC: "false"} and result.set_by == "user" and not result.deterministic


def test_the_strategy_sets_it_before_the_process_group(fake_npu_on_cpu, isolated_dist, deterministic, monkeypatch):
    seen: list[str | None] = []
    strategy = FSDP2FabricStrategy()
    original = strategy._setup_distributed
    monkeypatch.setattr(strategy, "_setup_distributed", lambda: (seen.append(os.environ.get(HCCL_DETERMINISTIC)),
                                                                 original())[1])
    fabric = Fabric(accelerator="npu", devices=1, strategy=strategy, plugins=[BF16FabricPlugin()])
    fabric.launch()
    assert seen == ["true"] and os.environ[HCCL_DETERMINISTIC] == "true"
    assert strategy.hccl_determinism.set_by == "lp-lightning"
    fabric.accelerator.teardown()
