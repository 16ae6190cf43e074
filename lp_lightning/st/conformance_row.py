"""The ``conformance`` row of ``lp-lightning st``: the run's backend against the emulation (docs/acceptance.md "Backend conformance").

``lp-lightning st --rows conformance`` runs :func:`lp_lightning.ops.conformance.run_conformance` for
the backend and device the user's YAML trains with (:func:`lp_lightning.st.target.run_target`: ``backend``, or for
``auto`` the backend registered for ``trainer.accelerator``; device 0 of that accelerator), writes
``conformance.json`` under ``--out`` and turns the cases into one check per operation and format.
A mismatch fails the row (so ``st`` exits 1); on the emulated backend the row is
``not-applicable`` (it would compare the emulation with itself). :func:`conformance_section` is the
report's section: the bound, the failing cases with their worst element, and one verdict line per
docs/formats.md open question.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lp_lightning.ops.backend import (
    LowPrecisionUnsupportedError,
)
from lp_lightning.ops.conformance import (
    REFERENCE_BACKEND,
    ConformanceCase,
    run_conformance,
)
from lp_lightning.st.verdict import Check, Row

__all__ = ["FILE", "ROW_ID", "conformance_row", "conformance_rows", "conformance_section"]

ROW_ID = "conformance"
FILE = "conformance.json"
NOT_APPLICABLE = (
    "the run's backend is the emulation, so this row would compare the emulation with itself; run st with the "
    "hardware backend (trainer.accelerator npu with backend auto or npu)"
)


def _worst(case: ConformanceCase) -> str:
    if case.error:
        return case.error
    worst = case.worst or {}
    text = f"{worst.get('tensor')} at {worst.get('index')}: {worst.get('seen')} vs the emulation {worst.get('reference')}"
    if "bound" in worst:
        text += f" (bound {worst['bound']:.3g}, {worst['ratio']:.3g}x)"
    if "input" in worst:
        text += f", input {worst['input']!r}"
    return f"{text}; {case.mismatches} of {case.compared} elements"


def conformance_row(backend: str, device: str, out: Path) -> Row:
    """The row for ``backend`` on ``device``; writes ``out / conformance.json``.

    Returns:
        Not-applicable on the emulated backend; else one check per operation and format (every case
        bit-identical / within the bound), failing with the first failing case and its worst element;
        a backend that cannot run here is one failing check naming why.
    """
    row = Row(ROW_ID)
    row.evidence.update(backend=backend, device=device, file=FILE)
    out.mkdir(parents=True, exist_ok=True)
    if backend == REFERENCE_BACKEND:
        row.not_applicable = NOT_APPLICABLE
        row.checks.append(Check("backend conformance against the emulation", True, f"backend {backend}",
                                "a hardware backend", not_applicable=NOT_APPLICABLE))
        (out / FILE).write_text(json.dumps({"backend": backend, "device": device, "not_applicable": NOT_APPLICABLE},
                                           indent=1) + "\n")
        return row
    try:
        result = run_conformance(backend, device)
    except (LowPrecisionUnsupportedError, ValueError, RuntimeError) as err:
        message = str(err).splitlines()[0]
        row.check("backend conformance ran", False, message, f"the {backend} backend runs every operation on {device}")
        (out / FILE).write_text(json.dumps({"backend": backend, "device": device, "error": message}, indent=1) + "\n")
        return row
    report = result.as_dict()
    (out / FILE).write_text(json.dumps(report, indent=1, default=str) + "\n")
    groups: dict[tuple[str, str], list[ConformanceCase]] = {}
    for case in result.cases:
        groups.setdefault((case.op, case.format), []).append(case)
    for (op, fmt), cases in groups.items():
        failed = [c for c in cases if not c.ok]
        bits = op.startswith("quantize")
        expected = ("codes and scales bit-identical to the emulation" if bits
                    else "every element within the FP32-accumulation bound of the emulation")
        observed = (f"{len(cases)} of {len(cases)} cases" if not failed
                    else f"{len(failed)} of {len(cases)} fail, first {failed[0].name}: {_worst(failed[0])}")
        row.check(f"{op} {fmt}", not failed, observed, expected)
    row.evidence.update(cases=len(result.cases), failed=[c.name for c in result.failures()],
                        verdicts=[v.line for v in result.verdicts])
    return row


def conformance_rows(out: Path, meta: dict[str, Any], only: Sequence[str]) -> list[Row]:
    """``[the conformance row]`` when ``only`` selects it, for ``meta["target"]`` (:mod:`lp_lightning.st.target`), else ``[]``."""
    if ROW_ID not in only:
        return []
    target = meta.get("target") or {"backend": REFERENCE_BACKEND, "device": "cpu"}
    return [conformance_row(target["backend"], target["device"], out)]


def conformance_section(out: Path, rows: Sequence[Row]) -> list[str]:
    """The report's "Backend conformance" markdown (empty when the row was not selected)."""
    row = next((r for r in rows if r.id == ROW_ID), None)
    if row is None:
        return []
    lines = [f"## Backend conformance: **{row.verdict}**", ""]
    try:
        data = json.loads((out / FILE).read_text())
    except (OSError, ValueError) as err:
        return lines + [f"`{FILE}` unreadable: {err}.", ""]
    lines.append(f"- backend `{data.get('backend')}` on `{data.get('device')}` against `{REFERENCE_BACKEND}` "
                 f"(docs/acceptance.md \"Backend conformance\"); details in `{FILE}`")
    if data.get("not_applicable"):
        return lines + [f"- not applicable: {data['not_applicable']}", ""]
    if data.get("error"):
        return lines + [f"- did not run: {data['error']}", ""]
    summary = data.get("summary", {})
    lines += [f"- {summary.get('cases')} cases, {summary.get('failed')} failed; GEMM bound `{data.get('bound')}`", ""]
    failed = [c for c in data.get("cases", []) if not c.get("ok")]
    if failed:
        lines += ["| failing case | worst element |", "|---|---|"]
        for case in failed:
            record = ConformanceCase(case["name"], case["op"], case["format"], case["params"], case["ok"],
                                     case["compared"], case["mismatches"], case["worst"], case["ran_on"], case["error"])
            lines.append(f"| {case['name']} | {_worst(record)} |")
        lines.append("")
    lines += ["Open questions of docs/formats.md:", ""] + [f"- {v['line']}" for v in data.get("verdicts", [])]
    return lines + [""]
