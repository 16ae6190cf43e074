"""Pretraining data: real text offline, tokenised once into a memory-mapped cache, and
deterministic batches that are a pure function of (seed, step, micro_step, split, rank).

Typical use (what the Lightning/CLI layer does)::

    from lp_lightning.data import build_token_cache, StepBatchDataset, StepBatchStream

    cache = build_token_cache(sources=None, tokenizer="byte", cache_dir=run_dir / "tokens")
    ds = StepBatchDataset(cache, seed=2026, global_batch_size=8, seq_len=256, grad_accum=2,
                          rank=rank, world_size=world_size)
    loader = DataLoader(StepBatchStream(ds, start_step=global_step, max_steps=max_steps),
                        batch_size=None)

Modules: ``corpus`` (which files; text or binary), ``tokenizer`` (byte / local HF tokenizer.json),
``token_cache`` (tokenise once, memmap, train/val split), ``batches`` (sampling and datasets),
``checks`` (enough tokens for one train sequence and one validation batch, counted before any build).
"""

from lp_lightning.data.batches import (
    StepBatchDataset,
    StepBatchStream,
    StepSampler,
    ValBatchDataset,
    batch_for,
    inputs_and_labels,
    num_val_batches,
    train_window_starts,
    val_batch,
)
from lp_lightning.data.corpus import (
    DEFAULT_CORPUS_MAX_BYTES,
    TEXT_SUFFIXES,
    Corpus,
    SourceFile,
    binary_problem,
    default_corpus,
    first_binary_file,
    resolve_corpus,
)
from lp_lightning.data.token_cache import (
    CACHE_FORMAT_VERSION,
    DEFAULT_VAL_FRACTION,
    Split,
    TokenCache,
    build_token_cache,
    cache_key,
    default_cache_dir,
    find_token_cache,
    split_bounds,
    token_dtype_for,
)
from lp_lightning.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)

__all__ = [
    "CACHE_FORMAT_VERSION",
    "DEFAULT_CORPUS_MAX_BYTES",
    "DEFAULT_VAL_FRACTION",
    "TEXT_SUFFIXES",
    "ByteTokenizer",
    "Corpus",
    "HFTokenizer",
    "SourceFile",
    "Split",
    "StepBatchDataset",
    "StepBatchStream",
    "StepSampler",
    "TokenCache",
    "Tokenizer",
    "ValBatchDataset",
    "batch_for",
    "binary_problem",
    "build_token_cache",
    "cache_key",
    "default_cache_dir",
    "default_corpus",
    "find_token_cache",
    "first_binary_file",
    "inputs_and_labels",
    "load_tokenizer",
    "num_val_batches",
    "resolve_corpus",
    "split_bounds",
    "token_dtype_for",
    "train_window_starts",
    "val_batch",
]
