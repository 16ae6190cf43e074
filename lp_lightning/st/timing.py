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
