"""What the Q3 rows must exercise, and the report sections that show it (docs/acceptance.md "What the rows exercise").

Checks that rows call with one line each, and the report sections built from the rows and runs:

=====================================  ==================================  ===================================
section (``report.json`` ``sections``)  evidence                            checks in
=====================================  ==================================  ===================================
``skipped_step``                        ``probe/<case>``: the injected       Q3-02 / Q3-03
                                        non-finite gradient at
                                        :data:`~lp_lightning.st.cases.INJECTED_STEP`, the refresh
                                        records per step
``recompute_vs_off``                    ``recompute/<case>`` against         Q3-08
                                        ``main/<case>`` over the same steps
                                        (gradient fingerprints: main's
                                        warm-up steps only)
``q3_05_backward_gathers``              the gather trace of the run with     Q3-05 (evidence and note)
                                        ``reshard_after_forward=true``
``low_precision_off``                   the main runs' resident-objects      (report only: design spec §17.4)
                                        probe and steady step times
``limitations``                         docs/formats.md open questions, the  (report only: design spec §17.5)
                                        rows' deviations, n/a and failures
=====================================  ==================================  ===================================

Design spec §16.5/§16.6: a step the guard skips refreshes no weight, a successful one refreshes each
weight exactly once; ``activation_checkpoint`` off and full give the same loss, gradients and kernel
path, and ``full`` does not refresh twice. Recompute replays the same 8-bit kernels on the same
inputs, so on the emulated backend (and any deterministic kernel) the losses and gradient norms are
bitwise equal; the recompute adds one fprop per low-precision GEMM (every replaced module lives in a
checkpointed decoder layer), dgrad and wgrad run as often.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

from lp_lightning.lightning.nonfinite import DEFAULT_MAX_CONSECUTIVE_SKIPS
from lp_lightning.st.cases import CASES, INJECTED_STEP, STSettings
from lp_lightning.st.runner import RunResult
from lp_lightning.st.verdict import Row, _gemm_counts

__all__ = [
    "backward_gather_evidence", "recompute_equality_checks", "report_sections", "sections_markdown",
    "skipped_step_checks",
]

_LP = ("mxfp8", "hif8_current")
FORMATS_DOC = Path(__file__).resolve().parents[2] / "docs" / "formats.md"
"""docs/formats.md of the source tree (its "Open questions" feed the §17.5 section)."""


# ------------------------------------------------------------------------------------------------
# The skipped step (Q3-02 / Q3-03)


def skipped_step_checks(row: Row, probe: RunResult, case: str) -> dict[str, Any]:
    """The injected non-finite gradient of ``probe/<case>``: its step skipped on every rank, no refresh there,
    one per weight at the other steps (design spec §16.6). Adds the checks to ``row``; returns the evidence."""
    name = probe.spec.name
    injected = [i for r in probe.probe("inject") for i in r.get("injected", [])]
    row.check(f"{name}: a non-finite gradient injected at step {INJECTED_STEP}",
              [i.get("step") for i in injected] == [INJECTED_STEP], injected or "no injection recorded",
              f"one injection at step {INJECTED_STEP} (InjectNonFiniteGradient)")
    per_rank = {r["_rank"]: r for r in probe.probe("refresh")}
    table, bad = [], []
    for rank, data in sorted(per_rank.items()):
        weights = data.get("low_precision_weights")
        for s in data.get("per_step", []):
            expect_skip = s.get("step") == INJECTED_STEP
            want = (0, 0) if expect_skip else (weights, 1)
            got = (s.get("refreshes"), s.get("max_per_weight"))
            table.append({"rank": rank, "step": s.get("step"), "skipped": s.get("skipped"), "refreshes": got[0],
                          "max_per_weight": got[1], "weights": weights, "expected_refreshes": want[0]})
            if bool(s.get("skipped")) != expect_skip or got != want or not weights:
                bad.append(f"rank {rank} step {s.get('step')}: skipped {s.get('skipped')}, refreshes {got[0]}, "
                           f"max/weight {got[1]} (want {want[0]}, {want[1]})")
    row.check_compared(f"{name}: the skipped step refreshes no weight, every other step each weight once",
                       len(table), not bad, bad[:4] or f"{len(table)} rank-steps",
                       f"step {INJECTED_STEP}: skipped, 0 refreshes; others: refreshes = weights, max 1 per weight")
    skips = ((probe.summary or {}).get("nonfinite") or {}).get("skips") or []
    evidence = {"run": name, "injected": injected, "per_step": table, "guard_skips": skips}
    row.evidence[f"{case}.skipped_step"] = evidence
    return evidence


# ------------------------------------------------------------------------------------------------
# Recompute off vs full (Q3-08)


def _per_step(values: list[Any], steps: int) -> list[Any]:
    return list(values[:steps])


def _roles_per_step(run: RunResult, steps: int) -> dict[str, float]:
    counts: dict[str, float] = {}
    for (role, _, _), n in _gemm_counts(run).items():
        counts[role] = counts.get(role, 0) + n
    return {role: n / steps / max(len(run.probe("gemm_trace")), 1) for role, n in sorted(counts.items())}


def _resident(run: RunResult) -> list[dict[str, Any]]:
    return [{k: r.get("parameters", {}).get(k) for k in ("count", "low_precision_weights",
                                                         "low_precision_storage_tensors", "low_precision_storage_bytes")}
            for r in sorted(run.probe("resident"), key=lambda r: r["_rank"])]


def recompute_equality_checks(row: Row, full: RunResult, off: RunResult, case: str, settings: STSettings) -> None:
    """``recompute/<case>`` (``activation_checkpoint: full``) against ``main/<case>`` (off) over the recompute run's
    steps, measured from both runs' records: losses and gradient norms bitwise, GEMMs per role per step (fprop
    doubled by the recompute, dgrad and wgrad equal), refreshes per step, all-gathers per step, resident objects.
    Adds the checks to ``row`` and the comparison to its evidence (``<case>.recompute_vs_off``)."""
    name = f"recompute/{case} vs main/{case}"
    steps = min(len(full.summary.get("losses", [])), len(off.summary.get("losses", [])))
    losses = (_per_step(full.summary.get("losses", []), steps), _per_step(off.summary.get("losses", []), steps))
    norms = (_per_step(full.summary.get("grad_norms", []), steps), _per_step(off.summary.get("grad_norms", []), steps))
    first = next((i + 1 for i, (a, b) in enumerate(zip(*losses)) if a != b), None)
    row.check_compared(f"{name}: losses bitwise equal (same kernels replayed)", steps, first is None,
                       f"{steps} steps equal" if first is None else f"step {first}: {losses[0][first - 1]!r} vs "
                       f"{losses[1][first - 1]!r}", "identical per step")
    first = next((i + 1 for i, (a, b) in enumerate(zip(*norms)) if a != b), None)
    row.check_compared(f"{name}: gradient norms bitwise equal", steps, first is None,
                       f"{steps} steps equal" if first is None else f"step {first}: {norms[0][first - 1]!r} vs "
                       f"{norms[1][first - 1]!r}", "identical per step")
    full_roles = _roles_per_step(full, max(len(full.summary.get("losses", [])), 1))
    off_roles = _roles_per_step(off, max(len(off.summary.get("losses", [])), 1))
    want = {role: (2 * n if role.endswith("fprop") else n) for role, n in off_roles.items()}
    row.check_compared(f"{name}: GEMMs per role per step (fprop: forward + recompute; dgrad, wgrad: as off)",
                       len(off_roles), full_roles == want and len(off_roles) == 6, full_roles, want)
    refresh = {}
    for run in (full, off):
        refresh[run.spec.name] = [(s.get("refreshes"), s.get("max_per_weight"))
                                  for r in run.probe("refresh") for s in r.get("per_step", [])[:steps]]
    row.check_compared(f"{name}: refreshes per step and rank equal (one per weight)",
                       len(refresh[off.spec.name]), refresh[full.spec.name] == refresh[off.spec.name],
                       refresh[full.spec.name][:6], refresh[off.spec.name][:6])
    gathers = {run.spec.name: [s.get("pre") for r in run.probe("gather_trace") for s in r.get("per_step", [])[:steps]]
               for run in (full, off)}
    row.check_compared(f"{name}: all-gathers per step and rank equal (recompute gathers nothing more)",
                       len(gathers[off.spec.name]), gathers[full.spec.name] == gathers[off.spec.name],
                       gathers[full.spec.name][:6], gathers[off.spec.name][:6])
    prints = {run.spec.name: {(r["_rank"], s["step"]): s["grads"] for r in run.probe("grad_fingerprint")
                              for s in r.get("per_step", [])} for run in (full, off)}
    common = sorted(set(prints[full.spec.name]) & set(prints[off.spec.name]))
    differ = [f"rank {rank} step {step}: {fqn}" for rank, step in common
              for fqn in sorted(set(prints[full.spec.name][(rank, step)]) | set(prints[off.spec.name][(rank, step)]))
              if prints[full.spec.name][(rank, step)].get(fqn) != prints[off.spec.name][(rank, step)].get(fqn)]
    row.check_compared(f"{name}: gradients bitwise equal (FP32 sum and max |g| of every gradient shard)", len(common),
                       not differ, differ[:5] or f"{len(common)} rank-steps equal", "identical fingerprints",
                       if_none=f"main/{case} fingerprints only its warm-up steps (outside the timed window): "
                               "--warmup_steps 0 leaves none")
    resident = {run.spec.name: _resident(run) for run in (full, off)}
    row.check_compared(f"{name}: no extra persistent weights (measured: parameters, 8-bit weights, storage tensors "
                       "and bytes per rank)", len(resident[off.spec.name]),
                       resident[full.spec.name] == resident[off.spec.name], resident[full.spec.name],
                       resident[off.spec.name])
    row.evidence[f"{case}.recompute_vs_off"] = {
        "steps_compared": steps, "losses": {"full": losses[0], "off": losses[1]},
        "grad_norms": {"full": norms[0], "off": norms[1]}, "gemms_per_step": {"full": full_roles, "off": off_roles},
        "refreshes": refresh, "gathers_per_step": gathers, "resident": resident,
        "gradient_fingerprints_compared": len(common), "gradients_differing": differ[:20],
    }


# ------------------------------------------------------------------------------------------------
# Q3-05: backward gathers, spec-literal against the product's rule


def backward_gather_evidence(row: Row, run: RunResult) -> dict[str, Any]:
    """Measured all-gather bytes of a ``reshard_after_forward=true`` MXFP8 run, and the design spec §9.1-literal
    figure from the same shapes (a backward gather carrying row and col: its bytes plus the other orientation's,
    which the forward gather of the same weight, step and rank carried). Adds a note and ``backward_gathers``."""
    pres = [{**e, "rank": r["_rank"]} for r in run.probe("gather_trace") for e in r.get("events", [])
            if e.get("stage", "pre_all_gather") == "pre_all_gather"]
    forward = {(e["rank"], e["step"], e["fqn"]): e.get("bytes") or 0 for e in pres if e.get("phase") == "forward"}
    steps = max(len({e["step"] for e in pres}), 1)
    fwd = sum(forward.values())
    bwd = sum(e.get("bytes") or 0 for e in pres if e.get("phase") == "backward")
    other = sum(forward.get((e["rank"], e["step"], e["fqn"]), 0) for e in pres if e.get("phase") == "backward")
    ranks = max(len({e["rank"] for e in pres}), 1)
    # Each rank contributes its shard; every rank receives all of them: bytes received per rank = sum over ranks.
    product = {"forward": fwd / steps, "backward": bwd / steps, "total": (fwd + bwd) / steps}
    literal = {"forward": fwd / steps, "backward": (bwd + other) / steps, "total": (fwd + bwd + other) / steps}
    evidence = {
        "run": run.spec.name,
        "spec_literal": "design spec §9.1/§17.2 Q3-05: with reshard_after_forward=true the backward gathers row and col",
        "product_rule": "the backward gathers the dgrad orientation only (dense col, grouped row); wgrad reads the "
                        "saved activation and the gradient, no weight (lp_lightning.fsdp.gather.GatherPolicy)",
        "bytes_received_per_rank_per_step": {"product": product, "spec_literal": literal},
        "ranks": ranks, "steps": steps,
        "backward_saving": 1 - (bwd / (bwd + other)) if bwd + other else None,
    }
    row.evidence["backward_gathers"] = evidence
    if pres:
        row.notes.append(
            f"Backward gathers ({run.spec.name}): spec-literal (row+col) {literal['backward']:.0f} B per rank and step, "
            f"the product's rule (dgrad plane only) {product['backward']:.0f} B measured; per step in total "
            f"{literal['total']:.0f} B vs {product['total']:.0f} B (the bytes every rank receives).")
    return evidence


# ------------------------------------------------------------------------------------------------
# Report sections


def _skipped_section(rows: dict[str, Row]) -> dict[str, Any]:
    out = {}
    for row_id, case in (("Q3-02", "mxfp8"), ("Q3-03", "hif8_current")):
        row = rows.get(row_id)
        if row is not None and f"{case}.skipped_step" in row.evidence:
            checks = [c.as_dict() for c in row.checks if c.name.startswith(f"probe/{case}: ") and (
                "injected" in c.name or "skipped step" in c.name)]
            out[case] = {**row.evidence[f"{case}.skipped_step"], "checks": checks, "row": row_id}
    return out


def _low_precision_off_section(runs: dict[str, RunResult], settings: STSettings) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in (c.name for c in CASES):
        run = runs.get(f"main/{case}")
        if run is None or not run.ok:
            continue
        ranks = sorted(run.probe("resident"), key=lambda r: r["_rank"])
        if not ranks:
            continue
        first = ranks[0]
        times = (run.summary.get("step_times_s") or [])[settings.warmup_steps:]
        out[case] = {
            "low_precision_modules": first["modules"]["low_precision"],
            "top_level_packages": first["modules"]["top_level"],
            "distributions": first["modules"].get("distributions", []),
            "lp_lightning_modules": len(first["modules"]["lp_lightning"]),
            "parameters": [r["parameters"] for r in ranks],
            "steady_step_time_s_mean": statistics.fmean(times) if times else None,
            "backend": run.summary.get("backend"),
        }
    base = out.get("bf16")
    for case in _LP:
        if base and case in out:
            out[case]["extra_distributions"] = sorted(set(out[case]["distributions"]) - set(base["distributions"]))
            t, b = out[case]["steady_step_time_s_mean"], base["steady_step_time_s_mean"]
            out[case]["step_time_ratio_to_bf16"] = t / b if t and b else None
    for entry in out.values():
        entry["top_level_packages"] = len(entry["top_level_packages"])
        entry["distributions"] = len(entry["distributions"])
    return out


def _open_questions() -> list[str]:
    if not FORMATS_DOC.is_file():
        return [f"docs/formats.md not found at {FORMATS_DOC} (an installed package without the docs): its open "
                "questions are not listed here"]
    text = FORMATS_DOC.read_text()
    part = text.split("## Open questions", 1)[1] if "## Open questions" in text else ""
    part = re.split(r"\n## |\n\n(?!\d+\.|\s)", part.strip("\n"), maxsplit=1)[0]
    items = re.split(r"\n(?=\d+\. )", part.strip())
    return [" ".join(item.split()) for item in items if re.match(r"\d+\. ", item)]


def _limitations_section(rows: list[Row], numerics_rows: list[Row], runs: dict[str, RunResult]) -> dict[str, Any]:
    deviations = [{"row": r.id, "text": r.evidence["backward_gathers"]["product_rule"] + "; the spec-literal "
                   "rule (" + r.evidence["backward_gathers"]["spec_literal"] + ") would move "
                   + _bytes_delta(r.evidence["backward_gathers"])}
                  for r in rows if "backward_gathers" in r.evidence]
    if any(r.id == "Q3-08" for r in rows):
        deviations.append({"row": "Q3-08", "text": "with activation_checkpoint=full the recompute reruns each fprop "
                           "GEMM once in backward (the spec's 'same kernel path': the same kernels, fprop twice per "
                           "step)"})
    every = [*rows, *numerics_rows]
    not_applicable = [{"row": r.id, "title": r.title, "why": r.not_applicable or "; ".join(
        sorted({c.not_applicable for c in r.checks if c.not_applicable}))} for r in every if r.verdict == "not-applicable"]
    failing = [{"row": r.id, "title": r.title, "checks": [c.name for c in r.checks if not c.ok][:5]}
               for r in every if r.verdict == "fail"]
    not_run = sorted(n for n, r in runs.items() if not r.ok)
    failure_rules = [
        "a row fails when any of its checks fails, and when it has no check; a check that compared nothing "
        "(no event, pair or rank) fails or is n/a with its reason, never passes",
        "exit status: 0 when no row fails, 1 when one does, 2 for a bad option, 130/143 after Ctrl-C/SIGTERM",
        f"training: a NaN/Inf gradient norm skips the step and its refresh; {DEFAULT_MAX_CONSECUTIVE_SKIPS} skipped "
        "steps in a row (nonfinite.max_consecutive_skips) or a NaN/Inf master stop the run with exit status 1",
        "checkpoints: a NaN/Inf in the state refuses the save; a damaged or unverifiable checkpoint refuses the load "
        "(with --ckpt_path last the next older intact one loads)",
        "the startup gate stops a run whose backend cannot run the format (design spec §15 rows 1-3); an NPU run "
        "never falls back to the emulation",
    ]
    return {"open_questions": _open_questions(), "deviations": deviations, "not_applicable": not_applicable,
            "failing_rows": failing, "runs_not_finished": not_run, "failure_rules": failure_rules}


def _bytes_delta(evidence: dict[str, Any]) -> str:
    figures = evidence["bytes_received_per_rank_per_step"]
    return (f"{figures['spec_literal']['backward']:.0f} instead of {figures['product']['backward']:.0f} bytes per rank "
            "and step in backward gathers")


def report_sections(rows: list[Row], numerics_rows: list[Row], runs: dict[str, RunResult],
                    settings: STSettings) -> dict[str, Any]:
    """The sections of the module docstring, JSON-ready (``report.json`` ``sections``); a section without data holds
    ``{}`` and the report says which runs it needs."""
    by_id = {r.id: r for r in rows}
    recompute = {case: by_id["Q3-08"].evidence[f"{case}.recompute_vs_off"] for case in _LP
                 if "Q3-08" in by_id and f"{case}.recompute_vs_off" in by_id["Q3-08"].evidence}
    gathers = by_id["Q3-05"].evidence.get("backward_gathers", {}) if "Q3-05" in by_id else {}
    return {
        "skipped_step": _skipped_section(by_id),
        "recompute_vs_off": recompute,
        "q3_05_backward_gathers": gathers,
        "low_precision_off": _low_precision_off_section(runs, settings),
        "limitations": _limitations_section(rows, numerics_rows, runs),
    }


def _mib(value: Any) -> str:
    return "—" if value is None else f"{value / 2**20:.3f}"


def sections_markdown(sections: dict[str, Any]) -> list[str]:
    """``report.md``'s sections for :func:`report_sections`."""
    md = ["## Skipped step (design spec §16.5, §16.6)", ""]
    skipped = sections["skipped_step"]
    if not skipped:
        md += ["Not shown: it needs Q3-02/Q3-03 and their `probe/<case>` runs.", ""]
    for case, entry in skipped.items():
        injected = entry["injected"][0] if entry["injected"] else {}
        md += [f"`{entry['run']}`: `InjectNonFiniteGradient(step={INJECTED_STEP})` wrote {injected.get('value')} into "
               f"`{injected.get('fqn')}` on rank {injected.get('rank')}; the guard: "
               + (", ".join(f"step {s['step']} {s['reason']} ({s.get('fqn')})" for s in entry["guard_skips"]) or "no skip")
               + f" ({entry['row']}).", "", "| rank | step | skipped | refreshes | max per weight | expected |",
               "|---|---|---|---|---|---|"]
        md += [f"| {s['rank']} | {s['step']} | {s['skipped']} | {s['refreshes']} | {s['max_per_weight']} | "
               f"{s['expected_refreshes']} |" for s in entry["per_step"]]
        md += [""] + [f"- {'yes' if c['ok'] else '**NO**'}: {c['name']}" for c in entry["checks"]] + [""]
    md += ["## Recompute off vs full (design spec §16.5, Q3-08)", ""]
    if not sections["recompute_vs_off"]:
        md += ["Not shown: it needs Q3-08 with its `recompute/<case>` and `main/<case>` runs.", ""]
    for case, entry in sections["recompute_vs_off"].items():
        md += [f"`{case}`, {entry['steps_compared']} steps: losses full {entry['losses']['full']} / off "
               f"{entry['losses']['off']}; GEMMs per step and rank full {entry['gemms_per_step']['full']} / off "
               f"{entry['gemms_per_step']['off']}; all-gathers per step and rank full "
               f"{list(entry['gathers_per_step'].values())[0]} / off {list(entry['gathers_per_step'].values())[1]}.", ""]
    md += ["## Q3-05 backward gathers: the spec-literal rule and the product's", ""]
    gathers = sections["q3_05_backward_gathers"]
    if gathers:
        figures = gathers["bytes_received_per_rank_per_step"]
        md += [f"- spec-literal: {gathers['spec_literal']}", f"- product: {gathers['product_rule']}", "",
               "| bytes received per rank and step | forward | backward | total |", "|---|---|---|---|"]
        md += [f"| {label} | {f['forward']:.0f} | {f['backward']:.0f} | {f['total']:.0f} |"
               for label, f in (("spec-literal (computed from the same shapes)", figures["spec_literal"]),
                                ("product (measured, " + gathers["run"] + ")", figures["product"]))]
        md += [""]
    else:
        md += ["Not shown: it needs Q3-05 and its `reshard_after_forward=true` MXFP8 run.", ""]
    md += ["## Low precision off vs BF16 (design spec §17.4)", ""]
    off = sections["low_precision_off"]
    if off:
        cases = list(off)
        md += ["| | " + " | ".join(cases) + " |", "|---|" + "---|" * len(cases) + ""]
        rank0 = {c: off[c]["parameters"][0] if off[c]["parameters"] else {} for c in cases}
        md += [
            "| low-precision modules imported | " + " | ".join(str(len(off[c]["low_precision_modules"])) for c in cases) + " |",
            "| top-level packages / distributions imported | " + " | ".join(
                f"{off[c]['top_level_packages']} / {off[c]['distributions']}" for c in cases) + " |",
            "| extra distributions vs bf16 | " + " | ".join(", ".join(off[c].get("extra_distributions", [])) or "—"
                                                         for c in cases) + " |",
            "| parameters by class (rank 0) | " + " | ".join(str(rank0[c].get("by_class")) for c in cases) + " |",
            "| 8-bit weights / storage MiB (rank 0) | " + " | ".join(
                f"{rank0[c].get('low_precision_weights')} / {_mib(rank0[c].get('low_precision_storage_bytes'))}"
                for c in cases) + " |",
            "| steady step time (s), ratio to bf16 | " + " | ".join(
                f"{off[c]['steady_step_time_s_mean']:.3g}" + (f" ({off[c]['step_time_ratio_to_bf16']:.3g})"
                                                             if off[c].get("step_time_ratio_to_bf16") else "")
                if off[c]["steady_step_time_s_mean"] else "—" for c in cases) + " |", ""]
        if "bf16" in off:
            lp = off["bf16"]["low_precision_modules"]
            md += [f"- bf16 (low precision off): {len(lp)} low-precision modules imported"
                   + (f" (**{', '.join(lp)}**)" if lp else " and no 8-bit weight resident: the plain FSDP2 BF16 path, "
                      "no extra dependency or object") + ".", ""]
    else:
        md += ["Not shown: no main run with the resident-objects probe finished.", ""]
    lim = sections["limitations"]
    md += ["## Known limitations and deviations from the spec (design spec §17.5)", "", "Open questions "
           "(docs/formats.md):", ""] + [f"- {q}" for q in lim["open_questions"]] + ["", "Deviations from the spec:", ""]
    md += [f"- {d['row']}: {d['text']}" for d in lim["deviations"]] or ["- none"]
    md += ["", "Not applicable here:", ""]
    md += [f"- {n['row']} {n['title']}: {n['why']}" for n in lim["not_applicable"]] or ["- none"]
    md += ["", "Open issues (failing rows, runs that did not finish):", ""]
    md += [f"- {f['row']} {f['title']}: {'; '.join(f['checks'])}" for f in lim["failing_rows"]]
    md += [f"- run {n} did not finish" for n in lim["runs_not_finished"]]
    if not lim["failing_rows"] and not lim["runs_not_finished"]:
        md += ["- none in this report"]
    md += ["", "Failure rules:", ""] + [f"- {rule}" for rule in lim["failure_rules"]] + [""]
    return md
