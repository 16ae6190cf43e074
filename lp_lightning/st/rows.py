"""Verdicts of the Q3-01…Q3-11 rows (design spec §17.2) from what the runs left behind.

Each row is a list of :class:`Check` s — a named criterion, what was observed, what was expected —
and its verdict is ``pass`` when every check holds, ``fail`` otherwise. A row whose runs did not
finish fails on the check "run finished". Q3-11 is ``not-applicable`` on the emulated backend: the
emulation models the hardware's numerics, not its speed, so its ratios are reported as the
emulation's cost and never as a hardware pass or fail.

Tolerances (written into the report next to the observed values) come from the formats
(docs/numerics.md §8.3: rounding noise lies between ε·O(1) and ε·√k): with ``u`` the unit roundoff
(ε/2) of the element format a recipe's GEMMs read (BF16 2^-8, E4M3 and HiF8 near 1.0 2^-4):

- Q3-09, first resumed loss against the continuous run: relative difference ≤ ``u`` (one rounding of
  the recipe's GEMM inputs, the lower end of the band). The state checks are exact: the resumed
  run's FP32 masters, AdamW moments and 8-bit storage must be bit-identical to the continuous run's
  after step N, which a loose loss tolerance could not establish (design spec §17.2: Q3-09 never
  passes on "the curves look close").
- short-run curves (§17.3.2): the mean loss of the last steps of mxfp8/hif8 within ``u`` of bf16's.
"""

from __future__ import annotations

import fnmatch
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

from lp_lightning.st.cases import CASES, STSettings
from lp_lightning.st.runner import RunResult

__all__ = ["Check", "Row", "ROW_TITLES", "element_format", "evaluate_rows", "unit_roundoff"]

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
    from lp_lightning.evidence.table import format_info

    return format_info(element_format(case)).eps / 2


@dataclass
class Check:
    """One criterion of a row: ``name`` held (``ok``) with ``observed`` against ``expected``."""

    name: str
    ok: bool
    observed: Any
    expected: Any

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": bool(self.ok), "observed": self.observed, "expected": self.expected}


@dataclass
class Row:
    """One Q3 row: its checks, verdict, evidence (numbers and file paths) and notes."""

    id: str
    checks: list[Check] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    not_applicable: str | None = None

    @property
    def title(self) -> str:
        return ROW_TITLES[self.id]

    @property
    def verdict(self) -> Verdict:
        if any(not c.ok for c in self.checks) or not self.checks:
            return "fail"
        return "not-applicable" if self.not_applicable else "pass"

    def check(self, name: str, ok: bool, observed: Any, expected: Any) -> bool:
        self.checks.append(Check(name, bool(ok), observed, expected))
        return bool(ok)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "verdict": self.verdict,
            "not_applicable_because": self.not_applicable,
            "checks": [c.as_dict() for c in self.checks],
            "evidence": self.evidence,
            "notes": list(self.notes),
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
    row.check(f"{name}: no GEMM of another format", not others, others or "none", "none")
    unlabelled = sum(rank.get("unlabelled", 0) for rank in run.probe("gemm_trace"))
    row.check(f"{name}: every GEMM declared its role", unlabelled == 0, unlabelled, 0)
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


def q3_01(runs: dict[str, RunResult], settings: STSettings) -> Row:
    row = Row("Q3-01")
    main, resume = runs.get("main/bf16"), runs.get("resume/bf16")
    if _finished(row, main, "main/bf16"):
        _training_checks(row, main, "main/bf16", settings.required_steps)
        from lp_lightning.distributed.checkpoint import is_dcp_checkpoint

        path = main.checkpoint(settings.save_step)
        row.check("checkpoint saved", is_dcp_checkpoint(path), str(path), "a DCP folder")
    if _finished(row, resume, "resume/bf16"):
        summary = resume.summary or {}
        row.check("resumed from the checkpoint step", summary.get("first_step") == settings.save_step,
                  summary.get("first_step"), settings.save_step)
        _training_checks(row, resume, "resume/bf16", settings.resume_steps)
    return row


def _low_precision_row(
    row_id: str, case: str, runs: dict[str, RunResult], settings: STSettings, targets: dict[str, list[str]]
) -> Row:
    row = Row(row_id)
    fmt = dict((c.name, (c.low_precision or {}).get("format")) for c in CASES)[case]
    main, probe = runs.get(f"main/{case}"), runs.get(f"probe/{case}")
    if _finished(row, main, f"main/{case}"):
        _training_checks(row, main, f"main/{case}", settings.required_steps)
        _replacement_checks(row, main, targets)
        _kernel_checks(row, main, f"main/{case}", fmt)
    if _finished(row, probe, f"probe/{case}") and main is not None and main.ok:
        _kernel_checks(row, probe, f"probe/{case}", fmt)
        _no_fallback_checks(row, probe, main)
        _scale_checks(row, probe, case, settings.devices)
    return row


def _scale_checks(row: Row, run: RunResult, case: str, devices: int) -> None:
    ranks = run.probe("scales")
    row.check(f"{run.spec.name}: scale statistics recorded on every rank", len(ranks) == devices, len(ranks), devices)
    if case == "mxfp8":
        dtypes = sorted({r.get("scale_dtype") for r in ranks} - {None})
        row.check("MXFP8 scales are E8M0", dtypes == ["float8_e8m0fnu"], dtypes, ["float8_e8m0fnu"])
        return
    summary: dict[str, dict[str, Any]] = defaultdict(lambda: {"events": 0, "format_max": set(), "all_match": True,
                                                              "all_finite_positive": True})
    for rank in ranks:
        for role, stats in (rank.get("hif8") or {}).items():
            merged = summary[role]
            merged["events"] += stats.get("events", 0)
            merged["format_max"] |= set(stats.get("format_max", []))
            merged["all_match"] &= bool(stats.get("all_match"))
            merged["all_finite_positive"] &= bool(stats.get("all_finite_positive"))
    expected_max = {"grad_output": [224.0]}
    observed = {role: sorted(s["format_max"]) for role, s in summary.items()}
    row.check("HiF8 scales recorded for input, weight and grad_output",
              {"input_fwd", "grad_output"} <= set(summary) and any("weight" in r for r in summary), sorted(summary),
              "input_fwd, weight, grad_output")
    row.check("HiF8 format_max: 15 for input/weight, 224 for gradients",
              all(v == expected_max.get(role, [15.0]) for role, v in observed.items()), observed,
              "grad_output [224.0], others [15.0]")
    row.check("HiF8 scale = amax / format_max (FP32)", all(s["all_match"] for s in summary.values()),
              {r: s["all_match"] for r, s in summary.items()}, "all True")
    row.check("HiF8 scales finite and positive", all(s["all_finite_positive"] for s in summary.values()),
              {r: s["all_finite_positive"] for r, s in summary.items()}, "all True")
    dtypes = sorted({r.get("scale_dtype") for r in ranks} - {None})
    row.check("HiF8 scales are FP32", dtypes in ([], ["float32"]), dtypes or "float32 (per event)", ["float32"])
    row.evidence["hif8_scales"] = {
        role: {k: (sorted(v) if isinstance(v, set) else v) for k, v in s.items()} for role, s in summary.items()
    }


def q3_04(runs: dict[str, RunResult], settings: STSettings, targets: dict[str, list[str]]) -> Row:
    """Dense, shared, routed and explicit MLA modules hit; embedding, head, router, norms, core attention not."""
    from lp_lightning.models.deepseek_v3.adapter import deepseek_v3_never_replace

    row = Row("Q3-04")
    never = deepseek_v3_never_replace()
    for case in ("mxfp8", "hif8_current"):
        probe = runs.get(f"probe/{case}")
        if not _finished(row, probe, f"probe/{case}"):
            continue
        report = _replacement_checks(row, probe, targets)
        replaced = [item["fqn"] for item in report.get("replaced", [])]
        row.evidence[f"{case}.replaced_per_rule"] = report.get("counts")
        seen: dict[str, set[str]] = defaultdict(set)
        no_weight = 0
        for rank in probe.probe("gemm_trace"):
            for event in rank.get("events", []):
                if event.get("weight_fqn"):
                    seen[event["role"]].add(event["weight_fqn"])
                else:
                    no_weight += 1
        expected_roles = {
            m: ROLES[3:] if any(w.startswith(m + ".") for role in ROLES[3:] for w in seen.get(role, ())) else ROLES[:3]
            for m in replaced
        }
        unhit = sorted({m for m in replaced for role in expected_roles[m] if not any(
            w.startswith(m + ".") for w in seen.get(role, ()))})
        row.check(f"{case}: every replaced module ran fprop, dgrad and wgrad in low precision", not unhit, unhit or
                  f"{len(replaced)} modules", "[]")
        forbidden = sorted({
            w for fqns in seen.values() for w in fqns
            if any(fnmatch.fnmatch(w.rsplit(".", 1)[0], glob) or fnmatch.fnmatch(w, glob)
                   for rule in never for glob in rule.fqn_globs)
        })
        row.check(f"{case}: no low-precision GEMM on embedding, head, router or norms", not forbidden, forbidden or "none",
                  "none")
        row.check(f"{case}: no low-precision GEMM without a weight (core attention)", no_weight == 0, no_weight, 0)
        kernels = (probe.summary or {}).get("kernels") or {}
        elsewhere = kernels.get("high_precision_gemms_elsewhere")
        row.check(f"{case}: attention core, router and head ran in high precision", bool(elsewhere), elsewhere, "> 0")
    row.notes.append("Not-replaced modules come from the model adapter's never-replace rules: "
                     + "; ".join(f"{r.reason} ({', '.join(r.fqn_globs)})" for r in never) + ".")
    return row


def _post_events(run: RunResult) -> list[dict[str, Any]]:
    return [{**e, "rank": r["_rank"]} for r in run.probe("gather_trace") for e in r.get("events", [])
            if e.get("stage") == "post_all_gather"]


def _pre_events(run: RunResult) -> list[dict[str, Any]]:
    return [{**e, "rank": r["_rank"]} for r in run.probe("gather_trace") for e in r.get("events", [])
            if e.get("stage", "pre_all_gather") == "pre_all_gather"]


def _grouped_fqns(run: RunResult) -> set[str]:
    return {e["fqn"] for e in _post_events(run) if len(e.get("logical_shape") or ()) == 3}


_DATA_DTYPE = {"mxfp8": "float8_e4m3fn", "hif8_current": "uint8"}
_SCALE_DTYPE = {"mxfp8": "float8_e8m0fnu", "hif8_current": "float32"}


def _wire_checks(row: Row, run: RunResult) -> None:
    """Every replaced module's weights travel as 8-bit payloads (none in BF16/FP32) in every step."""
    wire = (run.summary or {}).get("wire") or {}
    hp = wire.get("high_precision_gathers_of_replaced")
    row.check(f"{run.spec.name}: no high-precision gather of a replaced weight", hp == 0, hp, 0)
    gathered = {e["fqn"] for e in _pre_events(run)}
    replaced = [item["fqn"] for item in ((run.summary or {}).get("replacement") or {}).get("replaced", [])]
    missing = sorted(m for m in replaced if not any(f.startswith(m + ".") for f in gathered))
    row.check(f"{run.spec.name}: every replaced module's weights gathered as 8-bit payloads", bool(replaced) and not missing,
              missing[:5] or f"{len(replaced)} modules", "[]")
    wide = sorted({f"{e['fqn']} {name} {dtype}" for e in _pre_events(run) for name, dtype, _ in e.get("tensors", [])
                   if dtype != "uint8"})
    row.check(f"{run.spec.name}: all-gather inputs are uint8 slots", not wide, wide[:5] or "all uint8", "uint8")


def _rebuilt_checks(row: Row, run: RunResult, case: str) -> None:
    posts = _post_events(run)
    bad = []
    for event in posts:
        numel = math.prod(event.get("logical_shape") or [0])
        for name, dtype, shape in event.get("tensors", []):
            want = _DATA_DTYPE[case] if name.endswith("data") else _SCALE_DTYPE[case]
            if dtype != want or (name.endswith("data") and math.prod(shape) != numel):
                bad.append(f"{event['fqn']} {name} {dtype} {shape}")
    row.check(f"{run.spec.name}: rebuilt storage has the logical shape and the format's dtypes",
              bool(posts) and not bad, bad[:5] or f"{len(posts)} post-all-gather events", "data numel = logical, dtypes")
    shapes = defaultdict(set)
    for event in posts:
        shapes[event["fqn"]].add((tuple(event.get("logical_shape") or ()), event.get("logical_dtype")))
    differing = sorted(f for f, s in shapes.items() if len(s) != 1)
    row.check(f"{run.spec.name}: one logical shape and dtype per weight on every rank and gather", not differing,
              differing or f"{len(shapes)} weights", "[]")


def q3_05(runs: dict[str, RunResult], settings: STSettings, reshard_after_forward: bool) -> Row:
    row = Row("Q3-05")
    by_flag = {reshard_after_forward: runs.get("probe/mxfp8"), not reshard_after_forward: runs.get("reshard/mxfp8")}
    for flag, run in sorted(by_flag.items(), reverse=True):
        name = f"reshard_after_forward={str(flag).lower()}"
        if not _finished(row, run, f"{run.spec.name if run else name}"):
            continue
        grouped = _grouped_fqns(run)
        pres = _pre_events(run)
        wrong = []
        first_seen: set[tuple[int, int, str]] = set()
        for event in pres:
            kind = "grouped" if event["fqn"] in grouped else "dense"
            got = tuple(event.get("orientations", ()))
            key = (event["rank"], event["step"], event["fqn"])
            if flag:
                want = {"forward": {"dense": ("row",), "grouped": ("col",)},
                        "backward": {"dense": ("col",), "grouped": ("row",)}}[event["phase"]][kind]
            else:
                want = ("row", "col") if key not in first_seen else got
            first_seen.add(key)
            if got != want:
                wrong.append(f"{event['fqn']} {event['phase']} {got} != {want}")
        expected = ("forward: dense row, grouped col; backward: dense col, grouped row" if flag
                    else "the first gather of each step carries row and col")
        row.check(f"{name}: orientations per gather (design spec §9.1)", bool(pres) and not wrong,
                  wrong[:5] or f"{len(pres)} pre-all-gather events", expected)
        phases = sorted({e["phase"] for e in pres})
        row.evidence[f"{name}.phases"] = phases
        row.evidence[f"{name}.gathers"] = len(pres)
        _wire_checks(row, run)
        _rebuilt_checks(row, run, "mxfp8")
    row.notes.append(
        "With reshard_after_forward=true a backward gather carries the dgrad orientation only (dense col, grouped "
        "row): §9.1 lists row+col for backward because it counts wgrad, which reads no weight "
        "(lp_lightning.integration.GatherPolicy)."
    )
    return row


def q3_06(runs: dict[str, RunResult], settings: STSettings, reshard_after_forward: bool) -> Row:
    row = Row("Q3-06")
    for run in (runs.get("probe/hif8_current"), runs.get("reshard/hif8_current")):
        if not _finished(row, run, run.spec.name if run else "probe/reshard hif8_current"):
            continue
        posts = _post_events(run)
        grouped = _grouped_fqns(run)
        by_key: dict[tuple[int, str, str], dict[int, Any]] = defaultdict(dict)
        for event in posts:
            by_key[(event["step"], event["fqn"], event["phase"])][event["rank"]] = event.get("scale_values")
        unequal = sorted(f"{k[1]} step {k[0]} {k[2]}" for k, v in by_key.items()
                         if k[1] not in grouped and len({repr(x) for x in v.values()}) != 1)
        row.check(f"{run.spec.name}: dense scales equal on every rank", bool(by_key) and not unequal,
                  unequal[:5] or f"{len(by_key)} gathers", "[]")
        # Grouped: the gathered [E] scales are the ranks' [E_local] scales of the previous step's refresh, in rank order.
        refreshed: dict[tuple[int, str], dict[int, list[float]]] = defaultdict(dict)
        for rank in run.probe("scales"):
            for event in rank.get("records", []):
                if event.get("weight_fqn") and isinstance(event.get("scale"), list):
                    refreshed[(event["step"], event["weight_fqn"])][rank["_rank"]] = event["scale"]
        compared, wrong = 0, []
        for (step, fqn, phase), values in by_key.items():
            local = refreshed.get((step - 1, fqn))
            if fqn not in grouped or not local or len(local) != settings.devices:
                continue
            expected = [v for r in sorted(local) for v in local[r]]
            for rank, gathered in values.items():
                compared += 1
                if gathered != expected:
                    wrong.append(f"{fqn} step {step} rank {rank}")
        row.check(f"{run.spec.name}: grouped scales in global expert order (gathered = ranks' refreshed scales)",
                  compared > 0 and not wrong, wrong[:5] or f"{compared} gathers compared", "equal")
        same, differ = 0, []
        shas: dict[tuple[int, int, str], dict[str, Any]] = defaultdict(dict)
        for event in posts:
            shas[(event["rank"], event["step"], event["fqn"])][event["phase"]] = event.get("sha1")
        for key, phases in shas.items():
            if "forward" in phases and "backward" in phases:
                same += 1
                if phases["forward"] != phases["backward"]:
                    differ.append(f"{key[2]} step {key[1]} rank {key[0]}")
        flag = (run.summary or {}).get("sharding", {}).get("reshard_after_forward")
        row.check(f"{run.spec.name}: forward and backward use the same data and scale",
                  not differ and (same > 0 or flag is False), differ[:5] or f"{same} forward/backward pairs",
                  "identical bytes (reshard=false: one gather serves both)")
        _wire_checks(row, run)
        _rebuilt_checks(row, run, "hif8_current")
    return row


def _refresh_checks(row: Row, run: RunResult, *, micro_batches: int) -> None:
    ranks = run.probe("refresh")
    row.check(f"{run.spec.name}: refresh records on every rank", len(ranks) >= 1, len(ranks), ">= 1")
    for rank in ranks:
        tag = f"{run.spec.name} rank {rank['_rank']}"
        row.check(f"{tag}: micro-batches per optimizer step", rank.get("micro_batches_per_step") == micro_batches,
                  rank.get("micro_batches_per_step"), micro_batches)
        row.check(f"{tag}: no refresh on a micro-step", rank.get("micro_step_refreshes") == 0,
                  rank.get("micro_step_refreshes"), 0)
        row.check(f"{tag}: no refresh inside forward/backward (recompute)", rank.get("forward_backward_refreshes") == 0,
                  rank.get("forward_backward_refreshes"), 0)
        weights = rank.get("low_precision_weights")
        bad = [s for s in rank.get("per_step", [])
               if (s.get("skipped") and s.get("refreshes") != 0)
               or (not s.get("skipped") and (s.get("weights") != weights or s.get("max_per_weight") != 1))]
        row.check(f"{tag}: each successful step refreshes each of the {weights} weights once", not bad and bool(weights),
                  bad[:3] or f"{len(rank.get('per_step', []))} steps", "refreshes = weights, max 1 per weight")


def q3_07(runs: dict[str, RunResult], settings: STSettings) -> Row:
    row = Row("Q3-07")
    for case in ("mxfp8", "hif8_current"):
        run = runs.get(f"accum/{case}")
        if _finished(row, run, f"accum/{case}"):
            _training_checks(row, run, f"accum/{case}", settings.variant_steps)
            _refresh_checks(row, run, micro_batches=settings.accumulation)
    return row


def q3_08(runs: dict[str, RunResult], settings: STSettings) -> Row:
    row = Row("Q3-08")
    for case in ("mxfp8", "hif8_current"):
        run, main = runs.get(f"recompute/{case}"), runs.get(f"main/{case}")
        if not _finished(row, run, f"recompute/{case}"):
            continue
        _training_checks(row, run, f"recompute/{case}", settings.variant_steps)
        _refresh_checks(row, run, micro_batches=1)
        if main is not None and main.ok:
            lp = (run.summary.get("sharding") or {}).get("low_precision_weights")
            lp_main = (main.summary.get("sharding") or {}).get("low_precision_weights")
            row.check(f"recompute/{case}: no extra persistent weights", lp == lp_main,
                      f"{len(lp or [])} low-precision weights", f"{len(lp_main or [])} as in main/{case}")
        steps = max(len(run.summary.get("losses", [])), 1)
        row.evidence[f"{case}.gemms_per_step"] = {r: n / steps for (r, f, b), n in _gemm_counts(run).items()}
        row.evidence[f"{case}.gathers_per_step"] = ((run.summary.get("wire") or {}).get("gathers_per_step"))
    return row


def _checkpoint_checks(row: Row, path: Any, case: str, step: int) -> None:
    from lp_lightning.distributed.checkpoint import checkpoint_tensor_keys
    from lp_lightning.tensor.storage import ALL_STORAGE_NAMES

    try:
        keys = checkpoint_tensor_keys(path)
    except Exception as err:  # noqa: BLE001 - a missing or unreadable checkpoint is this check's failure
        row.check(f"{case}: checkpoint of step {step} readable", False, f"{type(err).__name__}: {err}", str(path))
        return
    tensors = {k: v for k, v in keys.items() if hasattr(v, "properties")}
    derived = sorted(k for k in tensors if k.rsplit(".", 1)[-1] in ALL_STORAGE_NAMES)
    row.check(f"{case}: no derived data/scale in the checkpoint", not derived, derived[:5] or f"{len(tensors)} tensors",
              "[]")
    model = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
    moments = {k: v for k, v in tensors.items() if k.endswith((".exp_avg", ".exp_avg_sq"))}
    not_fp32 = sorted(k for k, v in {**model, **moments}.items() if str(v.properties.dtype) != "torch.float32")
    row.check(f"{case}: masters and moments FP32 in the checkpoint", bool(model) and bool(moments) and not not_fp32,
              not_fp32[:5] or f"{len(model)} weights, {len(moments)} moments", "all torch.float32")


def _digest(run: RunResult, rank: int, when: str, step: int) -> dict[str, Any] | None:
    for data in run.probe("digest"):
        if data["_rank"] == rank:
            for snap in data.get("snapshots", []):
                if snap.get("when") == when and snap.get("global_step") == step:
                    return snap
    return None


def _state_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    out = []
    for fqn in sorted(set(a["params"]) | set(b["params"])):
        pa, pb = a["params"].get(fqn), b["params"].get(fqn)
        if pa is None or pb is None or pa["sha1"] != pb["sha1"] or pa["dtype"] != pb["dtype"]:
            out.append(f"{fqn} (master)")
        elif pa.get("storage") != pb.get("storage"):
            out.append(f"{fqn} (8-bit storage)")
    for fqn in sorted(set(a["optimizer"]) | set(b["optimizer"])):
        if a["optimizer"].get(fqn) != b["optimizer"].get(fqn):
            out.append(f"{fqn} (optimizer state)")
    return out


def q3_09(runs: dict[str, RunResult], settings: STSettings) -> Row:
    row = Row("Q3-09")
    n = settings.save_step
    for case in (c.name for c in CASES):
        main, resume = runs.get(f"main/{case}"), runs.get(f"resume/{case}")
        if not (_finished(row, main, f"main/{case}") & _finished(row, resume, f"resume/{case}")):
            continue
        _checkpoint_checks(row, main.checkpoint(n), case, n)
        first = resume.summary.get("first_step")
        row.check(f"{case}: restored step", first == n, first, n)
        compared, differences = 0, []
        for rank in range(settings.devices):
            after, start = _digest(main, rank, "after_step", n), _digest(resume, rank, "train_start", n)
            if after is None or start is None:
                differences.append(f"rank {rank}: digest missing")
                continue
            compared += 1
            differences += [f"rank {rank}: {d}" for d in _state_differences(after, start)]
            dtypes = {p["dtype"] for p in start["params"].values()} | {
                s["dtype"] for st in start["optimizer"].values() for k, s in st.items() if k != "step"}
            row.check(f"{case} rank {rank}: resumed masters and moments FP32", dtypes == {"float32"}, sorted(dtypes),
                      ["float32"])
        row.check(f"{case}: resumed state bit-identical to the continuous run after step {n} (masters, moments, "
                  "8-bit storage rebuilt from the FP32 master)", compared == settings.devices and not differences,
                  differences[:5] or f"{compared} ranks", "identical SHA-1 of every tensor")
        continuous = main.summary.get("losses", [])[n - main.summary.get("first_step", 0):]
        resumed = resume.summary.get("losses", [])
        tol = unit_roundoff(case)
        if continuous and resumed:
            rel = abs(resumed[0] - continuous[0]) / abs(continuous[0])
            row.check(f"{case}: first resumed loss within tolerance", rel <= tol,
                      f"{resumed[0]:.6f} vs {continuous[0]:.6f} (rel {rel:.2e})", f"rel <= u = {tol:.2e}")
        else:
            row.check(f"{case}: first resumed loss within tolerance", False, "no losses", "losses of both runs")
        row.evidence[f"{case}.continuous_losses"] = continuous
        row.evidence[f"{case}.resumed_losses"] = resumed
        row.evidence[f"{case}.tolerance_rel"] = tol
    return row


def q3_10(illegal: list[dict[str, Any]] | None) -> Row:
    row = Row("Q3-10")
    if illegal is None:
        row.check("illegal-configuration cases ran", False, "not run", "every design spec §15 row")
        return row
    for case in illegal:
        if case.get("pass") is None:  # the case cannot apply on this host (e.g. torch_npu installed)
            row.notes.append(f"{case['id']}: not applicable here ({case.get('note')})")
            continue
        row.check(
            f"{case['id']} ({case['section15_row']}): fails at {case['expected_stage']}",
            bool(case.get("pass")),
            f"stage {case.get('observed_stage')}, exit {case.get('exit_code')}, names {case.get('must_mention')}: "
            f"{case.get('mentions_ok')}",
            case["expected_stage"],
        )
    row.evidence["cases"] = illegal
    return row


def steady_performance(run: RunResult, settings: STSettings) -> dict[str, Any] | None:
    """Steady tokens/s and mean step time of a main run (the first ``warmup_steps`` left out).

    Same statistics for every case (design spec §17.4): tokens/s = tokens of the steady steps / their
    summed wall time; step time = mean (median also reported).
    """
    summary = run.summary or {}
    times = summary.get("step_times_s", [])[settings.warmup_steps:]
    steps = summary.get("steps") or 0
    if not times or not steps:
        return None
    tokens_per_step = summary.get("tokens", 0) / steps
    return {
        "steady_steps": len(times),
        "warmup_steps_excluded": settings.warmup_steps,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step * len(times) / sum(times),
        "step_time_s_mean": statistics.fmean(times),
        "step_time_s_median": statistics.median(times),
        "threads": summary.get("threads"),
        "load_average": summary.get("load_average"),
        "backend": summary.get("backend"),
    }


def q3_11(runs: dict[str, RunResult], settings: STSettings) -> Row:
    row = Row("Q3-11")
    perf = {}
    for case in (c.name for c in CASES):
        run = runs.get(f"main/{case}")
        if _finished(row, run, f"main/{case}"):
            perf[case] = steady_performance(run, settings)
            steady = (perf[case] or {}).get("steady_steps", 0)
            row.check(f"{case}: steady steps measured", steady >= settings.required_steps, steady,
                      f">= {settings.required_steps}")
    base = perf.get("bf16")
    backends = set()
    for case in ("mxfp8", "hif8_current"):
        if base and perf.get(case):
            ratios = {
                "throughput_ratio": perf[case]["tokens_per_s"] / base["tokens_per_s"],
                "step_time_ratio": perf[case]["step_time_s_mean"] / base["step_time_s_mean"],
            }
            perf[case].update(ratios)
            backends.add(perf[case]["backend"])
            if perf[case]["backend"] != "emulated":
                row.check(f"{case}: throughput_ratio >= 1", ratios["throughput_ratio"] >= 1.0,
                          round(ratios["throughput_ratio"], 4), ">= 1.0")
                row.check(f"{case}: step_time_ratio <= 1", ratios["step_time_ratio"] <= 1.0,
                          round(ratios["step_time_ratio"], 4), "<= 1.0")
    row.evidence["performance"] = perf
    if backends == {"emulated"}:
        row.not_applicable = (
            "the low-precision GEMMs ran on the emulated backend, a bit-exact model of the hardware's numerics, not "
            "of its speed: the ratios measure the emulation's cost, not an Ascend kernel"
        )
    return row


def evaluate_rows(
    runs: dict[str, RunResult],
    settings: STSettings,
    *,
    illegal: list[dict[str, Any]] | None,
    reshard_after_forward: bool,
    targets: dict[str, list[str]],
    only: list[str] | None = None,
) -> list[Row]:
    """The Q3 rows' verdicts, in order (``only``: these row ids)."""
    rows = [
        q3_01(runs, settings),
        _low_precision_row("Q3-02", "mxfp8", runs, settings, targets),
        _low_precision_row("Q3-03", "hif8_current", runs, settings, targets),
        q3_04(runs, settings, targets),
        q3_05(runs, settings, reshard_after_forward),
        q3_06(runs, settings, reshard_after_forward),
        q3_07(runs, settings),
        q3_08(runs, settings),
        q3_09(runs, settings),
        q3_10(illegal),
        q3_11(runs, settings),
    ]
    return [row for row in rows if only is None or row.id in only]
