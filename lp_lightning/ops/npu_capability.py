"""The npu backend's capability gate: the torch_npu rows of the startup gate (design spec §15).

:func:`npu_gate_checks` runs the checks in order and returns one :class:`GateCheck` per check
(name, value seen, ok, message), so a startup gate can print what it checked:

1. ``torch_npu installed`` — importable (an installed torch_npu that fails to import, e.g. without
   CANN's libraries on the path, is reported with its error);
2. ``torch_npu version`` — a PEP 440 version of at least ``MIN_TORCH_NPU_VERSION``, and
   ``torch_npu matches torch`` — built for the installed torch's major.minor (torch_npu 2.13.x
   for torch 2.13.x; the fix names ``VERIFIED_PAIR``, a pair with every op);
3. ``dtype …`` — the format's dtypes (``REQUIRED_DTYPES``);
4. ``NPU device`` and ``SoC Ascend950`` — ``torch_npu.npu.get_device_name()`` starts with
   ``"Ascend950"``, which maps to ``SocVersion::Ascend950`` (docs/formats.md §3.2);
5. ``op …`` — every op of ``REQUIRED_OPS`` is present and its schema (``op.default._schema``, as
   ``torch.ops`` packets carry it) accepts every keyword the backend passes.

A failing stage ends the list (within the op stage every op is checked, so all missing ones are
named). ``npu_capability_error`` returns the first failure's message, ``check_npu_capability``
raises ``LowPrecisionUnsupportedError`` with it. Nothing here imports ``torch_npu`` at module level;
successful results are cached per ``torch_npu`` module object (weakly), so the per-GEMM check in
``lp_lightning.ops.backend.resolve_backend`` costs a dictionary lookup.

Which PyPI releases have what (the table behind ``MIN_TORCH_NPU_VERSION``): docs/formats.md §3.1.
"""

from __future__ import annotations

import importlib
import sys
import threading
import weakref
from types import ModuleType

import torch
from packaging.version import InvalidVersion, Version

from lp_lightning.formats.spec import FormatSpec, as_spec
from lp_lightning.ops.backend import GateCheck, LowPrecisionUnsupportedError

__all__ = [
    "MIN_TORCH_NPU_VERSION",
    "REQUIRED_DTYPES",
    "REQUIRED_OPS",
    "SOC_PREFIX",
    "GateCheck",
    "check_npu_capability",
    "clear_capability_cache",
    "npu_capability_error",
    "npu_gate_checks",
]

MIN_TORCH_NPU_VERSION = "2.7.1.post8"
"""The first PyPI torch-npu release, in version order, whose op schemas and custom dtypes hold every
op, keyword and dtype of ``REQUIRED_OPS`` / ``REQUIRED_DTYPES``. Found by reading the schemas
(``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``) and dtype names of the PyPI wheels
2.7.1.post2 … 2.14.0. Some later releases still lack a piece (2.8.0.post5, 2.9.1 and 2.10.0 have no
``scale_alg`` in ``npu_grouped_dynamic_mx_quant``); the op checks catch those (docs/formats.md §3.1)."""

SOC_PREFIX = "Ascend950"

REQUIRED_DTYPES: dict[str, tuple[str, ...]] = {
    "mxfp8_e4m3": ("torch.float8_e4m3fn", "torch_npu.float8_e8m0fnu"),
    "hif8": ("torch_npu.hifloat8",),
}
"""Dtypes each format needs: E4M3 data (torch's own), E8M0 scales and HiF8 data (torch_npu's custom
dtype ids, docs/formats.md §3.1)."""

_GMM_KEYWORDS = (
    "scale", "per_token_scale", "group_list", "group_list_type", "group_type", "split_item", "output_dtype",
)

REQUIRED_OPS: dict[str, dict[str, tuple[str, ...]]] = {
    "mxfp8_e4m3": {
        "npu_dynamic_mx_quant": ("axis", "dst_type", "scale_alg"),
        "npu_dynamic_mx_quant_with_dual_axis": ("dst_type", "scale_alg"),
        "npu_grouped_dynamic_mx_quant": ("round_mode", "dst_type", "blocksize", "scale_alg"),
        "npu_quant_matmul": ("pertoken_scale", "output_dtype", "scale_dtype", "pertoken_scale_dtype", "group_sizes"),
        "npu_grouped_matmul": (*_GMM_KEYWORDS, "scale_dtype", "per_token_scale_dtype"),
    },
    "hif8": {
        "npu_quantize": ("axis", "div_mode"),
        "npu_quant_matmul": ("pertoken_scale", "output_dtype", "x1_dtype", "x2_dtype"),
        "npu_grouped_matmul": (*_GMM_KEYWORDS, "x_dtype", "weight_dtype"),
    },
}
"""Per format, every torch_npu op the npu backend calls and the keywords it passes to it (design spec
§15: dynamic MX quant, dual-axis quant, quant MM/GMM; HiF8 quant with a given scale, FP32-scale
MM/GMM). Each op's schema (``op.default._schema``) must accept those keywords. HiF8's "current
quant" is a torch amax on the device plus ``npu_quantize`` with the scale from it, so
``npu_dynamic_quant`` is not required (``lp_lightning.ops.npu`` module docstring)."""


_cache_lock = threading.Lock()
_passed: weakref.WeakKeyDictionary[ModuleType, dict[str, tuple[GateCheck, ...]]] = weakref.WeakKeyDictionary()


def clear_capability_cache() -> None:
    """Forget cached successful checks (tests that swap ``torch_npu`` modules call this)."""
    with _cache_lock:
        _passed.clear()


def _import_torch_npu() -> ModuleType | str | None:
    """``torch_npu``, ``None`` when it is not installed, or the import error's text when it is
    installed but fails to load (e.g. CANN's libraries not on the path)."""
    module = sys.modules.get("torch_npu")
    if module is not None:
        return module
    try:
        return importlib.import_module("torch_npu")
    except ModuleNotFoundError as exc:
        if exc.name == "torch_npu":
            return None
        return f"{type(exc).__name__}: {exc}"
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"


VERIFIED_PAIR = "torch==2.13.0 torch-npu==2.13.0"
"""A torch / torch_npu pair whose wheel was read and has every op, keyword and dtype of
``REQUIRED_OPS`` / ``REQUIRED_DTYPES`` (the vendored schemas of the tests; docs/formats.md §3.1)."""


def _matching_install() -> str:
    """The install command of a torch / torch_npu pair with every op (named in the messages)."""
    return f"pip install {VERIFIED_PAIR}"


def _check(name: str, seen: str, failure: str | None) -> GateCheck:
    """A check that passed when ``failure`` (its message) is None."""
    return GateCheck(name, seen, failure is None, failure)


def _version_checks(fmt: str, torch_npu: ModuleType) -> list[GateCheck]:
    seen = str(getattr(torch_npu, "__version__", "unknown"))
    try:
        version = Version(seen)
    except InvalidVersion:
        failure = f"torch_npu.__version__ {seen!r} is not a PEP 440 version; reinstall it: {_matching_install()}."
        return [_check("torch_npu version", seen, failure)]
    if version < Version(MIN_TORCH_NPU_VERSION):
        failure = (f"{fmt} on the npu backend needs torch_npu >= {MIN_TORCH_NPU_VERSION} (docs/formats.md §3.1), "
                   f"found {seen}; install a newer pair, e.g. {_matching_install()}.")
        return [_check("torch_npu version", seen, failure)]
    built_for = ".".join(map(str, version.release[:2]))
    failure = None
    if version.release[:2] != Version(torch.__version__).release[:2]:
        failure = (f"torch_npu {seen} is built for torch {built_for} but torch {torch.__version__} is installed; "
                   f"install a matching pair, e.g. {_matching_install()}.")
    return [
        _check("torch_npu version", seen, None),
        _check("torch_npu matches torch", f"torch_npu {seen}, torch {torch.__version__}", failure),
    ]


def _dtype_checks(fmt: str, torch_npu: ModuleType) -> list[GateCheck]:
    checks = []
    for qualified in REQUIRED_DTYPES[fmt]:
        module_name, _, attribute = qualified.partition(".")
        present = hasattr(torch if module_name == "torch" else torch_npu, attribute)
        failure = None if present else (
            f"{fmt} on the npu backend needs {qualified}, missing from torch {torch.__version__} / torch_npu "
            f"{getattr(torch_npu, '__version__', 'unknown')}; run {_matching_install()} (docs/formats.md §3.1).")
        checks.append(_check(f"dtype {qualified}", "present" if present else "missing", failure))
    return checks


def _device_checks(fmt: str, torch_npu: ModuleType) -> list[GateCheck]:
    npu = getattr(torch_npu, "npu", None)
    try:
        available = bool(npu.is_available()) if hasattr(npu, "is_available") else False
        device_name = str(npu.get_device_name()) if available else None
    except Exception as exc:  # any driver/runtime failure means "no usable device"
        failure = f"{fmt} on the npu backend: torch_npu could not query the NPU ({type(exc).__name__}: {exc})."
        return [_check("NPU device", f"query failed: {type(exc).__name__}", failure)]
    if device_name is None:
        failure = f"{fmt} on the npu backend needs an NPU device; torch_npu.npu.is_available() is False."
        return [_check("NPU device", "none", failure)]
    failure = None
    if not device_name.startswith(SOC_PREFIX):
        failure = (f"{fmt} on the npu backend needs an {SOC_PREFIX} (Ascend A5) SoC; torch_npu.npu.get_device_name() "
                   f"is {device_name!r}. MX-scaled and HiF8 GEMMs do not exist on this SoC; select the 'emulated' "
                   "backend.")
    return [_check("NPU device", "available", None), _check(f"SoC {SOC_PREFIX}", device_name, failure)]


def _schema_arguments(op: object) -> set[str] | None:
    """Argument names of a torch op's default overload (``torch.ops`` packets carry the schema)."""
    arguments = getattr(getattr(getattr(op, "default", None), "_schema", None), "arguments", None)
    return None if arguments is None else {argument.name for argument in arguments}


def _op_checks(fmt: str, torch_npu: ModuleType) -> list[GateCheck]:
    checks, version = [], getattr(torch_npu, "__version__", "unknown")
    for op_name, keywords in REQUIRED_OPS[fmt].items():
        op = getattr(torch_npu, op_name, None)
        arguments = _schema_arguments(op) if callable(op) else None
        if arguments is None:
            seen = "missing" if not callable(op) else "no op schema"
            failure = (f"{fmt} on the npu backend needs the op torch_npu.{op_name}, {seen} in torch_npu {version}; "
                       f"run {_matching_install()} with a matching CANN (docs/formats.md §3.1).")
        elif lacking := [keyword for keyword in keywords if keyword not in arguments]:
            seen = f"lacks {', '.join(lacking)}"
            failure = (f"{fmt} on the npu backend passes {', '.join(lacking)} to torch_npu.{op_name}, whose schema "
                       f"in torch_npu {version} lacks it; run {_matching_install()} (docs/formats.md §3.1).")
        else:
            seen, failure = "present", None
        checks.append(_check(f"op {op_name}", seen, failure))
    return checks


def npu_gate_checks(format: FormatSpec | str | None) -> tuple[GateCheck, ...]:
    """The npu capability gate's checks for ``format``, in order, with what each saw.

    Stages, each run only when the previous passed: ``torch_npu`` installed; its version (at least
    ``MIN_TORCH_NPU_VERSION``, and built for the installed torch's major.minor); the format's
    dtypes; an NPU device whose SoC is an Ascend 950; every op of ``REQUIRED_OPS`` present with a
    schema accepting the keywords the backend passes. A failing stage ends the list, so its last
    stage holds the failures (all missing ops are listed). Importable and callable without torch_npu.

    Args:
        format: A ``FormatSpec`` or a registered format name; ``None``: the format-independent
            checks of a ``bf16`` run on the npu accelerator (installed, version, a visible NPU).

    Returns:
        The checks run, each with ``name``, ``seen``, ``ok`` and ``message``; all ``ok`` when the
        npu backend can run the format here (cached per ``torch_npu`` module).

    Raises:
        ValueError: for an unknown format.
    """
    fmt = "bf16" if format is None else as_spec(format).name
    if format is not None and fmt not in REQUIRED_OPS:
        failure = f"the npu backend has no kernels for format {fmt!r}; it implements {sorted(REQUIRED_OPS)}."
        return (_check("npu backend kernels", fmt, failure),)
    torch_npu = _import_torch_npu()
    if torch_npu is None:
        failure = (f"{fmt} on the npu backend needs torch_npu, which is not installed: {_matching_install()} "
                   "(with a matching CANN), or select --backend emulated.")
        return (_check("torch_npu installed", "not installed", failure),)
    if isinstance(torch_npu, str):
        failure = (f"{fmt} on the npu backend: torch_npu is installed but fails to import ({torch_npu[:120]}); "
                   "source CANN's set_env.sh and check torch/torch_npu versions match.")
        return (_check("torch_npu installed", "fails to import", failure),)
    with _cache_lock:
        cached = _passed.get(torch_npu, {}).get(fmt)
    if cached is not None:
        return cached
    checks = [_check("torch_npu installed", "installed", None)]
    stages = (_version_checks, _dtype_checks, _device_checks, _op_checks)
    if format is None:  # bf16 on the npu accelerator: a matching torch_npu and a visible NPU, any SoC
        stages = (_version_checks, lambda fmt, module: _device_checks(fmt, module)[:1])
    for stage in stages:
        checks.extend(stage(fmt, torch_npu))
        if not all(check.ok for check in checks):
            return tuple(checks)
    result = tuple(checks)
    with _cache_lock:
        _passed.setdefault(torch_npu, {})[fmt] = result
    return result


def npu_capability_error(format: FormatSpec | str) -> str | None:
    """The message of the first failing check of :func:`npu_gate_checks`, or None when all pass.

    Raises:
        ValueError: for an unknown format.
    """
    return next((check.message for check in npu_gate_checks(format) if not check.ok), None)


def check_npu_capability(format: FormatSpec | str) -> None:
    """Raise unless the npu backend can run ``format`` on this machine.

    Args:
        format: A ``FormatSpec`` or a registered format name.

    Raises:
        LowPrecisionUnsupportedError: naming the missing piece (torch_npu, its version, a dtype,
            the SoC, an op or an op keyword) and the fix.
        ValueError: for an unknown format.
    """
    message = npu_capability_error(format)
    if message is not None:
        raise LowPrecisionUnsupportedError(message)
