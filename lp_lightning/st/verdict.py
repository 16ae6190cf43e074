"""Checks, rows and verdicts: the vocabulary of the Q3 rows (design spec §17.2), and the checks they share.

A row is a list of :class:`Check` s — a named criterion, what was observed, what was expected — and
its verdict is ``pass`` when every check holds, ``fail`` otherwise (also when it has no check), and
``not-applicable`` when every check holds but the row cannot be judged here (Q3-11 on the emulated
backend, the FSDP rows with one process) or when every check is itself not applicable. A check that
compared nothing (no event, pair or rank) never holds: it fails, or it is not applicable with the
reason (:meth:`Row.check_compared`). The tolerances are in :mod:`lp_lightning.st.thresholds`; a pass
that rests on a built-in one is shown ``pass (provisional thresholds)`` (:attr:`Row.shown_verdict`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

from lp_lightning.evidence.table import format_info
from lp_lightning.st.runner import RunResult

__all__ = ["ROLES", "ROW_TITLES", "Check", "Row", "element_format", "unit_roundoff"]

Verdict = Literal["pass", "fail", "not-applicable"]

ROW_TITLES = {
    "Q3-01": "BF16 baseline",
    "Q3-02": "MXFP8 end to end",
    "Q3-03": "HiF8 end to end",
    "Q3-04": "Model boundary",
    "Q3-05": "MXFP8 FSDP",
    "Q3-06": "HiF8 FSDP",
    "Q3-07": "Gradient accumulation",
    "Q3-08": "Full recompute",
    "Q3-09": "DCP resume",
    "Q3-10": "Illegal configurations",
    "Q3-11": "No performance regression",
    "conformance": "Backend conformance against the emulation",
    "parity": "Loss parity against BF16 and its noise floor",
    "N-1": "Operators against a BF16 golden (§17.3.2 item 1)",
    "N-2": "One-layer model against BF16 (§17.3.2 item 2)",
    "N-3": "Short-run loss and grad-norm curves (§17.3.2 item 3)",
}

_ELEMENT_FORMAT = {"bf16": "bf16", "mxfp8": "fp8_e4m3fn", "hif8_current": "hif8"}


def element_format(case: str) -> str:
    """The element format (``lp_lightning.evidence.table`` name) the case's GEMMs read."""
    return _ELEMENT_FORMAT[case]


def unit_roundoff(case: str) -> float:
    """``u = ε / 2`` of the case's GEMM input format (ε from its bit patterns)."""
    return format_info(element_format(case)).eps / 2


@dataclass
class Check:
    """One criterion of a row: ``name`` held (``ok``) with ``observed`` against ``expected``.

    ``not_applicable`` (a reason) marks a check with nothing to judge here; it does not fail its row
    (``ok`` is true) and the report shows it as ``n/a``, never as ``yes``.
    """

    name: str
    ok: bool
    observed: Any
    expected: Any
    not_applicable: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": bool(self.ok), "observed": self.observed, "expected": self.expected,
                "not_applicable": self.not_applicable}


@dataclass
class Row:
    """One Q3 row: its checks, verdict, evidence (numbers and file paths) and notes.

    ``thresholds`` lists the dotted threshold keys its checks read (:mod:`lp_lightning.st.thresholds`);
    ``provisional`` marks a pass that rests on a built-in one (``thresholds.mark_provisional``).
    """

    id: str
    checks: list[Check] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    not_applicable: str | None = None
    thresholds: list[str] = field(default_factory=list)
    provisional: bool = False

    @property
    def title(self) -> str:
        return ROW_TITLES[self.id]

    @property
    def verdict(self) -> Verdict:
        if any(not c.ok for c in self.checks) or not self.checks:
            return "fail"
        if self.not_applicable or all(c.not_applicable for c in self.checks):
            return "not-applicable"
        return "pass"

    @property
    def shown_verdict(self) -> str:
        """The verdict as the report and the console show it: ``pass (provisional thresholds)`` when provisional."""
        return f"{self.verdict} (provisional thresholds)" if self.provisional and self.verdict == "pass" else self.verdict

    def check(self, name: str, ok: bool, observed: Any, expected: Any) -> bool:
        self.checks.append(Check(name, bool(ok), observed, expected))
        return bool(ok)

    def check_compared(
        self, name: str, compared: int, ok: bool, observed: Any, expected: Any, *, if_none: str | None = None
    ) -> bool:
        """A check over ``compared`` items (events, pairs, ranks): with none it fails, or with ``if_none``
        (why there is nothing to compare here) it is not applicable."""
        if compared:
            return self.check(name, ok, observed, expected)
        if if_none:
            self.checks.append(Check(name, True, "nothing to compare", expected, not_applicable=if_none))
            return True
        return self.check(name, False, f"nothing compared (0 items): {observed}", expected)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "verdict": self.verdict,
            "not_applicable_because": self.not_applicable,
            "checks": [c.as_dict() for c in self.checks],
            "evidence": self.evidence,
            "notes": list(self.notes),
            "thresholds": list(self.thresholds),
            "provisional": self.provisional and self.verdict == "pass",
        }


# ------------------------------------------------------------------------------------------------
# Shared checks


def _finished(row: Row, run: RunResult | None, name: str) -> bool:
    if run is None:
        return row.check(f"{name} ran", False, "not run (excluded by --cases/--rows or an earlier failure)", "exit 0")
    observed = "exit 0" if run.ok else (run.error or f"exit {run.exit_code}").splitlines()[0]
    if not run.ok:
        row.evidence.setdefault("failures", {})[name] = run.error
    return row.check(f"{name} finished", run.ok, observed, "exit 0 and run_summary.json")


def _finite(values: list[Any]) -> bool:
    return bool(values) and all(v is not None and math.isfinite(v) for v in values)


def _training_checks(row: Row, run: RunResult, name: str, min_steps: int) -> None:
    summary = run.summary or {}
    losses, norms = summary.get("losses", []), summary.get("grad_norms", [])
    row.check(f"{name}: optimizer steps", summary.get("steps", 0) >= min_steps, summary.get("steps"), f">= {min_steps}")
    row.check(f"{name}: losses finite", _finite(losses), f"{len(losses)} steps", "all finite")
    row.check(f"{name}: grad norms finite", _finite(norms), f"{len(norms)} steps", "all finite")
    row.evidence[f"{name}.loss_first"] = summary.get("loss_first")
    row.evidence[f"{name}.loss_last_mean"] = summary.get("loss_last_mean")


def _gemm_counts(run: RunResult) -> dict[tuple[str, str, str], int]:
    counts: dict[tuple[str, str, str], int] = defaultdict(int)
    for rank in run.probe("gemm_trace"):
        for key, n in rank.get("counts", {}).items():
            role, fmt, backend = key.split("|")
            counts[(role, fmt, backend)] += n
    return dict(counts)


ROLES = ("dense_fprop", "dense_dgrad", "dense_wgrad", "grouped_fprop", "grouped_dgrad", "grouped_wgrad")


def _kernel_checks(row: Row, run: RunResult, name: str, fmt: str) -> None:
    counts = _gemm_counts(run)
    per_role = {role: sum(n for (r, f, _), n in counts.items() if r == role and f == fmt) for role in ROLES}
    row.check(f"{name}: every role ran {fmt} GEMMs", all(per_role.values()), per_role, "each of the six roles > 0")
    others = sorted({f for (_, f, _) in counts} - {fmt})
    total = sum(counts.values())
    row.check_compared(f"{name}: no GEMM of another format", total, not others, others or f"none of {total}", "none")
    unlabelled = sum(rank.get("unlabelled", 0) for rank in run.probe("gemm_trace"))
    row.check_compared(f"{name}: every GEMM declared its role", total + unlabelled, unlabelled == 0, unlabelled, 0)
    row.evidence[f"{name}.backends"] = sorted({b for (_, _, b) in counts})


def _no_fallback_checks(row: Row, probe: RunResult, main: RunResult) -> None:
    kernels = (probe.summary or {}).get("kernels") or {}
    inside = kernels.get("high_precision_gemms_in_replaced_modules")
    row.check("no high-precision GEMM inside a replaced module (dispatch probe)", inside == 0, inside, 0)
    elsewhere = kernels.get("high_precision_gemms_elsewhere")
    row.check("the probe sees the high-precision GEMMs elsewhere (positive control)", bool(elsewhere), elsewhere, "> 0")
    if kernels.get("high_precision_gemm_examples"):
        row.evidence["high_precision_gemm_examples"] = kernels["high_precision_gemm_examples"]
    for run in (main, probe):
        wire = (run.summary or {}).get("wire") or {}
        hp = wire.get("high_precision_gathers_of_replaced")
        row.check(f"{run.spec.name}: no high-precision gather of a replaced weight", hp == 0, hp, 0)


def _replacement_checks(row: Row, run: RunResult, targets: dict[str, list[str]]) -> dict[str, Any]:
    report = (run.summary or {}).get("replacement") or {}
    counts = report.get("counts", {})
    replaced = {item["fqn"] for item in report.get("replaced", [])}
    expected = {fqn for fqns in targets.values() for fqn in fqns}
    missing, extra = sorted(expected - replaced), sorted(replaced - expected)
    per_category = {cat: f"{len(set(fqns) & replaced)}/{len(fqns)}" for cat, fqns in targets.items()}
    row.check(f"{run.spec.name}: every target of the model replaced (found from its structure)",
              bool(expected) and not missing, missing[:5] or per_category, "no target left out")
    row.check(f"{run.spec.name}: nothing outside the targets replaced", not extra, extra[:5] or "none", "none")
    row.check(f"{run.spec.name}: every replacement rule hit", bool(counts) and all(counts.values()), counts, "every rule > 0")
    row.check(f"{run.spec.name}: nothing skipped", report.get("num_skipped") == 0, report.get("skipped"), "[]")
    return report


# ------------------------------------------------------------------------------------------------
# Rows
