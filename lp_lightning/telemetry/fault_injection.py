"""A public test hook: a non-finite gradient at a chosen optimizer step (docs/acceptance.md "Skipped step").

:class:`InjectNonFiniteGradient` is the one callback of this package that writes to a tensor, and it
is named as such: it exists so that an acceptance run (``lp-lightning st``) or a user's YAML can show
the product's answer to a NaN/Inf gradient — the non-finite guard skips ``optimizer.step()`` and the
weight refresh of that step (docs/architecture.md "The non-finite guard") — without patching
anything. It acts through Lightning's public ``on_before_optimizer_step`` hook, which the precision
plugin calls inside the training closure after backward and before it computes the total gradient
norm, so the guard sees the value exactly as it would see an overflowed gradient::

    trainer:
      callbacks:
        - class_path: lp_lightning.telemetry.InjectNonFiniteGradient
          init_args: {step: 2}

It is a Trainer callback (Fabric has no ``on_before_optimizer_step``; there, write the value before
``optimizer.step()`` in the loop). It writes ``inject_rank<r>.json`` like the probes (:mod:`lp_lightning.telemetry.probe_callbacks`):
``{"at_step", "value", "on_rank", "parameter", "injected": [{"step", "fqn", "rank", "value",
"index"}]}`` — ``injected`` is empty on the ranks that wrote nothing.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lp_lightning.telemetry.probe_base import ProbeCallback

__all__ = ["InjectNonFiniteGradient"]

_VALUES = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _plain_fqn(name: str) -> str:
    """The parameter's FQN without the recompute wrapper's segment (the checkpoint keys' spelling)."""
    return name.replace("._checkpoint_wrapped_module", "")


class InjectNonFiniteGradient(ProbeCallback):
    """Writes one non-finite value into one gradient at optimizer step ``step`` (a test hook, not a probe).

    The value goes into element 0 of this rank's shard of the first parameter (in
    ``named_parameters`` order) whose FQN matches ``parameter`` and whose local gradient is not
    empty. FQNs are those of the LightningModule's ``model`` when it has one (``DeepSeekV3LM``: the
    checkpoint keys, ``model.layers.0.mlp.gate_proj.weight``), else of the LightningModule. With FSDP2 the gradient is this rank's reduce-scattered shard, so the total norm — and
    every rank's guard decision, which comes from reduced values — becomes non-finite.

    Args:
        step: The optimizer step (1-based, the global step after it) whose gradient is spoiled.
        value: ``"inf"``, ``"-inf"`` or ``"nan"``.
        parameter: An fnmatch glob over the parameters' FQNs (default: any).
        rank: The rank that writes the value (the others write nothing).
        out_dir: Folder of ``inject_rank<r>.json``; ``null`` = ``<trainer.default_root_dir>/probes``.

    Raises:
        ValueError: ``step`` < 1, an unknown ``value`` or ``rank`` < 0 (at construction); ``parameter``
            matches no FQN of the model (when the fit starts); at the step, no parameter matching
            ``parameter`` holds a non-empty gradient on ``rank``.
    """

    kind = "inject"

    def __init__(self, step: int, value: str = "inf", parameter: str = "*", rank: int = 0,
                 out_dir: str | None = None) -> None:
        problems = []
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            problems.append(f"step={step!r} must be an int >= 1 (the 1-based optimizer step to spoil)")
        if value not in _VALUES:
            problems.append(f"value={value!r} must be one of {sorted(_VALUES)}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            problems.append(f"rank={rank!r} must be an int >= 0")
        if problems:
            raise ValueError(f"InjectNonFiniteGradient: {'; '.join(problems)}.")
        super().__init__(out_dir=out_dir, sample_every=1)
        self.step, self.value, self.parameter, self.rank = step, value, parameter, rank
        self._injected: list[dict[str, Any]] = []

    def _on_start(self) -> None:
        self._injected = []
        model = self._model
        model = model.model if isinstance(getattr(model, "model", None), torch.nn.Module) else model
        names = [_plain_fqn(n) for n, _ in model.named_parameters()] if model is not None else []
        if names and not any(fnmatch.fnmatch(n, self.parameter) for n in names):  # fail at the start, not the step
            raise ValueError(f"InjectNonFiniteGradient: parameter={self.parameter!r} matches no parameter FQN of the "
                             f"model (e.g. {names[0]!r}); fix the glob.")

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step + 1 != self.step or trainer.global_rank != self.rank:
            return
        model = pl_module.model if isinstance(getattr(pl_module, "model", None), torch.nn.Module) else pl_module
        for name, param in model.named_parameters():
            fqn = _plain_fqn(name)
            grad = param.grad
            if grad is None or not fnmatch.fnmatch(fqn, self.parameter):
                continue
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            if local.numel() == 0:
                continue
            with torch.no_grad():
                local.view(-1)[0] = _VALUES[self.value]
            self._injected.append({"step": self.step, "fqn": fqn, "rank": self.rank, "value": self.value,
                                   "index": 0})
            return
        raise ValueError(f"InjectNonFiniteGradient: no parameter matching {self.parameter!r} has a non-empty "
                         f"gradient on rank {self.rank} at step {self.step}; widen parameter= or pick another rank.")

    def _payload(self) -> dict[str, Any]:
        return {"at_step": self.step, "value": self.value, "on_rank": self.rank, "parameter": self.parameter,
                "injected": list(self._injected)}
