"""What a run loaded and keeps resident: the evidence of design spec §17.4 "extra dependencies, resident objects".

:class:`ResidentObjectsProbe` reads, at the end of training, ``sys.modules`` and the model's
parameters — nothing else — and writes ``resident_rank<r>.json``::

    {"modules": {"top_level": [...], "lp_lightning": [...], "low_precision": [...]},
     "parameters": {"count", "by_class": {"<local tensor class>": n}, "master_bytes",
                    "low_precision_weights", "low_precision_storage_bytes",
                    "low_precision_storage_tensors"}}

``top_level``: the top-level packages imported in the process (``torch``, ``lightning``, …);
``low_precision``: the imported modules of the low-precision stack (the modules a bf16 run must not
load, docs/architecture.md "Layers": ``formats`` beyond the registry, ``ops``, ``tensor``,
``functional``, ``modules``, ``fsdp`` beyond ``parallelize``/``optimizer``, the experts adapter,
``torch_npu``). A parameter's local tensor (its FSDP2 shard) counts as a low-precision weight when
it exposes the product's public ``low_precision_storage`` (docs/architecture.md "The path of one
weight"); its bytes are those of the storage tensors built at the last refresh, per rank.
"""

from __future__ import annotations

import sys
from typing import Any

from lp_lightning.telemetry.probe_base import ProbeCallback

__all__ = ["LOW_PRECISION_PACKAGES", "ResidentObjectsProbe", "low_precision_modules_loaded"]

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
            "modules": {"top_level": sorted({m.split(".", 1)[0] for m in modules if not m.startswith("_")}),
                        "lp_lightning": [m for m in modules if m.startswith("lp_lightning")],
                        "low_precision": low_precision_modules_loaded(modules)},
            "parameters": {"count": count, "by_class": dict(sorted(by_class.items())), "master_bytes": master_bytes,
                           "low_precision_weights": weights, "low_precision_storage_bytes": storage_bytes,
                           "low_precision_storage_tensors": storage_tensors},
        }
