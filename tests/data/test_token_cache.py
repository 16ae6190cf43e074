"""Token cache: stream layout, reuse without re-tokenising, invalidation, atomic builds, splits."""

from __future__ import annotations

import json
import os
import pickle
import threading
from pathlib import Path

import numpy as np
import pytest

from lp_lightning.data.corpus import resolve_corpus
from lp_lightning.data.token_cache import (
    CACHE_FORMAT_VERSION,
    Split,
    TokenCache,
    build_token_cache,
    default_cache_dir,
    split_bounds,
    token_dtype_for,
)
from lp_lightning.data.tokenizer import ByteTokenizer, load_tokenizer


class CountingTokenizer(ByteTokenizer):
    """Byte tokenizer that counts documents it encodes (a plain subclass; slots keep it tiny)."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "calls", [0])

    def encode_many(self, texts):
        self.calls[0] += len(texts)
        return super().encode_many(texts)


def expected_byte_stream(texts: list[str]) -> np.ndarray:
    parts = [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.uint16) for t in texts]
    return np.concatenate([np.append(p, np.uint16(256)) for p in parts])


def test_byte_stream_layout_dtype_and_sidecar(text_dir: Path, cache_dir: Path, docs):
    cache = build_token_cache([str(text_dir)], "byte", cache_dir)
    assert cache.built
    texts = [docs[k] for k in ["a.txt", "b.md", "sub/c.py", "sub/d.rst"]]
    assert cache.tokens.dtype == np.uint16 and isinstance(cache.tokens, np.memmap)
    np.testing.assert_array_equal(np.asarray(cache.tokens), expected_byte_stream(texts))
    assert cache.path == cache_dir / f"{cache.key}.bin"
    meta = json.loads(cache.path.with_suffix(".json").read_text())
    assert meta["format_version"] == CACHE_FORMAT_VERSION
    assert meta["n_tokens"] == cache.n_tokens == cache.path.stat().st_size // 2
    assert meta["n_documents"] == 4
    assert meta["tokenizer"]["fingerprint"] == ByteTokenizer().fingerprint
    assert [Path(s["path"]).name for s in meta["sources"]] == ["a.txt", "b.md", "c.py", "d.rst"]
    assert all({"size", "mtime_ns"} <= s.keys() for s in meta["sources"])
    import hashlib

    assert meta["tokens_sha256"] == hashlib.sha256(cache.path.read_bytes()).hexdigest()
    assert (cache.eos_id, cache.vocab_size) == (256, 257)
    assert not list(cache_dir.glob("*.tmp"))  # temporaries are cleaned up


def test_memmap_is_read_only(text_dir: Path, cache_dir: Path):
    cache = build_token_cache([str(text_dir)], "byte", cache_dir)
    with pytest.raises(ValueError, match="read-only"):
        cache.tokens[0] = 1


def test_invalid_utf8_is_replaced_not_fatal(tmp_path: Path, cache_dir: Path):
    p = tmp_path / "bad.txt"
    p.write_bytes(b"ok \xff\xfe end")
    cache = build_token_cache([str(p)], "byte", cache_dir)
    assert ByteTokenizer().decode(np.asarray(cache.tokens)) == "ok \ufffd\ufffd end"


def test_second_build_reuses_without_tokenising(text_dir: Path, cache_dir: Path):
    tok = CountingTokenizer()
    first = build_token_cache([str(text_dir)], tok, cache_dir)
    assert first.built and tok.calls[0] == 4
    mtime = first.path.stat().st_mtime_ns
    second = build_token_cache([str(text_dir)], tok, cache_dir)
    assert not second.built and tok.calls[0] == 4  # no document encoded again
    assert second.path == first.path and second.path.stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(second.tokens, first.tokens)


def test_changed_source_invalidates(text_dir: Path, cache_dir: Path):
    first = build_token_cache([str(text_dir)], "byte", cache_dir)
    target = text_dir / "a.txt"
    st = target.stat()
    target.write_text("changed text\n", encoding="utf-8")
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    second = build_token_cache([str(text_dir)], "byte", cache_dir)
    assert second.built and second.key != first.key
    assert ByteTokenizer().decode(np.asarray(second.tokens[:13])) == "changed text\n"
    # A touch alone (same content, new mtime) also re-keys: the key is (path, size, mtime_ns).
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 4_000_000_000))
    assert build_token_cache([str(text_dir)], "byte", cache_dir).key not in {first.key, second.key}


def test_tokenizer_change_invalidates_and_hf_stream(tmp_path: Path, text_dir: Path,
                                                    cache_dir: Path, docs, make_hf_tokenizer):
    byte_cache = build_token_cache([str(text_dir)], "byte", cache_dir)
    tok = load_tokenizer(make_hf_tokenizer(tmp_path / "tok"))
    hf_cache = build_token_cache([str(text_dir)], tok, cache_dir)
    assert hf_cache.key != byte_cache.key and hf_cache.built
    texts = [docs[k] for k in ["a.txt", "b.md", "sub/c.py", "sub/d.rst"]]
    expected = np.concatenate([np.array([*tok.encode(t), tok.eos_id]) for t in texts])
    np.testing.assert_array_equal(np.asarray(hf_cache.tokens, dtype=np.int64), expected)
    assert hf_cache.n_tokens < byte_cache.n_tokens
    assert (hf_cache.eos_id, hf_cache.vocab_size) == (tok.eos_id, tok.vocab_size)
    # Passing the folder path instead of the object reaches the same cache.
    assert not build_token_cache([str(text_dir)], str(tmp_path / "tok"), cache_dir).built


def test_corrupt_cache_is_rebuilt(text_dir: Path, cache_dir: Path):
    cache = build_token_cache([str(text_dir)], "byte", cache_dir)
    n = cache.n_tokens
    del cache
    path = next(cache_dir.glob("*.bin"))
    path.write_bytes(path.read_bytes()[:-2])  # truncated .bin: sidecar no longer matches
    with pytest.raises(ValueError, match="not a complete token cache"):
        TokenCache.open(path)
    rebuilt = build_token_cache([str(text_dir)], "byte", cache_dir)
    assert rebuilt.built and rebuilt.n_tokens == n


def test_concurrent_builders_publish_one_consistent_file(text_dir: Path, cache_dir: Path):
    corpus = resolve_corpus([str(text_dir)])
    barrier = threading.Barrier(4)
    results: list[TokenCache] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait()
            results.append(build_token_cache(corpus, "byte", cache_dir))
        except BaseException as err:  # surfaced by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len({r.path for r in results}) == 1
    reference = np.asarray(TokenCache.open(results[0].path).tokens)
    for r in results:
        np.testing.assert_array_equal(np.asarray(r.tokens), reference)
    assert sorted(p.suffix for p in cache_dir.iterdir()) == [".bin", ".json"]


def test_open_and_pickle_remap(text_dir: Path, cache_dir: Path):
    cache = build_token_cache([str(text_dir)], "byte", cache_dir)
    reopened = TokenCache.open(cache.path)
    assert not reopened.built and reopened.n_tokens == cache.n_tokens
    blob = pickle.dumps(cache)
    assert len(blob) < 1000  # the path travels, not the tokens
    clone = pickle.loads(blob)
    np.testing.assert_array_equal(clone.tokens, cache.tokens)
    assert "TokenCache(" in repr(clone)


def test_default_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "lp_lightning" / "tokens"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "lp_lightning" / "tokens"


def test_default_corpus_builds_with_default_cache_dir(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = build_token_cache(None, "byte", max_bytes=300_000)
    assert cache.path.parent == tmp_path / "lp_lightning" / "tokens"
    text = ByteTokenizer().decode(np.asarray(cache.tokens[:200_000]))
    assert "def " in text and "import " in text
    assert cache.meta["corpus"].startswith("stdlib:")


def test_token_dtype_for():
    assert token_dtype_for(257) == np.uint16
    assert token_dtype_for(65536) == np.uint16
    assert token_dtype_for(65537) == np.uint32
    assert token_dtype_for(129280) == np.uint32  # DeepSeek-V3 vocabulary
    with pytest.raises(ValueError, match="vocab_size"):
        token_dtype_for(0)


def test_split_is_a_disjoint_cover_snapped_to_a_document_start():
    # 10 documents of 99 tokens + EOS(=999) each: n = 1000; val_fraction 0.05 -> raw cut 950.
    tokens = np.tile(np.append(np.arange(99), 999), 10)
    bounds = split_bounds(tokens, 0.05, eos_id=999)
    assert bounds[Split.TRAIN] == (0, 900) and bounds[Split.VAL] == (900, 1000)
    assert tokens[899] == 999  # the validation split starts right after an EOS
    # Without an EOS id (or when snapping would more than double val) the raw cut is kept.
    assert split_bounds(tokens, 0.05)[Split.VAL] == (950, 1000)
    assert split_bounds(tokens, 0.02, eos_id=999)[Split.VAL] == (980, 1000)
    assert split_bounds(tokens, 0.0)[Split.VAL] == (1000, 1000)


@pytest.mark.parametrize("bad", [-0.1, 1.0, 2])
def test_bad_val_fraction(bad):
    with pytest.raises(ValueError, match="val_fraction"):
        split_bounds(np.arange(10), bad)
    with pytest.raises(TypeError, match="val_fraction"):
        split_bounds(np.arange(10), "0.1")  # type: ignore[arg-type]


def test_cache_split_range(text_dir: Path, cache_dir: Path, docs):
    cache = build_token_cache([str(text_dir)], "byte", cache_dir)
    t0, t1 = cache.split_range("train")
    v0, v1 = cache.split_range(Split.VAL)
    assert (t0, t1, v1) == (0, v0, cache.n_tokens) and v0 > 0
    # 5% is too little to reach the start of the last document without doubling: raw cut.
    assert v0 == cache.n_tokens - int(np.ceil(0.05 * cache.n_tokens))
    s0, s1 = cache.split_range("val", val_fraction=0.2)
    assert s1 == cache.n_tokens and cache.tokens[s0 - 1] == cache.eos_id  # a document start
    assert s0 == cache.n_tokens - len(docs["sub/d.rst"].encode()) - 1  # = the last document
    with pytest.raises(ValueError, match="split must be one of"):
        cache.split_range("test")


def test_orphaned_temp_file_of_a_killed_builder_is_removed(text_dir: Path, cache_dir: Path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)  # a process that has exited (a SIGTERM'd builder leaves this behind)
    cache_dir.mkdir(parents=True, exist_ok=True)
    orphan = cache_dir / f".abc.bin.{dead_pid}.0123456789abcdef.tmp"
    orphan.write_bytes(b"\0" * 64)
    live = cache_dir / f".abc.bin.{os.getppid()}.fedcba9876543210.tmp"  # writer still alive: kept
    live.write_bytes(b"\0" * 64)
    build_token_cache([str(text_dir)], "byte", cache_dir)
    assert not orphan.exists()
    assert live.exists()
