"""Usage errors of the command lines (``lp-lightning fit / validate``, ``plan``, ``st``): one block, no usage dump.

A usage error is ``<prog>: error: <message>`` and ``<prog> --help lists every option.`` (docs/usage.md);
jsonargparse's multi-line type errors are cut to the key, what was expected and the value given.
Pure Python: every layer may import it.
"""

from __future__ import annotations

__all__ = ["condensed", "usage_error_text"]


def condensed(message: str, max_lines: int = 4) -> str:
    """jsonargparse's multi-line type errors (``Parser key "...":`` and a dump of the union's subtypes) cut to the
    key, what was expected and the value given (≤ ``max_lines``); every other message is kept whole (the launch
    check's list of illegal shards names every FQN)."""
    lines = [line.rstrip() for line in message.strip().splitlines() if line.strip()]
    if len(lines) <= max_lines or not lines[0].startswith("Parser key "):
        return "\n".join(lines)
    expected = [line.strip().lstrip("- ") for line in lines[1:] if line.strip().lstrip("- ").startswith("Expected")]
    given = [line.strip() for line in lines if line.strip().startswith("Given value:")]
    kept = [lines[0], *("  " + line for line in expected[: max_lines - 1 - len(given[-1:])]), *("  " + g for g in given[-1:])]
    return "\n".join(kept[:max_lines])


def usage_error_text(prog: str, message: str, pointer: str = "every option") -> str:
    """``<prog>: error: <condensed message>`` and ``<prog> --help lists <pointer>.``, newline-terminated."""
    return f"{prog}: error: {condensed(message)}\n{prog} --help lists {pointer}.\n"
