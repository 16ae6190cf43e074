"""The loss plot of a run (``loss.png`` beside ``run_summary.json``) and the line a finished fit prints.

Drawn with matplotlib's object API on an Agg canvas (``matplotlib.figure.Figure``): no pyplot, so the
process's matplotlib backend and open figures are left alone (a notebook's included).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from collections.abc import Sequence
from typing import Any

__all__ = ["finished_line", "loss_plot_path", "trailing_mean", "write_loss_plot"]

SMOOTHING_STEPS = 10
"""Window of the trailing mean drawn over the raw losses (from twice that many steps on)."""


def loss_plot_path(summary_path: Path) -> Path:
    """``loss.png`` beside ``run_summary.json`` (``<stem>_loss.png`` beside a summary of another name)."""
    name = "loss.png" if summary_path.name == "run_summary.json" else f"{summary_path.stem}_loss.png"
    return summary_path.with_name(name)


def trailing_mean(values: Sequence[float], window: int) -> list[float]:
    """The mean of the last ``window`` finite values up to each position (``nan`` where there is none)."""
    out = []
    for i in range(len(values)):
        seen = [v for v in values[max(0, i - window + 1): i + 1] if math.isfinite(v)]
        out.append(statistics.fmean(seen) if seen else math.nan)
    return out


def write_loss_plot(summary: dict[str, Any], path: Path) -> Path:
    """Draws ``summary``'s per-step training losses (``losses`` from step ``first_step + 1``) into ``path``.

    A skipped (NaN) step is a gap; from 2 x :data:`SMOOTHING_STEPS` steps on a trailing mean is drawn
    too; the last validation loss is a point at the last step.

    Returns:
        ``path``.
    """
    # Imported here: only rank 0 draws, once, after training.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    losses = [float("nan") if v is None else float(v) for v in summary["losses"]]
    first = int(summary.get("first_step") or 0)
    steps = list(range(first + 1, first + 1 + len(losses)))
    fig = Figure(figsize=(6.4, 3.6), dpi=100)
    ax = fig.subplots()
    smooth = len(losses) >= 2 * SMOOTHING_STEPS
    ax.plot(steps, losses, color="tab:blue", linewidth=1, alpha=0.35 if smooth else 1.0,
            marker="o" if len(losses) < 20 else None, markersize=3, label="training loss")
    if smooth:
        ax.plot(steps, trailing_mean(losses, SMOOTHING_STEPS), color="tab:blue", linewidth=2,
                label=f"trailing mean of {SMOOTHING_STEPS}")
    if summary.get("val_loss_last") is not None and steps:
        ax.plot([steps[-1]], [summary["val_loss_last"]], "s", color="tab:orange", label="validation loss (last)")
    processes = summary.get("world_size") or 1
    ax.set(xlabel="optimizer step", ylabel="loss (nats/token)",
           title=f"{summary.get('precision')}, {processes} process{'es' if processes != 1 else ''}, "
                 f"{summary.get('tokens') or 0:,} tokens")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _loss(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def finished_line(summary: dict[str, Any], summary_path: Path) -> str:
    """What a finished fit prints (rank 0): steps, loss first -> last, steady tokens/s, the summary and plot paths."""
    steps, first = summary["steps"], summary["first_step"]
    if not steps:
        trained = "no optimizer step ran"
    else:
        rate = summary.get("tokens_per_s")
        trained = (f"steps {first + 1}-{first + steps} done, loss {_loss(summary['loss_first'])} -> "
                   f"{_loss(summary['loss_last'])}, "
                   f"{'n/a' if rate is None else f'{rate:,.0f}'} tokens/s (steady median)")
    plot = summary.get("loss_plot")
    return f"lp-lightning: {trained}; summary {summary_path}" + (f", loss plot {plot}" if plot else "")
