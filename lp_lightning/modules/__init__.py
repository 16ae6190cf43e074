"""Low-precision replacements for ``torch.nn`` modules (design spec §5.1), built by the replacement plan."""

from lp_lightning.modules.linear import LowPrecisionLinear, replace_low_precision_linear

__all__ = ["LowPrecisionLinear", "replace_low_precision_linear"]
