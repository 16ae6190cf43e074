"""The acceptance report on synthetic runs: what it shows, warns about and leaves out (design spec §17.3–§17.5)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lp_lightning.st.cases import STSettings
from lp_lightning.st.report import (
    _plot_curves,
    _plot_performance,
    load_comparison,
    performance_section,
    short_run_checks,
    write_report,
)
from lp_lightning.st.rows import Row

from ._synthetic import SETTINGS, refresh, run_result, summary

LONG = STSettings(devices=2, warmup_steps=2, steady_steps=8, resume_steps=2, variant_steps=2, required_steps=3,
                  profile_steps=1, reduced=True)
BF16 = [3.0 - 0.01 * i for i in range(10)]


def _main(case: str, folder: Path, losses: list[float], load: float = 1.0, step_s: float = 1.0,
          backend: str = "emulated") -> dict:
    extra = {"step_times_s": [step_s] * len(losses), "tokens": 100 * len(losses), "backend": backend,
             "load_average": {"start": [load, 1.0, 1.0], "end": [load, 1.0, 1.0]},
             "threads": {"torch_intra_op": 1, "torch_inter_op": 2, "OMP_NUM_THREADS": "1", "cpu_count": 2}}
    memory = {"steps": [{"records": [{"peak_memory_bytes": 300 * 2**20, "peak_memory_source": "ru_maxrss"}]}] * 2}
    return run_result(f"main/{case}", folder, summary(tuple(losses), **extra), memory, settings=LONG)


def _mains(tmp_path: Path, mxfp8: list[float], hif8: list[float], loads=(1.0, 1.0, 1.0)) -> dict:
    curves = {"bf16": BF16, "mxfp8": mxfp8, "hif8_current": hif8}
    return {f"main/{c}": _main(c, tmp_path / c, losses, load) for (c, losses), load in zip(curves.items(), loads)}


def _check(row: Row, words: str):
    (found,) = [c for c in row.checks if words in c.name]
    return found


def test_the_band_applies_to_the_smoothed_curve_at_every_steady_step(tmp_path):
    noisy = [v * (1 + 0.08 * (-1) ** i) for i, v in enumerate(BF16)]  # raw steps 8 % off bf16, smoothed ~2 %
    biased = [v * (1.10 if 3 <= i <= 7 else 1.0) for i, v in enumerate(BF16)]  # 5 steps 10 % high: smoothed too
    row = short_run_checks(_mains(tmp_path, noisy, biased), LONG)
    smoothed = "smoothed loss (trailing mean of 5 steps) within the band of bf16's at every steady step"
    assert _check(row, f"mxfp8: {smoothed}").ok
    failed = _check(row, f"hif8_current: {smoothed}")
    assert not failed.ok and "at step 8 of 8 steady steps" in failed.observed and "6.25e-02" in failed.expected
    assert _check(row, "hif8_current: mean loss of the last 10 steps").ok  # the last-10 mean alone would pass
    assert len(row.evidence["hif8_current.smoothed_rel_per_steady_step"]) == LONG.steady_steps


def test_load_and_threads_per_case_and_a_warning_when_they_differ(tmp_path):
    quiet = load_comparison(_mains(tmp_path, BF16, BF16, loads=(1.0, 1.5, 1.9)))
    assert quiet["warnings"] == [] and quiet["load_spread_1min"] == pytest.approx(0.9)
    assert quiet["per_case"]["mxfp8"]["threads"]["torch_intra_op"] == 1
    busy = load_comparison(_mains(tmp_path, BF16, BF16, loads=(1.05, 3.55, 3.6)))
    (warning,) = busy["warnings"]
    assert "different machine load" in warning and "bf16 1.05" in warning and "spread 2.55 > 1" in warning


def test_plots_say_the_band_in_percent_the_backend_and_that_memory_is_process_rss(tmp_path):
    runs = _mains(tmp_path, BF16, BF16)
    labels = _plot_curves(runs, tmp_path / "curves.png")
    assert "band: ±6.25 % of bf16 (smoothed)" in labels
    titles = _plot_performance(performance_section(runs, LONG), tmp_path / "perf.png")
    assert "emulated backend" in titles[0] and "Peak process RSS" in titles[1] and "not a low-precision saving" in titles[1]
    assert len(titles) == 2  # no profile: no empty time-share panel
    npu = {name: _main(name.split("/")[1], tmp_path, BF16, backend="npu") for name in runs}
    assert "emulated" not in _plot_performance(performance_section(npu, LONG), tmp_path / "perf_npu.png")[0]


def _report(tmp_path: Path, runs: dict, rows: list[Row], settings: STSettings = SETTINGS) -> tuple[dict, str]:
    meta = {"config": "embedded default (dsv3-tiny)", "user_reshard_after_forward": True, "skipped_parts": ["numerics"]}
    report = write_report(tmp_path, rows=rows, runs=runs, settings=settings, numerics={}, numerics_rows=[], meta=meta)
    return report, (tmp_path / "report.md").read_text()


def test_a_partial_report_draws_no_empty_plot_and_says_what_did_not_run(tmp_path):
    runs = {f"accum/{c}": run_result(f"accum/{c}", tmp_path, summary(), {"refresh": [refresh()]})
            for c in ("mxfp8", "hif8_current")}
    runs["accum/mxfp8"].reused = True
    row = Row("Q3-06")
    row.check_compared("reshard/hif8_current: forward and backward use the same data and scale", 0, True, "0 pairs",
                       "identical bytes", if_none="one gather serves forward and backward")
    report, md = _report(tmp_path, runs, [row])
    assert not any((tmp_path / name).exists() for name in ("loss_grad_norm.png", "performance_memory.png", "resume.png"))
    assert report["plots"] == {}
    assert "No curves: no main run finished." in md and "N-3 (short-run curves against bf16) not evaluated" in md
    assert "Layered numerics N-1/N-2 (§17.3.2 items 1-2) not run" in md and "Not measured: no main run ran" in md
    assert "- not run (" in md and "main/bf16" in md.split("- not run (")[1].splitlines()[0]
    assert "reused from an earlier st (`--reuse_runs`): accum/mxfp8" in md
    assert {r["name"]: r["reused"] for r in report["runs"]} == {"accum/mxfp8": True, "accum/hif8_current": False}
    assert "| n/a (one gather serves forward and backward) | " in md and "| yes |" not in md
    assert report["rows"][0]["checks"][0]["not_applicable"] == "one gather serves forward and backward"
    assert report["rows"][0]["verdict"] == "not-applicable"


def test_the_header_shows_devices_steps_reduced_and_the_load_warning(tmp_path):
    runs = _mains(tmp_path, BF16, BF16, loads=(0.8, 3.5, 3.6))
    report, md = _report(tmp_path, runs, [], settings=LONG)
    assert md.startswith("# Reduced smoke run (not an acceptance)") and "**REDUCED run (`--reduced true`)" in md
    assert "- devices: 2 process(es) per run; steps: main 2 warm-up + 8 steady = 10 (checkpoint at 8)" in md
    assert report["settings"]["reduced"] is True and report["settings"]["devices"] == 2
    perf = md.split("## Performance and memory (§17.4)")[1]
    assert "> **Warning:** the cases ran under different machine load" in perf
    assert "| machine load, 1-min average at start / end of main run | 0.80 / 0.80 (mean 0.8) | 3.50 / 3.50" in perf
    assert "| threads: torch intra-op / inter-op / OMP_NUM_THREADS (rank 0) | 1 / 2 / 1 (cpus 2) |" in perf
    assert "peak process RSS per rank (MiB)" in perf and "reshard run: step time ratio to main" not in perf.split("- ")[0]
    assert (tmp_path / "loss_grad_norm.png").is_file() and (tmp_path / "performance_memory.png").is_file()
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["performance"]["load"]["warnings"] == report["performance"]["load"]["warnings"] != []
    full = dataclasses.replace(LONG, reduced=False, required_steps=20, steady_steps=20)
    _, md = _report(tmp_path, _mains(tmp_path, BF16, BF16), [], settings=full)
    assert md.startswith("# Acceptance report (design spec §17)") and "REDUCED" not in md and "Warning" not in md
