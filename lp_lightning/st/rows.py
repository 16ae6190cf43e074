"""Verdicts of the Q3-01…Q3-11 rows (design spec §17.2) from what the runs left behind.

Each row is a list of :class:`Check` s — a named criterion, what was observed, what was expected —
and its verdict is ``pass`` when every check holds, ``fail`` otherwise. A row whose runs did not
finish fails on the check "run finished". Q3-11 is ``not-applicable`` on the emulated backend: the
emulation models the hardware's numerics, not its speed, so its ratios are reported as the
emulation's cost and never as a hardware pass or fail.

Tolerances (written into the report next to the observed values) are the thresholds of
:mod:`lp_lightning.st.thresholds` (``--thresholds FILE``); their built-in values come from the formats
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
import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lp_lightning.checkpoint.dcp import checkpoint_tensor_keys, is_dcp_checkpoint
from lp_lightning.st.cases import CASES, FSDP_ROWS, STSettings
from lp_lightning.st.rows_fsdp import (
    accumulation_refresh_row,
    gather_orientation_row,
    hif8_gather_scales_row,
    recompute_refresh_row,
)
from lp_lightning.st.runner import RunResult
from lp_lightning.st.sections import skipped_step_checks
from lp_lightning.st.thresholds import BUILTIN_THRESHOLDS, Thresholds, precision_of_case
from lp_lightning.st.timing import steady_timing
from lp_lightning.st.verdict import (
    ROLES,
    ROW_TITLES,
    Check,
    Row,
    _finished,
    _kernel_checks,
    _no_fallback_checks,
    _replacement_checks,
    _training_checks,
    element_format,
    unit_roundoff,
)
from lp_lightning.tensor.storage import ALL_STORAGE_NAMES

if TYPE_CHECKING:
    from lp_lightning.plan import NeverReplaceRule

__all__ = ["Check", "Row", "ROW_TITLES", "element_format", "evaluate_rows", "steady_performance", "unit_roundoff"]


def bf16_baseline_row(runs: dict[str, RunResult], settings: STSettings) -> Row:
    """Design spec §17.2 Q3-01 (BF16 baseline): main/bf16 trains and saves a DCP checkpoint; resume/bf16
    resumes from it and trains."""
    row = Row("Q3-01")
    main, resume = runs.get("main/bf16"), runs.get("resume/bf16")
    if _finished(row, main, "main/bf16"):
        _training_checks(row, main, "main/bf16", settings.required_steps)
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
    """Design spec §17.2 Q3-02 / Q3-03 (MXFP8 / HiF8 end to end): the case trains, replaces every target,
    runs its GEMMs in low precision with no fallback, and records its scales; the step of ``probe/<case>`` made
    non-finite on purpose is skipped and refreshes no weight (design spec §16.6, :mod:`lp_lightning.st.sections`)."""
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
        skipped_step_checks(row, probe, case)
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


def model_boundary_row(
    runs: dict[str, RunResult],
    settings: STSettings,
    targets: dict[str, list[str]],
    never_replace: Sequence[NeverReplaceRule],
) -> Row:
    """Design spec §17.2 Q3-04 (model boundary): dense, shared, routed and explicit MLA modules hit; embedding,
    head, router, norms, core attention not (``never_replace``: the model adapter's rules)."""
    row = Row("Q3-04")
    never = tuple(never_replace)
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
        events = sum(len(fqns) for fqns in seen.values()) + no_weight
        row.check_compared(f"{case}: no low-precision GEMM on embedding, head, router or norms", events, not forbidden,
                           forbidden or "none", "none")
        row.check_compared(f"{case}: no low-precision GEMM without a weight (core attention)", events, no_weight == 0,
                           no_weight, 0)
        kernels = (probe.summary or {}).get("kernels") or {}
        elsewhere = kernels.get("high_precision_gemms_elsewhere")
        row.check(f"{case}: attention core, router and head ran in high precision", bool(elsewhere), elsewhere, "> 0")
    row.notes.append("Not-replaced modules come from the model adapter's never-replace rules: "
                     + "; ".join(f"{r.reason} ({', '.join(r.fqn_globs)})" for r in never) + ".")
    return row


def _checkpoint_checks(row: Row, path: Any, case: str, step: int) -> None:
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


def dcp_resume_row(
    runs: dict[str, RunResult], settings: STSettings, *, thresholds: Thresholds = BUILTIN_THRESHOLDS
) -> Row:
    """Design spec §17.2 Q3-09 (DCP resume): the checkpoint holds FP32 masters and moments only; the resumed
    state is bit-identical to the continuous run's and its first loss within ``u``
    (``thresholds`` ``resume_first_loss_rel``)."""
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
        state = "masters, moments" + (", 8-bit storage rebuilt from the FP32 master" if case != "bf16" else "")
        row.check(f"{case}: resumed state bit-identical to the continuous run after step {n} ({state})",
                  compared == settings.devices and not differences, differences[:5] or f"{compared} ranks",
                  "identical SHA-1 of every tensor")
        continuous = main.summary.get("losses", [])[n - main.summary.get("first_step", 0):]
        resumed = resume.summary.get("losses", [])
        key = f"resume_first_loss_rel.{precision_of_case(case)}"
        tol = thresholds.get(row, *key.split("."))
        if continuous and resumed:
            rel = abs(resumed[0] - continuous[0]) / abs(continuous[0])
            row.check(f"{case}: first resumed loss within tolerance", rel <= tol,
                      f"{resumed[0]:.6f} vs {continuous[0]:.6f} (rel {rel:.2e})", f"rel <= {tol:.2e} ({key})")
        else:
            row.check(f"{case}: first resumed loss within tolerance", False, "no losses", "losses of both runs")
        row.evidence[f"{case}.continuous_losses"] = continuous
        row.evidence[f"{case}.resumed_losses"] = resumed
        row.evidence[f"{case}.tolerance_rel"] = tol
    return row


def illegal_configurations_row(illegal: list[dict[str, Any]] | None) -> Row:
    """Design spec §17.2 Q3-10 (illegal configurations): every design spec §15 case fails at its expected stage."""
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
    summed training time; step time = mean (median also reported). The training time is the run
    summary's ``step_times_s``: each step's wall time less the non-training work inside it (digests,
    snapshots, checkpoint saves: :mod:`lp_lightning.telemetry.step_clock`), both shown beside it.
    """
    summary = run.summary or {}
    times = summary.get("step_times_s", [])[settings.warmup_steps:]
    steps = summary.get("steps") or 0
    if not times or not steps:
        return None
    tokens_per_step = summary.get("tokens", 0) / steps
    return {
        **steady_timing(summary, settings.warmup_steps),
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


def performance_ratio_row(
    runs: dict[str, RunResult], settings: STSettings, *, thresholds: Thresholds = BUILTIN_THRESHOLDS
) -> Row:
    """Design spec §17.2 Q3-11 (no performance regression): steady throughput and step-time ratios against bf16
    (not-applicable on the emulated backend; bounds: ``thresholds`` ``min_throughput_ratio``,
    ``max_step_time_ratio``)."""
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
                for name in ("bf16", case):  # a summary without the step clock timed digests and saves too
                    row.check(f"{name}: steady step times exclude non-training work", perf[name]["timing"] == "subtracted",
                              perf[name]["timing"], "subtracted")
                low, high = thresholds.get(row, "min_throughput_ratio"), thresholds.get(row, "max_step_time_ratio")
                row.check(f"{case}: throughput_ratio >= {low:g}", ratios["throughput_ratio"] >= low,
                          round(ratios["throughput_ratio"], 4), f">= {low:g}")
                row.check(f"{case}: step_time_ratio <= {high:g}", ratios["step_time_ratio"] <= high,
                          round(ratios["step_time_ratio"], 4), f"<= {high:g}")
    row.evidence["performance"] = perf
    row.notes.append("Step times are training times: each step's wall time less the non-training work inside it "
                     "(checkpoint saves, state digests, probe sampling: measured and subtracted; work between steps is "
                     "outside every window); the wall times and the subtracted seconds are in the evidence.")
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
    never_replace: Sequence[NeverReplaceRule],
    only: list[str] | None = None,
    thresholds: Thresholds = BUILTIN_THRESHOLDS,
) -> list[Row]:
    """The Q3 rows' verdicts, in order (``only``: these row ids; ``thresholds``: the tolerances of Q3-09 and
    Q3-11, :mod:`lp_lightning.st.thresholds`).

    ``targets`` and ``never_replace`` are the model adapter's target groups and never-replace rules
    (:meth:`~lp_lightning.models.adapter.ModelAdapter.target_groups`, ``never_replace``).

    With one process (``settings.devices`` 1) the FSDP rows (:data:`~lp_lightning.st.cases.FSDP_ROWS`)
    are ``not-applicable``, or ``fail`` when one of their checks fails.
    """
    rows = [
        bf16_baseline_row(runs, settings),
        _low_precision_row("Q3-02", "mxfp8", runs, settings, targets),
        _low_precision_row("Q3-03", "hif8_current", runs, settings, targets),
        model_boundary_row(runs, settings, targets, never_replace),
        gather_orientation_row(runs, settings, reshard_after_forward),
        hif8_gather_scales_row(runs, settings, reshard_after_forward),
        accumulation_refresh_row(runs, settings),
        recompute_refresh_row(runs, settings),
        dcp_resume_row(runs, settings, thresholds=thresholds),
        illegal_configurations_row(illegal),
        performance_ratio_row(runs, settings, thresholds=thresholds),
    ]
    if settings.devices < 2:
        for row in rows:
            if row.id in FSDP_ROWS:
                row.not_applicable = (f"{settings.devices} process (--devices {settings.devices}): FSDP2 shards nothing, "
                                      "so sharded gathers and refreshes cannot be judged; run with --devices >= 2")
    return [row for row in rows if only is None or row.id in only]
