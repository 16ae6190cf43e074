"""The opt-in ``parity`` row of ``lp-lightning st``: loss parity against BF16 and its noise floor (docs/acceptance.md "Loss parity").

``lp-lightning st --rows [parity] --parity_seeds [0,1,2] --parity_steps 300`` runs, per seed, the three
cases and a bf16 run with AdamW eps x 1.01 (the noise floor; :func:`lp_lightning.st.cases.parity_runs`)
on the user's YAML, and judges with :func:`lp_lightning.st.parity.analyse`: one check per
low-precision case and seed, the gap of the last-50 training-loss mean and of the last validation
loss to bf16 within ``parity_max_gap_pct`` (2 %). The evidence carries the gaps in noise units, the
gap per 50-step window and the noise floor; ``parity.json`` and ``parity.png`` go under ``--out``,
and :func:`parity_section` is the report's section. ``benchmarks/parity.py`` is the same analysis
outside st (one process per run, several at a time, the Shakespeare corpus).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lp_lightning.st import parity
from lp_lightning.st.cases import CASES, NOISE_EPS_FACTOR, ParitySettings
from lp_lightning.st.runner import RunResult
from lp_lightning.st.thresholds import BUILTIN_THRESHOLDS, Thresholds, precision_of_case
from lp_lightning.st.verdict import Row

__all__ = ["FILE", "PLOT", "ROW_ID", "parity_row", "parity_section"]

ROW_ID = "parity"
FILE = "parity.json"
PLOT = "parity.png"


def _key(name: str) -> tuple[int, str]:
    _, seed, variant = name.split("/")
    return int(seed.removeprefix("seed")), variant


def parity_row(runs: dict[str, RunResult], out: Path, settings: ParitySettings,
               thresholds: Thresholds = BUILTIN_THRESHOLDS) -> Row:
    """The row from the ``parity/...`` runs; writes ``out / parity.json`` and ``out / parity.png``.

    A run that did not finish fails its seed's checks (named); with every run there, one check per
    low-precision case and seed.
    """
    row = Row(ROW_ID)
    expected = {f"parity/seed{s}/{v}" for s in settings.seeds for v in (*(c.name for c in CASES), parity.NOISE_VARIANT)}
    missing = sorted(n for n in expected if n not in runs or not runs[n].ok)
    finished = {_key(n): parity.load_parity_run(runs[n].folder) for n in sorted(expected) if n not in missing}
    complete = [s for s in settings.seeds if all(f"parity/seed{s}/{c.name}" not in missing for c in CASES)]
    if missing:
        row.check("every parity run finished", False, f"not finished: {', '.join(missing)}",
                  f"{len(expected)} runs ({len(settings.seeds)} seeds x bf16, mxfp8, hif8_current, {parity.NOISE_VARIANT})")
    result = parity.analyse({k: v for k, v in finished.items() if k[0] in complete}, last=settings.last_steps,
                            window=settings.window) if complete else None
    if result is not None:
        result["settings"] = {"steps": settings.steps, "seeds": list(settings.seeds), "corpus": "the YAML's data",
                              "noise": f"AdamW eps x {NOISE_EPS_FACTOR:g}"}
        out.mkdir(parents=True, exist_ok=True)
        (out / FILE).write_text(json.dumps(result, indent=1) + "\n")
        parity.plot({k: v for k, v in finished.items() if k[0] in complete}, result, out / PLOT)
        row.evidence.update(file=FILE, plot=PLOT, noise_floor=result["noise_floor"], overall=result["overall"],
                            last_steps=settings.last_steps)
        for case in (c for c in CASES if c.is_low_precision):
            tolerance = thresholds.get(row, "parity_max_gap_pct", precision_of_case(case.name))
            for seed in complete:
                r = result["per_seed"][str(seed)][case.name]
                gaps = [g for g in (r["train_gap_pct"], r["val_gap_pct"]) if g is not None]
                row.check(f"{case.name} seed {seed}: last-{settings.last_steps} training loss and validation loss "
                          "against bf16", bool(gaps) and len(gaps) == 2 and all(abs(g) <= tolerance for g in gaps),
                          f"train {_pct(r['train_gap_pct'])} ({_units(r.get('train_noise_units'))}), val "
                          f"{_pct(r['val_gap_pct'])} ({_units(r.get('val_noise_units'))})", f"|gap| <= {tolerance:g} %")
    return row


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:+.2f} %"


def _units(value: float | None) -> str:
    return "no noise floor" if value is None else f"{value:+.1f} x noise"


def parity_rows(runs: dict[str, RunResult], out: Path, selected: Sequence[str], settings: ParitySettings,
                thresholds: Thresholds = BUILTIN_THRESHOLDS) -> list[Row]:
    """``[parity_row(...)]`` when ``selected`` names the row, else ``[]``."""
    return [parity_row(runs, out, settings, thresholds)] if ROW_ID in selected else []


def parity_section(out: Path, rows: Sequence[Row]) -> list[str]:
    """The report's "Loss parity" markdown (empty when the row was not selected)."""
    row = next((r for r in rows if r.id == ROW_ID), None)
    if row is None:
        return []
    lines = [f"## Loss parity against BF16: **{row.shown_verdict}**", ""]
    try:
        result: dict[str, Any] = json.loads((out / FILE).read_text())
    except (OSError, ValueError):
        return lines + ["No parity figures: " + "; ".join(str(c.observed) for c in row.checks if not c.ok), ""]
    return lines + parity.markdown(result, plot=out / PLOT, doc=out / "report.md").splitlines() + [""]
