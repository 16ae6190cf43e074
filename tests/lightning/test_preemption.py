"""Stop signals on 2 processes through the CLI (issue 23 item 1): ``lp-lightning fit --trainer.devices 2``.

dsv3-tiny, 2 x 32 tokens per step, no periodic checkpoint (every checkpoint on disk is a stop's),
no validation. Each run is started under ``_reaper.py`` (a child subreaper: it gets rank 1's exit
status, since Lightning's launcher runs rank 1 as a child of rank 0), with ``_faults.Heartbeat``
writing each rank's pid and step, so the test signals a rank it found mid-run, from outside:

* one chain of runs into one folder, each resumed with ``--ckpt_path last``: SIGTERM to rank 0,
  SIGTERM to rank 1, SIGUSR1 to rank 1, SIGINT to the process group (a Ctrl-C), then to the end.
  Each stop: every rank exits 143 (130) within 60 s, the checkpoint of the stopping step verifies
  (every file's SHA-256), ``run_summary.json`` names the stop, rank 0 prints one resume command.
  The losses and gradient norms of the chain equal an uninterrupted run's bitwise;
* a second SIGTERM to rank 0 ends it at once; rank 1 ends with one line (its collective fails);
* rank 1 stopped (SIGSTOP, a hung peer), SIGTERM to rank 0: rank 0's watchdog ends it after
  ``--preemption.timeout_s``; rank 1, continued, then has a dead peer and ends with one line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_fit_e2e import REPO, _fit_command

from lp_lightning.checkpoint.dcp import verify_dcp_checkpoint

pytestmark = pytest.mark.slow

STEPS = 14  # 4 stops of ~2 steps each (a late signal: 3), then the rest
HERE = Path(__file__).parent
EXIT_BOUND_S = 60.0


def _command(root: Path, cache_dir: str, *extra: str) -> list[str]:
    return _fit_command(
        root, cache_dir, "--trainer.devices", "2", "--data.seq_len", "32", "--data.global_batch_size", "2",
        "--data.val_batches", "1", "--trainer.val_check_interval", "1000", "--checkpoint.every_n_steps", "0",
        "--trainer.max_steps", str(STEPS), "--model.warmup_steps", "1", "--model.lr_decay_steps", str(STEPS), *extra,
    )  # fmt: skip


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(HERE), env.get("PYTHONPATH")]))
    return env


class _Run:
    """One fit under ``_reaper.py``, its stderr in a file, its ranks' pids and steps from the heartbeat files."""

    def __init__(self, root: Path, cache_dir: str, *extra: str, sleep_s: float) -> None:
        self.root, self.beats = root, root / "heartbeat"
        for stale in self.beats.glob("rank*.json"):
            stale.unlink()
        (root / "run_summary.json").unlink(missing_ok=True)
        root.mkdir(parents=True, exist_ok=True)
        self.stderr_path, self.exits_path = root / "stderr.txt", root / "exits.json"
        heartbeat = ["--trainer.callbacks+=_faults.Heartbeat", f"--trainer.callbacks.out_dir={self.beats}",
                     f"--trainer.callbacks.sleep_s={sleep_s}"]
        with open(self.stderr_path, "w") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "_reaper.py"), str(self.exits_path), "--",
                 *_command(root, cache_dir, *heartbeat, *extra)],
                cwd=root.parent, env=_env(), stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
            )  # fmt: skip
        self.pids: list[int] = []

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait_for_step(self, step: int, timeout: float = 300) -> None:
        """Until both ranks finished optimizer step ``step``; sets :attr:`pids`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                beats = [json.loads((self.beats / f"rank{r}.json").read_text()) for r in (0, 1)]
            except FileNotFoundError:
                beats = []
            if beats and min(b["step"] for b in beats) >= step:
                self.pids = [b["pid"] for b in beats]
                return
            assert self.proc.poll() is None and time.monotonic() < deadline, self.stderr()[-4000:]
            time.sleep(0.05)

    def wait_for_line(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.stderr():
            assert time.monotonic() < deadline, self.stderr()[-4000:]
            time.sleep(0.01)

    def finish(self, since: float) -> dict:
        """Waits for every process; returns ``{"status": [rank 0, rank 1], "seconds": [...] after since, ...}``."""
        try:
            self.proc.wait(timeout=180)
        finally:
            self.kill()
        exits = json.loads(self.exits_path.read_text())
        missing = [pid for pid in self.pids if str(pid) not in exits]
        assert not missing, f"not reaped here (exited before rank 0?): {missing}; {exits}"
        summary_path = self.root / "run_summary.json"
        return {
            "status": [exits[str(pid)]["status"] for pid in self.pids],
            "seconds": [exits[str(pid)]["t"] - since for pid in self.pids],
            "stderr": self.stderr(),
            "summary": json.loads(summary_path.read_text()) if summary_path.is_file() else None,
        }

    def kill(self) -> None:
        """Nothing of this run outlives the test: while the reaper (which outlives every rank) runs, SIGKILL
        to the run's process group (its own session), a stopped rank included."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


CHAIN = [("rank0", signal.SIGTERM), ("rank1", signal.SIGTERM), ("rank1", signal.SIGUSR1), ("group", signal.SIGINT)]
"""The stops of the chain, in order: whom the signal goes to, which signal."""


@pytest.fixture(scope="module")
def chain(tmp_path_factory, token_cache_dir):
    """The uninterrupted reference run and the chain of stopped runs (see the module docstring), run once."""
    base = tmp_path_factory.mktemp("preemption")
    reference = subprocess.run(_command(base / "reference", token_cache_dir), cwd=base, env=_env(),
                               capture_output=True, text=True, timeout=600)
    assert reference.returncode == 0, reference.stderr[-4000:]
    root = base / "chain"
    stops = []
    first_step = 0
    for target, signum in CHAIN:
        run = _Run(root, token_cache_dir, "--ckpt_path", "last", sleep_s=0.3)
        try:
            run.wait_for_step(first_step + 1)
            sent = time.monotonic()
            if target == "group":
                os.killpg(run.proc.pid, signum)  # Ctrl-C: the terminal signals the foreground process group
            else:
                os.kill(run.pids[int(target[-1])], signum)
            result = run.finish(sent)
        finally:
            run.kill()
        result.update(target=target, signum=signum, first_step=first_step)
        stops.append(result)
        assert result["summary"] is not None, result["stderr"][-4000:]
        first_step = result["summary"]["global_step"]
        assert first_step < STEPS, "the run ended before the signal arrived"
    last = subprocess.run([*_command(root, token_cache_dir), "--ckpt_path", "last"], cwd=base, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert last.returncode == 0, last.stderr[-4000:]
    return {
        "reference": json.loads((base / "reference" / "run_summary.json").read_text()),
        "stops": stops,
        "last": json.loads((root / "run_summary.json").read_text()),
        "root": root,
    }


def _check_stop(result: dict, root: Path) -> None:
    signum, name = result["signum"], signal.Signals(result["signum"]).name
    expected = 130 if signum == signal.SIGINT else 143
    err = result["stderr"]
    assert result["status"] == [expected, expected], err[-4000:]
    assert max(result["seconds"]) < EXIT_BOUND_S, result["seconds"]
    assert "Traceback" not in err
    summary = result["summary"]
    step = summary["global_step"]
    assert step > result["first_step"] and summary["first_step"] == result["first_step"]
    checkpoint = root / "checkpoints" / f"step-{step:06d}"
    assert summary["stop_signal"] == {"signal": name, "step": step, "checkpoint": str(checkpoint), "saved": True,
                                      "exit_status": expected}
    assert summary["checkpoints"] == [str(checkpoint)] and summary["world_size"] == 2
    assert verify_dcp_checkpoint(checkpoint, weights_only=False)["global_step"] == step  # every file's digest
    assert not list((root / "checkpoints").glob(".*partial"))
    receivers = [0, 1] if result["target"] == "group" else [int(result["target"][-1])]
    for rank in (0, 1):
        assert err.count(f"lp-lightning: rank {rank}: {name} received") == (rank in receivers), err[-4000:]
    (line,) = [line for line in err.splitlines() if line.startswith("lp-lightning: training stopped early")]
    assert line.startswith(f"lp-lightning: training stopped early by {name} after step {step} (every rank at that "
                           f"step); saved {str(checkpoint)!r}. Resume: lp-lightning fit --config ")
    assert " --trainer.devices 2 " in line and line.endswith(" --ckpt_path last") and line.count("--ckpt_path") == 1


@pytest.mark.parametrize("index", range(len(CHAIN)), ids=[f"{s.name}-{t}" for t, s in CHAIN])
def test_a_stop_signal_to_any_rank_stops_every_rank_at_one_step_saves_it_and_exits(chain, index):
    """SIGTERM to rank 0, then to rank 1, SIGUSR1 (as SIGTERM), SIGINT (Ctrl-C: 130, run_summary.json written)."""
    _check_stop(chain["stops"][index], chain["root"])


def test_the_stopped_and_resumed_runs_equal_an_uninterrupted_run_bitwise(chain):
    segments = [stop["summary"] for stop in chain["stops"]] + [chain["last"]]
    assert [s["first_step"] for s in segments[1:]] == [s["global_step"] for s in segments[:-1]]
    assert segments[-1]["global_step"] == STEPS
    reference = chain["reference"]
    assert [loss for s in segments for loss in s["losses"]] == reference["losses"]
    assert [norm for s in segments for norm in s["grad_norms"]] == reference["grad_norms"]


def _failure_run(tmp_path: Path, cache_dir: str, *extra: str) -> _Run:
    run = _Run(tmp_path / "run", cache_dir, *extra, sleep_s=1.0)  # a stop takes >= 1 s: room for what follows
    run.wait_for_step(1)
    return run


def test_a_second_signal_ends_that_rank_at_once_and_the_other_with_one_line(tmp_path, token_cache_dir):
    run = _failure_run(tmp_path, token_cache_dir)
    try:
        os.kill(run.pids[0], signal.SIGTERM)
        run.wait_for_line("lp-lightning: rank 0: SIGTERM received")
        sent = time.monotonic()
        os.kill(run.pids[0], signal.SIGTERM)
        result = run.finish(sent)
    finally:
        run.kill()
    err = result["stderr"]
    assert result["status"] == [143, 1], err[-4000:]
    assert result["seconds"][0] < 5 and max(result["seconds"]) < EXIT_BOUND_S, result["seconds"]
    assert err.count("lp-lightning: rank 0: second stop signal (SIGTERM): exiting now with status 143") == 1
    assert err.count("lp-lightning: rank 1: a collective failed — another rank stopped") == 1
    assert "Traceback" not in err and not (run.root / "checkpoints").exists()


def test_a_hung_peer_meets_the_watchdog_and_then_a_dead_peer_one_line_each(tmp_path, token_cache_dir):
    run = _failure_run(tmp_path, token_cache_dir, "--preemption.timeout_s", "4")
    try:
        os.kill(run.pids[1], signal.SIGSTOP)  # rank 1 hangs: rank 0's collectives wait for it
        sent = time.monotonic()
        os.kill(run.pids[0], signal.SIGTERM)
        run.wait_for_line("lp-lightning: rank 0: still running 4 s after SIGTERM")
        watchdog_s = time.monotonic() - sent
        os.kill(run.pids[1], signal.SIGCONT)  # rank 1 goes on, and meets a dead peer
        result = run.finish(sent)
    finally:
        run.kill()
    err = result["stderr"]
    assert result["status"] == [143, 1], err[-4000:]
    assert 4 <= watchdog_s < 15 and max(result["seconds"]) < EXIT_BOUND_S, (watchdog_s, result["seconds"])
    assert err.count("lp-lightning: rank 0: still running") == 1
    assert err.count("lp-lightning: rank 1: a collective failed — another rank stopped") == 1
    assert "Traceback" not in err
