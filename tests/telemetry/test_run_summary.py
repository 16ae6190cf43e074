"""RunSummaryCallback (lp_lightning.telemetry.summary): the always-on keys and the opt-in wire section."""

from __future__ import annotations

from _inprocess import fit_tiny, tiny_datamodule
from lp_lightning.lightning import LowPrecisionPlugin
from lp_lightning.telemetry.loss_plot import finished_line, loss_plot_path, write_loss_plot
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
    # One count everywhere: 25 low-precision weights (21 Linears + 2 experts modules x 2) in 23 modules.
    assert summary["replacement"]["low_precision_weights"] == summary["refresh"]["weights"] == 25
    assert summary["replacement"]["num_replaced"] == 23 and summary["sharding"]["low_precision_weights"] == 25
    # The loss plot beside the summary.
    assert summary["loss_plot"] == str(tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_loss_plot_and_the_finished_line(tmp_path):
    """The plot draws a skipped (NaN) step as a gap and a trailing mean from 20 steps on; the line a finished
    fit prints names the steps, loss first -> last, the steady tokens/s and both files."""
    losses = [6.0 - 0.05 * i for i in range(24)]
    losses[3] = float("nan")
    summary = {"losses": losses, "first_step": 10, "steps": 24, "precision": "hif8", "world_size": 2, "tokens": 4096,
               "val_loss_last": 4.9, "loss_first": losses[0], "loss_last": losses[-1], "tokens_per_s": 12345.6}
    assert loss_plot_path(tmp_path / "run_summary.json") == tmp_path / "loss.png"
    assert loss_plot_path(tmp_path / "seg2.json") == tmp_path / "seg2_loss.png"
    summary["loss_plot"] = str(write_loss_plot(summary, tmp_path / "plots" / "loss.png"))
    assert (tmp_path / "plots" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert finished_line(summary, tmp_path / "run_summary.json") == (
        f"lp-lightning: steps 11-34 done, loss 6 -> 4.85, 12,346 tokens/s (steady median); summary "
        f"{tmp_path / 'run_summary.json'}, loss plot {tmp_path / 'plots' / 'loss.png'}")
    nothing = {**summary, "steps": 0, "losses": [], "loss_plot": None}
    assert finished_line(nothing, tmp_path / "s.json") == f"lp-lightning: no optimizer step ran; summary {tmp_path / 's.json'}"
