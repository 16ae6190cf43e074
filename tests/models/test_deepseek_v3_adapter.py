"""The model-adapter registry and the DeepSeek-V3 adapter (design spec §2, §6; ``lp_lightning.models.adapter``).

The generic layers (plan, FSDP2 application, precision plugin) learn everything model-specific from
the adapter; these tests pin what the DeepSeek-V3 adapter answers for ``dsv3-tiny`` and how the
registry reports a model it has no adapter for.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import lp_lightning.models.adapter as adapter_module
from lp_lightning.models import DEEPSEEK_V3, adapter_for, register_model_adapter, registered_model_adapters
from lp_lightning.models.adapter import hf_model_type
from lp_lightning.models.deepseek_v3 import build_meta_model, from_hf_config
from lp_lightning.models.deepseek_v3.adapter import (
    DEEPSEEK_V3_EXPERTS_FACTORY,
    DEEPSEEK_V3_EXPERTS_TYPE,
    decoder_layers,
    modules_kept_in_fp32,
    resolve_causal_lm,
)
from lp_lightning.models.deepseek_v3.rules import deepseek_v3_default_rules
from lp_lightning.plan import NeverReplaceRule, compile_plan, load_rules
from lp_lightning.policy import LowPrecisionConfig

MXFP8 = LowPrecisionConfig.from_precision("mxfp8").to_policy()
PLAN_YAML = Path(__file__).resolve().parents[2] / "configs" / "plan_deepseek_v3.yaml"


@pytest.fixture(scope="module")
def tiny() -> nn.Module:
    return from_hf_config("dsv3-tiny", seed=0)


def test_resolve_causal_lm_accepts_model_or_wrapper(tiny):
    model = tiny
    wrapper = nn.Module()
    wrapper.model = model
    assert resolve_causal_lm(model) is model
    assert resolve_causal_lm(wrapper) is model
    assert decoder_layers(model) is model.model.layers
    with pytest.raises(TypeError, match=r"module.model.layers"):
        resolve_causal_lm(nn.Linear(2, 2))


def test_registry_finds_deepseek_for_the_model_and_a_wrapper(tiny):
    wrapper = nn.Module()
    wrapper.model = tiny
    assert DEEPSEEK_V3 in registered_model_adapters()
    assert adapter_for(tiny) is DEEPSEEK_V3 and adapter_for(wrapper) is DEEPSEEK_V3
    assert hf_model_type(wrapper) == "deepseek_v3" == DEEPSEEK_V3.name
    assert DEEPSEEK_V3.causal_lm(wrapper) is tiny
    assert DEEPSEEK_V3.decoder_layers(tiny) is tiny.model.layers


def test_registry_names_the_model_type_and_the_fix_when_no_adapter_matches():
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    with torch.device("meta"):
        llama = LlamaForCausalLM(config)
    with pytest.raises(TypeError) as info:
        adapter_for(llama)
    message = str(info.value)
    assert "model type 'llama' (LlamaForCausalLM)" in message
    assert "registered adapters: ['deepseek_v3']" in message
    assert "lp_lightning.models.register_model_adapter(adapter)" in message
    with pytest.raises(TypeError, match=r"model type None \(Linear\)"):
        adapter_for(nn.Linear(2, 2))


def test_register_model_adapter_checks_the_protocol_and_names(monkeypatch):
    monkeypatch.setattr(adapter_module, "_ADAPTERS", dict(adapter_module._ADAPTERS))

    class Partial:
        name = "partial"

        def matches(self, model):
            return False

    with pytest.raises(TypeError, match=r"Partial is not a ModelAdapter; it lacks \['never_replace', 'glob_hint'"):
        register_model_adapter(Partial())

    class Impostor(type(DEEPSEEK_V3)):
        pass

    with pytest.raises(ValueError, match="'deepseek_v3' is already registered"):
        register_model_adapter(Impostor())
    assert register_model_adapter(DEEPSEEK_V3) is DEEPSEEK_V3  # the same object again: a no-op

    class Everything(type(DEEPSEEK_V3)):
        name = "everything"

        def matches(self, model):
            return True

    register_model_adapter(Everything())
    with pytest.raises(ValueError, match=r"2 model adapters match .*\['deepseek_v3', 'everything'\]"):
        adapter_for(build_meta_model("dsv3-tiny"))


def test_fp32_compute_modules_are_the_routers_of_a_bf16_model(tiny):
    assert DEEPSEEK_V3.fp32_compute_modules(tiny) == ("model.layers.1.mlp.gate", "model.layers.2.mlp.gate")
    assert modules_kept_in_fp32(from_hf_config("dsv3-tiny", seed=0, torch_dtype=torch.float32)) == ()


def test_meta_twin_has_the_module_tree_and_nothing_allocated(tiny):
    meta = DEEPSEEK_V3.build_meta_twin(tiny)
    assert [(n, type(m)) for n, m in meta.named_modules()] == [(n, type(m)) for n, m in tiny.named_modules()]
    assert all(p.is_meta for p in meta.parameters())
    assert meta.config.to_dict() == tiny.config.to_dict()


def test_default_rules_and_boundary_are_the_deepseek_ones(tiny):
    rules = DEEPSEEK_V3.default_replacement_rules(tiny.config)
    assert rules == deepseek_v3_default_rules(tiny.config)
    assert [r.name for r in rules] == ["mla_projections", "dense_mlp", "shared_experts", "routed_experts"]
    assert rules[-1].module_type == DEEPSEEK_V3_EXPERTS_TYPE and rules[-1].replace_module == DEEPSEEK_V3_EXPERTS_FACTORY
    assert all(isinstance(b, NeverReplaceRule) for b in DEEPSEEK_V3.never_replace)
    assert [b.reason for b in DEEPSEEK_V3.never_replace] == [
        "LM head", "embedding", "MoE router", "normalization", "rotary embedding", "core attention (QK, softmax, PV)"
    ]
    # The zero-hit error carries the adapter's advice (q_lora_rank set: q_a_proj/q_b_proj, no q_proj).
    meta = build_meta_model("dsv3-tiny", config_overrides={"q_lora_rank": 64})
    with pytest.raises(ValueError, match=r"fix the FQNs \(for DeepSeek-V3, q_lora_rank set means q_a_proj"):
        compile_plan(meta, load_rules(PLAN_YAML), MXFP8,
                     never_replace=DEEPSEEK_V3.never_replace, glob_hint=DEEPSEEK_V3.glob_hint)


def test_specs_and_meta_model_come_from_the_adapter_of_a_config(tmp_path):
    from lp_lightning.models.adapter import adapter_for_config, registered_specs
    from lp_lightning.models.deepseek_v3 import SPECS

    assert registered_specs() == ("dsv3-16b", "dsv3-tiny") and DEEPSEEK_V3.specs is SPECS
    assert adapter_for_config("dsv3-tiny") is DEEPSEEK_V3
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "deepseek_v3", "num_hidden_layers": 2}')
    assert adapter_for_config(tmp_path) is DEEPSEEK_V3 and adapter_for_config(str(config)) is DEEPSEEK_V3
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    for unknown in ("dsv3-huge", str(tmp_path / "llama")):
        with pytest.raises(ValueError, match=r"neither a built-in spec \['dsv3-16b', 'dsv3-tiny'\] nor a local"):
            adapter_for_config(unknown)
    meta = DEEPSEEK_V3.build_meta_model("dsv3-tiny", config_overrides={"num_hidden_layers": 2})
    assert all(p.is_meta for p in meta.parameters()) and meta.config.num_hidden_layers == 2
    assert meta.config._attn_implementation == "sdpa"


def test_target_groups_are_found_from_the_structure_not_the_plan():
    meta = build_meta_model("dsv3-tiny")  # 3 layers, 1 dense, q_lora_rank null
    groups = DEEPSEEK_V3.target_groups(meta)
    assert list(groups) == ["mla", "dense_mlp", "shared_experts", "routed_experts"]
    assert [len(v) for v in groups.values()] == [12, 3, 6, 2]
    assert groups["mla"][:4] == [f"model.layers.0.self_attn.{n}" for n in ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                                                              "o_proj")]
    assert groups["routed_experts"] == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    # The default plan names the same modules; the groups would still list one the plan left out.
    planned = {fqn for rule in DEEPSEEK_V3.default_replacement_rules(meta.config) for fqn in rule.match}
    assert planned == {fqn for fqns in groups.values() for fqn in fqns}
    q_lora = DEEPSEEK_V3.target_groups(build_meta_model("dsv3-tiny", config_overrides={"q_lora_rank": 64}))
    assert "model.layers.0.self_attn.q_a_proj" in q_lora["mla"] and len(q_lora["mla"]) == 15
