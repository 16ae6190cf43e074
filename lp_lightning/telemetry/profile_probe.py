"""Time shares of a few training steps from ``torch.profiler`` (design spec §17.4): ``profile_rank<r>.json``.

:class:`ProfilerProbe` (a :class:`~lp_lightning.telemetry.probe_base.ProbeCallback`) runs
``torch.profiler`` over the optimizer steps ``start_step`` … ``start_step + steps - 1`` of the fit
call (counted from 1 within the call, so the first, compiling step can be left out), marks each
profiled step with the range ``"lp_lightning::probe_step"`` and sorts the host-side (CPU) ranges
inside those steps into categories:

==================== ==========================================================================
category             ranges
==================== ==========================================================================
``quantize``         ``lp_lightning::quantize`` (every ``ops.quantize`` / ``quantize_dual``)
``low_precision_mm`` ``lp_lightning::matmul``, ``lp_lightning::grouped_matmul``
``all_gather``       FSDP2's ``FSDP::all_gather (<module>)`` and ``FSDP::all_gather_copy_out``
                     (torch 2.13 ``_fsdp_param_group.py``; a one-rank group issues none)
``reduce_scatter``   FSDP2's ``FSDP::post_backward_reduce (<module>)`` (reduce-scatter, and the
                     HSDP all-reduce of replicated weights) and ``FSDP::post_backward_rs_wait``
``high_precision_mm`` the aten GEMMs (``aten::mm``, ``aten::addmm``, ``aten::bmm``, …,
                     ``aten::matmul``, ``aten::linear``) outside the ranges above
``other``            the rest of the steps' wall time
==================== ==========================================================================

A range counts only when no enclosing range (up to the step mark) has a category: an ``aten::mm``
inside ``lp_lightning::matmul`` (the emulated backend's FP32 product of decoded operands) is
low-precision MM time, never high-precision, and nothing is counted twice. A range counts when it
starts inside a step mark's interval, on any thread (a device's autograd thread runs backward
outside the main thread's ranges). On one thread the counted ranges are disjoint, so
``other = wall - sum(categories)``; should ranges of several threads overlap in time and their sum
exceed the wall time, ``other`` is 0 and ``shares`` divide by the sum (they always sum to 1).

File keys: ``start_step``, ``window`` ``[first, last]`` (step numbers; ``null`` when none ran),
``steps_profiled``, ``complete`` (the run reached the end of the window), ``wall_s`` (sum of the
profiled steps' wall times, from the step marks), ``step_times_s``, ``categories_s`` and
``shares`` (keys ``quantize``, ``low_precision_mm``, ``high_precision_mm``, ``all_gather``,
``reduce_scatter``, ``other``), ``top_ops`` ``[[name, cpu_total_s], ...]`` (20, inclusive host
time, all profiled events), ``activities``, ``source``, ``source_reason``, ``device_s``,
``host_categories_s`` and ``host_shares``.

**Host or device.** On an asynchronous device (CUDA, or an NPU whose torch_npu makes its activity
available to ``torch.profiler`` as ``PrivateUse1``: ``torch.profiler.supported_activities()``) a host
range measures the kernel *launches*, not the kernels. When the profile holds device kernels inside
the profiled steps, ``categories_s`` and ``shares`` are device time (``"source": "device"``,
:func:`categorise_device`): each kernel's duration goes to the category of the outermost categorised
range enclosing the op that launched it (a NCCL kernel launched inside ``FSDP::all_gather`` is
all-gather time), and ``other`` is the kernel time launched outside every category; ``shares``
divide by the kernel time of the steps (``device_s``, summed over streams, so an all-gather
overlapping compute counts in both). Otherwise they are the host ranges above (``"source": "host"``;
``source_reason`` says why: a CPU run, where the host time is the compute, or no device activity);
``host_categories_s`` / ``host_shares`` always hold the host figures.
"""

from __future__ import annotations

import bisect
import sys
from typing import Any

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function, supported_activities

from lp_lightning.telemetry.probe_base import ProbeCallback, StepInfo
from lp_lightning.telemetry.probes import ATEN_GEMM_OPS

__all__ = [
    "CATEGORIES", "STEP_LABEL", "ProfilerProbe", "categorise_device", "categorise_profile", "device_activity",
    "time_shares",
]

STEP_LABEL = "lp_lightning::probe_step"
"""The range marking one profiled optimizer step."""

CATEGORIES: tuple[str, ...] = (
    "quantize", "low_precision_mm", "high_precision_mm", "all_gather", "reduce_scatter", "other",
)
"""The keys of ``categories_s`` and ``shares``."""

_HIGH_PRECISION_MM = frozenset({f"aten::{name}" for name in ATEN_GEMM_OPS} | {"aten::matmul", "aten::linear"})
_ALL_GATHER = ("FSDP::all_gather",)
_REDUCE_SCATTER = ("FSDP::post_backward_reduce", "FSDP::post_backward_rs_wait")


def _low_precision_labels() -> dict[str, str]:
    """The ops layer's labels, if it was loaded (a bf16 run never loads it and has none of them)."""
    trace = sys.modules.get("lp_lightning.ops.trace")
    if trace is None:
        return {}
    return {trace.QUANTIZE_LABEL: "quantize", trace.MATMUL_LABEL: "low_precision_mm",
            trace.GROUPED_MATMUL_LABEL: "low_precision_mm"}


def _category(name: str, labels: dict[str, str]) -> str | None:
    if name in labels:
        return labels[name]
    if name.startswith(_ALL_GATHER):
        return "all_gather"
    if name.startswith(_REDUCE_SCATTER):
        return "reduce_scatter"
    if name in _HIGH_PRECISION_MM:
        return "high_precision_mm"
    return None


def categorise_profile(events: Any) -> tuple[dict[str, float], float, list[float]]:
    """Seconds per category inside the step marks of ``events`` (``torch.profiler`` ``FunctionEvent``s).

    Returns:
        ``(categories_s, wall_s, step_times_s)``; ``categories_s`` has every key of
        :data:`CATEGORIES`, ``other`` included (see the module docstring).
    """
    labels = _low_precision_labels()
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    marks = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == STEP_LABEL)
    starts = [start for start, _ in marks]
    steps = [(end - start) / 1e6 for start, end in marks]
    for event in events:
        category = _category(event.name, labels)
        if category is None:
            continue
        index = bisect.bisect_right(starts, event.time_range.start) - 1
        if index < 0 or event.time_range.start >= marks[index][1]:
            continue  # outside every profiled step
        parent = event.cpu_parent
        while parent is not None and _category(parent.name, labels) is None:
            parent = parent.cpu_parent
        if parent is None:  # no enclosing categorised range: counted once, here
            seconds[category] += event.time_range.elapsed_us() / 1e6
    wall = sum(steps)
    seconds["other"] = max(wall - sum(seconds.values()), 0.0)
    return seconds, wall, steps


def _step_index(marks: list[tuple[float, float]], starts: list[float], start: float) -> int | None:
    """The step mark whose interval holds ``start`` (µs), or None."""
    index = bisect.bisect_right(starts, start) - 1
    return None if index < 0 or start >= marks[index][1] else index


def categorise_device(events: Any) -> tuple[dict[str, float], float] | None:
    """Device seconds per category of the kernels launched inside the step marks of ``events``.

    ``events`` are ``torch.profiler`` ``FunctionEvent`` s with device activity: a host op's
    ``kernels`` (``Kernel(name, device, duration_us)``, filled by the profiler from the device
    trace through the launch's correlation id) are attributed to the outermost categorised range
    enclosing that op (itself included), else to ``other``.

    Returns:
        ``(categories_s, device_s)``: every key of :data:`CATEGORIES`, and the kernel seconds of the
        steps (their sum); ``None`` when no kernel was launched inside a step mark (no device activity).
    """
    labels = _low_precision_labels()
    marks = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == STEP_LABEL)
    starts = [start for start, _ in marks]
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    total = 0.0
    for event in events:
        kernels = getattr(event, "kernels", None)
        if not kernels or event.device_type != DeviceType.CPU or event.name == STEP_LABEL:
            continue
        if _step_index(marks, starts, event.time_range.start) is None:
            continue  # launched outside every profiled step
        category, node = None, event
        while node is not None and node.name != STEP_LABEL:
            category = _category(node.name, labels) or category  # the outermost categorised range wins
            node = node.cpu_parent
        duration = sum(kernel.duration for kernel in kernels) / 1e6
        seconds[category or "other"] += duration
        total += duration
    return (seconds, total) if total > 0 else None


def device_activity(device_type: str) -> ProfilerActivity | None:
    """The ``torch.profiler`` activity recording ``device_type``'s kernels, or None (the CPU, or no profiler
    support for the device here: ``torch.profiler.supported_activities()``)."""
    activity = {"cuda": getattr(ProfilerActivity, "CUDA", None),
                "npu": getattr(ProfilerActivity, "PrivateUse1", None)}.get(device_type)
    return activity if activity is not None and activity in supported_activities() else None


def _shares(seconds: dict[str, float], total: float) -> dict[str, float]:
    return {key: (value / total if total > 0 else 0.0) for key, value in seconds.items()}


def time_shares(events: Any, device_type: str, device_recorded: bool) -> dict[str, Any]:
    """The probe's figures from a finished profile (module docstring, "Host or device").

    Args:
        events: The profile's ``FunctionEvent`` s.
        device_type: The run's device type (``"cpu"``, ``"cuda"``, ``"npu"``), for ``source_reason``.
        device_recorded: A device activity was requested from the profiler.

    Returns:
        ``categories_s``, ``shares``, ``source`` (``"device"`` / ``"host"``), ``source_reason``,
        ``device_s`` (kernel seconds of the steps; ``None`` for a host source), ``host_categories_s``,
        ``host_shares``, ``wall_s`` and ``step_times_s`` (from the host step marks).
    """
    host, wall, step_times = categorise_profile(events)
    host_shares = _shares(host, max(wall, sum(host.values())))
    device = categorise_device(events)
    if device is not None:
        seconds, device_s = device
        figures: dict[str, Any] = {
            "categories_s": seconds, "shares": _shares(seconds, device_s), "source": "device",
            "source_reason": f"{device_type} kernels recorded by the profiler's device activity", "device_s": device_s,
        }
    else:
        supported = sorted(str(a).removeprefix("ProfilerActivity.") for a in supported_activities())
        reason = ("a CPU run: the host ranges are the compute" if device_type == "cpu" else
                  f"no {device_type} kernel recorded inside the profiled steps" if device_recorded else
                  f"torch.profiler records no {device_type} activity here (supported: {supported}): host launch "
                  "times only")
        figures = {"categories_s": host, "shares": host_shares, "source": "host", "source_reason": reason,
                   "device_s": None}
    return {**figures, "host_categories_s": host, "host_shares": host_shares, "wall_s": wall,
            "step_times_s": step_times}


class ProfilerProbe(ProbeCallback):
    """``torch.profiler`` over a window of steps; time shares per category (``profile_rank<r>.json``).

    Args:
        start_step: First profiled step, counted from 1 within the fit call (2 leaves out the
            first step's compilation and warm-up).
        steps: Number of profiled steps.
        out_dir, sample_every: As :class:`~lp_lightning.telemetry.probe_base.ProbeCallback`.

    Raises:
        ValueError: ``start_step`` or ``steps`` is not an int >= 1.
    """

    kind = "profile"

    def __init__(self, start_step: int = 2, steps: int = 3, out_dir: str | None = None, sample_every: int = 10) -> None:
        super().__init__(out_dir=out_dir, sample_every=sample_every)
        for name, value in (("start_step", start_step), ("steps", steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ProfilerProbe: {name}={value!r} must be an int >= 1.")
        self.start_step = start_step
        self.steps = steps

    def _on_start(self) -> None:
        self._profiler: profile | None = None
        self._mark: record_function | None = None
        self._window: list[int] = []
        self._complete = False
        self._activities = [ProfilerActivity.CPU]
        activity = device_activity(self._device.type)
        if activity is not None:
            self._activities.append(activity)
        self._result: dict[str, Any] = {}

    def _on_step_start(self) -> None:
        index = self._steps + 1  # this step's position in the fit call
        if index == self.start_step and self._profiler is None and not self._result:
            self._profiler = profile(activities=self._activities, record_shapes=False, with_stack=False)
            self._profiler.__enter__()
        if self._profiler is not None:
            self._mark = record_function(STEP_LABEL)
            self._mark.__enter__()

    def _on_step_end(self, info: StepInfo) -> dict[str, float | None]:
        if self._mark is None:
            return {}
        self._mark.__exit__(None, None, None)
        self._mark = None
        self._window.append(info.step)
        if len(self._window) < self.steps:
            return {}
        self._complete = True
        self._analyse()
        return {f"profile/{key}_share": value for key, value in self._result["shares"].items()}

    def _on_stop(self) -> None:
        if self._mark is not None:  # an exception inside a profiled step
            self._mark.__exit__(None, None, None)
            self._mark = None
        if self._profiler is not None:
            self._analyse()

    def _analyse(self) -> None:
        assert self._profiler is not None
        self._profiler.__exit__(None, None, None)
        events = self._profiler.events()
        top = sorted(
            (a for a in self._profiler.key_averages() if a.key != STEP_LABEL), key=lambda a: a.cpu_time_total,
            reverse=True,
        )[:20]
        self._result = {**time_shares(events, self._device.type, len(self._activities) > 1),
                        "top_ops": [[a.key, a.cpu_time_total / 1e6] for a in top]}
        self._profiler = None

    def _payload(self) -> dict[str, Any]:
        empty = dict.fromkeys(CATEGORIES, 0.0)
        source = {k: self._result.get(k) for k in ("source", "source_reason", "device_s")}
        if not self._result:
            source = {"source": None, "source_reason": "no step was profiled", "device_s": None}
        return {
            "start_step": self.start_step,
            "window": [self._window[0], self._window[-1]] if self._window else None,
            "steps_profiled": len(self._window),
            "complete": self._complete,
            "wall_s": self._result.get("wall_s", 0.0),
            "step_times_s": self._result.get("step_times_s", []),
            "categories_s": self._result.get("categories_s", empty),
            "shares": self._result.get("shares", empty),
            "top_ops": self._result.get("top_ops", []),
            "activities": [str(a).removeprefix("ProfilerActivity.") for a in self._activities],
            **source,
            "host_categories_s": self._result.get("host_categories_s", empty),
            "host_shares": self._result.get("host_shares", empty),
        }
