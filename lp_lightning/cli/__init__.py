"""``lp-lightning``: the console entry point, dispatching ``fit``/``validate``, ``validate-model``, ``plan`` and ``st``.

``lp-lightning fit`` is :class:`~lp_lightning.cli.fit.LPLightningCLI` (its options: :mod:`lp_lightning.cli.fit`;
its launch checks: :mod:`lp_lightning.cli.launch`); ``validate-model`` is
:mod:`lp_lightning.models.deepseek_v3.validate_cli`; ``plan`` (:mod:`lp_lightning.planner.main`) reads a fit
YAML through :func:`~lp_lightning.cli.fit.plan_settings`; ``st`` (:mod:`lp_lightning.st.main`) is handed
:func:`~lp_lightning.cli.fit.parse_config` and :func:`main` itself (the harness never imports the CLI).
This module is the only one of the package that imports ``st`` and ``planner`` (tests/test_import_layers.py),
and the only one that writes the process environment: the CPU thread default (:func:`default_cpu_threads`).
Importing it filters known third-party console noise, message by message (:func:`quiet_third_party`).
``python -m lp_lightning.cli ...`` runs :func:`main` (``__main__.py``).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import sys
import warnings
from collections.abc import Sequence

import torch


class _DropMessages(logging.Filter):
    """Drops the records of one logger whose message matches ``pattern`` (third-party noise, see :func:`quiet_third_party`)."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


_QUIET_LOGS: tuple[tuple[str, str], ...] = (
    # torchao is not used by lp-lightning; transformers.quantizers imports it whenever it is installed (the
    # benchmark suite's peer), and on CPU it cannot load its CUDA extensions.
    ("torchao", r"^Failed to load .*torchao[/\\]_C\S*\.so\b"),
    # torchao registering its enums with torch's pytree at import (torchao's deprecation, not ours).
    ("torch.utils._pytree", r"is an Enum subclass and is now natively supported by torch\.compile"),
    # Lightning's logger connector advertises a cloud logger on every Trainer (CSVLogger is the run's logger).
    ("lightning.pytorch.utilities.rank_zero", r"^\W*Tip: For seamless cloud logging"),
    ("lightning.fabric.utilities.rank_zero", r"^\W*Tip: For seamless cloud logging"),
)
"""(logger, message pattern) of the third-party log records ``lp-lightning`` drops."""

_QUIET_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    # Lightning's own call of a torch API torch deprecated (lightning/pytorch/utilities/_pytree.py).
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"lightning\.pytorch\.utilities\._pytree$"),
    # PretrainDataModule's loaders always run in the main process (num_workers=0, fixed), so no worker can
    # duplicate data and the stream's __len__ (the run's micro-batches, needed for a resumable loader) is exact.
    (r"Your `IterableDataset` has `__len__` defined", UserWarning, r"lightning\.pytorch\.utilities\.data$"),
)
"""(message, category, module) of the third-party warnings ``lp-lightning`` ignores."""


def quiet_third_party() -> None:
    """Drops the third-party log records and warnings of :data:`_QUIET_LOGS` / :data:`_QUIET_WARNINGS`.

    Each entry matches one known message of one library, so everything else they say still shows.
    Runs when this module is imported: after ``import torch`` (whose logging setup may reset its
    loggers' levels; filters are not levels) and before Lightning, transformers and torchao load.
    """
    for name, pattern in _QUIET_LOGS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_DropMessages(pattern))
    for message, category, module in _QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


quiet_third_party()

from lightning.pytorch.utilities.exceptions import SIGTERMException  # noqa: E402 - after quiet_third_party()

from lp_lightning.cli.fit import LPLightningCLI, parse_config, plan_settings  # noqa: E402
from lp_lightning.cli.launch import NothingToDo, is_rank_zero  # noqa: E402
from lp_lightning.checkpoint.dcp import CheckpointSpaceError, DamagedCheckpointError, NonFiniteStateError  # noqa: E402
from lp_lightning.lightning.callbacks import THREADS_DEFAULTED_ENV  # noqa: E402
from lp_lightning.lightning.preemption import SignalStop  # noqa: E402

__all__ = ["CPU_THREADS_DEFAULT", "default_cpu_threads", "main", "quiet_third_party"]

CPU_THREADS_DEFAULT = 1
"""Intra-op threads per CPU process when ``OMP_NUM_THREADS`` is unset (docs/performance.md "Threads")."""


def default_cpu_threads() -> None:
    """One intra-op thread per CPU process unless ``OMP_NUM_THREADS`` says otherwise (``lp-lightning fit``).

    With 2 threads on 2 cores, a step slowed 10-20x whenever anything else ran on the machine:
    each of the thousands of small parallel regions of a step ends in an OpenMP barrier that waits
    for a thread the OS has descheduled. One thread per process keeps steps flat and costs little
    on these model sizes (docs/performance.md "Threads"). :func:`main` hands it to the CLI, which
    calls it before a cpu Trainer is built; the rank processes Lightning starts inherit the
    setting and the marker :data:`~lp_lightning.lightning.callbacks.THREADS_DEFAULTED_ENV`, from
    which ``run_summary.json`` ``threads.set_by`` records who chose.
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return
    os.environ["OMP_NUM_THREADS"] = str(CPU_THREADS_DEFAULT)
    os.environ[THREADS_DEFAULTED_ENV] = "1"
    torch.set_num_threads(CPU_THREADS_DEFAULT)


_COLLECTIVE_FAILURE_MARKERS = (
    "gloo/transport",  # gloo: "Read error ... Connection reset by peer", "Connection closed by peer"
    "Connection reset by peer",
    "Connection closed by peer",
    "NCCL error",
    "HCCL",
)


def _collective_failure(err: BaseException) -> bool:
    """Whether ``err`` is a failed collective (a peer process died, the connection dropped)."""
    import torch.distributed as dist

    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    return any(marker in str(err) for marker in _COLLECTIVE_FAILURE_MARKERS)


def _first_line(err: BaseException, limit: int = 160) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def resume_command(args: Sequence[str]) -> str:
    """``lp-lightning <args> --ckpt_path last``, any ``--ckpt_path`` in ``args`` replaced (shell-quoted)."""
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--ckpt_path":
            skip = True
        elif not arg.startswith("--ckpt_path="):
            kept.append(arg)
    return shlex.join(["lp-lightning", *kept, "--ckpt_path", "last"])


SUBCOMMANDS: tuple[tuple[str, str], ...] = (
    ("fit", "train (LightningCLI: --config, --precision bf16|mxfp8|hif8, --trainer.*, --ckpt_path last)"),
    ("validate", "the validation loss of a checkpoint (--ckpt_path PATH|last)"),
    ("validate-model", "check a model spec or config.json against the design spec's 16B targets"),
    ("plan", "predict the per-rank memory of a run before launching it"),
    ("st", "the acceptance run: the design spec's Q3 matrix, §15 refusals and numerics, one report"),
)
"""``lp-lightning --help``: every subcommand with one line."""


def _overview() -> str:
    width = max(len(name) for name, _ in SUBCOMMANDS)
    lines = [f"  {name:<{width}}  {what}" for name, what in SUBCOMMANDS]
    return ("usage: lp-lightning {" + ",".join(n for n, _ in SUBCOMMANDS) + "} ...\n\n"
            "MXFP8 / HiF8 pretraining of Hugging Face DeepSeek-V3 on FSDP2 (docs/usage.md).\n\n"
            "subcommands:\n" + "\n".join(lines) + "\n\nlp-lightning <subcommand> --help lists its options.")


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``lp-lightning``.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv[1:]``.

    Returns:
        Exit status: 0 on success; 143 (128 + SIGTERM) when a SIGTERM or SIGUSR1 stopped training
        early (a scheduler's preemption), 130 for SIGINT (Ctrl-C), so a job script can tell it from
        a finished run (rank 0 prints the resume command); 1 when the non-finite guard stopped
        training, the checkpoint to resume from is damaged or a checkpoint save ran out of disk space
        (one line on stderr), or the startup gate failed; argument errors exit with status 2 through
        ``SystemExit``.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] in (["-h"], ["--help"]):
        print(_overview())
        return 0
    if args and args[0] == "validate-model":
        # Imported here: each subcommand loads only its own stack.
        from lp_lightning.models.deepseek_v3.validate_cli import validate_model_main

        return validate_model_main(args[1:])
    if args and args[0] == "st":
        # Imported here: each subcommand loads only its own stack.
        from lp_lightning.st.main import st_main

        return st_main(args[1:], parse_config=parse_config, fit_main=main)
    if args and args[0] == "plan":
        # Imported here: each subcommand loads only its own stack.
        from lp_lightning.planner.main import plan_main

        return plan_main(args[1:], read_fit_config=plan_settings)
    try:
        LPLightningCLI(args=args, cpu_threads_default=default_cpu_threads)
    except NothingToDo as done:
        if is_rank_zero():
            print(f"lp-lightning: {done}", file=sys.stderr)
        return 0
    except (NonFiniteStateError, DamagedCheckpointError, CheckpointSpaceError) as err:
        # The non-finite guard stopped training, the checkpoint to resume from is damaged, or a save ran out of disk
        # space: every rank raised the same error; one line (step, skips, reason, FQN / file / bytes, last good
        # checkpoint), no traceback.
        if is_rank_zero():
            print(f"lp-lightning: {err}", file=sys.stderr)
        return 1
    except RuntimeError as err:
        if _collective_failure(err):  # a peer died or the network dropped: one line per surviving rank
            print(
                f"lp-lightning: rank {os.environ.get('RANK', os.environ.get('LOCAL_RANK', '0'))}: a collective failed "
                f"— another rank stopped or the connection dropped ({_first_line(err)}). Fix the cause, then rerun "
                "the same command with --ckpt_path last (the newest complete checkpoint).",
                file=sys.stderr,
            )
            return 1
        gate_error = sys.modules.get("lp_lightning.ops.gate")  # imported by the gate itself (bf16: never)
        if gate_error is None or not isinstance(err, gate_error.StartupGateError):
            raise
        if is_rank_zero():  # design spec §15: the checks were printed above; one line, no traceback
            print(f"lp-lightning: {err}", file=sys.stderr)
        return 1
    except SignalStop as stop:
        # Every rank stopped after the same step, which Preemption saved; ranks > 0 stay quiet.
        if is_rank_zero():
            print(f"lp-lightning: {stop.describe(resume_command(args))}", file=sys.stderr)
        return int(stop.code)
    except SIGTERMException:
        # Lightning's own SIGTERM stop (a SystemExit without status), e.g. before Preemption's handlers are in
        # place. PeriodicCheckpoint has saved the last completed step; ranks > 0 stay quiet.
        if is_rank_zero():
            print(
                "lp-lightning: training stopped early by SIGTERM. Resume: " + resume_command(args),
                file=sys.stderr,
            )
        return 128 + signal.SIGTERM
    return 0
