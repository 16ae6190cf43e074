"""Shared fixtures for the data-pipeline tests: small real-text corpora in tmp folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DOCS = {
    "a.txt": "The quick brown fox jumps over the lazy dog.\n" * 40,
    "b.md": "# Title\n\nSome *markdown* text with unicode: naïve café, 日本語.\n" * 30,
    "sub/c.py": "def add(x, y):\n    return x + y\n\n" * 50,
    "sub/d.rst": "Heading\n=======\n\nParagraph of reStructuredText.\n" * 30,
}


@pytest.fixture
def text_dir(tmp_path: Path) -> Path:
    """A folder with four text documents (plus files the folder expansion must skip)."""
    root = tmp_path / "corpus"
    for rel, text in DOCS.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    (root / "image.bin").write_bytes(bytes(range(256)))  # suffix not in TEXT_SUFFIXES
    (root / ".hidden.txt").write_text("hidden\n", encoding="utf-8")
    (root / ".git").mkdir()
    (root / ".git" / "x.txt").write_text("git internals\n", encoding="utf-8")
    return root


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "tokens"


LINES = [
    "def add(x, y):\n    return x + y\n",
    "The quick brown fox jumps over the lazy dog.\n",
    "naïve café 日本語 — unicode survives byte-level BPE.\n",
] * 20


def _make_hf_tokenizer(folder: Path, *, eos: str = "<|endoftext|>",
                      config_eos: str | None = None) -> Path:
    """Trains a tiny byte-level BPE on LINES (offline) and saves ``folder/tokenizer.json``."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(LINES, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config_eos is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": config_eos}))
    return folder


@pytest.fixture
def make_hf_tokenizer():
    """The factory ``make_hf_tokenizer(folder, *, eos=..., config_eos=None) -> folder``."""
    return _make_hf_tokenizer


@pytest.fixture
def docs() -> dict[str, str]:
    """Relative path -> text of the documents in ``text_dir``."""
    return dict(DOCS)
