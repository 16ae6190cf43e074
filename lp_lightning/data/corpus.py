"""Text corpora for pretraining: the embedded default (the Python standard library) or user files.

A corpus is an ordered tuple of files; each file is one *document*. The token cache
(``token_cache.py``) reads every file as bytes, decodes it as UTF-8 with ``errors="replace"``
(undecodable bytes become U+FFFD, so binary-ish files never abort a build) and appends the
tokeniser's EOS id after each document.

Default corpus (``sources=None`` or ``[]``): the ``*.py`` source files of the running Python's
standard library (``sysconfig.get_paths()["stdlib"]``). It is real, mixed prose/code text that is
present on every machine with no download. Files are sorted by their path relative to the stdlib
root; directories named in :data:`STDLIB_EXCLUDED_DIRS` (site-packages, test suites, caches) are
skipped; files are taken in that order while the running total stays within
:data:`DEFAULT_CORPUS_MAX_BYTES` (16 MiB). The cap keeps a first build fast: byte-level
tokenisation of 16 MiB takes about a second, a BPE tokenizer a few tens of seconds on one core.

User sources (``sources=[...]``), expanded in the order given, duplicates dropped (first wins):

* an existing file -> that file, whatever its extension;
* an existing folder -> every file below it whose suffix is in :data:`TEXT_SUFFIXES`, sorted by
  relative path, skipping hidden files and folders (names starting with ``"."``);
* anything containing ``*``, ``?`` or ``[`` -> a ``glob.glob(..., recursive=True)`` pattern
  (``**`` spans folders); matched files are taken as-is, matched folders expand as above.

A source that matches no file raises ``ValueError`` naming it.

Text or not (:func:`binary_problem`, :func:`first_binary_file`): a file whose first
:data:`TEXT_CHECK_BYTES` (1 MiB) hold a NUL byte, or more than :data:`MAX_INVALID_UTF8_FRACTION` (1 %)
bytes that are not valid UTF-8, is not text; ``lp-lightning fit`` and ``PretrainDataModule`` refuse
it unless ``data.allow_binary`` is true (the token cache would train on U+FFFD replacements).
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import os
import re
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_CORPUS_MAX_BYTES",
    "MAX_INVALID_UTF8_FRACTION",
    "STDLIB_EXCLUDED_DIRS",
    "TEXT_CHECK_BYTES",
    "TEXT_SUFFIXES",
    "Corpus",
    "SourceFile",
    "binary_problem",
    "default_corpus",
    "first_binary_file",
    "resolve_corpus",
]

DEFAULT_CORPUS_MAX_BYTES = 16 * 1024 * 1024
"""Byte cap of the default stdlib corpus (16 MiB); keeps the first tokenisation fast."""

STDLIB_EXCLUDED_DIRS: frozenset[str] = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
"""Folder names skipped anywhere under the stdlib root when building the default corpus."""

TEXT_SUFFIXES: frozenset[str] = frozenset(
    {
        ".txt", ".md", ".rst", ".tex", ".py", ".pyi", ".json", ".jsonl", ".yaml", ".yml",
        ".toml", ".cfg", ".ini", ".csv", ".tsv", ".html", ".htm", ".xml", ".c", ".h", ".cc",
        ".cpp", ".hpp", ".rs", ".go", ".java", ".js", ".ts", ".sh",
    }
)  # fmt: skip
"""File suffixes (lower-cased) taken when a folder is expanded."""

_GLOB_CHARS = frozenset("*?[")

TEXT_CHECK_BYTES = 1 << 20
"""Bytes read from the start of each file to tell text from binary (1 MiB)."""

TEXT_CHECK_TOTAL_BYTES = 64 << 20
"""Once this much has been read for one corpus, later files are checked on their first 4 KiB only."""

MAX_INVALID_UTF8_FRACTION = 0.01
"""Share of the bytes read that may be invalid UTF-8 in a text file (Latin-1 accents in English text pass)."""

_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # what ``surrogateescape`` turns each undecodable byte into


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceFile:
    """One document of a corpus, identified as the token-cache key sees it.

    Attributes:
        path: Absolute, resolved path.
        size: Size in bytes at resolution time.
        mtime_ns: Modification time in nanoseconds at resolution time.
    """

    path: Path
    size: int
    mtime_ns: int

    @classmethod
    def stat(cls, path: Path) -> SourceFile:
        """Builds a ``SourceFile`` from ``os.stat`` of ``path`` (resolved to an absolute path)."""
        resolved = path.resolve()
        st = resolved.stat()
        return cls(path=resolved, size=st.st_size, mtime_ns=st.st_mtime_ns)

    def read_text(self) -> str:
        """Returns the file decoded as UTF-8 with ``errors="replace"``."""
        return self.path.read_bytes().decode("utf-8", errors="replace")


@dataclass(frozen=True, kw_only=True, slots=True)
class Corpus:
    """An ordered, de-duplicated tuple of documents plus a description of where they came from.

    Attributes:
        files: Documents in stream order.
        description: ``"stdlib:<root> (<n> files, cap <bytes> B)"`` or the user's sources.
    """

    files: tuple[SourceFile, ...]
    description: str

    def __post_init__(self) -> None:
        if not self.files:
            raise ValueError(f"Corpus {self.description!r} has no files; pass at least one source.")

    @property
    def total_bytes(self) -> int:
        """Sum of file sizes in bytes."""
        return sum(f.size for f in self.files)

    @property
    def fingerprint(self) -> str:
        """sha256 over ``(path, size, mtime_ns)`` of every file, in order (cache-key component)."""
        h = hashlib.sha256()
        for f in self.files:
            h.update(f"{f.path}\0{f.size}\0{f.mtime_ns}\n".encode())
        return h.hexdigest()

    def iter_documents(self) -> Iterator[str]:
        """Yields each file's text (UTF-8, ``errors="replace"``) in order."""
        for f in self.files:
            yield f.read_text()


def binary_problem(path: str | os.PathLike[str], *, prefix_bytes: int = TEXT_CHECK_BYTES) -> str | None:
    """Why ``path`` is not text, judged on its first ``prefix_bytes``; ``None`` when it is.

    Returns:
        ``"it holds a NUL byte (at byte 12)"`` or ``"300 of its first 1000 bytes are not valid UTF-8"``.
    """
    with open(path, "rb") as stream:
        head = stream.read(prefix_bytes)
        whole = len(head) < prefix_bytes or not stream.read(1)
    nul = head.find(b"\0")
    if nul >= 0:
        return f"it holds a NUL byte (at byte {nul})"
    # final=False: a character cut by the end of the prefix is not counted as invalid.
    text = codecs.getincrementaldecoder("utf-8")("surrogateescape").decode(head, final=whole)
    invalid = len(text) - len(_ESCAPED_BYTE.sub("", text))
    if invalid > MAX_INVALID_UTF8_FRACTION * len(head):
        return f"{invalid} of its {'' if whole else 'first '}{len(head)} bytes are not valid UTF-8"
    return None


def first_binary_file(corpus: Corpus) -> tuple[SourceFile, str] | None:
    """The first file of ``corpus`` that is not text, with :func:`binary_problem`'s reason; ``None`` if all are text.

    Reads at most :data:`TEXT_CHECK_BYTES` per file; after :data:`TEXT_CHECK_TOTAL_BYTES` in all, 4 KiB per file.
    """
    read = 0
    for source in corpus.files:
        prefix = TEXT_CHECK_BYTES if read < TEXT_CHECK_TOTAL_BYTES else 4096
        problem = binary_problem(source.path, prefix_bytes=prefix)
        if problem is not None:
            return source, problem
        read += min(prefix, source.size)
    return None


def _walk_sorted(root: Path, *, excluded_dirs: frozenset[str], suffixes: frozenset[str] | None,
                 skip_hidden: bool) -> list[Path]:
    """Files under ``root`` sorted by relative POSIX path; pruned folders are never entered."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d for d in dirnames
            if d not in excluded_dirs and not (skip_hidden and d.startswith("."))
        ]
        for name in filenames:
            if skip_hidden and name.startswith("."):
                continue
            if suffixes is not None and Path(name).suffix.lower() not in suffixes:
                continue
            full = Path(dirpath, name)
            if full.is_file():
                found.append((full.relative_to(root).as_posix(), full))
    found.sort(key=lambda item: item[0])
    return [p for _, p in found]


def default_corpus(max_bytes: int = DEFAULT_CORPUS_MAX_BYTES) -> Corpus:
    """The embedded default corpus: the running Python's stdlib ``*.py`` files, capped.

    Args:
        max_bytes: Byte cap. Files (sorted by path relative to the stdlib root, excluded folders
            skipped) are taken while the running total stays ``<= max_bytes``; the first file is
            always taken.

    Returns:
        A :class:`Corpus` of real Python source text.

    Raises:
        ValueError: If ``max_bytes <= 0`` or the stdlib folder holds no ``.py`` file.
    """
    if max_bytes <= 0:
        raise ValueError(f"default_corpus: max_bytes must be > 0; got {max_bytes}.")
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = _walk_sorted(root, excluded_dirs=STDLIB_EXCLUDED_DIRS, suffixes=frozenset({".py"}),
                         skip_hidden=True)
    files = _take_within(paths, max_bytes)
    if not files:
        raise ValueError(f"default_corpus: no .py files under the stdlib folder {str(root)!r}.")
    return Corpus(
        files=tuple(files),
        description=f"stdlib:{root} ({len(files)} files, cap {max_bytes} B)",
    )


def _take_within(paths: Sequence[Path], max_bytes: int | None) -> list[SourceFile]:
    files: list[SourceFile] = []
    total = 0
    for p in paths:
        f = SourceFile.stat(p)
        if max_bytes is not None and files and total + f.size > max_bytes:
            break
        files.append(f)
        total += f.size
    return files


def _expand_source(source: str) -> list[Path]:
    if any(c in source for c in _GLOB_CHARS):
        matches = sorted(glob.glob(os.path.expanduser(source), recursive=True))
        out: list[Path] = []
        for m in matches:
            p = Path(m)
            if p.is_dir():
                out.extend(_walk_sorted(p, excluded_dirs=frozenset(), suffixes=TEXT_SUFFIXES,
                                        skip_hidden=True))
            elif p.is_file():
                out.append(p)
        if not out:
            raise ValueError(
                f"corpus source {source!r}: the glob pattern matches no file. Check the pattern "
                "(use '**' to span folders) or pass a file or folder path."
            )
        return out
    p = Path(source).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        out = _walk_sorted(p, excluded_dirs=frozenset(), suffixes=TEXT_SUFFIXES, skip_hidden=True)
        if not out:
            raise ValueError(
                f"corpus source {source!r}: the folder holds no text file (suffixes "
                f"{sorted(TEXT_SUFFIXES)}, hidden names skipped). Name files explicitly or use "
                "a glob."
            )
        return out
    raise ValueError(
        f"corpus source {source!r} does not exist: pass an existing file, folder or glob pattern."
    )


def resolve_corpus(
    sources: Sequence[str | os.PathLike[str]] | None = None,
    *,
    max_bytes: int | None = None,
) -> Corpus:
    """Resolves corpus sources (files, folders, globs) to an ordered :class:`Corpus`.

    Args:
        sources: ``None`` or empty for the default stdlib corpus (see the module docstring), else
            files, folders or glob patterns expanded in order (duplicates dropped, first wins).
        max_bytes: Optional byte cap applied to the expanded file list in order (the first file
            is always taken). ``None`` means :data:`DEFAULT_CORPUS_MAX_BYTES` for the default
            corpus and no cap for user sources.

    Returns:
        The resolved :class:`Corpus`.

    Raises:
        TypeError: If ``sources`` is a bare string (wrap it in a list) or holds a non-path.
        ValueError: If a source matches no file, or ``max_bytes <= 0``.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"resolve_corpus: max_bytes must be > 0 or None; got {max_bytes}.")
    if isinstance(sources, (str, os.PathLike)):
        raise TypeError(
            f"resolve_corpus: sources must be a list of paths/globs, got the single value "
            f"{str(sources)!r}; wrap it in a list: [{str(sources)!r}]."
        )
    if not sources:
        return default_corpus(DEFAULT_CORPUS_MAX_BYTES if max_bytes is None else max_bytes)
    seen: set[Path] = set()
    ordered: list[Path] = []
    for source in sources:
        if not isinstance(source, (str, os.PathLike)):
            raise TypeError(
                f"resolve_corpus: each source must be a str or path; got {type(source).__name__} "
                f"({source!r})."
            )
        for p in _expand_source(os.fspath(source)):
            key = p.resolve()
            if key not in seen:
                seen.add(key)
                ordered.append(p)
    files = _take_within(ordered, max_bytes)
    return Corpus(files=tuple(files), description=", ".join(os.fspath(s) for s in sources))
