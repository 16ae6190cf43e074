"""GEMM trace events and read-only observers (requirement R12 (docs/design.md) kernel-trace probes; design spec §16.6).

Every call of ``low_precision_matmul`` / ``low_precision_grouped_matmul`` emits one
``GemmTraceEvent`` after it computes its result: which backend ran it (``"emulated"`` is always
labelled as such — emulation is never passed off as a hardware kernel), the format, the layout,
the shapes and the output dtype, plus the *GEMM role* (dense|grouped × fprop|dgrad|wgrad) that the
autograd layer declares with ``gemm_role(...)`` around its calls.

Observers receive the frozen event and nothing else (no tensors), so they cannot change a
result::

    from lp_lightning.ops import record_gemms
    with record_gemms() as events:
        y = low_precision_matmul(x_op, w_op, layout="NT", output_dtype=torch.bfloat16)
    assert events[0].backend == "emulated"

An exception raised by an observer propagates to the GEMM's caller (a broken probe must be seen).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterator, Literal

import torch

from lp_lightning.observers import ObserverHandle, Observers

__all__ = [
    "GemmRole",
    "GemmTraceEvent",
    "ObserverHandle",
    "add_gemm_observer",
    "current_gemm_role",
    "emit",
    "gemm_role",
    "record_gemms",
]


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


Observer = Callable[[GemmTraceEvent], None]

_role_var: contextvars.ContextVar[GemmRole | None] = contextvars.ContextVar("lp_lightning_gemm_role", default=None)
_OBSERVERS: Observers[GemmTraceEvent] = Observers("add_gemm_observer")


@contextlib.contextmanager
def gemm_role(role: GemmRole | str) -> Iterator[GemmRole]:
    """Declare the role of the GEMMs issued inside the block (context-local, nests).

    The GEMM entry points check that the role agrees with the call (dense vs grouped, and the
    layout of ``GemmRole.layout``) and record it in the trace event.

    Args:
        role: A ``GemmRole`` or its string value.

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
    try:
        yield parsed
    finally:
        _role_var.reset(token)


def current_gemm_role() -> GemmRole | None:
    """The role declared by the innermost enclosing ``gemm_role(...)``, or None."""
    return _role_var.get()


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
    )
    _OBSERVERS.notify(event)
    return event
