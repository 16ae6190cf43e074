"""The rows' skipped-step and recompute checks and the report sections, on synthetic runs (``lp_lightning.st.sections``).

A fresh ``lp-lightning st --reduced`` shows the same sections from real runs
(``tests/st/test_broken_builds.py::test_correct_build_passes``).
"""

from __future__ import annotations

from lp_lightning.st.rows import Row
from lp_lightning.st.sections import (
    recompute_equality_checks,
    report_sections,
    sections_markdown,
    skipped_step_checks,
)

from ._synthetic import SETTINGS, run_result, summary


def _refresh(skipped_refreshes: int = 0) -> dict:
    steps = [{"step": s, "refreshes": 4 if s != 2 else skipped_refreshes, "weights": 4 if s != 2 else 0,
              "max_per_weight": 1 if s != 2 else min(skipped_refreshes, 1), "skipped": s == 2} for s in (1, 2, 3)]
    return {"low_precision_weights": 4, "per_step": steps, "forward_backward_refreshes": 0}


def _probe(tmp_path, skipped_refreshes: int = 0):
    inject = {"at_step": 2, "injected": [{"step": 2, "fqn": "model.layers.0.mlp.gate_proj.weight", "rank": 0,
                                          "value": "inf", "index": 0}]}
    skips = {"skips": [{"step": 2, "reason": "non-finite gradient", "fqn": "model.layers.0.mlp.gate_proj.weight"}]}
    return run_result("probe/mxfp8", tmp_path / "probe", summary((3.0, 2.9, 2.8), nonfinite=skips),
                      {"inject": [inject, {"at_step": 2, "injected": []}],
                       "refresh": [_refresh(skipped_refreshes), _refresh(skipped_refreshes)]})


def test_the_skipped_step_refreshes_nothing_and_the_others_each_weight_once(tmp_path):
    row = Row("Q3-02")
    evidence = skipped_step_checks(row, _probe(tmp_path), "mxfp8")
    assert [c.ok for c in row.checks] == [True, True] and len(evidence["per_step"]) == 6
    bad = Row("Q3-02")
    skipped_step_checks(bad, _probe(tmp_path, skipped_refreshes=4), "mxfp8")  # a refresh on the skipped step
    failed = [c for c in bad.checks if not c.ok]
    assert len(failed) == 1 and "rank 0 step 2: skipped True, refreshes 4" in failed[0].observed[0]


def _gemms(steps: int, fprop: int) -> dict:
    counts = {f"{kind}_{role}|mxfp8_e4m3|emulated": (fprop if role == "fprop" else 21 if kind == "dense" else 2) * steps
              for kind in ("dense", "grouped") for role in ("fprop", "dgrad", "wgrad")}
    return {"counts": counts}


def _variant(tmp_path, name: str, losses, fprop: int, grad_bits: int = 7):
    steps = len(losses)
    prints = {"per_step": [{"step": s + 1, "grads": {"model.layers.0.mlp.gate_proj.weight": [grad_bits * (s + 1), 3]}}
                           for s in range(steps)]}
    resident = {"parameters": {"count": 39, "low_precision_weights": 25, "low_precision_storage_tensors": 100,
                               "low_precision_storage_bytes": 5702400}}
    probes = {"gemm_trace": [_gemms(steps, fprop)], "refresh": [{"per_step": [
        {"step": s + 1, "refreshes": 25, "max_per_weight": 1} for s in range(steps)]}],
        "gather_trace": [{"per_step": [{"step": s + 1, "pre": 50} for s in range(steps)]}], "resident": [resident],
        "grad_fingerprint": [prints]}
    return run_result(name, tmp_path / name, summary(tuple(losses)), probes)


def test_recompute_matches_off_bitwise_with_fprop_doubled_and_names_the_first_difference(tmp_path):
    off = _variant(tmp_path, "main/mxfp8", (3.0, 2.9, 2.8, 2.7), fprop=21)
    row = Row("Q3-08")
    recompute_equality_checks(row, _variant(tmp_path, "recompute/mxfp8", (3.0, 2.9), fprop=42), off, "mxfp8", SETTINGS)
    assert all(c.ok for c in row.checks) and len(row.checks) == 7, [c for c in row.checks if not c.ok]
    assert row.evidence["mxfp8.recompute_vs_off"]["steps_compared"] == 2
    row = Row("Q3-08")
    recompute_equality_checks(row, _variant(tmp_path, "recompute/mxfp8", (3.0, 2.95), fprop=21, grad_bits=8), off,
                              "mxfp8", SETTINGS)
    failed = {c.name.split(": ", 1)[1]: c.observed for c in row.checks if not c.ok}
    assert failed.pop("gradients bitwise equal (FP32 sum and max |g| of every gradient shard)") == [
        "rank 0 step 1: model.layers.0.mlp.gate_proj.weight", "rank 0 step 2: model.layers.0.mlp.gate_proj.weight"]
    assert set(failed) == {"losses bitwise equal (same kernels replayed)",
                           "GEMMs per role per step (fprop: forward + recompute; dgrad, wgrad: as off)"}
    assert failed["losses bitwise equal (same kernels replayed)"] == "step 2: 2.95 vs 2.9"


def _main(tmp_path, case: str, low_precision: list[str], packages: list[str], storage: int):
    resident = {"modules": {"top_level": packages, "distributions": packages, "generated_top_level": 0,
                            "lp_lightning": ["lp_lightning"], "low_precision": low_precision},
                "parameters": {"count": 39, "by_class": {"Tensor": 39}, "low_precision_weights": 25 if storage else 0,
                               "low_precision_storage_bytes": storage}}
    return run_result(f"main/{case}", tmp_path / case,
                      summary((3.0, 2.9, 2.8, 2.7), step_times_s=[1.0, 1.0, 2.0, 2.0], backend="emulated"),
                      {"resident": [resident]})


def test_low_precision_off_and_the_limitations_sections(tmp_path):
    runs = {"main/bf16": _main(tmp_path, "bf16", [], ["lightning", "torch"], 0),
            "main/mxfp8": _main(tmp_path, "mxfp8", ["lp_lightning.ops.api"], ["lightning", "torch", "triton"], 2**20)}
    na = Row("Q3-11", not_applicable="emulated backend")
    na.check("x", True, 1, 1)
    failing = Row("Q3-07")
    failing.check("accum/mxfp8 rank 0: no refresh on a micro-step", False, 3, 0)
    sections = report_sections([na, failing], [], runs, SETTINGS)
    off = sections["low_precision_off"]
    assert off["bf16"]["low_precision_modules"] == [] and off["mxfp8"]["extra_distributions"] == ["triton"]
    assert off["mxfp8"]["step_time_ratio_to_bf16"] == 1.0
    lim = sections["limitations"]
    assert len(lim["open_questions"]) == 7 and lim["open_questions"][0].startswith("1. The exact HR")
    assert lim["not_applicable"] == [{"row": "Q3-11", "title": "No performance regression", "why": "emulated backend"}]
    assert lim["failing_rows"][0]["row"] == "Q3-07"
    md = "\n".join(sections_markdown(sections))
    for heading in ("## Skipped step", "## Recompute off vs full", "## Q3-05 backward gathers",
                    "## Low precision off vs BF16 (design spec §17.4)",
                    "## Known limitations and deviations from the spec (design spec §17.5)"):
        assert heading in md, heading
    assert "bf16 (low precision off): 0 low-precision modules imported and no 8-bit weight resident" in md
    assert "Not shown: it needs Q3-02/Q3-03" in md  # a section without its runs says what it needs
