"""Run folders (issue 23): one default folder per precision, no run written over another, ``validate --ckpt_path last``.

The README's sequence in miniature (the ``slow`` tests, about 30 s), in subprocesses from one working
folder with the default ``trainer.default_root_dir`` (2 steps of 2 x 32 tokens each): a bf16 fit, an
mxfp8 fit, then ``validate --ckpt_path last`` on the finished bf16 run. The refusals are checked
in-process (they happen while parsing, before anything is built).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lp_lightning.models.deepseek_v3 as deepseek_v3
from lp_lightning.cli import main
from lp_lightning.cli.fit import LPLightningCLI, parse_config
from lp_lightning.cli.launch import check_launch

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--data.seq_len", "32", "--data.global_batch_size", "2", "--data.val_batches", "1",
         "--trainer.max_steps", "2", "--checkpoint.every_n_steps", "1", "--trainer.val_check_interval", "1000",
         "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]  # fmt: skip
VAL_LOSS = re.compile(r"val/loss\s*[│|]?\s*([0-9.]+)")  # Lightning's results table, rich or plain


def _cli(cwd: Path, cache_dir: str, subcommand: str, *options: str) -> subprocess.CompletedProcess:
    """``python -m lp_lightning.cli <subcommand> --config configs/dsv3_tiny.yaml`` in ``cwd``, small, plus ``options``."""
    command = [sys.executable, "-m", "lp_lightning.cli", subcommand, "--config", str(REPO / "configs" / "dsv3_tiny.yaml"),
               "--data.cache_dir", cache_dir, *SMALL, *options]  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def readme_runs(tmp_path_factory, token_cache_dir) -> Path:
    """A working folder after ``fit`` (bf16) then ``fit --precision mxfp8``, both with the default folder."""
    cwd = tmp_path_factory.mktemp("readme")
    for precision in ("bf16", "mxfp8"):
        proc = _cli(cwd, token_cache_dir, "fit", "--precision", precision)
        assert proc.returncode == 0, proc.stderr[-4000:]
    return cwd


@pytest.fixture
def no_model_build(monkeypatch):
    calls = []
    monkeypatch.setattr(deepseek_v3, "from_hf_config", lambda *a, **k: calls.append(a))
    return calls


def test_the_default_folder_names_the_precision():
    assert [parse_config(["--precision", p]).trainer.default_root_dir for p in ("bf16", "mxfp8", "hif8")] == [
        "runs/dsv3_tiny/bf16", "runs/dsv3_tiny/mxfp8", "runs/dsv3_tiny/hif8"]
    assert parse_config(["--trainer.default_root_dir", "out/{precision}/a", "--precision", "hif8"]).trainer.default_root_dir \
        == "out/hif8/a"
    assert parse_config(["--trainer.default_root_dir", "mine", "--precision", "hif8"]).trainer.default_root_dir == "mine"


@pytest.mark.slow
def test_each_precision_keeps_its_run_and_a_rerun_stops(readme_runs, monkeypatch, capsys, no_model_build):
    runs = readme_runs / "runs" / "dsv3_tiny"
    assert sorted(p.name for p in runs.iterdir()) == ["bf16", "mxfp8"]
    for precision in ("bf16", "mxfp8"):
        assert sorted(p.name for p in (runs / precision / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
        assert f'"precision": "{precision}"' in (runs / precision / "run_summary.json").read_text()
    monkeypatch.chdir(readme_runs)  # the README's first command again, from the same folder: stopped at launch
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(REPO / "configs" / "dsv3_tiny.yaml")])
    assert exc.value.code == 2 and no_model_build == []
    assert "'runs/dsv3_tiny/bf16/checkpoints' already holds another run's checkpoints" in capsys.readouterr().err


@pytest.mark.slow
def test_validate_last_after_a_finished_run_prints_a_validation_loss(readme_runs, token_cache_dir):
    """The README's `validate --ckpt_path last`: the newest checkpoint of the finished bf16 run, weights only."""
    proc = _cli(readme_runs, token_cache_dir, "validate", "--ckpt_path", "last")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert VAL_LOSS.search(proc.stdout) and float(VAL_LOSS.search(proc.stdout).group(1)) > 0, proc.stdout[-2000:]
    newest = Path("runs") / "dsv3_tiny" / "bf16" / "checkpoints" / "step-000002"
    assert f"Loaded model weights from the checkpoint at {newest}" in out
    assert "nothing to do" not in out and "AdamW" not in out and "resuming" not in out
    # A checkpoint of another precision (the mxfp8 run's, here in bf16): no resume note of a training run either.
    other = _cli(readme_runs, token_cache_dir, "validate", "--ckpt_path", "runs/dsv3_tiny/mxfp8/checkpoints/step-000002")
    assert other.returncode == 0, (other.stdout + other.stderr)[-4000:]
    assert VAL_LOSS.search(other.stdout) and "AdamW" not in other.stdout + other.stderr


def _fake_run(root: Path) -> Path:
    """Two tiny checkpoint folders (written by the function training uses) and a run summary."""
    import torch

    from lp_lightning.checkpoint.dcp import save_dcp_checkpoint

    for step in (1, 2):
        save_dcp_checkpoint(root / "checkpoints" / f"step-00000{step}", model_state={"w": torch.ones(64)},
                            optimizer_states={}, metadata={}, rank=0)
    (root / "run_summary.json").write_text('{"global_step": 2}')
    return root


def test_a_new_run_into_another_runs_checkpoints_stops_before_training(tmp_path, capsys, no_model_build):
    root = _fake_run(tmp_path / "run")
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--trainer.default_root_dir", str(root)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and no_model_build == []
    assert (f"{str(root / 'checkpoints')!r} already holds another run's checkpoints (step-000001, step-000002) and "
            "run_summary.json") in err
    assert "--ckpt_path last" in err and "--overwrite true" in err and "Traceback" not in err
    assert (root / "run_summary.json").read_text() == '{"global_step": 2}'
    # Saying what to do lets it through: resume (here: nothing to do), or --overwrite true; validate never stops.
    assert main(["fit", "--trainer.default_root_dir", str(root), "--trainer.max_steps", "2", "--ckpt_path", "last"]) == 0
    for subcommand, options in (("fit", ["--overwrite", "true"]), ("validate", [])):
        section = parse_config(["--trainer.default_root_dir", str(root), *options])
        check_launch(section, subcommand=subcommand)
    # validate --ckpt_path last on the finished run (step 2 = max_steps): that checkpoint, not "nothing to do".
    section = parse_config(["--trainer.default_root_dir", str(root), "--trainer.max_steps", "2"])
    section["ckpt_path"] = "last"
    check_launch(section, subcommand="validate")
    assert section["ckpt_path"] == str(root / "checkpoints" / "step-000002")
    assert no_model_build == []


@pytest.mark.slow
def test_overwrite_true_trains_over_the_other_run(readme_runs, tmp_path, token_cache_dir):
    root = tmp_path / "bf16"
    shutil.copytree(readme_runs / "runs" / "dsv3_tiny" / "bf16", root)
    proc = _cli(tmp_path, token_cache_dir, "fit", "--trainer.default_root_dir", str(root), "--trainer.max_steps", "1",
                "--overwrite", "true")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "already holds checkpoints of an earlier run (step-000001, step-000002)" in proc.stderr  # the run's warning
    assert '"global_step": 1' in (root / "run_summary.json").read_text()


def test_overwrite_reaches_the_cli_and_validate_last_without_checkpoints_exits_2(tmp_path, capsys, no_model_build):
    class Resolved(LPLightningCLI):
        def _run_subcommand(self, subcommand: str) -> None:  # parse, build the Trainer, do not run
            pass

    (tmp_path / "checkpoints" / "step-000001").mkdir(parents=True)
    assert Resolved(args=["fit", "--trainer.default_root_dir", str(tmp_path), "--overwrite", "true"]).config.fit.overwrite
    with pytest.raises(SystemExit) as exc:
        main(["validate", "--trainer.default_root_dir", str(tmp_path / "empty"), "--ckpt_path", "last"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "no complete checkpoint under" in err and "nothing to validate" in err
