"""Capability gate for the ``npu`` backend (design spec §15; requirement R11 (docs/design.md)).

``check_npu_capability(format)`` either returns or raises ``LowPrecisionUnsupportedError`` naming
the first missing piece, in this order:

1. ``torch_npu`` is not installed → install it with ``pip install 'lp-lightning[npu]'``.
2. ``torch_npu`` is too old: the custom dtypes ``torch_npu.float8_e8m0fnu`` (MXFP8 scales) /
   ``torch_npu.hifloat8`` (HiF8 data) first appear in torch_npu v26.0.0 (docs/formats.md §3.1).
3. No NPU device is visible, or its SoC is not an Ascend 950 (``torch_npu.npu.get_device_name()``
   must start with ``"Ascend950"``; any such name maps to ``SocVersion::Ascend950``, docs/formats.md
   §3.2). MX-scaled GEMMs and HiF8 × HiF8 GEMMs exist only on the 950 (aclnnQuantMatmulV5.md).
4. An op the format's backend calls is missing from ``torch_npu`` (list per format below).

Importing this module never imports ``torch_npu``; only calling the gate does. Successful checks
are cached per ``torch_npu`` module object (weakly), so the hot path costs a dictionary lookup.
"""

from __future__ import annotations

import importlib
import sys
import threading
import weakref
from types import ModuleType

from lp_lightning.formats.operand import LowPrecisionFormat

__all__ = [
    "MIN_TORCH_NPU_VERSION",
    "REQUIRED_DTYPES",
    "REQUIRED_OPS",
    "LowPrecisionUnsupportedError",
    "check_npu_capability",
    "clear_capability_cache",
    "npu_capability_error",
]

MIN_TORCH_NPU_VERSION = "v26.0.0"
"""First torch_npu release line with hifloat8 / float8_e8m0fnu and the A5 op signatures (docs/formats.md §3.1)."""

SOC_PREFIX = "Ascend950"

REQUIRED_DTYPES: dict[LowPrecisionFormat, tuple[str, ...]] = {
    LowPrecisionFormat.MXFP8_E4M3: ("float8_e8m0fnu",),
    LowPrecisionFormat.HIF8: ("hifloat8",),
}
"""``torch_npu`` attributes (custom dtype ids) each format needs."""

REQUIRED_OPS: dict[LowPrecisionFormat, tuple[str, ...]] = {
    LowPrecisionFormat.MXFP8_E4M3: (
        "npu_dynamic_mx_quant",
        "npu_dynamic_mx_quant_with_dual_axis",
        "npu_grouped_dynamic_mx_quant",
        "npu_quant_matmul",
        "npu_grouped_matmul",
    ),
    LowPrecisionFormat.HIF8: ("npu_quant_matmul", "npu_grouped_matmul"),
}
"""``torch_npu`` ops the npu backend calls per format (design spec §15: quant, dual-axis quant, MM/GMM)."""


class LowPrecisionUnsupportedError(RuntimeError):
    """The requested low-precision path cannot run here; the message names what is missing.

    Raised instead of falling back to a BF16/FP32 GEMM (design spec §15: no high-precision fallback).
    """


_cache_lock = threading.Lock()
_passed: weakref.WeakKeyDictionary[ModuleType, set[LowPrecisionFormat]] = weakref.WeakKeyDictionary()


def clear_capability_cache() -> None:
    """Forget cached successful checks (tests that swap ``torch_npu`` modules call this)."""
    with _cache_lock:
        _passed.clear()


def _import_torch_npu() -> ModuleType | None:
    module = sys.modules.get("torch_npu")
    if module is not None:
        return module
    try:
        return importlib.import_module("torch_npu")
    except ImportError:
        return None


def npu_capability_error(format: LowPrecisionFormat | str) -> str | None:
    """Why the npu backend cannot run ``format`` here, or None when it can.

    Args:
        format: ``LowPrecisionFormat`` or its string value.

    Returns:
        A message naming the missing piece and the fix, or None.

    Raises:
        ValueError: for an unknown format.
    """
    fmt = LowPrecisionFormat.parse(format)
    torch_npu = _import_torch_npu()
    if torch_npu is None:
        return (
            f"{fmt.value} on the npu backend needs torch_npu, which is not installed. Install it with "
            f"pip install 'lp-lightning[npu]' (torch_npu {MIN_TORCH_NPU_VERSION} or newer, matching your "
            "torch and CANN), or select the 'emulated' backend."
        )
    with _cache_lock:
        if fmt in _passed.get(torch_npu, ()):
            return None
    version = getattr(torch_npu, "__version__", "unknown")
    missing_dtypes = [name for name in REQUIRED_DTYPES[fmt] if not hasattr(torch_npu, name)]
    if missing_dtypes:
        return (
            f"{fmt.value} on the npu backend needs torch_npu.{', torch_npu.'.join(missing_dtypes)}, missing from "
            f"torch_npu {version}: it is too old. Upgrade to torch_npu {MIN_TORCH_NPU_VERSION} or newer "
            "(pip install -U 'lp-lightning[npu]')."
        )
    npu = getattr(torch_npu, "npu", None)
    try:
        available = bool(npu.is_available()) if hasattr(npu, "is_available") else False
        device_name = str(npu.get_device_name()) if available else None
    except Exception as exc:  # any driver/runtime failure means "no usable device"
        return (
            f"{fmt.value} on the npu backend: torch_npu {version} could not query the NPU "
            f"({type(exc).__name__}: {exc})."
        )
    if device_name is None:
        return f"{fmt.value} on the npu backend needs an NPU device; torch_npu.npu.is_available() is False."
    if not device_name.startswith(SOC_PREFIX):
        return (
            f"{fmt.value} on the npu backend needs an {SOC_PREFIX} (Ascend A5) SoC; "
            f"torch_npu.npu.get_device_name() is {device_name!r}. MX-scaled and HiF8 GEMMs do not exist on "
            "this SoC; select the 'emulated' backend."
        )
    missing_ops = [name for name in REQUIRED_OPS[fmt] if not callable(getattr(torch_npu, name, None))]
    if missing_ops:
        return (
            f"{fmt.value} on the npu backend needs torch_npu.{', torch_npu.'.join(missing_ops)}, missing from "
            f"torch_npu {version}. Upgrade torch_npu (and CANN) to a release that ships them."
        )
    with _cache_lock:
        _passed.setdefault(torch_npu, set()).add(fmt)
    return None


def check_npu_capability(format: LowPrecisionFormat | str) -> None:
    """Raise unless the npu backend can run ``format`` on this machine.

    Args:
        format: ``LowPrecisionFormat`` or its string value.

    Raises:
        LowPrecisionUnsupportedError: naming the missing piece (torch_npu, its version, the SoC,
            or an op) and the fix.
        ValueError: for an unknown format.
    """
    message = npu_capability_error(format)
    if message is not None:
        raise LowPrecisionUnsupportedError(message)
