"""The run summary's schema (lp_lightning.telemetry.schema) and its generated page, docs/run_summary.md."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lp_lightning.telemetry.schema import RunSummary, schema_markdown

PAGE = Path(__file__).resolve().parents[2] / "docs" / "run_summary.md"


def test_committed_page_equals_the_generated_one():
    assert PAGE.read_text() == schema_markdown(), (
        "docs/run_summary.md is out of date with lp_lightning/telemetry/schema.py; regenerate it with "
        "`python -m lp_lightning.telemetry > docs/run_summary.md`."
    )


def test_every_key_has_a_meaning_and_a_row():
    page = PAGE.read_text()
    for f in dataclasses.fields(RunSummary):
        assert f.metadata["doc"].strip(), f.name
        assert f"| `{f.name}` |" in page, f.name


def test_a_summary_needs_every_key_and_keeps_their_order():
    values = {name: i for i, name in enumerate(RunSummary.keys())}
    assert list(RunSummary(**values).as_dict()) == list(RunSummary.keys())
    missing = dict(values)
    missing.pop("wire")
    with pytest.raises(TypeError, match="wire"):
        RunSummary(**missing)
