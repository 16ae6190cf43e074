"""RunSummaryCallback (lp_lightning.telemetry.summary): the always-on keys and the opt-in wire section."""

from __future__ import annotations

from _inprocess import fit_tiny, tiny_datamodule
from lp_lightning.lightning import LowPrecisionPlugin
from lp_lightning.telemetry.probes import GEMM_ROLE_KEYS
from lp_lightning.telemetry.schema import RunSummary


def test_wire_is_opt_in_and_the_summary_has_the_schema_keys(tmp_path, token_cache_dir, isolated_dist):
    _, _, summary = fit_tiny(tmp_path, datamodule=tiny_datamodule(token_cache_dir), max_steps=1,
                             plugin=LowPrecisionPlugin("mxfp8"), wire=False)
    assert list(summary) == list(RunSummary.keys())  # every key of docs/run_summary.md, in order
    assert summary["wire"] is None and list(tmp_path.glob("wire_trace_rank*.json")) == []
    # The counters every run needs stay on without the wire section.
    assert all(summary["kernels"][role] > 0 for role in GEMM_ROLE_KEYS)
    assert summary["refresh"]["per_step"] == [summary["refresh"]["weights"]] and summary["refresh"]["weights"] > 0
    assert summary["steps"] == 1 and len(summary["losses"]) == len(summary["grad_norms"]) == 1
