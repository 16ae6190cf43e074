"""The stop request of one process (``lp_lightning.lightning.preemption``): handler, watchdog, the ride in the
guard's reduce. The 2-process behaviour through the CLI: ``tests/lightning/test_preemption.py``."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from lp_lightning.checkpoint.finite import first_nonfinite
from lp_lightning.lightning import preemption
from lp_lightning.lightning.preemption import StopRequest, exit_status


@pytest.fixture
def exits(monkeypatch):
    """``os._exit`` of the module recorded instead of run (the handler's second signal, the watchdog)."""
    calls: list[int] = []
    monkeypatch.setattr(preemption.os, "_exit", calls.append)
    return calls


@pytest.fixture
def stop():
    request = StopRequest()
    yield request
    request.restore()


def test_exit_status():
    assert [exit_status(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)] == [143, 143, 130]


def test_the_handler_records_the_first_signal_and_a_second_one_exits_at_once(stop, exits, capfd):
    previous = signal.getsignal(signal.SIGTERM)
    stop.install(rank=1, timeout_s=60)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert stop.received == signal.SIGUSR1 and stop.agreed is None and exits == []
    assert stop.flags().tolist() == [signal.SIGUSR1]
    os.kill(os.getpid(), signal.SIGTERM)
    assert exits == [143] and stop.received == signal.SIGUSR1
    err = capfd.readouterr().err
    assert err.count("lp-lightning: rank 1: SIGUSR1 received: every rank stops after the current optimizer step") == 1
    assert err.count("lp-lightning: rank 1: second stop signal (SIGTERM): exiting now with status 143") == 1
    stop.restore()
    assert signal.getsignal(signal.SIGTERM) is previous


def test_agree_takes_the_reduced_signal_and_arms_the_watchdog(stop, exits, capfd):
    stop.install(rank=0, timeout_s=0.05)
    stop.agree(torch.tensor([0], dtype=torch.int32))
    assert stop.agreed is None
    stop.agree(torch.tensor([signal.SIGINT], dtype=torch.int32))  # another rank got Ctrl-C
    assert stop.agreed == signal.SIGINT and stop.received is None
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.01)
    assert exits == [130]
    assert "lp-lightning: rank 0: still running 0.05 s after SIGINT" in capfd.readouterr().err


def test_an_ignored_sigint_stays_ignored(stop, monkeypatch):
    monkeypatch.setattr(signal, "getsignal", lambda s: signal.SIG_IGN if s == signal.SIGINT else signal.SIG_DFL)
    installed = []
    monkeypatch.setattr(signal, "signal", lambda s, h: installed.append(s))
    stop.install(rank=0)
    assert installed == [signal.SIGTERM, signal.SIGUSR1]


def test_riders_take_part_in_the_nonfinite_reduce_in_place():
    """One process (no reduce): the riders come back as given, alone or next to the checked tensors."""
    riders = torch.tensor([15], dtype=torch.int32)
    assert first_nonfinite([("a", torch.ones(3)), ("b", torch.tensor([float("inf")]))], riders=riders) == "b"
    assert riders.tolist() == [15]
    assert first_nonfinite([], riders=riders) is None and riders.tolist() == [15]
    assert first_nonfinite([("a", torch.ones(3))]) is None


def test_a_disarmed_watchdog_never_fires(stop, exits):
    """The strategy's teardown disarms it: a process that goes on after fit (a notebook, a test) is not ended."""
    stop.install(rank=0, timeout_s=0.05)
    os.kill(os.getpid(), signal.SIGTERM)
    stop.disarm()
    time.sleep(0.3)
    assert exits == [] and stop.received == signal.SIGTERM
