"""DeepSeek-V3 routed experts in low precision (design spec §5.2, §6, §8, §16.3; requirement R5 (docs/design.md), R6, R12).

- The factory replaces HF ``DeepseekV3Experts`` whole, reusing its Parameters, attributes and
  forward signature; HF's ``@use_experts_implementation`` dispatch cannot bypass the new forward.
- Forward/backward: top-k > 1, empty experts (exactly zero weight gradient), one expert, uneven
  counts; the adapter is exactly the generic grouped function plus the top-k weighting.
- End-to-end SQNR against HF's eager experts run in BF16 (the golden; it is itself checked
  against HF eager in FP64).
- Probes on the tiny DeepSeek-V3 model with the default plan: all six (dense|grouped) ×
  (fprop|dgrad|wgrad) GEMM roles run in one training step, and no high-precision GEMM runs inside
  a replaced module (a ``TorchDispatchMode`` counts aten GEMM calls inside replaced modules'
  forwards and inside the low-precision autograd backwards, excluding the emulated backend's own
  FP32 matmul of decoded operands; the same probe counts > 0 on the unreplaced modules).
"""

from __future__ import annotations

import contextlib
import copy
import inspect

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

from lp_lightning.evidence.numerics import sqnr_db
from lp_lightning.formats import recipe_for, set_compiled_kernels
from lp_lightning.fsdp.weights import finalize_low_precision_weights
from lp_lightning.functional import grouped_linear, linear, low_precision_grouped_swiglu
from lp_lightning.models.deepseek_v3 import from_hf_config
from lp_lightning.models.deepseek_v3.rules import deepseek_v3_default_rules
from lp_lightning.models.deepseek_v3.experts import (
    DeepseekV3LowPrecisionExperts,
    replace_deepseek_v3_low_precision_experts,
)
from lp_lightning.modules import LowPrecisionLinear
from lp_lightning.ops import GemmRole, record_gemms
from lp_lightning.ops.emulated import EmulatedBackend
from lp_lightning.plan import compile_plan
from lp_lightning.policy import LowPrecisionConfig, LowPrecisionPolicy

FORMATS = {"mxfp8_e4m3": "mxfp8", "hif8": "hif8"}
H, FF = 64, 32

# End-to-end floors (dB) of the experts' outputs against HF eager in BF16 (the golden is checked
# against HF eager in FP64). Each output crosses two low-precision GEMMs and SwiGLU, so the noise
# compounds (per-GEMM floors are in tests/functional/test_grouped_linear.py): h = silu(gate)·up
# inherits the noise of both gate and up (≈ 28.5 dB each for MXFP8 → ≈ 25.5 dB), and the down
# GEMM adds its own ≈ 28.5 dB: ≈ 23.7 dB expected for y; the backward chains are alike. HiF8's
# gradient GEMMs are ≈ 24.7 dB (2-bit gradients), so its dx / d_gate_up land ≈ 21 dB.
# Measured (seed 0): MXFP8 y 23.6, dx 23.7, d_gate_up 23.6, d_down 23.6, d_top_k_weights 24.4;
# HiF8 y 23.3, dx 21.0, d_gate_up 20.8, d_down 22.0, d_top_k_weights 23.0. Floors = measured − ~2.
E2E_FLOORS_DB = {
    ("mxfp8_e4m3", "y"): 21.5,
    ("mxfp8_e4m3", "dx"): 21.5,
    ("mxfp8_e4m3", "d_gate_up"): 21.5,
    ("mxfp8_e4m3", "d_down"): 21.5,
    ("mxfp8_e4m3", "d_top_k_weights"): 22.0,
    ("hif8", "y"): 21.0,
    ("hif8", "dx"): 19.0,
    ("hif8", "d_gate_up"): 18.5,
    ("hif8", "d_down"): 20.0,
    ("hif8", "d_top_k_weights"): 21.0,
}


def policy_for(fmt: str) -> LowPrecisionPolicy:
    return LowPrecisionConfig.from_precision(FORMATS[fmt]).to_policy()


def hf_experts(num_experts: int = 4, scale: float = 0.1, experts_implementation: str | None = None) -> DeepseekV3Experts:
    config = DeepseekV3Config(hidden_size=H, moe_intermediate_size=FF, n_routed_experts=num_experts, num_experts_per_tok=2)
    if experts_implementation is not None:
        config._experts_implementation = experts_implementation
    module = DeepseekV3Experts(config)
    with torch.no_grad():
        module.gate_up_proj.normal_(0.0, scale)
        module.down_proj.normal_(0.0, scale)
    return module


def finalize(module: nn.Module) -> nn.Module:
    """Install the persistent low-precision weights built from the module's master weights."""
    finalize_low_precision_weights(module, recipe=module.recipe)
    return module


def routing(tokens: int, num_experts: int, top_k: int, *, never: tuple[int, ...] = ()):
    """HF-like routing: distinct top-k experts per token, FP32 weights; experts in ``never`` get no token."""
    scores = torch.rand(tokens, num_experts)
    scores[:, list(never)] = -1.0
    top_k_weights, top_k_index = scores.topk(top_k, dim=-1)
    return top_k_index, (top_k_weights.softmax(-1) * 2.5).requires_grad_()


# ------------------------------------------------------------------------------------------------
# Replacement


def test_replacement_reuses_parameters_attributes_and_signature():
    source = hf_experts()
    source.eval()
    source._is_hf_initialized = True
    names_before = [name for name, _ in source.named_modules()]
    keys_before = list(source.state_dict(keep_vars=True))

    new = replace_deepseek_v3_low_precision_experts(source, fqn="model.layers.1.mlp.experts", policy=policy_for("hif8"))

    assert type(new) is DeepseekV3LowPrecisionExperts and not isinstance(new, DeepseekV3Experts)
    assert new.gate_up_proj is source.gate_up_proj and new.down_proj is source.down_proj
    assert new.act_fn is source.act_fn
    assert (new.num_experts, new.hidden_dim, new.intermediate_dim) == (4, H, FF)
    assert new.config is source.config and new._is_hf_initialized is True and new.training is False
    assert [name for name, _ in new.named_modules()] == names_before
    assert list(new.state_dict(keep_vars=True)) == keys_before
    assert inspect.signature(new.forward) == inspect.signature(source.forward)
    assert inspect.signature(type(new).forward) == inspect.signature(DeepseekV3Experts.forward)
    assert new.fqn == "model.layers.1.mlp.experts" and new.recipe is recipe_for("hif8")


def test_hf_experts_dispatch_cannot_bypass_the_low_precision_forward():
    source = hf_experts(experts_implementation="batched_mm")
    new = finalize(
        replace_deepseek_v3_low_precision_experts(source, fqn="model.layers.1.mlp.experts", policy=policy_for("hif8"))
    )
    assert new.config._experts_implementation == "batched_mm"  # HF's dispatch setting is still there ...
    assert not hasattr(type(new).forward, "__wrapped__")  # ... but the class is not decorated
    index, weights = routing(24, 4, 2)
    with record_gemms() as events:
        new(torch.randn(24, H, dtype=torch.bfloat16), index, weights)
    assert [e.gemm_role for e in events] == [GemmRole.GROUPED_FPROP, GemmRole.GROUPED_FPROP]


def test_factory_rejects_what_it_cannot_replace():
    policy = policy_for("hif8")

    class MyExperts(DeepseekV3Experts):
        pass

    config = DeepseekV3Config(hidden_size=H, moe_intermediate_size=FF, n_routed_experts=2)
    with pytest.raises(TypeError, match="'model.layers.2.mlp.experts' is a .*MyExperts; only an exact"):
        replace_deepseek_v3_low_precision_experts(MyExperts(config), fqn="model.layers.2.mlp.experts", policy=policy)
    gelu = DeepseekV3Experts(DeepseekV3Config(hidden_size=H, moe_intermediate_size=FF, n_routed_experts=2, hidden_act="gelu"))
    with pytest.raises(TypeError, match="'e' has act_fn GELUActivation.*SwiGLU"):
        replace_deepseek_v3_low_precision_experts(gelu, fqn="e", policy=policy)
    with pytest.raises(ValueError, match="policy.enabled is False"):
        replace_deepseek_v3_low_precision_experts(hf_experts(), fqn="e", policy=LowPrecisionPolicy.disabled())
    with pytest.raises(TypeError, match="replace_deepseek_v3_low_precision_experts"):
        DeepseekV3LowPrecisionExperts()


def test_forward_checks_its_inputs():
    new = replace_deepseek_v3_low_precision_experts(hf_experts(), fqn="m.experts", policy=policy_for("hif8"))
    index, weights = routing(8, 4, 2)
    with pytest.raises(TypeError, match="'m.experts': gate_up_proj is still the plain high-precision Parameter"):
        new(torch.randn(8, H), index, weights)
    finalize(new)
    with pytest.raises(ValueError, match="hidden_states must be \\[S, H=64\\]"):
        new(torch.randn(2, 4, H), index, weights)
    with pytest.raises(ValueError, match="must both be \\[S=8, k\\]"):
        new(torch.randn(8, H), index[:, :1], weights)
    with pytest.raises(TypeError, match="top_k_index must be an integer tensor"):
        new(torch.randn(8, H), index.float(), weights)
    E = new.num_experts
    for bad in (E, -1):  # HF's expert-parallel sentinel E, a negative id: a clear error, not a bare IndexError
        wrong = index.clone()
        wrong[3, 1] = bad
        with pytest.raises(ValueError, match=rf"'m.experts': top_k_index holds expert ids \[{bad}\] outside \[0, {E}\)"):
            new(torch.randn(8, H), wrong, weights)


# ------------------------------------------------------------------------------------------------
# Forward / backward


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize(
    "num_experts, top_k, never",
    [(4, 2, (1,)), (4, 3, ()), (1, 1, ()), (6, 2, (0, 5))],
    ids=["topk2-empty-expert", "topk3", "one-expert", "two-empty-at-ends"],
)
def test_adapter_is_the_grouped_function_plus_topk_weighting(fmt, num_experts, top_k, never):
    source = hf_experts(num_experts)
    new = finalize(replace_deepseek_v3_low_precision_experts(source, fqn="experts", policy=policy_for(fmt)))
    tokens = 48
    index, weights = routing(tokens, num_experts, top_k, never=never)
    x = torch.randn(tokens, H, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, H, dtype=torch.bfloat16)

    y = new(x, index, weights)
    y.backward(dy)

    assert y.shape == (tokens, H) and y.dtype == torch.bfloat16
    assert x.grad.shape == x.shape and x.grad.dtype == torch.bfloat16
    assert weights.grad.shape == weights.shape and torch.count_nonzero(weights.grad) > 0
    assert new.gate_up_proj.grad.shape == (num_experts, 2 * FF, H) and new.gate_up_proj.grad.dtype == torch.float32
    assert new.down_proj.grad.shape == (num_experts, H, FF) and new.down_proj.grad.dtype == torch.float32
    counts = torch.bincount(index.reshape(-1), minlength=num_experts)
    for e in range(num_experts):
        empty = e in never
        assert (counts[e] == 0) == empty
        assert (torch.count_nonzero(new.gate_up_proj.grad[e]) == 0) == empty
        assert (torch.count_nonzero(new.down_proj.grad[e]) == 0) == empty

    # The same computation composed by hand from the generic grouped function.
    order = torch.argsort(index.reshape(-1), stable=True)
    token = order // top_k
    x2 = x.detach().requires_grad_()
    y_sorted = low_precision_grouped_swiglu(x2[token], counts, new.gate_up_proj, new.down_proj, recipe=recipe_for(fmt))
    weighted = y_sorted.float() * weights.detach().reshape(-1)[order].float()[:, None]
    y2 = torch.zeros(tokens, H).index_add(0, token, weighted).to(torch.bfloat16)
    assert torch.equal(y, y2)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_end_to_end_sqnr_against_hf_eager_experts_in_bf16(fmt):
    torch.manual_seed(0)
    source = hf_experts(num_experts=4, scale=0.05)
    golden = {}
    index, weights = routing(128, 4, 2, never=(2,))
    x = torch.randn(128, H, dtype=torch.bfloat16)
    dy = torch.randn(128, H, dtype=torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float64):
        module = copy.deepcopy(source).to(dtype)
        xg = x.detach().to(dtype).requires_grad_()
        wg = weights.detach().to(torch.float32 if dtype == torch.bfloat16 else dtype).requires_grad_()
        yg = module(xg, index, wg)
        yg.backward(dy.to(dtype))
        golden[dtype] = {
            "y": yg, "dx": xg.grad, "d_gate_up": module.gate_up_proj.grad,
            "d_down": module.down_proj.grad, "d_top_k_weights": wg.grad,
        }
    new = finalize(replace_deepseek_v3_low_precision_experts(source, fqn="experts", policy=policy_for(fmt)))
    xl = x.detach().requires_grad_()
    wl = weights.detach().requires_grad_()
    yl = new(xl, index, wl)
    yl.backward(dy)
    ours = {"y": yl, "dx": xl.grad, "d_gate_up": new.gate_up_proj.grad, "d_down": new.down_proj.grad, "d_top_k_weights": wl.grad}
    measured = {}
    for name, value in ours.items():
        bf16, fp64 = golden[torch.bfloat16][name], golden[torch.float64][name]
        assert sqnr_db(bf16, fp64) >= 35.0, f"the BF16 golden {name} must be far cleaner than the floors"
        measured[name] = sqnr_db(value, bf16)
    print(f"experts SQNR vs HF eager BF16, {fmt}: " + ", ".join(f"{k} {v:.2f} dB" for k, v in measured.items()))
    for name, value in measured.items():
        assert value >= E2E_FLOORS_DB[(fmt, name)], (fmt, name, value)


# ------------------------------------------------------------------------------------------------
# Probes: GEMM roles and high-precision GEMM count


def _gemm_packets() -> set:
    names = ("mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot", "vdot", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm")
    return {getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n)}


class HighPrecisionGemmProbe(TorchDispatchMode):
    """Counts aten GEMM calls made inside ``scope()`` and outside the emulated backend's kernels.

    The emulated backend computes each low-precision GEMM as an FP32 matmul of exactly decoded
    operands; those calls are the low-precision GEMMs themselves and are excluded by wrapping
    ``EmulatedBackend.matmul``/``grouped_matmul``. Any other GEMM in scope is a high-precision one.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        self.calls: list[str] = []
        self._scope = 0
        self._emulated = 0
        for name in ("matmul", "grouped_matmul"):
            original = getattr(EmulatedBackend, name)

            def wrapped(backend, *args, _original=original, **kwargs):
                self._emulated += 1
                try:
                    return _original(backend, *args, **kwargs)
                finally:
                    self._emulated -= 1

            monkeypatch.setattr(EmulatedBackend, name, wrapped)
        self._gemms = _gemm_packets()

    @contextlib.contextmanager
    def scope(self):
        self._scope += 1
        try:
            yield
        finally:
            self._scope -= 1

    def watch_forward(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(lambda m, args: self._enter())
        module.register_forward_hook(lambda m, args, out: self._exit())

    def watch_backward(self, monkeypatch: pytest.MonkeyPatch, function_cls: type) -> None:
        original = function_cls.backward

        def backward(ctx, *grads):
            with self.scope():
                return original(ctx, *grads)

        monkeypatch.setattr(function_cls, "backward", staticmethod(backward))

    def _enter(self) -> None:
        self._scope += 1

    def _exit(self) -> None:
        self._scope -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._scope and not self._emulated and func.overloadpacket in self._gemms:
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def eager_codecs():
    """Codec kernels eager while a dispatch mode is active (no torch.compile under the probe)."""
    set_compiled_kernels(False)
    yield
    set_compiled_kernels(True)


def test_probe_counts_high_precision_gemms_of_unreplaced_modules(monkeypatch, eager_codecs):
    """Positive control: the probe sees the BF16 GEMMs of HF's experts and of nn.Linear."""
    for module, args in (
        (hf_experts().to(torch.bfloat16), lambda: (torch.randn(16, H, dtype=torch.bfloat16, requires_grad=True), *routing(16, 4, 2))),
        (nn.Linear(H, 32), lambda: (torch.randn(8, H, requires_grad=True),)),
    ):
        probe = HighPrecisionGemmProbe(monkeypatch)
        with probe, probe.scope():
            module(*args()).float().sum().backward()
        assert len(probe.calls) > 0, type(module).__name__


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_replaced_modules_run_no_high_precision_gemm(fmt, monkeypatch, eager_codecs):
    from lp_lightning.modules import replace_low_precision_linear

    policy = policy_for(fmt)
    dense = finalize(replace_low_precision_linear(nn.Linear(H, H), fqn="proj", policy=policy))
    experts = finalize(replace_deepseek_v3_low_precision_experts(hf_experts(), fqn="experts", policy=policy))
    probe = HighPrecisionGemmProbe(monkeypatch)
    x = torch.randn(32, H, dtype=torch.bfloat16, requires_grad=True)
    index, weights = routing(32, 4, 2, never=(3,))
    with probe, probe.scope(), record_gemms() as events:
        experts(dense(x), index, weights).float().sum().backward()
    assert probe.calls == []
    assert {e.gemm_role for e in events} == set(GemmRole)
    assert all(e.backend == "emulated" and e.format == fmt for e in events)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_tiny_deepseek_v3_training_step_runs_all_six_roles_and_no_high_precision_gemm_in_replaced_modules(
    fmt, monkeypatch, eager_codecs
):
    model = from_hf_config("dsv3-tiny", torch_dtype=torch.float32, seed=0)
    policy = policy_for(fmt)
    plan = compile_plan(model, deepseek_v3_default_rules(model.config), policy)
    report = plan.apply(model)
    assert report.counts == {"mla_projections": 12, "dense_mlp": 3, "shared_experts": 6, "routed_experts": 2}
    replaced = [m for m in model.modules() if isinstance(m, (LowPrecisionLinear, DeepseekV3LowPrecisionExperts))]
    assert len(replaced) == 23
    records = finalize_low_precision_weights(model, recipe=policy)
    assert len(records) == 21 + 2 * 2

    probe = HighPrecisionGemmProbe(monkeypatch)
    for module in replaced:
        probe.watch_forward(module)
    probe.watch_backward(monkeypatch, linear._LowPrecisionLinearFunction)
    probe.watch_backward(monkeypatch, grouped_linear._GroupedSwiGLUFunction)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    with probe, record_gemms() as events:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()

    assert torch.isfinite(loss)
    assert probe.calls == []
    assert {e.gemm_role for e in events} == set(GemmRole)
    assert all(e.backend == "emulated" and e.format == fmt for e in events)
    assert sum(e.gemm_role is GemmRole.DENSE_FPROP for e in events) == 21  # one per replaced Linear
    assert sum(e.gemm_role is GemmRole.GROUPED_FPROP for e in events) == 4  # gate_up + down per MoE layer
    for module in replaced:
        for param in module.parameters(recurse=False):
            assert param.grad is not None and param.grad.shape == param.shape
