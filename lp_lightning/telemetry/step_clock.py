"""Training time of an optimizer step: its wall time less the non-training work inside it (design spec §17.4).

A step is timed from its first micro-batch's ``on_train_batch_start`` to its last micro-batch's
``on_train_batch_end``. Other callbacks run in between — before or after the timer's own hooks,
depending on their order in ``trainer.callbacks`` — and some of them do work that is not training:
a checkpoint save, the acceptance harness's state digest, a probe hashing tensors on a sampled
step. That work opens a :func:`lp_lightning.observers.non_training` range; :class:`StepClock`
observes the ranges and subtracts the part of each that falls inside the step's window, so the
training time does not depend on the callback order: a range outside the window costs nothing, a
range inside it is measured and subtracted.

On an asynchronous device (CUDA, NPU) the host clock runs ahead of the device. The clock therefore
synchronises the device at the window's edges and at both edges of a range: device work queued by
training before a range is charged to training, the range's own device work (a copy to host) to
the range. On the CPU nothing is synchronised.

``run_summary.json`` records all three per step: ``step_wall_times_s`` (the window),
``non_training_s`` (the ranges inside it) and ``step_times_s`` (their difference, the training
time every steady figure uses), plus the ``non_training`` section (seconds per kind inside and
outside the windows).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from lp_lightning.observers import NonTrainingEvent, ObserverHandle, add_non_training_observer

__all__ = ["StepClock", "StepTime", "synchronize"]


def synchronize(device: torch.device) -> None:
    """Waits for the work queued on ``device`` (CUDA: ``torch.cuda.synchronize``; NPU:
    ``torch_npu.npu.synchronize``; the CPU and other devices: nothing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch_npu = sys.modules.get("torch_npu")  # an npu device exists only once torch_npu is imported
        if torch_npu is not None:
            torch_npu.npu.synchronize()


@dataclass(frozen=True)
class StepTime:
    """One timed optimizer step.

    Attributes:
        wall_s: Seconds from the window's open to its close.
        non_training_s: Seconds of non-training ranges inside the window (outermost ranges only).
        training_s: ``wall_s - non_training_s`` (never below 0).
        non_training_by_kind: ``{kind: seconds}`` inside the window.
    """

    wall_s: float
    non_training_s: float
    training_s: float
    non_training_by_kind: dict[str, float]


class StepClock:
    """Times optimizer-step windows and subtracts the non-training ranges that fall inside them.

    Call :meth:`start` once (registers the observer), :meth:`open` / :meth:`close` around every
    step, :meth:`stop` at the end (idempotent). Ranges are the outermost
    :func:`~lp_lightning.observers.non_training` ranges of any thread; an ``end`` without a
    ``begin`` (the clock started inside a range) is ignored.

    Args:
        device: The run's device, synchronised at every edge when it is CUDA or NPU.

    Attributes:
        inside_s: ``{kind: seconds}`` of non-training work inside the windows, since :meth:`start`.
        outside_s: ``{kind: seconds}`` of non-training work outside every window.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device if device is not None else torch.device("cpu")
        self.inside_s: Counter[str] = Counter()
        self.outside_s: Counter[str] = Counter()
        self._handle: ObserverHandle | None = None
        self._t0: float | None = None
        self._depth = 0
        self._range: tuple[str, float] | None = None
        self._step_s: Counter[str] = Counter()

    @property
    def is_open(self) -> bool:
        """A step window is open."""
        return self._t0 is not None

    def start(self) -> StepClock:
        """Resets the totals and starts observing the non-training ranges."""
        self.stop()
        self.inside_s, self.outside_s = Counter(), Counter()
        self._t0, self._depth, self._range, self._step_s = None, 0, None, Counter()
        self._handle = add_non_training_observer(self._observe)
        return self

    def stop(self) -> None:
        """Stops observing (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _now(self) -> float:
        synchronize(self.device)
        return time.perf_counter()

    def _count(self, kind: str, begin: float, end: float) -> None:
        """Splits the range ``[begin, end]`` into the part inside the open window and the part outside."""
        inside = end - max(begin, self._t0) if self._t0 is not None else 0.0
        inside = max(inside, 0.0)
        self._step_s[kind] += inside
        self.inside_s[kind] += inside
        self.outside_s[kind] += max(end - begin - inside, 0.0)

    def _observe(self, event: NonTrainingEvent) -> None:
        if event.phase == "begin":
            self._depth += 1
            if self._depth == 1:
                self._range = (event.kind, self._now())
        elif event.phase == "end" and self._depth > 0:
            self._depth -= 1
            if self._depth == 0 and self._range is not None:
                kind, begin = self._range
                self._count(kind, begin, self._now())
                self._range = None

    def open(self) -> None:
        """Opens a step window now (the device's queued work is waited for first)."""
        self._t0 = self._now()
        self._step_s = Counter()

    def close(self) -> StepTime:
        """Closes the open window and returns its times.

        A range still open at the close is counted up to now, and only from now on for the next window.

        Raises:
            RuntimeError: no window is open.
        """
        if self._t0 is None:
            raise RuntimeError("StepClock.close: no step window is open; call open() at the step's start first.")
        now = self._now()
        if self._range is not None:
            kind, begin = self._range
            self._count(kind, begin, now)
            self._range = (kind, now)
        wall = now - self._t0
        non_training = float(min(sum(self._step_s.values(), 0.0), wall))
        by_kind = {kind: seconds for kind, seconds in sorted(self._step_s.items()) if seconds > 0}
        self._t0, self._step_s = None, Counter()
        return StepTime(wall, non_training, max(wall - non_training, 0.0), by_kind)

    def totals(self) -> dict[str, Any]:
        """``{"inside_steps_s": {kind: s}, "outside_steps_s": {kind: s}}`` since :meth:`start`."""
        return {
            "inside_steps_s": {k: v for k, v in sorted(self.inside_s.items()) if v > 0},
            "outside_steps_s": {k: v for k, v in sorted(self.outside_s.items()) if v > 0},
        }
