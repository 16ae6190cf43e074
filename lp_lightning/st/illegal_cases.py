"""The illegal configurations of Q3-10 (design spec §15, §17.2): :data:`ILLEGAL_CASES` holds one
:class:`IllegalCase` per row of §15's limit matrix that has a failure rule (:data:`SECTION15_ROWS`) and
sub-case, each with the stage of :data:`STAGES` where it must fail.

The table is read by both sides of a case: the runner and judge (:mod:`lp_lightning.st.illegal`) and
the child that runs it (:mod:`lp_lightning.st.illegal_child`); the stages are described there.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ILLEGAL_CASES", "MARKER", "SECTION15_ROWS", "STAGES", "IllegalCase", "case_argv", "plan_rule"]

STAGES = ("parse", "launch", "instantiate", "startup_gate", "model_build", "plan_compile", "sharding",
          "optimizer_construction", "training", "completed")  # fmt: skip
"""The stages in run order (module docstring)."""

SECTION15_ROWS = ("hardware / backend", "model", "low-precision format", "low-precision targets", "parallelism",
                  "FSDP comm fusion", "illegal shard", "optimizer", "checkpoint", "recompute",
                  "PEFT / custom modules")  # fmt: skip
"""The rows of design spec §15's limit matrix that have a failure rule (all but ``compile / fusion``)."""

MARKER = "LP_ILLEGAL_OBSERVATION "
"""Prefix of the child's one JSON line on stdout."""


@dataclass(frozen=True)
class IllegalCase:
    """One illegal configuration of design spec §15 and what must happen to it.

    Attributes:
        id: Short name (the child's argument).
        section15_row: Its row of :data:`SECTION15_ROWS`.
        description: What is illegal, in words.
        expected_stage: The stage (:data:`STAGES`) where it must fail.
        must_mention: Substrings the error message must contain (config key, FQN, shape, API).
        spec_stage: The row's stage in the §15 table (docs/design.md), e.g. ``"startup"``.
        cli_args: ``lp-lightning fit`` options (``{case_dir}`` is the case's folder); ``None``: the
            Trainer/Fabric script of :mod:`lp_lightning.st.illegal_child` named ``id``.
        files: ``(name, content)`` written into the case's folder first: text, or a dict saved with
            ``torch.save`` (a Lightning-style checkpoint file).
        needs_absent: A module that must not be importable for the case to apply (else not applicable).
    """

    id: str
    section15_row: str
    description: str
    expected_stage: str
    must_mention: tuple[str, ...]
    spec_stage: str
    cli_args: tuple[str, ...] | None = None
    files: tuple[tuple[str, Any], ...] = ()
    needs_absent: str | None = None


_FACTORY = "lp_lightning.modules.linear.replace_low_precision_linear"
_EXPERTS = "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Experts"


def plan_rule(name: str, *fqns: str, module_type: str = "torch.nn.Linear", **extra: Any) -> dict[str, Any]:
    return {"name": name, "match": list(fqns), "module_type": module_type, "replace_module": {"_target_": _FACTORY},
            **extra}  # fmt: skip


def _overrides(*rules: dict[str, Any]) -> tuple[str, str]:
    return ("--plan_overrides", json.dumps(list(rules)))


def _cli(id: str, row: str, spec_stage: str, stage: str, description: str, args: Sequence[str],
         mention: Sequence[str], **extra: Any) -> IllegalCase:  # fmt: skip
    return IllegalCase(id, row, description, stage, tuple(mention), spec_stage, cli_args=tuple(args), **extra)


def _script(id: str, row: str, spec_stage: str, stage: str, description: str, mention: Sequence[str]) -> IllegalCase:
    return IllegalCase(id, row, description, stage, tuple(mention), spec_stage)


_HW, _MODEL, _FORMAT, _TARGETS = SECTION15_ROWS[:4]
_PARALLEL, _FUSION, _SHARD, _OPTIMIZER, _CKPT, _RECOMPUTE, _PEFT = SECTION15_ROWS[4:]
_STARTUP, _GATE, _PARSE_SPEC = "startup", "startup (capability gate)", "config parse, before model build"
_PLAN_SPEC = "replacement plan compile"
_NO_NPU = ("--trainer.accelerator", "cpu")
_16B = ("--config", str(Path(__file__).resolve().parents[2] / "configs" / "dsv3_16b_mxfp8.yaml"))
_HIF8_ON = ("--precision", "hif8", "--low_precision.enabled", "true", "--low_precision.format", "hif8")
_MXFP8_ON = ("--precision", "mxfp8", "--low_precision.enabled", "true")
_DELAYED = "HiF8 delayed scaling is not supported"
_NO_SUCH_FQN, _UP_PROJ = "model.layers.0.mlp.gateproj", "model.layers.0.mlp.up_proj"
_AT_GATE_PROJ = "module 'model.layers.0.mlp.gate_proj' is lp_lightning.st.illegal_child."

ILLEGAL_CASES: tuple[IllegalCase, ...] = (
    _cli("backend-npu-on-cpu", _HW, _GATE, "startup_gate", "--backend npu with the cpu accelerator",
         ["--precision", "mxfp8", "--backend", "npu"], ["backend 'npu'", "accelerator is cpu", "--backend emulated"]),
    _cli("backend-unknown", _HW, _GATE, "parse", "an op backend that does not exist",
         ["--precision", "mxfp8", "--backend", "cuda"], ['"backend"', "'auto', 'emulated', 'npu'", "cuda"]),
    _cli("accelerator-npu-without-torch_npu", _HW, _GATE, "launch", "the npu accelerator where torch_npu is absent",
         ["--trainer.accelerator", "npu"], ["trainer.accelerator='npu'", "torch_npu", "pip install"],
         needs_absent="torch_npu"),
    _cli("model-spec-mismatch", _MODEL, "after model build (spec validation)", "model_build",
         "dsv3-tiny with 4 layers instead of 3 (the launch-time plan compile passes; the built model's spec fails)",
         ["--precision", "mxfp8", "--model.config_overrides", '{"num_hidden_layers": 4}'],
         ["spec 'dsv3-tiny'", "num_hidden_layers: expected 3, got 4", "--model.validate_spec false"]),
    _cli("hif8-delayed", _FORMAT, _PARSE_SPEC, "parse", "HiF8 with delayed scaling",
         [*_HIF8_ON, "--low_precision.scaling", "delayed"], ["low_precision.scaling='delayed'", _DELAYED]),
    _cli("hif8-delayed-yaml", _FORMAT, _PARSE_SPEC, "parse", "HiF8 delayed scaling from a YAML low_precision section",
         ["--config", "{case_dir}/delayed.yaml"], ["low_precision.scaling='delayed'", _DELAYED, "scaling: current"],
         files=(("delayed.yaml", "precision: hif8\nlow_precision: {enabled: true, format: hif8, scaling: delayed}"),)),
    _cli("mxfp8-current", _FORMAT, _PARSE_SPEC, "parse", "MXFP8 with per-tensor current scaling",
         [*_MXFP8_ON, "--low_precision.scaling", "current"],
         ["illegal low-precision pair mxfp8_e4m3+current", "mxfp8_e4m3+mx_block, hif8+current"]),
    _cli("hif8-mx_block", _FORMAT, _PARSE_SPEC, "parse", "HiF8 with MX block scaling", _HIF8_ON,
         ["illegal low-precision pair hif8+mx_block"]),
    _cli("low_precision-disagrees", _FORMAT, _PARSE_SPEC, "parse",
         "--precision hif8 with a low_precision section that is not enabled",
         ["--precision", "hif8", "--low_precision.format", "hif8", "--low_precision.scaling", "current"],
         ["precision='hif8'", "low_precision.enabled: true"]),
    _cli("bf16-names-hif8", _FORMAT, _PARSE_SPEC, "parse", "a bf16 run whose low_precision section names hif8+current",
         ["--low_precision.format", "hif8", "--low_precision.scaling", "current"],
         ["hif8+current but enabled=False", "train in bf16"]),
    _cli("trainer-precision", _FORMAT, _PARSE_SPEC, "parse", "Lightning's own precision instead of --precision",
         ["--trainer.precision", "bf16-mixed"], ["trainer.precision='bf16-mixed' cannot be set", "--precision"]),
    _cli("targets-wildcard", _TARGETS, _PLAN_SPEC, "parse", "a wildcard instead of explicit target FQNs",
         _overrides(plan_rule("mla", "model.layers.*.self_attn.*_proj")),
         ["rule 'mla'", "`match` entry 'model.layers.*.self_attn.*_proj' is a wildcard"]),
    _cli("targets-unknown-key", _TARGETS, _PLAN_SPEC, "parse", "a replacement rule with a key the schema lacks",
         ["--precision", "mxfp8", *_overrides(plan_rule("mlp", "model.layers.0.mlp.gate_proj", format="hif8"))],
         ["plan_overrides[0]", "unknown rule key(s) ['format']"]),
    _cli("targets-duplicate-names", _TARGETS, _PLAN_SPEC, "parse", "two replacement rules with one name",
         _overrides(plan_rule("mlp", "model.layers.0.mlp.gate_proj"), plan_rule("mlp", "model.layers.0.mlp.up_proj")),
         ["replacement rule names must be unique", "['mlp']"]),
    _cli("targets-zero-hits", _TARGETS, _PLAN_SPEC, "launch", "a target FQN that names no module",
         ["--precision", "hif8", *_overrides(plan_rule("mlp", "model.layers.0.mlp.gate_proj", _NO_SUCH_FQN))],
         ["rule 'mlp'", f"'{_NO_SUCH_FQN}'", "nearest FQNs"]),
    _cli("targets-wrong-type", _TARGETS, _PLAN_SPEC, "launch", "a target whose module is not the rule's module_type",
         ["--precision", "mxfp8", *_overrides(plan_rule("experts", _UP_PROJ, module_type=_EXPERTS))],
         ["rule 'experts'", f"'{_UP_PROJ}'", "torch.nn.modules.linear.Linear", "DeepseekV3Experts"]),
    _cli("targets-empty-plan", _TARGETS, _PLAN_SPEC, "launch", "a low-precision run whose plan replaces nothing",
         ["--precision", "mxfp8", "--plan_overrides", "[]"],
         ["replaces no module", "precision='mxfp8'", "plan_overrides"]),
    _script("targets-zero-hits-trainer", _TARGETS, _PLAN_SPEC, "plan_compile",
            "Trainer + LowPrecisionPlugin(plan_rules=...) naming a layer that does not exist (the per-rank check)",
            ["rule 'mla'", "'model.layers.9.self_attn.q_proj'", "nearest FQNs"]),
    *(_cli(f"{short}-2", _PARALLEL, _STARTUP, "parse", f"fsdp_config.{key}=2", [f"--fsdp_config.{key}", "2"],
           [f"fsdp_config.{key}=2 is not supported", f"set `{key}: 1`"])
      for short, key in (("tp", "tensor_parallel_size"), ("cp", "context_parallel_size"),
                         ("ep", "expert_parallel_size"), ("pp", "pipeline_parallel_size"))),
    _cli("comm-fusion", _FUSION, _STARTUP, "parse", "FSDP communication fusion", ["--fsdp_config.comm_fusion", "true"],
         ["fsdp_config.comm_fusion=true is not supported", "set `comm_fusion: false`"]),
    _cli("shard-illegal-no-fallback", _SHARD, "sharding (startup)", "launch",
         "MXFP8 over 2 ranks, hidden 192: kv_a_proj_with_mqa [96, 192] has no legal shard dim (48 rows, 96 columns "
         "per rank), fsdp_config.fallback_to_unsharded false",
         ["--precision", "mxfp8", "--trainer.devices", "2", "--model.validate_spec", "false",
          "--model.config_overrides", '{"kv_lora_rank": 64, "hidden_size": 192}', *_NO_NPU],
         ["3 low-precision weight(s) cannot be sharded over 2 ranks along any dim", "fsdp_config.fallback_to_unsharded",
          "model.layers.0.self_attn.kv_a_proj_with_mqa.weight: shape (96, 192)", "rows per rank [48, 48]",
          "K_local % 64 == 0 fails: K_local = 96"]),
    _cli("shard-16b-no-input-dim", _SHARD, "sharding (startup)", "launch",
         "dsv3-16b MXFP8 over 8 ranks with fsdp_config.input_dim_sharding false (84 weights break the dim-0 rule)",
         [*_16B, "--fsdp_config.input_dim_sharding", "false", *_NO_NPU],
         ["84 low-precision weight(s) cannot be sharded over 8 ranks", "fsdp_config.fallback_to_unsharded",
          "model.layers.0.self_attn.kv_a_proj_with_mqa.weight: shape (3136, 2048)", "rows per rank [392,"]),
    _script("optimizer-sgd-trainer", _OPTIMIZER, "optimizer construction", "optimizer_construction",
            "a LightningModule whose configure_optimizers returns torch.optim.SGD",
            ["optimizer torch.optim.sgd.SGD is not supported", "torch.optim.AdamW"]),
    _script("optimizer-sgd-fabric", _OPTIMIZER, "optimizer construction", "optimizer_construction",
            "fabric.setup_optimizers(torch.optim.SGD(...))",
            ["optimizer torch.optim.sgd.SGD is not supported", "torch.optim.AdamW"]),
    _script("optimizer-bf16-moments-fabric", _OPTIMIZER, "optimizer construction", "optimizer_construction",
            "fabric.setup_optimizers(AdamW) whose state holds a BF16 exp_avg (e.g. restored from a BF16 state)",
            ["torch.optim.AdamW state 'exp_avg' is torch.bfloat16", "FP32 moments"]),
    _cli("checkpoint-not-dcp", _CKPT, _STARTUP, "launch", "a Lightning .ckpt file as ckpt_path",
         ["--ckpt_path", "{case_dir}/last.ckpt"], ["ckpt_path=", "last.ckpt", "is not a DCP checkpoint folder"],
         files=(("last.ckpt", {"state_dict": {}, "hyper_parameters": {}}),)),
    _cli("recompute-selective", _RECOMPUTE, "—", "parse", "selective activation checkpointing",
         ["--model.activation_checkpoint", "selective"],
         ['"model.activation_checkpoint"', "'off', 'full'", "selective"]),
    _script("peft-lora-wrapper", _PEFT, _PLAN_SPEC, "plan_compile",
            "configure_model puts a LoRA-style wrapper at the target model.layers.0.mlp.gate_proj",
            [f"{_AT_GATE_PROJ}PeftStyleWrapper", "never replaced"]),
    _script("custom-linear-subclass", _PEFT, _PLAN_SPEC, "plan_compile",
            "configure_model turns the target model.layers.0.mlp.gate_proj into a Linear subclass",
            [f"{_AT_GATE_PROJ}LinearSubclass", "never replaced"]),
)  # fmt: skip
"""One case per design spec §15 row and sub-case (module docstring)."""

_RUN_ARGS = ("--trainer.default_root_dir", "{case_dir}/run", "--trainer.max_steps", "1", "--trainer.logger", "false",
             "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
             "--checkpoint.every_n_steps", "100", "--data.sources", "[{case_dir}/corpus.txt]",
             "--data.cache_dir", "{case_dir}/tokens", "--data.seq_len", "32", "--data.val_batches", "1")  # fmt: skip
"""Appended to every CLI case: a run that got through would stay inside its folder, on a tiny corpus, 1 step."""


def case_argv(case: IllegalCase, case_dir: Path) -> list[str]:
    """The ``lp-lightning`` arguments of a CLI case: ``fit``, its ``cli_args``, then :data:`_RUN_ARGS`."""
    assert case.cli_args is not None
    return ["fit", *(arg.replace("{case_dir}", str(case_dir)) for arg in (*case.cli_args, *_RUN_ARGS))]
