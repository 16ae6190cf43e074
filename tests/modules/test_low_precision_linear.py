"""``LowPrecisionLinear`` / ``replace_low_precision_linear`` (design spec §5.1, §8; requirement R5 (docs/design.md), R6): the
factory reuses the source Parameters and keeps the interface, rejects what it cannot replace, and the
forward is the dense low-precision autograd function."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from lp_lightning.formats import recipe_for
from lp_lightning.fsdp.weights import finalize_low_precision_weights
from lp_lightning.tensor import QuantizedWeightTensor
from lp_lightning.functional import low_precision_linear
from lp_lightning.modules import LowPrecisionLinear, replace_low_precision_linear
from lp_lightning.ops import GemmRole, record_gemms
from lp_lightning.policy import LowPrecisionConfig, LowPrecisionPolicy

FORMATS = {"mxfp8_e4m3": "mxfp8", "hif8": "hif8"}


def policy_for(fmt: str) -> LowPrecisionPolicy:
    return LowPrecisionConfig.from_precision(FORMATS[fmt]).to_policy()


def finalize(module: LowPrecisionLinear) -> LowPrecisionLinear:
    """Install the persistent low-precision weight built from the module's master weight."""
    finalize_low_precision_weights(module, recipe=module.recipe)
    return module


@pytest.mark.parametrize("with_bias", [True, False])
def test_replacement_reuses_parameters_and_keeps_the_interface(with_bias):
    source = nn.Linear(64, 48, bias=with_bias)
    source.eval()
    source._is_hf_initialized = True
    if with_bias:
        source.bias.requires_grad_(False)
    weight_before = source.weight.detach().clone()
    parent = nn.Sequential(source)
    keys_before = list(parent.state_dict(keep_vars=True))

    new = replace_low_precision_linear(source, fqn="model.layers.0.mlp.up_proj", policy=policy_for("hif8"))

    assert type(new) is LowPrecisionLinear and isinstance(new, nn.Linear)
    assert new.weight is source.weight and torch.equal(new.weight, weight_before)  # same object, no re-init
    assert (new.bias is source.bias) if with_bias else new.bias is None
    assert [name for name, _ in new.named_parameters()] == [name for name, _ in source.named_parameters()]
    assert [p.requires_grad for p in new.parameters()] == [p.requires_grad for p in source.parameters()]
    assert inspect.signature(new.forward) == inspect.signature(source.forward)
    assert (new.in_features, new.out_features, new.training) == (64, 48, False)
    assert new._is_hf_initialized is True
    assert new.fqn == "model.layers.0.mlp.up_proj" and new.policy == policy_for("hif8")
    assert new.recipe is recipe_for("hif8")
    assert "format=hif8" in repr(new)
    parent[0] = new
    assert list(parent.state_dict(keep_vars=True)) == keys_before
    assert all(a is b for a, b in zip(parent.state_dict(keep_vars=True).values(), source.state_dict(keep_vars=True).values()))
    assert type(parent[0]) is LowPrecisionLinear and source.weight is new.weight  # source itself untouched


def test_tied_weights_stay_tied():
    a, b = nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False)
    b.weight = a.weight
    policy = policy_for("mxfp8_e4m3")
    new_a = replace_low_precision_linear(a, fqn="a", policy=policy)
    new_b = replace_low_precision_linear(b, fqn="b", policy=policy)
    assert new_a.weight is new_b.weight is a.weight


def test_only_an_exact_linear_with_an_enabled_policy_is_replaced():
    class MyLinear(nn.Linear):
        pass

    policy = policy_for("hif8")
    with pytest.raises(TypeError, match="module 'model.layers.3.self_attn.o_proj' is a .*MyLinear; only an exact torch.nn"):
        replace_low_precision_linear(MyLinear(8, 8), fqn="model.layers.3.self_attn.o_proj", policy=policy)
    with pytest.raises(TypeError, match="'wrapped' is a torch.nn.modules.container.Sequential"):
        replace_low_precision_linear(nn.Sequential(nn.Linear(8, 8)), fqn="wrapped", policy=policy)
    with pytest.raises(ValueError, match="policy.enabled is False for 'x'"):
        replace_low_precision_linear(nn.Linear(8, 8), fqn="x", policy=LowPrecisionPolicy.disabled())
    with pytest.raises(TypeError, match="must be an lp_lightning.policy.LowPrecisionPolicy"):
        replace_low_precision_linear(nn.Linear(8, 8), fqn="x", policy="hif8")
    with pytest.raises(ValueError, match="non-empty fully qualified name"):
        replace_low_precision_linear(nn.Linear(8, 8), fqn="", policy=policy)
    with pytest.raises(TypeError, match="replace_low_precision_linear"):
        LowPrecisionLinear(8, 8)


def test_forward_before_the_low_precision_weight_is_built_raises_naming_the_fqn():
    new = replace_low_precision_linear(nn.Linear(16, 8), fqn="model.layers.0.mlp.down_proj", policy=policy_for("hif8"))
    with pytest.raises(TypeError, match="'model.layers.0.mlp.down_proj': weight is still the plain high-precision"):
        new(torch.randn(4, 16))


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("x_shape", [(64, 96), (2, 24, 96)], ids=["2d", "3d"])
def test_forward_is_the_dense_low_precision_function(fmt, x_shape):
    module = finalize(replace_low_precision_linear(nn.Linear(96, 64), fqn="proj", policy=policy_for(fmt)))
    x = torch.randn(x_shape, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(*x_shape[:-1], 64, dtype=torch.bfloat16)
    with record_gemms() as events:
        y = module(x)
        y.backward(dy)
    assert [e.gemm_role for e in events] == [GemmRole.DENSE_FPROP, GemmRole.DENSE_DGRAD, GemmRole.DENSE_WGRAD]
    assert y.shape == (*x_shape[:-1], 64) and y.dtype == torch.bfloat16
    assert isinstance(module.weight, QuantizedWeightTensor)
    assert module.weight.grad.shape == (64, 96) and module.weight.grad.dtype == torch.float32
    assert module.bias.grad.shape == (64,) and module.bias.grad.dtype == torch.float32

    x2 = x.detach().requires_grad_()
    y2 = low_precision_linear(x2, module.weight, module.bias, recipe=module.recipe)
    assert torch.equal(y, y2)
