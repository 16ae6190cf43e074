"""The low-precision storage of a persistent weight, declared once, and refresh observers.

A weight's storage is derived from its ``FormatSpec`` (design spec §7.2–7.3) in the GEMM view of
its kind (dense ``[N, K]``; grouped ``[E, K, N]``):

- a format with physical orientation (MXFP8) keeps both: ``row_data``/``row_scale`` and
  ``col_data``/``col_scale``;
- otherwise (HiF8) one ``data`` and one ``scale`` serve both orientations.

Scale shapes come from ``FormatSpec.scale_shape``. A 0-d scale (one per tensor) is replicated over
the FSDP shard group; every other storage tensor is sharded along dim 0 with the weight.

Refresh observers (:func:`add_refresh_observer`) are called after every storage (re)build; they
must not mutate the weight (the run's probes count refreshes through them).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from lp_lightning.formats.spec import FormatSpec, Orientation, WeightKind, as_spec
from lp_lightning.observers import ObserverHandle, Observers

if TYPE_CHECKING:
    from lp_lightning.tensor.weight import QuantizedWeightTensor

__all__ = [
    "ALL_STORAGE_NAMES",
    "add_refresh_observer",
    "nbytes",
    "storage_names",
    "storage_spec",
    "total_refresh_count",
]

ALL_STORAGE_NAMES: tuple[str, ...] = ("row_data", "row_scale", "col_data", "col_scale", "data", "scale")
"""Every storage name of :func:`storage_spec` (physical orientation: the first four; else the last two)."""


def storage_names(spec: FormatSpec, orientation: Orientation) -> tuple[str, str]:
    """``(data name, scale name)`` of the storage one orientation's operand views."""
    if spec.physical_orientation:
        return f"{orientation}_data", f"{orientation}_scale"
    return "data", "scale"


def storage_spec(
    format: FormatSpec | str, kind: WeightKind | str, shape: tuple[int, ...]
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of a weight's low-precision storage (the declaration every user reads).

    Args:
        format: A ``FormatSpec`` or a registered format name.
        kind: ``"dense"`` (``shape`` ``[N, K]``) or ``"grouped"`` (``shape`` ``[E, N, K]``).
        shape: Logical parameter shape (of the whole weight or of one shard).

    Returns:
        ``{name: (shape, dtype)}`` in declaration order. MXFP8 dense: ``row_data [N, K]``,
        ``row_scale [N, nb(K)]``, ``col_data [N, K]``, ``col_scale [nb(N), K]``; MXFP8 grouped
        (GMM view): ``row_data [E, K, N]``, ``row_scale [E, K, nb(N)]``, ``col_data [E, K, N]``,
        ``col_scale [E, nb(K), N]``; HiF8: ``data`` (GMM view, ``uint8``), ``scale`` (``[]`` or
        ``[E]``, FP32). ``nb(d) = ceil(d / 32)``.
    """
    spec, kind = as_spec(format), WeightKind.parse(kind)
    gemm = kind.gemm_view_shape(tuple(shape))
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for orientation in ("row", "col") if spec.physical_orientation else ("row",):
        data_name, scale_name = storage_names(spec, orientation)
        out[data_name] = (gemm, spec.data_dtype)
        out[scale_name] = (spec.scale_shape(gemm, orientation), spec.scale_dtype)
    return out


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * dtype.itemsize


# Refresh accounting (read-only observers; the lifecycle layer and the probes build on them).

_REFRESH_LOCK = threading.Lock()
_REFRESH_TOTAL = 0
_REFRESH_OBSERVERS: Observers[QuantizedWeightTensor] = Observers("add_refresh_observer")


def add_refresh_observer(observer: Callable[[QuantizedWeightTensor], None]) -> ObserverHandle:
    """Call ``observer(weight)`` after every storage (re)build. Observers must not mutate the weight.

    Returns:
        A handle whose ``remove()`` unregisters the observer (also a context manager).
    """
    return _REFRESH_OBSERVERS.add(observer)


def total_refresh_count() -> int:
    """Storage builds of every ``QuantizedWeightTensor`` in this process since import."""
    return _REFRESH_TOTAL


def note_refresh(weight: QuantizedWeightTensor) -> None:
    """Count one storage build of ``weight`` and tell the observers (called by the weight only)."""
    global _REFRESH_TOTAL
    with _REFRESH_LOCK:
        _REFRESH_TOTAL += 1
    _REFRESH_OBSERVERS.notify(weight)
