"""Verdict logic of the Q3 rows on synthetic evidence (the real runs: tests/st/test_st_cli.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lp_lightning.st.cases import CASES, ROW_RUNS, STSettings, build_runs, case_by_name, runs_for_rows
from lp_lightning.st.rows import q3_07, q3_09, q3_10, q3_11, unit_roundoff
from lp_lightning.st.runner import RunResult, load_run, run_config

SETTINGS = STSettings(devices=2, warmup_steps=1, steady_steps=3, resume_steps=2, variant_steps=2, required_steps=3,
                       profile_steps=1)


def _run(name: str, folder: Path, summary: dict | None, probes: dict[str, list[dict]] | None = None) -> RunResult:
    kind, case = name.split("/")
    spec = next(s for s in build_runs(SETTINGS, reshard_after_forward=True) if s.name == name)
    assert spec.kind == kind and spec.case.name == case
    result = RunResult(spec, folder, exit_code=0, summary=summary)
    for kind_, ranks in (probes or {}).items():
        result.probes[kind_] = [{**data, "_rank": r} for r, data in enumerate(ranks)]
    return result


def _refresh(micro: int = 0, max_per_weight: int = 1) -> dict:
    steps = [{"step": s, "refreshes": 4, "weights": 4, "max_per_weight": max_per_weight, "skipped": False}
             for s in (1, 2)]
    return {"micro_batches_per_step": 2, "micro_step_refreshes": micro, "forward_backward_refreshes": 0,
            "low_precision_weights": 4, "per_step": steps}


def _summary(losses=(3.0, 2.9), first_step=0, **extra) -> dict:
    return {"steps": len(losses), "losses": list(losses), "grad_norms": [1.0] * len(losses), "first_step": first_step,
            "loss_first": losses[0], "loss_last_mean": sum(losses) / len(losses), **extra}


def test_settings_and_matrix():
    assert SETTINGS.steps == 4 and SETTINGS.save_step == 2
    names = [s.name for s in build_runs(SETTINGS, reshard_after_forward=True)]
    assert names.index("main/mxfp8") < names.index("resume/mxfp8")
    assert {n.split("/")[0] for n in names} == {"main", "resume", "probe", "reshard", "recompute", "accum"}
    assert "probe/bf16" not in names and "accum/bf16" not in names
    assert runs_for_rows(["Q3-09"]) >= {"main/bf16", "resume/hif8_current"}
    assert set(ROW_RUNS) == {f"Q3-{i:02d}" for i in range(1, 12)}
    with pytest.raises(ValueError, match="Q3-12"):
        runs_for_rows(["Q3-12"])
    with pytest.raises(ValueError, match="accumulation=1"):
        STSettings(accumulation=1)
    with pytest.raises(ValueError, match="unknown ST case 'fp8'"):
        case_by_name("fp8")


def test_run_config_sets_the_variant_on_top_of_the_user_yaml(tmp_path):
    spec = next(s for s in build_runs(SETTINGS, reshard_after_forward=True) if s.name == "reshard/hif8_current")
    config = run_config(spec, tmp_path, SETTINGS)
    assert config["precision"] == "hif8" and config["low_precision"] is None
    assert config["fsdp_config"]["reshard_after_forward"] is False
    assert config["trainer"]["devices"] == 2 and config["trainer"]["default_root_dir"] == str(tmp_path)
    assert all(c["init_args"]["out_dir"] == str(tmp_path / "probes") for c in config["trainer"]["callbacks"])


def test_load_run_reads_summary_and_per_rank_probe_files(tmp_path):
    (tmp_path / "probes").mkdir()
    (tmp_path / "run_summary.json").write_text(json.dumps(_summary()))
    for rank in (1, 0):
        (tmp_path / "probes" / f"refresh_rank{rank}.json").write_text(json.dumps({"rank": rank}))
    spec = build_runs(SETTINGS, reshard_after_forward=True)[0]
    run = load_run(spec, tmp_path, exit_code=0)
    assert run.ok and [d["rank"] for d in run.probe("refresh")] == [0, 1]


def test_q3_07_fails_on_a_micro_step_refresh(tmp_path):
    good = {f"accum/{c}": _run(f"accum/{c}", tmp_path, _summary(), {"refresh": [_refresh(), _refresh()]})
            for c in ("mxfp8", "hif8_current")}
    assert q3_07(good, SETTINGS).verdict == "pass"
    bad = dict(good)
    bad["accum/hif8_current"] = _run("accum/hif8_current", tmp_path, _summary(), {"refresh": [_refresh(micro=4), _refresh()]})
    row = q3_07(bad, SETTINGS)
    assert row.verdict == "fail"
    assert [c.name for c in row.checks if not c.ok] == ["accum/hif8_current rank 0: no refresh on a micro-step"]


def test_q3_07_fails_when_a_run_is_missing_or_failed(tmp_path):
    runs = {"accum/mxfp8": _run("accum/mxfp8", tmp_path, _summary(), {"refresh": [_refresh()]})}
    runs["accum/mxfp8"].exit_code = 1
    runs["accum/mxfp8"].error = "exit status 1; boom"
    row = q3_07(runs, SETTINGS)
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
        runs[f"main/{case.name}"] = _run(f"main/{case.name}", tmp_path / case.name, _summary((3.0, 2.9, 2.8, 2.7)),
                                         {"digest": main_digests})
        runs[f"resume/{case.name}"] = _run(f"resume/{case.name}", tmp_path / "r", _summary((loss, 2.7), first_step=2),
                                           {"digest": resume_digests})
    return runs


def test_q3_09_needs_bit_identical_state_not_only_a_close_loss(tmp_path, monkeypatch):
    import lp_lightning.st.rows as rows

    monkeypatch.setattr(rows, "_checkpoint_checks", lambda row, path, case, step: row.check("ckpt", True, 0, 0))
    assert q3_09(_q3_09_runs(tmp_path, "s", 2.8), SETTINGS).verdict == "pass"
    row = q3_09(_q3_09_runs(tmp_path, "rebuilt-from-bf16", 2.8), SETTINGS)  # the loss agrees, the storage does not
    failed = [c for c in row.checks if not c.ok]
    assert row.verdict == "fail" and len(failed) == 1 and "bit-identical" in failed[0].name
    assert "model.w (8-bit storage)" in failed[0].observed[0]
    row = q3_09(_q3_09_runs(tmp_path, "s", 2.8 * (1 + 2 * unit_roundoff("mxfp8"))), SETTINGS)
    assert [c.name for c in row.checks if not c.ok] == ["mxfp8: first resumed loss within tolerance"]


def test_unit_roundoff_comes_from_the_formats():
    assert unit_roundoff("bf16") == 2**-8
    assert unit_roundoff("mxfp8") == unit_roundoff("hif8_current") == 2**-4


def test_q3_10_fails_on_one_case():
    ok = {"id": "a", "section15_row": "parallel", "expected_stage": "parse", "observed_stage": "parse",
          "exit_code": 2, "must_mention": ["tensor_parallel_size"], "mentions_ok": True, "pass": True}
    assert q3_10([ok]).verdict == "pass"
    assert q3_10([ok, {**ok, "id": "b", "pass": False, "observed_stage": "after model build"}]).verdict == "fail"
    assert q3_10(None).verdict == "fail"


def test_q3_11_is_not_applicable_on_the_emulated_backend_and_judged_on_npu(tmp_path):
    def main(case: str, seconds: float, backend: str) -> RunResult:
        times = [9.0] + [seconds] * 3
        return _run(f"main/{case}", tmp_path, _summary((3.0,) * 4, step_times_s=times, tokens=4000, backend=backend))

    runs = {"main/bf16": main("bf16", 1.0, "none"), "main/mxfp8": main("mxfp8", 1.5, "emulated"),
            "main/hif8_current": main("hif8_current", 1.2, "emulated")}
    row = q3_11(runs, SETTINGS)
    assert row.verdict == "not-applicable" and "emulation's cost" in row.not_applicable
    perf = row.evidence["performance"]
    assert perf["mxfp8"]["step_time_ratio"] == pytest.approx(1.5) and perf["mxfp8"]["throughput_ratio"] == pytest.approx(1 / 1.5)
    assert perf["bf16"]["warmup_steps_excluded"] == 1 and perf["bf16"]["steady_steps"] == 3
    runs["main/mxfp8"] = main("mxfp8", 0.9, "npu")
    runs["main/hif8_current"] = main("hif8_current", 1.2, "npu")
    row = q3_11(runs, SETTINGS)
    assert row.verdict == "fail"
    assert {c.name for c in row.checks if not c.ok} == {"hif8_current: throughput_ratio >= 1",
                                                         "hif8_current: step_time_ratio <= 1"}
