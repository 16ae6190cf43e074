"""Tests of lp_lightning.models.deepseek_v3: build from a config, named specs, validation (§4.1, R4).

The 16B spec is only ever built on the meta device; the tiny spec is materialised on CPU.
"""

from __future__ import annotations

import json
import math
import socket
import warnings

import pytest
import torch
from torch import nn
from transformers import DeepseekV3ForCausalLM

from lp_lightning.models.deepseek_v3 import (
    SPECS,
    SpecName,
    SpecValidationError,
    build_config,
    build_meta_model,
    expected_structure,
    from_hf_config,
    inherited_fields,
    structure_report,
    validate_spec,
)
from lp_lightning.models.deepseek_v3.validate_cli import validate_model_main

# Total parameter count of the frozen 16B spec (§4.1), computed once from the closed form in
# expected_structure and checked against the built meta model:
#   2·V·H + H + 28·(attention 24,251,392 + 2H) + 1·3·H·I + 27·(E·H + 3·E·H·F + 3·H·S·F)
DSV3_16B_TOTAL_PARAMS = 16_585_005_056
DSV3_16B_ACTIVATED_PARAMS = 3_037_927_424
DSV3_TINY_TOTAL_PARAMS = 3_033_120


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """No hub access: offline flags set and any socket connection fails the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")

    def _refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", _refuse)
    monkeypatch.setattr(socket, "create_connection", _refuse)


@pytest.fixture(scope="module")
def tiny() -> DeepseekV3ForCausalLM:
    return from_hf_config("dsv3-tiny", seed=1234)


@pytest.fixture(scope="module")
def meta_16b() -> DeepseekV3ForCausalLM:
    return from_hf_config("dsv3-16b", device="meta")


# ----------------------------------------------------------------------------------------------
# Named specs


def test_specs_are_read_only_and_16b_is_the_seed_block_verbatim():
    seed_41 = {
        "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 28, "first_k_dense_replace": 1,
        "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64,
        "n_shared_experts": 2, "q_lora_rank": None, "kv_lora_rank": 3072, "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "num_experts_per_tok": 6, "n_group": 1,
        "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "max_position_embeddings": 4096, "use_cache": False,
    }  # fmt: skip
    assert dict(SPECS["dsv3-16b"]) == seed_41
    assert set(SPECS) == {name.value for name in SpecName}
    with pytest.raises(TypeError):
        SPECS["dsv3-16b"]["num_hidden_layers"] = 27  # type: ignore[index]
    with pytest.raises(TypeError):
        SPECS["dsv3-x"] = {}  # type: ignore[index]


def test_tiny_uses_plain_rope_and_untied_head():
    config = build_config("dsv3-tiny")
    assert config.rope_parameters["rope_type"] == "default"
    assert "factor" not in config.rope_parameters
    assert config.tie_word_embeddings is False
    assert config.use_cache is False


def test_tiny_gemm_dims_are_mx_and_two_rank_shard_friendly():
    report = expected_structure({**_defaults(), **SPECS["dsv3-tiny"]})
    expected = {
        "self_attn.q_proj.weight": (256, 256),
        "self_attn.kv_a_proj_with_mqa.weight": (128, 256),
        "self_attn.kv_b_proj.weight": (384, 96),
        "self_attn.o_proj.weight": (256, 256),
        "mlp.gate_proj.weight": (512, 256),
        "mlp.up_proj.weight": (512, 256),
        "mlp.down_proj.weight": (256, 512),
        "mlp.shared_experts.gate_proj.weight": (128, 256),
        "mlp.shared_experts.up_proj.weight": (128, 256),
        "mlp.shared_experts.down_proj.weight": (256, 128),
        "mlp.experts.gate_up_proj": (8, 256, 256),
        "mlp.experts.down_proj": (8, 256, 128),
    }
    shapes = {glob.removeprefix("model.layers.*."): shape for glob, shape in report.projection_shapes}
    assert shapes == expected
    for name, shape in shapes.items():
        out_features, in_features = shape[-2:]
        assert in_features % 32 == 0 and out_features % 32 == 0, name  # MX block of 32 along K
        assert out_features % 128 == 0, name  # 2-rank row shards stay 64-row aligned


def _defaults() -> dict:
    from transformers import DeepseekV3Config

    config = DeepseekV3Config()
    return {"attention_bias": config.attention_bias, "tie_word_embeddings": config.tie_word_embeddings}


# ----------------------------------------------------------------------------------------------
# Tiny build on CPU


def test_tiny_has_plain_parameters_and_hf_backends(tiny):
    assert isinstance(tiny, DeepseekV3ForCausalLM)
    assert tiny.training
    assert tiny.config._attn_implementation == "sdpa"
    assert tiny.config._experts_implementation == "eager"
    for name, param in tiny.named_parameters():
        assert type(param) is nn.Parameter, name  # no DTensor, no subclass
        assert param.device.type == "cpu", name
        expected_dtype = torch.float32 if name.endswith("mlp.gate.weight") else torch.bfloat16
        assert param.dtype == expected_dtype, name
    assert sum(p.numel() for p in tiny.parameters()) == DSV3_TINY_TOTAL_PARAMS


def test_tiny_init_statistics_follow_hf_init(tiny):
    std = tiny.config.initializer_range
    eps_bf16 = 2.0**-8
    checked = 0
    for name, param in tiny.named_parameters():
        values = param.detach().double()
        if name.endswith("norm.weight") or "layernorm" in name:
            assert torch.equal(values, torch.ones_like(values)), name
            continue
        n = values.numel()
        # Sample std of n normal draws has relative standard error 1/sqrt(2n); allow 6 of those
        # plus bf16 rounding. The sample mean has standard error std/sqrt(n).
        assert abs(values.std().item() / std - 1) < 6 / math.sqrt(2 * n) + eps_bf16, name
        assert abs(values.mean().item()) < 6 * std / math.sqrt(n), name
        checked += 1
    # embed, lm_head, 3x(q, kv_a, kv_b, o), dense 3, 2x(router, gate_up, down, shared 3)
    assert checked == 2 + 3 * 4 + 3 + 2 * 6
    for name, buffer in tiny.named_buffers():
        if name.endswith("e_score_correction_bias"):
            assert torch.equal(buffer, torch.zeros_like(buffer)), name
        elif name.endswith("inv_freq"):
            dim = tiny.config.qk_rope_head_dim
            ref = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            assert torch.equal(buffer, ref), name


def test_tiny_forward_backward_runs(tiny):
    input_ids = torch.randint(0, tiny.config.vocab_size, (2, 32))
    out = tiny(input_ids=input_ids, labels=input_ids)
    assert out.logits.shape == (2, 32, tiny.config.vocab_size)
    # Random init: loss ~ ln(V) (uniform prediction) within a few tenths.
    assert abs(out.loss.item() - math.log(tiny.config.vocab_size)) < 0.5
    out.loss.backward()
    grads = [p.grad for p in tiny.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    tiny.zero_grad(set_to_none=True)


def test_seeded_build_is_bitwise_reproducible_and_leaves_global_rng_alone(tiny):
    rng_before = torch.get_rng_state()
    again = from_hf_config("dsv3-tiny", seed=1234)
    assert torch.equal(torch.get_rng_state(), rng_before)
    for (name, a), (_, b) in zip(tiny.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.is_floating_point() else torch.equal(a, b), name
    other = from_hf_config("dsv3-tiny", seed=1235)
    assert not torch.equal(other.lm_head.weight, tiny.lm_head.weight)
    # seed=s is the same stream as torch.manual_seed(s) followed by an unseeded build.
    torch.manual_seed(1234)
    unseeded = from_hf_config("dsv3-tiny")
    assert torch.equal(unseeded.model.layers[1].mlp.experts.gate_up_proj, tiny.model.layers[1].mlp.experts.gate_up_proj)


def test_float32_build():
    model = from_hf_config("dsv3-tiny", torch_dtype="float32", seed=0)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with pytest.raises(ValueError, match="torch_dtype"):
        from_hf_config("dsv3-tiny", torch_dtype="int8")


# ----------------------------------------------------------------------------------------------
# 16B on meta


def test_16b_meta_report_matches_analytic_and_pinned_count(meta_16b):
    assert all(p.device.type == "meta" for p in meta_16b.parameters())
    report = structure_report(meta_16b)
    expected = expected_structure({**_defaults(), **SPECS["dsv3-16b"]})
    assert report == expected
    assert report.total_params == DSV3_16B_TOTAL_PARAMS
    assert sum(p.numel() for p in meta_16b.parameters()) == DSV3_16B_TOTAL_PARAMS
    assert report.activated_params == DSV3_16B_ACTIVATED_PARAMS
    assert report.layers == 28 and report.dense_layers == (0,) and report.moe_layers == tuple(range(1, 28))
    assert (report.n_routed_experts, report.n_shared_experts, report.num_experts_per_tok) == (64, 2, 6)
    shapes = dict(report.projection_shapes)
    assert shapes["model.layers.*.self_attn.q_proj.weight"] == (16 * 128, 2048)
    assert shapes["model.layers.*.self_attn.kv_a_proj_with_mqa.weight"] == (3072 + 64, 2048)
    assert shapes["model.layers.*.self_attn.kv_b_proj.weight"] == (16 * (64 + 128), 3072)
    assert shapes["model.layers.*.mlp.experts.gate_up_proj"] == (64, 2 * 1408, 2048)
    assert shapes["model.layers.*.mlp.experts.down_proj"] == (64, 2048, 1408)
    assert "model.layers.*.self_attn.q_a_proj.weight" not in shapes  # q_lora_rank: null
    assert validate_spec(meta_16b, "dsv3-16b") == report
    text = report.format()
    assert "16,585,005,056" in text and "dense [0], MoE [1-27]" in text
    assert json.loads(report.to_json())["total_params"] == DSV3_16B_TOTAL_PARAMS


@pytest.mark.parametrize(
    ("override", "value", "expected"),
    [("num_hidden_layers", 27, 28), ("n_routed_experts", 63, 64), ("kv_lora_rank", 512, 3072)],
)
def test_16b_override_fails_naming_the_field(override, value, expected):
    with pytest.raises(SpecValidationError) as info:
        from_hf_config("dsv3-16b", config_overrides={override: value}, device="meta")
    err = info.value
    assert (override, expected, value) in err.mismatches
    assert f"{override}: expected {expected}, got {value}" in str(err)
    assert any(field == "structure.total_params" for field, _, _ in err.mismatches)
    # The same variant builds when validation is explicitly turned off.
    model = from_hf_config("dsv3-16b", config_overrides={override: value}, device="meta", validate=False)
    assert getattr(model.config, override) == value


def test_structural_drift_outside_the_spec_fields_is_caught():
    # attention_bias is not a §4.1 field, but a source config that sets it changes the structure.
    model = build_meta_model("dsv3-16b", config_overrides={"attention_bias": True})
    with pytest.raises(SpecValidationError, match=r"o_proj\.bias.*expected None, got \[2048\]"):
        validate_spec(model, "dsv3-16b")


@pytest.mark.parametrize(
    "overrides",
    [
        {"q_lora_rank": 64},
        {"attention_bias": True, "q_lora_rank": 64},
        {"tie_word_embeddings": True},
        {"first_k_dense_replace": 0},
        {"first_k_dense_replace": 3},
        {"n_shared_experts": 2, "num_experts_per_tok": 4},
    ],
)
def test_analytic_structure_matches_built_model_on_every_branch(overrides):
    spec = {**SPECS["dsv3-tiny"], **overrides}
    model = build_meta_model("dsv3-tiny", config_overrides=overrides)
    report = validate_spec(model, spec)
    assert report.total_params == sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------
# Config sources


def test_local_config_folder_and_file_work_offline(tmp_path):
    source = {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        **{k: (dict(v) if k == "rope_parameters" else v) for k, v in SPECS["dsv3-tiny"].items()},
        "num_hidden_layers": 2,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"},
    }
    (tmp_path / "config.json").write_text(json.dumps(source))
    with pytest.warns(UserWarning, match="quantization_config"):
        model = from_hf_config(tmp_path, seed=0, config_overrides={"num_hidden_layers": 3}, spec="dsv3-tiny")
    assert not hasattr(model.config, "quantization_config")
    assert structure_report(model).total_params == DSV3_TINY_TOTAL_PARAMS
    with pytest.warns(UserWarning, match="quantization_config"):
        config = build_config(str(tmp_path / "config.json"))
    assert config.num_hidden_layers == 2 and config.kv_lora_rank == 96
    # A path is validated only against an explicit spec.
    with pytest.warns(UserWarning), pytest.raises(SpecValidationError, match="num_hidden_layers"):
        from_hf_config(tmp_path, device="meta", spec="dsv3-tiny")


def test_released_v3_config_plus_16b_overrides_validates_and_flags_inherited_yarn(tmp_path):
    # The fields of DeepSeek-V3's released config.json that the §4.1 block does not reset.
    released = {
        "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "n_routed_experts": 256, "first_k_dense_replace": 3, "rope_theta": 10000,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"},
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "max_position_embeddings": 163840,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(released))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = from_hf_config(tmp_path, config_overrides=SPECS["dsv3-16b"], spec="dsv3-16b", device="meta")
    messages = [str(w.message) for w in caught]
    assert any("dropping 'quantization_config'" in m for m in messages)
    assert any("rope_parameters=" in m and "yarn" in m for m in messages)
    assert all(w.filename == __file__ for w in caught)  # points at the caller, not at spec.py
    assert structure_report(model).total_params == DSV3_16B_TOTAL_PARAMS
    assert list(inherited_fields(model.config, "dsv3-16b")) == ["rope_parameters"]
    assert inherited_fields(build_config("dsv3-16b"), "dsv3-16b") == {}


def test_bad_sources_and_overrides_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="neither a built-in spec"):
        build_config("deepseek-ai/DeepSeek-V3")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type='llama'"):
        build_config(tmp_path)
    with pytest.raises(ValueError, match="no config.json"):
        build_config(tmp_path / "..")
    with pytest.raises(ValueError, match=r"\['num_layers'\] are not DeepseekV3Config fields"):
        build_config("dsv3-tiny", config_overrides={"num_layers": 2})
    with pytest.raises(ValueError, match="num_hidden_layers"):
        build_config("dsv3-tiny", config_overrides={"num_hidden_layers": "three"})
    with pytest.raises(ValueError, match="not a built-in spec"):
        validate_spec(build_meta_model("dsv3-tiny"), "dsv3-7b")


# ----------------------------------------------------------------------------------------------
# lp-lightning validate-model


def test_validate_model_main_prints_report_and_exit_codes(capsys):
    assert validate_model_main(["--spec", "dsv3-16b"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "16,585,005,056" in out and "experts.gate_up_proj" in out

    assert validate_model_main(["--spec", "dsv3-16b", "--config_overrides", '{"num_hidden_layers": 27}']) == 1
    captured = capsys.readouterr()
    assert "MISMATCH" in captured.out and "15,989,668,864" in captured.out
    assert "num_hidden_layers: expected 28, got 27" in captured.err

    assert validate_model_main(["--spec", "dsv3-tiny", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["valid"] is True and payload["report"]["total_params"] == DSV3_TINY_TOTAL_PARAMS

    assert validate_model_main(["--spec", "dsv3-tiny", "--json", "--config_overrides", '{"n_routed_experts": 16}']) == 1
    payload = json.loads(capsys.readouterr().out)
    assert payload["valid"] is False
    assert {"field": "n_routed_experts", "expected": 8, "actual": 16} in payload["mismatches"]

    assert validate_model_main(["--spec", "dsv3-70b"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert validate_model_main(["--config_overrides", '{"n_layers": 3}']) == 2
    assert "not DeepseekV3Config fields" in capsys.readouterr().err


def test_validate_model_main_with_local_config_path(tmp_path, capsys):
    # A full-size-like source config: the spec's fields are applied on top, as in the §4.1 YAML.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "attention_bias": False}))
    assert validate_model_main(["--spec", "dsv3-16b", "--config_path", str(tmp_path)]) == 0
    assert "16,585,005,056" in capsys.readouterr().out
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096}}))
    assert validate_model_main(["--spec", "dsv3-16b", "--config_path", str(tmp_path)]) == 0
    assert "note: rope_parameters=" in capsys.readouterr().out
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "tie_word_embeddings": True}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert validate_model_main(["--spec", "dsv3-16b", "--config_path", str(tmp_path)]) == 1
    assert "lm_head.weight" in capsys.readouterr().err


def test_validate_model_main_rejects_a_model_without_layers(capsys):
    overrides = '{"num_hidden_layers": 0}'
    assert validate_model_main(["--spec", "dsv3-tiny", "--config_overrides", overrides]) == 2
    assert "num_hidden_layers=0 builds no decoder layer" in capsys.readouterr().err
