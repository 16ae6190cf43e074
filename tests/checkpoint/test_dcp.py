"""``lp_lightning.checkpoint.dcp``: HF-keyed DCP folders, FP32 views, exact round trip."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch.distributed.tensor import DTensor

from lp_lightning.checkpoint.dcp import (
    DIGESTS_FILENAME,
    METADATA_FILENAME,
    DamagedCheckpointError,
    NonFiniteStateError,
    checkpoint_tensor_keys,
    is_dcp_checkpoint,
    load_dcp_checkpoint,
    model_state_dict,
    optimizer_state_dict,
    save_dcp_checkpoint,
    verify_dcp_checkpoint,
)
from lp_lightning.fsdp.parallelize import build_dp_mesh, default_mixed_precision_policy, parallelize_causal_lm
from lp_lightning.models.adapter import adapter_for
from lp_lightning.models.deepseek_v3 import from_hf_config


def _sharded_tiny(seed: int, activation_checkpoint: str = "off"):
    model = from_hf_config("dsv3-tiny", seed=seed)
    parallelize_causal_lm(model, build_dp_mesh("cpu", 1), mp_policy=default_mixed_precision_policy(),
                          reshard_after_forward=True, activation_checkpoint=activation_checkpoint,
                          adapter=adapter_for(model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def _train_step(model, optimizer) -> None:
    ids_BT = torch.randint(0, 257, (2, 9), generator=torch.Generator().manual_seed(3))
    logits = model(input_ids=ids_BT[:, :-1]).logits
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids_BT[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_save_load_round_trip_with_hf_keys(tmp_path, single_rank_group):
    model, optimizer = _sharded_tiny(seed=0, activation_checkpoint="full")
    _train_step(model, optimizer)
    path = save_dcp_checkpoint(
        tmp_path / "step-000001",
        model_state=model_state_dict(model),
        optimizer_states={"optimizer": optimizer_state_dict(model, optimizer)},
        metadata={"global_step": 1},
        rank=0,
    )
    assert is_dcp_checkpoint(path) and (path / METADATA_FILENAME).is_file()
    keys = checkpoint_tensor_keys(path)
    model_keys = {k for k in keys if not k.startswith("optimizer.")}
    assert model_keys == set(model.state_dict())  # exactly the HF names, no wrapper prefix
    assert "model.layers.0.mlp.gate_proj.weight" in model_keys and "lm_head.weight" in model_keys
    for key in model_keys:
        assert keys[key].properties.dtype == torch.float32, key  # the FP32 master
    for fqn in ("model.layers.1.mlp.experts.gate_up_proj", "lm_head.weight"):
        for moment in ("exp_avg", "exp_avg_sq"):
            assert keys[f"optimizer.state.{fqn}.{moment}"].properties.dtype == torch.float32
        assert f"optimizer.state.{fqn}.step" in keys
    assert not any("_checkpoint_wrapped_module" in k for k in keys)

    fresh, fresh_opt = _sharded_tiny(seed=1)  # different init: everything must come from disk
    metadata = load_dcp_checkpoint(path, model=fresh, optimizers={"optimizer": fresh_opt})
    assert metadata == {"global_step": 1}
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert isinstance(q, DTensor) and torch.equal(p.full_tensor(), q.full_tensor()), name
    saved = optimizer_state_dict(model, optimizer)["state"]
    loaded = optimizer_state_dict(fresh, fresh_opt)["state"]
    assert saved.keys() == loaded.keys()
    for fqn in saved:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            a, b = saved[fqn][key], loaded[fqn][key]
            a = a.full_tensor() if isinstance(a, DTensor) else a
            b = b.full_tensor() if isinstance(b, DTensor) else b
            assert torch.equal(a, b), (fqn, key)
    # Continuing from the loaded state is bitwise the same as continuing the original.
    _train_step(model, optimizer)
    _train_step(fresh, fresh_opt)
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p.full_tensor(), q.full_tensor())


def test_errors(tmp_path, single_rank_group):
    model, optimizer = _sharded_tiny(seed=0)
    with pytest.raises(FileNotFoundError, match="not a DCP checkpoint folder"):
        load_dcp_checkpoint(tmp_path, model=model, optimizers={})
    with pytest.raises(ValueError, match="collides with model keys"):
        save_dcp_checkpoint(tmp_path / "x", model_state=model_state_dict(model),
                            optimizer_states={"model": optimizer_state_dict(model, optimizer)},
                            metadata={}, rank=0)
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="is a file"):
        save_dcp_checkpoint(tmp_path / "file", model_state={}, optimizer_states={}, metadata={}, rank=0)


def _save(model, optimizer, path, step):
    return save_dcp_checkpoint(
        path,
        model_state=model_state_dict(model),
        optimizer_states={"optimizer": optimizer_state_dict(model, optimizer)},
        metadata={"global_step": step},
        rank=0,
    )


def _masters(model) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().clone() for name, p in model.named_parameters()}


def test_save_is_atomic_and_overwrites_in_place(tmp_path, single_rank_group, monkeypatch):
    import lp_lightning.checkpoint.dcp as ckpt

    model, optimizer = _sharded_tiny(seed=0)
    first = _save(model, optimizer, tmp_path / "step-000001", 1)
    # A save killed after the shards, before the rename: no step-000002 appears, step-000001 stays.
    def killed(staging, path):
        raise KeyboardInterrupt("killed while saving")

    monkeypatch.setattr(ckpt, "_move_into_place", killed)
    with pytest.raises(KeyboardInterrupt):
        _save(model, optimizer, tmp_path / "step-000002", 2)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step-000002.partial", "step-000001"]
    assert load_dcp_checkpoint(first, model=model, optimizers={"optimizer": optimizer}) == {"global_step": 1}
    # The next save of that step replaces the leftover; saving over an existing folder replaces it.
    _save(model, optimizer, tmp_path / "step-000002", 2)
    _save(model, optimizer, tmp_path / "step-000002", 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001", "step-000002"]
    assert torch.load(tmp_path / "step-000002" / METADATA_FILENAME) == {"global_step": 3}


def _largest_item(path) -> tuple[str, int, int]:
    """(shard file, offset, length) of the largest tensor DCP wrote into ``path`` (raw bytes)."""
    import torch.distributed.checkpoint as dcp

    infos = dcp.FileSystemReader(str(path)).read_metadata().storage_data.values()
    info = max(infos, key=lambda i: int(i.length))
    return info.relative_path, int(info.offset), int(info.length)


def _overwrite_4k(path) -> str:
    """Overwrites 4 KiB inside the largest tensor of ``path`` with 0xFF (NaN as FP32); returns the file name."""
    name, offset, length = _largest_item(path)
    assert length >= 3 * 4096
    with open(path / name, "r+b") as stream:
        stream.seek(offset + length // 2)
        stream.write(b"\xff" * 4096)
    return name


def test_damaged_checkpoints_fail_before_anything_is_loaded(tmp_path, single_rank_group):
    import shutil

    source, source_opt = _sharded_tiny(seed=0)
    good = _save(source, source_opt, tmp_path / "good", 1)
    model, optimizer = _sharded_tiny(seed=1)
    before = _masters(model)

    def damaged(name: str, legacy: bool = False):
        path = tmp_path / name
        shutil.copytree(good, path)
        if legacy:  # a folder written before digests.json existed
            (path / DIGESTS_FILENAME).unlink()
        return path

    no_meta = damaged("no_meta")
    (no_meta / METADATA_FILENAME).unlink()
    truncated = damaged("truncated")
    shard = truncated / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    missing_shard = damaged("missing_shard")
    (missing_shard / "__0_0.distcp").unlink()
    flipped = damaged("flipped")  # same size, 4 KiB of 0xFF inside a tensor: only the digest sees it
    flipped_file = _overwrite_4k(flipped)
    truncated_metadata = damaged("truncated_metadata")
    dcp_meta = truncated_metadata / ".metadata"
    dcp_meta.write_bytes(dcp_meta.read_bytes()[:100])
    garbage_meta = damaged("garbage_meta")
    (garbage_meta / METADATA_FILENAME).write_bytes(b"not a pickle")
    garbage_digests = damaged("garbage_digests")
    (garbage_digests / DIGESTS_FILENAME).write_text("{")
    legacy_truncated = damaged("legacy_truncated", legacy=True)
    shard = legacy_truncated / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    legacy_garbage_meta = damaged("legacy_garbage_meta", legacy=True)
    (legacy_garbage_meta / METADATA_FILENAME).write_bytes(b"not a pickle")
    cases = [
        (no_meta, "has no meta.pt"),
        (truncated, r"file '__0_0.distcp' holds \d+ bytes, the save wrote \d+"),
        (missing_shard, "file '__0_0.distcp' is missing"),
        (flipped, f"file '{flipped_file}' does not match its SHA-256 digest"),
        (truncated_metadata, r"file '.metadata' holds 100 bytes, the save wrote \d+"),
        (garbage_meta, r"file 'meta.pt' holds 12 bytes"),
        (garbage_digests, "digests.json cannot be read"),
        (legacy_truncated, r"shard file '__0_0.distcp' should hold at least \d+ bytes, found \d+ bytes"),
        (legacy_garbage_meta, "cannot be read"),
    ]
    for path, message in cases:
        with pytest.warns(UserWarning, match="no digests.json") if "legacy" in path.name else nullcontext():
            with pytest.raises(DamagedCheckpointError, match=message) as info:
                load_dcp_checkpoint(path, model=model, optimizers={"optimizer": optimizer})
        assert str(path) in str(info.value) and "resume from another checkpoint folder" in str(info.value)
    # The quick check (what --ckpt_path runs at launch) sees all but the flipped bytes, which only the load's
    # digests find.
    assert verify_dcp_checkpoint(flipped, content=False) == {"global_step": 1}
    with pytest.raises(DamagedCheckpointError, match="does not match its SHA-256 digest"):
        verify_dcp_checkpoint(flipped)
    # A model-only checkpoint asked for its optimizer view.
    weights_only = save_dcp_checkpoint(
        tmp_path / "weights", model_state=model_state_dict(source), optimizer_states={}, metadata={}, rank=0
    )
    with pytest.raises(ValueError, match="has no optimizer view 'optimizer'"):
        load_dcp_checkpoint(weights_only, model=model, optimizers={"optimizer": optimizer})
    after = _masters(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was half-applied
    assert load_dcp_checkpoint(good, model=model, optimizers={"optimizer": optimizer}) == {"global_step": 1}


def test_digests_record_every_file(tmp_path, single_rank_group):
    import hashlib
    import json

    model, optimizer = _sharded_tiny(seed=0)
    path = _save(model, optimizer, tmp_path / "step-000001", 1)
    record = json.loads((path / DIGESTS_FILENAME).read_text())
    assert record["algorithm"] == "sha256" and record["finite"] is True and record["first_nonfinite"] is None
    on_disk = {p.name for p in path.iterdir()} - {DIGESTS_FILENAME}
    assert set(record["files"]) == on_disk == {".metadata", "__0_0.distcp", METADATA_FILENAME}
    for name, entry in record["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


def test_a_legacy_checkpoint_with_nan_bytes_fails_after_loading(tmp_path, single_rank_group):
    """Without digests (written before them) the flipped bytes load; the NaN check of what was read names the key."""
    model, optimizer = _sharded_tiny(seed=0)
    _train_step(model, optimizer)
    path = _save(model, optimizer, tmp_path / "step-000001", 1)
    (path / DIGESTS_FILENAME).unlink()
    _overwrite_4k(path)
    fresh, fresh_opt = _sharded_tiny(seed=1)
    with pytest.warns(UserWarning, match="no digests.json"):
        with pytest.raises(DamagedCheckpointError, match=r"'[\w.]+' holds NaN/Inf after loading"):
            load_dcp_checkpoint(path, model=fresh, optimizers={"optimizer": fresh_opt})


def test_a_non_finite_state_is_never_saved_unless_asked_and_then_never_resumed(tmp_path, single_rank_group):
    from lp_lightning.checkpoint.resume import newest_intact_checkpoint

    model, optimizer = _sharded_tiny(seed=0)
    _train_step(model, optimizer)
    good = _save(model, optimizer, tmp_path / "step-000001", 1)
    with torch.no_grad():
        model.model.embed_tokens.weight.to_local().view(-1)[5] = float("inf")
    with pytest.raises(NonFiniteStateError, match="'model.embed_tokens.weight' holds NaN/Inf") as info:
        _save(model, optimizer, tmp_path / "step-000002", 2)
    assert info.value.fqn == "model.embed_tokens.weight"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]  # nothing written, not even a partial
    # A NaN moment is found too (the optimizer view is checked as well as the masters).
    with torch.no_grad():
        model.model.embed_tokens.weight.to_local().view(-1)[5] = 0.0
        moment = optimizer.state[model.lm_head.weight]["exp_avg_sq"]
        moment.to_local().view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteStateError, match="'optimizer.state.lm_head.weight.exp_avg_sq' holds NaN/Inf"):
        _save(model, optimizer, tmp_path / "step-000002", 2)
    # Written on request (post-mortem), marked: refused on load, skipped by the newest-intact search.
    marked = save_dcp_checkpoint(
        tmp_path / "step-000002", model_state=model_state_dict(model),
        optimizer_states={"optimizer": optimizer_state_dict(model, optimizer)}, metadata={"global_step": 2},
        rank=0, allow_nonfinite=True,
    )
    with pytest.raises(DamagedCheckpointError, match="saved from a non-finite state"):
        load_dcp_checkpoint(marked, model=model, optimizers={"optimizer": optimizer})
    skipped = []
    assert newest_intact_checkpoint([marked, good], content=True, on_skip=lambda p, e: skipped.append(p)) == good
    assert skipped == [marked]


def test_checkpoint_of_another_model_names_the_fqn_and_shapes(tmp_path, single_rank_group):
    from torch import nn

    model, optimizer = _sharded_tiny(seed=0)
    path = _save(model, optimizer, tmp_path / "step-000001", 1)
    other, other_opt = _sharded_tiny(seed=0)
    # Same names, one shape changed (as a different hidden size or vocab would): fail naming it.
    other.lm_head.weight = nn.Parameter(torch.zeros(7, 3))
    with pytest.raises(ValueError, match=r"holds 'lm_head.weight' with shape \(512, 256\), the model has \(7, 3\)"):
        load_dcp_checkpoint(path, model=other, optimizers={})
