"""README.md stays short and every relative link in README.md and docs/ resolves (issue 22).

A relative link ``[text](path)`` or ``[text](path#anchor)`` must name an existing file or folder
(relative to the page that holds it); an ``#anchor`` into a markdown file must be the GitHub slug of
one of its headings (lower case, punctuation other than ``-`` and ``_`` dropped, spaces to ``-``,
``-1``, ``-2`` … for repeated headings). Links inside fenced code blocks and inline code are not
links. External links (``http:``, ``https:``, ``mailto:``) are not fetched.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_BYTES = 10_000
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup stripped, lower case, punctuation dropped, spaces to ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters and digits of every script, and "_"
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a markdown page, with GitHub's ``-1``, ``-2`` suffixes for repeats."""
    seen: dict[str, int] = {}
    for _, line in _prose_lines(page.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if match:
            slug = github_slug(match.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            if count:
                seen.setdefault(f"{slug}-{count}", 1)
    return set(seen)


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link of ``page`` outside code."""
    found = []
    for number, line in _prose_lines(page.read_text(encoding="utf-8")):
        reference = _REFERENCE.match(line)
        if reference:
            found.append((number, reference.group(1)))
            continue
        found += [(number, m.group(1)) for m in _LINK.finditer(_INLINE_CODE.sub("", line))]
    return found


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def broken_links(page: Path) -> list[str]:
    """One line per relative link of ``page`` whose file, folder or heading does not exist."""
    problems = []
    for number, target in links(page):
        if _EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / unquote(path_part)).resolve() if path_part else page
        where = f"{_shown(page)}:{number}: {target}"
        if not resolved.exists():
            problems.append(f"{where}: {_shown(resolved)} does not exist")
        elif anchor and resolved.suffix == ".md" and unquote(anchor).lower() not in anchors(resolved):
            problems.append(f"{where}: no heading with anchor #{anchor} in {_shown(resolved)}")
    return problems


def test_readme_is_short():
    size = (REPO / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, (
        f"README.md is {size} bytes, the limit is {README_MAX_BYTES}: move the detail to a page under docs/ "
        "and link it"
    )


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_relative_links_resolve(page: Path):
    problems = broken_links(page)
    assert not problems, "broken links (fix the path or the heading):\n" + "\n".join(problems)


def test_the_checker_sees_broken_links(tmp_path: Path):
    (tmp_path / "other.md").write_text("# Other page\n\n## The `plan` command (§15)\n\n## Repeat\n\n## Repeat\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md) [ok](other.md#the-plan-command-15) [ok](other.md#repeat-1) [ok](#page)\n"
        "[missing](nowhere.md) [bad anchor](other.md#nothing) [self](#absent)\n"
        "`[code](not-a-link.md)`\n```\n[fenced](not-a-link-either.md)\n```\n"
        "[web](https://example.com/x.md)\n[ref]: gone.md\n"
    )
    problems = broken_links(page)
    assert [p.split(": ")[1] for p in problems] == ["nowhere.md", "other.md#nothing", "#absent", "gone.md"], problems
