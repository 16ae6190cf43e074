"""Corpus resolution: default stdlib text, user files / folders / globs, and the errors."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from lp_lightning.data.corpus import (
    DEFAULT_CORPUS_MAX_BYTES,
    STDLIB_EXCLUDED_DIRS,
    Corpus,
    SourceFile,
    default_corpus,
    resolve_corpus,
)


def test_default_corpus_is_real_stdlib_python_text():
    corpus = resolve_corpus(None)
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert corpus.description.startswith("stdlib:")
    assert len(corpus.files) > 100
    assert 0 < corpus.total_bytes <= DEFAULT_CORPUS_MAX_BYTES
    rels = [f.path.relative_to(root) for f in corpus.files]
    assert all(r.suffix == ".py" for r in rels)
    assert not any(set(r.parts[:-1]) & STDLIB_EXCLUDED_DIRS for r in rels)
    assert [r.as_posix() for r in rels] == sorted(r.as_posix() for r in rels)
    text = "".join(f.read_text() for f in corpus.files[:20])
    assert "def " in text and "import " in text


def test_default_corpus_cap_takes_a_sorted_prefix():
    full = default_corpus()
    capped = default_corpus(max_bytes=200_000)
    assert capped.total_bytes <= 200_000 or len(capped.files) == 1
    assert capped.files == full.files[: len(capped.files)]
    assert resolve_corpus([], max_bytes=200_000).files == capped.files
    assert default_corpus(max_bytes=1).files == full.files[:1]  # the first file is always taken


def test_folder_expansion_filters_suffixes_and_hidden_and_sorts(text_dir: Path):
    corpus = resolve_corpus([str(text_dir)])
    names = [f.path.relative_to(text_dir.resolve()).as_posix() for f in corpus.files]
    assert names == ["a.txt", "b.md", "sub/c.py", "sub/d.rst"]


def test_explicit_file_any_suffix_glob_and_dedup(text_dir: Path):
    corpus = resolve_corpus([
        str(text_dir / "image.bin"),            # explicit: taken despite its suffix
        str(text_dir / "sub" / "*.py"),         # glob
        str(text_dir / "a.txt"),
        str(text_dir / "**" / "*.py"),          # matches sub/c.py again -> dropped
    ])
    names = [f.path.name for f in corpus.files]
    assert names == ["image.bin", "c.py", "a.txt"]
    assert corpus.files[0].size == 256


def test_source_file_records_size_and_mtime(text_dir: Path):
    p = text_dir / "a.txt"
    sf = SourceFile.stat(p)
    assert sf.size == p.stat().st_size and sf.mtime_ns == p.stat().st_mtime_ns
    assert sf.path.is_absolute()


def test_fingerprint_changes_with_mtime(text_dir: Path):
    import os

    before = resolve_corpus([str(text_dir)]).fingerprint
    assert resolve_corpus([str(text_dir)]).fingerprint == before
    st = (text_dir / "a.txt").stat()
    os.utime(text_dir / "a.txt", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert resolve_corpus([str(text_dir)]).fingerprint != before


def test_user_max_bytes_caps_in_order(text_dir: Path):
    corpus = resolve_corpus([str(text_dir)], max_bytes=1)
    assert [f.path.name for f in corpus.files] == ["a.txt"]


@pytest.mark.parametrize("bad", ["does/not/exist.txt", "nowhere/**/*.txt"])
def test_missing_source_raises_naming_it(tmp_path: Path, bad: str):
    source = str(tmp_path / bad)
    with pytest.raises(ValueError, match="corpus source") as info:
        resolve_corpus([source])
    assert source in str(info.value)


def test_folder_without_text_files_raises(tmp_path: Path):
    folder = tmp_path / "binaries"
    folder.mkdir()
    (folder / "blob.bin").write_bytes(b"\x00\x01")
    with pytest.raises(ValueError, match="holds no text file") as info:
        resolve_corpus([str(folder)])
    assert str(folder) in str(info.value)


def test_bare_string_sources_is_a_type_error(text_dir: Path):
    with pytest.raises(TypeError, match="wrap it in a list"):
        resolve_corpus(str(text_dir))
    with pytest.raises(TypeError, match="each source must be"):
        resolve_corpus([3])


def test_bad_max_bytes_and_empty_corpus():
    with pytest.raises(ValueError, match="max_bytes"):
        resolve_corpus(None, max_bytes=0)
    with pytest.raises(ValueError, match="no files"):
        Corpus(files=(), description="empty")
