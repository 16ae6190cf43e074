"""Lightning integration: FSDP2 strategy (Trainer + Fabric), precision plugins (bf16 / mxfp8 / hif8),
the ``npu`` accelerator, the DeepSeek-V3 LightningModule, the pretraining datamodule and the job's
checkpoint and stop-signal callbacks. The run summary and the read-only probes are :mod:`lp_lightning.telemetry`.

Importing this package registers the ``"npu"`` accelerator with Lightning when torch_npu is
importable (:func:`~lp_lightning.lightning.accelerator.register_npu_accelerator`)."""

from lp_lightning.lightning.accelerator import NPUAccelerator, NPUFabricAccelerator, register_npu_accelerator
from lp_lightning.lightning.callbacks import PeriodicCheckpoint, Preemption, checkpoint_dirname
from lp_lightning.lightning.datamodule import PretrainDataModule
from lp_lightning.lightning.module import DeepSeekV3LM, warmup_cosine_factor
from lp_lightning.lightning.precision import (
    SUPPORTED_PRECISIONS,
    BF16FabricPlugin,
    BF16Plugin,
    PrecisionMode,
    precision_plugin,
)
from lp_lightning.lightning.strategy import FSDP2FabricStrategy, FSDP2Strategy

__all__ = [
    "SUPPORTED_PRECISIONS",
    "BF16FabricPlugin",
    "BF16Plugin",
    "DeepSeekV3LM",
    "FSDP2FabricStrategy",
    "FSDP2Strategy",
    "LowPrecisionFabricPlugin",
    "LowPrecisionPlugin",
    "NPUAccelerator",
    "NPUFabricAccelerator",
    "PeriodicCheckpoint",
    "Preemption",
    "PrecisionMode",
    "PretrainDataModule",
    "checkpoint_dirname",
    "precision_plugin",
    "register_npu_accelerator",
    "warmup_cosine_factor",
]

_LOW_PRECISION = ("LowPrecisionFabricPlugin", "LowPrecisionPlugin")


def __getattr__(name: str) -> object:
    """``LowPrecisionPlugin`` / ``LowPrecisionFabricPlugin`` load the low-precision stack on first use only."""
    if name in _LOW_PRECISION:
        # Imported here: the low-precision plugins load their whole stack, which a bf16 run never loads.
        from lp_lightning.lightning import low_precision

        return getattr(low_precision, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

register_npu_accelerator()
