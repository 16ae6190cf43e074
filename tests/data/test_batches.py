"""Deterministic batches: pure function of (seed, step, micro_step, split, rank), rank slicing,
train/val disjointness, fixed validation tiling, and the resume-exact dataset adapters."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lp_lightning.data import (
    Split,
    StepBatchDataset,
    StepBatchStream,
    StepSampler,
    ValBatchDataset,
    batch_for,
    build_token_cache,
    inputs_and_labels,
    num_val_batches,
    train_window_starts,
    val_batch,
)

G, T = 8, 16


@pytest.fixture
def cache(text_dir: Path, cache_dir: Path):
    return build_token_cache([str(text_dir)], "byte", cache_dir)


def kw(**over):
    base = dict(split="train", seed=2026, step=3, micro_step=1, global_batch_size=G, seq_len=T)
    base.update(over)
    return base


def test_shape_dtype_and_windows_are_real_stream_slices(cache):
    x = batch_for(cache, **kw())
    assert x.shape == (G, T + 1) and x.dtype == torch.int64 and x.is_contiguous()
    stream = np.asarray(cache.tokens).tobytes()
    for row in x.numpy().astype(np.uint16):
        assert row.tobytes() in stream  # every row is a contiguous window of the token stream


def test_same_arguments_same_tensor_independent_of_global_rng(cache):
    torch.manual_seed(1)
    np.random.seed(1)
    a = batch_for(cache, **kw())
    torch.manual_seed(999)
    np.random.seed(999)
    torch.rand(100)
    b = batch_for(cache, **kw())
    assert torch.equal(a, b)


def test_every_key_component_changes_the_batch(cache):
    ref = batch_for(cache, **kw())
    for change in (dict(seed=2027), dict(step=4), dict(micro_step=0)):
        assert not torch.equal(batch_for(cache, **kw(**change)), ref), change


@pytest.mark.slow
def test_bitwise_identical_in_a_fresh_subprocess(cache, tmp_path: Path):
    here = batch_for(cache, **kw(step=7, micro_step=2, world_size=2, rank=1))
    out = tmp_path / "batch.npy"
    code = (
        "import sys, numpy as np, torch\n"
        "torch.manual_seed(12345)\n"
        "from lp_lightning.data import TokenCache, batch_for\n"
        "c = TokenCache.open(sys.argv[1])\n"
        f"x = batch_for(c, split='train', seed=2026, step=7, micro_step=2, global_batch_size={G},"
        f" seq_len={T}, rank=1, world_size=2)\n"
        "np.save(sys.argv[2], x.numpy())\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="random")
    subprocess.run([sys.executable, "-c", code, str(cache.path), str(out)], check=True, env=env,
                   timeout=120)
    there = np.load(out)
    assert there.dtype == np.int64 and there.tobytes() == here.numpy().tobytes()


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("split", ["train", "val"])
def test_rank_slices_concatenate_to_the_world_size_1_batch(cache, world_size, split):
    whole = batch_for(cache, **kw(split=split))
    parts = [batch_for(cache, **kw(split=split, rank=r, world_size=world_size))
             for r in range(world_size)]
    assert all(p.shape == (G // world_size, T + 1) for p in parts)
    assert torch.equal(torch.cat(parts), whole)


def test_bad_rank_layout_and_arguments(cache):
    with pytest.raises(ValueError, match="not divisible by world_size=3"):
        batch_for(cache, **kw(world_size=3))
    with pytest.raises(ValueError, match="rank must be in"):
        batch_for(cache, **kw(rank=2, world_size=2))
    with pytest.raises(ValueError, match="step must be >= 0"):
        batch_for(cache, **kw(step=-1))
    with pytest.raises(TypeError, match="seq_len must be an int"):
        batch_for(cache, **kw(seq_len=16.0))
    with pytest.raises(TypeError, match="seed must be an int"):
        batch_for(cache, **kw(seed="a"))
    with pytest.raises(ValueError, match="split must be one of"):
        batch_for(cache, **kw(split="test"))
    with pytest.raises(ValueError, match="fewer than seq_len"):
        batch_for(cache, **kw(split="val", seq_len=cache.n_tokens))
    with pytest.raises(TypeError, match="1-D"):
        batch_for(np.zeros((2, 50), dtype=np.int64), **kw())


def test_train_and_val_windows_never_overlap():
    # Unique token values make each token's position recoverable from the batch itself.
    tokens = np.arange(4000, dtype=np.int64)
    cut = 4000 - 200  # val_fraction 0.05, raw cut (plain arrays are not EOS-snapped)
    seen_train, seen_val = set(), set()
    for step in range(40):
        seen_train.update(batch_for(tokens, **kw(step=step)).flatten().tolist())
        seen_val.update(batch_for(tokens, **kw(step=step, split="val")).flatten().tolist())
    assert max(seen_train) < cut <= min(seen_val)
    assert not seen_train & seen_val
    assert max(seen_train) > cut - 200 and max(seen_val) == 3999  # both splits reach their ends
    # torch tensors are accepted the same way.
    assert torch.equal(batch_for(torch.from_numpy(tokens), **kw()), batch_for(tokens, **kw()))


def test_cache_windows_stay_inside_their_split(cache):
    for split in (Split.TRAIN, Split.VAL):
        start, end = cache.split_range(split)
        for step in range(20):
            rel = train_window_starts(split=split, seed=0, step=step, micro_step=0,
                                      rows=range(G), n_starts=end - start - T)
            assert (rel >= 0).all() and (start + rel + T + 1 <= end).all()
    assert cache.split_range(Split.TRAIN)[1] == cache.split_range(Split.VAL)[0]


def test_inputs_and_labels_are_shifted_views(cache):
    x = batch_for(cache, **kw())
    d = inputs_and_labels(x)
    assert d["input_ids"].shape == d["labels"].shape == (G, T)
    assert torch.equal(d["input_ids"][:, 1:], d["labels"][:, :-1])
    assert torch.equal(d["labels"][:, -1], x[:, -1])
    assert d["labels"].is_contiguous()
    with pytest.raises(ValueError, match=r"\[b, T \+ 1\]"):
        inputs_and_labels(torch.zeros(4, 1, dtype=torch.long))


def test_val_batches_tile_the_validation_split(cache):
    v0, v1 = cache.split_range(Split.VAL)
    n = num_val_batches(cache, global_batch_size=2, seq_len=T)
    assert n == ((v1 - v0) // (T + 1)) // 2 and n >= 2
    got = torch.cat([val_batch(cache, index=k, global_batch_size=2, seq_len=T) for k in range(n)])
    expected = np.asarray(cache.tokens[v0 : v0 + n * 2 * (T + 1)]).reshape(-1, T + 1)
    assert torch.equal(got, torch.from_numpy(expected.astype(np.int64)))
    halves = [val_batch(cache, index=1, global_batch_size=2, seq_len=T, rank=r, world_size=2)
              for r in range(2)]
    assert torch.equal(torch.cat(halves), val_batch(cache, index=1, global_batch_size=2, seq_len=T))
    with pytest.raises(ValueError, match=f"holds {n} batches"):
        val_batch(cache, index=n, global_batch_size=2, seq_len=T)
    assert num_val_batches(cache, global_batch_size=2, seq_len=T, val_fraction=0.0) == 0


def test_step_dataset_indexing_and_resume_equals_continuous_run(cache):
    ga, steps = 3, 4
    ds = StepBatchDataset(cache, seed=5, global_batch_size=G, seq_len=T, grad_accum=ga,
                          rank=1, world_size=2)
    item = ds[2 * ga + 1]
    ref = batch_for(cache, **kw(seed=5, step=2, micro_step=1, rank=1, world_size=2))
    assert torch.equal(item["input_ids"], ref[:, :-1]) and torch.equal(item["labels"], ref[:, 1:])

    def run(start_step):
        loader = DataLoader(ds, batch_size=None, shuffle=False,
                            sampler=StepSampler(start_step=start_step, max_steps=steps,
                                                grad_accum=ga))
        return [b["input_ids"] for b in loader]

    continuous, resumed = run(0), run(2)
    assert len(continuous) == steps * ga and len(resumed) == (steps - 2) * ga
    assert all(torch.equal(a, b) for a, b in zip(continuous[2 * ga :], resumed, strict=True))


def test_stream_matches_dataset_and_sampler(cache):
    ds = StepBatchDataset(cache, seed=5, global_batch_size=G, seq_len=T, grad_accum=2)
    stream = StepBatchStream(ds, start_step=1, max_steps=4)
    assert not hasattr(stream, "__len__")  # Lightning must treat the epoch as infinite
    got = [b["labels"] for b in DataLoader(stream, batch_size=None)]
    expected = [ds[i]["labels"] for i in range(2, 8)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    endless = iter(StepBatchStream(ds, start_step=1))
    assert all(torch.equal(next(endless)["labels"], e) for e in expected)


@pytest.mark.slow
def test_stream_order_is_kept_with_two_workers(cache):
    ds = StepBatchDataset(cache, seed=5, global_batch_size=G, seq_len=T, grad_accum=2)
    stream = StepBatchStream(ds, start_step=0, max_steps=3)
    got = [b["input_ids"] for b in DataLoader(stream, batch_size=None, num_workers=2)]
    expected = [ds[i]["input_ids"] for i in range(6)]
    assert len(got) == 6 and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_dataset_and_sampler_validation(cache):
    with pytest.raises(ValueError, match="fewer than seq_len"):
        StepBatchDataset(cache, seed=0, global_batch_size=G, seq_len=cache.n_tokens, split="val")
    with pytest.raises(ValueError, match="grad_accum must be >= 1"):
        StepBatchDataset(cache, seed=0, global_batch_size=G, seq_len=T, grad_accum=0)
    with pytest.raises(ValueError, match="not divisible"):
        StepBatchDataset(cache, seed=0, global_batch_size=G, seq_len=T, world_size=3)
    with pytest.raises(ValueError, match="max_steps must be >= 5"):
        StepSampler(start_step=5, max_steps=4)
    with pytest.raises(TypeError, match="StepBatchDataset"):
        StepBatchStream([], max_steps=1)  # type: ignore[arg-type]
    ds = StepBatchDataset(cache, seed=0, global_batch_size=G, seq_len=T)
    with pytest.raises(ValueError, match="max_steps must be >= 3"):
        StepBatchStream(ds, start_step=3, max_steps=2)


def test_val_dataset(cache):
    ds = ValBatchDataset(cache, global_batch_size=2, seq_len=T, rank=0, world_size=2, limit=2)
    assert len(ds) == 2
    ref = val_batch(cache, index=1, global_batch_size=2, seq_len=T, world_size=2)
    assert torch.equal(ds[1]["input_ids"], ref[:, :-1])
    with pytest.raises(IndexError):
        ds[2]
    assert len(list(DataLoader(ds, batch_size=None))) == 2
