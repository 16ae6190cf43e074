"""Issue 14's benchmark suite: every performance figure in one run, written to results.json and the docs.

Runs, in this order (``benchmarks/README.md`` "run_all.py" says how each figure is computed):

1. every configuration but the anchor (smallest width, 1 process): ``lp-lightning fit`` in bf16,
   mxfp8, hif8 back to back;
2. the **anchor**, bf16, mxfp8, hif8 with 26 steps (``thread_thrash/*``). Each is the second run
   of its precision on this machine in the suite (same kernels, torch's compile caches warm), so
   its first step gives ``first_step/*``; a precision without an earlier run (quick mode: only the
   anchor is timed) gets a short second anchor run instead;
3. the memory runs: 2 processes, smallest width, bf16 / mxfp8 / hif8 with the TensorMemoryProbe
   (``memory/*``, ``wire/*``; the probe slows steps, so they are not timed);
4. ``benchmarks/quantize.py`` (``codec/*``) and ``benchmarks/gemm.py`` (``gemm/*``) in subprocesses;
5. while the time budget (``--budget-s``) allows, each configuration's round again in reverse
   order (cheapest first), for a per-round spread.

The suite's own wall time is a figure too (``suite/wall_time`` ≤ 900 s, issue 14's acceptance).

Then it applies the accounts of unmet figures (``benchmarks/suite/accounts.py``), writes
``--results`` (default ``benchmarks/results.json``) and puts the table between the
``<!-- results:begin -->`` / ``<!-- results:end -->`` markers of each ``--readme`` (default
``benchmarks/README.md`` and ``docs/performance.md``). ``--render-only`` re-applies the accounts to an existing
results file and re-renders the tables without measuring. ``--quick`` is the smoke mode the test
suite runs (one width, one process for step times, short runs, small codec/GEMM sizes).

    python benchmarks/run_all.py                 # full suite (target: under 15 minutes on 2 cores)
    python benchmarks/run_all.py --quick --results /tmp/r.json --readme /tmp/README.md
    python benchmarks/run_all.py --render-only   # after editing suite/accounts.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # suite/ and this checkout's lp_lightning
from suite import training  # noqa: E402
from suite.accounts import apply_accounts  # noqa: E402
from suite.common import figure, load_average, machine  # noqa: E402
from suite.report import insert_between_markers, markdown, write_results  # noqa: E402

REPO = _HERE.parent
SUITE_LIMIT_S = 900.0
"""Issue 14: the suite runs every figure in under 15 minutes on 2 cores (figure ``suite/wall_time``)."""
MODES: dict[str, dict[str, Any]] = {
    "full": {
        "widths": [256, 512, 1024], "processes": [1, 2],
        "steps": {256: 10, 512: 9, 1024: 8}, "anchor_steps": (26, 8), "memory_steps": 2, "memory_warmup": 1,
        "second_round": training.PRECISIONS, "memory_precisions": training.PRECISIONS, "seq_len": None,
        "quantize": ["--size", "4096", "--rounds", "20", "--warmup", "2"],
        "gemm": ["--m", "1024", "--k", "1024", "--n", "1024", "--tokens", "1024", "--experts", "8", "--rounds", "6"],
    },
    "quick": {
        "widths": [256], "processes": [1],
        "steps": {256: 24}, "anchor_steps": (22, 4), "memory_steps": 1, "memory_warmup": 0,
        "second_round": ("mxfp8",), "memory_precisions": ("bf16", "mxfp8"), "seq_len": 64,
        "quantize": ["--size", "1024", "--rounds", "6", "--warmup", "1"],
        "gemm": ["--m", "256", "--k", "256", "--n", "256", "--tokens", "256", "--experts", "4", "--rounds", "3"],
    },
}  # fmt: skip
"""Per mode: widths, process counts, optimizer steps per width (5 of them warm-up), the anchor's
steps in its first round (> 20 for ``thread_thrash``) and in a second run of a precision that had
no earlier run (``first_step``), memory-run steps and how many of them are the probe's unmeasured
warm-up (quick: the one step is measured, AdamW's moments allocated in it), the precisions that may
get that second anchor run and the precisions of the memory runs (quick: fewer, to keep its test
short; the others' figures read "not run"), ``--data.seq_len`` (``None``: the config's 256) and the
codec / GEMM script arguments."""

REVERSE_ROUND_MARGIN = 1.3
"""A reverse round is started only if ``MARGIN`` × its forward round's wall time still fits the budget."""


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke mode (module docstring)")
    parser.add_argument("--results", type=Path, default=_HERE / "results.json", help="results.json to write")
    parser.add_argument("--readme", type=Path, action="append", default=None,
                        help="page to put the table in (repeatable; default benchmarks/README.md, docs/performance.md)")
    parser.add_argument("--no-readme", action="store_true", help="write the table into no page")
    parser.add_argument("--work-dir", type=Path, default=REPO / "runs" / "benchmarks", help="folder of the runs")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS of the training runs and threads of the codec/GEMM scripts "
                             "(default: unset, the product's default)")
    parser.add_argument("--budget-s", type=float, default=780.0,
                        help="wall-time budget; the optional reverse rounds run only while it allows (default 780)")
    parser.add_argument("--render-only", action="store_true", help="re-apply accounts and re-render, no runs")
    return parser.parse_args(argv)


def _log(message: str) -> None:
    print(f"[run_all] {message}", file=sys.stderr, flush=True)


def _script(name: str, extra: list[str], threads: int | None) -> dict[str, Any]:
    """Runs ``benchmarks/<name>.py`` in a subprocess and returns its JSON report."""
    command = [sys.executable, str(_HERE / f"{name}.py"), *extra,
               "--threads", str(threads if threads is not None else os.cpu_count() or 1)]
    if name == "quantize":
        command += ["--eager-rounds", "0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {proc.returncode}:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def _round(runner: training.Runner, runs: list[training.Run], width: int, processes: int, steps: int,
           round_: int, precisions: tuple[str, ...] = training.PRECISIONS) -> float:
    """bf16, mxfp8, hif8 of one configuration back to back (reversed on odd rounds); returns the wall time."""
    start = time.perf_counter()
    order = precisions if round_ % 2 == 0 else tuple(reversed(precisions))
    for precision in order:
        run = runner.run("step", precision, width, processes, steps, round_)
        runs.append(run)
        _log(f"{precision} w{width} p{processes} r{round_}: {run.wall_s:.0f} s wall, steady "
             f"{run.summary['step_time_s_steady_median'] * 1e3:.1f} ms/step")
    return time.perf_counter() - start


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the suite (module docstring) and returns the results dict."""
    mode = "quick" if args.quick else "full"
    cfg = MODES[mode]
    start, load_start = time.perf_counter(), load_average()
    work_dir = args.work_dir / mode
    runner = training.Runner(work_dir, threads=args.threads, seq_len=cfg["seq_len"])
    widths, processes = cfg["widths"], cfg["processes"]
    anchor = (min(widths), min(processes))
    configs = sorted(((w, p) for w in widths for p in processes), key=lambda c: (c[0], c[1]))
    runs: list[training.Run] = []
    rounds = {c: 0 for c in configs}
    forward_wall: dict[tuple[int, int], float] = {}

    for config in configs:  # 1. every other configuration once (warms the compile caches)
        if config != anchor:
            forward_wall[config] = _round(runner, runs, *config, cfg["steps"][config[0]], 0)
            rounds[config] = 1
    _round(runner, runs, *anchor, cfg["anchor_steps"][0], 0)  # 2. the anchor
    rounds[anchor] = 1
    first_runs = [p for p in cfg["second_round"]
                  if [r.precision for r in runs].count(p) == 1]  # the anchor was p's first run here
    if first_runs:
        _round(runner, runs, *anchor, cfg["anchor_steps"][1], 1, tuple(first_runs))
        rounds[anchor] = 2
    for precision in cfg["memory_precisions"]:  # 3. memory and wire (2 processes)
        run = runner.run("memory", precision, min(widths), 2, cfg["memory_steps"], 0,
                         memory_warmup=cfg["memory_warmup"])
        runs.append(run)
        _log(f"memory {precision}: {run.wall_s:.0f} s wall")
    reports = {}
    for name in ("quantize", "gemm"):  # 4. codecs and GEMMs
        t0 = time.perf_counter()
        reports[name] = _script(name, cfg[name], args.threads)
        _log(f"{name}.py: {time.perf_counter() - t0:.0f} s")
    skipped = []
    for config in sorted(forward_wall, key=forward_wall.get):  # 5. reverse rounds while the budget allows
        if time.perf_counter() - start + REVERSE_ROUND_MARGIN * forward_wall[config] > args.budget_s:
            skipped.append(list(config))
            continue
        _round(runner, runs, *config, cfg["steps"][config[0]], 1)
        rounds[config] = 2

    figures: dict[str, Any] = {}
    figures.update(training.step_time_figures(runs, widths, processes))
    figures.update(training.compile_figures(runs, anchor))
    figures.update(training.thread_figures(runs, anchor, args.threads))
    figures.update(training.wire_memory_figures(runs))
    for report in reports.values():
        figures.update(report["figures"])
    elapsed = time.perf_counter() - start
    figures["suite/wall_time"] = figure(elapsed, None, target=SUITE_LIMIT_S, criterion="value <= target", unit="s",
                                        detail={"budget_s": args.budget_s, "reverse_rounds_skipped": skipped})
    step_runs = [r for r in runs if r.kind == "step"]
    settings = {
        "widths": widths, "processes": processes, "anchor": list(anchor),
        "steps": {str(w): cfg["steps"][w] for w in widths}, "anchor_steps": list(cfg["anchor_steps"]),
        "memory_steps": cfg["memory_steps"], "memory_warmup_steps": cfg["memory_warmup"], "memory_processes": 2,
        "seq_len": cfg["seq_len"] or 256, "global_batch_size": 4,
        "width_overrides": {str(w): training.overrides_for(w) for w in widths},
        "omp_num_threads": args.threads,
        "threads_per_run": sorted({r.summary["threads"]["torch_intra_op"] for r in step_runs}),
        "rounds": {f"w{w}/p{p}": n for (w, p), n in rounds.items()}, "reverse_rounds_skipped_for_budget": skipped,
        "budget_s": args.budget_s, "quantize_args": cfg["quantize"], "gemm_args": cfg["gemm"],
        "codec_threads": reports["quantize"]["threads"], "gemm_threads": reports["gemm"]["threads"],
        "compile_s": reports["quantize"]["compile_s"],
    }  # fmt: skip
    return {
        "suite": "benchmarks/run_all.py", "mode": mode, "machine": machine(load_start), "settings": settings,
        "elapsed_s": round(elapsed, 1), "figures": figures,
        "runs": [r.record() for r in runs],
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.render_only:
        results = json.loads(args.results.read_text())
    else:
        results = measure(args)
    apply_accounts(results["figures"])
    write_results(args.results, results)
    block = markdown(results)
    readmes = [] if args.no_readme else (args.readme or [_HERE / "README.md", REPO / "docs" / "performance.md"])
    for readme in readmes:
        insert_between_markers(readme, block)
    _log(f"wrote {args.results} and {', '.join(map(str, readmes)) or 'no README'}; "
         f"{results['elapsed_s']:.0f} s; unmet: {sum(f['met'] is False for f in results['figures'].values())}")
    print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
