"""``lp-lightning`` CLI: defaults == configs/dsv3_tiny.yaml, config parsing, fail-fast errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import TQDMProgressBar

import lp_lightning.models.deepseek_v3 as deepseek_v3
from lp_lightning.cli import main
from lp_lightning.cli.fit import LPLightningCLI, parse_config
from lp_lightning.cli.launch import check_launch
from lp_lightning.lightning.progress import default_progress_bar

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _as_dict(namespace) -> dict:
    out = namespace.as_dict()
    out.pop("config", None)  # the list of config files read
    return out


def test_code_defaults_equal_the_tiny_yaml():
    defaults = _as_dict(parse_config([]))
    from_yaml = _as_dict(parse_config(["--config", str(CONFIGS / "dsv3_tiny.yaml")]))
    assert from_yaml == defaults
    assert defaults["model"]["config_name_or_path"] == "dsv3-tiny"
    assert defaults["data"]["tokenizer"] == "byte" and defaults["data"]["sources"] is None
    assert defaults["precision"] == "bf16" and defaults["trainer"]["use_distributed_sampler"] is False


def test_parse_config_leaves_the_rngs_alone():
    """Parsing only: no seed_everything (which would reseed the caller's RNGs and print "Seed set to 0")."""
    import random

    import torch

    torch.manual_seed(123)
    random.seed(123)
    state, py_state = torch.get_rng_state(), random.getstate()
    config = parse_config([])
    assert config.seed_everything == 0  # the value a fit run seeds with is still parsed
    assert torch.equal(torch.get_rng_state(), state) and random.getstate() == py_state


def test_parse_config_parses_its_args_whatever_sys_argv_holds(monkeypatch, recwarn):
    """``lp-lightning plan``/``st`` parse a fit YAML inside a process whose ``sys.argv`` holds their own
    options: the args given are parsed, sys.argv is neither read nor swapped, and nothing warns."""
    argv = ["lp-lightning", "st", "--out", "runs/st"]
    monkeypatch.setattr("sys.argv", argv)
    config = parse_config(["--config", str(CONFIGS / "dsv3_tiny.yaml"), "--precision", "hif8"])
    assert config.precision == "hif8"
    assert sys.argv is argv and sys.argv == ["lp-lightning", "st", "--out", "runs/st"]
    assert not [w for w in recwarn if "args parameter" in str(w.message)], [str(w.message) for w in recwarn]


def _cli_configs() -> list:
    # LightningCLI configs only (configs/plan_*.yaml are replacement plans, not CLI configs).
    return [pytest.param(path, id=path.name) for path in sorted(CONFIGS.glob("dsv3_*.yaml"))]


@pytest.mark.parametrize("path", _cli_configs())
def test_every_cli_config_parses(path):
    config = parse_config(["--config", str(path)])
    precision = {"dsv3_16b_mxfp8.yaml": "mxfp8", "dsv3_16b_hif8.yaml": "hif8"}.get(path.name, "bf16")
    assert config.precision == precision
    assert config.fsdp_config.comm_fusion is False
    if precision != "bf16":
        section = config.low_precision.as_dict()
        pair = {"mxfp8": ("mxfp8_e4m3", "mx_block"), "hif8": ("hif8", "current")}[precision]
        assert section == {"enabled": True, "format": pair[0], "scaling": pair[1]}


def test_16b_low_precision_configs_equal_the_bf16_baseline():
    """Design spec §17.4: same effective training configuration, one fsdp_config; only the precision differs."""
    base = _as_dict(parse_config(["--config", str(CONFIGS / "dsv3_16b_bf16.yaml")]))
    for name in ("mxfp8", "hif8"):
        other = _as_dict(parse_config(["--config", str(CONFIGS / f"dsv3_16b_{name}.yaml")]))
        differing = {k for k in base if base[k] != other[k]}
        assert differing == {"precision", "low_precision", "run_summary", "trainer"}, name
        assert {k for k in base["trainer"] if base["trainer"][k] != other["trainer"][k]} == {"default_root_dir"}
    mx = parse_config(["--config", str(CONFIGS / "dsv3_16b_mxfp8.yaml")])
    assert mx.fsdp_config.fallback_to_unsharded is False and mx.fsdp_config.input_dim_sharding is True


def _dim0_rule_breakers_at_8_ranks() -> list[tuple[str, tuple[int, ...]]]:
    """Independent of the planner: the design spec §9.1 dim-0 rule applied by hand to the 16B plan."""
    import torch

    from lp_lightning.models.deepseek_v3 import build_meta_model
    from lp_lightning.models.deepseek_v3.rules import deepseek_v3_default_rules
    from lp_lightning.plan import compile_plan
    from lp_lightning.policy import LowPrecisionConfig

    model = build_meta_model("dsv3-16b")
    plan = compile_plan(model, deepseek_v3_default_rules(model.config), LowPrecisionConfig.from_precision("mxfp8").to_policy())
    illegal = []
    for entry in plan.entries:
        module = model.get_submodule(entry.fqn)
        for name in ("weight",) if isinstance(module, torch.nn.Linear) else ("gate_up_proj", "down_proj"):
            shape = tuple(getattr(module, name).shape)
            rows = -(-shape[0] // 8)  # torch.chunk rows per rank (8 divides every dim 0 here)
            per_rank = rows if len(shape) == 2 else rows * shape[1]
            if per_rank % 64:
                illegal.append((f"{entry.fqn}.{name}", shape))
    return illegal


def test_16b_mxfp8_dim0_rule_breakers_shard_along_their_input_dim():
    """At 8 ranks 84 weights break the MXFP8 dim-0 rule (design spec §9.1); each takes Shard(1) (2048 / 8 = 256
    columns per rank, a multiple of 64), none is replicated."""
    from lp_lightning.lightning.low_precision import LowPrecisionPlugin
    from lp_lightning.fsdp.sharding import planned_placements, planned_shard_violations
    from lp_lightning.models.deepseek_v3 import build_meta_model

    illegal = _dim0_rule_breakers_at_8_ranks()
    assert len(illegal) == 28 + 2 + 2 * 27  # kv_a_proj_with_mqa per layer, dense gate/up, shared gate/up
    assert {(fqn.split(".", 3)[-1], shape) for fqn, shape in illegal} == {
        ("self_attn.kv_a_proj_with_mqa.weight", (3136, 2048)),
        ("mlp.gate_proj.weight", (10944, 2048)),
        ("mlp.up_proj.weight", (10944, 2048)),
        ("mlp.shared_experts.gate_proj.weight", (2816, 2048)),
        ("mlp.shared_experts.up_proj.weight", (2816, 2048)),
    }
    meta = build_meta_model("dsv3-16b")
    LowPrecisionPlugin("mxfp8").compile_plan(meta).apply(meta)
    placements = planned_placements(meta, 8, "mxfp8_e4m3")
    assert {p.fqn for p in placements if p.dim0_violation} == {fqn for fqn, _ in illegal}
    assert {p.fqn for p in placements if p.shard_dim == 1} == {fqn for fqn, _ in illegal}
    assert all(p.shard_dim == 0 for p in placements if not p.dim0_violation) and len(placements) == 250
    assert planned_shard_violations(meta, 8, "mxfp8_e4m3") == ()
    assert len(planned_shard_violations(meta, 8, "mxfp8_e4m3", input_dim_sharding=False)) == 84


def test_16b_bf16_config_is_the_seed_node_setup():
    config = parse_config(["--config", str(CONFIGS / "dsv3_16b_bf16.yaml")])
    assert config.model.config_name_or_path == "dsv3-16b"
    assert (config.fsdp_config.dp_shard_size, config.trainer.devices) == (8, 8)
    assert config.fsdp_config.reshard_after_forward is True and config.fsdp_config.fallback_to_unsharded is False


@pytest.fixture
def no_model_build(monkeypatch):
    calls = []
    monkeypatch.setattr(deepseek_v3, "from_hf_config", lambda *a, **k: calls.append(a))
    return calls


def test_unknown_precision_fails_while_parsing(capsys, no_model_build):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--precision", "fp8"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert 'Parser key "precision"' in err and "fp8" in err
    assert "'bf16', 'mxfp8', 'hif8'" in err
    assert no_model_build == []


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--precision", "hif8", "--low_precision.enabled", "true", "--low_precision.format", "hif8",
          "--low_precision.scaling", "mx_block"], "illegal low-precision pair hif8+mx_block; the legal pairs are "
                                                 "mxfp8_e4m3+mx_block, hif8+current"),
        (["--precision", "mxfp8", "--low_precision.enabled", "true", "--low_precision.format", "mxfp8_e4m3",
          "--low_precision.scaling", "current"], "illegal low-precision pair mxfp8_e4m3+current"),
        (["--precision", "hif8", "--low_precision.enabled", "true", "--low_precision.format", "hif8",
          "--low_precision.scaling", "delayed"], "delayed"),
        (["--precision", "mxfp8", "--low_precision.enabled", "true", "--low_precision.format", "hif8",
          "--low_precision.scaling", "current"], "selects --precision hif8, but precision='mxfp8'"),
    ],
)
def test_illegal_low_precision_section_fails_while_parsing(capsys, no_model_build, options, message):
    with pytest.raises(SystemExit) as exc:
        main(["fit", *options])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "low_precision" in err
    assert no_model_build == []


def test_low_precision_section_agreeing_with_precision_parses():
    config = parse_config(["--precision", "hif8", "--low_precision.enabled", "true", "--low_precision.format", "hif8",
                           "--low_precision.scaling", "current"])
    assert config.precision == "hif8" and config.low_precision.scaling == "current"
    assert parse_config([]).low_precision is None


@pytest.mark.parametrize(
    ("option", "key"),
    [
        ("--fsdp_config.comm_fusion=true", "fsdp_config.comm_fusion"),
        ("--fsdp_config.expert_parallel_size=2", "fsdp_config.expert_parallel_size"),
        ("--fsdp_config.dp_shard_size=0", "fsdp_config.dp_shard_size"),
        ("--fsdp_config.dp_shard_size=4", "fsdp_config.dp_shard_size=4 does not match the world size 1"),
    ],
)
def test_unsupported_fsdp_config_fails_before_the_model(capsys, no_model_build, option, key):
    with pytest.raises(SystemExit) as exc:
        main(["fit", option])
    assert exc.value.code == 2
    assert f"error: {key}" in capsys.readouterr().err
    assert no_model_build == []


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--trainer.strategy", "ddp"], "trainer.strategy='ddp' cannot be set: lp-lightning builds it from --fsdp_config"),
        (["--trainer.precision", "bf16-mixed"], "trainer.precision='bf16-mixed' cannot be set: lp-lightning builds it "
                                                "from --precision"),
        (["--trainer.plugins", "lightning.pytorch.plugins.precision.DoublePrecision"],
         "trainer.plugins=['lightning.pytorch.plugins.precision.DoublePrecision'] cannot be set"),
    ],
)
def test_trainer_strategy_precision_and_plugins_are_refused_while_parsing(capsys, no_model_build, option, message):
    """Design spec §15: a usage error (exit 2) before anything is built, not a traceback."""
    with pytest.raises(SystemExit) as exc:
        main(["fit", *option])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Remove trainer." in err and "Traceback" not in err
    assert no_model_build == []


def test_a_cluster_environment_plugin_is_passed_through(tmp_path):
    """SLURM/LSF/... users may name their ClusterEnvironment; only precision plugins are lp-lightning's."""
    from lightning.pytorch.plugins.environments import LightningEnvironment

    from lp_lightning.cli.fit import LPLightningCLI
    from lp_lightning.lightning import BF16Plugin

    cli = LPLightningCLI(args=["--trainer.plugins", "lightning.pytorch.plugins.environments.LightningEnvironment",
                               "--trainer.default_root_dir", str(tmp_path)], run=False)
    assert isinstance(cli.trainer.strategy.cluster_environment, LightningEnvironment)
    assert isinstance(cli.trainer.precision_plugin, BF16Plugin)  # the default precision: bf16


def test_help_marks_the_refused_trainer_options(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--help"])
    assert exc.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    refused = "REFUSED by lp-lightning: it builds the {} from {}; setting this exits with status 2."
    assert "--trainer.strategy STRATEGY " + refused.format("strategy", "--fsdp_config") in help_text
    assert "--trainer.precision PRECISION " + refused.format("precision plugin", "--precision") in help_text
    assert "--trainer.plugins+ PLUGINS " + refused.format(
        "precision plugin (cluster environments are accepted)", "--precision") in help_text
    assert help_text.count("REFUSED by lp-lightning") == 3


def test_an_enabled_false_low_precision_section_is_told_to_switch_on(capsys, no_model_build):
    """--precision hif8 with a hif8+current section lacking ``enabled: true`` names that key as the fix."""
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--precision", "hif8", "--low_precision.format", "hif8", "--low_precision.scaling", "current"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "enabled=False" in err and "set `low_precision.enabled: true`" in err and "precision: bf16" not in err
    assert no_model_build == []


def test_cli_builds_strategy_and_plugin_instances(tmp_path):
    cli = LPLightningCLI(args=["--trainer.default_root_dir", str(tmp_path), "--fsdp_config.reshard_after_forward",
                               "false"], run=False)
    from lp_lightning.lightning import BF16Plugin, FSDP2Strategy, PeriodicCheckpoint
    from lp_lightning.telemetry import RunSummaryCallback

    trainer = cli.trainer
    assert isinstance(trainer.strategy, FSDP2Strategy)
    assert trainer.strategy.fsdp_config.reshard_after_forward is False
    assert isinstance(trainer.precision_plugin, BF16Plugin) and trainer.precision_plugin.mode == "bf16"
    assert trainer.precision_plugin.policy.enabled is False
    assert trainer.logger.save_dir == str(tmp_path)
    summary = [c for c in trainer.callbacks if isinstance(c, RunSummaryCallback)]
    assert len(summary) == 1 and summary[0].precision == "bf16"
    checkpoint = [c for c in trainer.callbacks if isinstance(c, PeriodicCheckpoint)]
    assert len(checkpoint) == 1 and checkpoint[0].every_n_steps == 20
    assert type(trainer.progress_bar_callback) is type(default_progress_bar())  # counts optimizer steps
    assert trainer.precision_plugin.guard.max_consecutive_skips == 3 and trainer.strategy.resume_fallback is False
    from lp_lightning.lightning import Preemption

    stops = [c for c in trainer.callbacks if isinstance(c, Preemption)]
    assert len(stops) == 1 and stops[0].timeout_s == 300.0
    order = [type(c).__name__ for c in trainer.callbacks]  # Preemption raises after the summary recorded the step
    assert order.index("RunSummaryCallback") < order.index("Preemption")


def test_nonfinite_limit_reaches_the_plugin_and_a_negative_one_fails_while_parsing(tmp_path, capsys):
    cli = LPLightningCLI(args=["--trainer.default_root_dir", str(tmp_path), "--nonfinite.max_consecutive_skips", "0"],
                         run=False)
    assert cli.trainer.precision_plugin.guard.max_consecutive_skips == 0
    with pytest.raises(SystemExit) as exc:
        parse_config(["--nonfinite.max_consecutive_skips", "-1"])
    assert exc.value.code == 2 and "nonfinite.max_consecutive_skips" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--trainer.enable_progress_bar", "false"], type(None)),
        (["--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar"], TQDMProgressBar),
    ],
)
def test_progress_bar_off_or_the_users_own(tmp_path, options, expected):
    cli = LPLightningCLI(args=["--trainer.default_root_dir", str(tmp_path), *options], run=False)
    assert type(cli.trainer.progress_bar_callback) is expected


def test_cli_maps_precision_onto_the_plugin_policy(tmp_path):
    cli = LPLightningCLI(args=["--trainer.default_root_dir", str(tmp_path), "--precision", "hif8"], run=False)
    plugin = cli.trainer.precision_plugin
    assert plugin.mode == "hif8" and plugin.policy.as_dict() == {
        "enabled": True, "format": "hif8", "scaling": "current", "recipe_name": "hif8_current"}


def test_validate_model_is_dispatched(capsys):
    assert main(["validate-model", "--spec", "dsv3-16b"]) == 0
    assert "dsv3-16b" in capsys.readouterr().out
    assert main(["validate-model", "--spec", "dsv3-16b", "--config_overrides", '{"num_hidden_layers": 27}']) == 1
    assert "num_hidden_layers" in capsys.readouterr().err


def test_only_fit_and_validate_are_offered(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["test"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'test' (choose from 'fit', 'validate')" in capsys.readouterr().err  # no usage dump
    assert set(LPLightningCLI.subcommands()) == {"fit", "validate"}


def _fake_checkpoint(path: Path) -> Path:
    """A real (tiny) checkpoint folder, written by the same function as training checkpoints."""
    import torch

    from lp_lightning.checkpoint.dcp import save_dcp_checkpoint

    return save_dcp_checkpoint(path, model_state={"w": torch.ones(64)}, optimizer_states={}, metadata={}, rank=0)


@pytest.mark.parametrize(
    ("options", "env", "message"),
    [
        (["--trainer.devices", "3"], {}, "data.global_batch_size=4 must be divisible by trainer.accumulate_grad_batches "
                                         "(1) x world size (3) = 3"),
        (["--trainer.accumulate_grad_batches", "8"], {}, "x world size (1) = 8; pick a multiple of 8"),
        ([], {"TORCHELASTIC_RUN_ID": "job", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
         "torchrun started WORLD_SIZE=2 processes, but trainer.devices=1 x trainer.num_nodes=1 = 1; pass "
         "--trainer.devices 2"),
        (["--ckpt_path", "no/such/folder"], {}, "ckpt_path='no/such/folder' does not exist"),
    ],
)
def test_launch_problems_fail_while_parsing(capsys, monkeypatch, no_model_build, options, env, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exc:
        main(["fit", *options])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert no_model_build == []


def test_ckpt_path_last_and_the_parent_folder(tmp_path, capsys, no_model_build):
    checkpoints = tmp_path / "checkpoints"
    _fake_checkpoint(checkpoints / "step-000010")
    newest = _fake_checkpoint(checkpoints / "step-000020")
    _fake_checkpoint(checkpoints / ".step-000030.partial")  # a save cut short: never picked
    older_run = _fake_checkpoint(checkpoints / "step-000030")  # another run's higher step, written earlier
    os.utime(older_run / "meta.pt", (1, 1))
    damaged = _fake_checkpoint(checkpoints / "step-000040")
    for shard in damaged.glob("*.distcp"):
        shard.write_bytes(b"")  # truncated after the fact: skipped, and said so
    root = ["--trainer.default_root_dir", str(tmp_path)]
    section = parse_config(root)
    section["ckpt_path"] = "last"
    check_launch(section)  # what `lp-lightning fit --ckpt_path last` runs while parsing
    assert section["ckpt_path"] == str(newest)
    assert f"ckpt_path=last skips {str(damaged)!r}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["fit", *root, "--ckpt_path", str(checkpoints)])
    assert f"did you mean {str(newest)!r} (the newest checkpoint in it)" in capsys.readouterr().err
    # A truncated .metadata and a folder saved from a non-finite state: `last` skips both, naming them; the
    # explicit path fails naming the file and the last good checkpoint (bytes changed in place are found at load,
    # tests/lightning/test_faults.py).
    truncated = _fake_checkpoint(checkpoints / "step-000050")
    (truncated / ".metadata").write_bytes((truncated / ".metadata").read_bytes()[:10])
    import torch

    from lp_lightning.checkpoint.dcp import save_dcp_checkpoint

    nonfinite = save_dcp_checkpoint(checkpoints / "step-000060", model_state={"w": torch.full((64,), float("nan"))},
                                    optimizer_states={}, metadata={}, rank=0, allow_nonfinite=True)
    section = parse_config(root)
    section["ckpt_path"] = "last"
    check_launch(section)
    assert section["ckpt_path"] == str(newest)
    err = capsys.readouterr().err
    assert f"ckpt_path=last skips {str(truncated)!r} (file '.metadata' holds 10 bytes, the save wrote" in err
    assert f"ckpt_path=last skips {str(nonfinite)!r} (it was saved from a non-finite state ('w' holds NaN/Inf))" in err
    for damaged_path, problem in ((truncated, "file '.metadata' holds 10 bytes"), (nonfinite, "non-finite state")):
        with pytest.raises(SystemExit) as exc:
            main(["fit", *root, "--ckpt_path", str(damaged_path)])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"checkpoint {str(damaged_path)!r} is damaged: " in err and problem in err
        assert f"the last good checkpoint is {str(newest)!r}" in err

    class Resolved(LPLightningCLI):
        def _run_subcommand(self, subcommand: str) -> None:  # parse, build the Trainer, do not fit
            pass

    # `last` lets the strategy fall back further when a shard's digest fails at load; an explicit path does not.
    assert Resolved(args=["fit", *root, "--ckpt_path", "last"]).trainer.strategy.resume_fallback is True
    assert Resolved(args=["fit", *root, "--ckpt_path", str(newest)]).trainer.strategy.resume_fallback is False
    fresh = parse_config(["--trainer.default_root_dir", str(tmp_path / "empty")])
    fresh["ckpt_path"] = "last"
    check_launch(fresh)  # nothing to resume yet: start from step 0, as Lightning's "last"
    assert fresh["ckpt_path"] is None
    assert "ckpt_path=last: no complete checkpoint" in capsys.readouterr().err
    newer = _fake_checkpoint(checkpoints / "step-000070")  # intact and written after the damaged one
    with pytest.raises(SystemExit):
        main(["fit", *root, "--ckpt_path", str(truncated)])
    assert f"the last good checkpoint is {str(newer)!r}" in capsys.readouterr().err  # the one `last` would load
    assert no_model_build == []


def test_ckpt_path_last_on_a_completed_run_exits_0_with_nothing_to_do(tmp_path, capsys, no_model_build):
    """A job script passes `last` on every restart (docs/outputs.md): after the final step it must end cleanly."""
    _fake_checkpoint(tmp_path / "checkpoints" / "step-000020")
    root = ["--trainer.default_root_dir", str(tmp_path)]
    assert main(["fit", *root, "--trainer.max_steps", "20", "--ckpt_path", "last"]) == 0
    err = capsys.readouterr().err
    assert "is at step 20 and trainer.max_steps=20: the run is complete, nothing to do" in err
    assert "Traceback" not in err and no_model_build == []
    section = parse_config([*root, "--trainer.max_steps", "30"])
    section["ckpt_path"] = "last"
    check_launch(section)  # more steps asked: resume
    assert section["ckpt_path"].endswith("step-000020")


def test_resume_command_replaces_the_ckpt_path():
    from lp_lightning.cli import resume_command

    assert resume_command(["fit", "--config", "a b.yaml", "--ckpt_path", "runs/x/step-000004", "--trainer.devices=2"]) \
        == "lp-lightning fit --config 'a b.yaml' --trainer.devices=2 --ckpt_path last"
    assert resume_command(["fit", "--ckpt_path=last"]) == "lp-lightning fit --ckpt_path last"


@pytest.mark.parametrize(("signum", "status"), [(15, 143), (10, 143), (2, 130)])
def test_a_signal_stop_exits_with_its_status_and_prints_the_resume_command(monkeypatch, capsys, signum, status):
    """SIGTERM / SIGUSR1: 143, SIGINT: 130; rank 0 prints one line with the step, the checkpoint and the command."""
    import lp_lightning.cli as cli
    from lp_lightning.lightning.preemption import SignalStop

    def stopped(**kwargs):
        raise SignalStop(signum, step=7, checkpoint="runs/x/checkpoints/step-000007", saved=True)

    monkeypatch.setattr(cli, "LPLightningCLI", stopped)
    assert main(["fit", "--trainer.devices", "2"]) == status
    name = {15: "SIGTERM", 10: "SIGUSR1", 2: "SIGINT"}[signum]
    assert capsys.readouterr().err == (
        f"lp-lightning: training stopped early by {name} after step 7 (every rank at that step); saved "
        "'runs/x/checkpoints/step-000007'. Resume: lp-lightning fit --trainer.devices 2 --ckpt_path last\n"
    )


def test_help_lists_every_subcommand_with_one_line(capsys):
    from lp_lightning.cli import SUBCOMMANDS, main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("fit", "validate", "validate-model", "plan", "st"):
        assert sum(line.strip().startswith(name + " ") for line in out.splitlines()) == 1, name
    assert [name for name, _ in SUBCOMMANDS] == ["fit", "validate", "validate-model", "plan", "st"]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--trainer.max_step", "5"], "unrecognized arguments: --trainer.max_step 5"),  # no prefix matching
        (["--model.activation_checkpoint", "on"], 'Parser key "model.activation_checkpoint"'),
        (["--precision", "fp8"], "Expected a typing.Literal['bf16', 'mxfp8', 'hif8']"),
        # a callback refusing its init_args: its own message, not jsonargparse's dump of the union it tried
        (["--trainer.callbacks+=lp_lightning.telemetry.InjectNonFiniteGradient",
          "--trainer.callbacks.step", "0"], "InjectNonFiniteGradient: step=0 must be an int >= 1"),
    ],
)
def test_a_usage_error_is_at_most_five_lines_without_the_usage(capsys, options, expected):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS / "dsv3_tiny.yaml"), *options])
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("lp-lightning", "  "))]
    assert 2 <= len(err) <= 5 and expected in "\n".join(err), err
    assert err[0].startswith("lp-lightning fit: error: ") and err[-1] == "lp-lightning fit --help lists every option."


# ------------------------------------------------------------------------------------------------
# Output folders, disk space and data, checked at launch (nothing is created when a check fails)
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder this process cannot write: mode 0555, or for root (who ignores modes) a read-only tmpfs."""
    import shutil
    import subprocess

    folder = tmp_path / "read_only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    if shutil.which("mount") is None:
        pytest.skip("root ignores file modes and there is no mount command for a read-only tmpfs")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"root ignores file modes and mount is refused: {done.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def _launch_fails(capsys, *options: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["fit", *options])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    return " ".join(err.split())


def test_a_read_only_output_folder_fails_at_launch_and_creates_nothing(tmp_path, read_only_dir, capsys,
                                                                        no_model_build):
    tokens = tmp_path / "tokens"
    err = _launch_fails(capsys, "--trainer.default_root_dir", str(read_only_dir / "run"),
                        "--data.cache_dir", str(tokens))
    assert (f"error: trainer.default_root_dir={str(read_only_dir / 'run')!r} cannot be written: "
            f"{str(read_only_dir)!r} is ") in err
    assert "lp-lightning writes logs/, checkpoints/ and run_summary.json there. Pass a writable " \
           "--trainer.default_root_dir." in err
    err = _launch_fails(capsys, "--trainer.default_root_dir", str(tmp_path / "run"), "--data.cache_dir",
                        str(read_only_dir / "tokens"))  # a token cache still to build needs its folder too
    assert f"error: data.cache_dir={str(read_only_dir / 'tokens')!r} cannot be written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["read_only"] and not list(read_only_dir.iterdir())
    assert no_model_build == []


@pytest.mark.parametrize(("content", "tokens", "train"), [(b"", 1, 0), (b"hello world\n", 13, 12)])
def test_too_little_data_fails_at_launch_and_creates_nothing(tmp_path, capsys, no_model_build, content, tokens, train):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(content)
    root, cache = tmp_path / "run", tmp_path / "tokens"
    err = _launch_fails(capsys, "--trainer.default_root_dir", str(root), "--data.cache_dir", str(cache),
                        "--data.sources", str(corpus))
    assert (f"error: data.sources: {str(corpus)!r} holds {tokens} token{'s' if tokens > 1 else ''} (byte tokenizer): "
            f"the train split gets {train}, one sequence needs data.seq_len + 1 = 257; add text to data.sources or "
            "lower data.seq_len.") in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]  # no run/ (logs, checkpoints), no tokens/
    assert no_model_build == []


def test_a_validation_split_without_one_batch_fails_at_launch(tmp_path, capsys, no_model_build):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("word " * 400)  # 2001 tokens: a train sequence, but 101 validation tokens for 4 x 257
    options = ["--trainer.default_root_dir", str(tmp_path / "run"), "--data.cache_dir", str(tmp_path / "tokens"),
               "--data.sources", str(corpus)]
    err = _launch_fails(capsys, *options)
    assert ("holds 2001 tokens (byte tokenizer): the validation split (data.val_fraction=0.05) gets 101, one "
            "validation batch needs 4 x 257 = 1028; add text, raise data.val_fraction, lower data.seq_len / "
            "data.val_batch_size, or pass --trainer.limit_val_batches 0.") in err
    section = parse_config([*options, "--data.seq_len", "24"])  # 4 x 25 = 100 tokens fit
    check_launch(section)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"PK\x03\x04" + bytes(range(256)) * 40, "it holds a NUL byte (at byte 4)"),
        ("café crème brûlée ".encode("latin-1") * 600, "2400 of its 10800 bytes are not valid UTF-8"),
    ],
    ids=["nul", "latin1"],
)
def test_a_binary_corpus_fails_at_launch_unless_allowed(tmp_path, capsys, no_model_build, content, problem):
    corpus = tmp_path / "corpus.dat"
    corpus.write_bytes(content)
    options = ["--trainer.default_root_dir", str(tmp_path / "run"), "--data.cache_dir", str(tmp_path / "tokens"),
               "--data.sources", str(corpus), "--data.seq_len", "32"]
    err = _launch_fails(capsys, *options)
    assert (f"error: data.sources: {str(corpus)!r} is not text: {problem}. Pass text files, or --data.allow_binary "
            "true to train on it (undecodable bytes become U+FFFD).") in err
    check_launch(parse_config([*options, "--data.allow_binary", "true"]))  # allowed: the launch checks pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.dat"]
    assert no_model_build == []


def test_too_little_disk_for_one_checkpoint_warns_at_launch(tmp_path, capsys, monkeypatch):
    from collections import namedtuple

    from lp_lightning.checkpoint import space

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(space.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 5 * 10**6, 5 * 10**6))
    section = parse_config(["--trainer.default_root_dir", str(tmp_path / "run")])
    check_launch(section)  # a warning: the run may free space before it saves
    err = " ".join(capsys.readouterr().err.split())
    assert (f"lp-lightning: warning: {str(tmp_path)!r} has 5.0 MB free, but one checkpoint of this run needs about "
            "36.6 MB (FP32 masters and AdamW moments, 12 bytes per parameter); saves will fail unless space is "
            "freed.") in err
    monkeypatch.undo()
    check_launch(parse_config(["--trainer.default_root_dir", str(tmp_path / "run")]))
    assert "warning" not in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_full_disk_at_save_time_stops_fit_with_one_line(tmp_path, token_cache_dir, isolated_dist, monkeypatch,
                                                          capsys):
    """Injected: the second checkpoint's shards fill the disk (ENOSPC from DCP's writer)."""
    import errno

    import torch.distributed.checkpoint as dcp

    from lp_lightning.checkpoint.dcp import verify_dcp_checkpoint

    real_save, saves = dcp.save, []

    def filling_save(state, *, checkpoint_id):
        saves.append(checkpoint_id)
        real_save(state, checkpoint_id=checkpoint_id)
        if len(saves) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(dcp, "save", filling_save)
    root = ["--trainer.default_root_dir", str(tmp_path)]
    code = main(["fit", *root, "--data.cache_dir", token_cache_dir, "--data.seq_len", "32", "--trainer.max_steps", "2",
                 "--checkpoint.every_n_steps", "1", "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
                 "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    checkpoints = tmp_path / "checkpoints"
    line = (f"lp-lightning: checkpoint step-000002 not written: no space left in {str(checkpoints)!r} (it needs "
            f"36.")
    assert line in err and "the partial folder was removed, step-000001 is untouched. Free space, then rerun " \
                           "with --ckpt_path last." in err
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000001"]
    verify_dcp_checkpoint(checkpoints / "step-000001")  # every byte as saved
    section = parse_config(root)
    section["ckpt_path"] = "last"
    check_launch(section)
    assert section["ckpt_path"] == str(checkpoints / "step-000001")


def test_a_usage_error_under_torchrun_is_said_by_rank_zero_only(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS / "dsv3_tiny.yaml"), "--trainer.max_step", "5"])
    assert exit_info.value.code == 2 and "error" not in capsys.readouterr().err


_THIRD_PARTY_NOISE = re.compile(
    r"\.py:\d+[:\]]"                   # a warning's `file.py:123:` or a torch log record's `file.py:630]`
    r"|^[DIWEF]\d{4} \d\d:\d\d:\d\d"  # torch's log-record prefix (W1204 03:02:08.005000 ...)
    r"|warn|deprecat|Failed to load|Tip:|FLOPs|Traceback|[┏┃┡└]",  # warnings, advice, the model-summary table
    re.IGNORECASE,
)
"""A console line that is a warning or a log record (the product's own lines are told apart by their source)."""


def _third_party_noise(output: str) -> list[str]:
    return [line for line in output.splitlines() if _THIRD_PARTY_NOISE.search(line)
            and not line.startswith("lp-lightning") and "lp_lightning/" not in line]


@pytest.mark.slow
def test_a_quiet_mxfp8_fit_prints_no_third_party_warning_and_ends_with_its_summary_line(tmp_path, token_cache_dir):
    """Issue 23 item 5: a 2-step mxfp8 fit (defaults but short sequences) prints no third-party warning or log
    record (torchao, torch's pytree, Lightning's tip, model summary and warnings), one count of the low-precision
    weights and modules, the one-line model summary, and at the end where the summary and the loss plot went."""
    root = tmp_path / "run"
    command = [sys.executable, "-m", "lp_lightning.cli", "fit", "--config", str(CONFIGS / "dsv3_tiny.yaml"),
               "--precision", "mxfp8", "--trainer.max_steps", "2", "--trainer.default_root_dir", str(root),
               "--data.cache_dir", token_cache_dir, "--data.seq_len", "32", "--data.global_batch_size", "2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(CONFIGS.parent), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert _third_party_noise(output) == [], output
    lines = output.splitlines()
    assert any(line.startswith("lp-lightning: mxfp8 on 25 low-precision weights in 23 modules, op backend 'emulated'")
               for line in lines), output
    assert ("lp-lightning: model 3.0 M parameters, FP32 masters, FSDP2 over 1 rank; mxfp8 GEMMs on 25 low-precision "
            "weights in 23 modules (2.8 M parameters, 91%).") in lines, output
    summary = json.loads((root / "run_summary.json").read_text())
    assert summary["replacement"]["num_replaced"] == 23 and summary["replacement"]["low_precision_weights"] == 25
    plot = root / "loss.png"
    assert summary["loss_plot"] == str(plot) and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    last = [line for line in lines if line.startswith("lp-lightning: ")][-1]
    assert last == (f"lp-lightning: steps 1-2 done, loss {summary['loss_first']:.4g} -> {summary['loss_last']:.4g}, "
                    f"{summary['tokens_per_s']:,.0f} tokens/s (steady median); summary {root / 'run_summary.json'}, "
                    f"loss plot {plot}")


def test_a_folder_that_refuses_files_even_to_root_and_a_file_in_the_cache_path_fail_at_launch(tmp_path, capsys,
                                                                                              no_model_build):
    (tmp_path / "afile").write_text("")
    err = _launch_fails(capsys, "--trainer.default_root_dir", "/proc/lp-lightning-run",
                        "--data.cache_dir", str(tmp_path / "tokens"))  # os.access says yes to root; a file says no
    assert "trainer.default_root_dir='/proc/lp-lightning-run' cannot be written: '/proc' is not writable" in err
    err = _launch_fails(capsys, "--trainer.default_root_dir", str(tmp_path / "run"),
                        "--data.cache_dir", str(tmp_path / "afile" / "tok"))
    assert f"data.cache_dir={str(tmp_path / 'afile' / 'tok')!r} cannot be written: {str(tmp_path / 'afile')!r} is a file" \
        in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] and no_model_build == []


def test_an_unknown_subcommand_points_to_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fitt"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "lp-lightning --help lists every subcommand: fit, validate, validate-model, plan, st.")
