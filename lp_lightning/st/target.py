"""Where ``lp-lightning st`` judges the hardware: the run's accelerator, device and op backend.

One target for everything ``st`` runs in its own process — N-1/N-2 (docs/acceptance.md "The report"),
the ``conformance`` row ("Backend conformance") — and for the stop of an emulated backend on the NPU.
The user YAML's ``trainer.accelerator`` and ``backend`` (the keys ``lp-lightning fit`` reads) name it,
resolved as the startup gate resolves a run's backend (docs/architecture.md "The startup gate"):

- ``npu``: device 0 of the npu accelerator's device type (``npu:0``); backend ``auto`` is ``npu``
  (the backend registered for the device type);
- ``gpu`` / ``cuda``: device ``cuda:0``; ``auto`` is ``emulated`` (no CUDA backend is registered);
- ``cpu``: device ``cpu``; ``auto`` is ``emulated``;
- ``auto``: ``cuda:0`` when CUDA is available, else ``cpu`` (Lightning's choice; ``auto`` never picks
  an NPU).

An explicit ``backend: emulated`` or ``npu`` is kept. The emulated backend is a bit-exact model of the
hardware's numerics, not of its kernels or speed: on the npu accelerator it would pass every numerics
row and make Q3-11 and ``conformance`` ``not-applicable``, an acceptance that proved nothing about the
Ascend kernels, so ``st`` stops before any run (:func:`emulated_on_npu_error`) unless
``--allow_emulated true`` says it is intended. The report's meta records the target under ``target``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from lp_lightning.ops.backend import backend_for_device_type

__all__ = ["RunTarget", "check_target_device", "emulated_on_npu_error", "run_target"]

_DEVICE_TYPES = {"gpu": "cuda", "cuda": "cuda", "cpu": "cpu"}


@dataclass(frozen=True)
class RunTarget:
    """The accelerator, device and op backend ``st`` judges (module docstring).

    Attributes:
        accelerator: The YAML's ``trainer.accelerator`` (``"cpu"``, ``"npu"``, ...; ``auto`` resolved).
        device: The torch device string N-1/N-2 and ``conformance`` run on (``"cpu"``, ``"npu:0"``, ``"cuda:0"``).
        backend: The resolved op backend (``"emulated"``, ``"npu"``), never ``"auto"``.
        backend_requested: The YAML's ``backend`` as written (``"auto"``, ``"emulated"``, ``"npu"``).
    """

    accelerator: str
    device: str
    backend: str
    backend_requested: str = "auto"

    @property
    def emulated_on_npu(self) -> bool:
        """The emulated backend on the npu accelerator (what :func:`emulated_on_npu_error` stops)."""
        return self.accelerator == "npu" and self.backend == "emulated"

    def as_meta(self) -> dict[str, dict[str, Any]]:
        """``{"target": {accelerator, device, backend, backend_requested, emulated_on_npu}}`` for the report."""
        return {"target": {"accelerator": self.accelerator, "device": self.device, "backend": self.backend,
                           "backend_requested": self.backend_requested, "emulated_on_npu": self.emulated_on_npu}}


def _npu_device() -> str:
    """Device 0 of the npu accelerator's device type (``npu:0``; ``cpu`` where tests map the fake NPU to CPU)."""
    from lp_lightning.lightning.accelerator import DEVICE_TYPE

    return "cpu" if DEVICE_TYPE == "cpu" else f"{DEVICE_TYPE}:0"


def run_target(accelerator: Any, backend: str | None = "auto") -> RunTarget:
    """The target of a run on ``accelerator`` with op backend ``backend`` (module docstring).

    Args:
        accelerator: ``trainer.accelerator`` of the user YAML (a name; an accelerator object's class
            name is lower-cased, ``NPUAccelerator`` → ``npu``).
        backend: The YAML's ``backend`` (``"auto"``, ``"emulated"``, ``"npu"``; ``None`` is ``auto``).

    Raises:
        ValueError: an accelerator this table does not know, naming the known ones.
    """
    name = accelerator if isinstance(accelerator, str) else type(accelerator).__name__.lower().removesuffix(
        "accelerator")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name != "npu" and name not in _DEVICE_TYPES:
        raise ValueError(f"trainer.accelerator={accelerator!r}: st cannot place the numerics and conformance on it; "
                         f"use one of {sorted([*_DEVICE_TYPES, 'npu'])} or 'auto' in the YAML.")
    device_type = "npu" if name == "npu" else _DEVICE_TYPES[name]
    device = _npu_device() if name == "npu" else ("cpu" if device_type == "cpu" else f"{device_type}:0")
    requested = str(backend or "auto")
    resolved = requested
    if requested == "auto":
        resolved = backend_for_device_type(device_type) or "emulated"
    return RunTarget(accelerator=name, device=device, backend=resolved, backend_requested=requested)


def emulated_on_npu_error(emulated_on_npu: bool, allow_emulated: bool) -> str | None:
    """The one-line usage error for the emulated backend on the npu accelerator, or ``None`` when ``st`` may go on.

    Args:
        emulated_on_npu: The run's :attr:`RunTarget.emulated_on_npu`.
        allow_emulated: ``--allow_emulated``: the user asked for the emulation on the NPU on purpose.
    """
    if not emulated_on_npu or allow_emulated:
        return None
    return ("the YAML runs the emulated backend (backend: emulated) on the npu accelerator: every GEMM would run on "
            "the host emulation and Q3-11 could not judge the NPU. Set backend: auto (or npu), or pass "
            "--allow_emulated true for an intended emulated run.")


def check_target_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device``, checked usable before any numerics run on it.

    Args:
        device: ``"cpu"``, ``"npu:0"``, ``"cuda:0"`` (:attr:`RunTarget.device`) or a ``torch.device``.

    Raises:
        RuntimeError: an NPU device without an importable ``torch_npu`` or without a visible NPU, or a
            CUDA device without CUDA; the message names the fix.
    """
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if kind == "npu":
        try:
            torch_npu = importlib.import_module("torch_npu")  # renames PrivateUse1 to "npu"
        except ImportError as err:
            raise RuntimeError(
                f"st on {device} (trainer.accelerator npu) needs torch_npu, which does not import "
                f"({err}); install lp-lightning[npu] with the node's CANN, or set trainer.accelerator cpu."
            ) from None
        if not torch_npu.npu.is_available():
            raise RuntimeError(f"st on {device}: torch_npu sees no NPU (torch_npu.npu.is_available() "
                               "is False); check ASCEND_RT_VISIBLE_DEVICES and the driver, or set trainer.accelerator cpu.")
    elif kind == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"st on {device}: CUDA is not available; set trainer.accelerator cpu.")
    return torch.device(device)
