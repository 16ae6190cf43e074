"""The launch checks of ``lp-lightning fit``: what would otherwise fail only inside every launched process.

:func:`check_launch` runs once, after parsing and before any Trainer, process or model exists
(design spec §15 "startup"): the accelerator, the output folders (writable), ``ckpt_path``
(``last`` resolved to the newest complete checkpoint folder), the data (sources and tokenizer, text
unless ``data.allow_binary``, enough tokens for one train sequence and one validation batch), the
world size against ``torchrun`` and the batch geometry, that a fresh ``fit`` does not write over
another run's checkpoints, room for one checkpoint (a warning), and in mxfp8/hif8 the replacement
plan and the shard rule on the meta model. A failure is a usage error (:mod:`lp_lightning.cli.fit`
exits with status 2). Nothing is created on disk before the checks pass.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from torch import nn

from lp_lightning.config import FSDP2Config
from lp_lightning.data.checks import check_corpus_size
from lp_lightning.data.corpus import first_binary_file, resolve_corpus
from lp_lightning.data.token_cache import default_cache_dir, find_token_cache
from lp_lightning.data.tokenizer import load_tokenizer
from lp_lightning.checkpoint.dcp import is_dcp_checkpoint
from lp_lightning.checkpoint.integrity import DamagedCheckpointError
from lp_lightning.checkpoint.resume import check_explicit_checkpoint, latest_checkpoint
from lp_lightning.checkpoint.space import checkpoint_bytes, existing_ancestor, format_bytes, free_bytes
from lp_lightning.lightning.accelerator import npu_accelerator_error
from lp_lightning.lightning.datamodule import check_batch_geometry
from lp_lightning.models.adapter import adapter_for_config
from lp_lightning.observers import stage

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

    Checks that the output folders can be written (:func:`_check_output_folders`; nothing is
    created), resolves ``ckpt_path: last`` to the newest complete checkpoint folder (``validate``:
    whatever its step; ``fit``: "nothing to do" at ``trainer.max_steps``), checks that
    ``ckpt_path`` is a checkpoint folder (suggesting the newest one when given their parent) that
    passes the quick check (:func:`~lp_lightning.checkpoint.resume.check_explicit_checkpoint`), that
    ``data.sources`` resolve, are text and hold enough tokens, and ``data.tokenizer`` loads
    (:func:`_check_data`), that
    ``data.global_batch_size`` splits over accumulation x world size, and that a ``torchrun``
    launch matches ``trainer.devices`` x ``trainer.num_nodes``, and that ``trainer.accelerator: npu``
    has an importable torch_npu that sees an NPU (else Lightning lists the known names, without the fix).
    A fresh ``fit`` into a folder holding another run's checkpoints stops unless ``overwrite``
    (:func:`check_run_folder`). A ``fit`` warns when the checkpoint folder's disk has no room for one
    checkpoint (:func:`_warn_checkpoint_room`). In mxfp8/hif8 it then compiles the replacement plan once
    on the model's meta twin (:func:`~lp_lightning.cli.launch_low_precision.check_low_precision_launch`).

    Args:
        section: The subcommand's config.
        plan_rules: The run's ``plan_overrides`` rules (``None``: the model adapter's default).
        subcommand: ``fit`` (writes checkpoints) or ``validate``.

    Raises:
        ValueError, TypeError, ImportError: naming the key, the values and the fix.
    """
    trainer = section["trainer"]
    if (accelerator_error := npu_accelerator_error(trainer.get("accelerator"))) is not None:
        raise ValueError(accelerator_error)
    _check_output_folders(section)
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
    _check_data(section["data"], trainer)
    world_size = launch_world_size(trainer)
    if world_size is not None:  # what the strategy checks on each rank once the process group exists
        FSDP2Config(**section["fsdp_config"].as_dict()).resolve_dp_shard_size(world_size)
    accumulation = trainer.get("accumulate_grad_batches") or 1
    global_batch_size = section["data"].get("global_batch_size")
    if world_size is not None and isinstance(accumulation, int) and isinstance(global_batch_size, int):
        check_batch_geometry(global_batch_size, accumulation, world_size)  # what setup checks on each rank
    if subcommand == "fit" and ckpt_path is None:
        check_run_folder(section)
    saves_checkpoints = subcommand == "fit"
    low_precision = section["precision"] != "bf16"
    meta = _meta_model(section["model"]) if saves_checkpoints or low_precision else None
    if saves_checkpoints:
        _warn_checkpoint_room(section, meta)
    if low_precision:
        # Imported here: a low-precision launch only; a bf16 run loads no plan or shard-rule module.
        from lp_lightning.cli.launch_low_precision import check_low_precision_launch

        check_low_precision_launch(section, plan_rules, world_size, meta)


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


def _meta_model(model: Namespace) -> nn.Module:
    """The structure-only model of ``model.*`` (meta device: no memory, milliseconds even for 16B)."""
    name = model.get("config_name_or_path")
    with stage("meta_model_build"):
        return adapter_for_config(name).build_meta_model(
            name,
            config_overrides=model.get("config_overrides"),
            attn_implementation=model.get("attn_implementation") or "sdpa",
        )


_OUTPUTS = {
    "trainer.default_root_dir": "logs/, checkpoints/ and run_summary.json",
    "checkpoint.dirpath": "the checkpoint folders",
    "run_summary.path": "run_summary.json",
    "data.cache_dir": "the token cache of these sources (built on first use)",
}


def _unwritable(folder: Path) -> str | None:
    """Why files cannot be created in ``folder`` (or the folder itself), or ``None``; leaves nothing behind.

    Asked of the nearest existing folder by creating and removing one temporary file there: the only
    answer that holds for root (whom ``os.access`` always allows) and for /proc- or /sys-like file systems.
    """
    existing = existing_ancestor(folder)
    if not existing.is_dir():
        return f"{str(existing)!r} is a file"
    try:
        with tempfile.TemporaryFile(dir=existing):
            return None
    except OSError as err:
        if os.statvfs(existing).f_flag & os.ST_RDONLY:
            return f"{str(existing)!r} is on a read-only file system"
        return f"{str(existing)!r} is not writable by this user ({err.strerror or type(err).__name__})"


def _raise_if_unwritable(key: str, value: object, folder: Path) -> None:
    if (problem := _unwritable(folder)) is not None:
        raise ValueError(
            f"{key}={str(value)!r} cannot be written: {problem}; lp-lightning writes {_OUTPUTS[key]} there. "
            f"Pass a writable --{key}."
        )


def _check_output_folders(section: Namespace) -> None:
    """``trainer.default_root_dir``, ``checkpoint.dirpath`` and ``run_summary.path``'s folder can be written.

    Otherwise the CSV logger fails after launch with a traceback, once per rank. Checked on the nearest
    existing folder with a temporary file that is removed at once (:func:`_unwritable`), so nothing stays.

    Raises:
        ValueError: Naming the key, the folder that refuses and the fix.
    """
    root = section["trainer"].get("default_root_dir") or "."
    _raise_if_unwritable("trainer.default_root_dir", root, Path(root))
    if dirpath := (section.get("checkpoint") or Namespace()).get("dirpath"):
        _raise_if_unwritable("checkpoint.dirpath", dirpath, Path(dirpath))
    if summary := (section.get("run_summary") or Namespace()).get("path"):
        _raise_if_unwritable("run_summary.path", summary, Path(summary).parent)


def _warn_checkpoint_room(section: Namespace, meta: nn.Module) -> None:
    """Warns (rank 0, stderr) when the checkpoint folder's disk has less free than one checkpoint of the model.

    A warning, not an error: the run may free space before its first save. The size is 12 bytes per
    parameter (:func:`~lp_lightning.checkpoint.space.checkpoint_bytes`), the free space ``shutil.disk_usage``.
    """
    checkpoint = section.get("checkpoint") or Namespace()
    if not checkpoint.get("every_n_steps") and not checkpoint.get("save_last", True):
        return  # no checkpoint is ever written
    folder = Path(checkpoint.get("dirpath") or Path(section["trainer"].get("default_root_dir") or ".") / "checkpoints")
    parameters = list(meta.parameters())
    needed = checkpoint_bytes(sum(p.numel() for p in parameters), len(parameters))
    free = free_bytes(folder)
    if free < needed and is_rank_zero():
        print(
            f"lp-lightning: warning: {str(existing_ancestor(folder))!r} has {format_bytes(free)} free, but one "
            f"checkpoint of this run needs about {format_bytes(needed)} (FP32 masters and AdamW moments, 12 bytes "
            "per parameter); saves will fail unless space is freed.",
            file=sys.stderr,
        )


def _check_data(data: Namespace, trainer: Namespace) -> None:
    """The corpus resolves, is text and holds enough tokens, and the tokenizer loads, before any process starts.

    Otherwise every rank fails in ``prepare_data``/``setup`` after the process group exists (or trains on a
    binary file). Cheap: the sources are listed and stat-ed, the first MiB of each is read
    (:func:`~lp_lightning.data.corpus.first_binary_file`, skipped with ``data.allow_binary``), the tokens are
    counted from the sizes, an existing token cache or, for a small corpus, in memory
    (:func:`~lp_lightning.data.checks.check_corpus_size`); the tokenizer folder is loaded once. Without a token
    cache of these sources, ``data.cache_dir`` must be writable. Nothing is written.

    Raises:
        ValueError, TypeError: Prefixed with the ``data.*`` key, naming the file and the fix.
    """
    sources = data.get("sources")
    if isinstance(sources, str):
        sources = [sources]  # one path or glob, as the data module takes it
    try:
        corpus = resolve_corpus(list(sources) if sources else None, max_bytes=data.get("max_corpus_bytes"))
    except (ValueError, TypeError) as err:
        raise type(err)(f"data.sources: {err}") from None
    tokenizer_name = data.get("tokenizer") or "byte"
    try:
        tokenizer = load_tokenizer(tokenizer_name)
    except (ValueError, TypeError, OSError) as err:
        raise ValueError(f"data.tokenizer={tokenizer_name!r}: {err}") from None
    if not data.get("allow_binary") and (binary := first_binary_file(corpus)) is not None:
        source, problem = binary
        raise ValueError(
            f"data.sources: {str(source.path)!r} is not text: {problem}. Pass text files, or --data.allow_binary "
            "true to train on it (undecodable bytes become U+FFFD)."
        )
    cache_dir = data.get("cache_dir")
    cache_folder = Path(cache_dir or default_cache_dir())
    if not cache_folder.is_dir():  # a file in the way, or a folder that cannot be made: before the cache lookup
        _raise_if_unwritable("data.cache_dir", cache_dir or default_cache_dir(), cache_folder)
    if find_token_cache(corpus, tokenizer, cache_dir) is None:
        _raise_if_unwritable("data.cache_dir", cache_dir or default_cache_dir(), cache_folder)
    limit_val_batches = trainer.get("limit_val_batches")
    accumulation = trainer.get("accumulate_grad_batches") or 1
    micro_batch = data.get("global_batch_size") // accumulation if isinstance(accumulation, int) else None
    check_corpus_size(
        corpus, tokenizer, seq_len=data.get("seq_len"), val_fraction=data.get("val_fraction"),
        val_batch_size=None if limit_val_batches == 0 else (data.get("val_batch_size") or micro_batch or None),
        cache_dir=cache_dir,
    )
