"""``lp-lightning plan`` on the command line: options, spellings, ``--config``, output and exit status."""

from __future__ import annotations

import json

import pytest

from lp_lightning.cli import main
from lp_lightning.cli.fit import plan_settings
from lp_lightning.planner import plan_memory

TINY = ["plan", "--spec", "dsv3-tiny", "--precision", "mxfp8", "--seq_len", "64", "--micro_batch_size", "2"]


def _json(capsys, argv):
    status = main(argv)
    out = capsys.readouterr().out
    return status, json.loads(out)


def test_hyphen_and_underscore_spellings_agree(capsys):
    a = _json(capsys, [*TINY, "--world_size", "2", "--activation_checkpoint", "full", "--budget_gib", "1", "--json"])
    b = _json(capsys, ["plan", "--spec", "dsv3-tiny", "--precision", "mxfp8", "--seq-len", "64", "--micro-batch-size",
                       "2", "--world-size", "2", "--activation-checkpoint", "full", "--budget-gib", "1", "--json"])
    assert a == b and a[0] == 0
    status, plan = a
    assert plan["run"]["activation_checkpoint"] == "full" and plan["budget_bytes"] == 2**30
    direct = plan_memory("dsv3-tiny", "mxfp8", 2, seq_len=64, micro_batch_size=2, activation_checkpoint="full",
                         budget_bytes=2**30)
    assert plan == json.loads(direct.to_json())


def test_flags_and_overrides(capsys):
    _, plan = _json(capsys, [*TINY, "--world-size", "8", "--fallback-to-unsharded", "--no_reshard_after_forward",
                             "--config_overrides", '{"num_hidden_layers": 2}', "--json"])
    assert plan["run"]["fallback_to_unsharded"] and not plan["run"]["reshard_after_forward"]
    assert plan["launchable"] and len(plan["activation_terms"]["per_layer"]) == 2
    assert plan["in_flight"]["units"].keys() >= {"every unit"}


def test_human_report(capsys):
    assert main([*TINY, "--world-size", "4", "--config_overrides", '{"kv_lora_rank": 256}']) == 0
    out = capsys.readouterr().out
    for needle in ("per-rank memory (rank 0)", "master ", "all_gather_buffers", "total ", "budget 96.00 GiB: fits",
                   "bytes per parameter", "mxfp8  mxfp8_e4m3", "placements of 25 low-precision weights",
                   "dim-0 rule (design spec §9.1) breaks for", "Shard(1)    model.layers.0.self_attn.kv_a_proj_with_mqa"):
        assert needle in out, needle


def test_does_not_fit_or_cannot_start_exits_1(capsys):
    assert main([*TINY, "--world-size", "1", "--budget-gib", "0.001"]) == 1
    assert "does NOT fit" in capsys.readouterr().out
    assert main([*TINY, "--world-size", "8"]) == 1  # dsv3-tiny has weights no dim can shard over 8 ranks
    assert "cannot start" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--spec", "dsv3-99b"], "not a built-in spec"),
        (["--world-size", "0"], "--world_size must be an integer >= 1"),
        (["--precision", "fp4"], "--precision 'fp4' is not supported"),
        (["--activation-checkpoint", "some"], "activation_checkpoint"),
        (["--world-size", "two"], "world_size"),
        (["--bogus"], "bogus"),
        (["--config_overrides", "{not json"], "config_overrides"),
        (["--config", "does/not/exist.yaml"], "does/not/exist.yaml"),
    ],
)
def test_bad_options_exit_2(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()[-1]) < 400


def test_config_supplies_the_run(capsys):
    settings = plan_settings("configs/dsv3_16b_hif8.yaml")
    assert settings == {
        "spec": "dsv3-16b", "precision": "hif8", "world_size": 8, "seq_len": 4096, "micro_batch_size": 1,
        "global_batch_size": 8, "accumulate_grad_batches": 1,
        "activation_checkpoint": "off", "reshard_after_forward": True, "fallback_to_unsharded": False,
        "input_dim_sharding": True, "config_overrides": None,
    }
    _, plan = _json(capsys, ["plan", "--config", "configs/dsv3_16b_hif8.yaml", "--world-size", "16",
                             "--micro-batch-size", "1", "--json"])
    run = {k: v for k, v in settings.items() if k not in ("global_batch_size", "accumulate_grad_batches")}
    assert plan["run"] | {"world_size": 8} == {**run, "format": "hif8", "config_overrides": {}}
    assert plan["run"]["world_size"] == 16  # an explicit option wins over the YAML


def test_config_micro_batch_follows_the_world_size(capsys):
    """fit splits data.global_batch_size (4) over accumulation x world size: plan must plan the same micro batch."""
    tiny = ["plan", "--config", "configs/dsv3_tiny.yaml", "--json"]
    runs = {
        "yaml": _json(capsys, tiny),
        "world_size": _json(capsys, [*tiny, "--world-size", "2"]),
        "devices": _json(capsys, [*tiny, "--trainer.devices", "2"]),
        "nodes": _json(capsys, [*tiny, "--trainer.devices", "1", "--trainer.num_nodes", "2"]),
        "explicit": _json(capsys, [*tiny, "--world-size", "2", "--micro-batch-size", "3"]),
    }
    assert {name: (status, plan["run"]["world_size"], plan["run"]["micro_batch_size"])
            for name, (status, plan) in runs.items()} == {
        "yaml": (0, 1, 4), "world_size": (0, 2, 2), "devices": (0, 2, 2), "nodes": (0, 2, 2), "explicit": (0, 2, 3)}
    assert runs["devices"][1] == runs["world_size"][1]
    assert plan_settings("configs/dsv3_tiny.yaml", ["--trainer.devices", "2"])["micro_batch_size"] == 2
    _, by_devices = _json(capsys, ["plan", "--spec", "dsv3-tiny", "--trainer.devices", "2", "--json"])
    assert by_devices["run"]["world_size"] == 2  # without --config: --trainer.devices is the world size


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world-size", "3"], "data.global_batch_size=4 of 'configs/dsv3_tiny.yaml' does not split over "
                                "trainer.accumulate_grad_batches (1) x world size (3) = 3"),
        (["--trainer.devices", "3"], "data.global_batch_size=4 must be divisible by trainer.accumulate_grad_batches"),
        (["--trainer.devices", "2", "--world-size", "4"], "--world-size 4 disagrees with --trainer.devices 2"),
    ],
)
def test_config_world_size_that_fit_refuses_exits_2(capsys, argv, message):
    assert main(["plan", "--config", "configs/dsv3_tiny.yaml", *argv]) == 2
    assert message in capsys.readouterr().err


def test_config_with_input_dim_sharding_off_cannot_start(capsys, tmp_path):
    """fsdp_config.input_dim_sharding: false makes the 84 dim-0 rule breakers unshardable, as `fit` would say."""
    yaml = tmp_path / "no_input_dim.yaml"
    yaml.write_text(open("configs/dsv3_16b_mxfp8.yaml").read().replace(
        "  fallback_to_unsharded: false\n", "  fallback_to_unsharded: false\n  input_dim_sharding: false\n"))
    assert plan_settings(str(yaml))["input_dim_sharding"] is False
    code, plan = _json(capsys, ["plan", "--config", str(yaml), "--json"])
    assert code == 1 and plan["launchable"] is False and "84 low-precision weight(s)" in plan["startup_error"]
    assert sum(p["replicated_by_fallback"] for p in plan["placements"]) == 84
    code, plan = _json(capsys, ["plan", "--config", str(yaml), "--input-dim-sharding", "--json"])
    assert code == 0 and plan["launchable"] is True  # the option wins over the YAML
