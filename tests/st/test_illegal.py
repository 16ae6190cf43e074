"""Q3-10 (design spec §17.2): the illegal-configuration table of ``lp_lightning.st.illegal``.

The table must cover every row of the §15 limit matrix (read from docs/design.md); the verdict
(:func:`judge`) is tested on synthetic observations, including the ways a case must fail (wrong
stage, a message that does not name the key, an accepted value, a wrong exit status, a timeout);
one case per stage runs for real in forked children, one through the ``python -m`` child with a
deliberately wrong expected stage; the whole table (plus a legal config, which must be reported as
accepted) is the slow test.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from lp_lightning.cli import main
from lp_lightning.st.illegal import judge, observed_stage, run_illegal_cases
from lp_lightning.st.illegal_cases import ILLEGAL_CASES, SECTION15_ROWS, STAGES, IllegalCase

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"
CASES = {case.id: case for case in ILLEGAL_CASES}


def _limit_matrix_rows() -> dict[str, str]:
    """``dimension -> stage`` of the §15 "Full limit matrix" table in docs/design.md."""
    section = DESIGN.read_text().split("## §15 Constraints and failure rules", 1)[1].split("\n## ", 1)[0]
    table = section.split("| dimension | supported in Q3 | stage |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split("|")[1:-1] for line in table.strip().splitlines()[2:]]  # after the header's end and |---|
    return {cells[0].strip(): cells[2].strip() for cells in rows}


def test_the_table_covers_every_section15_row_with_a_failure_rule():
    matrix = _limit_matrix_rows()
    assert set(matrix) == {*SECTION15_ROWS, "compile / fusion"}  # compile/fusion: "outside the Q3 handover"
    assert {case.section15_row for case in ILLEGAL_CASES} == set(SECTION15_ROWS)
    assert len(CASES) == len(ILLEGAL_CASES)  # unique ids
    for case in ILLEGAL_CASES:
        assert case.expected_stage in STAGES[:-2] and case.must_mention, case.id  # never "training"/"completed"
        assert case.spec_stage == matrix[case.section15_row], case.id
    # The sub-cases docs/design.md §15 and the issue name.
    assert {"hif8-delayed", "hif8-delayed-yaml", "mxfp8-current", "hif8-mx_block"} <= set(CASES)
    assert {"targets-zero-hits", "targets-wrong-type", "targets-wildcard", "targets-zero-hits-trainer"} <= set(CASES)
    assert {"tp-2", "cp-2", "ep-2", "pp-2", "comm-fusion", "checkpoint-not-dcp"} <= set(CASES)
    assert {"shard-illegal-no-fallback", "accelerator-npu-without-torch_npu"} <= set(CASES)
    assert {"optimizer-sgd-trainer", "optimizer-sgd-fabric", "optimizer-bf16-moments-fabric"} <= set(CASES)
    assert {"peft-lora-wrapper", "custom-linear-subclass", "recompute-selective", "backend-npu-on-cpu"} <= set(CASES)
    assert CASES["hif8-delayed"].must_mention[-1] == "HiF8 delayed scaling is not supported"


# ------------------------------------------------------------------------------------------------
# The verdict, on synthetic observations
# ------------------------------------------------------------------------------------------------

LAUNCH_COMPILE = [["launch_check", "raised ValueError"], ["meta_model_build", "entered"],
                  ["plan_compile", "raised ValueError"]]
TRAINER_RUN = [["instantiate_classes", "entered"], ["startup_gate", "entered"], ["model_build", "entered"],
               ["plan_apply", "entered"], ["fully_shard", "entered"], ["optimizer_check", "raised TypeError"]]


@pytest.mark.parametrize(
    ("events", "exit_code", "stage"),
    [
        ([], 2, "parse"),
        (LAUNCH_COMPILE, 2, "launch"),  # the plan compiled at launch on the meta model is not the plan stage
        ([["launch_check", "entered"], ["instantiate_classes", "entered"],
          ["startup_gate", "raised StartupGateError"]], 1, "startup_gate"),
        (TRAINER_RUN[:3], 1, "model_build"),
        (TRAINER_RUN[:4], 1, "plan_compile"),
        (TRAINER_RUN[:5], 1, "sharding"),
        (TRAINER_RUN, 1, "optimizer_construction"),
        ([*TRAINER_RUN[:5], ["training_step", "entered"]], 1, "training"),
        (TRAINER_RUN, 0, "completed"),
    ],
)
def test_observed_stage_is_the_furthest_stage_entered(events, exit_code, stage):
    assert observed_stage(events, exit_code) == stage


def _observation(**fields):
    return {"exit_code": 2, "events": [], "message": "", "error_type": None, **fields}


def test_judge_passes_a_case_that_fails_where_and_how_it_must():
    case = CASES["comm-fusion"]
    message = ("fsdp_config.comm_fusion=true is not supported (design spec §15: FSDP communication\n  fusion fails at "
               "startup); set `comm_fusion: false`.")  # fmt: skip
    verdict = judge(case, _observation(message=message))
    assert verdict == {"observed_stage": "parse", "message": " ".join(message.split()), "mentions_ok": True,
                       "pass": True, "problems": []}  # fmt: skip


_NAMED = "fsdp_config.comm_fusion=true is not supported; set `comm_fusion: false`."


@pytest.mark.parametrize(
    ("observation", "problem", "mentions_ok"),
    [
        (_observation(message="fsdp_config.comm_fusion=true is not supported."),  # the fix is not named
         "the message does not name ['set `comm_fusion: false`']", False),
        (_observation(events=[["launch_check", "raised ValueError"]], message=_NAMED),
         "failed at stage 'launch', expected 'parse'", True),
        (_observation(exit_code=0, events=TRAINER_RUN[:5] + [["training_step", "entered"]]),
         "the run did not fail: the illegal value was accepted", False),
        (_observation(exit_code=1, message=_NAMED), "exit status 1, expected 2", True),
        (_observation(exit_code=2), "no error message", False),
        ({"exit_code": None, "problem": "no exit within 5 s"}, "no exit within 5 s", False),
        ({"exit_code": 1, "problem": "the child printed no observation; stderr: ..."}, "printed no observation", False),
    ],
    ids=["message-lacks-the-fix", "wrong-stage", "accepted", "wrong-exit-status", "no-message", "timeout", "crashed"],
)
def test_judge_fails_a_weakened_check(observation, problem, mentions_ok):
    verdict = judge(CASES["comm-fusion"], observation)
    assert verdict["pass"] is False and any(problem in p for p in verdict["problems"]), verdict["problems"]
    assert verdict["mentions_ok"] is mentions_ok


# ------------------------------------------------------------------------------------------------
# Real children
# ------------------------------------------------------------------------------------------------

ONE_PER_STAGE = ("comm-fusion", "targets-zero-hits", "backend-npu-on-cpu", "model-spec-mismatch", "peft-lora-wrapper",
                 "optimizer-sgd-fabric")  # fmt: skip


def test_one_case_per_stage_fails_at_its_stage_in_a_forked_child(tmp_path):
    wrong_word = dataclasses.replace(CASES["tp-2"], must_mention=("fsdp_config.tensor_parallel_size=2", "Megatron"))
    results = run_illegal_cases(tmp_path, cases=[*ONE_PER_STAGE, wrong_word], timeout_s=240, fit_main=main)
    by_id = {r["id"]: r for r in results[:-1]}
    assert {r["observed_stage"] for r in by_id.values()} == {
        "parse", "launch", "startup_gate", "model_build", "plan_compile", "optimizer_construction"
    }  # fmt: skip
    for result in by_id.values():
        assert result["pass"] is True, result
        assert result["observed_stage"] == result["expected_stage"] and result["mentions_ok"]
        assert not any(name == "training_step" for name, _ in result["events"])
    assert by_id["comm-fusion"]["events"] == [] and by_id["comm-fusion"]["exit_code"] == 2
    assert by_id["comm-fusion"]["command"].startswith("lp-lightning fit --fsdp_config.comm_fusion true ")
    assert ["launch_check", "raised ValueError"] in by_id["targets-zero-hits"]["events"]
    assert ["startup_gate", "raised StartupGateError"] in by_id["backend-npu-on-cpu"]["events"]
    assert ["model_build", "raised SpecValidationError"] in by_id["model-spec-mismatch"]["events"]
    peft = by_id["peft-lora-wrapper"]
    assert ["plan_apply", "raised TypeError"] in peft["events"]
    assert "fully_shard" not in {name for name, _ in peft["events"]}
    assert peft["error_type"] == "builtins.TypeError" and "python -m lp_lightning.st.illegal" in peft["command"]
    fabric = by_id["optimizer-sgd-fabric"]["events"]
    assert fabric[-1] == ["optimizer_check", "raised TypeError"] and ["fully_shard", "entered"] in fabric
    assert (tmp_path / "comm-fusion" / "stderr.txt").read_text().count("error: ") == 1
    # A case whose message must name a word it lacks fails, at the right stage.
    weakened = results[-1]
    assert weakened["observed_stage"] == "parse" and weakened["mentions_ok"] is False and weakened["pass"] is False
    assert weakened["problems"] == ["the message does not name ['Megatron']"]


def test_a_wrong_expected_stage_fails_through_the_module_child(tmp_path):
    case = dataclasses.replace(CASES["comm-fusion"], expected_stage="launch")
    (result,) = run_illegal_cases(tmp_path, cases=[case], preload=False, timeout_s=240, fit_main=main)
    assert result["observed_stage"] == "parse" and result["exit_code"] == 2 and result["mentions_ok"] is True
    assert result["pass"] is False and result["problems"] == ["failed at stage 'parse', expected 'launch'"]
    assert "LP_ILLEGAL_OBSERVATION " in (tmp_path / "comm-fusion" / "stdout.txt").read_text()


def test_a_spawned_child_runs_only_the_tables_cases(tmp_path):
    changed = dataclasses.replace(CASES["comm-fusion"], cli_args=("--fsdp_config.comm_fusion", "false"))
    with pytest.raises(ValueError, match=r"case 'comm-fusion' is not the table's"):
        run_illegal_cases(tmp_path, cases=[changed], preload=False)
    with pytest.raises(KeyError):
        run_illegal_cases(tmp_path, cases=["no-such-case"])


def test_a_cli_case_needs_the_entry_point_it_runs(tmp_path):
    """The harness never imports the CLI: a CLI case without ``fit_main`` is refused before any child starts."""
    with pytest.raises(ValueError, match=r"cases \['comm-fusion'\] run `lp-lightning fit`: pass the entry point"):
        run_illegal_cases(tmp_path, cases=["comm-fusion"])
    assert not (tmp_path / "comm-fusion").exists()


def test_a_case_for_a_machine_without_a_module_is_not_applicable_where_it_is_installed(tmp_path):
    case = dataclasses.replace(CASES["accelerator-npu-without-torch_npu"], needs_absent="json")  # json: always there
    (result,) = run_illegal_cases(tmp_path, cases=[case], fit_main=main)
    assert result["pass"] is None and result["observed_stage"] is None and result["exit_code"] is None
    assert result["note"] == "not applicable: json is installed here"
    assert not (tmp_path / case.id / "stdout.txt").exists()  # no child was started


@pytest.mark.slow
def test_every_illegal_case_fails_at_its_stage_and_a_legal_config_is_reported_as_accepted(tmp_path):
    legal = IllegalCase("legal-comm-fusion-off", "FSDP comm fusion", "comm_fusion false is legal: it trains", "parse",
                        ("comm_fusion",), "startup", cli_args=("--fsdp_config.comm_fusion", "false"))
    start = time.perf_counter()
    results = run_illegal_cases(tmp_path, cases=[*ILLEGAL_CASES, legal], timeout_s=300, fit_main=main)
    seconds = time.perf_counter() - start
    *table, control = results
    failed = [(r["id"], r["problems"]) for r in table if r["pass"] is False]
    assert failed == [], failed
    assert all(r["pass"] is True or (r["pass"] is None and r["note"].startswith("not applicable")) for r in table)
    assert [r["id"] for r in table] == [case.id for case in ILLEGAL_CASES]
    assert control["observed_stage"] == "completed" and control["pass"] is False
    assert ["training_step", "entered"] in control["events"]
    assert "the run did not fail: the illegal value was accepted" in control["problems"]
    print(f"{len(ILLEGAL_CASES)} illegal cases + 1 legal control in {seconds:.1f} s")


def test_a_status_the_forkserver_lost_runs_the_case_again(tmp_path, monkeypatch):
    """255 is multiprocessing's forkserver saying it could not read a child's status (not the child's own)."""
    from lp_lightning.st import illegal

    real, calls = illegal._fork, []

    def losing_once(*args, **kwargs):
        calls.append(1)
        status = real(*args, **kwargs)
        return illegal.FORKSERVER_LOST_STATUS if len(calls) == 1 else status

    monkeypatch.setattr(illegal, "_fork", losing_once)
    (result,) = run_illegal_cases(tmp_path, cases=[CASES["comm-fusion"]], timeout_s=240, fit_main=main)
    assert len(calls) == 2 and result["pass"] is True and result["exit_code"] == 2
    assert result["retried"].startswith("the forkserver reported 255 (status lost)")
