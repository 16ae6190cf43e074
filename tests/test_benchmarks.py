"""The benchmark suite (benchmarks/run_all.py, issue 14) runs end to end and writes what it promises.

The quick mode runs every figure's code path on tiny sizes (real CLI runs, real codec and GEMM
scripts) into a temporary folder; the checks are on the schema, on every figure being present, on
the byte figures' internal consistency and on the results table rendering (``docs/performance.md``,
``benchmarks/README.md``). No timing is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from suite.accounts import NO_ACCOUNT, apply_accounts  # noqa: E402
from suite.common import FIGURE_KEYS, figure, missing  # noqa: E402
from suite.report import MARK_BEGIN, MARK_END, insert_between_markers, markdown  # noqa: E402

OPS = ("dense_fprop", "dense_dgrad", "dense_wgrad", "grouped_fprop", "grouped_dgrad", "grouped_wgrad")
QUICK_FIGURES = (
    [f"step_time/{p}/w256/p1" for p in ("mxfp8", "hif8")]
    + [f"step_time_growth/{p}/p1" for p in ("mxfp8", "hif8")]
    + [f"{kind}/{p}" for kind in ("recompiles", "first_step", "thread_thrash") for p in ("bf16", "mxfp8", "hif8")]
    + [f"{kind}/{p}" for kind in ("wire", "memory") for p in ("mxfp8", "hif8")]
    + [f"wire/{p}/reduce_scatter" for p in ("mxfp8", "hif8")]
    + ["codec/mxfp8_dual_vs_torchao_compiled", "codec/mxfp8_dual_vs_clone",
       "codec/hif8_encode_vs_compiled_e4m3_cast", "codec/hif8_decode_vs_compiled_e4m3_decode"]
    + [f"gemm/{fmt}/{op}" for fmt in ("mxfp8_e4m3", "hif8") for op in OPS]
    + ["suite/wall_time"]
)  # fmt: skip


def test_figure_criteria_and_accounts():
    speedup = figure(2.0, 5.0, target=2, criterion="ratio >= target", unit="s", ratio_is="baseline / value")
    assert speedup["ratio"] == 2.5 and speedup["met"] is True
    slow = figure(3.0, 2.0, target=1.5, criterion="ratio <= target", unit="s")
    assert slow["ratio"] == 1.5 and slow["met"] is True
    assert figure(1, None, target=0, criterion="value <= target", unit="count")["met"] is False
    assert figure(1.0, 2.0, target=None, criterion=None, unit="s")["met"] is None
    gone = missing("run_summary has no compile section", target=0, criterion="value <= target", unit="count")
    assert gone["value"] is None and gone["met"] is False
    with pytest.raises(ValueError, match="criterion"):
        figure(1.0, 1.0, target=1.0, criterion=None, unit="s")
    figures = {"step_time/mxfp8/w256/p1": figure(3.0, 1.0, target=1.5, criterion="ratio <= target", unit="s"),
               "step_time/hif8/w256/p1": figure(3.0, 1.0, target=1.5, criterion="ratio <= target", unit="s"),
               "recompiles/bf16": gone, "wire/mxfp8": figure(1.0, 2.0, target=0.53, criterion="ratio <= target",
                                                             unit="bytes")}
    apply_accounts(figures, {"step_time/mxfp8/*": "GEMM decode 22%", "recompiles/*": "not used"})
    assert figures["step_time/mxfp8/w256/p1"]["account"] == "GEMM decode 22%"
    assert figures["step_time/hif8/w256/p1"]["account"] == NO_ACCOUNT
    assert figures["recompiles/bf16"]["account"] == "run_summary has no compile section"  # the suite's reason stays
    assert "account" not in figures["wire/mxfp8"]


def test_insert_between_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{MARK_BEGIN}\nold\n{MARK_END}\ntail\n")
    insert_between_markers(readme, "new\n")
    assert readme.read_text() == f"# x\n{MARK_BEGIN}\nnew\n{MARK_END}\ntail\n"
    readme.write_text("# no markers\n")
    with pytest.raises(ValueError, match="results:begin"):
        insert_between_markers(readme, "new\n")
    # Prose naming the markers (benchmarks/README.md does) is not where the table goes.
    prose = f"each between the `{MARK_BEGIN}` / `{MARK_END}` markers.\n"
    readme.write_text(f"{prose}## Results\n{MARK_BEGIN}\nold\n{MARK_END}\ntail\n")
    insert_between_markers(readme, "new\n")
    assert readme.read_text() == f"{prose}## Results\n{MARK_BEGIN}\nnew\n{MARK_END}\ntail\n"


def test_markdown_prints_each_account_once_with_the_figures_it_covers():
    slow = dict(target=1.5, criterion="ratio <= target", unit="s")
    figures = {f"step_time/mxfp8/w{w}/p1": figure(3.0, 1.0, **slow) for w in (256, 512)}
    figures |= {"step_time/hif8/w256/p1": figure(3.0, 1.0, **slow),
                "wire/mxfp8": figure(1.0, 2.0, target=0.53, criterion="ratio <= target", unit="bytes")}
    apply_accounts(figures, {"step_time/mxfp8/*": "GEMM decode 22%", "step_time/hif8/*": "FP32 GEMMs"})
    machine = {"cpu_model": "cpu", "physical_cores": 2, "logical_cpus": 2, "usable_cpus": 2,
               "load_average_start": [1.0], "load_average_end": [1.0], "torch": "2.13", "torchao": "0.18",
               "versions": {}, "date_utc": "today"}
    settings = {"widths": [256, 512], "processes": [1], "omp_num_threads": 1, "threads_per_run": [1]}
    block = markdown({"machine": machine, "settings": settings, "elapsed_s": 1.0, "figures": figures})
    accounts = block.split("Unmet figures and their accounts:\n\n")[1]
    assert accounts.count("GEMM decode 22%") == 1 and accounts.count("FP32 GEMMs") == 1
    assert "- `step_time/mxfp8/w256/p1`, `step_time/mxfp8/w512/p1`: GEMM decode 22%" in accounts.replace("\n  ", " ")
    assert "- `step_time/hif8/w256/p1`: FP32 GEMMs" in accounts and "wire/mxfp8" not in accounts
    for name in figures:  # every figure still has its table row
        assert f"| `{name}` |" in block


@pytest.mark.slow
def test_quick_suite_writes_every_figure_and_the_readme_table(tmp_path):
    results_path, readme = tmp_path / "results.json", tmp_path / "README.md"
    readme.write_text(f"# Performance\n\n{MARK_BEGIN}\n{MARK_END}\n\nafter\n")
    command = [sys.executable, str(BENCHMARKS / "run_all.py"), "--quick", "--threads", "1",
               "--results", str(results_path), "--readme", str(readme), "--work-dir", str(tmp_path / "runs")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1500, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]

    results = json.loads(results_path.read_text())
    assert results["mode"] == "quick" and results["elapsed_s"] > 0
    for key in ("cpu_model", "physical_cores", "logical_cpus", "load_average_start", "torch", "date_utc"):
        assert key in results["machine"], key
    assert results["settings"]["omp_num_threads"] == 1 and results["settings"]["threads_per_run"] == [1]
    figures = results["figures"]
    assert sorted(figures) == sorted(QUICK_FIGURES)
    for name, fig in figures.items():
        assert all(k in fig for k in FIGURE_KEYS), name
        assert (fig["met"] is None) == (fig["target"] is None), name
        if fig["met"] is False:
            assert isinstance(fig.get("account"), str) and fig["account"], name
    # Quick mode runs the second anchor round and the 2-process memory runs for mxfp8 (and bf16) only:
    # every code path once, at the cost of 6 CLI runs instead of 9; hif8's figures there read "not run".
    not_run = {"first_step/bf16", "first_step/hif8", "wire/hif8", "wire/hif8/reduce_scatter", "memory/hif8"}
    for name in not_run:
        assert figures[name]["value"] is None and figures[name]["met"] is False, name
    for name in set(QUICK_FIGURES) - not_run:  # measured (the growth fit needs two widths)
        if not name.startswith("step_time_growth/"):
            assert figures[name]["value"] is not None, name
            assert figures[name]["baseline"] is not None or name.startswith(("suite/", "recompiles/")), name
    assert {figures[f"recompiles/{p}"]["value"] for p in ("bf16", "mxfp8", "hif8")} == {0}
    for p in ("mxfp8", "hif8"):  # the 8-bit runs really ran compiled codec kernels (bf16 compiles none)
        assert all(run["compiled_graphs"] > 0 for run in figures[f"recompiles/{p}"]["detail"]["per_run"]), p
    detail = figures["wire/mxfp8"]["detail"]  # byte counts, not timings: the two wire baselines agree
    assert detail["baseline_from_numel"] == figures["wire/mxfp8"]["baseline"]
    assert detail["high_precision_gathers_of_replaced"] == 0 and detail["other_dtypes_equal"]
    assert len(results["runs"]) == 6  # 3 precisions + mxfp8's second run + 2 memory runs

    block = markdown(results)
    text = readme.read_text()
    assert f"{MARK_BEGIN}\n{block}{MARK_END}" in text and text.endswith("after\n")
    for name in figures:
        assert f"`{name}`" in block

    # --render-only re-renders from the file (after an ACCOUNTS edit) without measuring
    readme.write_text(f"{MARK_BEGIN}\n{MARK_END}\n")
    rerender = subprocess.run([sys.executable, str(BENCHMARKS / "run_all.py"), "--render-only", "--results",
                               str(results_path), "--readme", str(readme)], capture_output=True, text=True,
                              timeout=300, env=env)
    assert rerender.returncode == 0, rerender.stderr[-3000:]
    assert readme.read_text() == f"{MARK_BEGIN}\n{block}{MARK_END}\n"
