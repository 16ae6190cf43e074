"""Deterministic HCCL reductions for a deterministic run on the npu accelerator (docs/hccl.md).

HCCL's reduce-type collectives (all-reduce, reduce-scatter) are not deterministic unless
``HCCL_DETERMINISTIC`` is ``true`` (its default is ``false``; CANN environment-variable reference).
FSDP2 reduce-scatters every gradient, so without it two runs, or a continuous and a resumed run,
may differ in the last bits on an NPU node even with ``Trainer(deterministic=True)``: the bitwise
resume of docs/outputs.md would not hold. HCCL reads the variable when a communicator is created,
so :func:`apply_hccl_determinism` must run before the process group exists; the FSDP2 strategies
call it in ``setup_environment`` right before they start it, and ``run_summary.json`` records the
outcome (``determinism.hccl``).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Literal

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn

__all__ = ["HCCL_DETERMINISTIC", "HcclDeterminism", "apply_hccl_determinism"]

HCCL_DETERMINISTIC = "HCCL_DETERMINISTIC"
"""The CANN variable that makes HCCL's reduce-type collectives deterministic (``true``/``strict``)."""

_ON = ("true", "strict")


@dataclass(frozen=True)
class HcclDeterminism:
    """What a run on the npu accelerator did about ``HCCL_DETERMINISTIC``.

    Attributes:
        requested: ``torch.are_deterministic_algorithms_enabled()`` at process-group start
            (``Trainer(deterministic=True)``, ``--trainer.deterministic true``, or the user's own call).
        value: The variable's value the process group starts with (``None``: unset, HCCL's ``false``).
        set_by: ``"lp-lightning"`` (set here because the run is deterministic and the user had not set
            it), ``"user"`` (set before the run; left as it was) or ``"unset"``.
    """

    requested: bool
    value: str | None
    set_by: Literal["lp-lightning", "user", "unset"]

    @property
    def deterministic(self) -> bool:
        """Whether HCCL's reductions are deterministic with this value."""
        return (self.value or "").strip().lower() in _ON

    def as_dict(self) -> dict[str, object]:
        return {"requested": self.requested, "variable": HCCL_DETERMINISTIC, "value": self.value,
                "set_by": self.set_by, "deterministic": self.deterministic}


def apply_hccl_determinism(
    *, on_npu: bool, environ: MutableMapping[str, str] | None = None
) -> HcclDeterminism | None:
    """Sets ``HCCL_DETERMINISTIC=true`` for a deterministic run on the npu accelerator, unless the user set it.

    Call before the process group exists (HCCL reads it when a communicator is created).

    Args:
        on_npu: The run uses the npu accelerator (HCCL process groups); otherwise nothing is done.
        environ: The process environment (``os.environ``); a test passes a dict.

    Returns:
        ``None`` off the npu accelerator; else what was found and done. A user value that leaves the
        reductions non-deterministic in a deterministic run is kept and warned about (rank 0).
    """
    if not on_npu:
        return None
    env = os.environ if environ is None else environ
    requested = torch.are_deterministic_algorithms_enabled()
    current = env.get(HCCL_DETERMINISTIC)
    if current is not None:
        result = HcclDeterminism(requested, current, "user")
        if requested and not result.deterministic:
            rank_zero_warn(
                f"{HCCL_DETERMINISTIC}={current!r} with a deterministic run: HCCL's reduce-scatter stays "
                f"non-deterministic, so a resumed run may not match bit for bit; unset it or set it to true."
            )
        return result
    if not requested:
        return HcclDeterminism(False, None, "unset")
    env[HCCL_DETERMINISTIC] = "true"
    return HcclDeterminism(True, "true", "lp-lightning")
