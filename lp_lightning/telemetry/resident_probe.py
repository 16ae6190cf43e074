"""What a run loaded and keeps resident (design spec §17.4 "extra dependencies, resident objects"), and its gradients.

:class:`ResidentObjectsProbe` reads, at the end of training, ``sys.modules`` and the model's
parameters — nothing else — and writes ``resident_rank<r>.json``::

    {"modules": {"top_level": [...], "distributions": [...], "generated_top_level": n,
                 "lp_lightning": [...], "low_precision": [...]},
     "parameters": {"count", "by_class": {"<local tensor class>": n}, "master_bytes",
                    "low_precision_weights", "low_precision_storage_bytes",
                    "low_precision_storage_tensors"}}

``top_level``: the top-level packages imported in the process that are the standard library's or an
installed distribution's (``torch``, ``lightning``, …); ``distributions``: those distributions (the
run's dependencies, :func:`importlib.metadata.packages_distributions`); ``generated_top_level``: how
many other top-level modules were imported (code generated at run time, e.g. torch.compile's
code-cache modules, named by a hash);
``low_precision``: the imported modules of the low-precision stack (the modules a bf16 run must not
load, docs/architecture.md "Layers": ``formats`` beyond the registry, ``ops``, ``tensor``,
``functional``, ``modules``, ``fsdp`` beyond ``parallelize``/``optimizer``, the experts adapter,
``torch_npu``). A parameter's local tensor (its FSDP2 shard) counts as a low-precision weight when
it exposes the product's public ``low_precision_storage`` (docs/architecture.md "The path of one
weight"); its bytes are those of the storage tensors built at the last refresh, per rank.
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lp_lightning.observers import non_training
from lp_lightning.telemetry.probe_base import ProbeCallback

__all__ = ["LOW_PRECISION_PACKAGES", "GradientFingerprintProbe", "ResidentObjectsProbe", "low_precision_modules_loaded"]

LOW_PRECISION_PACKAGES = ("lp_lightning.formats", "lp_lightning.ops", "lp_lightning.functional",
                          "lp_lightning.modules", "lp_lightning.tensor", "lp_lightning.fsdp")
"""Packages whose every module belongs to the low-precision stack (exceptions: :data:`EVERY_RUN`)."""

EVERY_RUN = frozenset({"lp_lightning.formats", "lp_lightning.formats.registry", "lp_lightning.fsdp",
                       "lp_lightning.fsdp.parallelize", "lp_lightning.fsdp.optimizer"})
"""The pure-Python format catalogue and the half of ``fsdp`` every run (bf16 too) uses."""

LOW_PRECISION_EXTRA = ("lp_lightning.models.deepseek_v3.experts", "torch_npu")


def low_precision_modules_loaded(modules: Any = None) -> list[str]:
    """The imported modules of the low-precision stack (module docstring), sorted.

    Args:
        modules: Module names to look at (default: ``sys.modules``).
    """
    names = sys.modules if modules is None else modules
    return sorted(
        name for name in names
        if name not in EVERY_RUN and (
            any(name == p or name.startswith(p + ".") for p in LOW_PRECISION_PACKAGES)
            or any(name == p or name.startswith(p + ".") for p in LOW_PRECISION_EXTRA))
    )


class ResidentObjectsProbe(ProbeCallback):
    """Imported modules and resident parameter objects at the end of training (``resident_rank<r>.json``)."""

    kind = "resident"

    def _payload(self) -> dict[str, Any]:
        modules = sorted(sys.modules)
        owners = importlib.metadata.packages_distributions()  # top-level import name -> distributions
        imported = {m.split(".", 1)[0] for m in modules if not m.startswith("_")}
        top_level = sorted(t for t in imported if t in sys.stdlib_module_names or t in owners)
        by_class: dict[str, int] = {}
        count = master_bytes = weights = storage_bytes = storage_tensors = 0
        for param in (self._model.parameters() if self._model is not None else ()):
            local = param.to_local() if hasattr(param, "to_local") else param
            name = type(local).__name__
            by_class[name] = by_class.get(name, 0) + 1
            count += 1
            master = getattr(local, "master", None)
            master = local if master is None else master
            master_bytes += master.numel() * master.element_size()
            storage = getattr(local, "low_precision_storage", None)
            if storage is not None:
                weights += 1
                storage_tensors += len(storage)
                storage_bytes += sum(t.numel() * t.element_size() for t in storage.values())
        return {
            "modules": {"top_level": top_level,
                        "distributions": sorted({d for t in top_level for d in owners.get(t, ())}),
                        "generated_top_level": len(imported) - len(top_level),
                        "lp_lightning": [m for m in modules if m.startswith("lp_lightning")],
                        "low_precision": low_precision_modules_loaded(modules)},
            "parameters": {"count": count, "by_class": dict(sorted(by_class.items())), "master_bytes": master_bytes,
                           "low_precision_weights": weights, "low_precision_storage_bytes": storage_bytes,
                           "low_precision_storage_tensors": storage_tensors},
        }


class GradientFingerprintProbe(ProbeCallback):
    """A fingerprint of every gradient the optimizer reads, per step (``grad_fingerprint_rank<r>.json``).

    In ``on_before_optimizer_step`` (after backward and gradient clipping's closure) each parameter's
    local gradient shard gives two FP32 reductions computed on its device — the sum and ``max |g|`` —
    recorded as their IEEE bit patterns (int32). Bitwise-equal gradients give equal fingerprints; unequal
    ones differ with near certainty. ``per_step``: ``[{"step", "grads": {"<FQN>": [sum_bits, amax_bits]}}]``
    for steps ``1 .. steps`` of the fit call (``steps`` 0: every step); a Trainer callback. It costs two reductions per
    parameter and one host copy per step, a ``non_training("probe_sample")`` range the step clock subtracts
    (``lp-lightning st`` also records only warm-up steps of a main run).

    Args:
        steps: Fingerprint the first ``steps`` optimizer steps of the call (0: all).
        out_dir: Folder of the file; ``null`` = ``<trainer.default_root_dir>/probes``.

    Raises:
        ValueError: ``steps`` is not an int >= 0.
    """

    kind = "grad_fingerprint"

    def __init__(self, steps: int = 0, out_dir: str | None = None) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"GradientFingerprintProbe: steps={steps!r} must be an int >= 0 (0: every step).")
        super().__init__(out_dir=out_dir, sample_every=1)
        self.steps = steps
        self._per_step: list[dict[str, Any]] = []
        self._done = 0

    def _on_start(self) -> None:
        self._per_step = []
        self._done = 0

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.steps and self._done >= self.steps:
            return
        model = pl_module.model if isinstance(getattr(pl_module, "model", None), torch.nn.Module) else pl_module
        names, values = [], []
        with torch.no_grad(), non_training("probe_sample"):  # reductions and a host copy: no step time (observers)
            for name, param in model.named_parameters():
                if param.grad is None:
                    continue
                local = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
                flat = local.detach().reshape(-1).float()
                amax = flat.abs().max() if flat.numel() else flat.new_zeros(())
                names.append(name.replace("._checkpoint_wrapped_module", ""))
                values.append(torch.stack([flat.sum(), amax]))
            bits = torch.stack(values).view(torch.int32).cpu().tolist() if values else []
        self._per_step.append({"step": trainer.global_step + 1, "grads": dict(zip(names, bits))})
        self._done += 1

    def _payload(self) -> dict[str, Any]:
        return {"fingerprinted_steps": self.steps, "per_step": self._per_step}
