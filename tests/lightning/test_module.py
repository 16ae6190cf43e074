"""DeepSeekV3LM: schedule, argument checks, loss definition, FP32-state guard."""

from __future__ import annotations

import math

import pytest
import torch

from lp_lightning.lightning.module import DeepSeekV3LM, warmup_cosine_factor


def test_warmup_cosine_factor():
    f = lambda s: warmup_cosine_factor(s, warmup_steps=4, decay_steps=12, min_lr_ratio=0.1)  # noqa: E731
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0
    assert f(8) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(12) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    assert warmup_cosine_factor(0, warmup_steps=0, decay_steps=10, min_lr_ratio=0.0) == 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"activation_checkpoint": "selective"}, r"model.activation_checkpoint must be 'off' or 'full'"),
        ({"lr": 0.0}, r"model.lr must be > 0"),
        ({"betas": (0.9, 1.0)}, r"model.betas"),
        ({"min_lr_ratio": 1.5}, r"model.min_lr_ratio"),
        ({"lr_decay_steps": 0}, r"model.lr_decay_steps"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DeepSeekV3LM(**kwargs)


def test_configure_model_is_idempotent_and_loss_is_shifted_cross_entropy():
    module = DeepSeekV3LM()
    module.configure_model()
    model = module.model
    module.configure_model()
    assert module.model is model
    ids_BT = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids_BT[:, :-1], "labels": ids_BT[:, 1:]}
    logits = model(input_ids=batch["input_ids"]).logits.float()
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    loss = module.loss(batch)
    assert loss.dtype == torch.float32 and torch.equal(loss, expected)


def test_adamw_refuses_non_fp32_parameters():
    module = DeepSeekV3LM()
    module.configure_model()  # plain BF16 model: the strategy has not upcast it
    with pytest.raises(ValueError, match=r"AdamW needs FP32 master parameters \(design spec §15\)"):
        module.configure_optimizers()
