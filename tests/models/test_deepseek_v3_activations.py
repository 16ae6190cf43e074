"""The DeepSeek-V3 adapter's activation formula (``lp-lightning plan``) against what autograd saves (docs/planner.md).

A two-layer dsv3-tiny (one dense, one MoE layer) runs one forward and the training loss on CPU in
each precision, under ``torch.autograd.graph.saved_tensors_hooks``; every saved tensor still alive
at the end of forward is counted once per storage (parameters excluded: FSDP2 frees the gathered
weights at reshard), tagged with the decoder layer that saved it first. The planner's per-layer terms must match those bytes exactly,
except the MXFP8 grouped col scales of the routed experts, whose rows depend on the routing (the
formula takes the documented bound, at most ``(E - 1)·(H + F)`` bytes above). The planner's sum under
full recompute (``saved_activation_bytes``) is checked against the same measurement.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F

from lp_lightning.fsdp.parallelize import apply_activation_checkpointing
from lp_lightning.formats.spec import as_spec
from lp_lightning.fsdp.refresh import refresh_low_precision_weights
from lp_lightning.lightning.low_precision import LowPrecisionPlugin
from lp_lightning.models import DEEPSEEK_V3
from lp_lightning.models.deepseek_v3 import from_hf_config
from lp_lightning.models.deepseek_v3.activations import deepseek_v3_activations
from lp_lightning.planner.memory import saved_activation_bytes

BATCH, SEQ = 2, 64


def _model(precision: str, overrides: dict):
    model = from_hf_config("dsv3-tiny", seed=0, validate=False, config_overrides={"num_hidden_layers": 2, **overrides})
    if precision == "bf16":
        return model, frozenset(), None
    plugin = LowPrecisionPlugin(precision)
    model = plugin.convert_module(model)
    refresh_low_precision_weights(model.parameters())
    lp = frozenset(
        fqn for fqn, m in model.named_modules() if type(m).__name__ in ("LowPrecisionLinear", "DeepseekV3LowPrecisionExperts")
    )
    return model, lp, plugin.policy.format.value


def _measure_saved(model, *, checkpoint: bool = False) -> dict[str, int]:
    """Bytes of the distinct storages autograd saves, by the decoder layer that saved them first."""
    model.train()
    params = list(model.parameters())
    param_storages = set()
    for p in params:
        try:
            param_storages.add(p.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            pass
    where = ["outside"]
    handles = []

    def enter(tag: str):
        def hook(module, args) -> None:
            where.append(tag)
        return hook

    def leave(module, args, output) -> None:
        where.pop()

    for i, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_pre_hook(enter(f"layer{i}")))
        handles.append(layer.register_forward_hook(leave))
    if checkpoint:
        apply_activation_checkpointing(model.model.layers, "full")
    saved: list[tuple[weakref.ref, str]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not any(t is p for p in params):
            saved.append((weakref.ref(t), where[-1]))
        return t

    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
    labels = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())  # as DeepSeekV3LM.loss
    assert loss.requires_grad
    for h in handles:
        h.remove()
    # What is still alive at the end of forward (a dead graph branch, e.g. the router's group top-k,
    # frees what it saved), each storage once.
    seen: dict[int, tuple[str, int]] = {}
    for ref, tag in saved:
        t = ref()
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = (tag, storage.nbytes())
    totals: dict[str, int] = {}
    for tag, nbytes in seen.values():
        totals[tag] = totals.get(tag, 0) + nbytes
    return totals


@pytest.mark.parametrize(
    ("precision", "overrides"),
    [("bf16", {}), ("bf16", {"q_lora_rank": 64}), ("mxfp8", {}), ("hif8", {})],
    ids=["bf16", "bf16-q_lora", "mxfp8", "hif8"],
)
def test_saved_activations_match_the_formula(precision, overrides):
    model, lp, fmt = _model(precision, overrides)
    measured = _measure_saved(model)
    est = DEEPSEEK_V3.activation_terms(
        model.config, micro_batch_size=BATCH, seq_len=SEQ, low_precision_modules=lp,
        format=None if fmt is None else as_spec(fmt), activation_dtype=torch.bfloat16,
    )
    cfg = model.config
    T, V = BATCH * SEQ, cfg.vocab_size
    rotary = est.outside["rotary cos/sin"]  # computed once, first saved by layer 0's RoPE
    dense, moe = (sum(terms.values()) for terms in est.layers)
    assert measured["layer0"] == dense + rotary
    slack = (cfg.n_routed_experts - 1) * (cfg.hidden_size + cfg.moe_intermediate_size) if precision == "mxfp8" else 0
    assert 0 <= moe - measured["layer1"] <= slack, (moe, measured["layer1"])
    log_softmax, total_weight = 4 * T * V, 4  # the saved log-softmax output (in loss_logits) and NLL's 0-d weight
    assert measured["outside"] == sum(est.outside.values()) - rotary + log_softmax + total_weight
    assert est.loss_logits == 12 * T * V


def test_full_recompute_keeps_only_the_layer_inputs():
    """With ``activation_checkpoint="full"`` nothing saved inside a layer outlives its forward: the
    non-reentrant checkpoint saves each layer's positional input (the hidden states) and holds the
    keyword inputs (RoPE cos/sin) by reference; the formula adds one recomputed layer for backward."""
    model, lp, _ = _model("bf16", {})
    measured = _measure_saved(model, checkpoint=True)
    off = deepseek_v3_activations(model.config, micro_batch_size=BATCH, seq_len=SEQ, low_precision_modules=lp, format=None)
    full = deepseek_v3_activations(model.config, micro_batch_size=BATCH, seq_len=SEQ, low_precision_modules=lp,
                                   format=None)
    T, V = BATCH * SEQ, model.config.vocab_size
    rotary = off.outside["rotary cos/sin"]  # a keyword input of every checkpointed layer: held, not saved
    assert set(measured) == {"outside"}
    layers = len(off.layers)
    assert measured["outside"] == sum(off.outside.values()) - rotary + 4 * T * V + 4 + layers * full.layer_input
    per_layer = [sum(t.values()) for t in off.layers]
    assert full.layer_input == 2 * T * model.config.hidden_size
    assert saved_activation_bytes(full, "full") == 2 * full.layer_input + max(per_layer) + sum(off.outside.values())
    assert saved_activation_bytes(full, "full") < saved_activation_bytes(off, "off")
