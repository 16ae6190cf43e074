"""End to end through the CLI in fresh processes: 2-process FSDP2, parity, bitwise resume, outputs.

Runs (each a new ``lp-lightning fit`` process tree, dsv3-tiny, 4 x 64 tokens per step):

* ``two_proc``: ``--trainer.devices 2``, 4 steps, checkpoints at steps 2 and 4 (spawned from the
  console script when it is installed, as a user would run it);
* ``one_proc``: the same global batches in one process;
* ``two_proc_resumed``: a fresh 2-process run from ``two_proc``'s step-2 checkpoint;
* ``stopped`` then ``stopped_resumed``: one process stops at ``max_steps=2`` (same LR horizon via
  ``--model.lr_decay_steps 4``), a fresh process resumes it to step 4.

Tolerance of the 1- vs 2-process comparison (measured: step-1 losses equal to 7e-8 relative, then
up to 1.0e-3 on the losses and 1.5e-3 on the gradient norms by step 4): both runs compute every row's forward with the same BF16 kernels, but the weight
gradient GEMMs reduce over different token sets per rank (all 256 tokens vs 2 x 128) and round
their outputs to BF16 before the FP32 reduce-scatter, so gradients differ by O(u), u = 2**-8 the
BF16 unit roundoff; AdamW turns that into O(u * lr) weight differences and the following losses
differ by a small multiple of u. We assert rtol = 2u on losses and 8u on gradient norms (a norm of
gradients that differ element-wise by O(u)).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lp_lightning.checkpoint.dcp import checkpoint_tensor_keys

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BF16_UNIT_ROUNDOFF = 2.0**-8
SUMMARY_KEYS = {
    "precision": str, "backend": str, "world_size": int, "steps": int, "tokens": int, "loss_first": float,
    "loss_last": float, "val_loss_last": float, "tokens_per_s": float, "step_time_s_median": float,
    "peak_memory_bytes": int, "checkpoints": list, "versions": dict,
}


def _fit_command(root: Path, cache_dir: str, *options: str) -> list[str]:
    """``python -m lp_lightning.cli fit`` on the tiny config into ``root``, quiet, plus ``options``."""
    return [
        sys.executable, "-m", "lp_lightning.cli", "fit", "--config", str(REPO / "configs" / "dsv3_tiny.yaml"),
        "--trainer.default_root_dir", str(root), "--data.cache_dir", cache_dir,
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false", *options,
    ]  # fmt: skip


def _run(root: Path, cache_dir: str, *extra: str, console_script: bool = False) -> dict:
    command = _fit_command(
        root, cache_dir, "--data.seq_len", "64", "--data.global_batch_size", "4", "--data.val_batches", "1",
        "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--checkpoint.every_n_steps", "2",
        "--model.warmup_steps", "2", "--model.lr_decay_steps", "4",
        "--trainer.callbacks+=_probes.ShardingProbe", f"--trainer.callbacks.out_dir={root / 'probe'}", *extra,
    )  # fmt: skip
    script = shutil.which("lp-lightning", path=str(Path(sys.executable).parent))
    if console_script and script:
        command = [script, *command[3:]]  # as a user types it: lp-lightning fit ...
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
    proc = subprocess.run(command, cwd=root.parent, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((root / "run_summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory, token_cache_dir):
    base = tmp_path_factory.mktemp("e2e")
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            root = base / name
            if name == "two_proc":
                cache[name] = _run(root, token_cache_dir, "--trainer.devices", "2", console_script=True)
            elif name == "one_proc":
                cache[name] = _run(root, token_cache_dir)
            elif name == "two_proc_resumed":
                ckpt = base / "two_proc" / "checkpoints" / "step-000002"
                get("two_proc")
                cache[name] = _run(root, token_cache_dir, "--trainer.devices", "2", "--ckpt_path", str(ckpt))
            elif name == "stopped":
                cache[name] = _run(root, token_cache_dir, "--trainer.max_steps", "2")
            elif name == "stopped_resumed":
                get("stopped")
                ckpt = base / "stopped" / "checkpoints" / "step-000002"
                cache[name] = _run(root, token_cache_dir, "--ckpt_path", str(ckpt))
            cache[name]["root"] = str(root)
        return cache[name]

    return get


def test_two_processes_shard_every_parameter_over_the_dp_mesh(runs):
    summary = runs("two_proc")
    assert summary["world_size"] == 2 and summary["steps"] == 4
    for rank in (0, 1):
        facts = json.loads((Path(summary["root"]) / "probe" / f"probe_rank{rank}.json").read_text())
        assert facts["world_size"] == 2
        assert facts["parallelization"]["mesh_shape"] == [2]
        assert facts["parallelization"]["steps"] == ["convert_module", "upcast_fp32", "fully_shard"]
        for name, p in facts["params"].items():
            assert p["dtensor"] and p["dtype"] == "torch.float32", name
            assert p["placements"] == ["Shard(dim=0)"] and p["mesh_shape"] == [2], name
            assert p["mesh_dim_names"] == ["dp_shard"], name
            rows = p["global_shape"][0]
            assert p["local_shape"][0] == (rows + 1) // 2 if rank == 0 else rows - (rows + 1) // 2, name
        assert "model.layers.1.mlp.experts.gate_up_proj" in facts["state_dict_keys"]


def test_two_process_losses_match_one_process(runs):
    two, one = runs("two_proc"), runs("one_proc")
    assert one["world_size"] == 1 and len(one["losses"]) == len(two["losses"]) == 4
    assert two["losses"] == pytest.approx(one["losses"], rel=2 * BF16_UNIT_ROUNDOFF, abs=0)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=8 * BF16_UNIT_ROUNDOFF, abs=0)
    assert two["tokens"] == one["tokens"] == 4 * 4 * 64
    assert one["loss_last"] < one["loss_first"]


def test_two_process_resume_is_bitwise(runs):
    continuous, resumed = runs("two_proc"), runs("two_proc_resumed")
    assert resumed["first_step"] == 2 and resumed["global_step"] == 4
    assert resumed["losses"] == continuous["losses"][2:]
    assert resumed["grad_norms"] == continuous["grad_norms"][2:]


def test_stop_then_resume_in_a_fresh_process_is_bitwise(runs):
    continuous, stopped, resumed = runs("one_proc"), runs("stopped"), runs("stopped_resumed")
    assert stopped["losses"] == continuous["losses"][:2]
    assert resumed["first_step"] == 2 and resumed["steps"] == 2
    assert resumed["losses"] == continuous["losses"][2:]
    assert resumed["grad_norms"] == continuous["grad_norms"][2:]
    assert resumed["val_loss_last"] == continuous["val_loss_last"]


def test_checkpoint_folder_holds_hf_keys_fp32_optimizer_and_position(runs):
    summary = runs("two_proc")
    root = Path(summary["root"])
    assert summary["checkpoints"] == [str(root / "checkpoints" / f"step-00000{s}") for s in (2, 4)]
    path = root / "checkpoints" / "step-000002"
    keys = checkpoint_tensor_keys(path)
    model_keys = {k for k in keys if not k.startswith("optimizer.")}
    assert {"model.embed_tokens.weight", "model.layers.0.mlp.gate_proj.weight",
            "model.layers.2.mlp.experts.down_proj", "lm_head.weight"} <= model_keys
    assert not any(k.startswith(("model.model.", "state_dict.")) or "_checkpoint_wrapped" in k for k in keys)
    prefix, suffix = "optimizer.state.", ".exp_avg"
    param_fqns = {k[len(prefix):-len(suffix)] for k in keys if k.startswith(prefix) and k.endswith(suffix)}
    # Every model key is a Parameter with FP32 AdamW moments, except the router's bias buffers.
    assert {k for k in model_keys - param_fqns if not k.endswith("mlp.gate.e_score_correction_bias")} == set()
    assert "lm_head.weight" in param_fqns and param_fqns <= model_keys
    for fqn in model_keys:
        assert keys[fqn].properties.dtype == torch.float32, fqn
    for fqn in param_fqns:
        for moment in ("exp_avg", "exp_avg_sq"):
            assert keys[f"{prefix}{fqn}.{moment}"].properties.dtype == torch.float32, fqn
        assert f"{prefix}{fqn}.step" in keys
    meta = torch.load(path / "meta.pt", weights_only=False)
    assert meta["global_step"] == 2
    (loader_state,) = meta["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert loader_state["next_micro_index"] == 2
    assert meta["lr_schedulers"][0]["last_epoch"] == 2
    assert meta["BF16Plugin"] == {"mode": "bf16", "optimizer_steps_applied": 2, "optimizer_steps_skipped": 0,
                                         "consecutive_skips": 0}


def test_run_summary_contract(runs):
    summary = runs("one_proc")
    for key, kind in SUMMARY_KEYS.items():
        assert isinstance(summary[key], kind), (key, summary[key])
    assert summary["precision"] == "bf16" and summary["backend"] == "none"
    assert summary["peak_memory_bytes"] > 0 and summary["tokens_per_s"] > 0
    versions = summary["versions"]
    assert set(versions) == {"lp_lightning", "git_commit", "python", "torch", "torch_npu", "cann", "lightning",
                             "transformers"}
    assert versions["torch"] == torch.__version__ and len(versions["git_commit"] or "x" * 40) >= 40
    assert versions["torch_npu"] is None and versions["cann"] is None  # not installed here
    assert all(Path(p).is_dir() for p in summary["checkpoints"])
    losses, times = summary["losses"], summary["step_times_s"]
    assert summary["loss_last_mean_steps"] == min(10, len(losses))
    assert summary["loss_last_mean"] == pytest.approx(sum(losses[-10:]) / len(losses[-10:]), rel=1e-12)
    warmup = summary["warmup_steps_excluded"]
    assert warmup == min(5, len(times) - 1)
    assert summary["step_time_s_steady_median"] == statistics.median(times[warmup:])
    # tokens/s is the steady rate: the warm-up steps are left out, as in step_time_s_steady_median
    steady_rate = summary["tokens"] / summary["steps"] / summary["step_time_s_steady_median"]
    assert summary["tokens_per_s"] == pytest.approx(steady_rate, rel=1e-12)
    threads = summary["threads"]
    assert threads["torch_intra_op"] >= 1 and threads["cpu_count"] == os.cpu_count()
    if os.environ.get("OMP_NUM_THREADS"):  # the user's choice is kept
        assert threads["set_by"] == "user" and threads["OMP_NUM_THREADS"] == os.environ["OMP_NUM_THREADS"]
    else:  # fit on CPU chose one thread per process (docs/performance.md "Threads")
        assert threads["set_by"] == "lp-lightning default"
        assert threads["torch_intra_op"] == 1 and threads["OMP_NUM_THREADS"] == "1"
    # hccl: None off the npu accelerator (docs/hccl.md)
    assert summary["determinism"] == {"algorithms": True, "fill_uninitialized_memory": False, "hccl": None}
    assert len(summary["load_average"]["start"]) == len(summary["load_average"]["end"]) == 3
    assert (Path(summary["root"]) / "logs" / "version_0" / "metrics.csv").is_file()


def test_sigterm_saves_the_last_step_exits_143_and_resumes(tmp_path, token_cache_dir):
    """A preempted run (SIGTERM) saves its last completed step, exits with 128 + 15 and a resume
    hint, leaves only complete checkpoint folders, and `--ckpt_path last` continues from there."""
    import signal
    import time

    from lp_lightning.checkpoint.dcp import verify_dcp_checkpoint

    root = tmp_path / "sigterm"
    args = _fit_command(
        root, token_cache_dir, "--data.seq_len", "64", "--data.global_batch_size", "4", "--data.val_batches", "1",
        "--checkpoint.every_n_steps", "2", "--trainer.accumulate_grad_batches", "2",
    )  # fmt: skip
    proc = subprocess.Popen([*args, "--trainer.max_steps", "1000"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    checkpoints = root / "checkpoints"
    deadline = time.monotonic() + 300
    while not (checkpoints / "step-000002").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    time.sleep(3)  # into the next steps, possibly mid-accumulation
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "stopped early by SIGTERM" in stderr and "--ckpt_path last" in stderr
    folders = sorted(p.name for p in checkpoints.iterdir())
    assert all(name.startswith("step-") for name in folders), folders  # no .partial left visible
    steps = [verify_dcp_checkpoint(checkpoints / name, weights_only=False)["global_step"] for name in folders]
    assert steps == [int(name[5:]) for name in folders]
    last = steps[-1]
    if last % 2:  # not a periodic save: the SIGTERM save of the last completed step
        assert f"SIGTERM: saved the checkpoint of step {last}" in stdout + stderr
    resumed = subprocess.run([*args, "--trainer.max_steps", str(last + 1), "--ckpt_path", "last"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((root / "run_summary.json").read_text())
    assert summary["first_step"] == last and summary["global_step"] == last + 1


def test_fresh_run_into_a_folder_with_old_checkpoints_stops_or_warns_and_max_steps_below_the_checkpoint_fails(
    tmp_path, token_cache_dir
):
    root = tmp_path / "reuse"
    args = _fit_command(
        root, token_cache_dir, "--data.seq_len", "32", "--data.global_batch_size", "2", "--data.val_batches", "1",
        "--checkpoint.every_n_steps", "1", "--trainer.val_check_interval", "1000",
    )  # fmt: skip
    first = subprocess.run([*args, "--trainer.max_steps", "2"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    refused = subprocess.run([*args, "--trainer.max_steps", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "already holds another run's checkpoints" in refused.stderr  # before training
    again = subprocess.run([*args, "--trainer.max_steps", "1", "--overwrite", "true"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already holds checkpoints of an earlier run (step-000001, step-000002)" in again.stderr
    behind = subprocess.run([*args, "--trainer.max_steps", "1", "--ckpt_path", str(root / "checkpoints" / "step-000002")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert behind.returncode != 0
    assert "the restored checkpoint is at step 2, not below trainer.max_steps=1: nothing to train" in behind.stderr
