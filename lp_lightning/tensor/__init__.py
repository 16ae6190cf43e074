"""Persistent low-precision weight tensors (design spec §7.2–7.3, §13.4), format-agnostic.

- :mod:`~lp_lightning.tensor.weight` — ``QuantizedWeightTensor`` (FP32 master + derived storage,
  dispatch, ``refresh_from_master``) and ``GatheredWeightTensor`` (the all-gathered compute copy);
- :mod:`~lp_lightning.tensor.storage` — the storage declaration and the refresh observers.

The FSDP2/optimizer/DCP lifecycle of these tensors is :mod:`lp_lightning.fsdp`.
"""

from lp_lightning.tensor.base import GatherSpec
from lp_lightning.tensor.storage import add_refresh_observer, storage_spec, total_refresh_count
from lp_lightning.tensor.weight import (
    GatheredWeightTensor,
    QuantizedWeightTensor,
    is_low_precision_weight,
    is_master_of,
    weight_quantizer,
)

__all__ = [
    "GatherSpec",
    "GatheredWeightTensor",
    "QuantizedWeightTensor",
    "add_refresh_observer",
    "is_low_precision_weight",
    "is_master_of",
    "storage_spec",
    "total_refresh_count",
    "weight_quantizer",
]
