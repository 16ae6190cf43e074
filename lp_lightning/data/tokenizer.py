"""Tokenisers for the pretraining data pipeline: a byte-level one and local Hugging Face folders.

Two kinds are supported, both offline:

* ``"byte"`` -> :class:`ByteTokenizer`: ids ``0..255`` are the UTF-8 bytes of the text and id
  ``256`` is the end-of-sequence token that separates documents; ``vocab_size`` is 257, so it fits
  the tiny DeepSeek-V3 config (vocab 512) and any larger one.
* a path -> :class:`HFTokenizer`: a folder holding a Hugging Face *fast* tokenizer file
  ``tokenizer.json`` (or the path of that file itself), loaded with the ``tokenizers`` library.
  Nothing is downloaded.

Every tokeniser exposes ``name``, ``vocab_size``, ``eos_id``, ``encode(text) -> list[int]``,
``decode(ids) -> str``, ``encode_array(text) -> np.ndarray`` and ``encode_many(texts)`` (the fast
paths the token cache uses)
and ``fingerprint``: a string that changes whenever the text -> ids mapping can change, used in
the token-cache key (``token_cache.py``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = [
    "BYTE_TOKENIZER_NAME",
    "KNOWN_EOS_TOKENS",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "load_tokenizer",
]

BYTE_TOKENIZER_NAME = "byte"

# Special-token strings tried, in this order, when a tokenizer folder names no ``eos_token`` in its
# ``tokenizer_config.json``: DeepSeek-V3, GPT-2/Qwen, Llama-3, Llama-2/Mistral/T5, Gemma.
KNOWN_EOS_TOKENS: tuple[str, ...] = (
    "<｜end▁of▁sentence｜>",  # noqa: RUF001 - DeepSeek's token really uses U+FF5C and U+2581
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
)


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokeniser.

    Attributes:
        name: Human-readable name (``"byte"`` or the tokenizer folder).
        vocab_size: Number of token ids; every id produced is in ``[0, vocab_size)``.
        eos_id: Id appended after every document in the token stream.
        fingerprint: Stable string identifying the text -> ids mapping (cache key component).
    """

    name: str
    vocab_size: int
    eos_id: int
    fingerprint: str

    def encode(self, text: str) -> list[int]: ...

    def encode_array(self, text: str) -> np.ndarray: ...

    def encode_many(self, texts: list[str]) -> list[np.ndarray]: ...

    def decode(self, ids: list[int] | np.ndarray) -> str: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class ByteTokenizer:
    """Byte-level tokeniser: one id per UTF-8 byte, plus one end-of-sequence id.

    Ids ``0..255`` are byte values; ``eos_id == 256``; ``vocab_size == 257``. No BOS token: the
    EOS separator between documents is the only special token. The mapping is fixed, so the
    fingerprint is a constant that carries a version.
    """

    # Fixed by the byte mapping, so not constructor arguments (``ByteTokenizer()`` takes none).
    name: str = field(default=BYTE_TOKENIZER_NAME, init=False)
    vocab_size: int = field(default=257, init=False)
    eos_id: int = field(default=256, init=False)
    fingerprint: str = field(default="byte-v1:eos=256:vocab=257", init=False)

    def encode(self, text: str) -> list[int]:
        """Returns the UTF-8 bytes of ``text`` as ids in ``[0, 256)``; adds no special tokens."""
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """Like :meth:`encode` but returns a 1-D ``np.uint8`` array (no Python list)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        """:meth:`encode_array` of each text, in order."""
        return [self.encode_array(t) for t in texts]

    def decode(self, ids: list[int] | np.ndarray) -> str:
        """Decodes byte ids to text; ids >= 256 (EOS) are skipped, invalid UTF-8 becomes U+FFFD.

        Raises:
            ValueError: If an id is negative or >= ``vocab_size``.
        """
        ids_N = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids_N.size and (ids_N.min() < 0 or ids_N.max() >= self.vocab_size):
            raise ValueError(
                f"ByteTokenizer.decode: ids must lie in [0, {self.vocab_size}); got min "
                f"{int(ids_N.min())}, max {int(ids_N.max())}."
            )
        return ids_N[ids_N < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


@dataclass(frozen=True, kw_only=True, slots=True)
class HFTokenizer:
    """A Hugging Face fast tokenizer loaded offline from a local ``tokenizer.json``.

    Build it with :func:`load_tokenizer`. ``encode`` never adds special tokens (BOS/EOS from the
    tokenizer's post-processor): the token cache inserts ``eos_id`` between documents itself.

    Attributes:
        name: The tokenizer folder (or file) as given.
        vocab_size: ``get_vocab_size(with_added_tokens=True)`` of the tokenizer.
        eos_id: Id of the end-of-sequence token (see :func:`load_tokenizer` for how it is found).
        fingerprint: ``"hf-v1:" + sha256(tokenizer.json bytes, eos_id)``.
        tokenizer_json: Resolved path of the ``tokenizer.json`` that was loaded.
    """

    name: str
    vocab_size: int
    eos_id: int
    fingerprint: str
    tokenizer_json: Path
    _backend: object = field(repr=False, compare=False)

    def encode(self, text: str) -> list[int]:
        """Returns the token ids of ``text`` without special tokens."""
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def encode_array(self, text: str) -> np.ndarray:
        """Like :meth:`encode` but returns a 1-D ``np.int64`` array."""
        return np.asarray(self._backend.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        """:meth:`encode_array` of each text, in order (``encode_batch``, parallel in Rust)."""
        encodings = self._backend.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: list[int] | np.ndarray) -> str:
        """Decodes ids to text, skipping special tokens (the ``tokenizers`` default)."""
        return self._backend.decode([int(i) for i in np.asarray(ids).reshape(-1)])


def _eos_from_config(folder: Path) -> str | None:
    """Reads ``eos_token`` from ``<folder>/tokenizer_config.json`` if the file names one."""
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"load_tokenizer: {config_path} is not valid JSON ({err}).") from err
    eos = config.get("eos_token")
    if isinstance(eos, dict):  # AddedToken serialised as {"content": "...", ...}
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def _load_hf(path: Path, spec: str, eos_token: str | None) -> HFTokenizer:
    from tokenizers import Tokenizer as _HFBackend

    if path.is_dir():
        tokenizer_json = path / "tokenizer.json"
        if not tokenizer_json.is_file():
            present = sorted(p.name for p in path.iterdir())[:20]
            raise ValueError(
                f"load_tokenizer: folder {str(path)!r} has no tokenizer.json (found: {present}). Convert it "
                "with transformers.AutoTokenizer.from_pretrained(path).save_pretrained(path), or pass 'byte'."
            )
        folder = path
    else:
        if path.name != "tokenizer.json" and path.suffix != ".json":
            raise ValueError(
                f"load_tokenizer: {str(path)!r} is a file but not a tokenizer.json; pass 'byte', a "
                "folder containing tokenizer.json, or the tokenizer.json file itself."
            )
        tokenizer_json = path
        folder = path.parent

    raw = tokenizer_json.read_bytes()
    try:
        backend = _HFBackend.from_str(raw.decode("utf-8"))
    except Exception as err:  # the Rust side raises a bare Exception subclass
        raise ValueError(
            f"load_tokenizer: could not parse {str(tokenizer_json)!r} as a Hugging Face "
            f"tokenizer.json ({err})."
        ) from err

    candidates = [eos_token] if eos_token is not None else []
    if eos_token is None:
        from_config = _eos_from_config(folder)
        candidates = [from_config] if from_config is not None else list(KNOWN_EOS_TOKENS)
    eos_id = None
    for token in candidates:
        eos_id = backend.token_to_id(token)
        if eos_id is not None:
            break
    if eos_id is None:
        raise ValueError(
            f"load_tokenizer: no end-of-sequence token found in {str(tokenizer_json)!r}; tried "
            f"{candidates}. Name it with eos_token=..., or set \"eos_token\" in "
            f"{str(folder / 'tokenizer_config.json')!r}."
        )
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    digest = hashlib.sha256(raw + f"|eos={eos_id}".encode()).hexdigest()
    return HFTokenizer(
        name=spec,
        vocab_size=int(vocab_size),
        eos_id=int(eos_id),
        fingerprint=f"hf-v1:{digest}",
        tokenizer_json=tokenizer_json.resolve(),
        _backend=backend,
    )


def load_tokenizer(
    spec: str | Path, *, eos_token: str | None = None
) -> ByteTokenizer | HFTokenizer:
    """Loads a tokeniser by name or local path; never touches the network.

    Args:
        spec: ``"byte"`` for :class:`ByteTokenizer`, or the path of a local folder containing a
            Hugging Face ``tokenizer.json`` (or the path of that file).
        eos_token: For a Hugging Face tokenizer, the string of the end-of-sequence token. When
            ``None`` it is read from ``eos_token`` in ``tokenizer_config.json`` next to
            ``tokenizer.json``; without that file, the first of :data:`KNOWN_EOS_TOKENS` present
            in the vocabulary is used. Must be ``None`` for ``"byte"``.

    Returns:
        A :class:`ByteTokenizer` or :class:`HFTokenizer`.

    Raises:
        TypeError: If ``spec`` is not a ``str`` or ``Path``.
        ValueError: If the path does not exist, a folder has no ``tokenizer.json``, the file does
            not parse, or no end-of-sequence token can be found.
    """
    if not isinstance(spec, (str, Path)):
        raise TypeError(
            "load_tokenizer: spec must be 'byte' or a path (str | Path); got "
            f"{type(spec).__name__}."
        )
    if isinstance(spec, str) and spec == BYTE_TOKENIZER_NAME:
        if eos_token is not None:
            raise ValueError(
                f"load_tokenizer: eos_token={eos_token!r} is only meaningful for a Hugging Face "
                "tokenizer; the byte tokeniser's EOS id is fixed at 256. Drop eos_token."
            )
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.exists():
        raise ValueError(
            f"load_tokenizer: {str(spec)!r} is neither 'byte' nor an existing path. Pass 'byte' or "
            "a local folder containing a Hugging Face tokenizer.json (nothing is downloaded)."
        )
    return _load_hf(path, str(spec), eos_token)
