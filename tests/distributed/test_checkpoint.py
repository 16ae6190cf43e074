"""``lp_lightning.distributed.checkpoint``: HF-keyed DCP folders, FP32 views, exact round trip."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from lp_lightning.distributed.checkpoint import (
    METADATA_FILENAME,
    checkpoint_tensor_keys,
    is_dcp_checkpoint,
    load_dcp_checkpoint,
    model_state_dict,
    optimizer_state_dict,
    save_dcp_checkpoint,
)
from lp_lightning.distributed.fsdp import build_dp_mesh, default_mixed_precision_policy, parallelize_causal_lm
from lp_lightning.models.deepseek_v3 import from_hf_config


def _sharded_tiny(seed: int, activation_checkpoint: str = "off"):
    model = from_hf_config("dsv3-tiny", seed=seed)
    parallelize_causal_lm(model, build_dp_mesh("cpu", 1), mp_policy=default_mixed_precision_policy(),
                          reshard_after_forward=True, activation_checkpoint=activation_checkpoint)
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
    import lp_lightning.distributed.checkpoint as ckpt

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


def test_damaged_checkpoints_fail_before_anything_is_loaded(tmp_path, single_rank_group):
    import shutil

    source, source_opt = _sharded_tiny(seed=0)
    good = _save(source, source_opt, tmp_path / "good", 1)
    model, optimizer = _sharded_tiny(seed=1)
    before = _masters(model)

    def damaged(name: str):
        path = tmp_path / name
        shutil.copytree(good, path)
        return path

    no_meta = damaged("no_meta")
    (no_meta / METADATA_FILENAME).unlink()
    truncated = damaged("truncated")
    shard = truncated / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    missing_shard = damaged("missing_shard")
    (missing_shard / "__0_0.distcp").unlink()
    garbage_meta = damaged("garbage_meta")
    (garbage_meta / METADATA_FILENAME).write_bytes(b"not a pickle")
    cases = [
        (no_meta, "has no meta.pt"),
        (truncated, r"shard file '__0_0.distcp' should hold at least \d+ bytes, found \d+ bytes"),
        (missing_shard, r"shard file '__0_0.distcp' should hold at least \d+ bytes, found missing"),
        (garbage_meta, "cannot be read"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            load_dcp_checkpoint(path, model=model, optimizers={"optimizer": optimizer})
        assert "resume from another checkpoint folder" in str(info.value)
    # A model-only checkpoint asked for its optimizer view.
    weights_only = save_dcp_checkpoint(
        tmp_path / "weights", model_state=model_state_dict(source), optimizer_states={}, metadata={}, rank=0
    )
    with pytest.raises(ValueError, match="has no optimizer view 'optimizer'"):
        load_dcp_checkpoint(weights_only, model=model, optimizers={"optimizer": optimizer})
    after = _masters(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was half-applied
    assert load_dcp_checkpoint(good, model=model, optimizers={"optimizer": optimizer}) == {"global_step": 1}


def test_checkpoint_of_another_model_names_the_fqn_and_shapes(tmp_path, single_rank_group):
    from torch import nn

    model, optimizer = _sharded_tiny(seed=0)
    path = _save(model, optimizer, tmp_path / "step-000001", 1)
    other, other_opt = _sharded_tiny(seed=0)
    # Same names, one shape changed (as a different hidden size or vocab would): fail naming it.
    other.lm_head.weight = nn.Parameter(torch.zeros(7, 3))
    with pytest.raises(ValueError, match=r"holds 'lm_head.weight' with shape \(512, 256\), the model has \(7, 3\)"):
        load_dcp_checkpoint(path, model=other, optimizers={})
