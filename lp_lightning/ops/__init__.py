"""Low-precision quantize and GEMMs behind one interface, on plug-in backends (design spec §8, §13.4).

- :mod:`lp_lightning.ops.api` — ``quantize``/``quantize_dual`` and ``low_precision_matmul``/
  ``low_precision_grouped_matmul`` with their layout/orientation contract;
- :mod:`lp_lightning.ops.backend` — the ``Backend`` protocol, the backend registry and the choice
  (``auto``, ``emulated``, ``npu``);
- :mod:`lp_lightning.ops.emulated`, :mod:`lp_lightning.ops.npu` — one file per backend;
- :mod:`lp_lightning.ops.trace` — GEMM roles, the public GEMM, quantize and range observers, the
  profiler labels.

Importing this package never imports ``torch_npu``; only using the ``npu`` backend does.
"""

from lp_lightning.ops.api import (
    Layout,
    low_precision_grouped_matmul,
    low_precision_matmul,
    quantize,
    quantize_dual,
)
from lp_lightning.ops.backend import (
    Backend,
    BackendName,
    LowPrecisionUnsupportedError,
    backend_names,
    get_backend,
    register_backend,
    resolve_backend,
    use_backend,
)
from lp_lightning.ops.trace import (
    GemmOperandsEvent,
    GemmRole,
    GemmTraceEvent,
    QuantizeTraceEvent,
    add_gemm_observer,
    add_gemm_operands_observer,
    add_quantize_observer,
    add_range_observer,
    current_gemm_role,
    current_weight_fqn,
    gemm_role,
    record_gemms,
    record_quantizes,
)

__all__ = [
    "Backend",
    "BackendName",
    "GemmOperandsEvent",
    "GemmRole",
    "GemmTraceEvent",
    "Layout",
    "LowPrecisionUnsupportedError",
    "QuantizeTraceEvent",
    "add_gemm_observer",
    "add_gemm_operands_observer",
    "add_quantize_observer",
    "add_range_observer",
    "backend_names",
    "current_gemm_role",
    "current_weight_fqn",
    "gemm_role",
    "get_backend",
    "low_precision_grouped_matmul",
    "low_precision_matmul",
    "quantize",
    "quantize_dual",
    "record_gemms",
    "record_quantizes",
    "register_backend",
    "resolve_backend",
    "use_backend",
]
