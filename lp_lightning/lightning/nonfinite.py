"""The non-finite guard of the precision plugin: diagnoses skipped steps and stops a run that cannot progress.

The precision plugin (:mod:`lp_lightning.lightning.precision`) skips an optimizer step whose total
gradient norm is NaN/Inf and tells its :class:`NonFiniteGuard`; it also hands the guard the masters
after every applied step. The guard (docs/architecture.md, "The non-finite guard and verified
checkpoints"):

* diagnoses a skipped step with one fused check over all ranks
  (:func:`~lp_lightning.checkpoint.finite.first_nonfinite`): its reason is
  ``"non-finite master weight"`` when a master holds NaN/Inf, else ``"non-finite gradient"`` with
  the first parameter whose gradient does, else ``"gradient norm overflow"`` (every gradient
  finite, their FP32 norm is not); each is logged once and kept in :attr:`NonFiniteGuard.events`;
* checks the masters after every applied step: the low-precision weights through the amax their
  refresh computed (``RefreshReport.master_amax``), the plain parameters directly; the plugin's
  stop request rides in that reduce (``riders``, :mod:`lp_lightning.lightning.preemption`);
* stops the run with :class:`~lp_lightning.checkpoint.finite.NonFiniteStateError` (every rank
  alike: the decisions come from reduced values) when ``max_consecutive_skips`` steps in a row were
  skipped (``0``: never for this reason), and at once when a master holds NaN/Inf: a skipped step
  leaves it as it is and an AdamW step keeps a NaN/Inf, so the run cannot recover.

The error is raised inside the optimizer step, before the step's ``on_train_batch_end``, so no
checkpoint of that step is attempted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch import nn

from lp_lightning.checkpoint.finite import NonFiniteStateError, first_nonfinite

__all__ = [
    "DEFAULT_MAX_CONSECUTIVE_SKIPS",
    "NONFINITE_GRADIENT",
    "NONFINITE_MASTER",
    "NORM_OVERFLOW",
    "NonFiniteGuard",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_CONSECUTIVE_SKIPS = 3
"""Default of ``max_consecutive_skips`` (``--nonfinite.max_consecutive_skips``)."""

NONFINITE_MASTER = "non-finite master weight"
NONFINITE_GRADIENT = "non-finite gradient"
NORM_OVERFLOW = "gradient norm overflow"


LocalWeight = Callable[[torch.Tensor], Any]
"""A parameter's local low-precision weight (``.fqn``, ``.master``) or ``None`` for a plain one: the low-precision
plugin's ``lifecycle.local_weight``; a bf16 run passes no such function."""


class NonFiniteGuard:
    """Counts skipped steps, names their cause and stops the run (see the module docstring).

    Args:
        max_consecutive_skips: Stop after this many skipped steps in a row; ``0``: no limit.

    Attributes:
        max_consecutive_skips: As given.
        consecutive_skips: Skipped steps since the last applied one (the plugin saves it in ``meta.pt``).
        events: ``{"step", "reason", "fqn"}`` per skipped step of this process, in order (``step``:
            the 1-based optimizer step, skipped ones counted, as Lightning's ``global_step``).
        stop: The error that stopped the run (``None`` while it runs).

    Raises:
        ValueError: ``max_consecutive_skips`` is not an int >= 0.
    """

    def __init__(self, max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS) -> None:
        if isinstance(max_consecutive_skips, bool) or not isinstance(max_consecutive_skips, int) or (
            max_consecutive_skips < 0
        ):
            raise ValueError(
                f"nonfinite.max_consecutive_skips must be an int >= 0 (0 = no limit), got {max_consecutive_skips!r}."
            )
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive_skips = 0
        self.events: list[dict[str, Any]] = []
        self.stop: NonFiniteStateError | None = None
        self._names: dict[int, str] = {}

    def name_parameters(self, module: nn.Module) -> None:
        """Remembers the FQNs of ``module``'s parameters (activation-checkpoint prefixes dropped: the
        HF state-dict keys); unnamed parameters are reported as ``parameter <i> <shape>``."""
        self._names = {id(p): name.replace("_checkpoint_wrapped_module.", "") for name, p in module.named_parameters()}

    def _name(self, index: int, param: torch.Tensor) -> str:
        return self._names.get(id(param)) or f"parameter {index} {tuple(param.shape)}"

    def _masters(
        self, params: list[torch.Tensor], *, local_weight: LocalWeight | None, refreshed_amax: Sequence[torch.Tensor] = ()
    ) -> list[tuple[str, torch.Tensor]]:
        """``(fqn, master or its amax)`` per parameter, in optimizer order (see ``first_nonfinite``).

        A low-precision weight contributes its FP32 master (its Parameter dispatches to the 8-bit
        storage), or its refresh's amax when ``refreshed_amax`` is given (one per weight, in order).
        """
        if local_weight is None:
            return [(self._name(i, p), p) for i, p in enumerate(params)]
        amaxes = iter(refreshed_amax)
        named = []
        for i, p in enumerate(params):
            local = local_weight(p)
            if local is None:
                named.append((self._name(i, p), p))
            else:
                named.append((local.fqn, next(amaxes) if refreshed_amax else local.master))
        return named

    def skipped(
        self,
        params: list[torch.Tensor],
        *,
        step: int,
        norm: float,
        local_weight: LocalWeight | None = None,
        riders: torch.Tensor | None = None,
    ) -> None:
        """Records a step skipped for a NaN/Inf gradient norm (collective: every rank calls it).

        ``riders``: other int32 flags MAX-reduced in the masters' reduce, in place (``first_nonfinite``).

        Raises:
            NonFiniteStateError: A master holds NaN/Inf, or the limit of skips in a row is reached.
        """
        self.consecutive_skips += 1
        masters = self._masters(params, local_weight=local_weight)
        reason, fqn = NONFINITE_MASTER, first_nonfinite(masters, riders=riders)
        if fqn is None:
            fqn = first_nonfinite([(self._name(i, p), p.grad) for i, p in enumerate(params) if p.grad is not None])
            reason = NONFINITE_GRADIENT if fqn is not None else NORM_OVERFLOW
        self.events.append({"step": step, "reason": reason, "fqn": fqn})
        rank_zero_only(log.warning)(  # the same on every rank (reduced values): said once
            "step %d: gradient norm %s, optimizer step skipped (no weight update, no low-precision refresh): %s%s; "
            "%d skipped in a row.", step, norm, reason, f" ({fqn})" if fqn else "", self.consecutive_skips,
        )
        limit = self.max_consecutive_skips
        if reason == NONFINITE_MASTER or (limit and self.consecutive_skips >= limit):
            self._raise_stop(reason, fqn, step)

    def applied(
        self,
        params: list[torch.Tensor],
        *,
        step: int,
        local_weight: LocalWeight | None = None,
        refreshed_amax: Sequence[torch.Tensor] = (),
        riders: torch.Tensor | None = None,
    ) -> None:
        """Checks the masters after an applied step (collective).

        ``riders``: other int32 flags MAX-reduced in the same reduce, in place (``first_nonfinite``).

        Raises:
            NonFiniteStateError: A master holds NaN/Inf.
        """
        self.consecutive_skips = 0
        masters = self._masters(params, local_weight=local_weight, refreshed_amax=refreshed_amax)
        fqn = first_nonfinite(masters, riders=riders)
        if fqn is not None:
            self._raise_stop(NONFINITE_MASTER, fqn, step)

    def _raise_stop(self, reason: str, fqn: str | None, step: int) -> None:
        skips = self.consecutive_skips
        where = f" ({fqn!r})" if fqn else ""
        if reason == NONFINITE_MASTER:
            seen = f"{skips} step(s) skipped in a row" if skips else "after an applied optimizer step"
            message = (
                f"training stopped at step {step}: {reason}{where} ({seen}); a NaN/Inf master never becomes "
                "finite again and is never saved. Find the cause, then resume from the last checkpoint."
            )
        else:
            message = (
                f"training stopped at step {step}: {skips} optimizer steps skipped in a row ({reason}{where}), "
                f"nonfinite.max_consecutive_skips={self.max_consecutive_skips}. Lower --model.lr, check the data, "
                "or raise the limit."
            )
        self.stop = NonFiniteStateError(message, reason=reason, fqn=fqn, step=step, consecutive_skips=skips)
        raise self.stop
