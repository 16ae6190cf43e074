"""Does a corpus hold one training sequence and one validation batch? Answered before anything is built.

``lp-lightning fit`` asks at launch (:func:`check_corpus_size`), so an empty or tiny ``data.sources``
fails as a usage error naming the file and its token count, not inside every rank's ``setup``. The
need is what the batches take (:mod:`lp_lightning.data.batches`): the train split must hold one
window of ``seq_len + 1`` tokens, the validation split one validation batch of ``val_batch_size``
windows. The splits follow :func:`~lp_lightning.data.token_cache.split_bounds`.

Counting stays cheap (:func:`split_token_counts`): an existing token cache of the corpus gives the
exact splits; else, for the byte tokenizer, lower bounds from the file sizes (a file of ``b`` bytes
gives at least ``b`` tokens, exactly ``b`` when it is valid UTF-8, plus one EOS) settle any corpus
well above the need; else the corpus is tokenised in memory when it holds at most
:data:`EXACT_COUNT_MAX_BYTES` (byte tokenizer) or :data:`EXACT_COUNT_MAX_BYTES_TOKENIZER` (others).
A larger corpus with another tokenizer and no cache is not counted (``setup`` still checks). Nothing
is written.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from lp_lightning.data.corpus import Corpus
from lp_lightning.data.token_cache import Split, find_token_cache, split_bounds
from lp_lightning.data.tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "EXACT_COUNT_MAX_BYTES",
    "EXACT_COUNT_MAX_BYTES_TOKENIZER",
    "SplitTokens",
    "check_corpus_size",
    "split_token_counts",
]

EXACT_COUNT_MAX_BYTES = 16 << 20
"""Largest corpus the byte tokenizer's exact count reads at launch (16 MiB, the default corpus's cap)."""

EXACT_COUNT_MAX_BYTES_TOKENIZER = 4 << 20
"""Largest corpus another tokenizer encodes at launch to count it (4 MiB: a few seconds of BPE)."""

_ENCODE_GROUP = 64


@dataclass(frozen=True, slots=True)
class SplitTokens:
    """Tokens of a corpus and of its two splits.

    Attributes:
        total, train, val: Token counts (EOS separators included).
        exact: Counted (``False``: lower bounds, or the byte tokenizer's count from file sizes).
    """

    total: int
    train: int
    val: int
    exact: bool


def _lower_bounds(total: int, val_fraction: float) -> SplitTokens:
    """Split sizes every stream of at least ``total`` tokens reaches (``val_fraction < 0.5``).

    The cut moves back by at most one more validation length (``split_bounds``), so ``train >= n - 2 ceil(f n)``,
    and ``n (1 - 2f) - 2`` grows with ``n``; ``val >= ceil(f n)`` grows with ``n``.
    """
    val = math.ceil(val_fraction * total)
    return SplitTokens(total=total, train=max(total - 2 * val - 2, 0), val=val, exact=False)


def _split_of(lengths: list[int], val_fraction: float, *, exact: bool) -> SplitTokens:
    """The splits of the stream ``doc_0 EOS doc_1 EOS ...`` with these document lengths (``split_bounds``'s rule)."""
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64) + 1)
    total = int(ends[-1]) if ends.size else 0
    eos = np.zeros(total, dtype=bool)
    eos[ends - 1] = True
    cut = split_bounds(eos, val_fraction, eos_id=True)[Split.TRAIN][1]
    return SplitTokens(total=total, train=cut, val=total - cut, exact=exact)


def _document_lengths(corpus: Corpus, tokenizer: Tokenizer) -> list[int]:
    if isinstance(tokenizer, ByteTokenizer):
        return [len(source.read_text().encode("utf-8")) for source in corpus.files]
    lengths: list[int] = []
    for start in range(0, len(corpus.files), _ENCODE_GROUP):
        group = corpus.files[start : start + _ENCODE_GROUP]
        lengths.extend(ids.size for ids in tokenizer.encode_many([source.read_text() for source in group]))
    return lengths


def split_token_counts(
    corpus: Corpus,
    tokenizer: Tokenizer,
    *,
    val_fraction: float,
    cache_dir: str | os.PathLike[str] | None = None,
    need_train: int = 0,
    need_val: int = 0,
) -> SplitTokens | None:
    """The token counts of ``corpus`` and its splits, as cheaply as settles ``need_train`` / ``need_val``.

    Returns:
        Exact counts (a token cache, or an in-memory count), lower bounds that already meet both needs, the
        byte tokenizer's size-based count of a corpus too large to read, or ``None`` (another tokenizer, a
        corpus above :data:`EXACT_COUNT_MAX_BYTES_TOKENIZER`, no cache).
    """
    cache = find_token_cache(corpus, tokenizer, cache_dir)
    if cache is not None:
        train, val = cache.split_range(Split.TRAIN, val_fraction), cache.split_range(Split.VAL, val_fraction)
        return SplitTokens(total=cache.n_tokens, train=train[1] - train[0], val=val[1] - val[0], exact=True)
    byte = isinstance(tokenizer, ByteTokenizer)
    if byte and val_fraction < 0.5:
        bounds = _lower_bounds(corpus.total_bytes + len(corpus.files), val_fraction)
        if bounds.train >= need_train and bounds.val >= need_val:
            return bounds
    if corpus.total_bytes <= (EXACT_COUNT_MAX_BYTES if byte else EXACT_COUNT_MAX_BYTES_TOKENIZER):
        return _split_of(_document_lengths(corpus, tokenizer), val_fraction, exact=True)
    return _split_of([source.size for source in corpus.files], val_fraction, exact=False) if byte else None


def _named(corpus: Corpus) -> str:
    first = str(corpus.files[0].path)
    return repr(first) if len(corpus.files) == 1 else f"({len(corpus.files)} files, the first {first!r})"


def check_corpus_size(
    corpus: Corpus,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    val_fraction: float,
    val_batch_size: int | None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> None:
    """Checks that the train split holds one ``seq_len + 1`` window and the validation split one batch of them.

    Args:
        corpus, tokenizer: The run's data.
        seq_len: Model inputs per sequence (a window holds ``seq_len + 1`` tokens).
        val_fraction: The split rule's validation fraction.
        val_batch_size: Windows per validation batch; ``None``: the run does not validate (no need).
        cache_dir: Where the token cache would be (an existing one is read for the exact counts).

    Raises:
        ValueError: A split is too small; names the corpus, its token count, the split, the need and the fix.
    """
    window = seq_len + 1
    need_val = val_batch_size * window if val_batch_size else 0
    counts = split_token_counts(corpus, tokenizer, val_fraction=val_fraction, cache_dir=cache_dir,
                                need_train=window, need_val=need_val)
    if counts is None:
        return
    tokens = f"{'' if counts.exact else 'about '}{counts.total} token{'' if counts.total == 1 else 's'}"
    held = f"data.sources: {_named(corpus)} holds {tokens} ({tokenizer.name} tokenizer)"
    if counts.train < window:
        raise ValueError(
            f"{held}: the train split gets {counts.train}, one sequence needs data.seq_len + 1 = {window}; "
            "add text to data.sources or lower data.seq_len."
        )
    if counts.val < need_val:
        raise ValueError(
            f"{held}: the validation split (data.val_fraction={val_fraction}) gets {counts.val}, one validation batch "
            f"needs {val_batch_size} x {window} = {need_val}; add text, raise data.val_fraction, lower "
            "data.seq_len / data.val_batch_size, or pass --trainer.limit_val_batches 0."
        )
