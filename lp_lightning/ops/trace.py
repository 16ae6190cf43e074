"""GEMM and quantize trace events, read-only observers, profiler labels (R12 (docs/design.md); design spec §16.6).

Every call of ``low_precision_matmul`` / ``low_precision_grouped_matmul`` emits one
``GemmTraceEvent`` after it computes its result: which backend ran it (``"emulated"`` is always
labelled as such — emulation is never passed off as a hardware kernel), the format, the layout,
the shapes and the output dtype, plus the *GEMM role* (dense|grouped × fprop|dgrad|wgrad) and the
FQN of the low-precision weight whose fprop, dgrad or wgrad it is, which the autograd layer
declares with ``gemm_role(role, weight_fqn=...)`` around its calls.

Observers receive the frozen event and nothing else (no tensors), so they cannot change a
result::

    from lp_lightning.ops import record_gemms
    with record_gemms() as events:
        y = low_precision_matmul(x_op, w_op, layout="NT", output_dtype=torch.bfloat16)
    assert events[0].backend == "emulated"

Only while a GEMM-operand observer is registered (:func:`add_gemm_operands_observer`), each GEMM also
delivers a :class:`GemmOperandsEvent` with its two operands, ``group_list`` and result (read them, never
write): the per-layer numerics probe compares the result with a BF16 GEMM of the operands' sources.

Every ``quantize`` / ``quantize_dual`` emits one ``QuantizeTraceEvent`` after the backend returns
— only while a quantize observer is registered (:func:`add_quantize_observer`); otherwise no
event is built. It carries the high-precision input and the operands (read them, never write):
the scale probes read amax and scales from it on the steps they sample.

Profiler labels: while ``torch.profiler`` is recording, quantisation runs inside the range
``"lp_lightning::quantize"`` (:data:`QUANTIZE_LABEL`) and the GEMMs inside
``"lp_lightning::matmul"`` / ``"lp_lightning::grouped_matmul"``; with the profiler off no range is
opened (:func:`profiled`). Range observers (:func:`add_range_observer`) are told when each such
backend call begins and ends, profiler or not (the tensor-memory probe leaves the backend's
working buffers out of its second peak this way).

An exception raised by an observer propagates to the caller (a broken probe must be seen).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Callable, ContextManager, Iterator, Literal

import torch

from lp_lightning.observers import ObserverHandle, Observers

if TYPE_CHECKING:
    from lp_lightning.formats.operand import QuantizedOperand

__all__ = [
    "GROUPED_MATMUL_LABEL",
    "MATMUL_LABEL",
    "QUANTIZE_LABEL",
    "GemmOperandsEvent",
    "GemmRole",
    "GemmTraceEvent",
    "ObserverHandle",
    "QuantizeTraceEvent",
    "add_gemm_observer",
    "add_gemm_operands_observer",
    "add_quantize_observer",
    "add_range_observer",
    "current_gemm_role",
    "current_weight_fqn",
    "emit",
    "emit_gemm_operands",
    "emit_quantize",
    "gemm_operands_observed",
    "gemm_role",
    "profiled",
    "quantize_observed",
    "record_gemms",
    "record_quantizes",
]

QUANTIZE_LABEL = "lp_lightning::quantize"
"""``torch.profiler`` range of every ``quantize`` / ``quantize_dual`` call."""
MATMUL_LABEL = "lp_lightning::matmul"
"""``torch.profiler`` range of every ``low_precision_matmul`` backend call."""
GROUPED_MATMUL_LABEL = "lp_lightning::grouped_matmul"
"""``torch.profiler`` range of every ``low_precision_grouped_matmul`` backend call."""

_NO_RANGE = contextlib.nullcontext()


_RANGE_OBSERVERS: Observers[tuple[str, bool]] = Observers("add_range_observer")


def add_range_observer(observer: Callable[[tuple[str, bool]], None]) -> ObserverHandle:
    """Register ``observer((label, entering))``, called when a backend call of the ops layer begins
    (``entering=True``) and when it returns or raises (``False``), in every thread.

    ``label`` is :data:`QUANTIZE_LABEL` (``quantize`` / ``quantize_dual``), :data:`MATMUL_LABEL` or
    :data:`GROUPED_MATMUL_LABEL`; the range holds the backend's work only (its result is returned
    after the end). Calls nest in no other range of the ops layer.

    Returns:
        A handle whose ``remove()`` unregisters the observer (also a context manager).

    Raises:
        TypeError: if ``observer`` is not callable.
    """
    return _RANGE_OBSERVERS.add(observer)


@contextlib.contextmanager
def _observed_range(label: str) -> Iterator[None]:
    _RANGE_OBSERVERS.notify((label, True))
    try:
        with torch.profiler.record_function(label) if torch.autograd._profiler_enabled() else _NO_RANGE:
            yield
    finally:
        _RANGE_OBSERVERS.notify((label, False))


def profiled(label: str) -> ContextManager[object]:
    """The range of one backend call: ``torch.profiler.record_function(label)`` while the profiler
    records, the range observers' begin/end while any is registered, else a no-op context."""
    if _RANGE_OBSERVERS:
        return _observed_range(label)
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(label)
    return _NO_RANGE


class GemmRole(str, Enum):
    """Which of the six training GEMMs a call is (design spec §8, §16.3, R12 "kernel roles")."""

    DENSE_FPROP = "dense_fprop"
    DENSE_DGRAD = "dense_dgrad"
    DENSE_WGRAD = "dense_wgrad"
    GROUPED_FPROP = "grouped_fprop"
    GROUPED_DGRAD = "grouped_dgrad"
    GROUPED_WGRAD = "grouped_wgrad"

    @property
    def grouped(self) -> bool:
        """True for the grouped (MoE expert) GEMMs."""
        return self.value.startswith("grouped")

    @property
    def layout(self) -> Literal["NN", "NT", "TN"]:
        """The layout this role must use (the orientation contract of ``lp_lightning.ops``)."""
        return _ROLE_LAYOUT[self]


_ROLE_LAYOUT: dict[GemmRole, Literal["NN", "NT", "TN"]] = {
    GemmRole.DENSE_FPROP: "NT",  # y = x · Wᵀ
    GemmRole.DENSE_DGRAD: "NN",  # dx = dy · W
    GemmRole.DENSE_WGRAD: "TN",  # dW = dyᵀ · x
    GemmRole.GROUPED_FPROP: "NN",  # y_g = x_g · W_g (GMM view W [E, K, N])
    GemmRole.GROUPED_DGRAD: "NT",  # dx_g = dy_g · W_gᵀ
    GemmRole.GROUPED_WGRAD: "TN",  # dW_g = x_gᵀ · dy_g
}


@dataclass(frozen=True, slots=True)
class GemmTraceEvent:
    """One low-precision GEMM call, as seen by observers.

    Attributes:
        op: ``"low_precision_matmul"`` or ``"low_precision_grouped_matmul"``.
        backend: ``"emulated"`` or ``"npu"`` — the backend that computed the result.
        format: ``"mxfp8_e4m3"`` or ``"hif8"``.
        layout: ``"NN"``, ``"NT"`` or ``"TN"``.
        left_shape: Logical shape of the left operand's data.
        right_shape: Logical shape of the right operand's data.
        output_shape: Shape of the result.
        output_dtype: Result dtype, e.g. ``"torch.bfloat16"``.
        num_groups: Number of groups for a grouped GEMM, else None.
        device: Device type of the operands, e.g. ``"cpu"``, ``"npu"``.
        gemm_role: The role declared with ``gemm_role(...)`` around the call, or None.
        weight_fqn: FQN of the low-precision weight whose fprop, dgrad or wgrad this is (declared
            with ``gemm_role(..., weight_fqn=...)``), or None.
    """

    op: str
    backend: str
    format: str
    layout: str
    left_shape: tuple[int, ...]
    right_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    output_dtype: str
    num_groups: int | None
    device: str
    gemm_role: GemmRole | None
    weight_fqn: str | None = None


@dataclass(frozen=True, slots=True, eq=False)
class QuantizeTraceEvent:
    """One ``quantize`` / ``quantize_dual`` call, as seen by quantize observers.

    Attributes:
        op: ``"quantize"`` or ``"quantize_dual"``.
        backend: The backend that quantized (``"emulated"`` or ``"npu"``).
        format: Registry name of the format, e.g. ``"mxfp8_e4m3"``, ``"hif8"``.
        role: ``QuantizationRole`` value the caller passed (``"input_fwd"``, ``"grad_output"``,
            ...; ``"weight"`` for a weight refresh), or None.
        orientations: Orientations of ``operands``, in order.
        input: The high-precision tensor that was quantized (read only).
        operands: The ``QuantizedOperand`` results (read only; HiF8 dual: both share one data).
        amax: The precomputed amax the caller passed (e.g. the cross-rank MAX of a HiF8 dense
            weight), else None.
        format_max: The operands' ``format_max`` (HiF8: 15.0 / 224.0), else None.
        grouped: A ``group_list`` was given or the input is 3-D (stacked expert weights).
        weight_fqn: FQN of the weight being refreshed, or of the weight whose GEMMs read the
            operand (activations and gradients), else None.
        gemm_role: The GEMM role declared around the call, or None.
        device: Device type of the input.
    """

    op: str
    backend: str
    format: str
    role: str | None
    orientations: tuple[str, ...]
    input: torch.Tensor
    operands: tuple[QuantizedOperand, ...]
    amax: torch.Tensor | None
    format_max: float | None
    grouped: bool
    weight_fqn: str | None
    gemm_role: GemmRole | None
    device: str


@dataclass(frozen=True, slots=True, eq=False)
class GemmOperandsEvent:
    """One ``low_precision_matmul`` / ``low_precision_grouped_matmul`` call with its tensors, as seen by
    GEMM-operand observers (built only while one is registered, :func:`add_gemm_operands_observer`).

    Attributes:
        op: ``"low_precision_matmul"`` or ``"low_precision_grouped_matmul"``.
        backend: The backend that computed ``output``.
        layout: ``"NN"``, ``"NT"`` or ``"TN"`` (``output = op(left) · op(right)``, per group when grouped).
        left, right: The ``QuantizedOperand`` arguments (read only).
        group_list: ``int64 [E]`` rows per group of a grouped GEMM, else None.
        output: The result tensor (read only).
        gemm_role: The role declared around the call, or None.
        weight_fqn: FQN of the weight whose GEMM this is, or None.
    """

    op: str
    backend: str
    layout: str
    left: QuantizedOperand
    right: QuantizedOperand
    group_list: torch.Tensor | None
    output: torch.Tensor
    gemm_role: GemmRole | None
    weight_fqn: str | None


Observer = Callable[[GemmTraceEvent], None]

_role_var: contextvars.ContextVar[GemmRole | None] = contextvars.ContextVar("lp_lightning_gemm_role", default=None)
_fqn_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("lp_lightning_weight_fqn", default=None)
_OBSERVERS: Observers[GemmTraceEvent] = Observers("add_gemm_observer")
_QUANTIZE_OBSERVERS: Observers[QuantizeTraceEvent] = Observers("add_quantize_observer")
_GEMM_OPERAND_OBSERVERS: Observers[GemmOperandsEvent] = Observers("add_gemm_operands_observer")


@contextlib.contextmanager
def gemm_role(role: GemmRole | str, *, weight_fqn: str | None = None) -> Iterator[GemmRole]:
    """Declare the role of the GEMMs issued inside the block (context-local, nests).

    The GEMM entry points check that the role agrees with the call (dense vs grouped, and the
    layout of ``GemmRole.layout``) and record it in the trace event.

    Args:
        role: A ``GemmRole`` or its string value.
        weight_fqn: FQN of the low-precision weight whose GEMM this is (``""`` counts as None).

    Yields:
        The parsed ``GemmRole``.

    Raises:
        ValueError: for an unknown role, naming the legal values.
    """
    try:
        parsed = GemmRole(role)
    except ValueError:
        legal = ", ".join(repr(r.value) for r in GemmRole)
        raise ValueError(f"gemm_role: role={role!r} is not a GEMM role; legal values: {legal}.") from None
    token = _role_var.set(parsed)
    fqn_token = _fqn_var.set(weight_fqn or None)
    try:
        yield parsed
    finally:
        _fqn_var.reset(fqn_token)
        _role_var.reset(token)


def current_gemm_role() -> GemmRole | None:
    """The role declared by the innermost enclosing ``gemm_role(...)``, or None."""
    return _role_var.get()


def current_weight_fqn() -> str | None:
    """The weight FQN declared by the innermost enclosing ``gemm_role(...)``, or None."""
    return _fqn_var.get()


def add_gemm_observer(observer: Observer) -> ObserverHandle:
    """Register a callable that receives every ``GemmTraceEvent`` (process-wide, all threads).

    Args:
        observer: ``f(event) -> None``. It gets a frozen event with no tensors in it.

    Returns:
        A handle whose ``remove()`` unregisters the observer (also a context manager).

    Raises:
        TypeError: if ``observer`` is not callable.
    """
    return _OBSERVERS.add(observer)


@contextlib.contextmanager
def record_gemms() -> Iterator[list[GemmTraceEvent]]:
    """Collect the events of the GEMMs issued while the block runs (any thread) into a list."""
    events: list[GemmTraceEvent] = []
    with add_gemm_observer(events.append):
        yield events


def add_quantize_observer(observer: Callable[[QuantizeTraceEvent], None]) -> ObserverHandle:
    """Register a callable that receives every ``QuantizeTraceEvent`` (process-wide, all threads).

    While at least one is registered, ``quantize`` / ``quantize_dual`` build an event per call;
    the observer may read its tensors (``input``, ``operands``, ``amax``) but must not write them.

    Returns:
        A handle whose ``remove()`` unregisters the observer (also a context manager).

    Raises:
        TypeError: if ``observer`` is not callable.
    """
    return _QUANTIZE_OBSERVERS.add(observer)


@contextlib.contextmanager
def record_quantizes() -> Iterator[list[QuantizeTraceEvent]]:
    """Collect the events of the quantisations issued while the block runs (any thread) into a list."""
    events: list[QuantizeTraceEvent] = []
    with add_quantize_observer(events.append):
        yield events


def add_gemm_operands_observer(observer: Callable[[GemmOperandsEvent], None]) -> ObserverHandle:
    """Register a callable that receives a :class:`GemmOperandsEvent` after every low-precision GEMM
    (process-wide, all threads); it may read the operands and the output but must not write them.

    While none is registered no such event is built.

    Returns:
        A handle whose ``remove()`` unregisters the observer (also a context manager).

    Raises:
        TypeError: if ``observer`` is not callable.
    """
    return _GEMM_OPERAND_OBSERVERS.add(observer)


def gemm_operands_observed() -> bool:
    """Whether a GEMM-operand observer is registered (the GEMM entry points build no event otherwise)."""
    return bool(_GEMM_OPERAND_OBSERVERS)


def emit_gemm_operands(
    *, op: str, backend: str, layout: str, left: QuantizedOperand, right: QuantizedOperand,
    group_list: torch.Tensor | None, output: torch.Tensor, gemm_role: GemmRole | None, weight_fqn: str | None,
) -> None:
    """Deliver one finished GEMM with its tensors to every GEMM-operand observer (internal use)."""
    _GEMM_OPERAND_OBSERVERS.notify(GemmOperandsEvent(
        op=op, backend=backend, layout=layout, left=left, right=right, group_list=group_list, output=output,
        gemm_role=gemm_role, weight_fqn=weight_fqn,
    ))


def quantize_observed() -> bool:
    """Whether a quantize observer is registered (the quantize entry points build no event otherwise)."""
    return bool(_QUANTIZE_OBSERVERS)


def emit_quantize(
    *,
    op: str,
    backend: str,
    role: str | None,
    input: torch.Tensor,
    operands: tuple[QuantizedOperand, ...],
    amax: torch.Tensor | None,
    grouped: bool,
    weight_fqn: str | None,
) -> QuantizeTraceEvent:
    """Build the event for one finished quantisation and deliver it to every quantize observer (internal use)."""
    first = operands[0]
    event = QuantizeTraceEvent(
        op=op,
        backend=backend,
        format=first.format.name,
        role=role,
        orientations=tuple(o.orientation for o in operands),
        input=input,
        operands=operands,
        amax=amax,
        format_max=first.format_max,
        grouped=grouped,
        weight_fqn=weight_fqn or None,
        gemm_role=_role_var.get(),
        device=input.device.type,
    )
    _QUANTIZE_OBSERVERS.notify(event)
    return event


def emit(
    *,
    op: str,
    backend: str,
    format: str,
    layout: str,
    left_shape: torch.Size,
    right_shape: torch.Size,
    output: torch.Tensor,
    num_groups: int | None,
    gemm_role: GemmRole | None,
    weight_fqn: str | None = None,
) -> GemmTraceEvent:
    """Build the event for one finished GEMM and deliver it to every observer (internal use)."""
    event = GemmTraceEvent(
        op=op,
        backend=backend,
        format=format,
        layout=layout,
        left_shape=tuple(left_shape),
        right_shape=tuple(right_shape),
        output_shape=tuple(output.shape),
        output_dtype=str(output.dtype),
        num_groups=num_groups,
        device=output.device.type,
        gemm_role=gemm_role,
        weight_fqn=weight_fqn,
    )
    _OBSERVERS.notify(event)
    return event
