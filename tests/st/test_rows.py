"""Verdict logic of the Q3 rows on synthetic evidence (the real runs: tests/st/test_st_cli.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lp_lightning.st.cases import CASES, FSDP_ROWS, ROW_RUNS, STSettings, build_runs, case_by_name, runs_for_rows
from lp_lightning.st.rows import (
    Row,
    accumulation_refresh_row,
    dcp_resume_row,
    evaluate_rows,
    hif8_gather_scales_row,
    illegal_configurations_row,
    performance_ratio_row,
    unit_roundoff,
)
from lp_lightning.st.runner import RunResult, load_run, run_config

from ._synthetic import SETTINGS, refresh, run_result, summary


def test_settings_and_matrix():
    assert SETTINGS.steps == 4 and SETTINGS.save_step == 2
    names = [s.name for s in build_runs(SETTINGS, reshard_after_forward=True)]
    assert names.index("main/mxfp8") < names.index("resume/mxfp8")
    assert {n.split("/")[0] for n in names} == {"main", "resume", "probe", "reshard", "recompute", "accum"}
    assert "probe/bf16" not in names and "accum/bf16" not in names
    assert runs_for_rows(["Q3-09"]) >= {"main/bf16", "resume/hif8_current"}
    assert set(ROW_RUNS) == {f"Q3-{i:02d}" for i in range(1, 12)} | {"conformance", "parity"}  # parity: opt-in
    with pytest.raises(ValueError, match="Q3-12"):
        runs_for_rows(["Q3-12"])
    with pytest.raises(ValueError, match="accumulation=1"):
        STSettings(accumulation=1)
    with pytest.raises(ValueError) as every:  # all bad step options in one error, one line each
        STSettings(accumulation=1, variant_steps=0, devices=0, required_steps=3)
    assert [line.split(" ")[0].split("=")[0] for line in str(every.value).splitlines()] == [
        "--required_steps", "accumulation", "--variant_steps", "--devices"]
    with pytest.raises(ValueError, match="unknown ST case 'fp8'"):
        case_by_name("fp8")


def test_run_config_sets_the_variant_on_top_of_the_user_yaml(tmp_path):
    spec = next(s for s in build_runs(SETTINGS, reshard_after_forward=True) if s.name == "reshard/hif8_current")
    config = run_config(spec, tmp_path, SETTINGS)
    assert config["precision"] == "hif8" and config["low_precision"] is None
    assert config["fsdp_config"]["reshard_after_forward"] is False
    assert config["trainer"]["devices"] == 2 and config["trainer"]["default_root_dir"] == str(tmp_path)
    assert config["run_summary"] == {"wire": True}  # the rows read the opt-in wire section
    assert all(c["init_args"]["out_dir"] == str(tmp_path / "probes") for c in config["trainer"]["callbacks"])


def test_load_run_reads_summary_and_per_rank_probe_files(tmp_path):
    (tmp_path / "probes").mkdir()
    (tmp_path / "run_summary.json").write_text(json.dumps(summary()))
    for rank in (1, 0):
        (tmp_path / "probes" / f"refresh_rank{rank}.json").write_text(json.dumps({"rank": rank}))
    spec = build_runs(SETTINGS, reshard_after_forward=True)[0]
    run = load_run(spec, tmp_path, exit_code=0)
    assert run.ok and [d["rank"] for d in run.probe("refresh")] == [0, 1]


def test_q3_07_fails_on_a_micro_step_refresh(tmp_path):
    good = {f"accum/{c}": run_result(f"accum/{c}", tmp_path, summary(), {"refresh": [refresh(), refresh()]})
            for c in ("mxfp8", "hif8_current")}
    assert accumulation_refresh_row(good, SETTINGS).verdict == "pass"
    bad = dict(good)
    bad["accum/hif8_current"] = run_result("accum/hif8_current", tmp_path, summary(),
                                           {"refresh": [refresh(micro=4), refresh()]})
    row = accumulation_refresh_row(bad, SETTINGS)
    assert row.verdict == "fail"
    assert [c.name for c in row.checks if not c.ok] == ["accum/hif8_current rank 0: no refresh on a micro-step"]


def test_one_process_makes_the_fsdp_rows_not_applicable_unless_a_check_fails(tmp_path):
    one = dataclasses.replace(SETTINGS, devices=1)
    good = {f"accum/{c}": run_result(f"accum/{c}", tmp_path, summary(), {"refresh": [refresh()]}, settings=one)
            for c in ("mxfp8", "hif8_current")}
    kwargs = {"illegal": None, "reshard_after_forward": True, "targets": {}, "never_replace": ()}
    (row,) = evaluate_rows(good, one, only=["Q3-07"], **kwargs)
    assert row.verdict == "not-applicable" and "--devices 1" in row.not_applicable and "shards nothing" in row.not_applicable
    assert all(c.ok for c in row.checks)
    (row,) = evaluate_rows(good, SETTINGS, only=["Q3-07"], **kwargs)  # two ranks: judged
    assert row.verdict == "pass" and row.not_applicable is None
    bad = {**good, "accum/mxfp8": run_result("accum/mxfp8", tmp_path, summary(), {"refresh": [refresh(micro=4)]},
                                             settings=one)}
    rows = {r.id: r for r in evaluate_rows(bad, one, **kwargs)}
    assert rows["Q3-07"].verdict == "fail"  # a failing check still fails the row
    assert {i for i, r in rows.items() if r.not_applicable and "--devices 1" in r.not_applicable} == set(FSDP_ROWS)
    assert rows["Q3-09"].not_applicable is None and rows["Q3-01"].not_applicable is None


def test_a_check_that_compared_nothing_never_says_yes():
    row = Row("Q3-06")
    assert not row.check_compared("pairs equal", 0, True, "0 pairs", "equal")
    assert row.verdict == "fail" and row.checks[0].observed.startswith("nothing compared")
    row = Row("Q3-06")
    assert row.check_compared("pairs equal", 0, True, "0 pairs", "equal", if_none="one gather serves both")
    assert row.checks[0].not_applicable == "one gather serves both" and row.verdict == "not-applicable"
    row.check("something else", True, 1, 1)
    assert row.verdict == "pass"  # one judged check, one not applicable
    assert Row("Q3-06").verdict == "fail"  # no check at all


def test_q3_06_without_forward_backward_pairs(tmp_path):
    """reshard_after_forward=false: one gather serves both passes, so the SHA-1 pair check is n/a, not "yes"."""
    posts = [{"stage": "post_all_gather", "step": 1, "fqn": "model.l.w", "phase": "forward", "logical_shape": [4, 4],
              "logical_dtype": "torch.bfloat16", "tensors": [["data", "uint8", [4, 4]], ["scale", "float32", []]],
              "scale_values": 1.0, "sha1": "a"}]
    pres = [{"stage": "pre_all_gather", "step": 1, "fqn": "model.l.w", "phase": "forward", "orientations": ["row"],
             "tensors": [["data", "uint8", [2, 4]]], "bytes": 8}]
    traces = {"gather_trace": [{"events": posts + pres}] * 2}
    runs = {}
    for name, flag in (("probe/hif8_current", True), ("reshard/hif8_current", False)):
        extra = {"sharding": {"reshard_after_forward": flag}, "wire": {"high_precision_gathers_of_replaced": 0},
                 "replacement": {"replaced": [{"fqn": "model.l"}]}}
        runs[name] = run_result(name, tmp_path, summary(**extra), traces)
    row = hif8_gather_scales_row(runs, SETTINGS, True)
    pairs = {c.name.split(":")[0]: c for c in row.checks if "forward and backward" in c.name}
    assert not pairs["probe/hif8_current"].ok  # reshard=true must have forward/backward pairs
    assert pairs["reshard/hif8_current"].ok and "one gather serves" in pairs["reshard/hif8_current"].not_applicable


def test_q3_07_fails_when_a_run_is_missing_or_failed(tmp_path):
    runs = {"accum/mxfp8": run_result("accum/mxfp8", tmp_path, summary(), {"refresh": [refresh()]})}
    runs["accum/mxfp8"].exit_code = 1
    runs["accum/mxfp8"].error = "exit status 1; boom"
    row = accumulation_refresh_row(runs, SETTINGS)
    assert row.verdict == "fail"
    assert {c.name for c in row.checks} == {"accum/mxfp8 finished", "accum/hif8_current ran"}


def _digest(sha: str = "a", storage: str = "s") -> dict:
    return {"params": {"model.w": {"dtype": "float32", "shape": [2], "sha1": sha, "storage": {"data": storage}}},
            "optimizer": {"model.w": {"exp_avg": {"dtype": "float32", "sha1": "m"}, "step": {"dtype": "float32", "sha1": "t"}}}}


def _q3_09_runs(tmp_path: Path, resumed_storage: str, resumed_loss: float) -> dict[str, RunResult]:
    runs = {}
    for case in CASES:
        main_digests = [{"snapshots": [{"when": "after_step", "global_step": 2, **_digest()}]}] * 2
        storage = resumed_storage if case.name == "mxfp8" else "s"
        resume_digests = [{"snapshots": [{"when": "train_start", "global_step": 2, **_digest(storage=storage)}]}] * 2
        loss = resumed_loss if case.name == "mxfp8" else 2.8
        runs[f"main/{case.name}"] = run_result(f"main/{case.name}", tmp_path / case.name, summary((3.0, 2.9, 2.8, 2.7)),
                                         {"digest": main_digests})
        runs[f"resume/{case.name}"] = run_result(f"resume/{case.name}", tmp_path / "r", summary((loss, 2.7), first_step=2),
                                           {"digest": resume_digests})
    return runs


def test_q3_09_needs_bit_identical_state_not_only_a_close_loss(tmp_path, monkeypatch):
    import lp_lightning.st.rows as rows

    monkeypatch.setattr(rows, "_checkpoint_checks", lambda row, path, case, step: row.check("ckpt", True, 0, 0))
    assert dcp_resume_row(_q3_09_runs(tmp_path, "s", 2.8), SETTINGS).verdict == "pass"
    checks = dcp_resume_row(_q3_09_runs(tmp_path, "s", 2.8), SETTINGS).checks
    names = [c.name for c in checks if "bit-identical" in c.name]
    assert [n.split(":")[0] for n in names] == ["bf16", "mxfp8", "hif8_current"]
    assert "8-bit" not in names[0] and "8-bit storage" in names[1]  # bf16 has no 8-bit storage
    # the loss agrees, the storage does not
    row = dcp_resume_row(_q3_09_runs(tmp_path, "rebuilt-from-bf16", 2.8), SETTINGS)
    failed = [c for c in row.checks if not c.ok]
    assert row.verdict == "fail" and len(failed) == 1 and "bit-identical" in failed[0].name
    assert "model.w (8-bit storage)" in failed[0].observed[0]
    row = dcp_resume_row(_q3_09_runs(tmp_path, "s", 2.8 * (1 + 2 * unit_roundoff("mxfp8"))), SETTINGS)
    assert [c.name for c in row.checks if not c.ok] == ["mxfp8: first resumed loss within tolerance"]


def test_unit_roundoff_comes_from_the_formats():
    assert unit_roundoff("bf16") == 2**-8
    assert unit_roundoff("mxfp8") == unit_roundoff("hif8_current") == 2**-4


def test_q3_10_fails_on_one_case():
    ok = {"id": "a", "section15_row": "parallel", "expected_stage": "parse", "observed_stage": "parse",
          "exit_code": 2, "must_mention": ["tensor_parallel_size"], "mentions_ok": True, "pass": True}
    assert illegal_configurations_row([ok]).verdict == "pass"
    failed = {**ok, "id": "b", "pass": False, "observed_stage": "after model build"}
    assert illegal_configurations_row([ok, failed]).verdict == "fail"
    assert illegal_configurations_row(None).verdict == "fail"


def test_q3_11_is_not_applicable_on_the_emulated_backend_and_judged_on_npu(tmp_path):
    def main(case: str, seconds: float, backend: str, clock: bool = True) -> RunResult:
        times = [9.0] + [seconds] * 3
        # The step clock's record: a 0.5 s digest inside step 3, subtracted from its training time.
        timed = {"step_wall_times_s": [9.0, seconds, seconds + 0.5, seconds], "non_training_s": [0.0, 0.0, 0.5, 0.0],
                 "non_training": {"timing": "subtracted", "inside_steps_s": {"state_digest": 0.5},
                                  "outside_steps_s": {"checkpoint_save": 2.0}}} if clock else {}
        return run_result(f"main/{case}", tmp_path, summary((3.0,) * 4, step_times_s=times, tokens=4000, backend=backend,
                                                            **timed))

    runs = {"main/bf16": main("bf16", 1.0, "none"), "main/mxfp8": main("mxfp8", 1.5, "emulated"),
            "main/hif8_current": main("hif8_current", 1.2, "emulated")}
    row = performance_ratio_row(runs, SETTINGS)
    assert row.verdict == "not-applicable" and "emulation's cost" in row.not_applicable
    perf = row.evidence["performance"]
    assert perf["mxfp8"]["step_time_ratio"] == pytest.approx(1.5) and perf["mxfp8"]["throughput_ratio"] == pytest.approx(1 / 1.5)
    assert perf["bf16"]["warmup_steps_excluded"] == 1 and perf["bf16"]["steady_steps"] == 3
    # The steady figures show what the training time left out, and where.
    assert perf["mxfp8"]["step_time_s_mean"] == pytest.approx(1.5)
    assert perf["mxfp8"]["step_wall_time_s_mean"] == pytest.approx(1.5 + 0.5 / 3)
    assert (perf["mxfp8"]["non_training_s_steady"], perf["mxfp8"]["non_training_steps"]) == (0.5, [3])
    assert perf["mxfp8"]["non_training_outside_s"] == {"checkpoint_save": 2.0}
    runs["main/mxfp8"] = main("mxfp8", 0.9, "npu")
    runs["main/hif8_current"] = main("hif8_current", 1.2, "npu")
    row = performance_ratio_row(runs, SETTINGS)
    assert row.verdict == "fail"
    assert {c.name for c in row.checks if not c.ok} == {"hif8_current: throughput_ratio >= 1",
                                                         "hif8_current: step_time_ratio <= 1"}
    # A summary without the step clock's record timed its digests and saves as training: not accepted.
    runs["main/mxfp8"] = main("mxfp8", 0.9, "npu", clock=False)
    failed = {c.name for c in performance_ratio_row(runs, SETTINGS).checks if not c.ok}
    assert "mxfp8: steady step times exclude non-training work" in failed
