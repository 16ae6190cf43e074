"""What the steady step times of a run hold and leave out (design spec §17.4, Q3-11).

``run_summary.json``'s ``step_times_s`` are training times: the wall time of each step's window less
the non-training work that fell inside it (:mod:`lp_lightning.telemetry.step_clock`).
:func:`steady_timing` puts the raw wall times and the subtracted seconds of the steady window next
to them, so the report shows which work was excluded and how: measured and subtracted inside a
window, or outside every window (a checkpoint save run after the step's timer closed).
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["steady_timing"]


def steady_timing(summary: dict[str, Any], warmup_steps: int) -> dict[str, Any]:
    """The non-training evidence of a run's steady steps (the first ``warmup_steps`` left out).

    Returns:
        ``timing`` (``"subtracted"``, or ``"wall (no non-training record)"`` for a summary written before
        the step clock existed), ``step_wall_time_s_mean`` (s; ``None`` without wall times),
        ``non_training_s_steady`` (s subtracted from the steady steps), ``non_training_steps`` (the
        step numbers whose window held some), ``non_training_inside_s`` / ``non_training_outside_s``
        (``{kind: s}`` inside / outside the windows, whole run).
    """
    record = summary.get("non_training") or {}
    walls = (summary.get("step_wall_times_s") or [])[warmup_steps:]
    subtracted = (summary.get("non_training_s") or [])[warmup_steps:]
    first = summary.get("first_step", 0) + warmup_steps
    return {
        "timing": record.get("timing", "wall (no non-training record)"),
        "step_wall_time_s_mean": statistics.fmean(walls) if walls else None,
        "non_training_s_steady": sum(subtracted),
        "non_training_steps": [first + i + 1 for i, s in enumerate(subtracted) if s > 0],
        "non_training_inside_s": record.get("inside_steps_s", {}),
        "non_training_outside_s": record.get("outside_steps_s", {}),
    }


def shares_source(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the profiled time shares of a run come from (``profile_rank<r>.json`` of every rank).

    Returns:
        ``source``: ``"device"`` (kernel time) or ``"host"`` (host ranges: launches on an asynchronous
        device, the compute on the CPU), ``"mixed"`` when the ranks differ; ``source_reason``: rank 0's
        reason (:mod:`lp_lightning.telemetry.profile_probe`, "Host or device"). A file written before the
        probe recorded its source held host ranges.
    """
    sources = {r.get("source") or "host" for r in ranks}
    reason = ranks[0].get("source_reason") if ranks else None
    return {"source": sources.pop() if len(sources) == 1 else "mixed",
            "source_reason": reason or "host ranges (recorded before the probe named its source)"}


def timing_lines(steady: list[dict[str, Any]], shares: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """The report's performance-table rows saying what the step times exclude and what the shares measure.

    Args:
        steady: Each case's steady figures (:func:`lp_lightning.st.rows.steady_performance`).
        shares: Each case's time shares (with :func:`shares_source`'s keys), in the same order.
    """
    def seconds(value: Any) -> str:
        return "—" if value is None else f"{value:.3g}"

    def kinds(record: dict[str, float]) -> str:
        return ", ".join(f"{kind} {value:.3g} s" for kind, value in record.items()) or "none"

    return [
        ("steady wall time, mean (s) / non-training subtracted, total (s)",
         [f"{seconds(s.get('step_wall_time_s_mean'))} / {seconds(s.get('non_training_s_steady'))}"
          if s.get("timing") == "subtracted" else "—" for s in steady]),
        ("non-training work inside / outside the step windows",
         [f"{kinds(s.get('non_training_inside_s') or {})} / {kinds(s.get('non_training_outside_s') or {})}"
          if s.get("timing") == "subtracted" else "—" for s in steady]),
        ("time shares measured on", [str(sh.get("source") or "—") for sh in shares]),
    ]
