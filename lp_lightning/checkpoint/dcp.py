"""DCP (torch.distributed.checkpoint) checkpoints with Hugging Face parameter names as keys (§11).

Layout of one checkpoint folder, e.g. ``<default_root_dir>/checkpoints/step-000050/``::

    .metadata          DCP metadata (tensor keys, shapes, dtypes, chunk placement)
    __<rank>_0.distcp  this rank's shards (one file per rank)
    meta.pt            everything that is not a tensor view (``torch.save`` on rank 0): for the
                       Trainer the loop state (global step, epoch/batch progress), LR scheduler,
                       callback, datamodule (data position) and precision-plugin states
    digests.json       size and SHA-256 of each file above, and whether every saved tensor was
                       finite (:mod:`lp_lightning.checkpoint.integrity`)

DCP keys (read them with :func:`checkpoint_tensor_keys`):

* **model view** at the top level, keyed exactly by the HF module's state-dict names, e.g.
  ``model.layers.0.mlp.gate_proj.weight``, ``model.layers.1.mlp.experts.gate_up_proj``,
  ``lm_head.weight``. The values are the FP32 master weights (the sharded FSDP2 Parameters that
  AdamW updates). Design spec §11 asks for "BF16 logical weights"; we keep the FP32 master instead,
  because with FSDP2 the master *is* the Parameter and the optimizer view holds no copy of it:
  saving BF16 would lose the master and make bitwise resume impossible. A BF16 view is an exact
  cast of it. No derived low-precision data/scale is ever saved (R9).
* **optimizer view** under the optimizer's state key (``optimizer`` for the Trainer), keyed by
  the same HF names: ``optimizer.state.<fqn>.exp_avg`` / ``.exp_avg_sq`` (FP32) /
  ``.step``, plus ``optimizer.param_groups.*``.

Low-precision runs (``mxfp8``/``hif8``): a low-precision weight's Parameter is a
``QuantizedWeightTensor`` (FP32 master + derived 8-bit storage); a state-dict post hook of its
module (``lp_lightning.fsdp.weights``) exposes the plain FP32 master shard under the same HF key,
so the checkpoint holds no tensor subclass and no derived data/scale, loads with
``weights_only=True``, into a plain HF ``DeepseekV3ForCausalLM`` (``dcp.load`` without a process
group) and into a run of any precision. Loading copies into the master in place; the strategies then
rebuild the 8-bit storage from it once (``LowPrecisionFabricPlugin.rebuild_after_load``, design spec §11).

Writing is atomic per folder: every rank writes into a hidden sibling ``.<name>.partial/``, rank 0
adds ``meta.pt`` and ``digests.json`` last and renames the folder into place, so a run killed while
saving leaves the previous checkpoints untouched and no folder that looks complete but is not.
A save that runs out of disk space removes its staging folder and raises
:class:`~lp_lightning.checkpoint.space.CheckpointSpaceError` (one line: the folder, the bytes needed) on every rank.
A state holding NaN/Inf (masters, AdamW moments; one fused check over all ranks,
:func:`~lp_lightning.checkpoint.finite.first_nonfinite`) is never written: the save raises
:class:`~lp_lightning.checkpoint.finite.NonFiniteStateError` before creating anything.

Loading first checks the folder (``meta.pt`` present, every file's size and, spread over the
ranks, its SHA-256 against ``digests.json``; ``meta.pt`` and ``.metadata`` readable; every model
key present with the model's shape) and only then lets DCP read, so a damaged checkpoint fails
with :class:`~lp_lightning.checkpoint.integrity.DamagedCheckpointError` naming the file and leaves
the model as it was. After DCP has read, the loaded masters and moments are checked for NaN/Inf
(a folder without ``digests.json``, written before digests existed, is only checked this way); a
failure there raises the same error, with the loaded values left in the model and optimizer.

Both views come from ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` /
``get_optimizer_state_dict`` on the *HF module* (not on a wrapper such as the LightningModule,
which would prefix every key with its attribute name), and are restored with the matching
``set_*`` functions, so sharded checkpoints re-shard on load to any world size.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lp_lightning.checkpoint.finite import NonFiniteStateError, first_nonfinite, flatten_state
from lp_lightning.checkpoint.integrity import (
    DAMAGED_CHECKPOINT_FIX,
    DIGESTS_FILENAME,
    DamagedCheckpointError,
    check_files,
    file_records,
    read_digests,
    write_digests,
)
from lp_lightning.checkpoint.space import (
    BYTES_PER_TENSOR,
    SMALL_FILES_BYTES,
    CheckpointSpaceError,
    free_bytes,
    out_of_space,
)
from lp_lightning.observers import non_training

__all__ = [
    "DAMAGED_CHECKPOINT_FIX",
    "DIGESTS_FILENAME",
    "METADATA_FILENAME",
    "CheckpointSpaceError",
    "DamagedCheckpointError",
    "NonFiniteStateError",
    "checkpoint_problem",
    "checkpoint_tensor_keys",
    "is_dcp_checkpoint",
    "load_dcp_checkpoint",
    "model_state_dict",
    "optimizer_state_dict",
    "save_dcp_checkpoint",
    "verify_dcp_checkpoint",
]

METADATA_FILENAME = "meta.pt"
"""Non-tensor state file inside a checkpoint folder (same name as Lightning's ``_METADATA_FILENAME``)."""

_SMALL_FILES = (".metadata", METADATA_FILENAME)
"""Files whose digest is checked even by a quick verification (small; DCP and ``torch.load`` read them first)."""

_SHARDED = StateDictOptions(full_state_dict=False, cpu_offload=False)


def model_state_dict(model: nn.Module) -> dict[str, Any]:
    """Sharded model view keyed by ``model``'s own state-dict names (HF names for an HF model).

    Args:
        model: The FSDP2-sharded HF causal LM (not a wrapper around it).

    Returns:
        ``{fqn: DTensor}``; checkpoint-wrapper prefixes are already stripped.
    """
    return get_model_state_dict(model, options=_SHARDED)


def optimizer_state_dict(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """Sharded optimizer view ``{"state": {fqn: {...}}, "param_groups": [...]}`` keyed by FQN.

    Args:
        model: The module whose Parameters ``optimizer`` updates.
        optimizer: The optimizer (an unstepped one gets its state initialised by torch first).

    Returns:
        The optimizer state dict with FQN keys; AdamW moments are FP32 DTensors.
    """
    return get_optimizer_state_dict(model, optimizer, options=_SHARDED)


def is_dcp_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding a DCP ``.metadata`` file."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file()


def _check_key_collisions(model_state: Mapping[str, Any], optimizer_keys: list[str]) -> None:
    for key in optimizer_keys:
        clash = [k for k in model_state if k == key or k.startswith(key + ".")]
        if clash:
            raise ValueError(
                f"checkpoint key {key!r} for an optimizer collides with model keys {clash[:3]}; "
                f"name the optimizer entry differently."
            )


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(value: Any) -> list[Any]:
    """``value`` of every rank (``all_gather_object``), in rank order; ``[value]`` without a process group."""
    rank, world = _rank_and_world()
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value)
    return out


def _dcp_files(dcp_metadata: Any) -> dict[str, int]:
    """``{shard file: bytes it must hold at least}`` from DCP's metadata (its storage entries)."""
    needed: dict[str, int] = {}
    for info in dcp_metadata.storage_data.values():
        relative_path = getattr(info, "relative_path", None)
        if relative_path is not None:
            needed[relative_path] = max(needed.get(relative_path, 0), int(info.offset) + int(info.length))
    return needed


def save_dcp_checkpoint(
    path: str | Path,
    *,
    model_state: Mapping[str, Any],
    optimizer_states: Mapping[str, Mapping[str, Any]],
    metadata: Mapping[str, Any],
    rank: int,
    allow_nonfinite: bool = False,
) -> Path:
    """Writes one sharded checkpoint folder with its ``digests.json`` (collective: every rank must call it).

    Order: the NaN/Inf check of every floating-point tensor (all ranks) -> ``dcp.save`` into the
    hidden staging folder -> each rank hashes its share of DCP's files -> rank 0 writes
    ``meta.pt`` and ``digests.json`` (temporary name, rename) -> rank 0 renames the folder into place.

    Args:
        path: Target folder; created if missing. An existing *file* at that path is an error.
        model_state: :func:`model_state_dict` of the HF module (top-level DCP keys).
        optimizer_states: ``{key: optimizer_state_dict(...)}``; each lands under ``key.``.
        metadata: Picklable non-tensor state, written to ``meta.pt`` by rank 0.
        rank: Global rank of the caller.
        allow_nonfinite: Write a state holding NaN/Inf anyway (post-mortem), marked
            ``"finite": false`` in ``digests.json``: :func:`verify_dcp_checkpoint` then refuses it and
            ``--ckpt_path last`` never picks it. Default ``False``: such a state is not written.

    Returns:
        The folder path.

    Raises:
        FileExistsError: ``path`` exists and is a file.
        ValueError: An optimizer key collides with a model key.
        NonFiniteStateError: A tensor holds NaN/Inf (on any rank) and ``allow_nonfinite`` is false;
            nothing has been written.
        CheckpointSpaceError: The disk filled up while writing (on any rank; ENOSPC, or torch's "unexpected
            pos" with no room left); the staging folder has been removed, earlier checkpoints are untouched.

    The save is a ``non_training("checkpoint_save")`` range (:mod:`lp_lightning.observers`): the step
    timers leave it out of a step's training time.
    """
    with non_training("checkpoint_save"):
        return _write_checkpoint(Path(path), model_state=model_state, optimizer_states=optimizer_states,
                                 metadata=metadata, rank=rank, allow_nonfinite=allow_nonfinite)


def _write_checkpoint(
    path: Path,
    *,
    model_state: Mapping[str, Any],
    optimizer_states: Mapping[str, Mapping[str, Any]],
    metadata: Mapping[str, Any],
    rank: int,
    allow_nonfinite: bool,
) -> Path:
    """The body of :func:`save_dcp_checkpoint` (see there)."""
    if path.is_file():
        raise FileExistsError(f"checkpoint path {str(path)!r} is a file; DCP checkpoints are folders.")
    _check_key_collisions(model_state, list(optimizer_states))
    state: dict[str, Any] = dict(model_state)
    state.update(optimizer_states)
    tensors = flatten_state(state)
    bad = first_nonfinite(tensors)
    if bad is not None and not allow_nonfinite:
        raise NonFiniteStateError(
            f"checkpoint {path.name} not written: {bad!r} holds NaN/Inf, and a checkpoint is never written from a "
            "non-finite state (the ones on disk are kept).",
            reason="non-finite state at checkpoint save", fqn=bad,
        )
    staging = path.parent / f".{path.name}.partial"
    needed = sum(t.numel() * t.element_size() for _, t in tensors) + SMALL_FILES_BYTES + BYTES_PER_TENSOR * len(tensors)

    def prepare() -> None:
        if staging.exists():  # left by a run killed while saving
            shutil.rmtree(staging)
        staging.mkdir(parents=True)

    _settle(_attempt(prepare) if rank == 0 else None, path=path, staging=staging, needed=needed, rank=rank)
    records: dict[str, Any] = {}

    def write_shards() -> None:
        dcp.save(state, checkpoint_id=staging)
        _, world = _rank_and_world()
        shards = sorted(_dcp_files(dcp.FileSystemReader(str(staging)).read_metadata()))
        records.update(file_records(staging, shards[rank::world]))  # each rank hashes its share

    failure = _attempt(write_shards)
    parts = _gather((records, _report(failure, staging, needed)))
    _settle(failure, path=path, staging=staging, needed=needed, rank=rank, reports=[r for _, r in parts])

    def finish() -> None:
        torch.save(dict(metadata), staging / METADATA_FILENAME)
        files = file_records(staging, _SMALL_FILES)
        for part, _ in parts:
            files.update(part)
        write_digests(staging, files, finite=bad is None, first_nonfinite=bad)
        _move_into_place(staging, path)

    _settle(_attempt(finish) if rank == 0 else None, path=path, staging=staging, needed=needed, rank=rank)
    return path


_Failure = Exception | dcp.CheckpointException
"""What a save step may fail with: DCP's ``CheckpointException`` (every rank's write errors) is a ``BaseException``."""


def _attempt(step: Callable[[], None]) -> _Failure | None:
    """Runs one step of a save; the exception it raised (not an interrupt: those propagate), or ``None``."""
    try:
        step()
    except (Exception, dcp.CheckpointException) as err:  # sorted out by _settle, on every rank alike
        return err
    return None


def _report(err: _Failure | None, staging: Path, needed: int) -> tuple[bool, str] | None:
    """What a rank tells the others of its step: ``(out of space, the error's first line)``, ``None`` if it passed."""
    if err is None:
        return None
    lines = str(err).strip().splitlines()
    return out_of_space(err, staging, needed), f"{type(err).__name__}: {lines[0] if lines else ''}"


def _settle(
    err: _Failure | None, *, path: Path, staging: Path, needed: int, rank: int,
    reports: list[tuple[bool, str] | None] | None = None,
) -> None:
    """After one step of a save, raises on every rank if the step failed on any (collective: gathers ``reports``
    unless given).

    Out of space on any rank: rank 0 removes the staging folder and every rank raises
    :class:`~lp_lightning.checkpoint.space.CheckpointSpaceError`. Another error: the rank that met it re-raises
    it, the others raise a ``RuntimeError`` naming that rank (instead of waiting in the next collective).
    """
    if reports is None:
        reports = _gather(_report(err, staging, needed))
    failed = [(index, report) for index, report in enumerate(reports) if report is not None]
    if not failed:
        return
    if any(space for _, (space, _) in failed):
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        _barrier()  # the staging folder is gone before any rank reads the free space
        newest = _newest_checkpoint(path)
        raise CheckpointSpaceError(path, needed=needed, free=free_bytes(path.parent), newest=newest) from err
    if err is not None:
        raise err
    index, (_, line) = failed[0]
    raise RuntimeError(f"checkpoint {path.name} not written: rank {index} failed ({line}).")


def _newest_checkpoint(path: Path) -> str | None:
    """The most recently written ``step-*`` folder beside ``path`` (``path`` itself when a failed save meant to replace
    it): the one ``--ckpt_path last`` tries first."""
    # Imported here: resume imports this module.
    from lp_lightning.checkpoint.resume import checkpoint_folders

    newest = next(iter(checkpoint_folders(path.parent)), None)
    return None if newest is None else str(newest)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _move_into_place(staging: Path, path: Path) -> None:
    """Renames the finished ``staging`` folder to ``path`` (replacing an older folder there)."""
    if path.exists():
        old = path.parent / f".{path.name}.old"
        if old.exists():
            shutil.rmtree(old)
        path.rename(old)
        staging.rename(path)
        shutil.rmtree(old)
    else:
        staging.rename(path)


def _check_content(path: Path, record: Mapping[str, Any] | None) -> None:
    """Every file's SHA-256 against ``record``, the files spread over the ranks (collective).

    Raises:
        DamagedCheckpointError: On every rank, naming the first mismatching file of any rank.
    """
    if record is None:
        return
    rank, world = _rank_and_world()
    names = sorted(record["files"])[rank::world]
    problems = _gather(check_files(path, record, names, hash_names=names))
    problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise DamagedCheckpointError(path, problem)


def load_dcp_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizers: Mapping[str, Optimizer],
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Verifies the folder, restores the model view, then each optimizer view, in place; returns ``meta.pt``.

    Collective: every rank must call it. The model is restored first (high-precision weights),
    then the optimizer state (design spec §11: "恢复时先恢复模型与 optimizer 高精状态"). Before DCP
    reads, :func:`verify_dcp_checkpoint` (structure, sizes, small files) and the SHA-256 of every
    file (spread over the ranks); after it, a NaN/Inf check of every loaded tensor.

    Args:
        path: A folder written by :func:`save_dcp_checkpoint`.
        model: The sharded HF module whose state-dict names are the checkpoint keys.
        optimizers: ``{key: optimizer}`` with the keys used when saving (may be empty).
        strict: Require every model key to be present in the checkpoint.
        weights_only: Forwarded to ``torch.load`` for ``meta.pt``.

    Returns:
        The metadata dict saved in ``meta.pt``.

    Raises:
        FileNotFoundError: ``path`` is not a DCP checkpoint folder.
        DamagedCheckpointError: A file does not match its record (nothing loaded), or a loaded
            master or moment holds NaN/Inf (the model and optimizer hold the loaded values).
        ValueError: The folder does not fit ``model`` (see :func:`verify_dcp_checkpoint`);
            nothing has been loaded.
    """
    path = Path(path)
    model_sd = model_state_dict(model)
    metadata = verify_dcp_checkpoint(
        path,
        model_state=model_sd,
        optimizer_keys=list(optimizers),
        strict=strict,
        weights_only=weights_only,
        content=False,
    )
    _check_content(path, read_digests(path))
    dcp.load(model_sd, checkpoint_id=path)
    set_model_state_dict(model, model_sd, options=StateDictOptions(strict=strict))
    loaded = flatten_state(model_sd)
    for key, optimizer in optimizers.items():
        optim_sd = {key: optimizer_state_dict(model, optimizer)}
        dcp.load(optim_sd, checkpoint_id=path)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=optim_sd[key], options=_SHARDED)
        loaded.extend(flatten_state(optim_sd))
    bad = first_nonfinite(loaded)
    if bad is not None:
        raise DamagedCheckpointError(path, f"{bad!r} holds NaN/Inf after loading")
    return metadata


def _legacy_warning(path: Path) -> None:
    warnings.warn(
        f"checkpoint {str(path)!r} has no {DIGESTS_FILENAME} (written before content digests): its bytes are not "
        "verified; the loaded tensors are still checked for NaN/Inf.",
        stacklevel=3,
    )


def verify_dcp_checkpoint(
    path: str | Path,
    *,
    model_state: Mapping[str, Any] | None = None,
    optimizer_keys: list[str] | tuple[str, ...] = (),
    strict: bool = True,
    weights_only: bool | None = None,
    content: bool = True,
) -> dict[str, Any]:
    """Checks a checkpoint folder before anything is loaded from it; returns its ``meta.pt``.

    Reads ``digests.json``, ``meta.pt`` and ``.metadata``, stats every file and, with ``content``,
    recomputes every file's SHA-256 (one read of the whole checkpoint); needs no process group.

    Args:
        path: A folder written by :func:`save_dcp_checkpoint`.
        model_state: The model view that will be loaded (``{fqn: tensor or DTensor}``); when
            given, every key must be in the checkpoint (only when ``strict``) with the same
            global shape.
        optimizer_keys: Optimizer view keys that must be present (``"optimizer"`` for the Trainer).
        strict: Require every key of ``model_state``.
        weights_only: Forwarded to ``torch.load`` for ``meta.pt``.
        content: Hash every file; ``False`` hashes only ``.metadata`` and ``meta.pt`` and checks
            the shard files' sizes (what ``--ckpt_path`` checks at launch; the load hashes the rest).

    Returns:
        The metadata dict saved in ``meta.pt``.

    Raises:
        FileNotFoundError: ``path`` is not a folder with a DCP ``.metadata`` file.
        DamagedCheckpointError: ``meta.pt`` is missing, a file is missing, has another size or
            digest than at save, the save was marked non-finite, ``meta.pt`` or ``.metadata`` is
            unreadable, or (no ``digests.json``) a shard file is shorter than the metadata says.
        ValueError: A model key is missing or has another shape, or an optimizer view is absent.
            The message names the file or FQN, what was expected and found, and the fix.
    """
    path = Path(path)
    if not is_dcp_checkpoint(path):
        raise FileNotFoundError(
            f"{str(path)!r} is not a DCP checkpoint folder (no .metadata file); pass a folder such "
            f"as <default_root_dir>/checkpoints/step-000050."
        )
    meta_file = path / METADATA_FILENAME
    if not meta_file.is_file():
        raise DamagedCheckpointError(path, f"it has no {METADATA_FILENAME} (the loop and data state)")
    record = read_digests(path)
    if record is None:
        _legacy_warning(path)
    else:
        if not record["finite"]:
            raise DamagedCheckpointError(
                path, f"it was saved from a non-finite state ({record.get('first_nonfinite')!r} holds NaN/Inf)"
            )
        names = list(record["files"])
        problem = check_files(path, record, names, hash_names=names if content else _SMALL_FILES)
        if problem is not None:
            raise DamagedCheckpointError(path, problem)
    try:
        metadata = torch.load(meta_file, weights_only=weights_only)
        dcp_metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # any unpickling / format error: name the folder, keep the cause
        raise DamagedCheckpointError(path, f"it cannot be read ({type(exc).__name__}: {exc})") from exc
    if not isinstance(metadata, dict):
        raise DamagedCheckpointError(path, f"{METADATA_FILENAME} holds a {type(metadata).__name__}, expected a dict")
    for name, end in sorted(_dcp_files(dcp_metadata).items()):
        shard = path / name
        size = shard.stat().st_size if shard.is_file() else None
        if size is None or size < end:
            found = "missing" if size is None else f"{size} bytes"
            raise DamagedCheckpointError(
                path, f"shard file {name!r} should hold at least {end} bytes, found {found} (a save cut short, or a "
                "copy that lost files)",
            )
    saved = dcp_metadata.state_dict_metadata
    for fqn, tensor in (model_state or {}).items():
        entry = saved.get(fqn)
        if entry is None:
            if strict:
                raise ValueError(
                    f"checkpoint {str(path)!r} has no tensor {fqn!r} that the model expects (shape "
                    f"{tuple(tensor.shape)}). Build the model of that run, or load non-strictly "
                    f"(LightningModule.strict_loading = False)."
                )
            continue
        saved_shape = tuple(getattr(entry, "size", ()))
        if hasattr(entry, "size") and saved_shape != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint {str(path)!r} holds {fqn!r} with shape {saved_shape}, the model has "
                f"{tuple(tensor.shape)}. Build the model of that run (same --model.config_name_or_path "
                f"and --model.config_overrides)."
            )
    for key in optimizer_keys:
        if not any(k.startswith(key + ".") for k in saved):
            raise ValueError(
                f"checkpoint {str(path)!r} has no optimizer view {key!r} (it holds model weights "
                f"only); load the weights without an optimizer, or resume from a training checkpoint."
            )
    return metadata


def checkpoint_tensor_keys(path: str | Path) -> dict[str, Any]:
    """The DCP metadata of a checkpoint folder: ``{flattened key: storage metadata}``.

    Tensor entries are ``TensorStorageMetadata`` (``.size``, ``.properties.dtype``); non-tensor
    entries (``param_groups``) are ``BytesStorageMetadata``. Reads only ``.metadata``; needs no
    process group.

    Args:
        path: A DCP checkpoint folder.

    Returns:
        ``FileSystemReader(path).read_metadata().state_dict_metadata`` as a dict.
    """
    return dict(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def checkpoint_problem(path: str | Path, *, content: bool) -> DamagedCheckpointError | None:
    """Why ``path`` cannot be resumed from (the same answer on every rank), or ``None``.

    Collective when a process group exists (any rank's finding counts; ``content`` hashes every
    file, spread over the ranks); without one, this process checks alone.

    Args:
        path: A checkpoint folder.
        content: Also recompute every file's SHA-256 (else: structure, sizes and the small files).
    """
    path = Path(path)
    try:
        verify_dcp_checkpoint(path, weights_only=False, content=False)
        problem = None
    except FileNotFoundError:
        problem = "it is not a DCP checkpoint folder (no .metadata file)"
    except DamagedCheckpointError as err:
        problem = err.problem
    problem = next((p for p in _gather(problem) if p is not None), None)  # any rank's finding
    if problem is not None:
        return DamagedCheckpointError(path, problem)
    if content:
        try:
            _check_content(path, read_digests(path))
        except DamagedCheckpointError as err:
            return err
    return None
