"""Op backends as plug-ins: the ``Backend`` protocol, the registry and the backend choice (design spec §13.4, §15).

A backend is one file (``lp_lightning.ops.emulated``, ``lp_lightning.ops.npu``) exposing one
object that implements :class:`Backend`: quantize, dual quantize, dense GEMM, grouped GEMM and a
capability check. Backends are registered by name with the module attribute that holds them and
are imported on first use, so ``import lp_lightning.ops`` never imports ``torch_npu``.

Choice (:func:`resolve_backend`): ``backend=`` of a call — a run's recipe carries it
(``LowPrecisionRecipe.backend``, chosen by the startup gate when the run is configured), so every
quantisation and GEMM of the run passes it — else the innermost :func:`use_backend` block (a scoped
choice for direct op calls in tests and benchmarks), else ``"auto"``. There is no process-wide
selection:

- ``"emulated"`` / ``"npu"`` (any registered name): that backend; its capability check must pass
  for the format, else :class:`LowPrecisionUnsupportedError` names what is missing.
- ``"auto"``: the backend registered for the operands' device type (``npu`` for an ``npu``
  device) — whose failing check is an error, never a silent switch to emulation — and
  ``emulated`` on every other device (CPU, CUDA). The run records the resolved name
  (``run_summary.json`` ``backend``).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from lp_lightning.formats.spec import as_spec

if TYPE_CHECKING:
    from lp_lightning.formats.operand import QuantizedOperand
    from lp_lightning.formats.quantizer import Quantizer
    from lp_lightning.formats.spec import FormatSpec, Orientation

__all__ = [
    "AUTO",
    "Backend",
    "BackendName",
    "GateCheck",
    "LowPrecisionUnsupportedError",
    "backend_for_device_type",
    "device_type_of_backend",
    "backend_names",
    "get_backend",
    "get_backend_impl",
    "parse_backend_name",
    "register_backend",
    "resolve_backend",
    "use_backend",
]

BackendName = str
"""A registered backend name (``"emulated"``, ``"npu"``) or ``"auto"``."""

AUTO = "auto"


class LowPrecisionUnsupportedError(RuntimeError):
    """The requested low-precision path cannot run here; the message names what is missing.

    Raised instead of falling back to a BF16/FP32 GEMM (design spec §15: no high-precision fallback).
    """


@dataclass(frozen=True)
class GateCheck:
    """One check of a backend's startup checks (design spec §15), in the order they ran.

    Attributes:
        name: What was checked (``"torch_npu version"``, ``"SoC Ascend950"``, ``"op npu_quant_matmul"``).
        seen: The value found here (a version, a device name, ``"present"``, ``"missing"``).
        ok: Whether the check passed.
        message: For a failed check, what is wrong and the fix; ``None`` when it passed.
    """

    name: str
    seen: str
    ok: bool
    message: str | None = None


class Backend(Protocol):
    """What a backend implements. GEMM inputs arrive validated against ``lp_lightning.ops.api``'s contract."""

    name: str

    def capability_error(self, format: FormatSpec) -> str | None:
        """Why this backend cannot run ``format`` here (message with the fix), or ``None``."""
        ...

    def startup_checks(self, format: FormatSpec | None) -> Sequence[GateCheck]:
        """The startup gate's checks for ``format`` (``None``: the format-independent hardware
        checks of a backend registered for a device type), in order (``lp_lightning.ops.gate``)."""
        ...

    def quantize(
        self,
        quantizer: Quantizer,
        tensor: torch.Tensor,
        *,
        orientation: Orientation,
        group_list: torch.Tensor | None = None,
        amax: torch.Tensor | None = None,
    ) -> QuantizedOperand:
        """``quantizer``'s operand of ``tensor``, bit-identical to the quantizer's portable codec."""
        ...

    def quantize_dual(
        self, quantizer: Quantizer, tensor: torch.Tensor, *, amax: torch.Tensor | None = None
    ) -> tuple[QuantizedOperand, QuantizedOperand]:
        """``(row, col)`` operands of ``tensor`` (a persistent weight's storage)."""
        ...

    def matmul(
        self, left: QuantizedOperand, right: QuantizedOperand, layout: str, output_dtype: torch.dtype
    ) -> torch.Tensor:
        """Dense ``op(left) @ op(right)``."""
        ...

    def grouped_matmul(
        self,
        left: QuantizedOperand,
        right: QuantizedOperand,
        group_list: torch.Tensor,
        layout: str,
        output_dtype: torch.dtype,
    ) -> torch.Tensor:
        """Grouped GEMM (see ``lp_lightning.ops.api``)."""
        ...


@dataclass(frozen=True)
class _Registration:
    location: str  # "package.module:ATTRIBUTE"
    device_type: str | None  # the device type "auto" picks it for


_LOCK = threading.Lock()
_REGISTRY: dict[str, _Registration] = {}
_LOADED: dict[str, Backend] = {}


def register_backend(name: str, location: str, *, device_type: str | None = None) -> None:
    """Register a backend by the import location of its object (idempotent for equal arguments).

    Args:
        name: Backend name (not ``"auto"``).
        location: ``"package.module:ATTRIBUTE"`` of an object implementing :class:`Backend`.
        device_type: Device type for which ``"auto"`` picks this backend (``"npu"``), or ``None``.

    Raises:
        ValueError: ``name`` is ``"auto"`` or taken by another registration, or the device type is
            claimed by another backend.
    """
    registration = _Registration(location, device_type)
    with _LOCK:
        if name == AUTO or (name in _REGISTRY and _REGISTRY[name] != registration):
            raise ValueError(f"register_backend: name {name!r} is reserved or already registered.")
        owner = [n for n, r in _REGISTRY.items() if device_type is not None and r.device_type == device_type]
        if owner and owner != [name]:
            raise ValueError(f"register_backend: device type {device_type!r} already belongs to {owner[0]!r}.")
        _REGISTRY[name] = registration


def backend_names() -> tuple[str, ...]:
    """Registered backend names."""
    return tuple(_REGISTRY)


def parse_backend_name(name: object, who: str) -> str:
    """``name`` if it is ``"auto"`` or a registered backend.

    Args:
        name: The value to check.
        who: The caller or config key, named in the error.

    Raises:
        ValueError: naming the legal values.
    """
    if name != AUTO and name not in _REGISTRY:
        legal = ", ".join(repr(n) for n in (AUTO, *_REGISTRY))
        raise ValueError(f"{who}: backend={name!r}; legal values: {legal}.")
    return name  # type: ignore[return-value]


def device_type_of_backend(name: str) -> str | None:
    """The device type a registered backend computes on (``"npu"`` for ``npu``), ``None`` for any device."""
    return _REGISTRY[parse_backend_name(name, "device_type_of_backend")].device_type


def backend_for_device_type(device_type: str) -> str | None:
    """The backend registered for ``device_type`` (``"npu"`` for ``"npu"``), or ``None``."""
    owners = [n for n, r in _REGISTRY.items() if r.device_type == device_type]
    return owners[0] if owners else None


def get_backend_impl(name: str) -> Backend:
    """The backend object registered as ``name`` (imported on first use).

    Raises:
        ValueError: an unknown name.
    """
    backend = _LOADED.get(name)
    if backend is None:
        module_name, _, attribute = _REGISTRY[parse_backend_name(name, "get_backend_impl")].location.partition(":")
        backend = getattr(importlib.import_module(module_name), attribute)
        with _LOCK:
            backend = _LOADED.setdefault(name, backend)
    return backend


_scoped_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar("lp_lightning_gemm_backend", default=None)


def get_backend() -> BackendName:
    """The backend name a call without ``backend=`` uses: the innermost :func:`use_backend`, else ``"auto"``."""
    scoped = _scoped_backend.get()
    return scoped if scoped is not None else AUTO


@contextlib.contextmanager
def use_backend(name: BackendName) -> Iterator[BackendName]:
    """Select a backend for the op calls inside the block that pass no ``backend=`` (context-local; nests).

    A run never needs it: its recipe names the backend. Tests and benchmarks use it to send direct
    op calls (and recipes with backend ``"auto"``) to one backend.

    Raises:
        ValueError: for an unknown name.
    """
    token = _scoped_backend.set(parse_backend_name(name, "use_backend"))
    try:
        yield name
    finally:
        _scoped_backend.reset(token)


def resolve_backend(format: FormatSpec | str, device: torch.device | str, backend: BackendName | None = None) -> str:
    """The concrete backend a call with ``format`` on ``device`` uses (module docstring).

    Args:
        format: The operands' format (a ``FormatSpec`` or a registered name).
        device: The operands' device (a ``torch.device`` or a string such as ``"npu:0"``).
        backend: A registered name for this call; ``None`` or ``"auto"`` (a recipe that names no
            backend) uses :func:`get_backend`, and ``"auto"`` there picks by ``device``.

    Returns:
        A registered backend name whose capability check passed.

    Raises:
        ValueError: for an unknown backend or format name.
        LowPrecisionUnsupportedError: the chosen backend cannot run the format here.
    """
    spec = as_spec(format)
    name = AUTO if backend is None else parse_backend_name(backend, "backend")
    if name == AUTO:  # no explicit choice: the innermost use_backend block, else the device's backend
        name = get_backend()
    if name == AUTO:
        device_type = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
        name = backend_for_device_type(device_type) or "emulated"
    message = get_backend_impl(name).capability_error(spec)
    if message is not None:
        raise LowPrecisionUnsupportedError(message)
    return name


register_backend("emulated", "lp_lightning.ops.emulated:BACKEND")
register_backend("npu", "lp_lightning.ops.npu:BACKEND", device_type="npu")
