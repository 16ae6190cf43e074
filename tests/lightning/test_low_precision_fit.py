"""``lp-lightning fit --precision mxfp8|hif8`` end to end, one process per run (issue 4 item 6, issue 5).

Runs (dsv3-tiny on the stdlib corpus, 4 x 64 tokens per step, 8 steps, each a fresh
``python -m lp_lightning.cli fit`` process; the low-precision runs carry the opt-in
``HighPrecisionGemmProbe``, which also runs the codec kernels eagerly — bit-identical, no compile
warm-up):

* ``bf16``, ``mxfp8``, ``hif8``: the same global batches; checkpoints after steps 3, 6 and 8;
  ``mxfp8`` dumps its 8-bit storage and AdamW state after step 3 (``_probes.StateDump``);
* ``mxfp8_resumed``: a fresh process resumes ``mxfp8``'s step-3 checkpoint and trains steps 4-8;
* ``hif8_from_mxfp8`` then ``bf16_from_hif8``: cross-format resume (one step each).

Loss criterion (issue 4 acceptance): the final training loss of each low-precision run lies within
5 % of the BF16 run's on the same batches. The default 40-step run of ``configs/dsv3_tiny.yaml`` was
measured once (README of this test in the final report); here the criterion is applied after 8
steps, where the loss is still falling fast and each run's last-step loss is one micro-batch of
4 x 64 tokens — a noisier point than the default run's, so if anything a harder check.

Resume: on CPU every kernel is deterministic and the data, LR schedule and RNG are restored, so the
resumed losses equal the continuous run's bitwise; the restored AdamW moments/steps equal the
saved ones bitwise; the rebuilt 8-bit storage equals the continuous run's bitwise (it is a pure
function of the restored FP32 master).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lp_lightning.checkpoint.dcp import checkpoint_tensor_keys
from lp_lightning.telemetry.probes import GEMM_ROLE_KEYS

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 8
LOW_PRECISION_WEIGHTS = 25
COUNTS = {"mla_projections": 12, "dense_mlp": 3, "shared_experts": 6, "routed_experts": 2}


def _run(root: Path, cache_dir: str, precision: str, *extra: str, expect_failure: bool = False) -> dict:
    args = [
        sys.executable, "-m", "lp_lightning.cli", "fit", "--config", str(REPO / "configs" / "dsv3_tiny.yaml"),
        "--precision", precision,
        "--trainer.default_root_dir", str(root), "--data.cache_dir", cache_dir,
        "--data.seq_len", "64", "--data.global_batch_size", "4", "--data.val_batches", "1",
        "--trainer.max_steps", str(STEPS), "--trainer.val_check_interval", str(STEPS),
        "--checkpoint.every_n_steps", "3", "--model.warmup_steps", "2", "--model.lr_decay_steps", str(STEPS),
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.callbacks+=_probes.ImportedModules", f"--trainer.callbacks.out_dir={root / 'probe'}",
        "--run_summary.wire", "true",  # the tests read the opt-in wire section
    ]
    if precision != "bf16":
        args.append("--trainer.callbacks+=lp_lightning.telemetry.probes.HighPrecisionGemmProbe")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
    proc = subprocess.run(args + list(extra), cwd=root.parent, env=env, capture_output=True, text=True, timeout=600)
    if expect_failure:
        assert proc.returncode != 0, proc.stdout[-3000:]
        return {"stderr": proc.stderr, "root": str(root), "returncode": proc.returncode}
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    summary = json.loads((root / "run_summary.json").read_text())
    summary["root"] = str(root)
    summary["stderr"] = proc.stderr
    return summary


@pytest.fixture(scope="module")
def runs(tmp_path_factory, token_cache_dir):
    base = tmp_path_factory.mktemp("lp_fit")
    cache: dict[str, dict] = {}
    dump = ["--trainer.callbacks+=_probes.StateDump", f"--trainer.callbacks.out_dir={base / 'dump'}"]
    two = ["--trainer.devices", "2"]
    # kv_lora_rank 64: kv_a_proj_with_mqa is [64 + 32, 256], 48 rows per rank: breaks the MXFP8 dim-0 rule, but
    # 128 columns per rank are legal: it is sharded along its input dim (Shard(1)).
    input_dim = ["--model.validate_spec", "false", "--model.config_overrides", '{"kv_lora_rank": 64}',
                 "--trainer.max_steps", "4", "--model.lr_decay_steps", "4", "--trainer.val_check_interval", "4"]
    # hidden 192 as well: kv_a_proj_with_mqa [96, 192] has 48 rows and 96 columns per rank: no legal dim.
    illegal = ["--model.validate_spec", "false", "--model.config_overrides", '{"kv_lora_rank": 64, "hidden_size": 192}']

    def sharding(root: Path) -> list[str]:
        return ["--trainer.callbacks+=_probes.ShardingProbe", f"--trainer.callbacks.out_dir={root / 'probe'}"]

    def get(name: str) -> dict:
        if name not in cache:
            root = base / name
            if name in ("bf16", "hif8"):
                cache[name] = _run(root, token_cache_dir, name)
            elif name == "mxfp8":
                cache[name] = _run(root, token_cache_dir, "mxfp8", *dump, "--trainer.callbacks.steps=3")
            elif name == "mxfp8_resumed":
                ckpt = Path(get("mxfp8")["root"]) / "checkpoints" / "step-000003"
                cache[name] = _run(root, token_cache_dir, "mxfp8", "--ckpt_path", str(ckpt), *dump)
            elif name == "hif8_from_mxfp8":
                ckpt = Path(get("mxfp8")["root"]) / "checkpoints" / "step-000003"
                cache[name] = _run(root, token_cache_dir, "hif8", "--ckpt_path", str(ckpt), "--trainer.max_steps", "4")
            elif name in ("mxfp8_2proc", "hif8_2proc"):
                cache[name] = _run(root, token_cache_dir, name.split("_")[0], *two, *sharding(root))
            elif name == "mxfp8_2proc_resumed":
                ckpt = Path(get("mxfp8_2proc")["root"]) / "checkpoints" / "step-000003"
                cache[name] = _run(root, token_cache_dir, "mxfp8", *two, "--ckpt_path", str(ckpt))
            elif name == "mxfp8_2proc_input_dim_killed":  # rank 1 SIGKILLed in step 4, after the step-3 checkpoint
                cache[name] = _run(root, token_cache_dir, "mxfp8", *two, *input_dim,
                                   "--trainer.callbacks+=_probes.KillRank", "--trainer.callbacks.step=3",
                                   expect_failure=True)
            elif name == "mxfp8_2proc_input_dim_resumed":  # `last` after the kill: from step 3 to 4
                killed = Path(get("mxfp8_2proc_input_dim_killed")["root"])
                cache[name] = _run(killed, token_cache_dir, "mxfp8", *two, *input_dim, "--ckpt_path", "last")
            elif name == "mxfp8_2proc_illegal":
                cache[name] = _run(root, token_cache_dir, "mxfp8", *two, *illegal, "--trainer.max_steps", "2",
                                   expect_failure=True)
            elif name == "mxfp8_2proc_fallback":
                cache[name] = _run(root, token_cache_dir, "mxfp8", *two, *illegal, *sharding(root),
                                   "--fsdp_config.fallback_to_unsharded", "true", "--trainer.max_steps", "2")
            elif name == "mxfp8_2proc_input_dim":
                cache[name] = _run(root, token_cache_dir, "mxfp8", *two, *input_dim, *sharding(root))
            elif name == "mxfp8_2proc_input_dim_replicated":  # the pre-placement behaviour, for comparison
                cache[name] = _run(root, token_cache_dir, "mxfp8", *two, *input_dim,
                                   "--fsdp_config.input_dim_sharding", "false",
                                   "--fsdp_config.fallback_to_unsharded", "true")
            elif name == "bf16_from_hif8":
                ckpt = Path(get("hif8_from_mxfp8")["root"]) / "checkpoints" / "step-000004"
                cache[name] = _run(root, token_cache_dir, "bf16", "--ckpt_path", str(ckpt), "--trainer.max_steps", "5")
        return cache[name]

    get.base = base  # type: ignore[attr-defined]
    return get


@pytest.mark.parametrize("precision", ["mxfp8", "hif8"])
def test_fit_writes_the_low_precision_run_summary(runs, precision):
    summary = runs(precision)
    fmt, scaling = {"mxfp8": ("mxfp8_e4m3", "mx_block"), "hif8": ("hif8", "current")}[precision]
    assert summary["precision"] == precision and summary["backend"] == "emulated"
    assert summary["low_precision"] == {"enabled": True, "format": fmt, "scaling": scaling,
                                        "recipe_name": f"{fmt}_{scaling}"}
    replacement = summary["replacement"]
    assert replacement["applied"] is True and replacement["counts"] == COUNTS
    assert replacement["num_replaced"] == 23 and replacement["skipped"] == []
    kernels = summary["kernels"]
    assert all(kernels[role] > 0 for role in GEMM_ROLE_KEYS), kernels
    assert kernels["high_precision_gemms_in_replaced_modules"] == 0, kernels["high_precision_gemm_examples"]
    assert kernels["high_precision_gemms_elsewhere"] > 0
    assert kernels["backends"] == {"emulated": sum(kernels[r] for r in GEMM_ROLE_KEYS)}
    assert kernels["formats"] == {fmt: sum(kernels[r] for r in GEMM_ROLE_KEYS)}
    refresh = summary["refresh"]
    assert refresh["per_step"] == [LOW_PRECISION_WEIGHTS] * STEPS
    assert refresh["per_weight_per_step"] == {"min": 1, "max": 1}
    assert refresh["skipped_steps"] == 0 and refresh["startup"] == 1 and refresh["resume"] == 0
    wire = summary["wire"]
    assert wire["high_precision_gathers_of_replaced"] == 0
    assert wire["low_precision_weights_gathered"] == LOW_PRECISION_WEIGHTS
    assert wire["gathers_per_step"] == {"forward": LOW_PRECISION_WEIGHTS, "backward": LOW_PRECISION_WEIGHTS}
    assert wire["all_gather_bytes"] == wire["reduce_scatter_bytes"] == {}  # one rank: FSDP2 issues no collective
    assert wire["low_precision_weights_gathered_locally"] == LOW_PRECISION_WEIGHTS
    trace = json.loads((Path(summary["root"]) / "wire_trace_rank0.json").read_text())
    gathers = [e for e in trace["events"] if e["kind"] == "weight_gather_local"]  # one rank: local
    assert len(gathers) == 2 * LOW_PRECISION_WEIGHTS  # step 0: one forward and one backward gather each
    assert all(dtype == "uint8" for e in gathers for dtype, _ in e["tensors"])
    assert summary["steps"] == STEPS and summary["loss_last"] < summary["loss_first"]
    # HighPrecisionGemmProbe runs the eager codec kernels (a dispatch mode cannot see inside a
    # compiled graph), so nothing compiles here; the compiled runs' count is asserted in
    # tests/test_benchmarks.py (both formats, through the CLI) and tests/lightning/test_recompiles.py.
    assert summary["compile"] == {"compiled_graphs": 0, "recompiles_after_first_step": 0}
    imported = json.loads((Path(summary["root"]) / "probe" / "imported_rank0.json").read_text())
    assert "torch_npu" not in imported and "lp_lightning.tensor.weight" in imported


def test_bf16_run_imports_no_low_precision_module(runs):
    summary = runs("bf16")
    assert summary["precision"] == "bf16" and summary["backend"] == "none"
    assert summary["replacement"] is None and summary["low_precision"] is None
    assert summary["refresh"] is None and summary["kernels"] is None  # no low-precision weight or GEMM exists
    assert "low_precision_weights_gathered" not in summary["wire"] and summary["wire"]["steps"] == STEPS
    assert json.loads((Path(summary["root"]) / "probe" / "imported_rank0.json").read_text()) == []


@pytest.mark.parametrize("precision", ["mxfp8", "hif8"])
def test_final_loss_within_five_percent_of_bf16(runs, precision):
    bf16, low = runs("bf16"), runs(precision)
    print(f"final loss after {STEPS} steps: bf16 {bf16['loss_last']:.4f}, {precision} {low['loss_last']:.4f}")
    assert low["losses"][0] == pytest.approx(bf16["losses"][0], rel=0.01)  # same batch, same init
    assert abs(low["loss_last"] - bf16["loss_last"]) <= 0.05 * bf16["loss_last"]


def test_resume_in_a_fresh_process_is_bitwise(runs):
    continuous, resumed = runs("mxfp8"), runs("mxfp8_resumed")
    assert resumed["first_step"] == 3 and resumed["steps"] == STEPS - 3
    assert resumed["losses"] == continuous["losses"][3:]  # the next 5 losses, bitwise
    assert resumed["grad_norms"] == continuous["grad_norms"][3:]
    assert resumed["refresh"]["resume"] == 1 and resumed["refresh"]["per_step"] == [LOW_PRECISION_WEIGHTS] * 5
    dump = runs.base / "dump"
    saved = torch.load(dump / "state_step3_rank0.pt", weights_only=True)
    restored = torch.load(dump / "state_start3_rank0.pt", weights_only=True)
    assert saved["global_step"] == restored["global_step"] == 3
    assert saved["optimizer"].keys() == restored["optimizer"].keys() and len(saved["optimizer"]) > 0
    for fqn, state in saved["optimizer"].items():
        for key, value in state.items():
            other = restored["optimizer"][fqn][key]
            if key in ("exp_avg", "exp_avg_sq"):
                assert value.dtype == other.dtype == torch.float32, (fqn, key)
            assert torch.equal(value, other), (fqn, key)
    assert len(saved["storage"]) == LOW_PRECISION_WEIGHTS and saved["storage"].keys() == restored["storage"].keys()
    for fqn, tensors in saved["storage"].items():
        for name, value in tensors.items():  # E4M3 / E8M0 bytes rebuilt from the restored masters
            assert torch.equal(value.reshape(-1).view(torch.uint8),
                               restored["storage"][fqn][name].reshape(-1).view(torch.uint8)), (fqn, name)


def test_checkpoint_holds_only_high_precision_state(runs):
    path = Path(runs("mxfp8")["root"]) / "checkpoints" / "step-000003"
    keys = checkpoint_tensor_keys(path)
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys and "model.layers.0.self_attn.q_proj.weight" in keys
    derived = ("row_data", "row_scale", "col_data", "col_scale", ".data", ".scale")
    assert not any(k.endswith(derived) for k in keys)
    for key, meta in keys.items():
        if hasattr(meta, "properties"):
            assert meta.properties.dtype in (torch.float32, torch.int64) or key.endswith(".step"), key

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = runs.base / "mxfp8_step3.pt"
    dcp_to_torch_save(path, flat)
    state = torch.load(flat, weights_only=True)  # no tensor subclass, no custom class
    assert all(type(v) is torch.Tensor for v in state.values() if isinstance(v, torch.Tensor))


def test_checkpoint_loads_into_a_plain_hf_model(runs):
    import torch.distributed.checkpoint as dcp

    from lp_lightning.models.deepseek_v3 import from_hf_config

    path = Path(runs("mxfp8")["root"]) / "checkpoints" / "step-000003"
    model = from_hf_config("dsv3-tiny", torch_dtype=torch.float32, seed=1)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    state = model.state_dict()
    before = state["model.layers.0.self_attn.q_proj.weight"].clone()
    dcp.load(state, checkpoint_id=path)  # no process group: single-process load
    model.load_state_dict(state, strict=True)
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, before)
    ids = torch.randint(0, 257, (1, 16), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_cross_format_resume_mxfp8_to_hif8_to_bf16(runs):
    hif8 = runs("hif8_from_mxfp8")
    assert hif8["precision"] == "hif8" and hif8["first_step"] == 3 and hif8["global_step"] == 4
    assert hif8["refresh"]["resume"] == 1 and hif8["refresh"]["per_step"] == [LOW_PRECISION_WEIGHTS]
    mxfp8 = runs("mxfp8")
    # Same masters, same batch, another 8-bit format: the loss is the continuous run's within the
    # format's noise (a few 1e-3 relative at this loss level), not bitwise.
    assert hif8["losses"][0] == pytest.approx(mxfp8["losses"][3], rel=0.02)
    bf16 = runs("bf16_from_hif8")
    assert bf16["precision"] == "bf16" and bf16["first_step"] == 4 and bf16["global_step"] == 5
    assert bf16["refresh"] is None and bf16["replacement"] is None  # nothing low-precision is rebuilt
    assert torch.isfinite(torch.tensor(bf16["losses"])).all()


# ------------------------------------------------------------------------------------------------
# Two processes (FSDP2 over a 2-rank gloo mesh; issue 5)
#
# Tolerance of 2 vs 1 process. Both runs quantize every weight identically (the all-gathered 8-bit
# weight equals quantizing the full master: MXFP8 blocks never cross the 64-row shard boundary,
# HiF8 dense scales are MAX-reduced). What differs is how *activations and gradients* are grouped:
# each rank holds half of the tokens, so HiF8's per-tensor INPUT_FWD / GRAD_OUTPUT scales come from a
# rank's own amax, and MXFP8's wgrad col blocks (32 x 1 along the tokens) and the FP32 sums of the
# weight gradients hold other tokens. Each element's rounding changes by at most one step of its
# format, zero-mean; per GEMM that is noise at the SQNR of recipe.py (MXFP8 ~28.5 dB = 3.8 % rms,
# HiF8 gradients ~24.6 dB = 5.9 % rms).
#
# * Step 1 (no update yet): MXFP8's fprop is per row, so the loss agrees to the FP32 order of the
#   mean (measured 7e-8) and the gradient norm to the wgrad regrouping (4.8e-5). HiF8 rescales every
#   activation (loss 7e-4, gradient norm 2.1e-4).
# * Step 2: AdamW's first update is ~lr * sign(g) per element, so every gradient element whose sign
#   the noise flips (those smaller than a few % of the typical magnitude) moves by 2 lr the other
#   way. The loss then differs by 8.5e-5 (MXFP8) / 4.3e-3 (HiF8), the gradient norm - dominated by
#   the large first step - by 1.1e-3 / 4.4e-2. For scale: the 1-process HiF8 and BF16 runs differ
#   by 4.7e-2 in that gradient norm, the 2-process HiF8 run and BF16 by 5e-3; it is a sensitive
#   quantity, not a sign of a sharding error (steps 3-8 re-converge: losses within 5.5e-3).
# Asserted (~2x the measurement or the noise scale): below.
RTOL = {  # (step-1 loss, step-1 grad norm, step-2 loss, step-2 grad norm, steps 3-8 losses)
    "mxfp8": (1e-6, 1e-3, 2e-3, 1e-2, 1e-2),
    "hif8": (2e-3, 2e-3, 1e-2, 8e-2, 1e-2),
}


@pytest.mark.parametrize("precision", ["mxfp8", "hif8"])
def test_two_process_fit_gathers_only_8bit_payloads(runs, precision):
    summary = runs(f"{precision}_2proc")
    assert summary["world_size"] == 2 and summary["steps"] == STEPS
    assert summary["replacement"]["counts"] == COUNTS
    kernels = summary["kernels"]
    assert all(kernels[role] > 0 for role in GEMM_ROLE_KEYS)
    assert kernels["high_precision_gemms_in_replaced_modules"] == 0, kernels["high_precision_gemm_examples"]
    assert summary["refresh"]["per_step"] == [LOW_PRECISION_WEIGHTS] * STEPS
    assert summary["refresh"]["per_weight_per_step"] == {"min": 1, "max": 1}
    wire = summary["wire"]
    assert wire["high_precision_gathers_of_replaced"] == 0
    assert wire["low_precision_weights_gathered"] == LOW_PRECISION_WEIGHTS
    assert wire["low_precision_weights_gathered_locally"] == 0
    assert set(wire["all_gather_bytes"]) == {"uint8", "bfloat16", "float32"}  # 8-bit weights, BF16 rest, FP32 router
    assert set(wire["reduce_scatter_bytes"]) == {"float32"}  # FP32 gradient reduce-scatter (design spec §10)
    root = Path(summary["root"])
    for rank in (0, 1):
        trace = json.loads((root / f"wire_trace_rank{rank}.json").read_text())
        gathers = [e for e in trace["events"] if e["kind"] == "weight_gather"]
        assert {e["fqn"] for e in gathers} == set(trace["gathers_per_weight"])
        assert len(trace["gathers_per_weight"]) == LOW_PRECISION_WEIGHTS
        assert all(counts == {"forward": STEPS, "backward": STEPS} for counts in trace["gathers_per_weight"].values())
        for event in gathers:  # every replaced weight crossed the wire as 8-bit data + scales, never BF16/FP32
            assert {dtype for dtype, _ in event["tensors"]} == {"uint8"}, event
            grouped = event["fqn"].endswith(("experts.gate_up_proj", "experts.down_proj"))
            if precision == "mxfp8":  # reshard_after_forward=true, AC off: one orientation per gather (§9.1)
                fprop, dgrad = ("col", "row") if grouped else ("row", "col")
                assert event["orientations"] == [fprop if event["phase"] == "forward" else dgrad], event
                assert len(event["tensors"]) == 2  # data, scale
            else:  # HiF8: one data (both orientations) + the scale
                assert event["orientations"] == ["row", "col"] and len(event["tensors"]) == 2, event
        collectives = [e for e in trace["events"] if e["kind"] == "all_gather"]
        lp_fqns = [f for e in collectives for f in e["low_precision_fqns"]]
        assert sorted(lp_fqns) == sorted(e["fqn"] for e in gathers)  # each gather rode in one collective
        facts = json.loads((root / "probe" / f"probe_rank{rank}.json").read_text())
        assert facts["parallelization"]["steps"] == ["convert_module", "upcast_fp32", "fully_shard",
                                                     "refresh_low_precision"]
        assert facts["parallelization"]["low_precision_weights"] == LOW_PRECISION_WEIGHTS
        for name, p in facts["params"].items():
            assert p["placements"] == ["Shard(dim=0)"] and p["mesh_shape"] == [2], name


@pytest.mark.parametrize("precision", ["mxfp8", "hif8"])
def test_two_process_losses_match_one_process(runs, precision):
    one, two = runs(precision), runs(f"{precision}_2proc")
    print(f"{precision}: 1 proc losses {one['losses'][:2]} grad norms {one['grad_norms'][:2]}; "
          f"2 proc losses {two['losses'][:2]} grad norms {two['grad_norms'][:2]}")
    loss1, norm1, loss2, norm2, later = RTOL[precision]
    assert two["losses"][0] == pytest.approx(one["losses"][0], rel=loss1, abs=0)
    assert two["grad_norms"][0] == pytest.approx(one["grad_norms"][0], rel=norm1, abs=0)
    assert two["losses"][1] == pytest.approx(one["losses"][1], rel=loss2, abs=0)
    assert two["grad_norms"][1] == pytest.approx(one["grad_norms"][1], rel=norm2, abs=0)
    assert two["losses"][2:] == pytest.approx(one["losses"][2:], rel=later, abs=0)
    assert two["tokens"] == one["tokens"]


def test_two_process_resume_is_bitwise(runs):
    continuous, resumed = runs("mxfp8_2proc"), runs("mxfp8_2proc_resumed")
    assert resumed["first_step"] == 3 and resumed["refresh"]["resume"] == 1
    assert resumed["losses"] == continuous["losses"][3:]
    assert resumed["grad_norms"] == continuous["grad_norms"][3:]


@pytest.mark.slow
def test_a_rank_killed_mid_step_ends_the_job_with_one_line_and_resumes_from_the_last_checkpoint(runs):
    """Issue 13: a dead rank must not leave the others hanging or print a 40-line traceback; `last` resumes
    bitwise (here on the input-dim sharded model of issue 12, whose DCP checkpoint holds Shard(1) masters)."""
    killed = runs("mxfp8_2proc_input_dim_killed")
    err = killed["stderr"]
    assert killed["returncode"] == 1 and "Traceback" not in err
    assert err.count("lp-lightning: rank 0: a collective failed — another rank stopped or the connection dropped") == 1
    assert "rerun the same command with --ckpt_path last" in err
    continuous, resumed = runs("mxfp8_2proc_input_dim"), runs("mxfp8_2proc_input_dim_resumed")
    assert resumed["first_step"] == 3  # the newest complete checkpoint before the kill
    assert resumed["losses"] == continuous["losses"][3:] and resumed["grad_norms"] == continuous["grad_norms"][3:]


def test_illegal_mxfp8_shard_fails_at_startup_naming_fqn_shape_world_size_and_rule(runs):
    """Once, at launch (design spec §15): a usage error before any rank starts, not a traceback per rank."""
    result = runs("mxfp8_2proc_illegal")
    err = result["stderr"]
    assert result["returncode"] == 2 and "Traceback" not in err
    assert err.count("3 low-precision weight(s) cannot be sharded over 2 ranks along any dim") == 1
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight: shape (96, 192) over world size 2" in err
    assert "M_local % 64 == 0 fails: rows per rank [48, 48]" in err and "K_local = 96" in err
    assert "fallback_to_unsharded: true" in err


KV_A = {f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight" for i in range(3)}


def test_input_dim_shards_train_without_replicas(runs):
    """Acceptance (issue 12): weights that break the dim-0 rule train in MXFP8 with fallback_to_unsharded false,
    sharded along their input dim, gathered as 8-bit bytes, with no high-precision GEMM."""
    summary = runs("mxfp8_2proc_input_dim")
    assert summary["steps"] == 4 and summary["world_size"] == 2
    assert set(summary["sharding"]["input_dim_sharded"]) == KV_A
    assert summary["sharding"]["replicated_low_precision"] == []
    kernels = summary["kernels"]
    assert all(kernels[role] > 0 for role in GEMM_ROLE_KEYS)
    assert kernels["high_precision_gemms_in_replaced_modules"] == 0, kernels["high_precision_gemm_examples"]
    assert summary["refresh"]["per_step"] == [LOW_PRECISION_WEIGHTS] * 4
    wire = summary["wire"]
    assert wire["high_precision_gathers_of_replaced"] == 0 and wire["low_precision_weights_gathered_locally"] == 0
    root = Path(summary["root"])
    for rank in (0, 1):
        facts = json.loads((root / "probe" / f"probe_rank{rank}.json").read_text())
        for name, p in facts["params"].items():
            if name in KV_A:
                assert p["placements"] == ["Shard(dim=1)"] and p["local_shape"] == [96, 128], name
            else:
                assert p["placements"] == ["Shard(dim=0)"] and p["mesh_dim_names"] == ["dp_shard"], name
        trace = json.loads((root / f"wire_trace_rank{rank}.json").read_text())
        for event in (e for e in trace["events"] if e["kind"] == "weight_gather" and e["fqn"] in KV_A):
            # 8-bit data [96, 128] + the scales packed in one slot of the shard's shape (docs/architecture.md)
            assert event["tensors"] == [["uint8", [96, 128]], ["uint8", [96, 128]]], event


def test_input_dim_shards_against_the_replicated_fallback(runs):
    """The same model with input_dim_sharding false replicates the 3 weights (HSDP, gradients all-reduced)."""
    sharded, replicated = runs("mxfp8_2proc_input_dim"), runs("mxfp8_2proc_input_dim_replicated")
    assert {w["fqn"] for w in replicated["sharding"]["replicated_low_precision"]} == KV_A
    assert replicated["losses"][0] == pytest.approx(sharded["losses"][0], rel=1e-6, abs=0)
    per_gather = {}
    for name, summary in (("sharded", sharded), ("replicated", replicated)):
        trace = json.loads((Path(summary["root"]) / "wire_trace_rank0.json").read_text())
        sizes = {e["bytes"] for e in trace["events"] if e.get("fqn") in KV_A and e["kind"].startswith("weight_gather")}
        (per_gather[name],) = sizes
    # Bytes each rank puts into one gather of a kv_a_proj weight: its Shard(1) slots (2 x 96 x 128) against the
    # replicated copy FSDP2 makes locally of the whole 8-bit weight + scales (96 x 256 + 96 x 8).
    assert per_gather == {"sharded": 2 * 96 * 128, "replicated": 96 * 256 + 96 * 256 // 32}
    # On the network: the replicated weights all-reduce their FP32 gradients (4 bytes/element, twice on a ring);
    # the sharded ones gather 2 x 2 bytes/element and reduce-scatter 4: the same ring traffic, 1/W of the state.
    kv_elements = 3 * 96 * 256
    assert replicated["wire"]["all_reduce_bytes"]["float32"] - sharded["wire"]["all_reduce_bytes"].get("float32", 0) \
        == pytest.approx(4 * kv_elements, rel=0.01)


def test_fallback_keeps_illegal_weights_replicated_and_low_precision(runs):
    summary = runs("mxfp8_2proc_fallback")
    assert summary["steps"] == 2 and summary["world_size"] == 2
    kernels = summary["kernels"]
    assert all(kernels[role] > 0 for role in GEMM_ROLE_KEYS)
    assert kernels["high_precision_gemms_in_replaced_modules"] == 0
    assert summary["replacement"]["counts"] == COUNTS  # still replaced, still MXFP8
    assert summary["refresh"]["per_step"] == [LOW_PRECISION_WEIGHTS] * 2
    assert summary["wire"]["high_precision_gathers_of_replaced"] == 0
    replicated = {f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight" for i in range(3)}
    assert {w["fqn"] for w in summary["sharding"]["replicated_low_precision"]} == replicated
    assert "3 low-precision weight(s) cannot be sharded along any dim over 2 ranks and stay replicated" in summary["stderr"]
    assert len(summary["sharding"]["input_dim_sharded"]) == 6  # hidden 192: o_proj / down_proj take Shard(1)
    assert "returned a view tensor" not in summary["stderr"]  # the replicated modules' outputs are not views
    wire = summary["wire"]
    assert wire["low_precision_weights_gathered"] == LOW_PRECISION_WEIGHTS
    assert wire["low_precision_weights_gathered_locally"] == len(replicated)  # (W, 1) mesh: no collective
    assert wire["all_reduce_bytes"]["float32"] > 0  # HSDP all-reduce of the replicated weights' gradients
    events = json.loads((Path(summary["root"]) / "wire_trace_rank0.json").read_text())["events"]
    local = {e["fqn"] for e in events if e["kind"] == "weight_gather_local"}
    assert local == replicated
    for event in events:
        if event["kind"] == "all_gather":  # the split of a buffer adds up to the buffer
            assert sum(event["bytes_by_dtype"].values()) == event["bytes"], event
            assert not set(event["low_precision_fqns"]) & replicated
    for rank in (0, 1):
        facts = json.loads((Path(summary["root"]) / "probe" / f"probe_rank{rank}.json").read_text())
        assert {fqn for fqn, _ in facts["parallelization"]["replicated_low_precision"]} == replicated
        for name, p in facts["params"].items():
            if name in replicated:  # HSDP (W, 1): full copy on every rank, gradients all-reduced
                assert p["mesh_dim_names"] == ["dp_replicate", "dp_shard"] and p["local_shape"] == [96, 192], name
            else:
                assert p["mesh_dim_names"] == ["dp_shard"], name
