"""Tokenise a corpus once into a memory-mapped token file, and split it into train / validation.

Layout of a cache folder (default :func:`default_cache_dir`)::

    <cache_dir>/<key>.bin    flat token stream, little-endian np.uint16 (vocab <= 65536) or
                             np.uint32 otherwise
    <cache_dir>/<key>.json   sidecar: sources (path, size, mtime_ns), tokenizer fingerprint,
                             token dtype, n_tokens, n_documents, tokens_sha256, lp_lightning version

The token stream is ``doc_0 EOS doc_1 EOS ... doc_{n-1} EOS``: every document (one source file,
see ``corpus.py``) is followed by the tokeniser's ``eos_id``.

``key`` = sha256 of (:data:`CACHE_FORMAT_VERSION`, tokenizer fingerprint, every source's
``(path, size, mtime_ns)`` in order). Editing, touching, adding or removing a source file, or
changing the tokenizer, therefore yields a new key and a fresh build; an unchanged corpus reuses
the file without tokenising again (``TokenCache.built`` is ``False``).

Concurrency: both files are written to unique temporary names in ``cache_dir`` and published with
``os.replace`` (atomic on POSIX), the ``.bin`` first and the sidecar last; a cache counts as present
only when its sidecar exists and the ``.bin`` size matches it. Ranks that build the same key at the
same time therefore never observe a torn file: each writes identical bytes and the last rename wins.
To avoid the duplicated work, the recommended multi-rank pattern is still "rank 0 calls
:func:`build_token_cache`, all ranks barrier, then every rank calls it (a cheap cache hit)".

Train / validation split (:meth:`TokenCache.split_range`, :func:`split_bounds`): the validation
split is the *last* ``val_fraction`` of the stream (default :data:`DEFAULT_VAL_FRACTION` = 0.05).
With ``n`` tokens, ``v = ceil(val_fraction * n)`` and raw cut ``c = n - v``; the cut then moves back
to the start of the document containing it (one past the last EOS before ``c``) when that start lies
within ``[n - 2v, c]`` (i.e. when snapping at most doubles the validation split); otherwise it stays
at ``c``. Train is ``[0, cut)``, validation ``[cut, n)``; batches draw windows wholly inside one
split, so no token is in both.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import uuid
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from lp_lightning import __version__
from lp_lightning.data.corpus import Corpus, SourceFile, first_binary_file, resolve_corpus
from lp_lightning.data.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "CACHE_FORMAT_VERSION",
    "DEFAULT_VAL_FRACTION",
    "Split",
    "TokenCache",
    "build_token_cache",
    "cache_key",
    "default_cache_dir",
    "find_token_cache",
    "split_bounds",
    "token_dtype_for",
]

CACHE_FORMAT_VERSION = 1
"""Bumped whenever the ``.bin`` layout or the stream rule (EOS placement) changes."""

DEFAULT_VAL_FRACTION = 0.05
"""Fraction of the token stream (its tail) held out for validation."""

_ENCODE_GROUP = 64  # documents handed to Tokenizer.encode_many at once


class Split(str, Enum):
    """Which part of the token stream a batch is drawn from."""

    TRAIN = "train"
    VAL = "val"


def token_dtype_for(vocab_size: int) -> np.dtype:
    """``np.uint16`` when every id fits (``vocab_size <= 65536``), else ``np.uint32``.

    Raises:
        ValueError: If ``vocab_size`` is not in ``[1, 2**32]``.
    """
    if not 1 <= vocab_size <= 2**32:
        raise ValueError(f"token_dtype_for: vocab_size must be in [1, 2**32]; got {vocab_size}.")
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lp_lightning/tokens`` if ``XDG_CACHE_HOME`` is set, else
    ``~/.cache/lp_lightning/tokens`` (the XDG base-directory convention; no other variable)."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "lp_lightning" / "tokens"


def cache_key(corpus: Corpus, tokenizer: Tokenizer) -> str:
    """Hex sha256 naming the cache files of ``(corpus, tokenizer)``; see the module docstring."""
    h = hashlib.sha256()
    h.update(f"lp_lightning.token_cache.v{CACHE_FORMAT_VERSION}\n".encode())
    h.update(f"tokenizer={tokenizer.fingerprint}\n".encode())
    h.update(f"corpus={corpus.fingerprint}\n".encode())
    return h.hexdigest()


def _check_val_fraction(val_fraction: float) -> float:
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)):
        raise TypeError(f"val_fraction must be a float in [0, 1); got {val_fraction!r}.")
    if not 0.0 <= float(val_fraction) < 1.0:
        raise ValueError(
            f"val_fraction must lie in [0, 1) (0 disables validation); got {val_fraction}."
        )
    return float(val_fraction)


def split_bounds(
    tokens_N: np.ndarray, val_fraction: float = DEFAULT_VAL_FRACTION, eos_id: int | None = None
) -> dict[Split, tuple[int, int]]:
    """Half-open ``[start, end)`` token ranges of the train and validation splits.

    Args:
        tokens_N: 1-D token stream of ``N`` ids.
        val_fraction: Fraction of the tail held out, in ``[0, 1)``.
        eos_id: Document separator id used to snap the cut to a document start (module
            docstring). ``None`` keeps the raw cut ``N - ceil(val_fraction * N)``.

    Returns:
        ``{Split.TRAIN: (0, cut), Split.VAL: (cut, N)}``.

    Raises:
        TypeError / ValueError: If ``val_fraction`` is not a number in ``[0, 1)``.
    """
    val_fraction = _check_val_fraction(val_fraction)
    n = int(tokens_N.shape[0])
    v = math.ceil(val_fraction * n)
    cut = n - v
    if v > 0 and eos_id is not None:
        lo = max(0, n - 2 * v - 1)  # an EOS at lo starts a document at lo + 1 >= n - 2v
        eos_pos = np.flatnonzero(np.asarray(tokens_N[lo:cut]) == eos_id)
        if eos_pos.size:
            cut = lo + int(eos_pos[-1]) + 1
    return {Split.TRAIN: (0, cut), Split.VAL: (cut, n)}


class TokenCache:
    """A read-only, memory-mapped token stream plus its sidecar metadata.

    Build with :func:`build_token_cache` or reopen with :meth:`TokenCache.open`. Pickling sends
    only the path (workers and subprocesses re-map the file instead of copying tokens).

    Attributes:
        path: The ``.bin`` file.
        meta: The sidecar JSON as a read-only mapping.
        tokens: ``np.memmap`` of shape ``[n_tokens]`` and dtype ``token_dtype``, mode ``"r"``.
        built: ``True`` if this call tokenised the corpus, ``False`` on a cache hit.
    """

    __slots__ = ("_split_memo", "built", "meta", "path", "tokens")

    def __init__(self, path: Path, meta: dict[str, Any], *, built: bool) -> None:
        self.path = Path(path)
        self.meta = MappingProxyType(meta)
        dtype = np.dtype(meta["token_dtype"])
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r", shape=(int(meta["n_tokens"]),))
        self.built = built
        self._split_memo: dict[float, dict[Split, tuple[int, int]]] = {}

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> TokenCache:
        """Opens an existing cache from its ``.bin`` path (the sidecar must sit next to it).

        Raises:
            ValueError: If the sidecar is missing, has another format version, or disagrees
                with the ``.bin`` size.
        """
        meta = _read_valid_meta(Path(path))
        if meta is None:
            raise ValueError(
                f"TokenCache.open: {os.fspath(path)!r} is not a complete token cache of format "
                f"v{CACHE_FORMAT_VERSION} (missing/mismatched .json sidecar). Rebuild it with "
                "build_token_cache(...)."
            )
        return cls(Path(path), meta, built=False)

    def __reduce__(self) -> tuple[Any, ...]:
        return (TokenCache.open, (str(self.path),))

    def __repr__(self) -> str:
        return (
            f"TokenCache(path={str(self.path)!r}, n_tokens={self.n_tokens}, "
            f"tokenizer={self.meta['tokenizer']['name']!r}, built={self.built})"
        )

    @property
    def key(self) -> str:
        """The cache key (file stem)."""
        return self.path.stem

    @property
    def n_tokens(self) -> int:
        """Number of tokens in the stream, EOS separators included."""
        return int(self.meta["n_tokens"])

    @property
    def eos_id(self) -> int:
        """End-of-sequence id of the tokenizer the cache was built with."""
        return int(self.meta["tokenizer"]["eos_id"])

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the tokenizer the cache was built with."""
        return int(self.meta["tokenizer"]["vocab_size"])

    @property
    def token_dtype(self) -> np.dtype:
        """On-disk dtype of the ids (``uint16`` or ``uint32``, little-endian)."""
        return self.tokens.dtype

    def split_range(
        self, split: Split | str, val_fraction: float = DEFAULT_VAL_FRACTION
    ) -> tuple[int, int]:
        """``[start, end)`` token range of ``split`` (rule in the module docstring, EOS-snapped).

        Raises:
            ValueError: If ``split`` is not ``"train"``/``"val"`` or ``val_fraction`` is invalid.
        """
        split = _as_split(split)
        vf = _check_val_fraction(val_fraction)
        bounds = self._split_memo.get(vf)
        if bounds is None:
            bounds = split_bounds(self.tokens, vf, self.eos_id)
            self._split_memo[vf] = bounds
        return bounds[split]


def _as_split(split: Split | str) -> Split:
    try:
        return Split(split)
    except ValueError:
        raise ValueError(
            f"split must be one of {[s.value for s in Split]}; got {split!r}."
        ) from None


def _read_valid_meta(bin_path: Path) -> dict[str, Any] | None:
    """The sidecar of ``bin_path`` if it is complete and consistent, else ``None``."""
    meta_path = bin_path.with_suffix(".json")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        size = bin_path.stat().st_size
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if meta.get("format_version") != CACHE_FORMAT_VERSION:
        return None
    try:
        itemsize = np.dtype(meta["token_dtype"]).itemsize
        n_tokens = int(meta["n_tokens"])
    except (KeyError, TypeError, ValueError):
        return None
    if n_tokens <= 0 or size != n_tokens * itemsize:
        return None
    return meta


def _atomic_write_bytes(target: Path, data: bytes) -> None:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _remove_orphaned_temp_files(folder: Path) -> None:
    """Deletes ``.<name>.<pid>.<uuid>.tmp`` files left by a builder that was killed (e.g. SIGTERM
    skips the ``finally`` clean-up). A file whose writer process is still alive is left alone."""
    for tmp in folder.glob(".*.tmp"):
        parts = tmp.name.rsplit(".", 3)  # [".<name>", "<pid>", "<uuid>", "tmp"]
        if len(parts) != 4 or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except PermissionError:  # alive, owned by someone else
            continue


def _tokenise_to(tmp_path: Path, corpus: Corpus, tokenizer: Tokenizer, dtype: np.dtype
                 ) -> tuple[int, str]:
    """Writes the token stream of ``corpus`` to ``tmp_path``; returns (n_tokens, sha256 hex)."""
    eos_bytes = np.array([tokenizer.eos_id], dtype=dtype).tobytes()
    digest = hashlib.sha256()
    n_tokens = 0
    files = corpus.files
    with open(tmp_path, "wb") as f:
        for g in range(0, len(files), _ENCODE_GROUP):
            group = files[g : g + _ENCODE_GROUP]
            encoded = tokenizer.encode_many([sf.read_text() for sf in group])
            for sf, ids in zip(group, encoded, strict=True):
                if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= tokenizer.vocab_size):
                    raise ValueError(
                        f"build_token_cache: tokenizer {tokenizer.name!r} produced ids outside "
                        f"[0, {tokenizer.vocab_size}) for {str(sf.path)!r} (min {int(ids.min())}, "
                        f"max {int(ids.max())}); its vocab_size is inconsistent."
                    )
                if SourceFile.stat(sf.path) != sf:
                    raise ValueError(
                        f"build_token_cache: source {str(sf.path)!r} changed while it was being "
                        "tokenised (size or mtime differs); rerun once it is stable."
                    )
                chunk = ids.astype(dtype, copy=False).tobytes() + eos_bytes
                f.write(chunk)
                digest.update(chunk)
                n_tokens += ids.size + 1
        f.flush()
        os.fsync(f.fileno())
    return n_tokens, digest.hexdigest()


def find_token_cache(
    corpus: Corpus, tokenizer: Tokenizer, cache_dir: str | os.PathLike[str] | None = None
) -> TokenCache | None:
    """The complete cache of ``(corpus, tokenizer)`` under ``cache_dir`` (``None``: :func:`default_cache_dir`), or
    ``None``; creates and writes nothing."""
    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    bin_path = folder / f"{cache_key(corpus, tokenizer)}.bin"
    meta = _read_valid_meta(bin_path)
    return None if meta is None else TokenCache(bin_path, meta, built=False)


def build_token_cache(
    sources: Corpus | Sequence[str | os.PathLike[str]] | None = None,
    tokenizer: Tokenizer | str | os.PathLike[str] = "byte",
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    max_bytes: int | None = None,
    allow_binary: bool = True,
) -> TokenCache:
    """Tokenises a corpus once into ``<cache_dir>/<key>.bin`` (+ sidecar) and memory-maps it.

    A second call with the same sources (same paths, sizes, mtimes) and tokenizer returns the
    existing file without tokenising (``built=False``). Safe when several processes build the
    same key at once (atomic rename; module docstring).

    Args:
        sources: A resolved :class:`~lp_lightning.data.corpus.Corpus`, or files / folders / globs
            for :func:`~lp_lightning.data.corpus.resolve_corpus`; ``None`` or ``[]`` selects the
            default stdlib corpus.
        tokenizer: A tokenizer object, ``"byte"``, or a local Hugging Face tokenizer folder
            (see :func:`~lp_lightning.data.tokenizer.load_tokenizer`).
        cache_dir: Folder for the cache files; ``None`` -> :func:`default_cache_dir`.
        max_bytes: Corpus byte cap forwarded to ``resolve_corpus`` (ignored for a ``Corpus``).
        allow_binary: ``False`` refuses, before a build, a file that is not text
            (:func:`~lp_lightning.data.corpus.binary_problem`: NUL bytes, invalid UTF-8).

    Returns:
        A :class:`TokenCache` whose ``tokens`` is a read-only ``np.memmap`` ``[n_tokens]``.

    Raises:
        ValueError: For unresolvable sources or tokenizers (see those functions), ids outside
            the tokenizer's vocabulary, a source that changes during tokenisation, or (``allow_binary=False``)
            a source that is not text.
    """
    if isinstance(sources, Corpus):
        corpus = sources
    else:
        corpus = resolve_corpus(sources, max_bytes=max_bytes)
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer
    if not isinstance(tok, Tokenizer):
        raise TypeError(
            f"build_token_cache: tokenizer must be 'byte', a tokenizer folder path, or an object "
            f"with name/vocab_size/eos_id/fingerprint/encode/encode_many/decode; got "
            f"{type(tok).__name__}."
        )
    key = cache_key(corpus, tok)
    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    bin_path = folder / f"{key}.bin"
    meta = _read_valid_meta(bin_path)
    if meta is not None:
        return TokenCache(bin_path, meta, built=False)
    binary = None if allow_binary else first_binary_file(corpus)
    if binary is not None:
        raise ValueError(
            f"build_token_cache: {str(binary[0].path)!r} is not text: {binary[1]}. Pass text files, or "
            "allow_binary=True (data.allow_binary) to train on it with U+FFFD for the undecodable bytes."
        )

    folder.mkdir(parents=True, exist_ok=True)
    _remove_orphaned_temp_files(folder)
    dtype = token_dtype_for(tok.vocab_size)
    tmp = bin_path.with_name(f".{bin_path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        n_tokens, tokens_sha256 = _tokenise_to(tmp, corpus, tok, dtype)
        os.replace(tmp, bin_path)
    finally:
        tmp.unlink(missing_ok=True)

    meta = {
        "format_version": CACHE_FORMAT_VERSION,
        "lp_lightning_version": __version__,
        "key": key,
        "corpus": corpus.description,
        "sources": [
            {"path": str(f.path), "size": f.size, "mtime_ns": f.mtime_ns} for f in corpus.files
        ],
        "tokenizer": {
            "name": tok.name,
            "fingerprint": tok.fingerprint,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
        },
        "token_dtype": dtype.str,
        "n_tokens": n_tokens,
        "n_documents": len(corpus.files),
        "tokens_sha256": tokens_sha256,
    }
    _atomic_write_bytes(bin_path.with_suffix(".json"),
                        json.dumps(meta, indent=1, sort_keys=True).encode("utf-8"))
    return TokenCache(bin_path, meta, built=True)
