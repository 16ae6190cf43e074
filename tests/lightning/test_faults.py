"""Fault injection through the CLI, each fault in fresh ``lp-lightning fit`` processes (issue 13 item 5).

dsv3-tiny, 2 x 32 tokens per step, a checkpoint after every step, 3-5 steps per run
(``tests/lightning/_faults.py`` injects the faults):

* NaN in one batch: that step is skipped, the run finishes, ``run_summary.json`` reports it;
* NaN in ``nonfinite.max_consecutive_skips`` batches in a row: the run stops (exit 1, one line: step,
  skip count, reason, first FQN, last good checkpoint), nothing saved after the last good step;
* Inf written into a master (the embedding) before a step: the run stops at that step, nothing is
  saved from the non-finite state, ``--ckpt_path last`` resumes the last good checkpoint; written
  just before a checkpoint: that checkpoint is refused, the run stops;
* 4 KiB of a shard overwritten with 0xFF: ``--ckpt_path last`` skips the folder naming the file and
  resumes the previous one (losses equal to the uninterrupted run's); the explicit path fails before
  training, naming the file and the last good checkpoint. Also on 2 processes (the digests are
  checked spread over the ranks).

A truncated ``.metadata`` is found at launch (``tests/test_cli.py::test_ckpt_path_last_and_the_parent_folder``),
corrupted and truncated files on load in ``tests/checkpoint/test_dcp.py``; the SIGKILL-during-save
case (a save killed before its rename) in ``test_save_is_atomic_and_overwrites_in_place`` there, SIGTERM in
``tests/lightning/test_fit_e2e.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from test_fit_e2e import REPO, _fit_command

from lp_lightning.checkpoint.dcp import DIGESTS_FILENAME, verify_dcp_checkpoint

pytestmark = pytest.mark.slow

EMBED = "model.embed_tokens.weight"
POISON = "--trainer.callbacks+=_faults.PoisonBatches"
INF = "--trainer.callbacks+=_faults.InfIntoMaster"


def _fit(root: Path, cache_dir: str, *options: str, returncode: int = 0) -> tuple[subprocess.CompletedProcess, dict]:
    """One CLI run into ``root`` (checkpoint every step); returns the process and its run summary ({} if none)."""
    command = _fit_command(
        root, cache_dir, "--data.seq_len", "32", "--data.global_batch_size", "2", "--data.val_batches", "1",
        "--checkpoint.every_n_steps", "1", "--trainer.val_check_interval", "1000", "--model.warmup_steps", "1",
        "--model.lr_decay_steps", "5", *options,
    )  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(Path(__file__).parent), env.get("PYTHONPATH")]))
    summary_file = root / "run_summary.json"
    summary_file.unlink(missing_ok=True)  # a resumed run writes its own
    proc = subprocess.run(command, cwd=root.parent, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == returncode, proc.stderr[-6000:]
    return proc, json.loads(summary_file.read_text()) if summary_file.is_file() else {}


def _steps_on_disk(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "checkpoints").iterdir())


def _overwrite_4k(path: Path, shard: str) -> None:
    """0xFF over 4 KiB in the middle of the largest tensor DCP wrote into ``shard`` (same size, other bytes)."""
    items = dcp.FileSystemReader(str(path)).read_metadata().storage_data.values()
    infos = [i for i in items if i.relative_path == shard]
    info = max(infos, key=lambda i: int(i.length))
    with open(path / shard, "r+b") as stream:
        stream.seek(int(info.offset) + int(info.length) // 2)
        stream.write(b"\xff" * 4096)


def _stderr_line(proc: subprocess.CompletedProcess) -> str:
    """The run's last ``lp-lightning: `` line: the one it ended with (the model summary, and the run summary's
    line of a stopped run, come before it)."""
    return [line for line in proc.stderr.splitlines() if line.startswith("lp-lightning: ")][-1]


def test_nan_in_one_batch_skips_that_step_and_the_run_finishes(tmp_path, token_cache_dir):
    root = tmp_path / "nan_once"
    _, summary = _fit(root, token_cache_dir, "--trainer.max_steps", "4", POISON, "--trainer.callbacks.steps=2")
    assert summary["global_step"] == 4 and summary["losses"][1] != summary["losses"][1]  # NaN on step 2 only
    assert all(loss == loss for i, loss in enumerate(summary["losses"]) if i != 1)
    assert summary["nonfinite"] == {
        "max_consecutive_skips": 3, "skipped_steps": 1, "consecutive_skips": 0, "stopped": None,
        "skips": [{"step": 2, "reason": "non-finite gradient", "fqn": EMBED}],
    }
    assert _steps_on_disk(root) == [f"step-00000{s}" for s in (1, 2, 3, 4)]  # the skipped step's state is finite


def test_nan_batches_in_a_row_stop_the_run_at_the_limit(tmp_path, token_cache_dir):
    root = tmp_path / "nan_streak"
    proc, summary = _fit(root, token_cache_dir, "--trainer.max_steps", "5", "--nonfinite.max_consecutive_skips", "2",
                         POISON, "--trainer.callbacks.steps=2,3", returncode=1)
    good = str(root / "checkpoints" / "step-000002")
    assert _stderr_line(proc) == (
        f"lp-lightning: training stopped at step 3: 2 optimizer steps skipped in a row (non-finite gradient "
        f"('{EMBED}')), nonfinite.max_consecutive_skips=2. Lower --model.lr, check the data, or raise the limit. "
        f"Last good checkpoint: {good!r} (--ckpt_path last resumes it)."
    )
    assert "Traceback" not in proc.stderr
    assert _steps_on_disk(root) == ["step-000001", "step-000002"]  # nothing after the stop
    stopped = summary["nonfinite"]["stopped"]
    assert (stopped["step"], stopped["reason"], stopped["fqn"], stopped["consecutive_skips"]) == (
        3, "non-finite gradient", EMBED, 2)
    assert stopped["resume_checkpoint"] == good and summary["nonfinite"]["skipped_steps"] == 2


def test_inf_in_a_master_stops_the_run_saves_nothing_from_it_and_last_resumes_the_last_good(tmp_path, token_cache_dir):
    root = tmp_path / "inf"
    proc, summary = _fit(root, token_cache_dir, "--trainer.max_steps", "5", INF, "--trainer.callbacks.step=2",
                         returncode=1)
    line = _stderr_line(proc)
    assert line.startswith(f"lp-lightning: training stopped at step 3: non-finite master weight ('{EMBED}')")
    assert line.endswith(f"Last good checkpoint: {str(root / 'checkpoints' / 'step-000002')!r} "
                         "(--ckpt_path last resumes it).")
    assert _steps_on_disk(root) == ["step-000001", "step-000002"]
    for name in _steps_on_disk(root):  # every folder on disk was saved finite and verifies
        assert json.loads((root / "checkpoints" / name / DIGESTS_FILENAME).read_text())["finite"] is True
        verify_dcp_checkpoint(root / "checkpoints" / name, weights_only=False)
    assert summary["nonfinite"]["stopped"]["reason"] == "non-finite master weight"
    _, resumed = _fit(root, token_cache_dir, "--trainer.max_steps", "3", "--ckpt_path", "last")
    assert resumed["first_step"] == 2 and resumed["global_step"] == 3 and resumed["nonfinite"]["skips"] == []
    assert resumed["losses"][0] == resumed["losses"][0]


def test_inf_in_a_master_before_a_checkpoint_refuses_that_checkpoint(tmp_path, token_cache_dir):
    root = tmp_path / "inf_at_save"
    proc, summary = _fit(root, token_cache_dir, "--trainer.max_steps", "5", INF, "--trainer.callbacks.step=2",
                         "--trainer.callbacks.when=end", returncode=1)
    assert _stderr_line(proc) == (
        f"lp-lightning: checkpoint step-000002 not written: '{EMBED}' holds NaN/Inf, and a checkpoint is never "
        f"written from a non-finite state (the ones on disk are kept). Last good checkpoint: "
        f"{str(root / 'checkpoints' / 'step-000001')!r} (--ckpt_path last resumes it)."
    )
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["step-000001"]  # no .partial either
    stopped = summary["nonfinite"]["stopped"]
    assert (stopped["step"], stopped["reason"], stopped["fqn"]) == (2, "non-finite state at checkpoint save", EMBED)


def test_corrupted_shard_bytes_last_skips_the_folder_and_an_explicit_path_fails(tmp_path, token_cache_dir):
    root = tmp_path / "corrupt"
    _, continuous = _fit(root, token_cache_dir, "--trainer.max_steps", "3")
    damaged = root / "checkpoints" / "step-000003"
    _overwrite_4k(damaged, "__0_0.distcp")
    previous = str(root / "checkpoints" / "step-000002")
    problem = "file '__0_0.distcp' does not match its SHA-256 digest (its bytes changed after the save)"
    explicit, nothing = _fit(root, token_cache_dir, "--trainer.max_steps", "4", "--ckpt_path", str(damaged),
                             returncode=1)
    assert _stderr_line(explicit) == (
        f"lp-lightning: checkpoint {str(damaged)!r} is damaged: {problem}; the last good checkpoint is {previous!r}: "
        "resume from it (or pass --ckpt_path last)."
    )
    assert nothing == {} and _steps_on_disk(root) == ["step-000001", "step-000002", "step-000003"]  # no step ran
    proc, resumed = _fit(root, token_cache_dir, "--trainer.max_steps", "4", "--ckpt_path", "last")
    assert f"ckpt_path=last skips {str(damaged)!r} ({problem}); trying the previous one." in proc.stderr
    # The product's line is the last word on what was loaded: Lightning's "Restored all states" naming the
    # damaged folder it was given is dropped.
    assert f"ckpt_path=last: loaded {previous!r} instead of the damaged {str(damaged)!r}." in proc.stderr
    assert "Restored all states" not in proc.stderr
    assert resumed["first_step"] == 2 and resumed["global_step"] == 4
    assert resumed["losses"][0] == continuous["losses"][2]  # step 3 again, from step 2's state: bitwise equal


def test_two_processes_skip_a_nan_on_one_rank_and_last_skips_a_corrupted_shard_of_the_other(tmp_path, token_cache_dir):
    root = tmp_path / "two"
    two = ["--trainer.devices", "2"]
    _, first = _fit(root, token_cache_dir, *two, "--trainer.max_steps", "3", POISON, "--trainer.callbacks.steps=2",
                    "--trainer.callbacks.ranks=1")
    assert first["world_size"] == 2 and first["nonfinite"]["skips"] == [
        {"step": 2, "reason": "non-finite gradient", "fqn": EMBED}]
    damaged = root / "checkpoints" / "step-000003"
    record = json.loads((damaged / DIGESTS_FILENAME).read_text())
    assert set(record["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"}  # both ranks' shards
    _overwrite_4k(damaged, "__1_0.distcp")
    proc, resumed = _fit(root, token_cache_dir, *two, "--trainer.max_steps", "4", "--ckpt_path", "last")
    skipped = f"ckpt_path=last skips {str(damaged)!r} (file '__1_0.distcp' does not match its SHA-256 digest"
    assert skipped in proc.stderr
    assert resumed["first_step"] == 2 and resumed["losses"][0] == first["losses"][2]
