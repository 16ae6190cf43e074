"""Precision plugins: choices, FSDP2 policy, conversion seam, applied-step accounting."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lp_lightning.lightning.precision import SUPPORTED_PRECISIONS, LowPrecisionFabricPlugin, LowPrecisionPlugin


@pytest.mark.parametrize("cls", [LowPrecisionFabricPlugin, LowPrecisionPlugin])
def test_bf16_plugin(cls):
    plugin = cls("bf16")
    assert plugin.mode == "bf16" and plugin.backend == "none" and plugin.precision == "bf16-mixed"
    policy = plugin.fsdp_mixed_precision_policy()
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    module = nn.Linear(4, 4)
    assert plugin.convert_module(module) is module  # bf16 replaces nothing


@pytest.mark.parametrize("bad", ["mxfp8", "hif8", "fp16", "bf16-mixed"])
def test_unknown_precision_names_the_choices(bad):
    with pytest.raises(ValueError, match=rf"precision='{bad}' is not supported; choose one of \['bf16'\]"):
        LowPrecisionPlugin(bad)
    assert SUPPORTED_PRECISIONS == ("bf16",)


def test_fabric_plugin_counts_every_returned_step():
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.5)
    plugin = LowPrecisionFabricPlugin("bf16")
    param.grad = torch.ones(2)
    plugin.optimizer_step(optimizer)
    assert plugin.optimizer_steps_applied == 1 and plugin.last_step_applied
    assert torch.equal(param.detach(), torch.full((2,), 0.5))


def test_trainer_plugin_counts_only_steps_whose_closure_produced_a_loss(monkeypatch):
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.5)
    plugin = LowPrecisionPlugin("bf16")
    # No Trainer here: skip Lightning's post-closure hooks (callbacks, gradient clipping).
    monkeypatch.setattr(Precision, "_after_closure", lambda self, model, optimizer: None)
    model = nn.Linear(1, 1)

    def closure_with_loss():
        param.grad = torch.ones(2)
        return torch.tensor(1.0)

    assert plugin.optimizer_step(optimizer, model, closure_with_loss) is not None
    assert plugin.last_step_applied and plugin.optimizer_steps_applied == 1
    assert plugin.optimizer_step(optimizer, model, lambda: None) is None  # training_step skipped
    assert not plugin.last_step_applied and plugin.optimizer_steps_applied == 1


def test_state_dict_round_trip_and_precision_mismatch():
    plugin = LowPrecisionPlugin("bf16")
    plugin.optimizer_steps_applied = 7
    restored = LowPrecisionPlugin("bf16")
    restored.load_state_dict(plugin.state_dict())
    assert restored.optimizer_steps_applied == 7
    with pytest.raises(ValueError, match=r"trained with precision='mxfp8'.*--precision mxfp8"):
        restored.load_state_dict({"mode": "mxfp8", "optimizer_steps_applied": 1})
