"""Low-precision GEMMs behind one interface, with ``emulated`` and ``npu`` backends (design spec §8, §13.4).

Importing this package never imports ``torch_npu``; only selecting/using the ``npu`` backend does.
See ``lp_lightning.ops.api`` for the layout/orientation contract.
"""

from lp_lightning.ops.api import (
    BackendName,
    Layout,
    get_backend,
    low_precision_grouped_matmul,
    low_precision_matmul,
    resolve_backend,
    set_backend,
    use_backend,
)
from lp_lightning.ops.capability import LowPrecisionUnsupportedError, check_npu_capability
from lp_lightning.ops.trace import (
    GemmRole,
    GemmTraceEvent,
    add_gemm_observer,
    current_gemm_role,
    gemm_role,
    record_gemms,
)

__all__ = [
    "BackendName",
    "GemmRole",
    "GemmTraceEvent",
    "Layout",
    "LowPrecisionUnsupportedError",
    "add_gemm_observer",
    "check_npu_capability",
    "current_gemm_role",
    "gemm_role",
    "get_backend",
    "low_precision_grouped_matmul",
    "low_precision_matmul",
    "record_gemms",
    "resolve_backend",
    "set_backend",
    "use_backend",
]
