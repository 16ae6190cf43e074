"""The owner's thresholds: ``lp-lightning st --thresholds FILE`` (``lp_lightning.st.thresholds``; design spec §17.2).

- ``configs/st_thresholds.yaml`` holds exactly the built-ins, one comment per key.
- A bad file stops ``st`` with exit 2 before anything runs, every problem at once, each naming its key.
- The N-1 floors and the N-2 bands read the thresholds (a stricter floor fails exactly its rows).
- Round trip through ``st`` (re-reporting synthetic main runs, no ``fit``): without a file the rows that
  read a threshold pass ``provisional``ly (report.json, report.md, the console line, the summary count);
  a stricter file turns Q3-11's pass into a fail, and report.json records the file verbatim.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from lp_lightning.cli import main
from lp_lightning.st.cases import STSettings, build_runs
from lp_lightning.st.numerics import _bands, operator_numerics
from lp_lightning.st.runner import run_config
from lp_lightning.st.thresholds import BUILTIN_THRESHOLDS, THRESHOLD_KEYS, load_thresholds, mark_provisional
from lp_lightning.st.verdict import Row

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "configs" / "st_thresholds.yaml"


def test_the_shipped_file_holds_the_built_ins_with_a_comment_per_key():
    shipped = load_thresholds(SHIPPED)
    assert shipped.values == BUILTIN_THRESHOLDS.values and set(shipped.values) == set(THRESHOLD_KEYS)
    report = shipped.as_report()
    assert report["built_in"] == [] and report["provisional"] is False and report["text"] == SHIPPED.read_text()
    lines = SHIPPED.read_text().splitlines()
    for key in THRESHOLD_KEYS:
        (at,) = [i for i, line in enumerate(lines) if line.startswith(f"{key}:")]
        assert lines[at - 1].startswith("#"), f"{key} has no comment"
    assert BUILTIN_THRESHOLDS.values["resume_first_loss_rel"] == {"bf16": 2**-8, "mxfp8": 2**-4, "hif8": 2**-4}


def test_a_partial_file_keeps_the_other_built_ins_and_marks_only_their_rows_provisional(tmp_path):
    path = tmp_path / "owner.yaml"
    path.write_text("operator_sqnr_floor_db:\n  hif8: {dgrad: 24}\nmin_throughput_ratio: 0.95\n")
    owner = load_thresholds(path)
    assert owner.get(None, "operator_sqnr_floor_db", "hif8", "dgrad") == 24.0
    assert owner.get(None, "operator_sqnr_floor_db", "hif8", "wgrad") == 22.5  # built-in
    assert owner.from_file == {"operator_sqnr_floor_db.hif8.dgrad", "min_throughput_ratio"}
    on_file, mixed, failed = Row("Q3-11"), Row("N-1"), Row("N-2")
    for row in (on_file, mixed, failed):
        row.check("something held", row is not failed, 1, 1)
    owner.get(on_file, "min_throughput_ratio")
    owner.get(mixed, "operator_sqnr_floor_db", "hif8", "dgrad")
    owner.get(mixed, "operator_sqnr_floor_db", "hif8", "wgrad")
    owner.get(failed, "short_run_explosion_factor")
    mark_provisional([on_file, mixed, failed], owner)
    assert [r.provisional for r in (on_file, mixed, failed)] == [False, True, False]
    assert mixed.shown_verdict == "pass (provisional thresholds)" and failed.shown_verdict == "fail"
    assert mixed.notes == [("Provisional: passes on built-in thresholds (operator_sqnr_floor_db.hif8.wgrad); the "
                            "owner's --thresholds file makes it final (docs/acceptance.md, Thresholds).")]
    assert on_file.notes == [] == failed.notes
    assert mixed.as_dict()["thresholds"] == ["operator_sqnr_floor_db.hif8.dgrad", "operator_sqnr_floor_db.hif8.wgrad"]


BAD = """\
resume_first_loss_rel: {mxfp8: 2.0, fp4: 0.1}
short_run_loss_rel: 0.01
operator_sqnr_floor_db: {hif8: {fprop: "high"}}
min_throughput_ratio: true
max_step_time_ratio: .nan
tolerance: 3
"""


def test_a_bad_file_lists_every_problem_naming_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    with pytest.raises(ValueError) as info:
        load_thresholds(path)
    message = str(info.value)
    assert message.startswith(f"--thresholds {str(path)!r}: 7 problem(s):")
    for words in ("resume_first_loss_rel.mxfp8: 2.0 is out of range; it must be finite, > 0 and <= 1 (built-in 0.0625)",
                  "resume_first_loss_rel.fp4: unknown key; resume_first_loss_rel takes ['bf16', 'hif8', 'mxfp8']",
                  "short_run_loss_rel: a map of ['hif8', 'mxfp8'] is expected, got float 0.01",
                  ("operator_sqnr_floor_db.hif8.fprop: a number is expected, got str 'high'; write e.g. "
                   "operator_sqnr_floor_db.hif8.fprop: 26.5"),
                  "min_throughput_ratio: a number is expected, got bool True",
                  "max_step_time_ratio: nan is out of range",
                  "tolerance: unknown key; thresholds are ['max_step_time_ratio',"):
        assert words in message, (words, message)
    for text, words in (("[1, 2]\n", "a map of keys"), ("a: [\n", "not valid YAML"),
                        ("# only a comment\n", "the file sets no threshold"),
                        ("resume_first_loss_rel: {bf16: 0.001, bf16: 0.5}\n", "key 'bf16' given twice (line 1)")):
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(words)):
            load_thresholds(path)
    with pytest.raises(ValueError, match="cannot read it"):
        load_thresholds(tmp_path / "missing.yaml")
    path.write_bytes(b"resume_first_loss_rel: {bf16: 0.001}  # \xff\n")
    with pytest.raises(ValueError, match="cannot read it .*name a UTF-8 YAML file"):
        load_thresholds(path)


def test_a_number_in_exponent_notation_is_a_number(tmp_path):
    path = tmp_path / "owner.yaml"
    path.write_text("resume_first_loss_rel: {bf16: 1e-3, mxfp8: 5E-2}\n")  # YAML 1.2, as the fit YAMLs read it
    owner = load_thresholds(path)
    assert owner.get(None, "resume_first_loss_rel", "bf16") == 1e-3
    assert owner.get(None, "resume_first_loss_rel", "mxfp8") == 5e-2


def test_st_stops_on_a_bad_file_before_anything_runs(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    with pytest.raises(SystemExit) as info:
        main(["st", "--out", str(tmp_path / "st"), "--thresholds", str(path), "--devices", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "7 problem(s)" in err and "tolerance: unknown key" in err and "Traceback" not in err
    assert "--devices 0 must be >= 1" in err  # with the other options' problems, in one error
    assert not (tmp_path / "st").exists()


# ------------------------------------------------------------------------------------------------
# Round trip through st: synthetic main runs re-reported (Q3-11 on an NPU backend, N-3)


def _main_runs(out: Path) -> None:
    """main/<case> folders that ``--reuse_runs`` accepts: a falling loss, mxfp8/hif8 steps 0.8 s vs bf16 1 s."""
    settings = STSettings()
    for spec in build_runs(settings, reshard_after_forward=True):
        if spec.kind != "main":
            continue
        folder = out / "runs" / spec.name
        folder.mkdir(parents=True)
        (folder / "run.yaml").write_text(yaml.safe_dump(run_config(spec, folder, settings)))
        (folder / "user_config.yaml").write_text("# embedded default\n{}\n")
        steps = settings.steps
        summary = {"steps": steps, "first_step": 0, "losses": [3.0 - 0.01 * i for i in range(steps)],
                   "grad_norms": [1.0] * steps, "tokens": 100 * steps,
                   "step_times_s": [1.0 if spec.case.name == "bf16" else 0.8] * steps,
                   "backend": "none" if spec.case.name == "bf16" else "npu",
                   # the step clock's record of a run today (docs/outputs.md "Step times"): nothing subtracted
                   "step_wall_times_s": [1.0 if spec.case.name == "bf16" else 0.8] * steps,
                   "non_training_s": [0.0] * steps,
                   "non_training": {"timing": "subtracted", "inside_steps_s": {}, "outside_steps_s": {}}}
        (folder / "run_summary.json").write_text(json.dumps(summary))


def _st(out: Path, *extra: str) -> tuple[int, dict, str]:
    code = main(["st", "--out", str(out), "--rows", "[Q3-11]", "--reuse_runs", "true", "--skip", "[illegal, numerics]",
                 *extra])
    return code, json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


def test_thresholds_round_trip_through_st(capsys, tmp_path):
    out = tmp_path / "st"
    _main_runs(out)
    code, report, md = _st(out)
    console = capsys.readouterr().out
    assert code == 0
    (q3_11,) = report["rows"]
    assert q3_11["verdict"] == "pass" and q3_11["provisional"] is True
    assert q3_11["thresholds"] == ["min_throughput_ratio", "max_step_time_ratio"]
    (n3,) = [r for r in report["numerics"]["checks"] if r["id"] == "N-3"]
    assert n3["provisional"] is True and "short_run_loss_rel.mxfp8" in n3["thresholds"]
    assert "|rel| <= 6.25e-02 (short_run_loss_rel.hif8)" in {c["expected"] for c in n3["checks"]}
    assert report["summary"]["provisional"] == 2 and report["thresholds"]["path"] is None
    assert report["thresholds"]["provisional"] is True and "min_throughput_ratio" in report["thresholds"]["built_in"]
    assert "| Q3-11 | No performance regression | pass (provisional thresholds) |" in md
    assert "### N-3 Short-run loss and grad-norm curves (§17.3.2 item 3): **pass (provisional thresholds)**" in md
    assert "2 pass, 0 fail, 0 not-applicable (2 of the passes on provisional thresholds)" in md.splitlines()[0] and "## Thresholds" in md
    assert re.search(r"Q3-11 +No performance regression +pass \(provisional thresholds\)", console)

    strict = tmp_path / "owner.yaml"
    strict.write_text("# the owner's bar after the first A5 collection\nmin_throughput_ratio: 1.5\n")
    code, report, md = _st(out, "--thresholds", str(strict))
    assert code == 1
    (q3_11,) = report["rows"]
    assert q3_11["verdict"] == "fail" and q3_11["provisional"] is False
    failed = [c for c in q3_11["checks"] if not c["ok"]]
    assert [c["name"] for c in failed] == ["mxfp8: throughput_ratio >= 1.5", "hif8_current: throughput_ratio >= 1.5"]
    assert failed[0]["observed"] == 1.25 and failed[0]["expected"] == ">= 1.5"
    recorded = report["thresholds"]
    assert recorded["path"] == str(strict) and recorded["text"] == strict.read_text()
    assert recorded["from_file"] == ["min_throughput_ratio"] and recorded["values"]["min_throughput_ratio"] == 1.5
    assert "From `--thresholds " in md and "| `min_throughput_ratio` | 1.5 | file |" in md
    assert "# the owner's bar after the first A5 collection" in md  # the file, verbatim


def test_the_numerics_floors_come_from_the_thresholds(tmp_path):
    path = tmp_path / "strict.yaml"
    path.write_text("operator_sqnr_floor_db: {mxfp8: {fprop: 40}}\none_layer_sqnr_floor_db: {hif8: {dgrad: 30}}\n")
    strict = load_thresholds(path)
    rows = operator_numerics(seed=0, precisions=["mxfp8"], thresholds=strict)
    failed = {(r["operator"], r["tensor"]) for r in rows if not r["pass"]}
    assert failed == {("dense", "output"), ("grouped", "output")}  # ≈ 28.5 dB < 40 dB; dgrad/wgrad keep 26.5
    assert {r["threshold"]: r["sqnr_floor_db"] for r in rows} == {
        "operator_sqnr_floor_db.mxfp8.fprop": 40.0, "operator_sqnr_floor_db.mxfp8.dgrad": 26.5,
        "operator_sqnr_floor_db.mxfp8.wgrad": 26.5}
    gemms = {"dense_fprop": 9, "dense_dgrad": 9, "dense_wgrad": 9}
    builtin, owner = _bands("hif8", gemms), _bands("hif8", gemms, strict)
    assert builtin["sqnr_floors_db"] == {"fprop": 26.5, "dgrad": 22.5, "wgrad": 22.5}
    assert owner["sqnr_floors_db"] == {"fprop": 26.5, "dgrad": 30.0, "wgrad": 22.5}
    assert owner["grad_norm_rel_band"] == builtin["grad_norm_rel_band"]  # ε_min: wgrad's 22.5 dB still the lowest
    assert owner["loss_rel_band"] == pytest.approx(10 ** (-26.5 / 20) * 3)
