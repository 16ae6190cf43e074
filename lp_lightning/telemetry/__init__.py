"""Telemetry: the run summary and the read-only probes of a training run (design spec §16.6, §17).

:class:`~lp_lightning.telemetry.summary.RunSummaryCallback` writes ``run_summary.json``
(docs/run_summary.md); the probes observe through the public event hooks
(:mod:`lp_lightning.observers`) and FSDP2's public comm hooks, and never change a tensor, a kernel
choice or the order of an operation. The one exception is named as such: the test hook
:class:`~lp_lightning.telemetry.fault_injection.InjectNonFiniteGradient` writes one NaN/Inf into one
gradient at a chosen step (through Lightning's ``on_before_optimizer_step``) to show the guard's skip. Nothing below this package imports it; the probe callbacks
import nothing low-precision until a low-precision run starts.
"""

from lp_lightning.telemetry.fault_injection import InjectNonFiniteGradient
from lp_lightning.telemetry.layer_numerics import LayerNumericsProbe
from lp_lightning.telemetry.memory_probe import TensorMemoryProbe
from lp_lightning.telemetry.probe_callbacks import (
    GatherTraceProbe,
    GemmTraceProbe,
    ProbeCallback,
    ProfilerProbe,
    RefreshProbe,
    ScaleStatsProbe,
    StepRecordProbe,
)
from lp_lightning.telemetry.probes import HighPrecisionGemmProbe
from lp_lightning.telemetry.summary import RunSummaryCallback

__all__ = [
    "GatherTraceProbe",
    "GemmTraceProbe",
    "HighPrecisionGemmProbe",
    "InjectNonFiniteGradient",
    "LayerNumericsProbe",
    "ProbeCallback",
    "ProfilerProbe",
    "RefreshProbe",
    "RunSummaryCallback",
    "ScaleStatsProbe",
    "StepRecordProbe",
    "TensorMemoryProbe",
]
