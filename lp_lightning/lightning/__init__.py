"""Lightning integration: FSDP2 strategy (Trainer + Fabric), precision plugins (bf16 / mxfp8 / hif8),
the ``npu`` accelerator, the DeepSeek-V3 LightningModule, the pretraining datamodule, the job's
callbacks and read-only probes (the probe callbacks of :mod:`~lp_lightning.lightning.probe_callbacks`
import nothing low-precision until a low-precision run starts).

Importing this package registers the ``"npu"`` accelerator with Lightning when torch_npu is
importable (:func:`~lp_lightning.lightning.accelerator.register_npu_accelerator`)."""

from lp_lightning.lightning.accelerator import NPUAccelerator, NPUFabricAccelerator, register_npu_accelerator
from lp_lightning.lightning.callbacks import PeriodicCheckpoint, RunSummaryCallback, checkpoint_dirname
from lp_lightning.lightning.datamodule import PretrainDataModule
from lp_lightning.lightning.memory_probe import TensorMemoryProbe
from lp_lightning.lightning.module import DeepSeekV3LM, warmup_cosine_factor
from lp_lightning.lightning.precision import (
    SUPPORTED_PRECISIONS,
    BF16FabricPlugin,
    BF16Plugin,
    PrecisionMode,
    precision_plugin,
)
from lp_lightning.lightning.probe_callbacks import (
    GatherTraceProbe,
    GemmTraceProbe,
    ProbeCallback,
    ProfilerProbe,
    RefreshProbe,
    ScaleStatsProbe,
    StepRecordProbe,
)
from lp_lightning.lightning.probes import HighPrecisionGemmProbe
from lp_lightning.lightning.strategy import FSDP2FabricStrategy, FSDP2Strategy

__all__ = [
    "SUPPORTED_PRECISIONS",
    "BF16FabricPlugin",
    "BF16Plugin",
    "DeepSeekV3LM",
    "FSDP2FabricStrategy",
    "FSDP2Strategy",
    "GatherTraceProbe",
    "GemmTraceProbe",
    "HighPrecisionGemmProbe",
    "LowPrecisionFabricPlugin",
    "LowPrecisionPlugin",
    "NPUAccelerator",
    "NPUFabricAccelerator",
    "PeriodicCheckpoint",
    "PrecisionMode",
    "PretrainDataModule",
    "ProbeCallback",
    "ProfilerProbe",
    "RefreshProbe",
    "RunSummaryCallback",
    "ScaleStatsProbe",
    "StepRecordProbe",
    "TensorMemoryProbe",
    "checkpoint_dirname",
    "precision_plugin",
    "register_npu_accelerator",
    "warmup_cosine_factor",
]

_LOW_PRECISION = ("LowPrecisionFabricPlugin", "LowPrecisionPlugin")


def __getattr__(name: str) -> object:
    """``LowPrecisionPlugin`` / ``LowPrecisionFabricPlugin`` load the low-precision stack on first use only."""
    if name in _LOW_PRECISION:
        from lp_lightning.lightning import low_precision  # not at import: a bf16 run never loads it

        return getattr(low_precision, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

register_npu_accelerator()
