"""NaN/Inf checks of training state over all ranks: the non-finite guard's primitives.

:func:`first_nonfinite` answers "which of these tensors holds a NaN or an Inf on any rank?" with
one fused reduction per call: one 0-d FP32 ``max |x|`` per tensor (this rank's shard of a
``DTensor``), stacked, tested with ``isfinite`` and MAX-reduced over the process group as one
int32 vector, so every rank gets the same answer, the first offending name in the order given.
A caller that already holds a tensor's amax (the weight refresh computes one per low-precision
master, :func:`lp_lightning.fsdp.refresh.refresh_low_precision_weights`) passes that 0-d amax
instead of the tensor: ``max |amax|`` is the amax itself.

Users (docs/architecture.md, "The non-finite guard"):

* the precision plugin after every applied optimizer step (masters) and on a skipped step (the
  reason: a non-finite master, a non-finite gradient, or a norm that overflowed); that reduce also
  carries the stop request of every rank (``riders``, :mod:`lp_lightning.lightning.preemption`);
* :func:`lp_lightning.checkpoint.dcp.save_dcp_checkpoint` before anything is written
  (masters, AdamW moments), and the load after DCP has read (the same tensors).

Every rank must call it with the same names in the same order (collective).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lp_lightning.observers import notify_collective

__all__ = ["NonFiniteStateError", "first_nonfinite", "flatten_state", "local_amax"]


class NonFiniteStateError(RuntimeError):
    """The training state holds NaN/Inf, or the run skipped too many steps in a row; the run stops.

    Raised on every rank alike (the decision comes from all-reduced values), so Lightning's
    exception hooks run everywhere and ``lp-lightning fit`` prints ``str(err)`` once and exits 1.

    Args:
        message: One line: what stopped the run, the step, the skip count, the FQN, the fix.
        reason: ``"non-finite gradient"``, ``"gradient norm overflow"``, ``"non-finite master weight"``
            or ``"non-finite state at checkpoint save"``.
        fqn: The first offending parameter / checkpoint key (``None`` when none is non-finite, e.g.
            a norm overflow of finite gradients).
        step: The optimizer step (1-based, counting skipped ones) where the run stopped.
        consecutive_skips: Skipped steps in a row when the run stopped.

    Attributes:
        resume_checkpoint: The newest checkpoint on disk, filled in by
            :class:`~lp_lightning.lightning.callbacks.PeriodicCheckpoint` when it knows one (``None``
            otherwise); shown after the message.
    """

    def __init__(
        self, message: str, *, reason: str, fqn: str | None, step: int | None = None, consecutive_skips: int = 0
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.fqn = fqn
        self.step = step
        self.consecutive_skips = consecutive_skips
        self.resume_checkpoint: str | None = None

    def __str__(self) -> str:
        if self.resume_checkpoint is None:
            return self.message
        return f"{self.message} Last good checkpoint: {self.resume_checkpoint!r} (--ckpt_path last resumes it)."

    def as_dict(self) -> dict[str, Any]:
        """``{"step", "reason", "fqn", "consecutive_skips", "message", "resume_checkpoint"}`` for run_summary.json."""
        return {
            "step": self.step, "reason": self.reason, "fqn": self.fqn, "consecutive_skips": self.consecutive_skips,
            "message": self.message, "resume_checkpoint": self.resume_checkpoint,
        }


def local_amax(tensor: torch.Tensor) -> torch.Tensor:
    """``max |x|`` of this rank's part of ``tensor`` as an FP32 0-d tensor (0 when the part is empty).

    NaN anywhere gives NaN (``torch.amax`` propagates it); an Inf gives Inf.

    Args:
        tensor: A floating-point tensor or ``DTensor`` (its local shard is read).
    """
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    local = local.detach()
    if local.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=local.device)
    low, high = torch.aminmax(local)  # one read, no |x| temporary; |max(-min, max)| is exact (as formats.amax)
    return torch.maximum(high, low.neg()).abs().to(torch.float32)


def flatten_state(state: Mapping[str, Any], prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """The floating-point tensors of a nested state dict with dotted keys, in insertion order.

    ``{"optimizer": {"state": {"w": {"exp_avg": t}}}}`` gives ``[("optimizer.state.w.exp_avg", t)]``
    (the keys DCP writes); lists and tuples count their items (``param_groups.0.lr``); non-tensor
    and integer leaves are left out.
    """
    out: list[tuple[str, torch.Tensor]] = []
    items: Iterable[tuple[Any, Any]] = state.items() if isinstance(state, Mapping) else enumerate(state)
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                out.append((name, value))
        elif isinstance(value, (Mapping, list, tuple)):
            out.extend(flatten_state(value, prefix=f"{name}."))
    return out


def first_nonfinite(
    named: Iterable[tuple[str, torch.Tensor]],
    *,
    group: dist.ProcessGroup | None = None,
    riders: torch.Tensor | None = None,
) -> str | None:
    """The first name whose tensor holds NaN/Inf on any rank, or ``None`` (collective, see the module docstring).

    Args:
        named: ``(name, tensor)`` pairs, identical names and order on every rank; non-floating
            tensors are skipped. A 0-d tensor may stand for a precomputed amax.
        group: The process group to reduce over (default: the default group, when initialised).
        riders: An int32 vector of other per-step flags, the same length on every rank, MAX-reduced
            in the same collective and overwritten in place with the result (the stop request of
            :mod:`lp_lightning.lightning.preemption`: one collective serves both).

    Returns:
        The first offending name in ``named`` order, the same on every rank.
    """
    names: list[str] = []
    amaxes: list[torch.Tensor] = []
    for name, tensor in named:
        if tensor.is_floating_point():
            names.append(name)
            amaxes.append(local_amax(tensor))
    if not names and riders is None:
        return None
    device = next((a.device for a in amaxes if a.device.type != "cpu"), torch.device("cpu"))
    flags = (~torch.isfinite(torch.stack([a.to(device) for a in amaxes]))).to(torch.int32) if names else (
        torch.zeros(0, dtype=torch.int32, device=device))
    if riders is not None:
        flags = torch.cat([flags, riders.to(device=device, dtype=torch.int32)])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        notify_collective("all_reduce", flags, "first_nonfinite")
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if riders is not None:
        riders.copy_(flags[len(names):])
        flags = flags[: len(names)]
    bad = torch.nonzero(flags).flatten()
    return names[int(bad[0])] if bad.numel() else None
