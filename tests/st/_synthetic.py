"""Synthetic run evidence for the verdict and report tests (no ``fit`` process runs)."""

from __future__ import annotations

from pathlib import Path

from lp_lightning.st.cases import STSettings, build_runs
from lp_lightning.st.runner import RunResult

SETTINGS = STSettings(devices=2, warmup_steps=1, steady_steps=3, resume_steps=2, variant_steps=2, required_steps=3,
                      profile_steps=1, reduced=True)


def run_result(name: str, folder: Path, summary: dict | None, probes: dict[str, list[dict]] | None = None,
               settings: STSettings = SETTINGS) -> RunResult:
    """A finished run ``<kind>/<case>`` of the matrix with ``summary`` and per-rank ``probes``."""
    kind, case = name.split("/")
    spec = next(s for s in build_runs(settings, reshard_after_forward=True) if s.name == name)
    assert spec.kind == kind and spec.case.name == case
    result = RunResult(spec, folder, exit_code=0, summary=summary)
    for kind_, ranks in (probes or {}).items():
        result.probes[kind_] = [{**data, "_rank": r} for r, data in enumerate(ranks)]
    return result


def summary(losses=(3.0, 2.9), first_step=0, **extra) -> dict:
    """A ``run_summary.json`` with these losses (grad norms 1.0)."""
    return {"steps": len(losses), "losses": list(losses), "grad_norms": [1.0] * len(losses), "first_step": first_step,
            "loss_first": losses[0], "loss_last_mean": sum(losses) / len(losses), **extra}


def refresh(micro: int = 0, max_per_weight: int = 1) -> dict:
    """A RefreshProbe rank file of two accumulation steps (2 micro-batches, 4 weights)."""
    steps = [{"step": s, "refreshes": 4, "weights": 4, "max_per_weight": max_per_weight, "skipped": False}
             for s in (1, 2)]
    return {"micro_batches_per_step": 2, "micro_step_refreshes": micro, "forward_backward_refreshes": 0,
            "low_precision_weights": 4, "per_step": steps}
