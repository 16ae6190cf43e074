"""Low-precision formats: codecs, quantized operands, quantizers and recipes (design spec §3, §7).

Codecs live in their own modules (``lp_lightning.formats.hif8``, ``lp_lightning.formats.mxfp8``);
this package re-exports the objects the layers above use::

    from lp_lightning.formats import QuantizationRole, recipe_for

    recipe = recipe_for("hif8")
    x_op = recipe.quantizer(QuantizationRole.INPUT_FWD).quantize(x_MK, orientation="row")
"""

from lp_lightning.formats._compile import compiled_kernels_enabled, set_compiled_kernels
from lp_lightning.formats.operand import (
    MX_BLOCK_SIZE,
    LowPrecisionFormat,
    Orientation,
    QuantizationRole,
    QuantizedOperand,
)
from lp_lightning.formats.quantizers import HiF8Quantizer, MXFP8Quantizer, Quantizer
from lp_lightning.formats.recipe import (
    HIF8_CURRENT,
    MXFP8_E4M3_MX_BLOCK,
    SQNR_FLOORS_DB,
    LowPrecisionRecipe,
    recipe_for,
)

__all__ = [
    "HIF8_CURRENT",
    "MXFP8_E4M3_MX_BLOCK",
    "MX_BLOCK_SIZE",
    "SQNR_FLOORS_DB",
    "HiF8Quantizer",
    "LowPrecisionFormat",
    "LowPrecisionRecipe",
    "MXFP8Quantizer",
    "Orientation",
    "QuantizationRole",
    "QuantizedOperand",
    "Quantizer",
    "compiled_kernels_enabled",
    "recipe_for",
    "set_compiled_kernels",
]
