"""Precision plugins: choices, FSDP2 policy, conversion, checked optimizer step, refresh, resume state."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lp_lightning.checkpoint.finite import NonFiniteStateError
from lp_lightning.formats import compiled_kernels_enabled, set_compiled_kernels
from lp_lightning.lightning.low_precision import LowPrecisionFabricPlugin, LowPrecisionPlugin
from lp_lightning.lightning.precision import SUPPORTED_PRECISIONS, BF16FabricPlugin, BF16Plugin, precision_plugin


@pytest.fixture
def eager_codecs():
    """Plumbing tests: eager codec kernels (bit-identical to the fused ones), no compile warm-up."""
    previous = compiled_kernels_enabled()
    set_compiled_kernels(False)
    yield
    set_compiled_kernels(previous)


@pytest.mark.parametrize("cls", [BF16FabricPlugin, BF16Plugin])
def test_bf16_plugin(cls):
    plugin = cls()
    assert plugin.mode == "bf16" and plugin.backend == "none" and plugin.precision == "bf16-mixed"
    assert plugin.policy.enabled is False
    policy = plugin.fsdp_mixed_precision_policy()
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    module = nn.Linear(4, 4)
    weight = module.weight
    assert plugin.convert_module(module) is module and module.weight is weight  # bf16 replaces nothing
    assert plugin.replacement_report is None


def test_one_factory_picks_the_plugin():
    """precision_plugin: bf16 -> the BF16 plugins, mxfp8/hif8 -> the low-precision ones; each refuses the other's mode."""
    assert type(precision_plugin("bf16")) is BF16Plugin and type(precision_plugin("bf16", trainer=False)) is BF16FabricPlugin
    plugin = precision_plugin("hif8", backend="emulated", max_consecutive_skips=5)
    assert type(plugin) is LowPrecisionPlugin and plugin.mode == "hif8" and plugin.guard.max_consecutive_skips == 5
    assert plugin.policy.backend == "emulated" and plugin.gate.requested == "emulated"
    assert type(precision_plugin("mxfp8", trainer=False)) is LowPrecisionFabricPlugin
    with pytest.raises(ValueError, match=r"precision='bf16' is the BF16 baseline: use precision_plugin\('bf16'\)"):
        LowPrecisionPlugin("bf16")
    with pytest.raises(ValueError, match=r"precision='fp8' is not supported"):
        precision_plugin("fp8")
    with pytest.raises(ValueError, match=r"precision='bf16' replaces no module, so plan_rules does not apply"):
        precision_plugin("bf16", plan_rules=[])
    assert type(precision_plugin("bf16", plan_rules=None)) is BF16Plugin


@pytest.mark.parametrize("bad", ["fp16", "bf16-mixed", "fp8", "mxfp4"])
def test_unknown_precision_names_the_choices(bad):
    with pytest.raises(ValueError, match=rf"precision='{bad}' is not supported; choose one of \['bf16', 'mxfp8', 'hif8'\]"):
        LowPrecisionPlugin(bad)
    assert SUPPORTED_PRECISIONS == ("bf16", "mxfp8", "hif8")


@pytest.mark.parametrize(("mode", "fmt", "scaling"), [("mxfp8", "mxfp8_e4m3", "mx_block"), ("hif8", "hif8", "current")])
def test_low_precision_modes_map_onto_the_policy(mode, fmt, scaling):
    plugin = LowPrecisionPlugin(mode)
    assert plugin.policy.as_dict() == {"enabled": True, "format": fmt, "scaling": scaling, "recipe_name": f"{fmt}_{scaling}"}
    assert plugin.backend == "emulated"  # CPU: no hardware kernel, labelled as emulation


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["mxfp8", "hif8"])
def test_convert_module_replaces_the_plan_and_finalizes_fp32_masters(mode, eager_codecs):
    from lp_lightning.tensor import QuantizedWeightTensor
    from lp_lightning.models.deepseek_v3 import from_hf_config

    model = from_hf_config("dsv3-tiny", seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    plugin = LowPrecisionPlugin(mode)
    assert plugin.convert_module(model) is model
    report = plugin.replacement_report
    assert report.counts == {"mla_projections": 12, "dense_mlp": 3, "shared_experts": 6, "routed_experts": 2}
    assert len(plugin.low_precision_weights) == 21 + 2 * 2
    assert list(model.state_dict()) == keys  # HF keys unchanged
    for name, param in model.named_parameters():
        if name in plugin.low_precision_weights:
            assert isinstance(param, QuantizedWeightTensor) and param.dtype == torch.float32, name
            assert param.is_built and param.refresh_count == 1, name  # no strategy: built at once
            assert torch.equal(param.master, before[name].float()), name  # BF16 -> FP32 is exact
        else:
            assert type(param) is nn.Parameter and torch.equal(param, before[name]), name
    with pytest.raises(RuntimeError, match="ran twice on .*: it is already converted"):
        plugin.convert_module(model)
    other = from_hf_config("dsv3-tiny", seed=1)
    with pytest.raises(RuntimeError, match=r"already converted another model \(25 low-precision weights\); one plugin serves one model"):
        plugin.convert_module(other)
    assert not any(isinstance(p, QuantizedWeightTensor) for p in other.parameters())  # nothing half-applied


class _Dense(nn.Module):
    low_precision_weight_names = ("weight",)
    low_precision_weight_kind = "dense"

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 64))
        self.bias = nn.Parameter(torch.zeros(64))


def _lp_params(mode: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    from lp_lightning.fsdp.weights import finalize_low_precision_weights

    module = _Dense()
    finalize_low_precision_weights(module, recipe=LowPrecisionPlugin(mode).policy)
    return module, torch.optim.AdamW(module.parameters(), lr=0.1)


@pytest.mark.parametrize("mode", ["mxfp8", "hif8"])
def test_fabric_step_refreshes_each_weight_once_and_skips_non_finite(mode, eager_codecs):
    from lp_lightning.fsdp.refresh import RefreshRecorder

    module, optimizer = _lp_params(mode)
    plugin = LowPrecisionFabricPlugin(mode)
    module.weight.grad = torch.ones(64, 64)
    module.bias.grad = torch.ones(64)
    with RefreshRecorder() as rec:
        plugin.optimizer_step(optimizer)
    assert rec.counts == {"weight": 1}
    assert plugin.optimizer_steps_applied == 1 and plugin.last_step_applied and plugin.refreshes["step"] == 1
    stepped = module.weight.master.clone()

    module.weight.grad = torch.full((64, 64), float("nan"))
    with RefreshRecorder() as rec:
        plugin.optimizer_step(optimizer)
    assert rec.total == 0  # a skipped step refreshes nothing
    assert torch.equal(module.weight.master, stepped)  # and updates nothing
    assert plugin.optimizer_steps_skipped == 1 and not plugin.last_step_applied
    assert plugin.optimizer_steps_applied == 1 and plugin.refreshes["step"] == 1


@pytest.mark.parametrize("mode", ["mxfp8", "hif8"])
def test_a_non_finite_low_precision_master_stops_the_run_after_the_step(mode, eager_codecs):
    """The refresh's amax of each weight shows a NaN/Inf master; the stop names the weight's FQN."""
    module, optimizer = _lp_params(mode)
    plugin = LowPrecisionFabricPlugin(mode)
    plugin.guard.name_parameters(module)
    with torch.no_grad():
        module.weight.master[3, 5] = float("inf")  # e.g. a fault between two steps; the gradients stay finite
    module.weight.grad = torch.ones(64, 64)
    module.bias.grad = torch.ones(64)
    with pytest.raises(NonFiniteStateError, match=r"non-finite master weight \('weight'\)") as info:
        plugin.optimizer_step(optimizer)
    assert info.value.fqn == "weight" and info.value.step == 1 and plugin.optimizer_steps_applied == 1


def test_consecutive_skips_stop_the_run_at_the_limit_and_an_applied_step_resets_them():
    module = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    plugin = BF16FabricPlugin(max_consecutive_skips=2)
    plugin.guard.name_parameters(module)

    def step(bad: float) -> None:
        module.weight.grad = torch.tensor([[1.0, bad], [0.0, 0.0]])
        module.bias.grad = torch.zeros(2)
        plugin.optimizer_step(optimizer)

    step(float("nan"))
    step(1.0)  # applied: the streak starts again
    step(float("inf"))
    assert plugin.guard.consecutive_skips == 1 and plugin.optimizer_steps_skipped == 2
    with pytest.raises(NonFiniteStateError, match=r"stopped at step 4: 2 optimizer steps skipped in a row "
                       r"\(non-finite gradient \('weight'\)\), nonfinite.max_consecutive_skips=2") as info:
        step(float("nan"))
    assert (info.value.reason, info.value.fqn, info.value.consecutive_skips) == ("non-finite gradient", "weight", 2)
    assert [e["step"] for e in plugin.guard.events] == [1, 3, 4]
    # Finite gradients whose norm overflows FP32: said so, no FQN; 0 = no limit.
    plugin = BF16FabricPlugin(max_consecutive_skips=0)
    for _ in range(5):
        step(1e30)
    assert plugin.guard.consecutive_skips == 5 and plugin.guard.events[-1] == {
        "step": 5, "reason": "gradient norm overflow", "fqn": None}
    with pytest.raises(ValueError, match="nonfinite.max_consecutive_skips must be an int >= 0"):
        BF16FabricPlugin(max_consecutive_skips=-1)


def test_a_skip_caused_by_a_non_finite_master_stops_at_once():
    module = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    plugin = BF16FabricPlugin()  # limit 3, but a NaN master cannot recover
    plugin.guard.name_parameters(module)
    with torch.no_grad():
        module.bias[0] = float("nan")
    module.weight.grad = torch.full((2, 2), float("nan"))
    module.bias.grad = torch.zeros(2)
    with pytest.raises(NonFiniteStateError, match=r"step 1: non-finite master weight \('bias'\) \(1 step\(s\) "
                       r"skipped in a row\)"):
        plugin.optimizer_step(optimizer)
    assert plugin.optimizer_steps_skipped == 1 and plugin.optimizer_steps_applied == 0


def test_fabric_plugin_counts_every_returned_step():
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.5)
    plugin = BF16FabricPlugin()
    param.grad = torch.ones(2)
    plugin.optimizer_step(optimizer)
    assert plugin.optimizer_steps_applied == 1 and plugin.last_step_applied
    assert torch.equal(param.detach(), torch.full((2,), 0.5))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_skips_the_step_unless_disabled(bad):
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.5)
    plugin = BF16FabricPlugin()
    param.grad = torch.tensor([1.0, bad])
    plugin.optimizer_step(optimizer)
    assert plugin.optimizer_steps_skipped == 1 and plugin.optimizer_steps_applied == 0
    assert torch.equal(param.detach(), torch.ones(2))
    assert plugin.guard.events == [{"step": 1, "reason": "non-finite gradient", "fqn": "parameter 0 (2,)"}]
    # Not skipping applies the update; the master is then NaN/Inf and the guard stops the run at once.
    plugin = BF16FabricPlugin(skip_nonfinite_steps=False)
    with pytest.raises(NonFiniteStateError, match=r"step 1: non-finite master weight \('parameter 0 \(2,\)'\) "
                       r"\(after an applied optimizer step\)") as info:
        plugin.optimizer_step(optimizer)
    assert plugin.optimizer_steps_applied == 1 and not torch.isfinite(param.detach()).all()
    assert plugin.guard.stop is info.value and info.value.reason == "non-finite master weight"


def test_trainer_plugin_runs_the_closure_then_steps(monkeypatch):
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.5)
    plugin = BF16Plugin()
    # No Trainer here: skip Lightning's post-closure hooks (callbacks, gradient clipping).
    monkeypatch.setattr(Precision, "_after_closure", lambda self, model, optimizer: None)
    model = nn.Linear(1, 1)

    def closure_with_loss():
        param.grad = torch.ones(2)
        return torch.tensor(1.0)

    def closure_without_backward():  # training_step returned None: Lightning zeroed the grads
        param.grad = None

    assert plugin.optimizer_step(optimizer, model, closure_with_loss) is not None
    assert plugin.last_step_applied and plugin.optimizer_steps_applied == 1
    assert plugin.optimizer_step(optimizer, model, closure_without_backward) is None
    assert not plugin.last_step_applied and plugin.optimizer_steps_applied == 1
    assert torch.equal(param.detach(), torch.full((2,), 0.5))

    def closure_nan():
        param.grad = torch.tensor([float("nan"), 0.0])
        return torch.tensor(1.0)

    assert plugin.optimizer_step(optimizer, model, closure_nan) is not None  # the loss is still returned
    assert plugin.optimizer_steps_skipped == 1 and torch.equal(param.detach(), torch.full((2,), 0.5))


def test_state_dict_round_trip_and_cross_precision_resume():
    plugin = BF16Plugin()
    plugin.optimizer_steps_applied, plugin.optimizer_steps_skipped, plugin.guard.consecutive_skips = 7, 2, 1
    restored = BF16Plugin()
    restored.load_state_dict(plugin.state_dict())
    assert (restored.optimizer_steps_applied, restored.optimizer_steps_skipped, restored.guard.consecutive_skips) == (
        7, 2, 1)
    assert plugin.state_dict() == {"mode": "bf16", "optimizer_steps_applied": 7, "optimizer_steps_skipped": 2,
                                   "consecutive_skips": 1}
    hif8 = LowPrecisionPlugin("hif8")
    with pytest.warns(UserWarning, match="trained with precision='mxfp8' in precision='hif8'.*rebuilt from them in hif8"):
        hif8.load_state_dict({"mode": "mxfp8", "optimizer_steps_applied": 3})  # checkpoints hold no 8-bit data
    assert hif8.optimizer_steps_applied == 3
    with pytest.warns(UserWarning, match="no low-precision weight is built"):
        BF16Plugin().load_state_dict({"mode": "hif8"})


def test_a_trainer_plugin_resumes_the_other_precisions_counters():
    """Lightning keys plugin state by class name; bf16 <-> mxfp8/hif8 resumes still restore the counters."""
    state = {"mode": "mxfp8", "optimizer_steps_applied": 3, "optimizer_steps_skipped": 1, "consecutive_skips": 1}
    bf16 = BF16Plugin()
    with pytest.warns(UserWarning, match="trained with precision='mxfp8' in precision='bf16'"):
        bf16.on_load_checkpoint({"LowPrecisionPlugin": state})
    assert (bf16.optimizer_steps_applied, bf16.optimizer_steps_skipped, bf16.guard.consecutive_skips) == (3, 1, 1)
    hif8 = LowPrecisionPlugin("hif8")
    with pytest.warns(UserWarning, match="trained with precision='bf16' in precision='hif8'"):
        hif8.on_load_checkpoint({"BF16Plugin": {**state, "mode": "bf16"}})
    assert hif8.optimizer_steps_applied == 3
    same = LowPrecisionPlugin("hif8")
    same.on_load_checkpoint({"LowPrecisionPlugin": state})  # its own key: Lightning restores it, not this hook
    assert same.optimizer_steps_applied == 0


# The bf16 import guard (R3 / design spec §13.1: low precision off imports neither the format layer, the
# plan nor torch_npu) is tests/test_bf16_imports.py: the same plugin steps plus a CLI fit, checked
# against every low-precision module of the source tree instead of five names.


def test_convert_module_needs_a_model_adapter():
    """The plugin learns the model (meta twin, default rules, boundary) from its adapter; none, no conversion."""
    with pytest.raises(TypeError, match=r"no model adapter for model type None \(Sequential\)"):
        LowPrecisionPlugin("mxfp8").convert_module(nn.Sequential(nn.Linear(64, 64)))
    assert BF16Plugin().convert_module(model := nn.Sequential()) is model  # bf16: nothing to look up
