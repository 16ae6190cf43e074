"""The results.json figure schema, timing statistics and the machine block of the benchmark suite.

A **figure** is one measured quantity against its target (``benchmarks/README.md`` "results.json")::

    {"value", "baseline", "ratio", "ratio_is", "target", "criterion", "met", "unit",
     "spread"?, "account"?, "detail"?}

``ratio`` is ``value / baseline`` unless ``ratio_is`` says ``"baseline / value"`` (a speed-up);
``criterion`` names what is compared with ``target`` (``"ratio <= target"``, ``"value == target"``
...); ``met`` is ``None`` for an informational figure (``target`` ``None``) and ``False`` whenever
the compared quantity could not be measured (``None``). ``spread`` (timed figures) is
:func:`spread_of` of per-round ratios or per-sample times; ``account`` says why an unmet figure
misses (:mod:`suite.accounts`; ``account_source``: ``"suite"`` for a figure the suite could not
measure, ``"ACCOUNTS"`` for a hand-written account, ``"none"`` when there is none yet).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from typing import Any, Callable

CRITERIA = ("ratio <= target", "ratio >= target", "ratio == target", "value <= target", "value == target")
"""The comparisons a figure can make (``criterion``)."""

FIGURE_KEYS = ("value", "baseline", "ratio", "ratio_is", "target", "criterion", "met", "unit")
"""Keys every figure has (``spread``, ``account`` and ``detail`` are optional)."""


def _round(x: Any, digits: int = 6) -> Any:
    return round(x, digits) if isinstance(x, float) else x


def figure(
    value: float | int | None,
    baseline: float | int | None,
    *,
    target: float | int | None,
    criterion: str | None,
    unit: str,
    ratio: float | None = None,
    ratio_is: str = "value / baseline",
    spread: dict[str, Any] | None = None,
    detail: dict[str, Any] | None = None,
    account: str | None = None,
) -> dict[str, Any]:
    """One figure of results.json (module docstring).

    Args:
        value, baseline: The measured quantity and what it is compared with (``None``: not measured).
        target: The issue's target; ``None`` for an informational figure.
        criterion: One of :data:`CRITERIA` (``None`` with ``target`` ``None``).
        unit: Unit of ``value`` and ``baseline`` (``"s"``, ``"bytes"``, ``"count"``, ``"ratio"``).
        ratio: Overrides the computed ratio (e.g. a median of per-round ratios).
        ratio_is: ``"value / baseline"`` or ``"baseline / value"``.
        spread, detail, account: Optional fields, stored as given.

    Returns:
        The figure dict, ``met`` computed from ``criterion``.

    Raises:
        ValueError: an unknown ``criterion`` or ``ratio_is``, or a target without a criterion.
    """
    if (target is None) != (criterion is None) or (criterion is not None and criterion not in CRITERIA):
        raise ValueError(f"criterion={criterion!r} with target={target!r}: use one of {CRITERIA} with a target, "
                         "None without one.")
    if ratio_is not in ("value / baseline", "baseline / value"):
        raise ValueError(f"ratio_is={ratio_is!r}: use 'value / baseline' or 'baseline / value'.")
    if ratio is None and value is not None and baseline:
        ratio = value / baseline if ratio_is == "value / baseline" else baseline / value
    met: bool | None = None
    if criterion is not None:
        quantity = ratio if criterion.startswith("ratio") else value
        if quantity is None:
            met = False
        elif "<=" in criterion:
            met = quantity <= target
        elif ">=" in criterion:
            met = quantity >= target
        else:
            met = abs(quantity - target) <= 1e-12 * max(1.0, abs(target))
    out: dict[str, Any] = {
        "value": _round(value), "baseline": _round(baseline), "ratio": _round(ratio), "ratio_is": ratio_is,
        "target": target, "criterion": criterion, "met": met, "unit": unit,
    }  # fmt: skip
    if spread is not None:
        out["spread"] = spread
    if account is not None:
        out["account"] = account
    if detail is not None:
        out["detail"] = detail
    return out


def missing(reason: str, *, target: float | int | None, criterion: str | None, unit: str,
            ratio_is: str = "value / baseline") -> dict[str, Any]:
    """A figure that could not be measured: ``value`` ``None``, ``met`` ``False`` (or ``None`` when
    informational) and ``reason`` as its account."""
    out = figure(None, None, target=target, criterion=criterion, unit=unit, ratio_is=ratio_is, account=reason)
    out["account_source"] = "suite"  # kept by suite.accounts.apply_accounts
    return out


def quantiles(samples: list[float]) -> dict[str, float]:
    """``{"n", "min", "q1", "median", "q3", "max"}`` of ``samples`` (inclusive quartiles)."""
    if not samples:
        raise ValueError("quantiles of no samples: time at least one round.")
    s = sorted(samples)
    q1, _, q3 = statistics.quantiles(s, n=4, method="inclusive") if len(s) > 1 else (s[0], s[0], s[0])
    return {"n": len(s), "min": _round(s[0]), "q1": _round(q1), "median": _round(statistics.median(s)),
            "q3": _round(q3), "max": _round(s[-1])}


def spread_of(samples: list[float], of: str) -> dict[str, Any]:
    """A figure's ``spread``: :func:`quantiles` of ``samples`` plus what they are (``of``)."""
    return {"of": of, **quantiles(samples)}


def time_interleaved(
    cases: dict[str, Callable[[], object]], *, warmup: int, rounds: int, sync: Callable[[], None] = lambda: None
) -> dict[str, list[float]]:
    """Seconds of every case in every round; round ``r`` runs each case once, in the listed order on
    even rounds and reversed on odd ones (A B B A ...), so a slow drift of the machine hits every
    case alike. ``warmup`` untimed rounds first."""
    names = list(cases)
    for _ in range(warmup):
        for name in names:
            cases[name]()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            start = time.perf_counter()
            cases[name]()
            sync()
            samples[name].append(time.perf_counter() - start)
    return samples


def paired_ratios(a: list[float], b: list[float]) -> list[float]:
    """Per-round ``a[i] / b[i]`` of two cases timed in the same rounds."""
    if len(a) != len(b):
        raise ValueError(f"paired ratios need the same rounds, got {len(a)} and {len(b)} samples.")
    return [x / y for x, y in zip(a, b)]


def timed_figure(
    samples: dict[str, list[float]], name: str, base: str, *, target: float | None, criterion: str | None,
    speedup: bool = False, detail: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A figure of case ``name`` against case ``base`` from :func:`time_interleaved` samples: medians
    as value/baseline, the median of the per-round ratios as ratio, their quantiles as spread
    (``speedup``: ratios are ``base / name``)."""
    ratios = paired_ratios(samples[base], samples[name]) if speedup else paired_ratios(samples[name], samples[base])
    of = f"per-round {base} / {name} (speed-up)" if speedup else f"per-round {name} / {base}"
    return figure(
        statistics.median(samples[name]), statistics.median(samples[base]), target=target, criterion=criterion,
        unit="s", ratio=statistics.median(ratios), ratio_is="baseline / value" if speedup else "value / baseline",
        spread=spread_of(ratios, of),
        detail={"value_s": quantiles(samples[name]), "baseline_s": quantiles(samples[base]), **(detail or {})},
    )


def _cpu_model() -> tuple[str, int | None]:
    """CPU model name and physical core count from /proc/cpuinfo (``platform`` elsewhere)."""
    model, cores = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            physical = core = None
            for line in f:
                key, _, val = line.partition(":")
                key, val = key.strip(), val.strip()
                if key == "model name":
                    model = val
                elif key == "physical id":
                    physical = val
                elif key == "core id":
                    core = val
                elif not key and core is not None:
                    cores.add((physical, core))
                    physical = core = None
            if core is not None:
                cores.add((physical, core))
    except OSError:
        pass
    return model, (len(cores) or None)


def load_average() -> list[float] | None:
    """The 1/5/15-minute load averages (``None`` where the platform has none)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def machine(load_start: list[float] | None) -> dict[str, Any]:
    """The ``machine`` block: CPU model, physical cores, logical CPUs (threads), load averages at the
    start and end of the suite, software versions and the date (UTC)."""
    import torch

    from lp_lightning.versions import software_versions

    model, cores = _cpu_model()
    try:
        import torchao

        torchao_version = getattr(torchao, "__version__", "unknown")
    except Exception as exc:  # noqa: BLE001 - optional benchmark dependency
        torchao_version = f"unavailable ({type(exc).__name__})"
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu_model": model,
        "physical_cores": cores,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": affinity,
        "load_average_start": load_start,
        "load_average_end": load_average(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchao": torchao_version,
        "versions": software_versions(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }
