"""The step timers leave non-training work out of the training step time (lp_lightning.telemetry.step_clock).

Design spec §17.4 / Q3-11: a digest, snapshot or checkpoint save that lands inside a step's window is
measured and subtracted, whatever the callback order; the raw wall time stays next to it.
"""

from __future__ import annotations

import json
import time

import pytest
from _inprocess import fit_tiny, tiny_datamodule

from lp_lightning.lightning.callbacks import PeriodicCheckpoint
from lp_lightning.observers import non_training
from lp_lightning.st.digest import StateDigestProbe
from lp_lightning.telemetry import RunSummaryCallback
from lp_lightning.telemetry.step_clock import StepClock

SLOW_S = 1.0
"""How long the slow digest sleeps at its step: far above a tiny step's jitter, far below a test's budget."""


class SlowDigestProbe(StateDigestProbe):
    """The acceptance's digest probe, made slow on purpose after the digested step."""

    def _snapshot(self, trainer, pl_module, when):
        super()._snapshot(trainer, pl_module, when)
        if when == "after_step":
            time.sleep(SLOW_S)


def test_a_slow_digest_lands_in_non_training_and_not_in_the_step_time(tmp_path, token_cache_dir, isolated_dist):
    """One run, two summaries: ``outside`` runs before the slow probe (the digest falls between its windows),
    ``inside`` after it (the digest falls inside its window of step 2). Both report the same training time."""
    inside = RunSummaryCallback(path=str(tmp_path / "inside.json"), plot=False)
    probe = SlowDigestProbe(out_dir=str(tmp_path / "probes"), steps=[2])
    save = PeriodicCheckpoint(every_n_steps=2, dirpath=str(tmp_path / "ckpt"), save_last=False)
    _, _, outside = fit_tiny(tmp_path, datamodule=tiny_datamodule(token_cache_dir), max_steps=3, wire=False,
                             callbacks=[probe, inside, save], enable_checkpointing=True)
    inner = json.loads((tmp_path / "inside.json").read_text())
    for summary in (outside, inner):
        wall, non_training, training = (summary[k] for k in ("step_wall_times_s", "non_training_s", "step_times_s"))
        assert len(wall) == len(non_training) == len(training) == 3
        assert training == pytest.approx([w - n for w, n in zip(wall, non_training)], abs=1e-9)
        assert summary["non_training"]["timing"] == "subtracted"
        # The checkpoint save (Lightning runs Checkpoint callbacks last) is outside every window.
        assert summary["non_training"]["outside_steps_s"]["checkpoint_save"] > 0
        assert summary["step_time_s_median"] == pytest.approx(sorted(training)[1])
    # Inside the window of step 2: measured and subtracted.
    assert inner["non_training_s"][1] >= SLOW_S and inner["step_wall_times_s"][1] >= SLOW_S
    assert inner["non_training"]["inside_steps_s"]["state_digest"] >= SLOW_S
    assert inner["non_training"]["steps_with_non_training"] == [2]
    # Outside the windows: nothing to subtract (the digest at train start too: ``outside`` started before it).
    assert outside["non_training"]["outside_steps_s"]["state_digest"] >= SLOW_S
    assert outside["non_training_s"] == [0.0, 0.0, 0.0] and outside["non_training"]["inside_steps_s"] == {}
    # The same step's training time either way: the two windows differ by a few hooks (the slow digest among
    # them, subtracted), so the slow seconds moved neither summary's step time.
    assert abs(inner["step_times_s"][1] - outside["step_times_s"][1]) < SLOW_S / 2


def test_step_clock_counts_the_outermost_ranges_and_only_their_part_inside_a_window():
    clock = StepClock().start()
    try:
        with non_training("checkpoint_save"):  # before any window: outside
            time.sleep(0.01)
        clock.open()
        with non_training("state_digest"), non_training("probe_sample"):  # nested: counted once, as the outer
            time.sleep(0.02)
        first = clock.close()
        assert set(first.non_training_by_kind) == {"state_digest"}
        assert first.non_training_s >= 0.02 and first.training_s == pytest.approx(first.wall_s - first.non_training_s)
        with non_training("checkpoint_save"):  # straddles the next open: only the part after it counts
            time.sleep(0.02)
            clock.open()
            time.sleep(0.01)
        second = clock.close()
        assert 0.01 <= second.non_training_s <= second.wall_s
        totals = clock.totals()
        assert totals["outside_steps_s"]["checkpoint_save"] >= 0.03
        assert totals["inside_steps_s"]["state_digest"] == pytest.approx(first.non_training_s)
        with pytest.raises(RuntimeError, match="no step window is open"):
            clock.close()
    finally:
        clock.stop()
    clock.open()
    with non_training("state_digest"):  # a stopped clock observes nothing
        time.sleep(0.005)
    assert clock.close().non_training_s == 0.0
