"""The committed acceptance report (docs/acceptance/dsv3_tiny) has the schema ``lp-lightning st`` writes today.

A report's schema here is the set of keys of each of its records — the report itself, ``summary``,
``settings``, ``versions``, ``target``, ``thresholds``, ``sections``, a row, a check, a run, a numerics
operator, a case's performance entry —
and the ids of its rows. Values (evidence, observed/expected, figures) are data and not compared.
Today's side is written by the code under test: a real ``st`` with every part that needs a ``fit`` run
skipped (rows, numerics, meta, settings), and ``write_report`` on synthetic runs for the records that
only a run produces (``runs[]``, ``performance.<case>``). When this test fails, regenerate the report
(docs/acceptance.md "Regenerating the committed report") in the same change as the schema.
"""

from __future__ import annotations

import json
from pathlib import Path

from lp_lightning.cli import main
from lp_lightning.st.cases import CASES
from lp_lightning.st.report import short_run_checks, write_report

from ._synthetic import SETTINGS, run_result, summary

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "acceptance" / "dsv3_tiny" / "report.json"
CASE_RECORDS = ("", ".steady", ".reshard_delta", ".recompute_delta", ".peak_memory_bytes")
RECORDS = ("$", "$.summary", "$.settings", "$.versions", "$.target", "$.thresholds", "$.sections", "$.rows[]", "$.rows[].checks[]", "$.numerics",
           "$.numerics.operators[]", "$.numerics.one_layer", "$.numerics.target", "$.numerics.checks[]", "$.numerics.checks[].checks[]",
           "$.runs[]", "$.performance.load", *(f"$.performance.{c.name}{r}" for c in CASES for r in CASE_RECORDS))
"""The records whose keys the code fixes (not the data); a new report section adds its records here."""


def _records(value, path: str, found: dict[str, set[str]]) -> None:
    if isinstance(value, dict):
        if path in RECORDS:
            found.setdefault(path, set()).update(value)
        for key, item in value.items():
            _records(item, f"{path}.{key}", found)
    elif isinstance(value, list):
        for item in value:
            _records(item, f"{path}[]", found)


def report_schema(*reports: dict) -> dict[str, set[str]]:
    """``{record path: its keys}`` over ``reports``, plus ``row ids`` and ``numerics row ids``."""
    found: dict[str, set[str]] = {}
    for report in reports:
        _records(report, "$", found)
        found.setdefault("row ids", set()).update(r["id"] for r in report["rows"])
        found.setdefault("numerics row ids", set()).update(r["id"] for r in report["numerics"].get("checks", []))
    return found


def _runs_report(tmp_path: Path) -> dict:
    """``write_report`` on synthetic main, reshard and recompute runs of every case, with N-3 (no fit runs)."""
    extra = {"step_times_s": [1.0] * 4, "tokens": 400, "backend": "emulated",
             "wire": {"all_gather_bytes": {"w": 10.0}, "gathers_per_step": {"forward": 1, "backward": 1}}}
    runs = {f"{kind}/{c.name}": run_result(f"{kind}/{c.name}", tmp_path / kind / c.name,
                                          summary((3.0, 2.9, 2.8, 2.7), **extra))
            for kind in ("main", "reshard", "recompute") for c in CASES}
    tmp_path.mkdir(parents=True)
    return write_report(tmp_path, rows=[], runs=runs, settings=SETTINGS, numerics={},
                        numerics_rows=[short_run_checks(runs, SETTINGS)],
                        meta={"config": "synthetic"})


def test_the_committed_report_has_the_schema_st_writes_today(tmp_path, capsys):
    out = tmp_path / "st"
    main(["st", "--out", str(out), "--skip", "[runs, illegal]"])  # every row, numerics, meta; no fit run
    capsys.readouterr()
    today = report_schema(json.loads((out / "report.json").read_text()), _runs_report(tmp_path / "synthetic"))
    committed = report_schema(json.loads(COMMITTED.read_text()))
    differences = {
        path: {"only committed": sorted(committed.get(path, set()) - keys),
               "only today": sorted(keys - committed.get(path, set()))}
        for path, keys in today.items() if keys != committed.get(path, set())
    }
    differences.update({path: {"only committed": sorted(keys), "only today": []}
                        for path, keys in committed.items() if path not in today})
    assert not differences, (
        f"{COMMITTED.relative_to(COMMITTED.parents[3])} differs from what st writes today: {differences}. "
        "Regenerate it (docs/acceptance.md 'Regenerating the committed report').")
    versions = json.loads(COMMITTED.read_text())["versions"]
    assert versions["git_commit"] and not versions["git_commit"].endswith("-dirty"), versions  # a committed tree
