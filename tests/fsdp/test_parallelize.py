"""``lp_lightning.fsdp.parallelize``: build order, sharding layout, recompute keys, grad norm."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from lp_lightning.fsdp.parallelize import (
    build_dp_mesh,
    default_mixed_precision_policy,
    is_parallelized,
    parallelize_causal_lm,
    process_group_backend_for,
    total_grad_norm,
    upcast_parameters_to_fp32,
)
from lp_lightning.models.adapter import adapter_for
from lp_lightning.models.deepseek_v3 import from_hf_config


@pytest.fixture(scope="module")
def tiny_state() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in from_hf_config("dsv3-tiny", seed=0).state_dict().items()}


def _tiny(tiny_state) -> nn.Module:
    model = from_hf_config("dsv3-tiny", seed=0)
    model.load_state_dict(tiny_state)
    return model


def test_backend_by_device_type():
    assert [process_group_backend_for(d) for d in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "hccl"]
    with pytest.raises(ValueError, match=r"'xpu'.*process_group_backend"):
        process_group_backend_for("xpu")


@pytest.mark.parametrize("activation_checkpoint", ["off", "full"])
def test_parallelize_order_layout_and_hf_keys(tiny_state, single_rank_group, activation_checkpoint):
    model = _tiny(tiny_state)
    names_before = [n for n, _ in model.named_parameters()]
    keys_before = list(model.state_dict())
    calls = []

    def convert(module: nn.Module) -> nn.Module:
        # The conversion must see plain BF16 Parameters (design spec §12.1: replace before sharding).
        calls.append({type(p) for p in module.parameters()})
        assert {p.dtype for p in module.model.layers[0].parameters()} == {torch.bfloat16}
        return module

    mesh = build_dp_mesh("cpu", 1)
    out, record = parallelize_causal_lm(
        model, mesh, mp_policy=default_mixed_precision_policy(), reshard_after_forward=True,
        activation_checkpoint=activation_checkpoint, convert_module=convert, adapter=adapter_for(model),
    )
    assert out is model and calls == [{nn.Parameter}]
    expected = ("convert_module", "upcast_fp32", "fully_shard")
    assert record.steps == expected + (("activation_checkpoint",) if activation_checkpoint == "full" else ())
    bf16_params = sum(p.dtype == torch.bfloat16 for p in _tiny(tiny_state).parameters())
    assert record.upcast_params == bf16_params
    # The MoE routers stay FP32 in compute (HF keeps gate.weight FP32 in a BF16 model).
    assert record.fp32_compute_modules == ("model.layers.1.mlp.gate", "model.layers.2.mlp.gate")
    assert record.sharded_modules == 2 + 3 + 1
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.placements == (Shard(0),), name
        assert param.dtype == torch.float32, name
    # FQNs: the recompute wrapper shows in named_parameters(), never in state-dict keys.
    wrapped = [n for n, _ in model.named_parameters() if "_checkpoint_wrapped_module" in n]
    assert bool(wrapped) == (activation_checkpoint == "full")
    assert list(model.state_dict()) == keys_before
    assert len(names_before) == len(list(model.parameters()))
    with pytest.raises(TypeError, match="already sharded"):
        parallelize_causal_lm(model, mesh, mp_policy=default_mixed_precision_policy(),
                              reshard_after_forward=True, activation_checkpoint="off", adapter=adapter_for(model))


def test_upcast_is_exact_and_keeps_parameter_identity(tiny_state):
    model = _tiny(tiny_state)
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    assert upcast_parameters_to_fp32(model) > 0
    for p, b in zip(model.parameters(), before, strict=True):
        assert p.dtype == torch.float32
        assert torch.equal(p.detach(), b.float())  # BF16 -> FP32 is exact
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]


def test_sharded_forward_matches_plain_bf16_model_and_grad_norm(tiny_state, single_rank_group):
    ids_BT = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = _tiny(tiny_state)
    ref_logits = plain(input_ids=ids_BT).logits
    ref_logits.float().square().mean().backward()
    ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in plain.parameters()]))

    sharded = _tiny(tiny_state)
    parallelize_causal_lm(sharded, build_dp_mesh("cpu", 1), mp_policy=default_mixed_precision_policy(),
                          reshard_after_forward=True, activation_checkpoint="off", adapter=adapter_for(sharded))
    logits = sharded(input_ids=ids_BT).logits
    # The all-gathered compute weights are the BF16 values the model was built with: same forward.
    assert logits.dtype == torch.bfloat16
    assert torch.equal(logits, ref_logits)
    logits.float().square().mean().backward()
    norm = total_grad_norm(list(sharded.parameters()))
    assert norm.dtype == torch.float32 and not isinstance(norm, DTensor)
    # FP32-reduced grads vs BF16 grads of the plain model: agree to the BF16 unit roundoff.
    assert norm.item() == pytest.approx(ref_norm.item(), rel=2.0**-8)


class _ToyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, dtype=torch.bfloat16)
        self.gate = nn.Linear(8, 2)  # FP32 in a BF16 model

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h)


class _ToyLM(nn.Module):
    """Not a HF model: embedding, two blocks (a BF16 Linear and an FP32 ``gate`` each), head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8, dtype=torch.bfloat16)
        self.blocks = nn.ModuleList(_ToyBlock() for _ in range(2))
        self.head = nn.Linear(8, 16, dtype=torch.bfloat16)


class _ToyAdapter:
    """A model adapter for :class:`_ToyLM`: the FSDP2 application needs nothing else to know."""

    name = "toy"
    never_replace = ()
    glob_hint = None

    def matches(self, model):
        return isinstance(model, _ToyLM)

    def causal_lm(self, module):
        return module

    def decoder_layers(self, causal_lm):
        return causal_lm.blocks

    def fp32_compute_modules(self, causal_lm):
        return ("blocks.0.gate", "blocks.1.gate")

    def default_replacement_rules(self, config):
        return ()

    def build_meta_twin(self, causal_lm):
        raise NotImplementedError


def test_parallelize_takes_the_model_structure_from_the_adapter(single_rank_group):
    mesh = build_dp_mesh("cpu", 1)
    with pytest.raises(TypeError, match=r"no model adapter for model type None \(_ToyLM\).*register_model_adapter"):
        toy = _ToyLM()
        parallelize_causal_lm(toy, mesh, mp_policy=default_mixed_precision_policy(),
                              reshard_after_forward=True, activation_checkpoint="off", adapter=adapter_for(toy))
    model = _ToyLM()
    out, record = parallelize_causal_lm(
        model, mesh, mp_policy=default_mixed_precision_policy(), reshard_after_forward=True,
        activation_checkpoint="full", adapter=_ToyAdapter(),
    )
    assert out is model
    assert record.steps == ("upcast_fp32", "fully_shard", "activation_checkpoint")
    assert record.fp32_compute_modules == ("blocks.0.gate", "blocks.1.gate")
    assert record.sharded_modules == 2 + 2 + 1 and record.checkpointed_layers == 2
    assert record.upcast_params == 1 + 2 * 2 + 2  # embed, proj weight+bias per block, head weight+bias
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.dtype == torch.float32, name


def test_low_precision_weights_without_a_lifecycle_are_refused_before_the_model_changes(single_rank_group):
    from lp_lightning.lightning.low_precision import LowPrecisionFabricPlugin

    model = LowPrecisionFabricPlugin("mxfp8").convert_module(from_hf_config("dsv3-tiny", seed=0))
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    with pytest.raises(TypeError, match=r"got no lifecycle: pass lifecycle=plugin\.lifecycle"):
        parallelize_causal_lm(model, build_dp_mesh("cpu", 1), mp_policy=default_mixed_precision_policy(),
                              reshard_after_forward=True, activation_checkpoint="off", adapter=adapter_for(model))
    assert {name: p.dtype for name, p in model.named_parameters()} == dtypes  # not upcast, not sharded
    assert not is_parallelized(model)
