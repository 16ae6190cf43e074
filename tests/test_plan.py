"""ModuleReplacementPlan: compile on structure, atomic apply, report (design spec §5, §13.2, §16.1; requirement R5 (docs/design.md)).

Factories here are test-local (the real LowPrecisionLinear / experts factories live elsewhere): an
``nn.Linear`` subclass built on meta that takes over the source Parameters, and a generic
"same module, dynamic subclass" factory for other module types.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

from lp_lightning.models.deepseek_v3 import build_meta_model
from lp_lightning.models.deepseek_v3.adapter import DEEPSEEK_V3
from lp_lightning.models.deepseek_v3.rules import deepseek_v3_default_rules
from lp_lightning.plan import (
    ModuleReplacementPlan,
    NeverReplaceRule,
    ReplacementReport,
    ReplacementRule,
    compile_plan,
    load_rules,
    rules_from_config,
)
from lp_lightning.policy import LowPrecisionConfig

REPO = Path(__file__).resolve().parents[1]
PLAN_YAML = REPO / "configs" / "plan_deepseek_v3.yaml"
MXFP8 = LowPrecisionConfig.from_precision("mxfp8").to_policy()
_LM_HEAD = (NeverReplaceRule(reason="LM head", fqn_globs=("lm_head", "*.lm_head")),)  # a model adapter's boundary
HIF8 = LowPrecisionConfig.from_precision("hif8").to_policy()
OFF = LowPrecisionConfig.from_precision("bf16").to_policy()


# ------------------------------------------------------------------------------------------------
# Test factories
# ------------------------------------------------------------------------------------------------


class _TestLowPrecisionLinear(nn.Linear):
    """Stand-in for LowPrecisionLinear: an exact nn.Linear subclass reusing the source Parameters."""


class _Recorder:
    """Factory wrapper recording (fqn, policy) of every call."""

    def __init__(self, build):
        self.build = build
        self.calls: list[tuple[str, object]] = []

    def __call__(self, source, *, fqn, policy):
        self.calls.append((fqn, policy))
        return self.build(source)


def _linear_like(source: nn.Linear) -> nn.Linear:
    with torch.device("meta"):
        new = _TestLowPrecisionLinear(source.in_features, source.out_features, bias=source.bias is not None)
    new.weight = source.weight
    new.bias = source.bias
    new.train(source.training)
    return new


_SUBCLASSES: dict[type, type] = {}


def _same_module_new_type(source: nn.Module) -> nn.Module:
    """A shallow twin of ``source`` whose type is a cached subclass of type(source)."""
    cls = _SUBCLASSES.setdefault(type(source), type(f"Test{type(source).__name__}", (type(source),), {}))
    new = cls.__new__(cls)
    new.__dict__.update(source.__dict__)
    for key in ("_parameters", "_buffers", "_modules"):
        new.__dict__[key] = dict(source.__dict__[key])
    new.__dict__["_non_persistent_buffers_set"] = set(source._non_persistent_buffers_set)
    return new


def linear_factory():
    return _Recorder(_linear_like)


def generic_factory():
    return _Recorder(_same_module_new_type)


def _rule(
    name="r", match=("layers.0.proj", "layers.1.proj"), module_type=nn.Linear, factory=None, **kwargs
) -> ReplacementRule:
    return ReplacementRule(
        name=name, match=match, module_type=module_type, replace_module=factory or linear_factory(), **kwargs
    )


# ------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4, bias=False)
        self.norm = nn.LayerNorm(8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.proj(x) * self.scale))


class _Toy(nn.Module):
    """Embedding -> 2 blocks -> head, with a frozen parameter and one submodule in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.mix = nn.Linear(4, 8)
        self.lm_head = nn.Linear(8, 16)
        self.layers[1].out.weight.requires_grad_(False)
        self.layers[1].proj.eval()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = self.mix(layer(h))
        return self.lm_head(h)


class _Aliased(nn.Module):
    """``a`` registered twice (``a`` and ``b``); ``c`` and ``d`` share one weight Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = self.a
        self.c = nn.Linear(4, 4)
        self.d = nn.Linear(4, 4)
        self.d.weight = self.c.weight


def _snapshot(model: nn.Module) -> dict:
    """Identity + metadata + values of everything the plan must preserve or leave untouched."""
    return {
        "modules": [(n, id(m), type(m)) for n, m in model.named_modules(remove_duplicate=False)],
        "training": [(n, m.training) for n, m in model.named_modules(remove_duplicate=False)],
        "params": [(n, id(p), p.requires_grad) for n, p in model.named_parameters(remove_duplicate=False)],
        "buffers": [(n, id(b)) for n, b in model.named_buffers(remove_duplicate=False)],
        "state_dict": {k: (id(v), v.detach().clone()) for k, v in model.state_dict(keep_vars=True).items()},
    }


def _assert_untouched(model: nn.Module, before: dict) -> None:
    after = _snapshot(model)
    for key in ("modules", "training", "params", "buffers"):
        assert after[key] == before[key], key
    assert list(after["state_dict"]) == list(before["state_dict"])
    for key, (obj_id, value) in before["state_dict"].items():
        assert after["state_dict"][key][0] == obj_id, key
        assert torch.equal(after["state_dict"][key][1], value), key


def _names(model: nn.Module) -> dict:
    return {
        "modules": [n for n, _ in model.named_modules(remove_duplicate=False)],
        "params": [(n, id(p), p.requires_grad) for n, p in model.named_parameters(remove_duplicate=False)],
        "buffers": [(n, id(b)) for n, b in model.named_buffers(remove_duplicate=False)],
        "state_dict": list(model.state_dict(keep_vars=True)),
        "training": [(n, m.training) for n, m in model.named_modules(remove_duplicate=False)],
    }


def _tiny_meta(**overrides) -> DeepseekV3ForCausalLM:
    config = DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, first_k_dense_replace=2, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, n_shared_experts=1, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16, num_experts_per_tok=2, n_group=1, topk_group=1,
        max_position_embeddings=64, use_cache=False,
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    with torch.device("meta"):
        return DeepseekV3ForCausalLM(config)


def _default_rules_with_test_factories(config, linear=None, experts=None):
    return deepseek_v3_default_rules(
        config, linear_factory=linear or linear_factory(), experts_factory=experts or generic_factory()
    )


@pytest.fixture
def dsv3_16b_meta():
    return build_meta_model("dsv3-16b")


# ------------------------------------------------------------------------------------------------
# DeepSeek-V3 default plan (acceptance)
# ------------------------------------------------------------------------------------------------


def test_dsv3_16b_default_plan_replaces_exactly_the_low_precision_gemms(dsv3_16b_meta):
    model = dsv3_16b_meta
    linear, experts = linear_factory(), generic_factory()
    rules = _default_rules_with_test_factories(model.config, linear, experts)
    assert all("*" not in fqn for rule in rules for fqn in rule.match)  # explicit full FQNs
    plan = compile_plan(model, rules, MXFP8)
    expected_counts = {"mla_projections": 28 * 4, "dense_mlp": 3, "shared_experts": 27 * 3, "routed_experts": 27}
    assert plan.counts == expected_counts
    assert plan.skipped == ()

    # Independent oracle: every exact nn.Linear except lm_head, plus every routed-experts module.
    # (The router mlp.gate is DeepseekV3TopkRouter, norms/rotary/attention are not Linear.)
    oracle = {
        fqn
        for fqn, m in model.named_modules()
        if (type(m) is nn.Linear and fqn != "lm_head") or type(m) is DeepseekV3Experts
    }
    planned = {entry.fqn for entry in plan.entries}
    assert planned == oracle and len(planned) == 223
    assert not any(
        part in fqn for fqn in planned for part in ("embed_tokens", "lm_head", "norm", "rotary")
    )
    assert not any(fqn.endswith(".mlp.gate") for fqn in planned)

    before = _names(model)
    report = plan.apply(model)
    assert report.counts == expected_counts and report.applied
    assert len(linear.calls) == 196 and len(experts.calls) == 27
    assert all(policy is MXFP8 for _, policy in linear.calls + experts.calls)
    assert _names(model) == before
    assert type(model.model.layers[5].self_attn.kv_b_proj) is _TestLowPrecisionLinear
    assert type(model.model.layers[5].mlp.experts).__name__ == "TestDeepseekV3Experts"
    assert type(model.model.layers[5].mlp.gate).__name__ == "DeepseekV3TopkRouter"
    assert type(model.lm_head) is nn.Linear

    summary = json.loads(report.to_json())
    assert summary["counts"] == expected_counts and summary["num_replaced"] == 223
    assert summary["policy"]["recipe_name"] == "mxfp8_e4m3_mx_block"
    assert summary["replaced"][0] == {
        "fqn": "model.layers.0.self_attn.q_proj",
        "aliases": [],
        "rule": "mla_projections",
        "from_type": "torch.nn.modules.linear.Linear",
        "to_type": f"{__name__}._TestLowPrecisionLinear",
    }
    text = report.format()
    for line in ("223 module(s) replaced", "mla_projections: 112 replaced", "dense_mlp: 3 replaced",
                 "shared_experts: 81 replaced", "routed_experts: 27 replaced"):
        assert line in text
    assert "model.layers.27.mlp.experts" in report.format(verbose=True)
    assert summary["low_precision_weights"] is None  # the plan counts modules; finalize counts the weights
    counted = dataclasses.replace(report, low_precision_weights=250)  # what the precision plugin reports
    assert "223 module(s) replaced holding 250 low-precision weights, 0 skipped" in counted.format()
    assert counted.as_dict()["low_precision_weights"] == 250


def test_plan_yaml_is_the_adapter_default_of_dsv3_16b_by_full_fqn(dsv3_16b_meta):
    """configs/plan_deepseek_v3.yaml is deepseek_v3_default_rules of the dsv3-16b config, written out."""
    from_yaml = load_rules(PLAN_YAML)
    assert from_yaml == deepseek_v3_default_rules(dsv3_16b_meta.config)
    assert {r.name: len(r.match) for r in from_yaml} == {
        "mla_projections": 112, "dense_mlp": 3, "shared_experts": 81, "routed_experts": 27}
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa" in from_yaml[0].match  # what `*_proj` globs missed
    assert compile_plan(dsv3_16b_meta, from_yaml, HIF8).counts == {r.name: len(r.match) for r in from_yaml}
    # Another layer count is another FQN list: the 16B file on dsv3-tiny has zero hits from layer 3 on.
    with pytest.raises(ValueError, match=r"(?s)'mla_projections'.*'model\.layers\.3\.self_attn\.q_proj'"):
        compile_plan(build_meta_model("dsv3-tiny"), from_yaml, HIF8)


def test_default_rules_follow_q_lora_rank_and_dense_layer_count():
    model = _tiny_meta(q_lora_rank=32)
    plan = compile_plan(model, _default_rules_with_test_factories(model.config), MXFP8)
    assert plan.counts == {
        "mla_projections": 4 * 5, "dense_mlp": 2 * 3, "shared_experts": 2 * 3, "routed_experts": 2
    }
    assert {e.fqn for e in plan.entries if e.fqn.startswith("model.layers.0.self_attn")} == {
        "model.layers.0.self_attn.q_a_proj",
        "model.layers.0.self_attn.q_b_proj",
        "model.layers.0.self_attn.kv_a_proj_with_mqa",
        "model.layers.0.self_attn.kv_b_proj",
        "model.layers.0.self_attn.o_proj",
    }
    # The q_lora_rank-null 16B file does not fit this model: zero hits on q_proj, with candidates.
    with pytest.raises(ValueError, match=r"(?s)'mla_projections'.*model\.layers\.0\.self_attn\.q_proj.*q_a_proj"):
        compile_plan(model, load_rules(PLAN_YAML), MXFP8)
    # Explicit rules of another model version (more layers) fail too.
    deeper = _default_rules_with_test_factories(dataclasses.replace(_Cfg(), num_hidden_layers=6))
    with pytest.raises(ValueError, match=r"model\.layers\.5\.self_attn\.q_proj"):
        compile_plan(_tiny_meta(), deeper, MXFP8)


@dataclasses.dataclass
class _Cfg:
    num_hidden_layers: int = 4
    first_k_dense_replace: int = 2
    q_lora_rank: int | None = None


def test_default_rules_reject_bad_config():
    with pytest.raises(ValueError, match="first_k_dense_replace"):
        deepseek_v3_default_rules(_Cfg(first_k_dense_replace=5))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        deepseek_v3_default_rules({"first_k_dense_replace": 1, "q_lora_rank": None})
    all_dense = deepseek_v3_default_rules(_Cfg(first_k_dense_replace=4))
    assert [r.name for r in all_dense] == ["mla_projections", "dense_mlp"]


def test_plan_compiled_on_meta_applies_after_materialisation():
    model = build_meta_model("dsv3-tiny")
    linear, experts = linear_factory(), generic_factory()
    plan = compile_plan(model, _default_rules_with_test_factories(model.config, linear, experts), HIF8)
    model.to_empty(device="cpu")  # new Parameter objects, same module tree
    before = _names(model)
    report = plan.apply(model)
    assert _names(model) == before
    assert report.counts == {"mla_projections": 12, "dense_mlp": 3, "shared_experts": 6, "routed_experts": 2}
    assert model.model.layers[1].mlp.experts.gate_up_proj.device.type == "cpu"


# ------------------------------------------------------------------------------------------------
# Compile-time errors
# ------------------------------------------------------------------------------------------------


def test_zero_hit_fqn_names_rule_fqn_and_nearest_fqns():
    model = build_meta_model("dsv3-tiny")
    rule = _rule("mla_typo", match=("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.qproj"))
    with pytest.raises(ValueError) as info:
        compile_plan(model, [rule], MXFP8)
    message = str(info.value)
    assert "'mla_typo'" in message and "'model.layers.0.self_attn.qproj'" in message
    assert "model.layers.0.self_attn.q_proj" in message.split("nearest FQNs:")[1]
    assert "named_modules()" in message
    nearest = ast.literal_eval(message.split("nearest FQNs: ")[1].splitlines()[0])  # the printed list
    assert 1 <= len(nearest) <= 5


def test_two_rules_on_one_module_fail():
    model = _Toy()
    rules = [_rule("first", match="layers.0.proj"), _rule("second", match=("layers.1.proj", "layers.0.proj"))]
    with pytest.raises(ValueError, match=r"'layers\.0\.proj'.*two rules: 'first'.*'second'"):
        compile_plan(model, rules, MXFP8)


def test_two_rules_on_aliases_of_one_module_fail():
    rules = [_rule("via_a", match="a"), _rule("via_b", match="b")]
    with pytest.raises(ValueError, match=r"two rules: 'via_a'.*'via_b'"):
        compile_plan(_Aliased(), rules, MXFP8)


def test_linear_subclass_fails_where_exact_linear_is_required():
    class MyLinear(nn.Linear):
        pass

    model = _Toy()
    model.layers[1].proj = MyLinear(8, 8)
    with pytest.raises(TypeError) as info:
        compile_plan(model, [_rule("proj")], MXFP8)
    message = str(info.value)
    assert "'layers.1.proj'" in message and "MyLinear" in message
    assert "exactly torch.nn.modules.linear.Linear" in message and "subclass" in message
    # exact_type=False accepts the subclass.
    plan = compile_plan(model, [_rule("proj", exact_type=False)], MXFP8)
    assert [e.fqn for e in plan.entries] == ["layers.0.proj", "layers.1.proj"]


def test_wrapper_module_fails_naming_the_wrapped_linear():
    class LoraWrapper(nn.Module):
        def __init__(self, base: nn.Linear) -> None:
            super().__init__()
            self.base_layer = base
            self.lora_a = nn.Linear(base.in_features, 2, bias=False)

        def forward(self, x):
            return self.base_layer(x)

    model = _Toy()
    model.layers[0].proj = LoraWrapper(model.layers[0].proj)
    pattern = r"'layers\.0\.proj' is .*LoraWrapper.*wraps .*Linear at \['layers\.0\.proj\.base_layer'"
    with pytest.raises(TypeError, match=pattern):
        compile_plan(model, [_rule("proj")], MXFP8)


@pytest.mark.parametrize(
    ("match", "module_type", "reason"),
    [
        ("lm_head", nn.Linear, "LM head"),
        ("embed_tokens", nn.Embedding, "embedding"),
        ("layers.0.norm", nn.LayerNorm, "normalization"),
        ("layers.0", _Block, "normalization"),  # contains a norm
    ],
)
def test_never_replaced_modules_are_refused(match, module_type, reason):
    rule = _rule("bad", match=match, module_type=module_type)
    with pytest.raises(ValueError, match=rf"selects '{match}'.*{reason}.*design spec §1\.1"):
        compile_plan(_Toy(), [rule], MXFP8, never_replace=_LM_HEAD)
    if reason == "LM head":  # a model's boundary is data: without it the plan knows no LM head
        assert [e.fqn for e in compile_plan(_Toy(), [rule], MXFP8).entries] == ["lm_head"]
    else:  # embeddings and norms are refused for every model
        with pytest.raises(ValueError, match=rf"selects '{match}'.*{reason}"):
            compile_plan(_Toy(), [rule], MXFP8)


def test_never_replace_rules_match_fqn_globs_and_class_names():
    by_name = (NeverReplaceRule(reason="layer stack", type_names=("Module*",)),)
    with pytest.raises(ValueError, match=r"selects 'layers', which is a layer stack module \(torch\.nn\.modules"):
        compile_plan(_Toy(), [_rule("seq", match="layers", module_type=nn.ModuleList, exact_type=False)], MXFP8,
                     never_replace=by_name)
    by_fqn = (NeverReplaceRule(reason="mixing", fqn_globs=("m?x",)),)
    with pytest.raises(ValueError, match=r"selects 'mix', which is a mixing module"):
        compile_plan(_Toy(), [_rule("mix", match="mix")], MXFP8, never_replace=by_fqn)
    with pytest.raises(ValueError, match="at least one of"):
        NeverReplaceRule(reason="nothing")
    with pytest.raises(TypeError, match="NeverReplaceRule objects"):
        compile_plan(_Toy(), [_rule()], MXFP8, never_replace=[("lm_head", "LM head")])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("match", "type_name", "reason"),
    [
        ("model.layers.1.mlp.gate", "DeepseekV3TopkRouter", "MoE router"),
        ("model.layers.1.mlp", "DeepseekV3MoE", "MoE router"),
        ("model.layers.0.self_attn", "DeepseekV3Attention", "core attention"),
        ("model.rotary_emb", "DeepseekV3RotaryEmbedding", "rotary embedding"),
        ("model.layers.0.self_attn.kv_a_layernorm", "DeepseekV3RMSNorm", "normalization"),
    ],
)
def test_never_replaced_deepseek_modules_are_refused(match, type_name, reason):
    type_path = f"transformers.models.deepseek_v3.modeling_deepseek_v3.{type_name}"
    rule = _rule("bad", match=match, module_type=type_path, factory=generic_factory())
    with pytest.raises(ValueError, match=reason):
        compile_plan(build_meta_model("dsv3-tiny"), [rule], MXFP8, never_replace=DEEPSEEK_V3.never_replace)


def test_exclude_skips_with_reason_and_all_excluded_is_an_error():
    plan = compile_plan(_Toy(), [_rule("proj", exclude="layers.1.proj")], MXFP8)
    assert [e.fqn for e in plan.entries] == ["layers.0.proj"]
    skipped = [(s.fqn, s.rule, s.reason) for s in plan.skipped]
    assert skipped == [("layers.1.proj", "proj", "excluded by 'layers.1.proj'")]
    assert "skipped layers.1.proj [proj]: excluded by 'layers.1.proj'" in plan.preview().format()
    with pytest.raises(ValueError, match=r"'proj' is enabled but selects no module.*excluded"):
        compile_plan(_Toy(), [_rule("proj", exclude=("layers.0.proj", "layers.1.proj"))], MXFP8)
    # An excluded never-replaced module is fine: exclusion wins.
    plan = compile_plan(_Toy(), [_rule("heads", match=("mix", "lm_head"), exclude="lm_head")], MXFP8,
                        never_replace=_LM_HEAD)
    assert [e.fqn for e in plan.entries] == ["mix"]


def test_nested_selections_fail():
    model = build_meta_model("dsv3-tiny")
    rules = [
        _rule("mlp", match="model.layers.0.mlp", factory=generic_factory(),
              module_type="transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MLP"),
        _rule("proj", match="model.layers.0.mlp.up_proj"),
    ]
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj'.*inside 'model\.layers\.0\.mlp'"):
        compile_plan(model, rules, MXFP8)


def test_bad_rules_fail():
    with pytest.raises(ValueError, match="non-empty full module FQN"):  # the root module has the FQN ""
        _rule("root", match="", module_type=nn.Module, exact_type=False)
    with pytest.raises(ValueError, match="unique"):
        compile_plan(_Toy(), [_rule("x"), _rule("x", match="mix")], MXFP8)
    with pytest.raises(TypeError, match="LowPrecisionPolicy"):
        compile_plan(_Toy(), [_rule()], LowPrecisionConfig())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'no_such_module'"):
        compile_plan(_Toy(), [_rule(module_type="torch.nn.no_such_module.Linear")], MXFP8)
    with pytest.raises(TypeError, match="is not a class"):
        compile_plan(_Toy(), [_rule(module_type="torch.nn.functional.linear")], MXFP8)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"match": ()}, ValueError, "`match` is empty"),
        ({"match": ("a", "a")}, ValueError, "more than once"),
        ({"match": (" a",)}, ValueError, "whitespace"),
        ({"match": ("layers.*.proj",)}, ValueError, r"`match` entry 'layers\.\*\.proj' is a wildcard.*§1\.1"),
        ({"match": ("layers.?.proj",)}, ValueError, "wildcard"),
        ({"match": ("layers.[01].proj",)}, ValueError, "wildcard"),
        ({"exclude": ("layers.1.*",)}, ValueError, r"`exclude` entry 'layers\.1\.\*' is a wildcard"),
        ({"module_type": "Linear"}, ValueError, "dotted import path"),
        ({"module_type": 3}, TypeError, "module_type"),
        ({"replace_module": {"_target_": "a.b", "scale": 2}}, ValueError, "_target_"),
        ({"replace_module": "not a path"}, ValueError, "dotted import path"),
        ({"replace_module": 3}, TypeError, "replace_module"),
        ({"when": "always"}, ValueError, r"`when` must be one of \['low_precision'\]"),
        ({"exact_type": "yes"}, TypeError, "exact_type"),
    ],
)
def test_rule_validation(kwargs, error, pattern):
    base = {"name": "r", "match": ("a",), "module_type": "torch.nn.Linear", "replace_module": "pkg.mod.fn"}
    with pytest.raises(error, match=pattern):
        ReplacementRule(**{**base, **kwargs})


def test_rules_from_config_seed_layout():
    rules = rules_from_config(
        [
            {
                "match": "model.layers.1.mlp.experts",
                "when": "low_precision",
                "module_type": "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Experts",
                "exact_type": True,
                "replace_module": {"_target_": "pkg.mod.replace_experts"},
            },
            {"name": "linear", "match": ["a", "b"], "module_type": "torch.nn.Linear",
             "replace_module": {"_target_": "pkg.mod.replace_linear"}},
        ]
    )
    assert [r.name for r in rules] == ["plan_overrides[0]", "linear"]
    assert rules[0].match == ("model.layers.1.mlp.experts",)
    assert rules[0].replace_module == "pkg.mod.replace_experts"
    assert rules[1].as_dict()["replace_module"] == {"_target_": "pkg.mod.replace_linear"}
    assert rules_from_config({"plan_overrides": [rules[1].as_dict()]}) == (rules[1],)
    with pytest.raises(ValueError, match=r"unknown rule key\(s\) \['format'\]"):
        rules_from_config([{**rules[1].as_dict(), "format": "hif8"}])
    with pytest.raises(ValueError, match="missing required"):
        rules_from_config([{"match": "a"}])
    with pytest.raises(ValueError, match="unique"):
        rules_from_config([rules[1].as_dict(), rules[1].as_dict()])
    globbed = {"match": ["model.layers.*.mlp"], "module_type": "torch.nn.Linear", "replace_module": "a.b"}
    with pytest.raises(ValueError, match=r"rule 'plan_overrides\[0\]': `match` entry 'model\.layers\.\*\.mlp' is a"):
        rules_from_config([globbed])


def test_compile_dispatches_no_tensor_op(dsv3_16b_meta):
    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    for model in (dsv3_16b_meta, _Toy()):
        rules = (
            _default_rules_with_test_factories(model.config) if isinstance(model, DeepseekV3ForCausalLM)
            else [_rule("proj"), _rule("out", match=("layers.0.out", "layers.1.out"))]
        )
        with CountOps() as counter:
            plan = compile_plan(model, rules, MXFP8)
            plan.preview()
        assert len(plan) > 0
        assert counter.ops == []


# ------------------------------------------------------------------------------------------------
# Apply: contract preserved, aliases, atomicity
# ------------------------------------------------------------------------------------------------


def test_successful_apply_preserves_names_identity_flags_signature_and_output():
    model = _Toy()
    ids = torch.randint(0, 16, (2, 5))
    expected = model(ids)
    before = _names(model)
    signatures = {
        fqn: str(inspect.signature(model.get_submodule(fqn).forward)) for fqn in ("layers.0.proj", "layers.1.out")
    }
    linear = linear_factory()
    rules = [_rule("proj", factory=linear), _rule("out", match=("layers.0.out", "layers.1.out"), factory=linear)]
    plan = compile_plan(model, rules, HIF8)
    report = plan.apply(model)

    assert _names(model) == before  # FQNs, param/buffer names + objects, state_dict keys, requires_grad, training
    assert [fqn for fqn, _ in linear.calls] == ["layers.0.proj", "layers.0.out", "layers.1.proj", "layers.1.out"]
    for fqn in ("layers.0.proj", "layers.0.out", "layers.1.proj", "layers.1.out"):
        assert type(model.get_submodule(fqn)) is _TestLowPrecisionLinear
    assert model.layers[1].proj.training is False and model.layers[1].out.weight.requires_grad is False
    for fqn, text in signatures.items():
        assert str(inspect.signature(model.get_submodule(fqn).forward)) == text
    torch.testing.assert_close(model(ids), expected, rtol=0, atol=0)
    assert report.counts == {"proj": 2, "out": 2}
    assert {r.to_type for r in report.replaced} == {f"{__name__}._TestLowPrecisionLinear"}


def test_alias_fqns_replaced_once_and_installed_everywhere_sharing_preserved():
    model = _Aliased()
    weight_c, weight_a = model.c.weight, model.a.weight
    linear = linear_factory()
    plan = compile_plan(model, [_rule("all", match=("b", "c", "d"), factory=linear)], MXFP8)
    entries = [(e.fqns, e.matched_fqns) for e in plan.entries]
    assert entries == [(("a", "b"), ("b",)), (("c",), ("c",)), (("d",), ("d",))]
    before = _names(model)
    report = plan.apply(model)
    assert [fqn for fqn, _ in linear.calls] == ["a", "c", "d"]  # the aliased module once, by its primary FQN
    assert model.a is model.b and type(model.a) is _TestLowPrecisionLinear
    assert model.a.weight is weight_a
    assert model.c.weight is model.d.weight is weight_c  # shared Parameter stays shared
    assert _names(model) == before
    assert report.replaced[0].aliases == ("b",) and report.counts == {"all": 3}


def _first_call_ok_then(build_bad):
    """Factory: the first call behaves, later calls use ``build_bad(source)``."""
    state = {"n": 0}

    def factory(source, *, fqn, policy):
        state["n"] += 1
        return _linear_like(source) if state["n"] == 1 else build_bad(source)

    return factory


def _raise(source):
    source.weight.requires_grad_(False)  # even a factory that touched shared state before failing
    source.train(False)
    raise RuntimeError("factory exploded")


def _copy_param(source):
    new = _linear_like(source)
    new.weight = nn.Parameter(source.weight.detach().clone())
    return new


def _rename_forward_arg(source):
    class Renamed(nn.Linear):
        def forward(self, inputs):  # nn.Linear's is forward(self, input)
            return super().forward(inputs)

    new = Renamed(source.in_features, source.out_features, device="meta")
    new.weight, new.bias = source.weight, source.bias
    return new


def _extra_buffer(source):
    new = _linear_like(source)
    new.register_buffer("amax", torch.zeros(()))
    return new


def _flip_training(source):
    return _linear_like(source).train(not source.training)


def _drop_bias(source):
    new = _linear_like(source)
    del new._parameters["bias"]
    return new


@pytest.mark.parametrize(
    ("build_bad", "error", "pattern"),
    [
        (_raise, RuntimeError, "factory exploded"),
        (_copy_param, ValueError, r"parameter 'weight' is a different object"),
        (_rename_forward_arg, ValueError, r"forward signature changed"),
        (_extra_buffer, ValueError, r"buffer names changed: \[\] -> \['amax'\]"),
        (_flip_training, ValueError, r"`training` flags changed"),
        (_drop_bias, ValueError, r"parameter names changed: \['weight', 'bias'\] -> \['weight'\]"),
        (lambda source: "not a module", TypeError, "not an nn.Module"),
        (lambda source: source, ValueError, "returned the source module itself"),
    ],
)
def test_failed_apply_leaves_model_untouched(build_bad, error, pattern):
    model = _Toy()
    before = _snapshot(model)
    rules = [
        _rule("proj", factory=_first_call_ok_then(build_bad)), _rule("out", match=("layers.0.out", "layers.1.out"))
    ]
    plan = compile_plan(model, rules, MXFP8)
    with pytest.raises(error, match=pattern) as info:
        plan.apply(model)
    _assert_untouched(model, before)
    if error is RuntimeError:
        assert any("'layers.1.proj'" in note for note in getattr(info.value, "__notes__", [""]))
    elif error is ValueError and "source module itself" not in pattern:
        assert "'layers.1.proj'" in str(info.value) and "rule 'proj'" in str(info.value)


def test_failed_install_rolls_back():
    class Picky(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(4, 4)
            self.second = nn.Linear(4, 4)

        def __setattr__(self, name, value):
            if name == "second" and type(value) is not nn.Linear:
                raise RuntimeError("parent refuses")
            super().__setattr__(name, value)

    model = nn.Sequential()
    model.add_module("picky", Picky())
    before = _snapshot(model)
    plan = compile_plan(model, [_rule("all", match=("picky.first", "picky.second"))], MXFP8)
    with pytest.raises(RuntimeError, match="parent refuses"):
        plan.apply(model)
    _assert_untouched(model, before)


def test_two_factories_returning_one_object_fail():
    shared = {}

    def factory(source, *, fqn, policy):
        return shared.setdefault("m", _linear_like(source))

    model = nn.Module()
    model.c = nn.Linear(4, 4, bias=False)
    model.d = nn.Linear(4, 4, bias=False)
    model.d.weight = model.c.weight  # so one object passes both per-module checks
    plan = compile_plan(model, [_rule("cd", match=("c", "d"), factory=factory)], MXFP8)
    before = _snapshot(model)
    with pytest.raises(ValueError, match="two factories returned the same module object"):
        plan.apply(model)
    _assert_untouched(model, before)


def test_apply_checks_structure_and_factory_before_calling_anything(tmp_path, monkeypatch):
    model = _Toy()
    linear = linear_factory()
    plan = compile_plan(model, [_rule("proj", factory=linear)], MXFP8)
    changed = _Toy()
    changed.layers[1].proj = nn.Identity()
    with pytest.raises(TypeError, match=r"'layers\.1\.proj' is .*Identity.*at compile time"):
        plan.apply(changed)
    smaller = _Toy()
    del smaller.layers[1]
    with pytest.raises(ValueError, match=r"'layers\.1\.proj'.*does not exist"):
        plan.apply(smaller)
    assert linear.calls == []

    def wrong_signature(source, fqn):
        raise AssertionError("must not be called")

    with pytest.raises(TypeError, match=r"must accept \(source, \*, fqn, policy\)"):
        compile_plan(model, [_rule("proj", factory=wrong_signature)], MXFP8).apply(model)

    # String targets are imported at apply time only, and a missing one fails before any call.
    (tmp_path / "lp_test_factories.py").write_text(
        "import sys\nLOADED = True\n"
        "def replace(source, *, fqn, policy):\n"
        "    from tests_factory_helper import build\n"
        "    return build(source)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lp_test_factories", raising=False)
    before = _snapshot(model)
    lazy = compile_plan(
        model,
        [_rule("first", match="layers.0.proj", factory=linear),
         _rule("late", match="layers.1.proj", factory="lp_test_factories.no_such_factory")],
        MXFP8,
    )
    assert "lp_test_factories" not in sys.modules  # compile imported nothing
    with pytest.raises(ValueError, match=r"rule 'late'.*has no attribute or submodule 'no_such_factory'"):
        lazy.apply(model)
    assert "lp_test_factories" in sys.modules and linear.calls == []
    _assert_untouched(model, before)


# ------------------------------------------------------------------------------------------------
# Low precision off
# ------------------------------------------------------------------------------------------------


def test_disabled_policy_gives_empty_plan_and_calls_nothing():
    class NoScan(_Toy):
        def named_modules(self, *args, **kwargs):
            raise AssertionError("compile must not scan the model when low precision is off")

    model = NoScan()
    linear = linear_factory()
    plan = compile_plan(model, [_rule("proj", factory=linear), _rule("bad", match="no.such.fqn")], OFF)
    assert isinstance(plan, ModuleReplacementPlan) and len(plan) == 0
    report = plan.apply(model)
    assert isinstance(report, ReplacementReport) and report.applied
    assert linear.calls == [] and report.num_replaced == 0 and report.counts == {"proj": 0, "bad": 0}
    assert report.as_dict()["inactive_rules"] == [
        {"rule": "proj", "reason": "low_precision.enabled is false"},
        {"rule": "bad", "reason": "low_precision.enabled is false"},
    ]
    assert "proj: inactive (low_precision.enabled is false)" in report.format()
    assert type(model.layers[0].proj) is nn.Linear


@pytest.mark.slow
def test_disabled_run_imports_no_torch_npu_and_no_factory(tmp_path):
    """Subprocess: with a torch_npu import trap armed, the enabled=False path imports nothing."""
    (tmp_path / "lp_trap_factories.py").write_text(
        "raise ImportError('lp_trap_factories must not be imported when low precision is off')\n"
    )
    code = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(tmp_path)!r})
        from lp_lightning.models.deepseek_v3 import build_meta_model
        model = build_meta_model("dsv3-tiny")  # transformers' own NPU probing happens before the trap

        class Trap:
            hits = []
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch_npu", "lp_trap_factories"):
                    Trap.hits.append(name)
                return None

        sys.meta_path.insert(0, Trap())
        from lp_lightning.models.deepseek_v3.rules import deepseek_v3_default_rules
        from lp_lightning.plan import compile_plan, load_rules
        from lp_lightning.policy import LowPrecisionConfig

        policy = LowPrecisionConfig.from_precision("bf16").to_policy()
        rules = [*deepseek_v3_default_rules(model.config, linear_factory="lp_trap_factories.linear",
                                            experts_factory="lp_trap_factories.experts")]
        reports = [compile_plan(model, r, policy).apply(model).as_dict()
                   for r in (rules, load_rules({str(PLAN_YAML)!r}))]
        print(json.dumps({{
            "hits": Trap.hits,
            "torch_npu": "torch_npu" in sys.modules,
            "replaced": [r["num_replaced"] for r in reports],
            "types": sorted({{type(m).__name__ for m in model.modules()}}),
        }}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["hits"] == [] and result["torch_npu"] is False
    assert result["replaced"] == [0, 0]
    assert "DeepseekV3Experts" in result["types"] and not any("LowPrecision" in t for t in result["types"])
