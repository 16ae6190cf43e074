"""Loss parity of the 8-bit runs against BF16 and BF16's own noise floor (``benchmarks/parity.py``).

A *parity run* is one finished ``lp-lightning fit`` folder: ``run_summary.json`` (per-step training
losses, last validation loss) and the CSV logger's ``metrics.csv`` (the validation loss at every
validation). The runs of one suite are keyed ``(seed, variant)``; the variant ``bf16`` of a seed is
its baseline and :data:`NOISE_VARIANT` is bf16 again with a perturbation that should not matter
(AdamW eps x 1.01, or another data order), whose gap to the baseline measures how far two BF16 runs
of that seed drift apart by chance.

Figures (:func:`analyse`), for each seed and variant, in % of the baseline (positive: higher loss
than bf16):

* ``train_gap_pct``: gap of the mean training loss of the last ``last`` steps (default 50);
* ``val_gap_pct``: gap of the last validation loss (the same fixed validation tokens in every run);
* ``window_gap_pct``: gap of the mean training loss of each ``window``-step window (does it grow?);
* ``*_noise_units``: the gap divided by the noise floor, the RMS over seeds of the noise-floor
  run's gap (``noise_floor.train_pct`` / ``val_pct``); ``None`` without a noise-floor run.

Per variant over seeds: mean, sample standard deviation, worst (largest) and largest-magnitude gap,
the mean in noise units, and ``within_pct``: every seed's training and validation gap within
``tolerance_pct`` (2 %) in magnitude.
"""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lp_lightning.telemetry.loss_plot import trailing_mean

__all__ = ["LAST_STEPS", "NOISE_VARIANT", "PRECISIONS", "TOLERANCE_PCT", "ParityRun", "analyse",
           "load_parity_run", "markdown", "plot"]

PRECISIONS = ("bf16", "mxfp8", "hif8")
BASELINE = "bf16"
NOISE_VARIANT = "bf16_noise"
LAST_STEPS = 50
TOLERANCE_PCT = 2.0
"""Issue 25's parity bar: an 8-bit run within 2 % of bf16 on the last-50 mean and the validation loss."""
SMOOTHING_STEPS = 20


@dataclass(frozen=True)
class ParityRun:
    """What the figures read from one run folder.

    Attributes:
        losses: Training loss of steps 1..N (nats/token); ``nan`` for a skipped step.
        val: ``(step, validation loss)`` at each validation, in step order.
        folder: The run folder.
    """

    losses: tuple[float, ...]
    val: tuple[tuple[int, float], ...]
    folder: Path

    @property
    def val_last(self) -> float | None:
        return self.val[-1][1] if self.val else None


def _val_series(folder: Path) -> tuple[tuple[int, float], ...]:
    """``(optimizer step, val/loss)`` from the newest ``logs/version_N/metrics.csv`` (CSV logger) under ``folder``."""
    versions = sorted(folder.glob("logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    if not versions:
        return ()
    out: dict[int, float] = {}
    with open(versions[-1], newline="") as f:
        for row in csv.DictReader(f):
            if row.get("val/loss"):
                out[int(row["step"]) + 1] = float(row["val/loss"])  # the CSV logger's step is 0-based
    return tuple(sorted(out.items()))


def load_parity_run(folder: Path) -> ParityRun:
    """Reads one finished fit folder.

    Raises:
        FileNotFoundError: ``folder`` has no ``run_summary.json`` (the run did not finish); the fix is
            to run the suite again (finished runs are reused).
    """
    import json

    path = Path(folder) / "run_summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no run summary; the run did not finish. Run the parity suite again "
                                "(finished runs are reused).")
    summary = json.loads(path.read_text())
    losses = tuple(math.nan if v is None else float(v) for v in summary["losses"])
    val = _val_series(Path(folder))
    if not val and summary.get("val_loss_last") is not None:
        val = ((len(losses), float(summary["val_loss_last"])),)
    return ParityRun(losses, val, Path(folder))


def _mean(values: Any) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else math.nan


def _pct(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or not math.isfinite(value) or not math.isfinite(base) or base == 0:
        return None
    return 100.0 * (value - base) / base


def _units(gap: float | None, floor: float | None) -> float | None:
    return None if gap is None or not floor else gap / floor


def _rms(values: list[float]) -> float | None:
    return math.sqrt(statistics.fmean(v * v for v in values)) if values else None


def _digits(key: str) -> int:
    if "noise_units" in key:
        return 2
    return 5 if key in ("train_last_mean", "val_last") else 4


def _rounded(value: Any, key: str = "") -> Any:
    """``value`` with every float rounded for the JSON (losses 5 decimals, noise units 2, % 4)."""
    if isinstance(value, dict):
        return {k: _rounded(v, k if key not in ("val_gap_pct_by_step",) else key) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v, key) for v in value]
    return round(value, _digits(key)) if isinstance(value, float) else value


def analyse(runs: dict[tuple[int, str], ParityRun], *, last: int = LAST_STEPS, window: int = 50,
            tolerance_pct: float = TOLERANCE_PCT) -> dict[str, Any]:
    """The parity figures of ``runs`` (keys ``(seed, variant)``; every seed needs its ``bf16`` run).

    Returns:
        ``{"per_seed": {seed: {variant: {...}}}, "noise_floor": {...}, "overall": {variant: {...}},
        "last_steps", "window_steps", "tolerance_pct"}``; losses in nats/token, gaps in %.

    Raises:
        ValueError: a seed without its bf16 run, or runs of one seed with different step counts.
    """
    seeds = sorted({s for s, _ in runs})
    per_seed: dict[int, dict[str, Any]] = {}
    for seed in seeds:
        base = runs.get((seed, BASELINE))
        if base is None:
            raise ValueError(f"seed {seed}: no {BASELINE} run; every seed needs its baseline.")
        base_train = _mean(base.losses[-last:])
        rows: dict[str, Any] = {}
        for (s, name), run in sorted(runs.items()):
            if s != seed:
                continue
            if len(run.losses) != len(base.losses):
                raise ValueError(f"seed {seed}: {name} has {len(run.losses)} steps, {BASELINE} {len(base.losses)}; "
                                 "compare runs of the same length.")
            train = _mean(run.losses[-last:])
            windows = [
                _pct(_mean(run.losses[k:k + window]), _mean(base.losses[k:k + window]))
                for k in range(0, len(run.losses), window)
            ]
            rows[name] = {"train_last_mean": train, "val_last": run.val_last,
                          "train_gap_pct": _pct(train, base_train),
                          "val_gap_pct": _pct(run.val_last, base.val_last),
                          "window_gap_pct": windows if name != BASELINE else None,
                          "val_gap_pct_by_step": {str(step): _pct(v, dict(base.val).get(step))
                                                  for step, v in run.val} if name != BASELINE else None}
        per_seed[seed] = rows
    noise = [per_seed[s][NOISE_VARIANT] for s in seeds if NOISE_VARIANT in per_seed[s]]
    floor = {"train_pct": _rms([n["train_gap_pct"] for n in noise if n["train_gap_pct"] is not None]),
             "val_pct": _rms([n["val_gap_pct"] for n in noise if n["val_gap_pct"] is not None]),
             "seeds": len(noise), "variant": NOISE_VARIANT}
    overall: dict[str, Any] = {}
    names = sorted({n for _, n in runs} - {BASELINE}, key=lambda n: (n not in PRECISIONS, n == NOISE_VARIANT, n))
    for name in names:
        for seed in seeds:
            row = per_seed[seed].get(name)
            if row is not None:
                row["train_noise_units"] = _units(row["train_gap_pct"], floor["train_pct"])
                row["val_noise_units"] = _units(row["val_gap_pct"], floor["val_pct"])
        rows = [per_seed[s][name] for s in seeds if name in per_seed[s]]
        summary: dict[str, Any] = {"seeds": len(rows)}
        for key in ("train", "val"):
            gaps = [r[f"{key}_gap_pct"] for r in rows if r[f"{key}_gap_pct"] is not None]
            summary[f"{key}_gap_pct_mean"] = statistics.fmean(gaps) if gaps else None
            summary[f"{key}_gap_pct_std"] = statistics.stdev(gaps) if len(gaps) > 1 else None
            summary[f"{key}_gap_pct_worst"] = max(gaps) if gaps else None
            summary[f"{key}_gap_pct_max_abs"] = max(abs(g) for g in gaps) if gaps else None
            summary[f"{key}_noise_units_mean"] = _units(summary[f"{key}_gap_pct_mean"], floor[f"{key}_pct"])
        summary["within_pct"] = bool(rows) and all(
            r[k] is not None and abs(r[k]) <= tolerance_pct for r in rows for k in ("train_gap_pct", "val_gap_pct"))
        overall[name] = summary
    result = {"per_seed": {str(s): v for s, v in per_seed.items()}, "noise_floor": floor, "overall": overall,
              "last_steps": last, "window_steps": window, "tolerance_pct": tolerance_pct}
    return _rounded(result)  # once, at the end: the noise units come from the unrounded gaps


_COLORS = {"bf16": "black", "mxfp8": "tab:blue", "hif8": "tab:orange", "hif8_current": "tab:orange",
           NOISE_VARIANT: "tab:gray"}  # hif8_current: the st case of hif8
_STYLES = ("-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 3)), (0, (8, 3)))


def plot(runs: dict[tuple[int, str], ParityRun], result: dict[str, Any], path: Path) -> Path:
    """Draws the smoothed training curves (trailing mean of 20 steps; validation losses as points) and
    each variant's smoothed gap to bf16 in % with the noise band (+- the training noise floor) and the
    +- tolerance lines into ``path`` (PNG, matplotlib's object API: no pyplot state)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 7.5), dpi=100)
    top, bottom = fig.subplots(2, 1, sharex=True)
    seeds = sorted({s for s, _ in runs})
    other = iter(["tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive"])
    colors = dict(_COLORS)
    for _, name in sorted(runs):
        colors.setdefault(name, next(other, "tab:cyan"))
    steps_of_run = max(len(r.losses) for r in runs.values())
    smoothing = min(SMOOTHING_STEPS, max(1, steps_of_run // 5))
    for i, seed in enumerate(seeds):
        style = _STYLES[i % len(_STYLES)]
        base = trailing_mean(runs[(seed, BASELINE)].losses, smoothing)
        for (s, name), run in sorted(runs.items()):
            if s != seed:
                continue
            steps = range(1, len(run.losses) + 1)
            smooth = trailing_mean(run.losses, smoothing)
            label = name if i == 0 else None
            top.plot(steps, smooth, linestyle=style, color=colors[name], linewidth=1.2, label=label)
            if run.val:
                top.plot([v[0] for v in run.val], [v[1] for v in run.val], "o", color=colors[name], markersize=3)
            if name != BASELINE:
                gaps = [100.0 * (a - b) / b if math.isfinite(a) and math.isfinite(b) and b else math.nan
                        for a, b in zip(smooth, base)]
                bottom.plot(steps, gaps, linestyle=style, color=colors[name], linewidth=1.2, label=label)
    curves = [trailing_mean(run.losses, smoothing) for run in runs.values()]
    finite = [v for c in curves for v in c if math.isfinite(v)]
    early = [c[len(c) // 6] for c in curves if c and math.isfinite(c[len(c) // 6])]
    if finite and early:  # the first steps' loss (~ln 256 for bytes) would flatten everything after them
        top.set_ylim(min(finite) * 0.98, max(early) * 1.02)
    floor = result["noise_floor"].get("train_pct")
    if floor:
        bottom.axhspan(-floor, floor, color="tab:gray", alpha=0.2,
                       label=f"noise floor ±{floor:.3g} % (RMS over seeds of the {NOISE_VARIANT} gap)")
    tol = result["tolerance_pct"]
    for y in (-tol, tol):
        bottom.axhline(y, color="tab:red", linestyle="--", linewidth=0.8)
    bottom.axhline(0, color="black", linewidth=0.5)
    settings = result.get("settings", {})
    width = f"hidden {settings['width']}, " if settings.get("width") else ""
    top.set_title(f"Parity: {width}{steps_of_run} steps, seeds {', '.join(map(str, seeds))} (line style = seed; "
                  "points = validation)", fontsize=10)
    top.set_ylabel(f"training loss, trailing mean of {smoothing} (nats/token)")
    bottom.set_ylabel("gap to bf16 (%)")
    bottom.set_xlabel("optimizer step")
    bottom.set_ylim(-max(3 * tol, 1.0), max(3 * tol, 1.0))
    top.legend(fontsize=8, loc="upper right")
    bottom.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _f(value: Any, fmt: str = "{:+.2f}") -> str:
    return "—" if value is None else fmt.format(value)


def markdown(result: dict[str, Any], *, plot: Path | None = None, doc: Path | None = None) -> str:
    """The parity table (per seed and variant, then per variant over seeds) as markdown."""
    import os

    s = result.get("settings", {})
    floor = result["noise_floor"]
    width = f"Hidden {s['width']}, " if s.get("width") else ""
    lines = [
        f"{width}{s.get('steps')} steps, seeds {s.get('seeds')}, corpus {s.get('corpus')}; "
        f"noise floor = RMS over {floor['seeds']} seed(s) of `{floor['variant']}` ({s.get('noise')}) against bf16: "
        f"training {_f(floor['train_pct'], '{:.3f}')} %, validation {_f(floor['val_pct'], '{:.3f}')} %. "
        f"Gaps in % of bf16 (positive = higher loss), training = mean of the last {result['last_steps']} steps.",
        "",
        f"| seed | run | train last-{result['last_steps']} | gap % | / noise | val loss | gap % | / noise | gap % per "
        f"{result['window_steps']}-step window |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for seed, rows in result["per_seed"].items():
        for name, r in rows.items():
            windows = " ".join(_f(w) for w in (r.get("window_gap_pct") or []))
            lines.append(f"| {seed} | {name} | {_f(r['train_last_mean'], '{:.4f}')} | {_f(r['train_gap_pct'])} | "
                         f"{_f(r.get('train_noise_units'), '{:+.1f}')} | {_f(r['val_last'], '{:.4f}')} | "
                         f"{_f(r['val_gap_pct'])} | {_f(r.get('val_noise_units'), '{:+.1f}')} | {windows} |")
    lines += ["", "| run | seeds | train gap % mean ± std (worst) | / noise | val gap % mean ± std (worst) | / noise | "
              f"within ±{result['tolerance_pct']:g} % on every seed |", "|---|---|---|---|---|---|---|"]
    for name, o in result["overall"].items():
        spread = {k: "" if o.get(f"{k}_gap_pct_std") is None else f" ± {o[f'{k}_gap_pct_std']:.2f}" for k in ("train", "val")}
        lines.append(f"| {name} | {o['seeds']} | {_f(o['train_gap_pct_mean'])}{spread['train']} ({_f(o['train_gap_pct_worst'])}) | "
                     f"{_f(o['train_noise_units_mean'], '{:+.2f}')} | {_f(o['val_gap_pct_mean'])}{spread['val']} "
                     f"({_f(o['val_gap_pct_worst'])}) | {_f(o['val_noise_units_mean'], '{:+.2f}')} | "
                     f"{'yes' if o['within_pct'] else 'no'} |")
    m, records = result.get("machine", {}), result.get("runs", {})
    if m:
        wall = sum(r.get("wall_s") or 0 for r in records.values())
        commits = sorted({str(r.get("git_commit"))[:12] for r in records.values() if r.get("git_commit")})
        lines += ["", f"{len(records)} runs, {wall:.0f} s of run time, {s.get('jobs')} at a time with "
                  f"{s.get('threads_per_run')} thread(s) each on {m.get('cpu_model')} ({m.get('usable_cpus')} CPUs; "
                  f"each run's wall time, threads and load average are in the JSON), last measured "
                  f"{m.get('date_utc')}; runs made at git {', '.join(commits) or 'unknown'}."]
    if plot is not None:
        target = os.path.relpath(plot, doc.parent) if doc is not None else str(plot)
        lines += ["", f"![parity curves and gaps]({target})"]
    return "\n".join(lines) + "\n"
