"""The launch checks of ``lp-lightning fit``: what would otherwise fail only inside every launched process.

:func:`check_launch` runs once, after parsing and before any Trainer, process or model exists
(design spec §15 "startup"): the accelerator, ``ckpt_path`` (``last`` resolved to the newest
complete checkpoint folder), the data sources and tokenizer, the world size against ``torchrun``
and the batch geometry, in mxfp8/hif8 the replacement plan and the shard rule on the meta
model, and that a fresh ``fit`` does not write over another run's checkpoints. A failure is a
usage error (:mod:`lp_lightning.cli.fit` exits with status 2).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jsonargparse import Namespace

from lp_lightning.config import FSDP2Config
from lp_lightning.data.corpus import resolve_corpus
from lp_lightning.data.tokenizer import load_tokenizer
from lp_lightning.checkpoint.dcp import is_dcp_checkpoint
from lp_lightning.checkpoint.integrity import DamagedCheckpointError
from lp_lightning.checkpoint.resume import check_explicit_checkpoint, latest_checkpoint
from lp_lightning.lightning.accelerator import npu_accelerator_error
from lp_lightning.lightning.datamodule import check_batch_geometry

__all__ = ["NothingToDo", "check_launch", "check_run_folder", "checkpoint_folder", "is_rank_zero", "launch_world_size"]


def is_rank_zero() -> bool:
    """Whether this process is rank 0 (torchrun sets ``RANK``; Lightning's launcher ``LOCAL_RANK``)."""
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0"


def launch_world_size(trainer: Namespace) -> int | None:
    """Processes the run will have: torchrun's ``WORLD_SIZE``, else ``devices x num_nodes`` (ints only)."""
    devices, num_nodes = trainer.get("devices"), trainer.get("num_nodes") or 1
    if isinstance(devices, str) and devices.strip().isdigit():  # LightningCLI keeps "--trainer.devices 2" a str
        devices = int(devices)
    launched = os.environ.get("WORLD_SIZE") if "TORCHELASTIC_RUN_ID" in os.environ else None
    if launched is not None:
        if isinstance(devices, int) and isinstance(num_nodes, int) and devices * num_nodes != int(launched):
            raise ValueError(
                f"torchrun started WORLD_SIZE={launched} processes, but trainer.devices={devices} x "
                f"trainer.num_nodes={num_nodes} = {devices * num_nodes}; pass --trainer.devices "
                f"{os.environ.get('LOCAL_WORLD_SIZE', launched)} (per node) and --trainer.num_nodes to match."
            )
        return int(launched)
    if isinstance(devices, int) and devices > 0 and isinstance(num_nodes, int):
        return devices * num_nodes
    return None


class NothingToDo(Exception):
    """``ckpt_path: last`` names a checkpoint at or past ``trainer.max_steps``: the run is complete.

    :func:`lp_lightning.cli.main` prints it and returns 0, so a job script that passes ``last`` on every restart ends
    cleanly after the last one.
    """


def _checkpoint_step(path: Path) -> int | None:
    """The optimizer step of a ``step-NNNNNN`` checkpoint folder (its name; ``None`` if not that form)."""
    match = re.fullmatch(r"step-(\d+)", path.name)
    return int(match.group(1)) if match else None


def _latest_checkpoint(folder: Path) -> Path | None:
    """:func:`~lp_lightning.checkpoint.resume.latest_checkpoint` of ``folder``, each skipped folder noted on stderr
    (rank 0) naming it and why."""
    def note(path: Path, err: DamagedCheckpointError) -> None:
        if is_rank_zero():  # once, not per rank
            print(f"lp-lightning: ckpt_path=last skips {str(path)!r} ({err.problem}); trying the previous one.",
                  file=sys.stderr)

    return latest_checkpoint(folder, on_skip=note)


def check_launch(section: Namespace, *, plan_rules: Sequence[Any] | None = None, subcommand: str = "fit") -> None:
    """Checks what would otherwise fail only inside every launched process.

    Resolves ``ckpt_path: last`` to the newest complete checkpoint folder (``validate``: whatever its
    step; ``fit``: "nothing to do" at ``trainer.max_steps``), checks that
    ``ckpt_path`` is a checkpoint folder (suggesting the newest one when given their parent) that
    passes the quick check (:func:`~lp_lightning.checkpoint.resume.check_explicit_checkpoint`), that ``data.sources`` resolve and
    ``data.tokenizer`` loads, that
    ``data.global_batch_size`` splits over accumulation x world size, and that a ``torchrun``
    launch matches ``trainer.devices`` x ``trainer.num_nodes``, and that ``trainer.accelerator: npu``
    has an importable torch_npu that sees an NPU (else Lightning lists the known names, without the fix).
    In mxfp8/hif8 it then compiles the replacement plan once on the model's meta twin
    (:func:`~lp_lightning.cli.launch_low_precision.check_low_precision_launch`). A fresh ``fit`` into a
    folder holding another run's checkpoints stops unless ``overwrite`` (:func:`check_run_folder`).

    Args:
        section: The subcommand's config.
        plan_rules: The run's ``plan_overrides`` rules (``None``: the model adapter's default).
        subcommand: ``fit`` or ``validate``.

    Raises:
        ValueError, TypeError, ImportError: naming the key, the values and the fix.
    """
    trainer = section["trainer"]
    if (accelerator_error := npu_accelerator_error(trainer.get("accelerator"))) is not None:
        raise ValueError(accelerator_error)
    ckpt_path = section.get("ckpt_path")
    if ckpt_path is not None:
        checkpoints = checkpoint_folder(section)
        if ckpt_path == "last":
            # As Lightning's "last": a job script can pass it on every (re)start; the first one starts fresh.
            latest = _latest_checkpoint(checkpoints)
            if latest is None and subcommand == "validate":
                raise ValueError(_nothing_to_validate(checkpoints))
            if latest is None:
                print(
                    f"lp-lightning: ckpt_path=last: no complete checkpoint under {str(checkpoints)!r}; "
                    f"starting from step 0.",
                    file=sys.stderr,
                )
            else:
                step, max_steps = _checkpoint_step(latest), trainer.get("max_steps")
                if subcommand == "fit" and step is not None and isinstance(max_steps, int) and 0 < max_steps <= step:
                    raise NothingToDo(
                        f"ckpt_path=last: the newest checkpoint {str(latest)!r} is at step {step} and "
                        f"trainer.max_steps={max_steps}: the run is complete, nothing to do. Raise "
                        "--trainer.max_steps to train on."
                    )
            section["ckpt_path"] = None if latest is None else str(latest)
        elif is_dcp_checkpoint(ckpt_path):
            check_explicit_checkpoint(ckpt_path)  # a DamagedCheckpointError is a ValueError: a usage error
        else:
            hint = "pass a checkpoint folder such as <default_root_dir>/checkpoints/step-000020, or `last`"
            latest = _latest_checkpoint(Path(ckpt_path)) if Path(ckpt_path).is_dir() else None
            if latest is not None:
                hint = f"did you mean {str(latest)!r} (the newest checkpoint in it)? Or pass `last`"
            what = "does not exist" if not Path(ckpt_path).exists() else (
                "is not a DCP checkpoint folder (design spec §11, §15: only DCP checkpoints are read)"
            )
            raise ValueError(f"ckpt_path={ckpt_path!r} {what}; {hint}.")
    _check_data_sources_and_tokenizer(section["data"])
    world_size = launch_world_size(trainer)
    if world_size is not None:  # what the strategy checks on each rank once the process group exists
        FSDP2Config(**section["fsdp_config"].as_dict()).resolve_dp_shard_size(world_size)
    accumulation = trainer.get("accumulate_grad_batches") or 1
    global_batch_size = section["data"].get("global_batch_size")
    if world_size is not None and isinstance(accumulation, int) and isinstance(global_batch_size, int):
        check_batch_geometry(global_batch_size, accumulation, world_size)  # what setup checks on each rank
    if section["precision"] != "bf16":
        # Imported here: a low-precision launch only; a bf16 run loads no plan, model-adapter or shard-rule module.
        from lp_lightning.cli.launch_low_precision import check_low_precision_launch

        check_low_precision_launch(section, plan_rules, world_size)
    if subcommand == "fit" and ckpt_path is None:
        check_run_folder(section)


def checkpoint_folder(section: Namespace) -> Path:
    """The run's checkpoint folder: ``checkpoint.dirpath``, else ``<trainer.default_root_dir>/checkpoints``."""
    root = section["trainer"].get("default_root_dir") or "."
    return Path(section["checkpoint"].get("dirpath") or Path(root) / "checkpoints")


def _nothing_to_validate(checkpoints: Path) -> str:
    return (
        f"ckpt_path=last: no complete checkpoint under {str(checkpoints)!r}, so there is nothing to validate; "
        "train first (lp-lightning fit with the same --config/--precision), or pass --ckpt_path <checkpoint folder>."
    )


def check_run_folder(section: Namespace) -> None:
    """A fresh ``fit`` (no ``ckpt_path``) stops when its checkpoint folder holds ``step-*`` folders, unless ``overwrite``.

    Otherwise the new run would overwrite the other run's same-step checkpoints and its
    ``run_summary.json`` (``--overwrite true`` does that knowingly; PeriodicCheckpoint then warns).

    Raises:
        ValueError: naming the folder, what it holds and both fixes (``--ckpt_path last``, ``--overwrite true``).
    """
    if section.get("overwrite"):
        return
    folder = checkpoint_folder(section)
    steps = sorted(p.name for p in folder.glob("step-*") if p.is_dir()) if folder.is_dir() else []
    if not steps:
        return
    shown = ", ".join(steps[:3]) + (f" ... ({len(steps)} folders)" if len(steps) > 3 else "")
    root = Path(section["trainer"].get("default_root_dir") or ".")
    summary = " and run_summary.json" if (root / "run_summary.json").is_file() else ""
    raise ValueError(
        f"{str(folder)!r} already holds another run's checkpoints ({shown}){summary}, which a new run would "
        "overwrite. Resume that run with --ckpt_path last, or pass --overwrite true to train a new run there "
        "(or pick another --trainer.default_root_dir)."
    )


def _check_data_sources_and_tokenizer(data: Namespace) -> None:
    """The corpus sources resolve to readable files and the tokenizer loads, before any process starts.

    Otherwise every rank fails in ``prepare_data``/``setup`` after the process group exists. Cheap:
    the sources are listed and stat-ed (not read) and the tokenizer folder is loaded once.

    Raises:
        ValueError, TypeError: from :func:`~lp_lightning.data.corpus.resolve_corpus` /
            :func:`~lp_lightning.data.tokenizer.load_tokenizer`, prefixed with the ``data.*`` key.
    """
    sources = data.get("sources")
    if isinstance(sources, str):
        sources = [sources]  # one path or glob, as the data module takes it
    try:
        resolve_corpus(list(sources) if sources else None, max_bytes=data.get("max_corpus_bytes"))
    except (ValueError, TypeError) as err:
        raise type(err)(f"data.sources: {err}") from None
    tokenizer = data.get("tokenizer") or "byte"
    try:
        load_tokenizer(tokenizer)
    except (ValueError, TypeError, OSError) as err:
        raise ValueError(f"data.tokenizer={tokenizer!r}: {err}") from None
