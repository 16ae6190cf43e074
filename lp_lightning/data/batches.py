"""Deterministic language-model batches: a pure function of (seed, step, micro_step, split, rank).

This is the data side of requirement R12 (docs/design.md) "same seed, same batch order" and of design spec §16.6
``deterministic_batch(step, micro_step)``: every case (bf16 / mxfp8 / hif8_current), every rank
count and every resumed run sees the same tokens for the same ``(step, micro_step)``.

Shape legend:
    G  global batch size (rows of one micro-batch summed over all ranks)
    b  per-rank rows, ``G // world_size``
    T  sequence length (model inputs per row); a window holds ``T + 1`` tokens

Training batches (:func:`batch_for`). Row ``i`` (``0 <= i < G``) of the global micro-batch of
``(seed, step, micro_step)`` is the window ``tokens[s : s + T + 1]`` with
``s = start + H(seed, split, step, micro_step, i) mod (end - start - T)``, where ``[start, end)``
is the split's token range (``token_cache.split_range``) and ``H`` is the first 8 bytes
(little-endian) of BLAKE2b over ``"lp_lightning.batch.v1|<split>|<seed>|<step>|<micro_step>|<i>"``.
So windows are uniform with replacement over all start positions of the split, independent of any
global RNG state and of torch / numpy generator versions, and rank ``r`` computes only its rows
``[r * b, (r + 1) * b)``: concatenating the ranks' batches gives exactly the ``world_size == 1``
batch. (A keyed hash rather than a seeded ``torch.Generator`` is used for that reason: a rank need
not draw the other ranks' rows, and the stream cannot change with a library upgrade.)

Validation batches (:func:`val_batch`): the validation split is tiled by consecutive,
non-overlapping windows of ``T + 1`` tokens; global validation batch ``k`` holds windows
``k * G + i`` for ``i < G`` and rank ``r`` again takes rows ``[r * b, (r + 1) * b)``. The set is
fixed (no seed): every run evaluates on the same tokens. :func:`num_val_batches` says how many fit.

Inputs / labels: a window ``w`` of ``T + 1`` tokens gives ``input_ids = w[:-1]`` and
``labels = w[1:]``, i.e. labels are ALREADY SHIFTED next-token targets aligned with the inputs.
Compute ``cross_entropy(logits.view(-1, V), labels.view(-1))`` directly, or call a Hugging Face
causal LM with ``labels=labels, shift_labels=labels`` (``labels`` only switches the loss on;
``shift_labels`` stops ``ForCausalLMLoss`` from shifting again; checked against transformers 5.x).
Never pass them as ``labels=`` alone: HF would shift once more and drop a target per row.

Resume (:class:`StepBatchDataset`, :class:`StepSampler`, :class:`StepBatchStream`): item index
``i = step * grad_accum + micro_step`` is the global micro-batch counter. A run resumed at optimizer
step ``k`` starts its sampler/stream at ``k * grad_accum`` and so sees exactly the batches the
continuous run saw from step ``k`` on. Nothing about the data has to be checkpointed except ``k``
(Lightning's ``trainer.global_step``).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

from lp_lightning.data.token_cache import (
    DEFAULT_VAL_FRACTION,
    Split,
    TokenCache,
    _as_split,
    split_bounds,
)

__all__ = [
    "StepBatchDataset",
    "StepBatchStream",
    "StepSampler",
    "ValBatchDataset",
    "batch_for",
    "inputs_and_labels",
    "num_val_batches",
    "train_window_starts",
    "val_batch",
]

TokenSource = TokenCache | np.ndarray | torch.Tensor
"""A :class:`TokenCache`, or a 1-D token array / tensor (split at the raw cut, no EOS snapping)."""

_HASH_DOMAIN = "lp_lightning.batch.v1"


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"{name} must be an int >= {minimum}; got {type(value).__name__} {value!r}."
        )
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}.")
    return int(value)


def _check_ranks(global_batch_size: int, rank: int, world_size: int) -> int:
    """Validates the rank layout; returns the per-rank batch ``b``."""
    g = _check_int("global_batch_size", global_batch_size, 1)
    ws = _check_int("world_size", world_size, 1)
    r = _check_int("rank", rank, 0)
    if r >= ws:
        raise ValueError(f"rank must be in [0, world_size={ws}); got rank={r}.")
    if g % ws != 0:
        raise ValueError(
            f"global_batch_size={g} is not divisible by world_size={ws}; every rank takes "
            f"global_batch_size // world_size rows. Pick a global_batch_size that is a multiple "
            f"of {ws}."
        )
    return g // ws


def _tokens_and_range(source: TokenSource, split: Split | str, val_fraction: float
                      ) -> tuple[np.ndarray, int, int]:
    split = _as_split(split)
    if isinstance(source, TokenCache):
        start, end = source.split_range(split, val_fraction)
        return source.tokens, start, end
    if isinstance(source, torch.Tensor):
        source = source.detach().cpu().numpy()
    if not isinstance(source, np.ndarray) or source.ndim != 1:
        raise TypeError(
            "cache_or_tokens must be a TokenCache or a 1-D np.ndarray / torch.Tensor of token ids; "
            f"got {type(source).__name__} with shape {getattr(source, 'shape', None)}."
        )
    start, end = split_bounds(source, val_fraction, eos_id=None)[split]
    return source, start, end


def _need_tokens(split: Split, start: int, end: int, seq_len: int, what: str) -> None:
    if end - start < seq_len + 1:
        raise ValueError(
            f"{what}: the {split.value!r} split has {end - start} tokens, fewer than seq_len + 1 = "
            f"{seq_len + 1}. Use a shorter seq_len, a larger corpus, or adjust val_fraction."
        )


def train_window_starts(
    *, split: Split | str, seed: int, step: int, micro_step: int, rows: range, n_starts: int
) -> np.ndarray:
    """Window start offsets (relative to the split start) of the given global rows.

    Args:
        split: ``"train"`` or ``"val"`` (part of the hash key).
        seed: Run seed (any int).
        step: Optimizer step, ``>= 0``.
        micro_step: Gradient-accumulation micro-step within ``step``, ``>= 0``.
        rows: Global row indices ``i`` to compute.
        n_starts: Number of valid start offsets, ``split_len - T``.

    Returns:
        ``np.int64`` array ``[len(rows)]`` with values in ``[0, n_starts)``.
    """
    split = _as_split(split)
    prefix = f"{_HASH_DOMAIN}|{split.value}|{int(seed)}|{int(step)}|{int(micro_step)}|"
    out = np.empty(len(rows), dtype=np.int64)
    for j, i in enumerate(rows):
        h = hashlib.blake2b(f"{prefix}{i}".encode(), digest_size=8).digest()
        out[j] = int.from_bytes(h, "little") % n_starts
    return out


def _gather(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    window_bW = np.stack([np.asarray(tokens[s : s + seq_len + 1]) for s in starts.tolist()])
    return torch.from_numpy(window_bW.astype(np.int64))


def batch_for(
    cache_or_tokens: TokenSource,
    *,
    split: Split | str = Split.TRAIN,
    seed: int,
    step: int,
    micro_step: int = 0,
    global_batch_size: int,
    seq_len: int,
    rank: int = 0,
    world_size: int = 1,
    val_fraction: float = DEFAULT_VAL_FRACTION,
) -> torch.Tensor:
    """This rank's slice of the global micro-batch of ``(seed, step, micro_step)``.

    Args:
        cache_or_tokens: A :class:`TokenCache` or a 1-D token array / tensor.
        split: ``"train"`` (default) or ``"val"``; windows lie wholly inside the split.
        seed: Run seed (any int).
        step: Optimizer step, ``>= 0``.
        micro_step: Gradient-accumulation micro-step, ``>= 0``.
        global_batch_size: ``G``, rows summed over ranks; must be divisible by ``world_size``.
        seq_len: ``T``, model sequence length, ``>= 1``.
        rank: This rank, ``0 <= rank < world_size``.
        world_size: Number of data-parallel ranks.
        val_fraction: Validation fraction of the split rule (``token_cache`` module docstring).

    Returns:
        ``torch.int64`` tensor ``[G // world_size, T + 1]``, CPU, contiguous: rows
        ``[rank * b, (rank + 1) * b)`` of the global batch. Use :func:`inputs_and_labels`.

    Raises:
        TypeError / ValueError: For a bad argument (named in the message), a ``G`` not divisible
            by ``world_size``, or a split shorter than ``T + 1`` tokens.
    """
    split = _as_split(split)
    b = _check_ranks(global_batch_size, rank, world_size)
    seq_len = _check_int("seq_len", seq_len, 1)
    step = _check_int("step", step, 0)
    micro_step = _check_int("micro_step", micro_step, 0)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int; got {type(seed).__name__} {seed!r}.")
    tokens, start, end = _tokens_and_range(cache_or_tokens, split, val_fraction)
    _need_tokens(split, start, end, seq_len, "batch_for")
    rows = range(rank * b, (rank + 1) * b)
    rel_b = train_window_starts(split=split, seed=seed, step=step, micro_step=micro_step,
                                rows=rows, n_starts=end - start - seq_len)
    return _gather(tokens, start + rel_b, seq_len)


def num_val_batches(
    cache_or_tokens: TokenSource,
    *,
    global_batch_size: int,
    seq_len: int,
    val_fraction: float = DEFAULT_VAL_FRACTION,
) -> int:
    """How many full global validation batches tile the validation split.

    Returns:
        ``floor(floor(val_len / (T + 1)) / G)``; ``0`` when ``val_fraction == 0`` or the split is
        too short.
    """
    g = _check_int("global_batch_size", global_batch_size, 1)
    seq_len = _check_int("seq_len", seq_len, 1)
    _, start, end = _tokens_and_range(cache_or_tokens, Split.VAL, val_fraction)
    return ((end - start) // (seq_len + 1)) // g


def val_batch(
    cache_or_tokens: TokenSource,
    *,
    index: int,
    global_batch_size: int,
    seq_len: int,
    rank: int = 0,
    world_size: int = 1,
    val_fraction: float = DEFAULT_VAL_FRACTION,
) -> torch.Tensor:
    """This rank's slice of fixed validation batch ``index`` (consecutive tiling, no seed).

    Args:
        cache_or_tokens: A :class:`TokenCache` or a 1-D token array / tensor.
        index: Validation batch index, ``0 <= index < num_val_batches(...)``.
        global_batch_size: ``G``; must be divisible by ``world_size``.
        seq_len: ``T``.
        rank: This rank.
        world_size: Number of data-parallel ranks.
        val_fraction: Validation fraction of the split rule.

    Returns:
        ``torch.int64`` tensor ``[G // world_size, T + 1]``.

    Raises:
        ValueError: If ``index`` is out of range (the message gives ``num_val_batches``) or a
            rank argument is invalid.
    """
    b = _check_ranks(global_batch_size, rank, world_size)
    seq_len = _check_int("seq_len", seq_len, 1)
    index = _check_int("index", index, 0)
    tokens, start, end = _tokens_and_range(cache_or_tokens, Split.VAL, val_fraction)
    n = ((end - start) // (seq_len + 1)) // global_batch_size
    if index >= n:
        raise ValueError(
            f"val_batch: index={index} is out of range; the validation split "
            f"({end - start} tokens, val_fraction={val_fraction}) holds {n} batches of "
            f"global_batch_size="
            f"{global_batch_size} x (seq_len + 1)={seq_len + 1} tokens."
        )
    windows = np.arange(index * global_batch_size + rank * b,
                        index * global_batch_size + (rank + 1) * b, dtype=np.int64)
    return _gather(tokens, start + windows * (seq_len + 1), seq_len)


def inputs_and_labels(window_bW: torch.Tensor) -> dict[str, torch.Tensor]:
    """Splits windows ``[b, T + 1]`` into ``{"input_ids": [b, T], "labels": [b, T]}``.

    ``labels[:, t] == input_ids[:, t + 1]`` for ``t < T - 1``: labels are already shifted (see the
    module docstring for how to feed them to a Hugging Face model). Both are contiguous int64.
    """
    if window_bW.ndim != 2 or window_bW.shape[1] < 2:
        raise ValueError(
            f"inputs_and_labels: expected windows of shape [b, T + 1] with T >= 1; got "
            f"{tuple(window_bW.shape)}."
        )
    return {
        "input_ids": window_bW[:, :-1].contiguous(),
        "labels": window_bW[:, 1:].contiguous(),
    }


class StepBatchDataset(Dataset[dict[str, torch.Tensor]]):
    """Map-style dataset: item ``i = step * grad_accum + micro_step`` -> this rank's batch dict.

    Plain torch (no Lightning dependency). Use with
    ``DataLoader(ds, batch_size=None, shuffle=False, sampler=StepSampler(...))``; under Lightning
    pass ``use_distributed_sampler=False`` to the Trainer, because Lightning would otherwise wrap
    the sampler in a ``DistributedSamplerWrapper`` and re-shard indices that are already
    per-rank. :class:`StepBatchStream` (an ``IterableDataset``) avoids that trap entirely.

    Args:
        cache: The token source.
        seed: Run seed.
        global_batch_size: ``G`` (summed over ranks, per micro-step).
        seq_len: ``T``.
        grad_accum: Micro-steps per optimizer step, ``>= 1``.
        rank: This data-parallel rank.
        world_size: Number of data-parallel ranks.
        split: ``"train"`` (default) or ``"val"``.
        val_fraction: Validation fraction of the split rule.
    """

    def __init__(
        self,
        cache: TokenSource,
        *,
        seed: int,
        global_batch_size: int,
        seq_len: int,
        grad_accum: int = 1,
        rank: int = 0,
        world_size: int = 1,
        split: Split | str = Split.TRAIN,
        val_fraction: float = DEFAULT_VAL_FRACTION,
    ) -> None:
        _check_ranks(global_batch_size, rank, world_size)
        self.cache = cache
        self.seed = seed
        self.global_batch_size = global_batch_size
        self.seq_len = _check_int("seq_len", seq_len, 1)
        self.grad_accum = _check_int("grad_accum", grad_accum, 1)
        self.rank = rank
        self.world_size = world_size
        self.split = _as_split(split)
        self.val_fraction = val_fraction
        # Fail at construction, not at the first batch, if the split is too short.
        _, start, end = _tokens_and_range(cache, self.split, val_fraction)
        _need_tokens(self.split, start, end, self.seq_len, "StepBatchDataset")

    def step_and_micro(self, index: int) -> tuple[int, int]:
        """``divmod(index, grad_accum)``: the (optimizer step, micro-step) of item ``index``."""
        return divmod(_check_int("index", index, 0), self.grad_accum)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        step, micro = self.step_and_micro(index)
        window_bW = batch_for(
            self.cache, split=self.split, seed=self.seed, step=step, micro_step=micro,
            global_batch_size=self.global_batch_size, seq_len=self.seq_len, rank=self.rank,
            world_size=self.world_size, val_fraction=self.val_fraction,
        )
        return inputs_and_labels(window_bW)


class StepSampler(Sampler[int]):
    """Yields micro-batch indices ``start_step * grad_accum, ..., max_steps * grad_accum - 1``.

    Args:
        start_step: First optimizer step (``trainer.global_step`` when resuming).
        max_steps: One past the last optimizer step.
        grad_accum: Micro-steps per optimizer step.
    """

    def __init__(self, *, start_step: int = 0, max_steps: int, grad_accum: int = 1) -> None:
        self.start_step = _check_int("start_step", start_step, 0)
        self.max_steps = _check_int("max_steps", max_steps, self.start_step)
        self.grad_accum = _check_int("grad_accum", grad_accum, 1)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start_step * self.grad_accum, self.max_steps * self.grad_accum))

    def __len__(self) -> int:
        return (self.max_steps - self.start_step) * self.grad_accum


class StepBatchStream(IterableDataset[dict[str, torch.Tensor]]):
    """Iterable view of a :class:`StepBatchDataset`: items ``start_step * grad_accum, ...``.

    The drop-in choice for a Lightning Trainer: Lightning never injects a distributed sampler
    into an iterable dataset, and the stream deliberately has no ``__len__``, so Lightning counts
    the epoch as infinite and stops on ``max_steps`` only. (With a finite length, a run resumed
    mid-epoch restores Lightning's per-epoch batch counter, may end the "epoch" early and would
    then restart the stream, repeating batches.) Build it in ``train_dataloader()`` with
    ``start_step=trainer.global_step``: Lightning restores the checkpoint before it calls
    ``train_dataloader()``. With ``num_workers > 1`` worker ``w`` produces every
    ``num_workers``-th item from offset ``w``; the DataLoader's round-robin over workers restores
    the order. Use ``DataLoader(stream, batch_size=None)``.

    Args:
        dataset: The per-rank batch function.
        start_step: First optimizer step (``trainer.global_step`` when resuming).
        max_steps: One past the last optimizer step, or ``None`` for an endless stream.
    """

    def __init__(self, dataset: StepBatchDataset, *, start_step: int = 0,
                 max_steps: int | None = None) -> None:
        if not isinstance(dataset, StepBatchDataset):
            raise TypeError(f"dataset must be a StepBatchDataset; got {type(dataset).__name__}.")
        self.dataset = dataset
        self.start_step = _check_int("start_step", start_step, 0)
        self.max_steps = (None if max_steps is None
                          else _check_int("max_steps", max_steps, self.start_step))

    def indices(self) -> Iterator[int]:
        """Micro-batch indices yielded, in order (endless when ``max_steps`` is None)."""
        ga = self.dataset.grad_accum
        if self.max_steps is None:
            return itertools.count(self.start_step * ga)
        return iter(range(self.start_step * ga, self.max_steps * ga))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, n_workers = (0, 1) if info is None else (info.id, info.num_workers)
        for index in itertools.islice(self.indices(), worker, None, n_workers):
            yield self.dataset[index]


class ValBatchDataset(Dataset[dict[str, torch.Tensor]]):
    """Map-style dataset of the fixed validation batches (:func:`val_batch`), ``len`` = count.

    Under Lightning pass ``use_distributed_sampler=False`` (the rows are already per rank) and use
    ``DataLoader(ds, batch_size=None, shuffle=False)``.

    Args:
        cache: The token source.
        global_batch_size: ``G``.
        seq_len: ``T``.
        rank: This data-parallel rank.
        world_size: Number of data-parallel ranks.
        val_fraction: Validation fraction of the split rule.
        limit: Optional cap on the number of batches (the first ``limit`` are used).
    """

    def __init__(
        self,
        cache: TokenSource,
        *,
        global_batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        val_fraction: float = DEFAULT_VAL_FRACTION,
        limit: int | None = None,
    ) -> None:
        _check_ranks(global_batch_size, rank, world_size)
        self.cache = cache
        self.global_batch_size = global_batch_size
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        self.val_fraction = val_fraction
        n = num_val_batches(cache, global_batch_size=global_batch_size, seq_len=seq_len,
                            val_fraction=val_fraction)
        if limit is not None:
            n = min(n, _check_int("limit", limit, 0))
        self._len = n

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self._len:
            raise IndexError(f"ValBatchDataset index {index} out of range [0, {self._len}).")
        return inputs_and_labels(val_batch(
            self.cache, index=index, global_batch_size=self.global_batch_size,
            seq_len=self.seq_len, rank=self.rank, world_size=self.world_size,
            val_fraction=self.val_fraction,
        ))
