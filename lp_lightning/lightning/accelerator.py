"""The ``npu`` accelerator (Ascend NPUs through torch_npu) for Lightning's Trainer, Fabric and the CLI.

Lightning 2.6 knows ``cpu``, ``cuda``, ``mps`` and ``tpu``; ``Trainer(accelerator="npu")`` needs an
accelerator registered under that name. This module provides it, written like Lightning's own
``CUDAAccelerator`` (``lightning/pytorch/accelerators/cuda.py`` and
``lightning/fabric/accelerators/cuda.py``):

* :class:`NPUFabricAccelerator` (Fabric) and :class:`NPUAccelerator` (Trainer; adds ``setup`` and
  ``get_device_stats``): devices ``torch.device("npu", i)``; ``setup_device`` =
  ``torch_npu.npu.set_device``; ``auto_device_count`` / ``is_available`` from
  ``torch_npu.npu.device_count`` / ``is_available``; device statistics from
  ``torch_npu.npu.memory_stats``; teardown empties the NPU caching allocator.
* ``devices`` is parsed as for CUDA (:func:`parse_npu_devices`): an int ``N`` = NPUs ``0..N-1``,
  a list or ``"0,3"`` = those indices, ``-1`` / ``"-1"`` / ``"auto"`` = every visible NPU.
  Under ``torchrun`` (Lightning's ``TorchElasticEnvironment``) each process takes
  ``parallel_devices[LOCAL_RANK]``, i.e. ``npu:LOCAL_RANK``, on every node.
* The FSDP2 strategies (:mod:`lp_lightning.lightning.strategy`) pick the process-group backend and
  the device mesh from the root device's type: ``hccl`` and an ``"npu"`` mesh here (FSDP2
  collectives and DCP's metadata exchange use the default group).

``torch_npu`` is imported only when the accelerator is used. :func:`register_npu_accelerator`
adds ``"npu"`` to both Lightning registries when torch_npu is *importable*
(``importlib.util.find_spec``, which does not import it); it is idempotent and runs when
:mod:`lp_lightning.lightning` is imported and again whenever an FSDP2 strategy is built (so a
torch_npu installed afterwards is seen). Without torch_npu, ``lp-lightning fit --trainer.accelerator
npu`` fails while parsing with :func:`npu_accelerator_error`'s message (install command and CANN)
instead of Lightning's list of known names. Install: ``pip install 'lp-lightning[npu]'`` with the
torch_npu release matching the installed torch and CANN (docs/ascend.md).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from types import ModuleType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.accelerators import ACCELERATOR_REGISTRY
from lightning.fabric.accelerators.accelerator import Accelerator as FabricAccelerator
from lightning.fabric.accelerators.registry import _AcceleratorRegistry
from lightning.fabric.utilities.device_parser import (
    _check_data_type,
    _check_unique,
    _normalize_parse_gpu_string_input,
)
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.types import _DEVICE
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.accelerators.accelerator import Accelerator
from typing_extensions import override

__all__ = [
    "DEVICE_TYPE",
    "INSTALL_FIX",
    "NAME",
    "NPUAccelerator",
    "NPUFabricAccelerator",
    "npu_accelerator_error",
    "parse_npu_devices",
    "register_npu_accelerator",
]

_log = logging.getLogger(__name__)

NAME = "npu"
"""The registry name: ``Trainer(accelerator="npu")``, ``--trainer.accelerator npu``."""

DEVICE_TYPE = "npu"
"""``torch.device`` type of the accelerator's devices (torch_npu renames PrivateUse1 to it on import)."""

INSTALL_FIX = "pip install torch==2.13.0 torch-npu==2.13.0 (a torch/torch_npu pair; source CANN's set_env.sh)"
"""How to get torch_npu (named in the errors)."""


_IMPORT_FAILURES = (ImportError, OSError, RuntimeError)
"""What ``import torch_npu`` raises when CANN's libraries are missing or versions do not match."""


def _torch_npu() -> ModuleType:
    import torch_npu  # noqa: PLC0415 - imported only when the accelerator is used

    return torch_npu


def _torch_npu_importable() -> bool:
    """Whether ``import torch_npu`` would find a module, without importing it."""
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except ValueError:  # in sys.modules without a __spec__ (placed by hand): already imported
        return sys.modules.get("torch_npu") is not None


def parse_npu_devices(devices: int | str | list[int]) -> list[int] | None:
    """The NPU indices ``devices`` selects (Lightning's rules for CUDA ids, counted by torch_npu).

    Args:
        devices: ``N > 0`` (NPUs ``0..N-1``), a list of indices or a string ``"0,3"`` / ``"2"``,
            ``-1`` / ``"-1"`` / ``"auto"`` (every visible NPU), ``0`` / ``"0"`` / ``[]`` (none).

    Returns:
        The indices, or ``None`` when no NPU is requested (Lightning then reports the
        ``devices`` value as invalid for this accelerator).

    Raises:
        TypeError: ``devices`` is not an int, a string or a sequence of ints.
        MisconfigurationException: An index repeats or is not below
            ``torch_npu.npu.device_count()``, or ``-1`` finds no NPU.
    """
    if devices == "auto":
        devices = -1
    _check_data_type(devices)
    if (isinstance(devices, (list, tuple)) and not devices) or str(devices).strip() == "0":
        return None
    requested = _normalize_parse_gpu_string_input(devices)
    if isinstance(requested, int) and requested < -1:
        raise MisconfigurationException(
            f"devices={devices!r} is not valid for the npu accelerator; pass N > 0, a list of NPU indices, -1 or 'auto'."
        )
    visible = NPUFabricAccelerator.auto_device_count()
    ids = list(range(visible if requested == -1 else requested)) if isinstance(requested, int) else list(requested)
    if not ids:
        raise MisconfigurationException(
            f"devices={devices!r} asks for every NPU, but torch_npu.npu.device_count() is 0; check `npu-smi info` "
            f"and ASCEND_RT_VISIBLE_DEVICES."
        )
    _check_unique(ids)
    # As Lightning's CUDA parsing: under torchrun a process may see only its own NPU.
    if torch.distributed.is_available() and torch.distributed.is_torchelastic_launched() and visible == 1:
        return ids
    missing = [i for i in ids if not 0 <= i < visible]
    if missing:
        raise MisconfigurationException(
            f"devices={devices!r} selects NPU(s) {missing}, but torch_npu.npu.device_count() is {visible}; "
            f"pass at most {visible} devices (ASCEND_RT_VISIBLE_DEVICES limits what is visible)."
        )
    return ids


class NPUFabricAccelerator(FabricAccelerator):
    """Fabric accelerator for Ascend NPUs (module docstring); registered as ``"npu"``."""

    @override
    def setup_device(self, device: torch.device) -> None:
        """Makes ``device`` this process's current NPU (``torch_npu.npu.set_device``).

        Raises:
            ValueError: ``device`` is not an NPU device.
        """
        if device.type != DEVICE_TYPE:
            raise ValueError(f"the npu accelerator sets up {DEVICE_TYPE} devices; got {device}.")
        _torch_npu().npu.set_device(device)

    @override
    def teardown(self) -> None:
        """Releases the cached blocks of the NPU caching allocator (``torch_npu.npu.empty_cache``)."""
        _torch_npu().npu.empty_cache()

    @staticmethod
    @override
    def parse_devices(devices: int | str | list[int]) -> list[int] | None:
        """See :func:`parse_npu_devices`."""
        return parse_npu_devices(devices)

    @staticmethod
    @override
    def get_parallel_devices(devices: list[int]) -> list[torch.device]:
        """``[torch.device("npu", i) for i in devices]``; process ``LOCAL_RANK`` uses entry ``LOCAL_RANK``."""
        return [torch.device(DEVICE_TYPE, i) for i in devices]

    @staticmethod
    @override
    def auto_device_count() -> int:
        """Number of NPUs visible to this process (``torch_npu.npu.device_count()``)."""
        return int(_torch_npu().npu.device_count())

    @staticmethod
    @override
    def is_available() -> bool:
        """Whether torch_npu imports and sees an NPU (``torch_npu.npu.is_available()``)."""
        try:
            torch_npu = _torch_npu()
        except _IMPORT_FAILURES:  # npu_accelerator_error says why (the CLI checks it while parsing)
            return False
        return bool(torch_npu.npu.is_available())

    @staticmethod
    @override
    def name() -> str:
        return NAME

    @classmethod
    @override
    def register_accelerators(cls, accelerator_registry: _AcceleratorRegistry) -> None:
        accelerator_registry.register(cls.name(), cls, description=cls.__name__)


class NPUAccelerator(NPUFabricAccelerator, Accelerator):
    """Trainer accelerator for Ascend NPUs: :class:`NPUFabricAccelerator` plus device statistics."""

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Logs which NPUs this process sees (as Lightning's CUDA accelerator logs CUDA_VISIBLE_DEVICES)."""
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", ",".join(map(str, range(self.auto_device_count()))))
        _log.info(f"LOCAL_RANK: {trainer.local_rank} - ASCEND_RT_VISIBLE_DEVICES: [{visible}]")

    @override
    def get_device_stats(self, device: _DEVICE) -> dict[str, Any]:
        """``torch_npu.npu.memory_stats(device)`` (the caching allocator's counters, CUDA's key names)."""
        return dict(_torch_npu().npu.memory_stats(device))


def register_npu_accelerator() -> bool:
    """Registers ``"npu"`` in Lightning's Trainer and Fabric accelerator registries if torch_npu is importable.

    Idempotent; never imports torch_npu. An ``"npu"`` entry that is already there (ours, or another
    package's) is left as it is.

    Returns:
        Whether torch_npu is importable (then both registries hold ``"npu"``).
    """
    if not _torch_npu_importable():
        return False
    for registry, accelerator in ((AcceleratorRegistry, NPUAccelerator), (ACCELERATOR_REGISTRY, NPUFabricAccelerator)):
        if NAME not in registry:
            accelerator.register_accelerators(registry)
    return True


def npu_accelerator_error(accelerator: object) -> str | None:
    """Why ``trainer.accelerator`` cannot run on this machine, or ``None`` (only ``"npu"`` is checked).

    Registers the accelerator first (:func:`register_npu_accelerator`); then checks that torch_npu is
    installed, that it imports (CANN's libraries found) and that it sees an NPU. Imports torch_npu
    only when ``accelerator == "npu"``.

    Args:
        accelerator: The ``trainer.accelerator`` value (a name, or an Accelerator instance).

    Returns:
        A message naming the missing piece and the fix, or ``None``.
    """
    if accelerator != NAME:
        return None
    if not register_npu_accelerator():
        return f"trainer.accelerator='npu' needs torch_npu, which is not installed; install it with {INSTALL_FIX}."
    try:
        torch_npu = _torch_npu()
    except _IMPORT_FAILURES as exc:
        return (
            f"trainer.accelerator='npu': torch_npu is installed but fails to import ({str(exc)[:120]}); source "
            f"CANN's set_env.sh and check that torch, torch_npu and CANN versions match."
        )
    if not torch_npu.npu.is_available():
        return (
            "trainer.accelerator='npu': torch_npu.npu.is_available() is False (no NPU visible to this process); "
            "check `npu-smi info` and ASCEND_RT_VISIBLE_DEVICES."
        )
    return None
