"""The recorders of a low-precision run (design spec §16.6): GEMM roles, weight refreshes, and the
low-precision hooks that :class:`~lp_lightning.telemetry.probes.HighPrecisionGemmProbe` reads.

:class:`GemmRoleCounter` observes ``lp_lightning.ops`` trace events; :class:`RefreshCounter` wraps
``lp_lightning.fsdp.refresh.RefreshRecorder``. The GEMM probe asks the op layer whether a
low-precision GEMM entry point is running (``current_gemm_role``), reads the names of the
low-precision autograd nodes (``LOW_PRECISION_BACKWARD_NODES``) and runs the codec kernels eagerly
while it is active (``compiled_kernels_enabled`` / ``set_compiled_kernels``). The probe callbacks
subscribe through the event hooks re-exported here (refresh, range, GEMM, GEMM-operand, quantize and gather
observers, ``is_low_precision_weight``). This module imports that stack at module top; :func:`lp_lightning.telemetry.probes.low_precision_recorders` loads it in a
low-precision run (and for the opt-in GEMM probe), so a bf16 run imports none of it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from lp_lightning.formats import compiled_kernels_enabled, set_compiled_kernels
from lp_lightning.fsdp.gather import add_gather_observer
from lp_lightning.fsdp.refresh import RefreshRecorder
from lp_lightning.functional import LOW_PRECISION_BACKWARD_NODES
from lp_lightning.ops import (
    add_gemm_observer, add_gemm_operands_observer, add_quantize_observer, add_range_observer, current_gemm_role,
)
from lp_lightning.tensor import add_refresh_observer, is_low_precision_weight
from lp_lightning.telemetry.probes import GEMM_ROLE_KEYS

__all__ = [
    "LOW_PRECISION_BACKWARD_NODES",
    "GemmRoleCounter",
    "RefreshCounter",
    "add_gather_observer",
    "add_gemm_observer",
    "add_gemm_operands_observer",
    "add_quantize_observer",
    "add_range_observer",
    "add_refresh_observer",
    "compiled_kernels_enabled",
    "current_gemm_role",
    "is_low_precision_weight",
    "set_compiled_kernels",
]


class GemmRoleCounter:
    """Counts low-precision GEMM trace events per role and per backend while active.

    Attributes:
        roles: ``{"dense.fprop": n, ...}`` (all six keys, zeros included).
        backends: ``{"emulated": n}`` — the backend that computed each GEMM.
        formats: ``{"mxfp8_e4m3": n}``.
        unlabelled: Events issued without a declared role.
    """

    def __init__(self) -> None:
        self.roles: dict[str, int] = dict.fromkeys(GEMM_ROLE_KEYS, 0)
        self.backends: Counter[str] = Counter()
        self.formats: Counter[str] = Counter()
        self.unlabelled = 0
        self._handle: Any = None

    def _observe(self, event: Any) -> None:
        if event.gemm_role is None:
            self.unlabelled += 1
        else:
            self.roles[event.gemm_role.value.replace("_", ".", 1)] += 1
        self.backends[event.backend] += 1
        self.formats[event.format] += 1

    def __enter__(self) -> GemmRoleCounter:
        self._handle = add_gemm_observer(self._observe)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class RefreshCounter:
    """Storage builds of low-precision weights, split per optimizer step (wraps ``RefreshRecorder``).

    Call :meth:`close_step` at the end of every optimizer step.

    Attributes:
        per_step: Builds during each closed step (a skipped step closes with 0).
        max_per_weight: Largest number of builds of one weight within one step.
        min_per_weight: Smallest number of builds of a weight within a step, over the weights
            built in that step, ``None`` before any build.
    """

    def __init__(self) -> None:
        self._recorder = RefreshRecorder()
        self._seen = 0
        self.per_step: list[int] = []
        self.max_per_weight = 0
        self.min_per_weight: int | None = None
        self.weights_per_step: list[int] = []

    def __enter__(self) -> RefreshCounter:
        self._recorder.__enter__()
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        if getattr(self, "_active", False):
            self._recorder.__exit__(*exc)
            self._active = False

    def close_step(self) -> None:
        """Attribute the builds since the previous call to the step that just ended."""
        events = self._recorder.events[self._seen :]
        self._seen = len(self._recorder.events)
        self.per_step.append(len(events))
        counts = Counter(events)
        self.weights_per_step.append(len(counts))
        if counts:
            self.max_per_weight = max(self.max_per_weight, max(counts.values()))
            low = min(counts.values())
            self.min_per_weight = low if self.min_per_weight is None else min(self.min_per_weight, low)

    def discard_pending(self) -> None:
        """Forget builds since the last step boundary (e.g. during validation)."""
        self._seen = len(self._recorder.events)
