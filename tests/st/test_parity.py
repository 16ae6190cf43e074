"""The parity figures (lp_lightning.st.parity) and benchmarks/parity.py end to end (issue 25).

The figures are checked on synthetic runs whose gaps are known; the script runs its real CLI fits on
a tiny setting (width 256, 6 steps, one seed, the Shakespeare corpus) and writes the JSON, the plot and
the table between its markers.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lp_lightning.st import parity

REPO = Path(__file__).resolve().parents[2]


def _run(losses, val=()):
    return parity.ParityRun(tuple(losses), tuple(val), Path("."))


def test_gaps_are_in_percent_of_bf16_and_in_units_of_the_noise_floor():
    base = [4.0] * 100
    runs = {}
    for seed, noise in ((0, 1.002), (1, 0.998)):  # the bf16 noise run is ±0.2 % off its baseline
        runs[(seed, "bf16")] = _run(base, [(50, 5.0), (100, 4.0)])
        runs[(seed, parity.NOISE_VARIANT)] = _run([v * noise for v in base], [(50, 5.0), (100, 4.0 * noise)])
        runs[(seed, "mxfp8")] = _run([4.0] * 50 + [4.04] * 50, [(50, 5.0), (100, 4.1)])  # +1 % late, val +2.5 %
    result = parity.analyse(runs, last=50, window=50)
    floor = result["noise_floor"]
    assert floor["train_pct"] == pytest.approx(0.2) and floor["val_pct"] == pytest.approx(0.2) and floor["seeds"] == 2
    row = result["per_seed"]["0"]["mxfp8"]
    assert row["train_gap_pct"] == pytest.approx(1.0) and row["val_gap_pct"] == pytest.approx(2.5)
    assert row["train_noise_units"] == pytest.approx(5.0) and row["val_noise_units"] == pytest.approx(12.5)
    assert row["window_gap_pct"] == [0.0, 1.0]  # the gap opened in the second window
    assert row["val_gap_pct_by_step"] == {"50": 0.0, "100": 2.5}
    overall = result["overall"]["mxfp8"]
    assert overall["train_gap_pct_worst"] == pytest.approx(1.0) and overall["within_pct"] is False  # val 2.5 % > 2 %
    assert result["overall"][parity.NOISE_VARIANT]["within_pct"] is True
    assert list(result["overall"]) == ["mxfp8", parity.NOISE_VARIANT]
    table = parity.markdown({**result, "settings": {"width": 512, "steps": 100, "seeds": [0, 1]}})
    assert "| seed | run | train last-50 |" in table
    assert "| 0 | mxfp8 | 4.0400 | +1.00 | +5.0 | 4.1000 | +2.50 | +12.5 | +0.00 +1.00 |" in table
    assert "| mxfp8 | 2 | +1.00 ± 0.00 (+1.00) | +5.00 | +2.50 ± 0.00 (+2.50) | +12.50 | no |" in table


def test_a_seed_without_its_baseline_or_of_another_length_is_refused():
    with pytest.raises(ValueError, match="seed 3: no bf16 run"):
        parity.analyse({(3, "mxfp8"): _run([1.0] * 10)}, last=5)
    with pytest.raises(ValueError, match="mxfp8 has 9 steps, bf16 10"):
        parity.analyse({(0, "bf16"): _run([1.0] * 10), (0, "mxfp8"): _run([1.0] * 9)}, last=5)


def test_a_run_folder_gives_its_losses_and_every_validation(tmp_path):
    (tmp_path / "logs" / "version_1").mkdir(parents=True)
    (tmp_path / "run_summary.json").write_text(json.dumps({"losses": [3.0, None, 2.0], "val_loss_last": 2.5}))
    with open(tmp_path / "logs" / "version_1" / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["step", "train/loss", "val/loss"])
        writer.writeheader()
        writer.writerows([{"step": 0, "train/loss": 3.0}, {"step": 1, "val/loss": 2.7}, {"step": 2, "val/loss": 2.5}])
    run = parity.load_parity_run(tmp_path)
    assert run.losses[0] == 3.0 and math.isnan(run.losses[1]) and run.val == ((2, 2.7), (3, 2.5))  # 1-based steps
    with pytest.raises(FileNotFoundError, match="did not finish"):
        parity.load_parity_run(tmp_path / "missing")


@pytest.mark.slow
def test_the_parity_script_runs_its_fits_and_writes_json_plot_and_table(tmp_path, token_cache_dir):
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- parity:begin -->\nold\n<!-- parity:end -->\nrest\n")
    command = [sys.executable, str(REPO / "benchmarks" / "parity.py"), "--width", "256", "--steps", "6", "--last", "3",
               "--seeds", "0", "--val-every", "3", "--window", "3", "--val-batches", "1", "--fit-arg=--data.seq_len=32",
               f"--fit-arg=--data.cache_dir={tmp_path / 'tokens'}",
               "--work-dir", str(tmp_path / "runs"), "--results", str(tmp_path / "parity.json"),
               "--plot", str(tmp_path / "parity.png"), "--doc", str(doc), "--corpus-cache", str(tmp_path / "cache")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == json.loads((tmp_path / "parity.json").read_text())
    assert set(result["per_seed"]["0"]) == {"bf16", "mxfp8", "hif8", parity.NOISE_VARIANT}
    assert set(result["overall"]) == {"mxfp8", "hif8", parity.NOISE_VARIANT}
    for name in ("mxfp8", "hif8"):
        row = result["per_seed"]["0"][name]
        assert abs(row["train_gap_pct"]) < 5 and abs(row["val_gap_pct"]) < 5 and len(row["window_gap_pct"]) == 2
    assert set(result["runs"]) == {f"seed0/{n}" for n in ("bf16", "mxfp8", "hif8", parity.NOISE_VARIANT)}
    assert all(r["load_average_start"] is not None and r["threads"]["OMP_NUM_THREADS"] == "1"
               for r in result["runs"].values())
    assert "shakespeare" in result["settings"]["corpus"] and result["settings"]["noise"] == "eps"
    noise_command = (tmp_path / "runs" / "seed0" / parity.NOISE_VARIANT / "command.txt").read_text()
    assert "--model.eps 1.01e-08" in noise_command and "--seed_everything 0" in noise_command
    text = doc.read_text()
    assert text.startswith("intro\n<!-- parity:begin -->\nHidden 256, 6 steps") and text.endswith("<!-- parity:end -->\nrest\n")
    assert "![parity curves and gaps](parity.png)" in text and (tmp_path / "parity.png").is_file()
    # a second call reuses the finished runs (same commands) and only re-renders
    again = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and all(r["reused"] for r in json.loads(again.stdout.splitlines()[-1])["runs"].values())


def _st_run(tmp_path: Path, name: str, losses, val_last):
    from lp_lightning.st.cases import ParitySettings, parity_runs
    from lp_lightning.st.runner import RunResult

    spec = next(s for s in parity_runs(ParitySettings(seeds=(0, 1), steps=4)) if s.name == name)
    folder = tmp_path / name
    folder.mkdir(parents=True)
    summary = {"losses": list(losses), "val_loss_last": val_last}
    (folder / "run_summary.json").write_text(json.dumps(summary))
    return RunResult(spec, folder, exit_code=0, summary=summary)


def test_the_st_parity_row_checks_every_low_precision_case_and_seed(tmp_path):
    from lp_lightning.st.cases import ParitySettings, parity_runs
    from lp_lightning.st.parity_row import parity_row, parity_section
    from lp_lightning.st.thresholds import BUILTIN_THRESHOLDS

    settings = ParitySettings(seeds=(0, 1), steps=4, eps=1e-8)
    specs = parity_runs(settings)
    assert [s.name for s in specs[:4]] == [f"parity/seed0/{n}" for n in ("bf16", "mxfp8", "hif8_current", "bf16_noise")]
    assert specs[3].overrides["model.eps"] == 1.01e-08 and specs[5].overrides["seed_everything"] == 1
    assert all(s.overrides["trainer.val_check_interval"] == 4 and s.max_steps == 4 for s in specs)
    values = {"bf16": 2.0, "mxfp8": 2.02, "hif8_current": 2.1, "bf16_noise": 2.01}  # hif8 +5 %: fails
    runs = {s.name: _st_run(tmp_path / "runs", s.name, [3.0, 2.5] + [values[s.name.rsplit("/", 1)[1]]] * 2,
                            values[s.name.rsplit("/", 1)[1]]) for s in specs}
    row = parity_row(runs, tmp_path, settings, BUILTIN_THRESHOLDS)
    assert row.verdict == "fail" and row.thresholds == ["parity_max_gap_pct.mxfp8", "parity_max_gap_pct.hif8"]
    verdicts = {c.name.split(":")[0]: c.ok for c in row.checks}
    assert verdicts == {"mxfp8 seed 0": True, "mxfp8 seed 1": True, "hif8_current seed 0": False,
                        "hif8_current seed 1": False}
    assert row.checks[0].observed == "train +1.00 % (+2.0 x noise), val +1.00 % (+2.0 x noise)"
    assert row.evidence["noise_floor"]["train_pct"] == pytest.approx(0.5)
    assert (tmp_path / "parity.json").is_file() and (tmp_path / "parity.png").is_file()
    section = "\n".join(parity_section(tmp_path, [row]))
    assert section.startswith("## Loss parity against BF16: **fail**") and "| 1 | hif8_current | 2.1000 | +5.00 |" in section
    del runs["parity/seed1/bf16"]
    row = parity_row(runs, tmp_path, settings, BUILTIN_THRESHOLDS)
    assert row.checks[0].name == "every parity run finished" and not row.checks[0].ok
    assert "parity/seed1/bf16" in row.checks[0].observed and len(row.checks) == 3  # seed 0 still judged


def test_st_parity_options_are_checked_and_the_row_is_opt_in(capsys):
    from lp_lightning.cli import main
    from lp_lightning.st.main import build_parser

    assert "parity" not in build_parser().parse_args([]).rows
    with pytest.raises(SystemExit) as stop:
        main(["st", "--rows", "[parity]", "--parity_seeds", "[1, 1]", "--parity_steps", "1"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--parity_seeds [1, 1]: name one or more different seeds in [0, 2^32)." in err and "--parity_steps 1 must be >= 2." in err


def test_st_parity_validates_at_the_last_step_and_checks_seed_bounds():
    from lp_lightning.st.cases import ParitySettings

    assert [ParitySettings(steps=n).val_every for n in (300, 150, 120, 125, 97, 4)] == [50, 50, 40, 25, 97, 4]
    assert ParitySettings(steps=300).last_steps == 50 and ParitySettings(steps=4).last_steps == 2
    with pytest.raises(ValueError, match=r"\[-1\]: name one or more different seeds in \[0, 2\^32\)"):
        ParitySettings(seeds=(-1,))


def test_the_parity_script_refuses_bad_options_before_any_run(tmp_path):
    command = [sys.executable, str(REPO / "benchmarks" / "parity.py"), "--seeds", "0", "0", "--last", "0",
               "--steps", "7", "--val-every", "3", "--width", "300", "--jobs", "0", "--corpus", str(tmp_path / "none"),
               "--doc", str(tmp_path / "no.md"), "--variant", "bf16=mxfp8", "--work-dir", str(tmp_path / "runs")]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and not (tmp_path / "runs").exists()
    for text in ("--seeds 0 0: name different seeds", "--last 0 must be in [1, --steps 7]",
                 "--steps 7 must be a multiple of --val-every 3", "--jobs 0 and --threads None must be >= 1",
                 "--width width=300: use 256 times a power of two", f"--corpus {tmp_path / 'none'}: no such file",
                 "needs the lines <!-- parity:begin -->", "the name 'bf16' is taken"):
        assert text in proc.stderr, (text, proc.stderr)
