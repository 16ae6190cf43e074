"""The startup gate: hardware, torch_npu and op checks before the model is built (design spec §15 rows 1–3).

The FSDP2 strategies run :func:`run_startup_gate` once per process in ``setup_environment``, before
the process group, the model or the optimizer exist. It picks the op backend of the run and runs
that backend's checks (:meth:`~lp_lightning.ops.backend.Backend.startup_checks`); any failing check
stops the run with :class:`StartupGateError` naming the missing piece and the fix. There is no
fall-back: a failing ``npu`` check never becomes ``emulated``.

Backend choice (the ``backend:`` key, ``--backend``):

=================  ====================================================================
``auto``           the backend registered for the run's device type: ``npu`` on the
                   ``npu`` accelerator (its checks must pass, else the run stops), and
                   ``emulated`` on CPU and CUDA
``emulated``       the exact software emulation, on any device (an NPU run computes
                   with it only when this is asked for explicitly)
``npu``            torch_npu's kernels, on the npu accelerator only; without an Ascend 950
                   the checks fail
=================  ====================================================================

In ``bf16`` no low-precision op runs (backend ``"none"``); on the ``npu`` accelerator the gate
still checks the hardware rows that do not depend on a format (torch_npu installed, its version
matching torch, an NPU visible). The result is printed once (rank zero) and recorded in
``run_summary.json`` under ``startup_gate``; the precision plugin then builds the run's recipes
with the chosen backend (``LowPrecisionPolicy.backend``), so every op call of the run names it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lp_lightning.formats.spec import FormatSpec, as_spec
from lp_lightning.ops.backend import (
    AUTO,
    GateCheck,
    LowPrecisionUnsupportedError,
    backend_for_device_type,
    device_type_of_backend,
    get_backend_impl,
    parse_backend_name,
)

__all__ = ["StartupGateError", "StartupGateResult", "run_startup_gate"]


class StartupGateError(LowPrecisionUnsupportedError):
    """A startup-gate check failed (design spec §15: startup failure, no fall-back).

    Attributes:
        result: The gate's result, with every check run (the failing ones have ``ok=False``).
    """

    def __init__(self, message: str, result: StartupGateResult) -> None:
        super().__init__(message)
        self.result = result


@dataclass(frozen=True)
class StartupGateResult:
    """What the startup gate checked and chose.

    Attributes:
        requested: The ``backend`` setting: ``"auto"``, ``"emulated"`` or ``"npu"``.
        backend: The op backend of the run: ``"none"`` (``bf16``), ``"emulated"`` or ``"npu"``.
        device_type: The run's accelerator device type (``"cpu"``, ``"cuda"``, ``"npu"``).
        format: The low-precision format's name, ``None`` in ``bf16``.
        checks: The checks run, in order.
    """

    requested: str
    backend: str
    device_type: str
    format: str | None
    checks: tuple[GateCheck, ...]

    @property
    def ok(self) -> bool:
        """Whether every check passed."""
        return all(check.ok for check in self.checks)

    def describe(self) -> str:
        """Multi-line text printed at startup: the choice, then one line per check."""
        what = self.format or "bf16 (no low-precision op)"
        head = (f"lp-lightning startup gate (design spec §15): {what} on {self.device_type}, backend "
                f"{self.requested!r} -> {self.backend!r}")
        if self.backend == "emulated":
            head += " (exact software emulation)"
        lines = [head]
        lines += [f"  [{'ok' if c.ok else 'FAILED'}] {c.name}: {c.seen}" for c in self.checks]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """JSON form (``run_summary.json`` ``startup_gate``)."""
        return {
            "requested": self.requested, "backend": self.backend, "device_type": self.device_type,
            "format": self.format, "ok": self.ok, "checks": [asdict(check) for check in self.checks],
        }


def run_startup_gate(
    format: FormatSpec | str | None, *, device_type: str, backend: str = AUTO
) -> StartupGateResult:
    """Choose the run's op backend and run its checks (module docstring).

    Args:
        format: The low-precision format (a ``FormatSpec`` or registered name); ``None`` for ``bf16``.
        device_type: The accelerator's device type: ``"npu"`` for the npu accelerator (also when a
            test maps its devices to CPU memory), else the root device's type.
        backend: ``"auto"`` or a registered backend name.

    Returns:
        The result; every check in it passed.

    Raises:
        ValueError: an unknown backend or format name.
        StartupGateError: a check failed; the message is the first failure's (what is missing
            and the fix), ``error.result`` holds every check.
    """
    requested = parse_backend_name(backend, "backend")
    hardware = backend_for_device_type(device_type)
    if format is None:
        name, checks = "none", () if hardware is None else get_backend_impl(hardware).startup_checks(None)
        fmt = None
    else:
        spec = as_spec(format)
        fmt = spec.name
        name = requested if requested != AUTO else (hardware or "emulated")
        computes_on = device_type_of_backend(name)
        if computes_on not in (None, device_type):  # e.g. --backend npu with the cpu accelerator
            failure = (f"backend {name!r} computes on {computes_on} devices, but this run's accelerator is "
                       f"{device_type}; pass --trainer.accelerator {computes_on}, or --backend emulated.")
            checks = (GateCheck("backend device", f"{name} on {device_type}", False, failure),)
        else:
            checks = tuple(get_backend_impl(name).startup_checks(spec))
    result = StartupGateResult(requested, name, device_type, fmt, tuple(checks))
    failed = [check for check in result.checks if not check.ok]
    if failed:
        more = f" ({len(failed) - 1} more failed check(s) printed above)" if len(failed) > 1 else ""
        raise StartupGateError(f"startup gate: {failed[0].message}{more}", result)
    return result
