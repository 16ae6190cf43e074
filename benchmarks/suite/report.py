"""results.json of the benchmark suite and its results table (between marker comments).

:func:`markdown` renders every figure of a results dict as one table, with the machine it came
from above it and, below it, each distinct account of the unmet figures once, after the names of
the figures it covers; :func:`insert_between_markers` puts it into a page (``benchmarks/README.md``,
``docs/performance.md``) between ``<!-- results:begin -->`` and ``<!-- results:end -->``.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

from suite.common import FIGURE_KEYS

MARK_BEGIN, MARK_END = "<!-- results:begin -->", "<!-- results:end -->"
ORDER = ("step_time/", "step_time_growth/", "recompiles/", "first_step/", "thread_thrash/", "wire/", "memory/",
         "codec/", "gemm/", "suite/")
"""Table order: figure-name prefixes (longest match wins)."""
_SYMBOL = {"<=": "≤", ">=": "≥", "==": "="}


def check_schema(results: dict[str, Any]) -> None:
    """Raises ValueError when ``results`` lacks a top-level block or a figure lacks a key of
    :data:`suite.common.FIGURE_KEYS`."""
    for key in ("machine", "settings", "elapsed_s", "figures"):
        if key not in results:
            raise ValueError(f"results.json has no {key!r}: regenerate it with benchmarks/run_all.py.")
    for name, fig in results["figures"].items():
        absent = [k for k in FIGURE_KEYS if k not in fig]
        if absent:
            raise ValueError(f"figure {name!r} lacks {absent}: regenerate it with benchmarks/run_all.py.")


def _rank(name: str) -> int:
    matches = [i for i, prefix in enumerate(ORDER) if name.startswith(prefix)]
    return max(matches, key=lambda i: len(ORDER[i])) if matches else len(ORDER)


def _quantity(value: float | int | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "s":
        return f"{value * 1e3:.2f} ms" if abs(value) < 1 else f"{value:.3f} s"
    if unit == "bytes":
        return f"{value / 2**20:.3f} MiB" if abs(value) >= 2**20 else f"{value / 2**10:.1f} KiB"
    if unit == "count":
        return str(int(value))
    return f"{value:.4g}"


def _target(fig: dict[str, Any]) -> str:
    if fig["criterion"] is None:
        return "—"
    quantity, op, _ = fig["criterion"].split()
    return f"{quantity} {_SYMBOL[op]} {fig['target']:g}"


def _met(fig: dict[str, Any]) -> str:
    return {True: "yes", False: "**no**", None: "—"}[fig["met"]]


def _spread(fig: dict[str, Any]) -> str:
    s = fig.get("spread")
    if not s or "min" not in s:
        return ""
    return f"{s['min']:.3g}–{s['max']:.3g} (n={s['n']})"


def _machine_line(results: dict[str, Any]) -> str:
    m, st = results["machine"], results["settings"]
    versions = m.get("versions") or {}
    load = lambda v: "n/a" if not v else f"{v[0]:.2f}"  # noqa: E731
    threads = st.get("threads_per_run") or "n/a"
    return textwrap.fill(
        f"Measured by `python benchmarks/run_all.py{' --quick' if results.get('mode') == 'quick' else ''}` on "
        f"{m['cpu_model']}, {m['physical_cores'] or '?'} cores / {m['logical_cpus']} threads "
        f"({m['usable_cpus']} usable), 1-minute load average {load(m['load_average_start'])} at the start and "
        f"{load(m['load_average_end'])} at the end (the cores were shared: compare ratios, not seconds); "
        f"torch {m['torch']}, torchao {m['torchao']}, lightning {versions.get('lightning')}, lp-lightning commit "
        f"`{versions.get('git_commit')}`; {m['date_utc']}; the suite took {results['elapsed_s']:.0f} s. "
        f"Training runs: `configs/dsv3_tiny.yaml` (deterministic, reshard after forward), widths "
        f"{st['widths']}, processes {st['processes']}, `OMP_NUM_THREADS` "
        f"{st['omp_num_threads'] if st['omp_num_threads'] is not None else 'unset (the product default)'}, "
        f"torch intra-op threads per rank seen {threads}. How each figure is computed: `benchmarks/README.md`.",
        width=100, break_on_hyphens=False,
    )


def _grouped_accounts(names: list[str], figures: dict[str, Any]) -> list[tuple[list[str], str]]:
    """(figure names, account) of the unmet figures, one entry per distinct account, in table order."""
    groups: dict[str, list[str]] = {}
    for name in names:
        if figures[name]["met"] is False:
            groups.setdefault(figures[name].get("account", ""), []).append(name)
    return [(covered, account) for account, covered in groups.items()]


def markdown(results: dict[str, Any]) -> str:
    """The results block: machine line, the table of every figure, then each distinct account of the
    unmet figures once, after the names of the figures it covers."""
    check_schema(results)
    figures = results["figures"]
    names = sorted(figures, key=lambda n: (_rank(n), n))
    lines = [_machine_line(results), "",
             "| figure | value | baseline | ratio | target | met | spread |", "|---|---|---|---|---|---|---|"]
    for name in names:
        f = figures[name]
        ratio = "n/a" if f["ratio"] is None else f"{f['ratio']:.3f}"
        if f["ratio_is"] == "baseline / value" and f["ratio"] is not None:
            ratio += " (speed-up)"
        lines.append(f"| `{name}` | {_quantity(f['value'], f['unit'])} | {_quantity(f['baseline'], f['unit'])} | "
                     f"{ratio} | {_target(f)} | {_met(f)} | {_spread(f)} |")
    accounts = _grouped_accounts(names, figures)
    if accounts:
        lines += ["", "Unmet figures and their accounts:", ""]
        lines += [textwrap.fill(f"- {', '.join(f'`{n}`' for n in covered)}: {account}", width=100,
                                subsequent_indent="  ", break_on_hyphens=False) for covered, account in accounts]
    return "\n".join(lines) + "\n"


def insert_between_markers(readme: Path, block: str, begin_mark: str = MARK_BEGIN, end_mark: str = MARK_END) -> None:
    """Replaces the text between the ``begin_mark`` and ``end_mark`` lines of ``readme`` (default
    :data:`MARK_BEGIN` / :data:`MARK_END`) with ``block``.

    Only markers alone on their line count: prose that names them (in backticks) is left alone.

    Raises:
        ValueError: ``readme`` lacks one of the two marker lines, or has them in the wrong order.
    """
    text = readme.read_text()
    begin = re.search(rf"^{re.escape(begin_mark)}\n", text, re.MULTILINE)
    end = re.search(rf"^{re.escape(end_mark)}$", text[begin.end():], re.MULTILINE) if begin else None
    if begin is None or end is None:
        raise ValueError(f"{readme}: needs a {begin_mark!r} line followed by a {end_mark!r} line where the "
                         "table belongs; add them.")
    readme.write_text(f"{text[:begin.end()]}{block}{text[begin.end() + end.start():]}")


def write_results(path: Path, results: dict[str, Any]) -> None:
    """Writes results.json (indented, sorted figure names)."""
    check_schema(results)
    results = {**results, "figures": dict(sorted(results["figures"].items(), key=lambda kv: (_rank(kv[0]), kv[0])))}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
