"""HiF8 (HiFloat8, arXiv 2409.16626) with FP32 current scaling, one package.

- :mod:`~lp_lightning.formats.hif8.codec` — bit-exact encode/decode of HiFloat8 codes;
- :mod:`~lp_lightning.formats.hif8.spec` — ``SPEC``, what the generic layers need to know
  (scale shapes, exact GEMM factors, per-tensor/per-group amax scope, SQNR floors),
  ``HiF8Quantizer`` and the v1 recipe.

The codec's public functions and constants are re-exported here (``hif8.encode(x)``).
"""

from lp_lightning.formats.hif8.codec import (
    FORMAT_MAX_GRADIENT,
    FORMAT_MAX_INPUT_WEIGHT,
    HIF8_MAX,
    HIF8_MIN_NORMAL,
    HIF8_MIN_SUBNORMAL,
    HIF8_NAN_CODE,
    HIF8_NEG_INF_CODE,
    HIF8_OVERFLOW_THRESHOLD,
    HIF8_POS_INF_CODE,
    HIF8_ZERO_CODE,
    decode,
    encode,
)
from lp_lightning.formats.hif8.spec import HIF8_CURRENT, SPEC, HiF8Quantizer, HiF8Spec

__all__ = [
    "FORMAT_MAX_GRADIENT",
    "FORMAT_MAX_INPUT_WEIGHT",
    "HIF8_CURRENT",
    "HIF8_MAX",
    "HIF8_MIN_NORMAL",
    "HIF8_MIN_SUBNORMAL",
    "HIF8_NAN_CODE",
    "HIF8_NEG_INF_CODE",
    "HIF8_OVERFLOW_THRESHOLD",
    "HIF8_POS_INF_CODE",
    "HIF8_ZERO_CODE",
    "SPEC",
    "HiF8Quantizer",
    "HiF8Spec",
    "decode",
    "encode",
]
