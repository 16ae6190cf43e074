"""Q3-05…Q3-08: the FSDP2 gather rows and the weight-lifecycle rows (design spec §9, §10, §17.2, §17.3.1).

Evidence: the gather trace (pre/post-all-gather events with the physical tensors, HiF8 scale values
and SHA-1 of every rebuilt storage tensor), the scale records of the refreshes, the refresh records
and the run summaries' wire sections (:mod:`lp_lightning.telemetry.probe_callbacks`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from lp_lightning.st.cases import STSettings
from lp_lightning.st.runner import RunResult
from lp_lightning.st.sections import backward_gather_evidence, recompute_equality_checks
from lp_lightning.st.verdict import Row, _finished, _gemm_counts, _training_checks

__all__ = ["accumulation_refresh_row", "gather_orientation_row", "hif8_gather_scales_row", "recompute_refresh_row"]


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
    pres = _pre_events(run)
    wide = sorted({f"{e['fqn']} {name} {dtype}" for e in pres for name, dtype, _ in e.get("tensors", [])
                   if dtype != "uint8"})
    row.check_compared(f"{run.spec.name}: all-gather inputs are uint8 slots", len(pres), not wide,
                       wide[:5] or f"all uint8 ({len(pres)} pre-all-gather events)", "uint8")


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
    row.check_compared(f"{run.spec.name}: one logical shape and dtype per weight on every rank and gather", len(shapes),
                       not differing, differing or f"{len(shapes)} weights", "[]")


def gather_orientation_row(runs: dict[str, RunResult], settings: STSettings, reshard_after_forward: bool) -> Row:
    """Design spec §17.2 Q3-05 (MXFP8 FSDP): the orientations each all-gather carries (design spec §9.1), with and
    without ``reshard_after_forward``; 8-bit payloads on the wire and rebuilt storage of the logical shape."""
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
        if flag:
            backward_gather_evidence(row, run)
    row.notes.append(
        "With reshard_after_forward=true a backward gather carries the dgrad orientation only (dense col, grouped "
        "row): §9.1 lists row+col for backward because it counts wgrad, which reads no weight "
        "(lp_lightning.fsdp.gather.GatherPolicy)."
    )
    return row


def hif8_gather_scales_row(runs: dict[str, RunResult], settings: STSettings, reshard_after_forward: bool) -> Row:
    """Design spec §17.2 Q3-06 (HiF8 FSDP): dense scales equal on every rank, grouped scales gathered in global
    expert order, forward and backward reading the same bytes; 8-bit payloads and rebuilt storage."""
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
        row.check_compared(f"{run.spec.name}: forward and backward use the same data and scale", same, not differ,
                           differ[:5] or f"{same} forward/backward pairs", "identical bytes",
                           if_none="reshard_after_forward=false: one gather serves forward and backward, no pair to "
                                   "compare" if flag is False else None)
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


def accumulation_refresh_row(runs: dict[str, RunResult], settings: STSettings) -> Row:
    """Design spec §17.2 Q3-07 (gradient accumulation): the accumulation runs train, and each optimizer step
    refreshes every low-precision weight once, never on a micro-step."""
    row = Row("Q3-07")
    for case in ("mxfp8", "hif8_current"):
        run = runs.get(f"accum/{case}")
        if _finished(row, run, f"accum/{case}"):
            _training_checks(row, run, f"accum/{case}", settings.variant_steps)
            _refresh_checks(row, run, micro_batches=settings.accumulation)
    return row


def recompute_refresh_row(runs: dict[str, RunResult], settings: STSettings) -> Row:
    """Design spec §17.2 Q3-08 (full recompute): the recompute runs train, refresh once per step (never inside
    forward/backward) and, measured against ``main/<case>`` (recompute off) over the same steps, give bitwise the
    same losses and gradient norms, the same GEMMs per role (fprop twice), refreshes, all-gathers and resident
    objects (design spec §16.5; :func:`lp_lightning.st.sections.recompute_equality_checks`)."""
    row = Row("Q3-08")
    for case in ("mxfp8", "hif8_current"):
        run, main = runs.get(f"recompute/{case}"), runs.get(f"main/{case}")
        if not _finished(row, run, f"recompute/{case}"):
            continue
        _training_checks(row, run, f"recompute/{case}", settings.variant_steps)
        _refresh_checks(row, run, micro_batches=1)
        if _finished(row, main, f"main/{case}"):
            recompute_equality_checks(row, run, main, case, settings)
        steps = max(len(run.summary.get("losses", [])), 1)
        row.evidence[f"{case}.gemms_per_step"] = {r: n / steps for (r, f, b), n in _gemm_counts(run).items()}
        row.evidence[f"{case}.gathers_per_step"] = ((run.summary.get("wire") or {}).get("gathers_per_step"))
    return row
