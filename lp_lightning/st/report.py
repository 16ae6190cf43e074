"""The acceptance report: ``report.json``, ``report.md``, ``per_step.csv`` and PNG plots (design spec §17.3–§17.5).

``report.json`` holds ``rows`` (the Q3 rows: ``id``, ``title``, ``verdict``
``pass|fail|not-applicable``, ``checks``, ``evidence``, ``notes``), ``numerics`` (§17.3.2: the
per-operator table, the one-layer comparison, the short-run checks), ``performance`` (§17.4: steady
tokens/s and step times, ratios, per-rank and global peak memory, profiler time shares, the reshard
and recompute deltas, all-gather bytes against BF16), ``runs`` (each run's folder, exit status and
wall time), ``settings``, ``versions`` and ``plots``. ``report.md`` is the same for a reader, with
the plots inline. ``per_step.csv`` is the raw per-step data of every run and rank.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path
from typing import Any

from lp_lightning.st.cases import CASES, STSettings
from lp_lightning.st.rows import Row, steady_performance, unit_roundoff
from lp_lightning.st.runner import RunResult

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


def short_run_checks(runs: dict[str, RunResult]) -> Row:
    """No NaN/Inf, no explosion, training moves; mxfp8/hif8 final mean loss within ``u`` of bf16's."""
    row = Row("N-3")
    means = {}
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
        row.check(f"{case}: the loss moves down from step one", means[case] < losses[0] if losses else False,
                  f"first {losses[0]:.4f}, mean of last {LOSS_MEAN_STEPS} {means[case]:.4f}" if losses else None,
                  "mean of the last steps < first loss")
        row.check(f"{case}: no explosion (last grad norms within 10x of the median)",
                  finite and bool(norms) and max(norms[-LOSS_MEAN_STEPS:]) <= 10 * statistics.median(norms),
                  max(norms[-LOSS_MEAN_STEPS:]) if norms and finite else None, "<= 10 x median")
    base = means.get("bf16")
    for case in ("mxfp8", "hif8_current"):
        if base is not None and case in means:
            band = unit_roundoff(case)
            rel = (means[case] - base) / base
            row.check(f"{case}: mean loss of the last {LOSS_MEAN_STEPS} steps within the band of bf16", abs(rel) <= band,
                      f"{means[case]:.5f} vs {base:.5f} (rel {rel:+.2e})", f"|rel| <= u = {band:.2e}")
            row.evidence[f"{case}.band_rel"] = band
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
    }


def performance_section(runs: dict[str, RunResult], settings: STSettings) -> dict[str, Any]:
    """The §17.4 figures of every case (JSON-ready)."""
    out: dict[str, Any] = {}
    bf16_bytes = _gathered_bytes(runs.get("main/bf16"))
    for case in (c.name for c in CASES):
        main = runs.get(f"main/{case}")
        entry: dict[str, Any] = {"steady": steady_performance(main, settings) if main is not None and main.ok else None}
        entry["peak_memory_bytes"] = _peak_memory(main) if main is not None else None
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
        f"steady: the first {settings.warmup_steps} steps are left out; tokens/s = steady tokens / steady wall time, "
        "step time = mean (and median) of the steady steps, the same statistics for every case (design spec §17.4)",
        "reshard/recompute deltas come from the short variant runs (median of their steps after the second): "
        "indicative, compare them within one report",
        "on CPU, peak memory is each process's peak RSS (ru_maxrss: Python, libraries and the data included), not "
        "device memory; it does not show an 8-bit saving",
    ]
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


def _plot_curves(runs: dict[str, RunResult], path: Path) -> None:
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
                     label=f"{case} (mean of {SMOOTHING_STEPS})")
        if case == "bf16":
            band = max(unit_roundoff("mxfp8"), unit_roundoff("hif8_current"))
            ax_loss.fill_between(steps, [v * (1 - band) for v in smooth], [v * (1 + band) for v in smooth],
                                 color=color, alpha=0.12, label=f"bf16 ± {band:.3g} (band)")
        clean = [n if n is not None else math.nan for n in norms]
        ax_norm.plot(steps, clean, color=color, alpha=0.3, linewidth=1)
        ax_norm.plot(steps, _moving_mean(clean, SMOOTHING_STEPS), color=color, linewidth=2, linestyle=_STYLES[case],
                     label=case)
    ax_loss.set(xlabel="optimizer step", ylabel="training loss", title="Loss (raw and smoothed)")
    ax_norm.set(xlabel="optimizer step", ylabel="gradient norm (pre-clip)", title="Grad norm (raw and smoothed)")
    for ax in (ax_loss, ax_norm):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


def _plot_performance(perf: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c.name for c in CASES if (perf.get(c.name) or {}).get("steady")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    times = [perf[c]["steady"]["step_time_s_mean"] for c in cases]
    axes[0].bar(cases, times, color=[_COLORS[c] for c in cases])
    axes[0].set(ylabel="s", title="Steady mean step time")
    memory = [[(perf[c]["peak_memory_bytes"] or {}).get("per_rank") or [] for c in cases]][0]
    for i, case in enumerate(cases):
        ranks = memory[i]
        axes[1].bar([i + (r - (len(ranks) - 1) / 2) * 0.35 for r in range(len(ranks))], [(m or 0) / 2**20 for m in ranks],
                    width=0.33, color=_COLORS[case])
    axes[1].set_xticks(range(len(cases)), cases)
    source = next(((perf[c]["peak_memory_bytes"] or {}).get("source") for c in cases), None)
    axes[1].set(ylabel="MiB", title=f"Peak memory per rank ({source})")
    bottoms = [0.0] * len(cases)
    categories = sorted({k for c in cases for k in ((perf[c].get("time_shares") or {}).get("shares") or {})})
    for category in categories:
        values = [((perf[c].get("time_shares") or {}).get("shares") or {}).get(category, 0.0) for c in cases]
        axes[2].bar(cases, values, bottom=bottoms, label=category)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    axes[2].set(ylabel="share of step time", title="Profiler time shares")
    if categories:
        axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _num(value: Any, scale: float = 1.0, digits: int = 3) -> str:
    return "—" if value is None else f"{value / scale:.{digits}g}"


def _performance_markdown(perf: dict[str, Any]) -> list[str]:
    cases = [c.name for c in CASES if isinstance(perf.get(c.name), dict)]
    lines = ["| | " + " | ".join(cases) + " |", "|---|" + "---|" * len(cases)]

    def line(label: str, values: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(values) + " |")

    steady = [perf[c].get("steady") or {} for c in cases]
    line("steady tokens/s", [_num(s.get("tokens_per_s"), digits=4) for s in steady])
    line("steady step time, mean / median (s)",
         [f"{_num(s.get('step_time_s_mean'))} / {_num(s.get('step_time_s_median'))}" for s in steady])
    line("throughput_ratio / step_time_ratio vs bf16",
         [f"{_num(s.get('throughput_ratio'))} / {_num(s.get('step_time_ratio'))}" if "step_time_ratio" in s else "—"
          for s in steady])
    memory = [perf[c].get("peak_memory_bytes") or {} for c in cases]
    line("peak memory per rank (MiB)", [", ".join(_num(m, 2**20, 4) for m in mem.get("per_rank") or []) or "—"
                                        for mem in memory])
    line("peak memory, max / all ranks (MiB)",
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
    threads = (steady[0].get("threads") or {}) if steady else {}
    load = (steady[0].get("load_average") or {}) if steady else {}
    lines += ["", f"Threads (rank 0 of main/{cases[0] if cases else '?'}): `{json.dumps(threads)}`; load average at "
              f"start / end: `{load.get('start')}` / `{load.get('end')}`.", ""]
    lines += [f"- {note}" for note in perf.get("notes", [])] + [""]
    return lines


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
    lines = [f"### {row.id} {row.title}: **{row.verdict}**", ""]
    if row.not_applicable:
        lines += [f"Not applicable: {row.not_applicable}.", ""]
    lines += ["| check | ok | observed | expected |", "|---|---|---|---|"]
    for c in row.checks:
        lines.append(f"| {c.name} | {'yes' if c.ok else '**NO**'} | {_fmt(c.observed)} | {_fmt(c.expected)} |")
    lines += [""] + [f"- {note}" for note in row.notes] + ([""] if row.notes else [])
    return lines


def write_report(
    out: Path,
    *,
    rows: list[Row],
    runs: dict[str, RunResult],
    settings: STSettings,
    numerics: dict[str, Any],
    numerics_rows: list[Row],
    meta: dict[str, Any],
) -> dict[str, Any]:
    """Writes ``report.json``, ``report.md``, ``per_step.csv`` and the plots under ``out``; returns the JSON dict."""
    plots: dict[str, str] = {}
    perf = performance_section(runs, settings)
    q3_09 = next((r for r in rows if r.id == "Q3-09"), None)
    drawings = [("loss_grad_norm.png", lambda p: _plot_curves(runs, p)),
                ("performance_memory.png", lambda p: _plot_performance(perf, p))]
    if q3_09 is not None:
        drawings.append(("resume.png", lambda p: _plot_resume(q3_09, settings, p)))
    for name, draw in drawings:
        draw(out / name)
        plots[name.removesuffix(".png")] = name
    plots.update(numerics.get("plots", {}))
    write_per_step_csv(runs, out / "per_step.csv")
    report = {
        "rows": [r.as_dict() for r in rows],
        "summary": {v: sum(r.verdict == v for r in rows) for v in ("pass", "fail", "not-applicable")},
        "numerics": {**{k: v for k, v in numerics.items() if k != "plots"}, "checks": [r.as_dict() for r in numerics_rows]},
        "performance": perf,
        "runs": [{"name": n, "folder": str(r.folder), "exit_code": r.exit_code, "seconds": round(r.seconds, 1),
                  "error": r.error} for n, r in runs.items()],
        "settings": {k: getattr(settings, k) for k in settings.__dataclass_fields__} | {"steps": settings.steps,
                                                                                       "save_step": settings.save_step},
        "plots": plots,
        **meta,
    }
    (out / "report.json").write_text(json.dumps(_json_safe(report), indent=1, default=str) + "\n")
    counts = ", ".join(f"{n} {verdict}" for verdict, n in report["summary"].items())
    md = [f"# Acceptance report (design spec §17): {counts}", ""]
    md += [f"- {k}: `{_fmt(v)}`" for k, v in meta.items()]
    md += ["", "| row | scenario | verdict |", "|---|---|---|"]
    md += [f"| {r.id} | {r.title} | {r.verdict} |" for r in rows]
    md += ["", "## Loss and grad norm (§17.3.2)", "", "![curves](loss_grad_norm.png)", ""]
    for r in numerics_rows:
        md += _row_markdown(r)
    for key, name in numerics.get("plots", {}).items():
        md += [f"![{key}]({name})", ""]
    md += ["## Q3 rows (§17.2)", ""]
    for r in rows:
        md += _row_markdown(r)
    md += (["![resume](resume.png)", ""] if "resume" in plots else []) + ["## Performance and memory (§17.4)", "", "![performance](performance_memory.png)", ""]
    md += _performance_markdown(perf)
    (out / "report.md").write_text("\n".join(md) + "\n")
    return report
