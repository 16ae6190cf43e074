"""Text or binary, and enough tokens: the launch-time corpus checks (``data.corpus``, ``data.checks``)."""

from __future__ import annotations

import pytest

from lp_lightning.data import Split, build_token_cache, find_token_cache, load_tokenizer, resolve_corpus
from lp_lightning.data.checks import check_corpus_size, split_token_counts
from lp_lightning.data.corpus import binary_problem, first_binary_file


def test_binary_problem_tells_text_from_binary(tmp_path):
    def problem(data: bytes, **kwargs):
        path = tmp_path / "f"
        path.write_bytes(data)
        return binary_problem(path, **kwargs)

    assert problem("naïve café, 日本語 — text\n".encode() * 100) is None
    assert problem(b"") is None
    assert problem(b"abc\x00def") == "it holds a NUL byte (at byte 3)"
    assert problem("x".encode("utf-16")) == "it holds a NUL byte (at byte 3)"  # UTF-16 is not UTF-8 text
    # Latin-1: each accented letter is one undecodable byte; up to 1 % of the bytes read is still text.
    assert problem(("caf\u00e9 " + "plain English text " * 6).encode("latin-1") * 50) is None  # 1 in 119
    assert problem(("caf\u00e9 " + "plain text " * 4).encode("latin-1") * 50) == (
        "50 of its 2450 bytes are not valid UTF-8")  # 1 in 49
    # A character cut by the end of the prefix is not invalid; one cut by the end of the file is.
    assert problem(b"a" * 9 + "日".encode(), prefix_bytes=10) is None
    assert problem(b"a" * 9 + "日".encode()[:1]) == "1 of its 10 bytes are not valid UTF-8"
    assert problem(b"\xff" * 20 + b"a" * 10, prefix_bytes=20) == "20 of its first 20 bytes are not valid UTF-8"


def test_first_binary_file_names_the_file(text_dir):
    assert first_binary_file(resolve_corpus([str(text_dir)])) is None
    image = text_dir / "image.bin"  # not taken when the folder is expanded (suffix), so name it
    found = first_binary_file(resolve_corpus([str(text_dir), str(image)]))
    assert found is not None and found[0].path == image.resolve() and found[1] == "it holds a NUL byte (at byte 0)"


def test_a_binary_source_is_refused_before_a_token_cache_is_built(text_dir, cache_dir):
    from lp_lightning.lightning.datamodule import PretrainDataModule

    sources = [str(text_dir / "a.txt"), str(text_dir / "image.bin")]
    with pytest.raises(ValueError, match=r"image.bin' is not text: it holds a NUL byte \(at byte 0\)\. Pass text"):
        build_token_cache(sources, "byte", cache_dir, allow_binary=False)
    with pytest.raises(ValueError, match="allow_binary=True"):
        PretrainDataModule(sources=sources, cache_dir=str(cache_dir)).prepare_data()  # refuses by default
    assert not cache_dir.exists()
    allowed = build_token_cache(sources, "byte", cache_dir)
    assert allowed.n_tokens == 1800 + 128 + 3 * 128 + 2  # ASCII, a U+FFFD (3 bytes) per high byte, 2 EOS
    PretrainDataModule(sources=sources, cache_dir=str(cache_dir)).prepare_data()  # a cache hit is not read again


def _docs(tmp_path, lengths: list[int]) -> list[str]:
    paths = []
    for index, length in enumerate(lengths):
        path = tmp_path / f"doc{index:03d}.txt"
        path.write_text(("abcdefghij" * (length // 10 + 1))[:length])
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("lengths", [[0], [12], [2000], [100] * 30, [7, 300, 5, 5, 5, 40, 1]])
@pytest.mark.parametrize("val_fraction", [0.05, 0.2, 0.0])
def test_the_counts_are_the_token_caches_splits(tmp_path, lengths, val_fraction):
    corpus = resolve_corpus(_docs(tmp_path, lengths))
    byte = load_tokenizer("byte")
    # Need more than the corpus holds: the count is exact, from the file contents (no cache yet).
    counts = split_token_counts(corpus, byte, val_fraction=val_fraction, cache_dir=tmp_path / "tokens",
                                need_train=10**9)
    cache = build_token_cache(corpus, byte, tmp_path / "tokens")
    train, val = cache.split_range(Split.TRAIN, val_fraction), cache.split_range(Split.VAL, val_fraction)
    assert counts is not None and counts.exact
    assert (counts.total, counts.train, counts.val) == (cache.n_tokens, train[1] - train[0], val[1] - val[0])
    cached = split_token_counts(corpus, byte, val_fraction=val_fraction, cache_dir=tmp_path / "tokens")
    assert cached == counts  # read from the cache
    bounds = split_token_counts(corpus, byte, val_fraction=val_fraction, cache_dir=tmp_path / "elsewhere")
    assert bounds is not None and not bounds.exact  # no need: the size-based lower bounds answer
    assert bounds.total == counts.total and bounds.train <= counts.train and bounds.val <= counts.val


def test_another_tokenizer_is_counted_in_memory(tmp_path, text_dir, make_hf_tokenizer):
    tokenizer = load_tokenizer(str(make_hf_tokenizer(tmp_path / "tok")))
    corpus = resolve_corpus([str(text_dir)])
    counts = split_token_counts(corpus, tokenizer, val_fraction=0.05, cache_dir=tmp_path / "tokens")
    cache = build_token_cache(corpus, tokenizer, tmp_path / "tokens")
    assert counts is not None and counts.exact and counts.total == cache.n_tokens < corpus.total_bytes
    assert counts.train == cache.split_range(Split.TRAIN, 0.05)[1]
    assert find_token_cache(corpus, tokenizer, tmp_path / "tokens").key == cache.key


def test_check_corpus_size_names_the_corpus_and_the_need(tmp_path):
    byte = load_tokenizer("byte")
    corpus = resolve_corpus(_docs(tmp_path, [100, 100]))
    check_corpus_size(corpus, byte, seq_len=31, val_fraction=0.2, val_batch_size=1)
    with pytest.raises(ValueError) as info:
        check_corpus_size(corpus, byte, seq_len=63, val_fraction=0.2, val_batch_size=1)
    first = str(tmp_path / "doc000.txt")
    assert str(info.value) == (
        f"data.sources: (2 files, the first {first!r}) holds 202 tokens (byte tokenizer): the validation split "
        "(data.val_fraction=0.2) gets 41, one validation batch needs 1 x 64 = 64; add text, raise "
        "data.val_fraction, lower data.seq_len / data.val_batch_size, or pass --trainer.limit_val_batches 0."
    )
    check_corpus_size(corpus, byte, seq_len=63, val_fraction=0.2, val_batch_size=None)  # no validation: enough
    with pytest.raises(ValueError, match=r"the train split gets \d+, one sequence needs data.seq_len \+ 1 = 1001"):
        check_corpus_size(corpus, byte, seq_len=1000, val_fraction=0.2, val_batch_size=None)
