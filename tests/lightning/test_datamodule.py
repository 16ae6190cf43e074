"""PretrainDataModule: resumable stream position, geometry checks, rank slicing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lp_lightning.data import StepBatchDataset, build_token_cache
from lp_lightning.lightning.datamodule import PretrainDataModule, ResumableStepStream, _StatefulLoader


def _trainer(**kw):
    defaults = {"accumulate_grad_batches": 1, "world_size": 1, "global_rank": 0, "max_steps": 3, "global_step": 0}
    return SimpleNamespace(**{**defaults, **kw})


def test_stream_resumes_at_position_with_full_length(token_cache_dir):
    cache = build_token_cache(None, "byte", token_cache_dir)
    ds = StepBatchDataset(cache, seed=0, global_batch_size=2, seq_len=8, grad_accum=2)
    full = list(ResumableStepStream(ds, total_micro_batches=6, start=0))
    stream = ResumableStepStream(ds, total_micro_batches=6, start=4)
    assert len(stream) == 6  # the whole run: Lightning counts restored batches as fetched
    resumed = list(stream)
    assert len(resumed) == 2
    for a, b in zip(full[4:], resumed, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    with pytest.raises(ValueError, match="start=7"):
        ResumableStepStream(ds, total_micro_batches=6, start=7)


def test_loader_state_checks_geometry_and_position(token_cache_dir):
    cache = build_token_cache(None, "byte", token_cache_dir)
    ds = StepBatchDataset(cache, seed=0, global_batch_size=2, seq_len=8)
    loader = _StatefulLoader(ResumableStepStream(ds, total_micro_batches=4, start=2), {"seed": 0, "seq_len": 8})
    it = iter(loader)
    next(it)
    assert loader.state_dict() == {"next_micro_index": 3, "seed": 0, "seq_len": 8}
    fresh = _StatefulLoader(ResumableStepStream(ds, total_micro_batches=4, start=3), {"seed": 0, "seq_len": 8})
    fresh.load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match=r"data seq_len=16 differs from this run's seq_len=8"):
        fresh.load_state_dict({"next_micro_index": 3, "seed": 0, "seq_len": 16})
    with pytest.raises(ValueError, match=r"micro-batch 1\) does not match"):
        fresh.load_state_dict({"next_micro_index": 1, "seed": 0, "seq_len": 8})


def test_setup_checks_batch_divisibility(token_cache_dir):
    dm = PretrainDataModule(cache_dir=token_cache_dir, global_batch_size=6, seq_len=8)
    dm.trainer = _trainer(accumulate_grad_batches=2, world_size=2)
    with pytest.raises(ValueError, match=r"data.global_batch_size=6 must be divisible by .* = 4"):
        dm.setup("fit")
    dm.trainer = _trainer(max_steps=-1)
    with pytest.raises(ValueError, match=r"trainer.max_steps must be >= 1"):
        dm.setup("fit")


def test_ranks_split_the_global_micro_batch(token_cache_dir):
    def first_batch(rank: int, world_size: int):
        dm = PretrainDataModule(cache_dir=token_cache_dir, global_batch_size=4, seq_len=8)
        dm.trainer = _trainer(accumulate_grad_batches=2, world_size=world_size, global_rank=rank)
        dm.setup("fit")
        return next(iter(dm.train_dataloader()))["input_ids"]

    single = first_batch(0, 1)
    assert single.shape == (2, 8)  # 4 sequences per step / 2 micro-batches
    assert torch.equal(torch.cat([first_batch(0, 2), first_batch(1, 2)]), single)
    assert PretrainDataModule(global_batch_size=4, seq_len=8).tokens_per_step == 32
