"""DCP (torch.distributed.checkpoint) checkpoints with Hugging Face parameter names as keys (§11).

Layout of one checkpoint folder, e.g. ``<default_root_dir>/checkpoints/step-000050/``::

    .metadata          DCP metadata (tensor keys, shapes, dtypes, chunk placement)
    __<rank>_0.distcp  this rank's shards (one file per rank)
    meta.pt            everything that is not a tensor view (``torch.save`` on rank 0): for the
                       Trainer the loop state (global step, epoch/batch progress), LR scheduler,
                       callback, datamodule (data position) and precision-plugin states

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
module (``lp_lightning.integration.weights``) exposes the plain FP32 master shard under the same HF key,
so the checkpoint holds no tensor subclass and no derived data/scale, loads with
``weights_only=True``, into a plain HF ``DeepseekV3ForCausalLM`` (``dcp.load`` without a process
group) and into a run of any precision. Loading copies into the master in place; the strategies then
rebuild the 8-bit storage from it once (``LowPrecisionFabricPlugin.rebuild_after_load``, design spec §11).

Writing is atomic per folder: every rank writes into a hidden sibling ``.<name>.partial/``, rank 0
adds ``meta.pt`` last and renames the folder into place, so a run killed while saving leaves the
previous checkpoints untouched and no folder that looks complete but is not. Loading first checks
the folder (``meta.pt`` readable, every shard file present and long enough, every model key
present with the model's shape) and only then copies anything into the model, so a damaged
checkpoint fails with a message naming the file or FQN and leaves the model as it was.

Both views come from ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` /
``get_optimizer_state_dict`` on the *HF module* (not on a wrapper such as the LightningModule,
which would prefix every key with its attribute name), and are restored with the matching
``set_*`` functions, so sharded checkpoints re-shard on load to any world size.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
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

__all__ = [
    "DAMAGED_CHECKPOINT_FIX",
    "METADATA_FILENAME",
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

DAMAGED_CHECKPOINT_FIX = "resume from another checkpoint folder (an earlier step-NNNNNN) or start without --ckpt_path"
"""The fix that ends :func:`verify_dcp_checkpoint`'s messages about an incomplete or unreadable folder."""

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


def save_dcp_checkpoint(
    path: str | Path,
    *,
    model_state: Mapping[str, Any],
    optimizer_states: Mapping[str, Mapping[str, Any]],
    metadata: Mapping[str, Any],
    rank: int,
) -> Path:
    """Writes one sharded checkpoint folder (collective: every rank must call it).

    Args:
        path: Target folder; created if missing. An existing *file* at that path is an error.
        model_state: :func:`model_state_dict` of the HF module (top-level DCP keys).
        optimizer_states: ``{key: optimizer_state_dict(...)}``; each lands under ``key.``.
        metadata: Picklable non-tensor state, written to ``meta.pt`` by rank 0.
        rank: Global rank of the caller.

    Returns:
        The folder path.

    Raises:
        FileExistsError: ``path`` exists and is a file.
        ValueError: An optimizer key collides with a model key.
    """
    path = Path(path)
    if path.is_file():
        raise FileExistsError(f"checkpoint path {str(path)!r} is a file; DCP checkpoints are folders.")
    _check_key_collisions(model_state, list(optimizer_states))
    staging = path.parent / f".{path.name}.partial"
    if rank == 0:
        if staging.exists():  # left by a run killed while saving
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    _barrier()
    state: dict[str, Any] = dict(model_state)
    state.update(optimizer_states)
    dcp.save(state, checkpoint_id=staging)
    if rank == 0:
        torch.save(dict(metadata), staging / METADATA_FILENAME)
        _move_into_place(staging, path)
    _barrier()
    return path


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


def load_dcp_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizers: Mapping[str, Optimizer],
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Restores the model view, then each optimizer view, in place; returns ``meta.pt``.

    Collective: every rank must call it. The model is restored first (high-precision weights),
    then the optimizer state (design spec §11: "恢复时先恢复模型与 optimizer 高精状态").

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
        ValueError: The folder is incomplete or damaged, or does not fit ``model`` (see
            :func:`verify_dcp_checkpoint`); nothing has been loaded.
    """
    path = Path(path)
    model_sd = model_state_dict(model)
    metadata = verify_dcp_checkpoint(
        path,
        model_state=model_sd,
        optimizer_keys=list(optimizers),
        strict=strict,
        weights_only=weights_only,
    )
    dcp.load(model_sd, checkpoint_id=path)
    set_model_state_dict(model, model_sd, options=StateDictOptions(strict=strict))
    for key, optimizer in optimizers.items():
        optim_sd = {key: optimizer_state_dict(model, optimizer)}
        dcp.load(optim_sd, checkpoint_id=path)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=optim_sd[key], options=_SHARDED)
    return metadata


def verify_dcp_checkpoint(
    path: str | Path,
    *,
    model_state: Mapping[str, Any] | None = None,
    optimizer_keys: list[str] | tuple[str, ...] = (),
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Checks a checkpoint folder before anything is loaded from it; returns its ``meta.pt``.

    Reads ``meta.pt`` and ``.metadata`` and stats the shard files; reads no tensor data and
    needs no process group.

    Args:
        path: A folder written by :func:`save_dcp_checkpoint`.
        model_state: The model view that will be loaded (``{fqn: tensor or DTensor}``); when
            given, every key must be in the checkpoint (only when ``strict``) with the same
            global shape.
        optimizer_keys: Optimizer view keys that must be present (``"optimizer"`` for the Trainer).
        strict: Require every key of ``model_state``.
        weights_only: Forwarded to ``torch.load`` for ``meta.pt``.

    Returns:
        The metadata dict saved in ``meta.pt``.

    Raises:
        FileNotFoundError: ``path`` is not a folder with a DCP ``.metadata`` file.
        ValueError: ``meta.pt`` or ``.metadata`` is missing or unreadable, a shard file is
            missing or shorter than the metadata says (a save that was cut short), a model key is
            missing or has another shape, or an optimizer view is absent. The message names the
            file or FQN, what was expected and found, and the fix.
    """
    path = Path(path)
    if not is_dcp_checkpoint(path):
        raise FileNotFoundError(
            f"{str(path)!r} is not a DCP checkpoint folder (no .metadata file); pass a folder such "
            f"as <default_root_dir>/checkpoints/step-000050."
        )
    fix = DAMAGED_CHECKPOINT_FIX
    meta_file = path / METADATA_FILENAME
    if not meta_file.is_file():
        raise ValueError(f"checkpoint {str(path)!r} has no {METADATA_FILENAME} (the loop and data state); {fix}.")
    try:
        metadata = torch.load(meta_file, weights_only=weights_only)
        dcp_metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # any unpickling / format error: name the folder, keep the cause
        raise ValueError(f"checkpoint {str(path)!r} cannot be read ({type(exc).__name__}: {exc}); {fix}.") from exc
    if not isinstance(metadata, dict):
        raise ValueError(f"{str(meta_file)!r} holds a {type(metadata).__name__}, expected a dict; {fix}.")
    needed: dict[str, int] = {}
    for info in dcp_metadata.storage_data.values():
        relative_path = getattr(info, "relative_path", None)
        if relative_path is not None:
            end = int(info.offset) + int(info.length)
            needed[relative_path] = max(needed.get(relative_path, 0), end)
    for name, end in sorted(needed.items()):
        shard = path / name
        size = shard.stat().st_size if shard.is_file() else None
        if size is None or size < end:
            found = "missing" if size is None else f"{size} bytes"
            raise ValueError(
                f"checkpoint {str(path)!r} is incomplete: shard file {name!r} should hold at least "
                f"{end} bytes, found {found} (a save cut short, or a copy that lost files); {fix}."
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
