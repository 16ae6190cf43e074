"""MXFP8 (OCP MX FP8: E4M3 elements, one E8M0 scale per 32-element block, RCEIL), one package.

- :mod:`~lp_lightning.formats.mxfp8.codec` — bit-exact quantize/dequantize, row/col/grouped;
- :mod:`~lp_lightning.formats.mxfp8.e8m0` — E8M0 scales and the RCEIL rule;
- :mod:`~lp_lightning.formats.mxfp8.spec` — ``SPEC``, what the generic layers need to know
  (scale shapes, exact GEMM factors, per-block amax scope, the §9.1 shard rule, SQNR floors),
  ``MXFP8Quantizer`` and the v1 recipe.

The codec's functions are re-exported here (``mxfp8.quantize(x, orientation="row")``).
"""

from lp_lightning.formats.mxfp8.codec import (
    BLOCK_SIZE,
    dequantize,
    dequantize_grouped,
    grouped_scale_rows,
    quantize,
    quantize_dual,
    quantize_grouped,
    scale_shape,
)
from lp_lightning.formats.mxfp8.spec import MXFP8_E4M3_MX_BLOCK, SPEC, MXFP8Quantizer, MXFP8Spec

__all__ = [
    "BLOCK_SIZE",
    "MXFP8Quantizer",
    "MXFP8Spec",
    "MXFP8_E4M3_MX_BLOCK",
    "SPEC",
    "dequantize",
    "dequantize_grouped",
    "grouped_scale_rows",
    "quantize",
    "quantize_dual",
    "quantize_grouped",
    "scale_shape",
]
