"""Stop signals (SIGTERM, SIGUSR1, SIGINT) on any number of processes: every rank stops at the same optimizer step.

A scheduler preempts a job with SIGTERM (SLURM's ``--signal`` sends SIGUSR1 first), a user with
Ctrl-C (SIGINT); the signal may reach one rank or all of them. :class:`StopRequest` (the precision
plugin's ``stop``) turns it into one decision of all ranks (docs/architecture.md "Preemption"):

* **Handler.** It only records the signal, prints one line and arms a watchdog; it runs no
  collective. A Python handler runs between two bytecodes of the main thread, wherever the
  training loop is, so a collective started there meets a different collective on the other ranks
  and waits forever (Lightning 2.6's SIGTERM handler broadcasts from rank 0 there).
* **Decision.** After every optimizer step the non-finite guard MAX-reduces one int32 flag per
  checked tensor over all ranks (:func:`~lp_lightning.checkpoint.finite.first_nonfinite`); the
  plugin appends this rank's signal number to that vector (:meth:`StopRequest.flags`,
  :meth:`StopRequest.agree`). Every rank thus learns the same signal at the same step with no
  collective of its own; the largest number wins (SIGTERM 15 over SIGUSR1 10 over SIGINT 2).
* **Stop.** At that step's ``on_train_batch_end``,
  :class:`~lp_lightning.lightning.callbacks.Preemption` saves the step and raises
  :class:`SignalStop` on every rank; ``lp-lightning fit`` exits with :func:`exit_status`.
* **Bounds.** A second signal ends the process at once. The watchdog, armed by the first signal
  a rank receives or by the agreed stop, ends the process ``timeout_s`` later whatever it is
  doing (a peer that hangs, a save that does not finish). A peer that dies makes the next
  collective fail (gloo: at once). Each of these prints one line.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "STOP_SIGNALS",
    "SignalStop",
    "StopRequest",
    "exit_status",
    "outlive_launcher",
    "signal_name",
]

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
"""The signals that stop training at the next optimizer step (SIGUSR1: SLURM's ``--signal`` default)."""

DEFAULT_TIMEOUT_S = 300.0
"""Default watchdog bound (``--preemption.timeout_s``): a step, its save and the run summary must fit in it."""

LAUNCHER_EXIT_WAIT_S = 30.0
"""How long a rank started by Lightning's launcher in rank 0 waits at exit for rank 0 to exit first."""


def exit_status(signum: int) -> int:
    """The exit status of a run stopped by ``signum``: 130 for SIGINT (Ctrl-C), 143 (128 + SIGTERM) otherwise."""
    return 128 + signal.SIGINT if signum == signal.SIGINT else 128 + signal.SIGTERM


def signal_name(signum: int) -> str:
    """``"SIGTERM"`` for 15 (the number itself when it has no name)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def _say(line: str) -> None:
    """One line on stderr, unbuffered: safe in a signal handler and a watchdog thread (no buffered stream)."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


class StopRequest:
    """This process's stop signal and the one every rank agreed on (the precision plugin's ``stop``).

    See the module docstring. :meth:`install` and :meth:`restore` are called by
    :class:`~lp_lightning.lightning.callbacks.Preemption` (``on_train_start`` / ``on_train_end``);
    the plugin calls :meth:`flags` and :meth:`agree` around the guard's reduce of every optimizer step.

    Attributes:
        received: The first stop signal this process received since :meth:`install` (``None``: none).
        agreed: The signal every rank stops for, set by the optimizer step whose reduce carried it
            (``None`` until then).
        rank: This process's global rank (for the lines it prints).
        timeout_s: The watchdog bound in seconds.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.agreed: int | None = None
        self.rank = 0
        self.timeout_s = DEFAULT_TIMEOUT_S
        self._previous: dict[int, Any] = {}
        self._watchdog: threading.Timer | None = None

    def install(self, *, rank: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Clears the request and handles :data:`STOP_SIGNALS` in this process (main thread only).

        SIGINT is left alone where it is ignored (a shell's background job): the process was
        started not to be stopped by Ctrl-C. The handlers found are kept for :meth:`restore`.
        """
        if timeout_s <= 0:
            raise ValueError(f"preemption.timeout_s must be > 0, got {timeout_s}.")
        self.received = self.agreed = None
        self.rank, self.timeout_s = rank, float(timeout_s)
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal works only there; Lightning's handlers (if any) stay
        for signum in STOP_SIGNALS:
            if signum == signal.SIGINT and signal.getsignal(signum) is signal.SIG_IGN:
                continue
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        """Puts back the handlers :meth:`install` replaced and disarms the watchdog."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}
        self.disarm()

    def disarm(self) -> None:
        """Cancels the watchdog: the stop has run its course (the strategy's ``teardown``, the end of ``fit``).

        A process that goes on after ``fit`` (a notebook, a test, a script that catches
        :class:`SignalStop`) is never ended by a watchdog of a finished run.
        """
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def flags(self) -> torch.Tensor:
        """``int32 [1]``: this rank's signal number, 0 without one; the guard's reduce MAX-reduces it in place."""
        return torch.tensor([self.received or 0], dtype=torch.int32)

    def agree(self, flags: torch.Tensor) -> None:
        """Takes the reduced :meth:`flags`: a non-zero value is the signal every rank stops for; arms the watchdog."""
        signum = int(flags[0])
        if signum and self.agreed is None:
            self.agreed = signum
            self._arm(signum)

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal_name(signum)
        if self.received is not None:
            status = exit_status(signum)
            _say(f"lp-lightning: rank {self.rank}: second stop signal ({name}): exiting now with status {status}, "
                 "without saving. --ckpt_path last resumes the newest complete checkpoint.")
            os._exit(status)
            return
        self.received = signum
        self._arm(signum)
        _say(f"lp-lightning: rank {self.rank}: {name} received: every rank stops after the current optimizer step "
             f"and saves it (a second signal exits at once; at most {self.timeout_s:g} s, --preemption.timeout_s).")

    def _arm(self, signum: int) -> None:
        if self._watchdog is not None:
            return
        self._watchdog = threading.Timer(self.timeout_s, self._expire, args=(signum,))
        self._watchdog.daemon = True  # armed until the process exits
        self._watchdog.start()

    def _expire(self, signum: int) -> None:
        status = exit_status(signum)
        _say(f"lp-lightning: rank {self.rank}: still running {self.timeout_s:g} s after {signal_name(signum)} (a peer "
             f"hangs or the save is slow): exiting with status {status}. --ckpt_path last resumes the newest complete "
             "checkpoint; raise --preemption.timeout_s if saves take longer.")
        os._exit(status)


class SignalStop(SIGTERMException):
    """Every rank stopped training after the same optimizer step for a stop signal.

    A ``SystemExit`` (Lightning's ``SIGTERMException``, which the Trainer re-raises after its
    ``on_exception`` hooks) whose ``code`` is :func:`exit_status`, so an uncaught one ends the
    process with that status.

    Args:
        signum: The agreed signal.
        step: The optimizer step training stopped after (``global_step``).
        checkpoint: The newest checkpoint on disk: the one of ``step``, or the last one before it
            (``None``: none).
        saved: Whether ``checkpoint`` was written at this stop.
    """

    def __init__(self, signum: int, *, step: int, checkpoint: str | None, saved: bool) -> None:
        super().__init__(exit_status(signum))
        self.signum, self.step, self.checkpoint, self.saved = signum, step, checkpoint, saved

    def describe(self, resume_command: str) -> str:
        """The line ``lp-lightning fit`` prints on rank 0: what stopped the run, at which step, what is on disk, how to resume."""
        if self.checkpoint is None:
            where = "no checkpoint on disk: the resumed run starts from step 0"
        else:
            where = f"{'saved' if self.saved else 'newest checkpoint'} {self.checkpoint!r}"
        return (f"training stopped early by {signal_name(self.signum)} after step {self.step} (every rank at that "
                f"step); {where}. Resume: {resume_command}")

    def as_dict(self) -> dict[str, Any]:
        """``{"signal", "step", "checkpoint", "saved", "exit_status"}`` for run_summary.json ``stop_signal``."""
        return {"signal": signal_name(self.signum), "step": self.step, "checkpoint": self.checkpoint,
                "saved": self.saved, "exit_status": self.code}


def outlive_launcher(parent_pid: int, bound_s: float = LAUNCHER_EXIT_WAIT_S) -> None:
    """Waits (at most ``bound_s``) until ``parent_pid``, this rank's parent, has exited (an ``atexit`` hook).

    ``lp-lightning fit --trainer.devices N`` runs rank 0 in the process the user started, and
    Lightning's launcher starts the other ranks as its children; a thread in rank 0 SIGKILLs
    rank 0 when it sees a child exit with a non-zero status first. So after a stop the children
    exit only once rank 0 has. Meanwhile a stop signal ends this process at once.
    """

    def leave(signum: int, frame: Any) -> None:
        os._exit(exit_status(signum))

    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, leave)
    deadline = time.monotonic() + bound_s
    while os.getppid() == parent_pid and time.monotonic() < deadline:
        time.sleep(0.02)
