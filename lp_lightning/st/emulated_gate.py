"""Where the acceptance's runs execute, and the stop for an emulated backend on the NPU (design spec §17.2 Q3-11).

The emulated backend is a bit-exact model of the hardware's numerics, not of its speed: on an NPU
node a YAML with ``backend: emulated`` would run every low-precision GEMM on the host emulation,
pass every numerics row, make Q3-11 ``not-applicable`` and exit 0 — an acceptance that proved
nothing about the Ascend kernels. ``lp-lightning st`` therefore stops before any run when the
user's YAML puts the npu accelerator together with the emulated backend, unless
``--allow_emulated true`` says this is intended (a debugging run); the report's meta records the
accelerator, the backend and ``emulated_on_npu`` either way (docs/acceptance.md).
"""

from __future__ import annotations

from typing import Any

__all__ = ["emulated_on_npu_error", "run_target"]


def run_target(parsed: Any) -> dict[str, Any]:
    """The accelerator and op backend the user's YAML gives every run (``parsed``: the fit config namespace).

    Returns:
        ``{"accelerator", "backend", "emulated_on_npu"}``: the ``trainer.accelerator`` and ``backend``
        values as written (``auto`` resolves to ``npu`` on the npu accelerator, ``emulated`` elsewhere:
        docs/architecture.md "Backends"), and whether the emulated backend was asked for on the npu accelerator.
    """
    accelerator = str(parsed.trainer.accelerator)
    backend = str(parsed.get("backend") or "auto")
    return {"accelerator": accelerator, "backend": backend,
            "emulated_on_npu": accelerator == "npu" and backend == "emulated"}


def emulated_on_npu_error(target: dict[str, Any], allow_emulated: bool) -> str | None:
    """The one-line usage error for the emulated backend on the npu accelerator, or ``None`` when the run may go on.

    Args:
        target: :func:`run_target`'s result.
        allow_emulated: ``--allow_emulated``: the user asked for the emulation on the NPU on purpose.
    """
    if not target["emulated_on_npu"] or allow_emulated:
        return None
    return ("the YAML runs the emulated backend (backend: emulated) on the npu accelerator: every GEMM would run on "
            "the host emulation and Q3-11 could not judge the NPU. Set backend: auto (or npu), or pass "
            "--allow_emulated true for an intended emulated run.")
