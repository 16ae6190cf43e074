"""DCP checkpoints of a run and what guards them (design spec §11, §15): one package, no model knowledge.

- :mod:`~lp_lightning.checkpoint.dcp` — save and load a DCP folder with HF-keyed model and optimizer
  views (FP32 masters, FP32 AdamW moments), ``meta.pt`` for the rest;
- :mod:`~lp_lightning.checkpoint.integrity` — ``digests.json``: size and SHA-256 of every file, checked on load;
- :mod:`~lp_lightning.checkpoint.finite` — NaN/Inf in the training state (saved, loaded, per step);
- :mod:`~lp_lightning.checkpoint.space` — the bytes of one checkpoint, and a save that runs out of disk space;
- :mod:`~lp_lightning.checkpoint.resume` — which folder a resume loads: ``last``, the quick check
  of an explicit path, the fallback to the newest intact older folder; shared by ``lp-lightning fit``'s
  launch check and both FSDP2 strategies.

Everything here imports torch only (no Lightning, no low-precision module): a bf16 run uses it as is.
"""

from lp_lightning.checkpoint.dcp import (
    METADATA_FILENAME,
    checkpoint_tensor_keys,
    is_dcp_checkpoint,
    load_dcp_checkpoint,
    model_state_dict,
    optimizer_state_dict,
    save_dcp_checkpoint,
    verify_dcp_checkpoint,
)
from lp_lightning.checkpoint.finite import NonFiniteStateError, first_nonfinite
from lp_lightning.checkpoint.integrity import DIGESTS_FILENAME, DamagedCheckpointError
from lp_lightning.checkpoint.space import CheckpointSpaceError

__all__ = [
    "DIGESTS_FILENAME",
    "METADATA_FILENAME",
    "CheckpointSpaceError",
    "DamagedCheckpointError",
    "NonFiniteStateError",
    "checkpoint_tensor_keys",
    "first_nonfinite",
    "is_dcp_checkpoint",
    "load_dcp_checkpoint",
    "model_state_dict",
    "optimizer_state_dict",
    "save_dcp_checkpoint",
    "verify_dcp_checkpoint",
]
