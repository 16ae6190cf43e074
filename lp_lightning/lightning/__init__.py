"""Lightning integration: FSDP2 strategy (Trainer + Fabric), precision plugins, the DeepSeek-V3
LightningModule, the pretraining datamodule and the job's callbacks."""

from lp_lightning.lightning.callbacks import PeriodicCheckpoint, RunSummaryCallback, checkpoint_dirname
from lp_lightning.lightning.datamodule import PretrainDataModule
from lp_lightning.lightning.module import DeepSeekV3LM, warmup_cosine_factor
from lp_lightning.lightning.precision import (
    SUPPORTED_PRECISIONS,
    LowPrecisionFabricPlugin,
    LowPrecisionPlugin,
    PrecisionMode,
)
from lp_lightning.lightning.strategy import FSDP2FabricStrategy, FSDP2Strategy

__all__ = [
    "SUPPORTED_PRECISIONS",
    "DeepSeekV3LM",
    "FSDP2FabricStrategy",
    "FSDP2Strategy",
    "LowPrecisionFabricPlugin",
    "LowPrecisionPlugin",
    "PeriodicCheckpoint",
    "PrecisionMode",
    "PretrainDataModule",
    "RunSummaryCallback",
    "checkpoint_dirname",
    "warmup_cosine_factor",
]
