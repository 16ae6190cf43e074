"""Design spec §15, "Constraints and failure rules": one test per row of the limit matrix, asserting stage and message.

Stages (as the spec names them; how this repository realises each):

- **parse**: ``lp-lightning fit`` exits with status 2 (a usage error, no traceback) while parsing,
  before any class is instantiated (``LPLightningCLI.instantiate_classes`` is never called, no model
  is built);
- **launch**: the same exit 2, after the checks that need the config's meta model
  (``cli.launch_low_precision.check_low_precision_launch``: the replacement plan compiled on the meta twin, the shard
  rule over the launch's world size), still before any process, Trainer or model exists;
- **after model build**: an in-process Trainer run (one rank, gloo) fails after ``configure_model``
  built the model (spec validation), or in the plan compile/apply that follows, before any
  ``fully_shard``;
- **optimizer construction**: the Trainer's ``configure_optimizers`` result or Fabric's
  ``fabric.setup_optimizers`` is refused before any step.

Rows covered here: model spec, format/scaling pairs (HiF8 delayed says "not supported"), targets
(zero hits, wrong type, wildcards, overrides from YAML and CLI), TP/CP/EP/PP, comm fusion, non-DCP
checkpoint, illegal shards without fallback, optimizer (Trainer and Fabric), recompute, PEFT/custom
modules, and ``--print_config`` (it validates first). Refused Trainer options are in
``tests/test_cli.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

import lp_lightning.fsdp.parallelize as fsdp
import lp_lightning.models.deepseek_v3 as deepseek_v3
from lp_lightning.cli import main
from lp_lightning.cli.fit import LPLightningCLI, parse_config
from lp_lightning.cli.launch import check_launch
from lp_lightning.fsdp.optimizer import check_optimizer
from lp_lightning.lightning import (
    BF16FabricPlugin,
    BF16Plugin,
    DeepSeekV3LM,
    FSDP2FabricStrategy,
    FSDP2Strategy,
    LowPrecisionFabricPlugin,
    LowPrecisionPlugin,
)
from lp_lightning.models.adapter import LINEAR_FACTORY
from lp_lightning.plan import rules_from_config
from lp_lightning.st.illegal_child import LinearSubclass, PeftStyleWrapper  # the harness's illegal PEFT/custom modules

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# ------------------------------------------------------------------------------------------------
# Hardware / backend row (the startup gate, before the model is built: SoC, torch_npu version, each
# op the format needs; `backend: auto|emulated|npu`): tests/lightning/test_startup_gate.py (through the
# CLI on the npu accelerator, stage and message) and tests/ops/test_gate.py (the gate's choices).
# ------------------------------------------------------------------------------------------------
NO_NPU = ("--trainer.accelerator", "cpu")
"""The 16B configs ask for the npu accelerator; without torch_npu that fails first (tested in
tests/lightning/test_accelerator.py), so the 16B launch checks run with the accelerator on the CPU."""


# ------------------------------------------------------------------------------------------------
# Stage spies
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def nothing_instantiated(monkeypatch):
    """Records model builds and CLI instantiation; a test asserts both stayed empty (parse/launch stage)."""
    calls: list[str] = []

    def instantiate(self):
        calls.append("instantiate_classes")
        raise AssertionError("the CLI got past parsing")

    monkeypatch.setattr(LPLightningCLI, "instantiate_classes", instantiate)
    monkeypatch.setattr(deepseek_v3, "from_hf_config", lambda *a, **k: calls.append("from_hf_config"))
    return calls


def _fails_at_parse(capsys, calls: list[str], *args: str) -> str:
    """Runs ``lp-lightning fit *args``; asserts exit status 2 with nothing built; returns stderr."""
    with pytest.raises(SystemExit) as exc:
        main(["fit", *args])
    captured = capsys.readouterr()
    assert exc.value.code == 2, captured.err[-2000:]
    assert calls == []
    assert "Traceback" not in captured.err and captured.err.count("error: ") == 1
    message, pointer, rest = captured.err.split("error: ", 1)[1].rpartition("lp-lightning fit --help lists every option.")
    assert pointer and not rest.strip()  # the error, then the pointer to --help (no usage dump)
    return " ".join(message.split())  # the message, whitespace folded


@pytest.fixture
def build_stages(monkeypatch):
    """Records, in order, the model build, the plan compile and every ``fully_shard`` of a Trainer run."""
    events: list[str] = []
    compile_plan, fully_shard = LowPrecisionFabricPlugin.compile_plan, fsdp.fully_shard
    build = deepseek_v3.from_hf_config

    def record_build(*args, **kwargs):
        events.append("model_build")
        return build(*args, **kwargs)

    def record_compile(self, meta):
        events.append("plan_compile")
        return compile_plan(self, meta)

    def record_shard(*args, **kwargs):
        events.append("fully_shard")
        return fully_shard(*args, **kwargs)

    monkeypatch.setattr(deepseek_v3, "from_hf_config", record_build)
    monkeypatch.setattr(LowPrecisionFabricPlugin, "compile_plan", record_compile)
    monkeypatch.setattr(fsdp, "fully_shard", record_shard)
    return events


def _batches(n: int = 2) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 256, (n, 2, 9), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row[:, :-1], "labels": row[:, 1:]} for row in ids]


def _fit(module: pl.LightningModule, plugin: LowPrecisionPlugin, root: Path) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=FSDP2Strategy(), plugins=[plugin], max_steps=1,
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        default_root_dir=str(root),
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(_batches(), batch_size=None))
    return trainer


def _linear_rule(name: str, *fqns: str, module_type: str = "torch.nn.Linear") -> dict:
    return {"name": name, "match": list(fqns), "module_type": module_type,
            "replace_module": {"_target_": LINEAR_FACTORY}}


# ------------------------------------------------------------------------------------------------
# Model: the frozen structure, checked after the model is built (spec validation)
# ------------------------------------------------------------------------------------------------


def test_model_spec_fails_after_model_build(tmp_path, build_stages, isolated_dist):
    module = DeepSeekV3LM(config_overrides={"num_hidden_layers": 4})  # dsv3-tiny has 3 layers
    with pytest.raises(deepseek_v3.SpecValidationError, match=r"num_hidden_layers.*4.*3"):
        _fit(module, LowPrecisionPlugin("mxfp8"), tmp_path)
    assert build_stages == ["model_build"]  # failed in the build's validation: no plan, no fully_shard


# ------------------------------------------------------------------------------------------------
# Low-precision format: only mxfp8_e4m3+mx_block and hif8+current, rejected at config parse
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--precision", "hif8", "--low_precision.enabled", "true", "--low_precision.format", "hif8",
          "--low_precision.scaling", "delayed"],
         "low_precision.scaling='delayed': HiF8 delayed scaling is not supported"),
        (["--low_precision.scaling", "delayed"], "HiF8 delayed scaling is not supported"),
        (["--precision", "mxfp8", "--low_precision.enabled", "true", "--low_precision.scaling", "current"],
         "illegal low-precision pair mxfp8_e4m3+current; the legal pairs are mxfp8_e4m3+mx_block, hif8+current"),
        (["--precision", "hif8", "--low_precision.enabled", "true", "--low_precision.format", "hif8"],
         "illegal low-precision pair hif8+mx_block"),
        (["--precision", "hif8", "--low_precision.format", "hif8", "--low_precision.scaling", "current"],
         "selects --precision bf16, but precision='hif8'; set `low_precision.enabled: true`"),
        (["--low_precision.format", "hif8", "--low_precision.scaling", "current"],
         "low_precision names hif8+current but enabled=False, so this run would train in bf16; set "
         "`low_precision.enabled: true` and `precision: hif8`"),
    ],
    ids=["hif8-delayed", "delayed-alone", "mxfp8-current", "hif8-mx_block", "enabled-missing", "bf16-with-hif8-pair"],
)
def test_format_scaling_pairs_fail_at_parse(capsys, nothing_instantiated, options, message):
    text = _fails_at_parse(capsys, nothing_instantiated, *options)
    assert message in text and "Does not validate against any of the Union subtypes" not in text


def test_hif8_delayed_in_yaml_fails_at_parse_in_words(tmp_path, capsys, nothing_instantiated):
    path = tmp_path / "delayed.yaml"
    path.write_text("precision: hif8\nlow_precision: {enabled: true, format: hif8, scaling: delayed}\n")
    text = _fails_at_parse(capsys, nothing_instantiated, "--config", str(path))
    assert text.startswith("low_precision.scaling='delayed': HiF8 delayed scaling is not supported")
    assert "for hif8 set `scaling: current`" in text


# ------------------------------------------------------------------------------------------------
# Targets: explicit FQNs; zero hits or a type mismatch fail at plan compile; overrides from YAML/CLI
# ------------------------------------------------------------------------------------------------


def test_wildcard_targets_fail_at_parse_from_cli_and_yaml(tmp_path, capsys, nothing_instantiated):
    rule = _linear_rule("mla", "model.layers.*.self_attn.*_proj")
    text = _fails_at_parse(capsys, nothing_instantiated, "--plan_overrides", json.dumps([rule]))
    assert "rule 'mla': `match` entry 'model.layers.*.self_attn.*_proj' is a wildcard" in text
    path = tmp_path / "plan.yaml"
    path.write_text("plan_overrides:\n  - {match: [model.layers.0.mlp.gate_proj], exclude: ['model.layers.?.mlp'],"
                    f" module_type: torch.nn.Linear, replace_module: {{_target_: {LINEAR_FACTORY}}}}}\n")
    text = _fails_at_parse(capsys, nothing_instantiated, "--precision", "mxfp8", "--config", str(path))
    assert "rule 'plan_overrides[0]': `exclude` entry 'model.layers.?.mlp' is a wildcard" in text


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ({"match": ["model.layers.0.mlp.gate_proj"], "module_type": "torch.nn.Linear", "replace_module": "x.y",
          "format": "hif8"}, "plan_overrides[0]: unknown rule key(s) ['format']"),
        (_linear_rule("typo", "model.layers.0.mlp.gate_proj", module_type="torch.nn.Linearr"),
         "rule 'typo': `module_type`='torch.nn.Linearr': 'torch.nn' has no attribute or submodule 'Linearr'"),
        ({**_linear_rule("bad_factory", "model.layers.0.mlp.gate_proj"), "replace_module": "lp_lightning.nope.f"},
         "rule 'bad_factory': `replace_module._target_`='lp_lightning.nope.f'"),
    ],
    ids=["unknown-key", "module-type-path", "factory-path"],
)
def test_bad_plan_overrides_fail_before_anything_is_built(capsys, nothing_instantiated, rule, message):
    assert message in _fails_at_parse(capsys, nothing_instantiated, "--precision", "mxfp8",
                                      "--plan_overrides", json.dumps([rule]))


def test_duplicated_rule_names_fail_at_parse(capsys, nothing_instantiated):
    rules = [_linear_rule("mlp", "model.layers.0.mlp.gate_proj"), _linear_rule("mlp", "model.layers.0.mlp.up_proj")]
    text = _fails_at_parse(capsys, nothing_instantiated, "--plan_overrides", json.dumps(rules))
    assert "replacement rule names must be unique; ['mlp'] appear more than once" in text


def test_zero_hits_and_wrong_type_fail_at_launch_naming_rule_and_fqn(capsys, nothing_instantiated):
    missing = _linear_rule("mlp", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.gateproj")
    text = _fails_at_parse(capsys, nothing_instantiated, "--precision", "hif8",
                           "--plan_overrides", json.dumps([missing]))
    assert "rule 'mlp' (torch.nn.Linear -> lp_lightning.modules.linear.replace_low_precision_linear) is enabled but " \
           "1 of its `match` FQNs name no module" in text
    assert "'model.layers.0.mlp.gateproj'; nearest FQNs: ['model.layers.0.mlp.gate_proj'" in text
    experts = "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Experts"
    wrong = _linear_rule("experts", "model.layers.0.mlp.up_proj", module_type=experts)
    text = _fails_at_parse(capsys, nothing_instantiated, "--precision", "mxfp8",
                           "--plan_overrides", json.dumps([wrong]))
    assert f"rule 'experts': module 'model.layers.0.mlp.up_proj' is torch.nn.modules.linear.Linear, but the rule " \
           f"requires exactly {experts}" in text


EMPTY_PLAN = "the replacement plan replaces no module, so precision='mxfp8' would run every GEMM in BF16"
"""A low-precision run whose plan replaces nothing would train every GEMM in BF16: refused."""


def test_an_empty_low_precision_plan_fails_at_launch(capsys, nothing_instantiated):
    assert EMPTY_PLAN in _fails_at_parse(capsys, nothing_instantiated, "--precision", "mxfp8", "--plan_overrides", "[]")


def test_an_empty_low_precision_plan_fails_at_plan_compile(tmp_path, build_stages, isolated_dist):
    with pytest.raises(ValueError, match=re.escape(EMPTY_PLAN)):
        _fit(DeepSeekV3LM(), LowPrecisionPlugin("mxfp8", plan_rules=()), tmp_path)
    assert build_stages == ["model_build", "plan_compile"]


def test_zero_hits_fail_at_plan_compile_after_model_build(tmp_path, build_stages, isolated_dist):
    rules = rules_from_config(
        [_linear_rule("mla", "model.layers.0.self_attn.q_proj", "model.layers.9.self_attn.q_proj")]
    )
    with pytest.raises(ValueError, match=r"(?s)rule 'mla' .*'model\.layers\.9\.self_attn\.q_proj'; nearest FQNs"):
        _fit(DeepSeekV3LM(), LowPrecisionPlugin("mxfp8", plan_rules=rules), tmp_path)
    assert build_stages == ["model_build", "plan_compile"]  # before any fully_shard


def test_plan_overrides_from_yaml_and_cli_reach_the_plugin(tmp_path):
    rules = [_linear_rule("mla", "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.o_proj")]
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({"precision": "hif8", "plan_overrides": rules}))  # JSON is YAML
    root = ["--trainer.default_root_dir", str(tmp_path)]
    from_yaml = LPLightningCLI(args=["--config", str(path), *root], run=False).trainer.precision_plugin
    from_cli = LPLightningCLI(args=["--precision", "hif8", "--plan_overrides", json.dumps(rules), *root],
                              run=False).trainer.precision_plugin
    assert from_yaml.plan_rules == from_cli.plan_rules == rules_from_config(rules)
    default = LPLightningCLI(args=["--precision", "hif8", *root], run=False).trainer.precision_plugin
    assert default.plan_rules is None  # the adapter's default (a bf16 plugin has no plan at all)
    # The 16B plan file is a valid partial config: the 16B run with it parses, compiles and checks at launch.
    config = parse_config(
        ["--config", str(CONFIGS / "dsv3_16b_mxfp8.yaml"), "--config", str(CONFIGS / "plan_deepseek_v3.yaml"), *NO_NPU]
    )
    assert [rule["name"] for rule in config.plan_overrides] == ["mla_projections", "dense_mlp", "shared_experts",
                                                                 "routed_experts"]
    check_launch(config, plan_rules=rules_from_config(config.plan_overrides))  # fallback true: no error


def test_plan_overrides_are_applied(tmp_path, isolated_dist):
    rules = rules_from_config([_linear_rule("two", "model.layers.0.mlp.gate_proj", "model.layers.2.self_attn.o_proj")])
    trainer = _fit(DeepSeekV3LM(), LowPrecisionPlugin("hif8", plan_rules=rules), tmp_path)
    plugin = trainer.precision_plugin
    assert plugin.replacement_report.counts == {"two": 2}
    assert plugin.low_precision_weights == (
        "model.layers.0.mlp.gate_proj.weight", "model.layers.2.self_attn.o_proj.weight"
    )


# ------------------------------------------------------------------------------------------------
# PEFT / custom modules at a target FQN: fail in the plan, never replaced
# ------------------------------------------------------------------------------------------------


def _subclassed(base: nn.Linear) -> nn.Linear:
    base.__class__ = LinearSubclass
    return base


class _CustomizedLM(DeepSeekV3LM):
    """``configure_model`` swaps the dense ``gate_proj`` of layer 0 for a custom module (as PEFT would)."""

    def __init__(self, customize) -> None:
        super().__init__()
        self.customize = customize

    def configure_model(self) -> None:
        super().configure_model()
        mlp = self.model.model.layers[0].mlp
        mlp.gate_proj = self.customize(mlp.gate_proj)


@pytest.mark.parametrize(("customize", "found"), [(PeftStyleWrapper, PeftStyleWrapper), (_subclassed, LinearSubclass)])
def test_peft_and_custom_modules_fail_in_the_plan_and_are_not_replaced(tmp_path, build_stages, isolated_dist,
                                                                      customize, found):
    module = _CustomizedLM(customize)
    with pytest.raises(TypeError) as info:
        _fit(module, LowPrecisionPlugin("mxfp8"), tmp_path)
    message = str(info.value)
    expected = f"module 'model.layers.0.mlp.gate_proj' is {found.__module__}.{found.__qualname__} but was " \
               "torch.nn.modules.linear.Linear"
    assert expected in message
    assert "PEFT/custom wrapper at a target is never replaced (design spec §15)" in message
    assert build_stages == ["model_build", "plan_compile"]  # no fully_shard
    assert not any("LowPrecision" in type(m).__name__ for m in module.model.modules())  # atomic: nothing replaced


# ------------------------------------------------------------------------------------------------
# Parallelism, comm fusion, recompute: rejected at parse
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["tensor_parallel_size", "context_parallel_size", "expert_parallel_size",
                                 "pipeline_parallel_size"])
def test_tp_cp_ep_pp_above_one_fail_at_parse(capsys, nothing_instantiated, key):
    text = _fails_at_parse(capsys, nothing_instantiated, f"--fsdp_config.{key}", "2")
    assert text.startswith(f"fsdp_config.{key}=2 is not supported") and f"set `{key}: 1`" in text


def test_comm_fusion_fails_at_parse(capsys, nothing_instantiated):
    text = _fails_at_parse(capsys, nothing_instantiated, "--fsdp_config.comm_fusion", "true")
    assert text.startswith("fsdp_config.comm_fusion=true is not supported") and "set `comm_fusion: false`" in text


def test_recompute_policies_other_than_off_and_full_fail_at_parse(capsys, nothing_instantiated):
    text = _fails_at_parse(capsys, nothing_instantiated, "--model.activation_checkpoint", "selective")
    assert "activation_checkpoint" in text and "'off', 'full'" in text and "selective" in text
    with pytest.raises(ValueError, match="activation_checkpoint must be 'off' or 'full', got 'selective'"):
        FSDP2FabricStrategy(activation_checkpoint="selective")


# ------------------------------------------------------------------------------------------------
# Checkpoint: DCP folders only, checked at startup
# ------------------------------------------------------------------------------------------------


def test_non_dcp_checkpoint_fails_at_startup_naming_the_path(tmp_path, capsys, nothing_instantiated):
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {}}, path)  # a Lightning-style checkpoint file
    text = _fails_at_parse(capsys, nothing_instantiated, "--ckpt_path", str(path))
    assert text.startswith(f"ckpt_path={str(path)!r} is not a DCP checkpoint folder (design spec §11, §15")


# ------------------------------------------------------------------------------------------------
# Illegal shard without fallback: one error at launch listing every weight
# ------------------------------------------------------------------------------------------------


def test_illegal_shards_fail_once_at_launch_listing_every_fqn(capsys, nothing_instantiated):
    # Without input-dim sharding, the 84 weights that break the MXFP8 dim-0 rule at 8 ranks cannot be placed.
    text = _fails_at_parse(capsys, nothing_instantiated, "--config", str(CONFIGS / "dsv3_16b_mxfp8.yaml"),
                           "--fsdp_config.input_dim_sharding", "false", *NO_NPU)
    assert text.count("cannot be sharded") == 1
    assert text.startswith("84 low-precision weight(s) cannot be sharded over 8 ranks along any dim (design spec "
                           '§9.1; docs/architecture.md "Placements") and fsdp_config.fallback_to_unsharded is false:')
    assert text.count(": shape (3136, 2048) over world size 8: MXFP8 2-D rule M_local % 64 == 0 fails: rows per "
                      "rank [392, 392, 392, 392, 392, 392, 392, 392]") == 28
    assert text.count(": shape (10944, 2048) over world size 8") == 2 and "rows per rank [1368," in text
    assert text.count(": shape (2816, 2048) over world size 8") == 54 and "rows per rank [352," in text
    assert text.count("fsdp_config.input_dim_sharding is false") == 84
    for layer in range(28):
        assert f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight: shape" in text
    assert text.endswith("Set `fsdp_config.fallback_to_unsharded: true` (they stay replicated; their GEMMs stay low "
                         "precision) or use another data-parallel size (trainer.devices x trainer.num_nodes).")


def test_weights_no_dim_can_shard_fail_at_launch_with_both_rules(capsys, nothing_instantiated):
    # hidden 192: kv_a_proj_with_mqa [96, 192] has 48 rows and 96 columns per rank, neither a multiple of 64.
    text = _fails_at_parse(capsys, nothing_instantiated, "--precision", "mxfp8", "--trainer.devices", "2",
                           "--model.validate_spec", "false",
                           "--model.config_overrides", '{"kv_lora_rank": 64, "hidden_size": 192}')
    assert text.startswith("3 low-precision weight(s) cannot be sharded over 2 ranks along any dim")
    assert text.count("kv_a_proj_with_mqa.weight: shape (96, 192) over world size 2: MXFP8 2-D rule M_local % 64 "
                      "== 0 fails: rows per rank [48, 48] (dim 0 = 96 over 2 ranks); MXFP8 Shard(1) rule K_local % "
                      "64 == 0 fails: K_local = 96 (K = 192 over 2 ranks)") == 3


def test_missing_data_source_or_tokenizer_fails_at_launch(capsys, nothing_instantiated, tmp_path):
    """Before any process or process group exists (it used to fail on every rank in prepare_data)."""
    missing = str(tmp_path / "nope.txt")
    text = _fails_at_parse(capsys, nothing_instantiated, "--data.sources", f"[{missing}]", *NO_NPU)
    assert text.startswith(f"data.sources: corpus source {missing!r} does not exist")
    text = _fails_at_parse(capsys, nothing_instantiated, "--data.sources", missing, *NO_NPU)  # one path, no list
    assert text.startswith(f"data.sources: corpus source {missing!r} does not exist")
    text = _fails_at_parse(capsys, nothing_instantiated, "--data.tokenizer", str(tmp_path / "tok"), *NO_NPU)
    assert text.startswith(f"data.tokenizer={str(tmp_path / 'tok')!r}: load_tokenizer:") and "nothing is downloaded" in text


def test_16b_mxfp8_passes_the_launch_check_with_input_dim_shards():
    check_launch(parse_config(["--config", str(CONFIGS / "dsv3_16b_mxfp8.yaml"), *NO_NPU]))


def test_legal_shards_pass_the_launch_check():
    check_launch(parse_config(["--precision", "mxfp8", "--trainer.devices", "2"]))  # dsv3-tiny over 2 ranks


# ------------------------------------------------------------------------------------------------
# Optimizer: AdamW with FP32 master, moments and update; refused at optimizer construction
# ------------------------------------------------------------------------------------------------


class _SGDModule(DeepSeekV3LM):
    steps = 0

    def training_step(self, batch, batch_idx):
        type(self).steps += 1
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)


def test_trainer_refuses_other_optimizers_at_construction(tmp_path, build_stages, isolated_dist):
    with pytest.raises(TypeError, match=r"optimizer torch\.optim\.sgd\.SGD is not supported: design spec §15 allows "
                                        r"only torch\.optim\.AdamW with FP32 master weights, moments and update"):
        _fit(_SGDModule(), BF16Plugin(), tmp_path)
    assert "fully_shard" in build_stages and _SGDModule.steps == 0  # after sharding, before any step


def test_fabric_refuses_other_optimizers_and_non_fp32_state(isolated_dist):
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FSDP2FabricStrategy(),
                    plugins=[BF16FabricPlugin()])
    fabric.launch()
    model = fabric.setup_module(deepseek_v3.from_hf_config("dsv3-tiny", seed=0))
    with pytest.raises(TypeError, match=r"optimizer torch\.optim\.sgd\.SGD is not supported"):
        fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = next(iter(model.parameters()))
    adamw.state[first] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros((), dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match=r"torch\.optim\.AdamW state 'exp_avg' is torch\.bfloat16; design spec §15 "
                                         r"needs FP32 moments"):
        fabric.setup_optimizers(adamw)
    adamw.state.clear()
    fabric.setup_optimizers(adamw)  # FP32 masters, no state yet: accepted


def test_adamw_over_non_fp32_parameters_is_refused():
    weight = nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"param_groups\[0\] holds a torch\.bfloat16 parameter of shape \(4, 4\); "
                                         r"design spec §15 needs FP32 master weights"):
        check_optimizer(torch.optim.AdamW([weight]))

    class MyAdamW(torch.optim.AdamW):
        pass

    with pytest.raises(TypeError, match=rf"optimizer {__name__}\..*MyAdamW is not supported"):
        check_optimizer(MyAdamW([nn.Parameter(torch.zeros(2))]))


# ------------------------------------------------------------------------------------------------
# --print_config validates first: what `fit` rejects is never printed
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--fsdp_config.comm_fusion", "true"], "fsdp_config.comm_fusion=true is not supported"),
        (["--fsdp_config.tensor_parallel_size", "2"], "fsdp_config.tensor_parallel_size=2 is not supported"),
        (["--precision", "mxfp8", "--low_precision.enabled", "true", "--low_precision.scaling", "current"],
         "illegal low-precision pair mxfp8_e4m3+current"),
        (["--low_precision.scaling", "delayed"], "HiF8 delayed scaling is not supported"),
        (["--trainer.precision", "bf16-mixed"], "trainer.precision='bf16-mixed' cannot be set"),
        (["--precision", "mxfp8", "--plan_overrides", json.dumps([_linear_rule("x", "model.layers.0.mlp.nope")])],
         "rule 'x' (torch.nn.Linear"),
        (["--config", str(CONFIGS / "dsv3_16b_mxfp8.yaml"), "--fsdp_config.input_dim_sharding", "false", *NO_NPU],
         "84 low-precision weight(s) cannot be sharded over 8 ranks"),
    ],
    ids=["comm_fusion", "tp2", "mxfp8-current", "delayed", "trainer.precision", "plan-zero-hits", "illegal-shards"],
)
def test_print_config_validates_first(capsys, nothing_instantiated, options, message):
    for flag in ("--print_config", "--print_config=skip_default"):
        with pytest.raises(SystemExit) as exc:
            main(["fit", *options, flag])
        captured = capsys.readouterr()
        assert exc.value.code == 2 and captured.out == ""
        assert message in " ".join(captured.err.split())
    assert nothing_instantiated == []


def test_print_config_prints_a_valid_config(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--precision", "hif8", "--print_config"])
    assert exc.value.code == 0
    assert "precision: hif8" in capsys.readouterr().out
