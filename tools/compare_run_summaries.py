"""Compare two ``run_summary.json`` files leaf by leaf, floats by ``float.hex`` (a refactor must change no bit).

    python tools/compare_run_summaries.py BEFORE.json AFTER.json [--markdown]

Every leaf is compared exactly. Leaves that differ between two runs of the same code (wall-clock
times, machine load, memory peaks, paths under the run folder, the git commit) are listed as
``varies`` and do not count; every other difference, and a leaf present on one side only, is a
failure (exit 1). ``--markdown`` prints the table of the deterministic leaves for a closing note.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

VARIES = re.compile(
    r"^/(tokens_per_s|step_time_s_median|step_time_s_steady_median|step_times_s(/\d+)?|load_average/.*"
    r"|peak_memory_bytes.*|peak_tensor_bytes.*|checkpoints/\d+|versions/git_commit|run_dir|.*_path"
    r"|.*wall_time.*|.*elapsed.*|.*duration.*|timing/.*|.*/seconds)$"
)
"""Leaves that differ between two runs of one commit (time, load, memory peaks, paths, commit)."""


def leaves(value: Any, path: str = "") -> dict[str, Any]:
    """``{"/a/b/0": leaf}`` for every scalar leaf (lists by index, dicts by key)."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(leaves(item, f"{path}/{key}"))
        return out or {path: {}}
    if isinstance(value, list):
        out = {}
        for index, item in enumerate(value):
            out.update(leaves(item, f"{path}/{index}"))
        return out or {path: []}
    return {path: value}


def exact(value: Any) -> str:
    """The bits of a leaf: ``float.hex`` for floats, ``repr`` otherwise."""
    return value.hex() if isinstance(value, float) else repr(value)


def compare(before: dict[str, Any], after: dict[str, Any]) -> tuple[list[tuple[str, str, str, str]], int]:
    """Rows ``(leaf, before, after, verdict)`` and the number of failures."""
    a, b = leaves(before), leaves(after)
    rows, failures = [], 0
    for key in sorted(set(a) | set(b)):
        left = exact(a[key]) if key in a else "(absent)"
        right = exact(b[key]) if key in b else "(absent)"
        if left == right:
            verdict = "same"
        elif VARIES.match(key) and key in a and key in b:
            verdict = "varies"
        else:
            verdict, failures = "DIFFERENT", failures + 1
        rows.append((key, left, right, verdict))
    return rows, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--markdown", action="store_true", help="print every deterministic leaf as a table")
    args = parser.parse_args(argv)
    rows, failures = compare(json.loads(args.before.read_text()), json.loads(args.after.read_text()))
    if args.markdown:
        print("| leaf | before | after | |\n|---|---|---|---|")
        for key, left, right, verdict in rows:
            if verdict != "varies":
                print(f"| `{key}` | `{left}` | `{right}` | {verdict} |")
    for key, left, right, verdict in rows:
        if verdict == "DIFFERENT":
            print(f"DIFFERENT {key}: {left} -> {right}", file=sys.stderr)
    same = sum(v == "same" for *_, v in rows)
    varies = sum(v == "varies" for *_, v in rows)
    print(f"{same} leaves equal bit for bit, {varies} vary between runs (time, load, memory, paths), "
          f"{failures} differ", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
