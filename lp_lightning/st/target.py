"""Where ``lp-lightning st`` computes the layered numerics N-1/N-2: the run's device and op backend.

The user YAML's ``trainer.accelerator`` and ``backend`` (the keys ``lp-lightning fit`` reads) name them,
resolved as the startup gate resolves a run's backend (docs/architecture.md "The startup gate"):

- ``npu``: device ``npu:0``; backend ``auto`` is ``npu`` (the backend registered for the device type);
- ``gpu`` / ``cuda``: device ``cuda:0``; ``auto`` is ``emulated`` (no CUDA backend is registered);
- ``cpu``: device ``cpu``; ``auto`` is ``emulated``;
- ``auto``: ``cuda:0`` when CUDA is available, else ``cpu`` (Lightning's choice; ``auto`` never picks
  an NPU).

An explicit ``backend: emulated`` or ``npu`` is kept. ``st`` runs the numerics in its own process
after the training runs have ended, so the device is free.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from lp_lightning.ops.backend import backend_for_device_type

__all__ = ["NumericsTarget", "check_numerics_device", "numerics_target"]

_DEVICES = {"npu": "npu:0", "gpu": "cuda:0", "cuda": "cuda:0", "cpu": "cpu"}


@dataclass(frozen=True)
class NumericsTarget:
    """The device and op backend of N-1/N-2.

    Attributes:
        accelerator: The YAML's ``trainer.accelerator`` (``"cpu"``, ``"npu"``, ...).
        device: The torch device string the numerics run on (``"cpu"``, ``"npu:0"``, ``"cuda:0"``).
        backend: The resolved op backend (``"emulated"``, ``"npu"``), never ``"auto"``.
    """

    accelerator: str
    device: str
    backend: str

    def as_meta(self) -> dict[str, str]:
        """``numerics_accelerator``, ``numerics_device`` and ``numerics_backend`` for the report's meta."""
        return {"numerics_accelerator": self.accelerator, "numerics_device": self.device,
                "numerics_backend": self.backend}


def numerics_target(accelerator: Any, backend: str = "auto") -> NumericsTarget:
    """The numerics target of a run on ``accelerator`` with op backend ``backend`` (module docstring).

    Args:
        accelerator: ``trainer.accelerator`` of the user YAML (a name; an accelerator object's class
            name is lower-cased, ``NPUAccelerator`` → ``npu``).
        backend: The YAML's ``backend`` (``"auto"``, ``"emulated"``, ``"npu"``).

    Raises:
        ValueError: an accelerator this table does not know, naming the known ones.
    """
    name = accelerator if isinstance(accelerator, str) else type(accelerator).__name__.lower().removesuffix(
        "accelerator")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name not in _DEVICES:
        raise ValueError(f"trainer.accelerator={accelerator!r}: st cannot place the layered numerics on it; use one of "
                         f"{sorted(_DEVICES)} or 'auto' in the YAML.")
    device = _DEVICES[name]
    resolved = backend
    if backend == "auto":
        resolved = backend_for_device_type(device.split(":")[0]) or "emulated"
    return NumericsTarget(accelerator=name, device=device, backend=resolved)


def check_numerics_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device``, checked usable before any numerics run on it.

    Args:
        device: ``"cpu"``, ``"npu:0"``, ``"cuda:0"`` (:attr:`NumericsTarget.device`) or a ``torch.device``.

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
                f"st numerics on {device} (trainer.accelerator npu) need torch_npu, which does not import "
                f"({err}); install lp-lightning[npu] with the node's CANN, or set trainer.accelerator cpu."
            ) from None
        if not torch_npu.npu.is_available():
            raise RuntimeError(f"st numerics on {device}: torch_npu sees no NPU (torch_npu.npu.is_available() "
                               "is False); check ASCEND_RT_VISIBLE_DEVICES and the driver, or set trainer.accelerator cpu.")
    elif kind == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"st numerics on {device}: CUDA is not available; set trainer.accelerator cpu.")
    return torch.device(device)
