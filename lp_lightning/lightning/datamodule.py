"""``PretrainDataModule``: real text, deterministic per-step batches, resumable position.

Built on :mod:`lp_lightning.data`: the corpus is tokenised once into a memory-mapped cache
(``prepare_data`` on local rank 0, a cache hit everywhere else), and micro-batch ``m`` of optimizer
step ``s`` is ``batch_for(seed, s, m)`` - a pure function, sliced per rank, so every world size
sees the same global rows (``lp_lightning/data/batches.py``).

Batch geometry (all per optimizer step unless stated):

* ``global_batch_size`` sequences per optimizer step, summed over ranks and micro-batches;
* ``accumulate_grad_batches`` (the Trainer's) micro-batches per step, so each global micro-batch
  has ``global_batch_size // accumulate_grad_batches`` rows and each rank takes
  ``global_batch_size // (accumulate_grad_batches * world_size)`` of them;
* ``seq_len`` tokens per row; tokens per step = ``global_batch_size * seq_len``.

Resume: the training loader is *stateful* in Lightning's sense. Its length is the whole run
(``max_steps * accumulate_grad_batches`` micro-batches, one epoch), its ``state_dict`` is the next
micro-batch index (saved in the checkpoint's loop state: the data position), and a loader built
after a restore starts at ``trainer.global_step * accumulate_grad_batches`` - the two must agree.
Lightning counts the restored micro-batches as already fetched, which is why the length stays the
whole run (the same contract as ``torchdata``'s ``StatefulDataLoader``). Iteration runs in the main
process (``num_workers=0``) so that the position is exact.

Lightning must not re-shard the per-rank rows: the loaders are built over an ``IterableDataset``
(train) or already-per-rank map dataset (validation); set ``use_distributed_sampler=False``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lp_lightning.data import StepBatchDataset, TokenCache, ValBatchDataset, build_token_cache, num_val_batches

__all__ = ["PretrainDataModule", "ResumableStepStream", "check_batch_geometry"]


class ResumableStepStream(IterableDataset):
    """Micro-batches ``start .. total - 1`` of a :class:`StepBatchDataset`, with a saved position.

    Args:
        dataset: The per-rank batch function (item ``i = step * grad_accum + micro``).
        total_micro_batches: Length of the run in micro-batches (``max_steps * grad_accum``).
        start: First micro-batch index to yield.
    """

    def __init__(self, dataset: StepBatchDataset, *, total_micro_batches: int, start: int) -> None:
        if not 0 <= start <= total_micro_batches:
            raise ValueError(f"start={start} must lie in [0, total_micro_batches={total_micro_batches}].")
        self.dataset = dataset
        self.total_micro_batches = total_micro_batches
        self.next_index = start

    def __len__(self) -> int:
        return self.total_micro_batches

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while self.next_index < self.total_micro_batches:
            index = self.next_index
            self.next_index = index + 1  # counted as consumed when handed out (num_workers=0)
            yield self.dataset[index]


class _StatefulLoader(DataLoader):
    """DataLoader whose ``state_dict`` is the stream position (Lightning's ``_Stateful``)."""

    def __init__(self, stream: ResumableStepStream, geometry: dict[str, int]) -> None:
        super().__init__(stream, batch_size=None, num_workers=0)
        self._geometry = geometry

    def state_dict(self) -> dict[str, int]:
        return {"next_micro_index": self.dataset.next_index, **self._geometry}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        for key, value in self._geometry.items():
            if state_dict.get(key, value) != value:
                raise ValueError(
                    f"cannot resume: the checkpoint's data {key}={state_dict[key]} differs from this "
                    f"run's {key}={value}; the batches would not continue the saved run. Resume with "
                    f"the same data.{key} / trainer settings."
                )
        saved = int(state_dict["next_micro_index"])
        if saved != self.dataset.next_index:
            raise ValueError(
                f"cannot resume: the checkpoint's data position (micro-batch {saved}) does not match "
                f"the restored global step (micro-batch {self.dataset.next_index})."
            )


def check_batch_geometry(global_batch_size: int, accumulate_grad_batches: int, world_size: int) -> None:
    """Checks that one global batch splits into equal micro-batches on every rank.

    Raises:
        ValueError: ``global_batch_size`` is not divisible by ``accumulate_grad_batches *
            world_size``; the message names both settings and the multiple to pick.
    """
    divisor = accumulate_grad_batches * world_size
    if global_batch_size % divisor:
        raise ValueError(
            f"data.global_batch_size={global_batch_size} must be divisible by "
            f"trainer.accumulate_grad_batches ({accumulate_grad_batches}) x world size ({world_size}) = "
            f"{divisor}; pick a multiple of {divisor}."
        )


class PretrainDataModule(pl.LightningDataModule):
    """Offline text corpus -> token cache -> deterministic per-step batches.

    Args:
        sources: Files, folders or glob patterns of text (a list, or one string); ``null``/empty = the embedded default
            corpus (the running Python's standard-library sources, real text on every machine).
        tokenizer: ``"byte"`` (UTF-8 bytes + EOS, vocab 257) or a local HF tokenizer folder.
        cache_dir: Folder of the token cache; ``null`` = ``lp_lightning.data.default_cache_dir()``.
        max_corpus_bytes: Byte cap on the corpus (``null`` = the data package's default for the
            stdlib corpus, no cap for user sources).
        seed: Seed of the batch order (independent of the model-init seed).
        global_batch_size: Sequences per optimizer step over all ranks and micro-batches; must be
            divisible by ``accumulate_grad_batches * world_size``.
        seq_len: Tokens per sequence (model inputs; each window holds ``seq_len + 1`` tokens).
        val_fraction: Tail fraction of the token stream held out for validation.
        val_batches: Number of fixed validation batches per evaluation (``null`` = all that fit).
        val_batch_size: Sequences per validation batch over all ranks (``null`` = the size of one
            training micro-batch, ``global_batch_size // accumulate_grad_batches``).
        allow_binary: Tokenise source files that are not text (a NUL byte or over 1 % invalid UTF-8 in
            their first MiB; undecodable bytes become U+FFFD); ``false`` refuses them, naming the file.
    """

    def __init__(
        self,
        sources: list[str] | str | None = None,
        tokenizer: str = "byte",
        cache_dir: str | None = None,
        max_corpus_bytes: int | None = None,
        seed: int = 0,
        global_batch_size: int = 4,
        seq_len: int = 256,
        val_fraction: float = 0.05,
        val_batches: int | None = 4,
        val_batch_size: int | None = None,
        allow_binary: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (("global_batch_size", global_batch_size), ("seq_len", seq_len)):
            if value < 1:
                raise ValueError(f"data.{name} must be >= 1, got {value}.")
        if val_batches is not None and val_batches < 1:
            raise ValueError(f"data.val_batches must be >= 1 or null, got {val_batches}.")
        self.save_hyperparameters()
        self.sources = ([sources] if isinstance(sources, str) else list(sources)) if sources else None
        self.tokenizer = tokenizer
        self.cache_dir = cache_dir
        self.max_corpus_bytes = max_corpus_bytes
        self.seed = seed
        self.global_batch_size = global_batch_size
        self.seq_len = seq_len
        self.val_fraction = val_fraction
        self.val_batches = val_batches
        self.val_batch_size = val_batch_size
        self.allow_binary = allow_binary
        self.cache: TokenCache | None = None

    def _build_cache(self) -> TokenCache:
        return build_token_cache(
            self.sources, self.tokenizer, self.cache_dir, max_bytes=self.max_corpus_bytes,
            allow_binary=self.allow_binary,
        )

    @override
    def prepare_data(self) -> None:
        """Tokenises the corpus once (local rank 0); other ranks then hit the cache."""
        self._build_cache()

    @override
    def setup(self, stage: str) -> None:
        """Opens the token cache and checks the batch geometry against the Trainer.

        Raises:
            ValueError: ``global_batch_size`` is not divisible by ``accumulate_grad_batches *
                world_size``, or ``trainer.max_steps`` is not set.
        """
        if self.cache is None:
            self.cache = self._build_cache()
        trainer = self.trainer
        assert trainer is not None
        check_batch_geometry(self.global_batch_size, trainer.accumulate_grad_batches, trainer.world_size)
        if stage == "fit" and (trainer.max_steps is None or trainer.max_steps < 1):
            raise ValueError(
                f"trainer.max_steps must be >= 1 (got {trainer.max_steps}): batches are indexed by "
                f"optimizer step and the whole run is one epoch."
            )

    @property
    def vocab_size(self) -> int | None:
        """Number of token ids the tokenizer produces (``None`` before ``setup``)."""
        return None if self.cache is None else self.cache.vocab_size

    @property
    def tokens_per_step(self) -> int:
        """Tokens trained per optimizer step: ``global_batch_size * seq_len``."""
        return self.global_batch_size * self.seq_len

    def _micro_batch_size(self) -> int:
        return self.global_batch_size // self.trainer.accumulate_grad_batches

    @override
    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        assert self.cache is not None and trainer is not None
        accum = trainer.accumulate_grad_batches
        if trainer.global_step > 0 and trainer.global_step >= trainer.max_steps:
            raise ValueError(
                f"the restored checkpoint is at step {trainer.global_step}, not below trainer.max_steps="
                f"{trainer.max_steps}: nothing to train. Set --trainer.max_steps above {trainer.global_step} "
                f"(and --model.lr_decay_steps to stretch the schedule)."
            )
        dataset = StepBatchDataset(
            self.cache,
            seed=self.seed,
            global_batch_size=self._micro_batch_size(),
            seq_len=self.seq_len,
            grad_accum=accum,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            split="train",
            val_fraction=self.val_fraction,
        )
        stream = ResumableStepStream(
            dataset, total_micro_batches=trainer.max_steps * accum, start=trainer.global_step * accum
        )
        geometry = {
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "seq_len": self.seq_len,
            "accumulate_grad_batches": accum,
        }
        return _StatefulLoader(stream, geometry)

    @override
    def val_dataloader(self) -> DataLoader:
        trainer = self.trainer
        assert self.cache is not None and trainer is not None
        batch_size = self.val_batch_size or self._micro_batch_size()
        available = num_val_batches(
            self.cache, global_batch_size=batch_size, seq_len=self.seq_len, val_fraction=self.val_fraction
        )
        if available < 1:
            raise ValueError(
                f"the validation split holds no batch of {batch_size} x {self.seq_len + 1} tokens; "
                f"raise data.val_fraction, use a larger corpus or lower data.val_batch_size."
            )
        dataset = ValBatchDataset(
            self.cache,
            global_batch_size=batch_size,
            seq_len=self.seq_len,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            val_fraction=self.val_fraction,
            limit=self.val_batches,
        )
        return DataLoader(dataset, batch_size=None, shuffle=False, num_workers=0)

    @override
    def state_dict(self) -> dict[str, Any]:
        """Records the corpus identity (token-cache key) so a resume on other data is refused."""
        return {"token_cache_key": None if self.cache is None else self.cache.key}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raises ``ValueError`` when the checkpoint was trained on a different token cache."""
        saved = state_dict.get("token_cache_key")
        if self.cache is None:
            self.cache = self._build_cache()
        if saved is not None and saved != self.cache.key:
            raise ValueError(
                f"cannot resume: the checkpoint was trained on token cache {saved} but this run's "
                f"corpus/tokenizer give {self.cache.key}; pass the same data.sources and data.tokenizer."
            )
