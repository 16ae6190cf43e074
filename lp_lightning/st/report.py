"""The acceptance report: ``report.json``, ``report.md``, ``per_step.csv`` and PNG plots (design spec §17.3–§17.5).

``report.json`` holds ``rows`` (the Q3 rows: ``id``, ``title``, ``verdict``
``pass|fail|not-applicable``, ``checks`` with ``not_applicable`` reasons, ``evidence``, ``notes``),
``numerics`` (§17.3.2: the per-operator table, the one-layer comparison, the short-run checks),
``performance`` (§17.4, per case whose main run ran: steady tokens/s and step times, ratios,
per-rank and global peak memory, profiler time shares, the reshard and recompute deltas,
all-gather bytes against BF16; ``load``: :func:`load_comparison`), ``runs`` (each run's folder,
exit status, wall time, ``reused``), ``settings`` (with ``reduced``), ``versions``, ``plots``
(only those drawn) and ``sections`` (skipped step, recompute off vs full, Q3-05 backward gathers, §17.4
low precision off, §17.5 limitations: :mod:`lp_lightning.st.sections`). ``report.md`` is the same for a reader, with the plots inline, a header with
the devices, step counts and the runs that did not run, and a load warning in its performance
section. ``per_step.csv`` is the raw per-step data of every run and rank.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path
from typing import Any

from lp_lightning.st.cases import CASES, STSettings, build_runs
from lp_lightning.st.conformance_row import conformance_section
from lp_lightning.st.parity_row import parity_section
from lp_lightning.st.rows import Row, steady_performance
from lp_lightning.st.runner import RunResult
from lp_lightning.st.sections import report_sections, sections_markdown
from lp_lightning.st.thresholds import BUILTIN_THRESHOLDS, Thresholds, precision_of_case, thresholds_markdown
from lp_lightning.st.timing import shares_source, timing_lines

__all__ = ["performance_section", "short_run_checks", "write_per_step_csv", "write_report"]

_COLORS = {"bf16": "tab:blue", "mxfp8": "tab:orange", "hif8_current": "tab:green"}
_STYLES = {"bf16": "-", "mxfp8": "--", "hif8_current": ":"}  # the curves lie on top of each other
SMOOTHING_STEPS = 5
"""Window of the moving mean drawn over the raw loss curves."""
LOSS_MEAN_STEPS = 10
"""The short-run band compares the mean loss of this many last steps."""


def _moving_mean(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_json_safe(v) for v in value]
    return value


# ------------------------------------------------------------------------------------------------
# §17.3.2 item 3: the short-run curves


def short_run_checks(
    runs: dict[str, RunResult], settings: STSettings, *, thresholds: Thresholds = BUILTIN_THRESHOLDS
) -> Row:
    """No NaN/Inf, no explosion, training moves; mxfp8/hif8 within ``u`` of bf16 (relative; ``thresholds``
    ``short_run_loss_rel`` and ``short_run_explosion_factor``).

    The band is checked twice: on the curves smoothed by a trailing mean of :data:`SMOOTHING_STEPS`
    steps at every steady step (after ``settings.warmup_steps``), and on the mean of the last
    :data:`LOSS_MEAN_STEPS` steps. Raw single steps are noisier than ``u`` and are not checked.
    """
    row = Row("N-3")
    means, smooth = {}, {}
    for case in (c.name for c in CASES):
        run = runs.get(f"main/{case}")
        if run is None or not run.ok:
            row.check(f"main/{case} finished", False, None if run is None else run.exit_code, 0)
            continue
        losses = run.summary.get("losses", [])
        norms = run.summary.get("grad_norms", [])
        finite = all(v is not None and math.isfinite(v) for v in losses + norms)
        row.check(f"{case}: no NaN/Inf in loss and grad norm", finite and bool(losses), len(losses), "all finite")
        means[case] = statistics.fmean(losses[-LOSS_MEAN_STEPS:]) if losses else math.nan
        smooth[case] = _moving_mean(losses, SMOOTHING_STEPS) if finite else []
        row.check(f"{case}: the loss moves down from step one", means[case] < losses[0] if losses else False,
                  f"first {losses[0]:.4f}, mean of last {LOSS_MEAN_STEPS} {means[case]:.4f}" if losses else None,
                  "mean of the last steps < first loss")
        factor = thresholds.get(row, "short_run_explosion_factor")
        row.check(f"{case}: no explosion (last grad norms within {factor:g}x of the median)",
                  finite and bool(norms) and max(norms[-LOSS_MEAN_STEPS:]) <= factor * statistics.median(norms),
                  max(norms[-LOSS_MEAN_STEPS:]) if norms and finite else None, f"<= {factor:g} x median")
    base = means.get("bf16")
    for case in ("mxfp8", "hif8_current"):
        if base is None or case not in means:
            continue
        key = f"short_run_loss_rel.{precision_of_case(case)}"
        band = thresholds.get(row, *key.split("."))
        steady = range(settings.warmup_steps, min(len(smooth[case]), len(smooth["bf16"])))
        rels = [(smooth[case][i] - smooth["bf16"][i]) / smooth["bf16"][i] for i in steady]
        worst = max(range(len(rels)), key=lambda i: abs(rels[i]), default=None)
        row.check_compared(
            f"{case}: smoothed loss (trailing mean of {SMOOTHING_STEPS} steps) within the band of bf16's at every "
            "steady step", len(rels), len(smooth[case]) == len(smooth["bf16"]) and all(abs(r) <= band for r in rels),
            f"max |rel| {abs(rels[worst]):.2e} at step {settings.warmup_steps + worst + 1} of {len(rels)} steady steps"
            if worst is not None else "no steady step", f"|rel| <= {band:.2e} ({key}) at each step")
        rel = (means[case] - base) / base
        row.check(f"{case}: mean loss of the last {LOSS_MEAN_STEPS} steps within the band of bf16", abs(rel) <= band,
                  f"{means[case]:.5f} vs {base:.5f} (rel {rel:+.2e})", f"|rel| <= {band:.2e} ({key})")
        row.evidence[f"{case}.band_rel"] = band
        row.evidence[f"{case}.smoothed_rel_per_steady_step"] = rels
    row.evidence["loss_last_mean"] = means
    return row


# ------------------------------------------------------------------------------------------------
# §17.4: performance and memory


def _peak_memory(run: RunResult) -> dict[str, Any]:
    per_rank = []
    source = None
    for rank in run.probe("steps"):
        peaks = [r.get("peak_memory_bytes") or 0 for r in rank.get("records", [])]
        per_rank.append(max(peaks) if peaks else None)
        source = source or next((r.get("peak_memory_source") for r in rank.get("records", [])), None)
    known = [p for p in per_rank if p is not None]
    return {"per_rank": per_rank, "max": max(known) if known else None, "global": sum(known) if known else None,
            "source": source}


def _short_median(run: RunResult | None, skip: int = 2) -> float | None:
    times = ((run.summary or {}).get("step_times_s") or [])[skip:] if run is not None and run.ok else []
    return statistics.median(times) if times else None


def _gathered_bytes(run: RunResult | None) -> float | None:
    wire = ((run.summary or {}).get("wire") or {}) if run is not None else {}
    values = (wire.get("all_gather_bytes") or {}).values()
    return float(sum(values)) if values else None


def _time_shares(run: RunResult | None) -> dict[str, Any] | None:
    ranks = run.probe("profile") if run is not None else []
    if not ranks:
        return None
    keys = sorted({k for r in ranks for k in r.get("shares", {})})
    return {
        "shares": {k: statistics.fmean(r.get("shares", {}).get(k, 0.0) for r in ranks) for k in keys},
        "window": ranks[0].get("window"),
        "wall_s": [r.get("wall_s") for r in ranks],
        "from": run.spec.name,
        **shares_source(ranks),  # device kernel time or host ranges
    }


LOAD_SPREAD_WARNING = 1.0
"""The report warns when the cases' machine loads differ by more than this (1-minute load average)."""


def _load_1min(summary: dict[str, Any]) -> float | None:
    """Mean of the 1-minute load average at the start and the end of a run (``None``: not recorded)."""
    load = summary.get("load_average") or {}
    values = [v[0] for v in (load.get("start"), load.get("end")) if v]
    return statistics.fmean(values) if values else None


def load_comparison(runs: dict[str, RunResult]) -> dict[str, Any]:
    """The machine load and thread counts of each case's main run, and a warning when they differ.

    A case's load is the mean of the 1-minute load average at the start and the end of its main run
    (``run_summary.json`` ``load_average``). The warning is raised when the cases' loads differ by
    more than :data:`LOAD_SPREAD_WARNING` (one busy core more for some cases than for others: on a
    shared machine that shifts their step times, so the ratios compare the load too), or when their
    thread counts differ.
    """
    per_case: dict[str, Any] = {}
    for case in (c.name for c in CASES):
        run = runs.get(f"main/{case}")
        if run is None or not run.ok:
            continue
        summary = run.summary or {}
        per_case[case] = {"load_1min": _load_1min(summary), "load_average": summary.get("load_average"),
                          "threads": summary.get("threads")}
    loads = {c: e["load_1min"] for c, e in per_case.items() if e["load_1min"] is not None}
    spread = (max(loads.values()) - min(loads.values())) if len(loads) > 1 else None
    warnings = []
    if spread is not None and spread > LOAD_SPREAD_WARNING:
        shown = ", ".join(f"{c} {v:.2f}" for c, v in loads.items())
        warnings.append(f"the cases ran under different machine load (1-min load: {shown}; spread {spread:.2f} > "
                        f"{LOAD_SPREAD_WARNING:g}): their step-time and throughput ratios compare the load as well as "
                        "the precision; rerun on a quiet machine")
    threads = {c: json.dumps(e["threads"], sort_keys=True) for c, e in per_case.items() if e["threads"]}
    if len(set(threads.values())) > 1:
        warnings.append("the cases ran with different thread counts: " + "; ".join(f"{c} {t}" for c, t in threads.items()))
    return {"per_case": per_case, "load_spread_1min": spread, "warning_threshold": LOAD_SPREAD_WARNING,
            "warnings": warnings}


def performance_section(runs: dict[str, RunResult], settings: STSettings) -> dict[str, Any]:
    """The §17.4 figures of every case whose main run ran (JSON-ready), and :func:`load_comparison`."""
    out: dict[str, Any] = {}
    bf16_bytes = _gathered_bytes(runs.get("main/bf16"))
    for case in (c.name for c in CASES):
        main = runs.get(f"main/{case}")
        if main is None:
            continue
        entry: dict[str, Any] = {"steady": steady_performance(main, settings) if main.ok else None}
        entry["peak_memory_bytes"] = _peak_memory(main)
        entry["time_shares"] = _time_shares(runs.get(f"resume/{case}"))
        base = _short_median(main, settings.warmup_steps)
        for kind in ("reshard", "recompute"):
            variant = runs.get(f"{kind}/{case}")
            median = _short_median(variant)
            entry[f"{kind}_delta"] = {
                "step_time_s_median": median,
                "main_step_time_s_median": base,
                "ratio": (median / base) if median and base else None,
                "all_gather_bytes_per_step": _gathered_bytes(variant),
                "peak_memory_bytes": _peak_memory(variant) if variant is not None else None,
                "gathers_per_step": ((variant.summary or {}).get("wire") or {}).get("gathers_per_step") if variant else None,
            }
        base_steady = (out.get("bf16") or {}).get("steady")
        if entry["steady"] and base_steady and case != "bf16":
            entry["steady"]["throughput_ratio"] = entry["steady"]["tokens_per_s"] / base_steady["tokens_per_s"]
            entry["steady"]["step_time_ratio"] = entry["steady"]["step_time_s_mean"] / base_steady["step_time_s_mean"]
        gathered = _gathered_bytes(main)
        entry["all_gather_bytes_per_step"] = gathered
        entry["all_gather_bytes_vs_bf16"] = (gathered / bf16_bytes) if gathered and bf16_bytes else None
        out[case] = entry
    out["notes"] = [
        f"steady: the first {settings.warmup_steps} steps are left out; tokens/s = steady tokens / steady training time, "
        "step time = mean (and median) of the steady steps' training time (wall time less the checkpoint saves, "
        "digests and probe sampling inside the step: docs/outputs.md \"Step times\"), the same statistics for every "
        "case (design spec §17.4)",
        "reshard/recompute deltas come from the short variant runs (median of their steps after the second): "
        "indicative, compare them within one report",
        "on CPU, peak memory is each process's peak RSS (ru_maxrss: Python, libraries and the data included), not "
        "device memory; it does not show an 8-bit saving",
        f"load: mean of the 1-min load average at the start and end of each main run; a spread above "
        f"{LOAD_SPREAD_WARNING:g} between the cases is flagged",
    ]
    out["load"] = load_comparison(runs)
    return out


# ------------------------------------------------------------------------------------------------
# Raw data and plots


def write_per_step_csv(runs: dict[str, RunResult], path: Path) -> None:
    """One row per run, rank and optimizer step (the step records, with rank 0's loss and grad norm)."""
    fields = ["run", "case", "rank", "step", "loss", "grad_norm", "step_time_s", "tokens", "tokens_per_s",
              "peak_memory_bytes", "peak_memory_source"]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for name, run in sorted(runs.items()):
            for rank in run.probe("steps"):
                for record in rank.get("records", []):
                    writer.writerow({"run": name, "case": run.spec.case.name, "rank": rank["_rank"], **record})


def _plot_curves(runs: dict[str, RunResult], path: Path, thresholds: Thresholds = BUILTIN_THRESHOLDS) -> list[str]:
    """Loss and grad norm of the finished main runs, raw and smoothed, with the band around bf16's
    smoothed loss (the wider ``short_run_loss_rel``); returns the loss panel's legend labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_norm) = plt.subplots(1, 2, figsize=(12, 4.5))
    for case in (c.name for c in CASES):
        run = runs.get(f"main/{case}")
        if run is None or not run.ok:
            continue
        first = run.summary.get("first_step", 0)
        losses, norms = run.summary["losses"], run.summary["grad_norms"]
        steps = list(range(first + 1, first + len(losses) + 1))
        color = _COLORS[case]
        ax_loss.plot(steps, losses, color=color, alpha=0.3, linewidth=1)
        smooth = _moving_mean(losses, SMOOTHING_STEPS)
        ax_loss.plot(steps, smooth, color=color, linewidth=2, linestyle=_STYLES[case],
                     label=f"{case} (trailing mean of {SMOOTHING_STEPS})")
        if case == "bf16":
            band = max(thresholds.get(None, "short_run_loss_rel", p) for p in ("mxfp8", "hif8"))
            ax_loss.fill_between(steps, [v * (1 - band) for v in smooth], [v * (1 + band) for v in smooth],
                                 color=color, alpha=0.12, label=f"band: ±{100 * band:g} % of bf16 (smoothed)")
        clean = [n if n is not None else math.nan for n in norms]
        ax_norm.plot(steps, clean, color=color, alpha=0.3, linewidth=1)
        ax_norm.plot(steps, _moving_mean(clean, SMOOTHING_STEPS), color=color, linewidth=2, linestyle=_STYLES[case],
                     label=case)
    ax_loss.set(xlabel="optimizer step", ylabel="training loss", title="Loss (raw and smoothed)")
    ax_norm.set(xlabel="optimizer step", ylabel="gradient norm (pre-clip)", title="Grad norm (raw and smoothed)")
    for ax in (ax_loss, ax_norm):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    labels = ax_loss.get_legend_handles_labels()[1]
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return labels


def _plot_resume(q3_09: Row, settings: STSettings, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for case in (c.name for c in CASES):
        continuous = q3_09.evidence.get(f"{case}.continuous_losses") or []
        resumed = q3_09.evidence.get(f"{case}.resumed_losses") or []
        steps = list(range(settings.save_step + 1, settings.save_step + 1 + max(len(continuous), len(resumed))))
        ax.plot(steps[: len(continuous)], continuous, color=_COLORS[case], linewidth=2, label=f"{case} continuous")
        ax.plot(steps[: len(resumed)], resumed, color=_COLORS[case], linestyle="none", marker="x", markersize=9,
                label=f"{case} resumed")
    ax.set(xlabel="optimizer step", ylabel="training loss", title=f"Resume from step {settings.save_step} (Q3-09)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _steady_cases(perf: dict[str, Any]) -> list[str]:
    return [c.name for c in CASES if (perf.get(c.name) or {}).get("steady")]


def _plot_performance(perf: dict[str, Any], path: Path) -> list[str]:
    """Step time, peak memory and time-share panels of the cases with steady data (a panel only with
    data); returns the panel titles, which say which backend ran and what the memory is."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = _steady_cases(perf)
    backends = sorted({perf[c]["steady"].get("backend") for c in cases} - {None, "none"})
    memory = [(perf[c]["peak_memory_bytes"] or {}).get("per_rank") or [] for c in cases]
    shares = [(perf[c].get("time_shares") or {}).get("shares") or {} for c in cases]
    categories = sorted({k for sh in shares for k in sh})
    panels = 1 + any(memory) + bool(categories)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4.4), squeeze=False)
    axes = list(axes[0])
    ax = axes.pop(0)
    ax.bar(cases, [perf[c]["steady"]["step_time_s_mean"] for c in cases], color=[_COLORS[c] for c in cases])
    backend = f"\n({', '.join(backends)} backend" + (": the emulation's cost)" if backends == ["emulated"] else ")")
    ax.set(ylabel="s", title="Steady mean step time" + (backend if backends else ""))
    if any(memory):
        ax = axes.pop(0)
        for i, (case, ranks) in enumerate(zip(cases, memory)):
            ax.bar([i + (r - (len(ranks) - 1) / 2) * 0.35 for r in range(len(ranks))],
                   [(m or 0) / 2**20 for m in ranks], width=0.33, color=_COLORS[case])
        ax.set_xticks(range(len(cases)), cases)
        source = next(((perf[c]["peak_memory_bytes"] or {}).get("source") for c in cases), None)
        ax.set(ylabel="MiB", title="Peak process RSS per rank\n(whole process: not a low-precision saving)"
               if source == "ru_maxrss" else f"Peak device memory per rank\n({source})")
    if categories:
        ax = axes.pop(0)
        bottoms = [0.0] * len(cases)
        for category in categories:
            values = [sh.get(category, 0.0) for sh in shares]
            ax.bar(cases, values, bottom=bottoms, label=category)
            bottoms = [b + v for b, v in zip(bottoms, values)]
        ax.set(ylabel="share of step time", title="Profiler time shares\n(resumed runs' last steps, host time)")
        ax.legend(fontsize=7)
    titles = [a.get_title() for a in fig.axes]
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return titles


def _num(value: Any, scale: float = 1.0, digits: int = 3) -> str:
    return "—" if value is None else f"{value / scale:.{digits}g}"


def _load_markdown(load: dict[str, Any]) -> list[str]:
    lines = [f"> **Warning:** {w}." for w in load.get("warnings", [])]
    return lines + [""] if lines else []


def _performance_markdown(perf: dict[str, Any]) -> list[str]:
    cases = [c.name for c in CASES if isinstance(perf.get(c.name), dict)]
    load = perf.get("load") or {}
    lines = _load_markdown(load) + ["| | " + " | ".join(cases) + " |", "|---|" + "---|" * len(cases)]

    empty: list[str] = []

    def line(label: str, values: list[str]) -> None:
        if all(not v.strip("—/() ") for v in values):  # no case has this figure: say so below, no empty row
            empty.append(label)
        else:
            lines.append(f"| {label} | " + " | ".join(values) + " |")

    steady = [perf[c].get("steady") or {} for c in cases]
    line("steady tokens/s", [_num(s.get("tokens_per_s"), digits=4) for s in steady])
    line("steady step time, mean / median (s)",
         [f"{_num(s.get('step_time_s_mean'))} / {_num(s.get('step_time_s_median'))}" for s in steady])
    for label, values in timing_lines(steady, [perf[c].get("time_shares") or {} for c in cases]):
        line(label, values)
    line("throughput_ratio / step_time_ratio vs bf16",
         [f"{_num(s.get('throughput_ratio'))} / {_num(s.get('step_time_ratio'))}" if "step_time_ratio" in s else "—"
          for s in steady])
    memory = [perf[c].get("peak_memory_bytes") or {} for c in cases]
    kind = "process RSS" if any(m.get("source") == "ru_maxrss" for m in memory) else "device memory"
    line(f"peak {kind} per rank (MiB)", [", ".join(_num(m, 2**20, 4) for m in mem.get("per_rank") or []) or "—"
                                        for mem in memory])
    line(f"peak {kind}, max / all ranks (MiB)",
         [f"{_num(mem.get('max'), 2**20, 4)} / {_num(mem.get('global'), 2**20, 4)}" for mem in memory])
    shares = [(perf[c].get("time_shares") or {}).get("shares") or {} for c in cases]
    for category in sorted({k for sh in shares for k in sh}):
        line(f"time share: {category}", [f"{100 * sh[category]:.1f} %" if category in sh else "—" for sh in shares])
    line("all-gather bytes per step (vs bf16)",
         [f"{_num(perf[c].get('all_gather_bytes_per_step'), digits=4)} ({_num(perf[c].get('all_gather_bytes_vs_bf16'))})"
          for c in cases])
    for kind in ("reshard", "recompute"):
        deltas = [perf[c].get(f"{kind}_delta") or {} for c in cases]
        line(f"{kind} run: step time ratio to main", [_num(d.get("ratio")) for d in deltas])
        line(f"{kind} run: all-gather bytes per step", [_num(d.get("all_gather_bytes_per_step"), digits=4) for d in deltas])
    per_case = [(load.get("per_case") or {}).get(c) or {} for c in cases]

    def start_end(entry: dict[str, Any]) -> str:
        average = entry.get("load_average") or {}
        values = [f"{v[0]:.2f}" if v else "—" for v in (average.get("start"), average.get("end"))]
        return f"{' / '.join(values)} (mean {_num(entry.get('load_1min'))})" if average else "—"

    def threads(entry: dict[str, Any]) -> str:
        t = entry.get("threads") or {}
        return (f"{t.get('torch_intra_op')} / {t.get('torch_inter_op')} / {t.get('OMP_NUM_THREADS')} "
                f"(cpus {t.get('cpu_count')})") if t else "—"

    line("machine load, 1-min average at start / end of main run", [start_end(e) for e in per_case])
    line("threads: torch intra-op / inter-op / OMP_NUM_THREADS (rank 0)", [threads(e) for e in per_case])
    lines += [""] + [f"- {note}" for note in perf.get("notes", [])]
    if empty:
        lines.append(f"- not measured in this report (their runs did not run or were too short): {'; '.join(empty)}")
    return lines + [""]


def _rounded(value: Any) -> Any:
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def _fmt(value: Any) -> str:
    text = json.dumps(_json_safe(_rounded(value)), default=str)
    return text if len(text) <= 160 else text[:157] + "..."


def _row_markdown(row: Row) -> list[str]:
    lines = [f"### {row.id} {row.title}: **{row.shown_verdict}**", ""]
    if row.not_applicable:
        lines += [f"Not applicable: {row.not_applicable}." if row.verdict == "not-applicable" else
                  f"Would be not-applicable ({row.not_applicable}), but a check fails.", ""]
    lines += ["| check | ok | observed | expected |", "|---|---|---|---|"]
    for c in row.checks:
        ok = f"n/a ({c.not_applicable})" if c.not_applicable else "yes" if c.ok else "**NO**"
        lines.append(f"| {c.name} | {ok} | {_fmt(c.observed)} | {_fmt(c.expected)} |")
    lines += [""] + [f"- {note}" for note in row.notes] + ([""] if row.notes else [])
    return lines


def _header(settings: STSettings, runs: dict[str, RunResult], meta: dict[str, Any]) -> list[str]:
    """The report's first lines: reduced or not, devices and step counts, what ran, was reused or did not run."""
    lines = []
    if settings.reduced:
        lines += ["**REDUCED run (`--reduced true`): a smoke run below the design spec §17 step counts or cases; not "
                  "an acceptance.**", ""]
    lines.append(f"- devices: {settings.devices} process(es) per run; steps: main {settings.warmup_steps} warm-up + "
                 f"{settings.steady_steps} steady = {settings.steps} (checkpoint at {settings.save_step}), resume "
                 f"{settings.resume_steps} (profiled {settings.profile_steps}), variants {settings.variant_steps} "
                 f"(accumulation {settings.accumulation}); required {settings.required_steps}")
    every = [s.name for s in build_runs(settings, reshard_after_forward=bool(meta.get("user_reshard_after_forward")))]
    reused = [n for n, r in runs.items() if r.reused]
    lines.append(f"- runs: {len(runs)} of the {len(every)} of the full matrix"
                 + (f"; reused from an earlier st (`--reuse_runs`): {', '.join(reused)}" if reused else ""))
    missing = [n for n in every if n not in runs]
    if missing:
        lines.append(f"- not run (not selected by `--cases`/`--rows`/`--skip`, or their continuous run failed): "
                     f"{', '.join(missing)}")
    return lines + [f"- {k}: `{_fmt(v)}`" for k, v in meta.items()]


def write_report(
    out: Path,
    *,
    rows: list[Row],
    runs: dict[str, RunResult],
    settings: STSettings,
    numerics: dict[str, Any],
    numerics_rows: list[Row],
    meta: dict[str, Any],
    thresholds: Thresholds = BUILTIN_THRESHOLDS,
) -> dict[str, Any]:
    """Writes ``report.json``, ``report.md``, ``per_step.csv`` and the plots under ``out``; returns the JSON dict.

    A plot or table without data is left out and the report says what did not run instead. ``thresholds``
    (the tolerances the rows used) is recorded verbatim (``report.json`` ``thresholds``, a report.md
    section). ``summary`` counts the verdicts of every row, Q3, ``conformance`` and N (the exit status
    reads them all); ``summary.provisional`` the passes that rest on a built-in threshold.
    """
    plots: dict[str, str] = {}
    perf = performance_section(runs, settings)
    q3_09 = next((r for r in rows if r.id == "Q3-09"), None)
    finished = [c.name for c in CASES if f"main/{c.name}" in runs and runs[f"main/{c.name}"].ok]
    drawings = []
    if finished:
        drawings.append(("loss_grad_norm.png", lambda p: _plot_curves(runs, p, thresholds)))
    if _steady_cases(perf):
        drawings.append(("performance_memory.png", lambda p: _plot_performance(perf, p)))
    if q3_09 is not None and any(q3_09.evidence.get(f"{c.name}.{k}_losses") for c in CASES for k in ("continuous", "resumed")):
        drawings.append(("resume.png", lambda p: _plot_resume(q3_09, settings, p)))
    for name, draw in drawings:
        draw(out / name)
        plots[name.removesuffix(".png")] = name
    plots.update(numerics.get("plots", {}))
    write_per_step_csv(runs, out / "per_step.csv")
    report = {
        "rows": [r.as_dict() for r in rows],
        "summary": {v: sum(r.verdict == v for r in [*rows, *numerics_rows]) for v in ("pass", "fail", "not-applicable")}
        | {"provisional": sum(r.provisional and r.verdict == "pass" for r in [*rows, *numerics_rows])},
        "thresholds": thresholds.as_report(),
        "numerics": {**{k: v for k, v in numerics.items() if k != "plots"}, "checks": [r.as_dict() for r in numerics_rows]},
        "performance": perf,
        "runs": [{"name": n, "folder": str(r.folder), "exit_code": r.exit_code, "seconds": round(r.seconds, 1),
                  "reused": r.reused, "error": r.error} for n, r in runs.items()],
        "settings": {k: getattr(settings, k) for k in settings.__dataclass_fields__} | {"steps": settings.steps,
                                                                                       "save_step": settings.save_step},
        "plots": plots,
        "sections": report_sections(rows, numerics_rows, runs, settings),
        **meta,
    }
    (out / "report.json").write_text(json.dumps(_json_safe(report), indent=1, default=str) + "\n")
    counts = ", ".join(f"{n} {verdict}" for verdict, n in report["summary"].items() if verdict != "provisional")
    if report["summary"]["provisional"]:
        counts += f" ({report['summary']['provisional']} of the passes on provisional thresholds)"
    title = "Reduced smoke run (not an acceptance)" if settings.reduced else "Acceptance report (design spec §17)"
    md = [f"# {title}: {counts}", ""] + _header(settings, runs, meta)
    md += ["", "| row | scenario | verdict |", "|---|---|---|"]
    md += [f"| {r.id} | {r.title} | {r.shown_verdict} |" for r in rows]
    md += [""] + thresholds_markdown(thresholds)
    md += ["", "## Loss and grad norm (§17.3.2)", ""]
    md += (["![curves](loss_grad_norm.png)", ""] if "loss_grad_norm" in plots
           else ["No curves: no main run finished.", ""])
    if not any(r.id == "N-3" for r in numerics_rows):
        md += ["N-3 (short-run curves against bf16) not evaluated: it needs main/bf16, main/mxfp8 and "
               f"main/hif8_current; finished: {', '.join(f'main/{c}' for c in finished) or 'none'}.", ""]
    if not numerics:
        md += ["Layered numerics N-1/N-2 (§17.3.2 items 1-2) not run (`--skip numerics`).", ""]
    for r in numerics_rows:
        md += _row_markdown(r)
    for key, name in numerics.get("plots", {}).items():
        md += [f"![{key}]({name})", ""]
    md += ["## Q3 rows (§17.2)", ""]
    for r in rows:
        md += _row_markdown(r)
    md += (["![resume](resume.png)", ""] if "resume" in plots else []) + ["## Performance and memory (§17.4)", ""]
    if "performance_memory" in plots:
        md += ["![performance](performance_memory.png)", ""]
    md += _performance_markdown(perf) if any(c.name in perf for c in CASES) else [
        "Not measured: no main run ran (`--cases`/`--rows` selected none).", ""]
    md += sections_markdown(report["sections"])
    md += conformance_section(out, rows)
    md += parity_section(out, rows)
    (out / "report.md").write_text("\n".join(md) + "\n")
    return report
