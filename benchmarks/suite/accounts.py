"""Accounts of unmet figures: where the time (bytes) goes and what would close the gap.

Issue 14 asks every unmet target to carry a profile-based account in results.json. Write it here,
keyed by figure name or by an ``fnmatch`` pattern (``"step_time/mxfp8/*"``), after profiling the
run that missed; ``python benchmarks/run_all.py --render-only`` re-applies this table to the
committed results.json and rewrites the README tables without measuring again. An account is used
only while its figure is unmet; an unmet figure without one says so in the table.

Example entry::

    "step_time/mxfp8/*": "cProfile of 12 steps (w512, 1 process): emulated GEMMs 40% ... ; "
                         "closing it needs ...",
"""

from __future__ import annotations

import fnmatch
from typing import Any

ACCOUNTS: dict[str, str] = {
    "step_time/mxfp8/*": (
        "cProfile of steps 15-30 (w256, 1 process, 1 thread; docs/performance.md): on top of the BF16 work a "
        "step spends ~140 ms in the compiled codec kernels (2 casts of every activation and gradient, 4 decodes "
        "per layer, ~256 calls), ~0.1-0.4 ms of torch.compile call overhead per call, ~70 ms in the weight "
        "refresh (dual cast of 25 FP32 masters) and GEMMs now at BF16 speed (exact: BF16 units with FP32 "
        "accumulation). Closing it: one kernel for the row+col casts and for the refresh, AOTInductor kernels "
        "instead of torch.compile (call overhead), decoded weights reused between fprop and dgrad."
    ),
    "step_time/hif8/*": (
        "cProfile of steps 15-30 (w256, 1 process, 1 thread): the GEMMs must stay IEEE FP32 (the per-tensor "
        "scales multiply the FP32 product before the one rounding, and no CPU BF16 GEMM returns FP32; oneDNN's "
        "fp32_precision=bf16 measured 250x over the FP32 accumulation bound): ~140 ms/step against the BF16 "
        "GEMMs' ~40; encode ~75 ms (TA rounding is ~25 integer ops per element), decode of weights and saved "
        "inputs ~60, amax ~35, refresh ~55. The FP32 GEMM share grows with width. Closing it: an FP32-output "
        "BF16 GEMM (oneDNN has the primitive, torch 2.13 does not expose it on CPU; CUDA has mm(out_dtype)), "
        "then the MXFP8 levers."
    ),
    "first_step/bf16": (
        "BF16 compiles nothing (run_summary compile.compiled_graphs 0): its first step (~1.2 s against ~0.39) "
        "holds FSDP2's lazy initialisation and oneDNN's first primitive creation for every GEMM shape; not "
        "profiled yet. The 8-bit runs add the kernel tracing below."
    ),
    "first_step/*": (
        "A new process re-traces every codec kernel with dynamo and loads it from Inductor's on-disk cache "
        "(~1 s a graph on these cores, ~10 graphs for MXFP8: row/col casts per input dtype, decodes per output "
        "dtype); the C++ compile itself is cached (40-50 s cold). torch._dynamo.config.caching_precompile did "
        "not shorten it here. Closing it: AOTInductor packages of the kernels (no tracing at start-up)."
    ),
    "codec/mxfp8_dual_vs_clone": (
        "Dual-axis MXFP8 of a 4096x4096 BF16 tensor reads it twice (row and col kernels) and the col kernel "
        "reduces 32 rows with a strided access the compiled CPU loop does not vectorise as well as the row one; "
        "the copy_ floor is a streaming memcpy. Closing it: one kernel computing both orientations per 32x32 "
        "tile (one read, both outputs)."
    ),
    "codec/mxfp8_dual_vs_torchao_compiled": (
        "torchao's to_mx compiled is the same kind of Inductor loop; our edge is the E4M3 rounding arithmetic "
        "and the in-place block layout (1.5x). The remaining cost is the col orientation (see "
        "codec/mxfp8_dual_vs_clone); a fused 32x32-tile kernel would give the 2x."
    ),
    "codec/hif8_encode_vs_compiled_e4m3_cast": (
        "HiF8's tapered encoding (Dot prefix, sign-magnitude exponent, band-dependent mantissa width, ties "
        "away) is ~25 branch-free integer operations per element in the compiled loop, against a native E4M3 "
        "cast that is one vector conversion; decode is at the target. Closing it: a 256-entry threshold "
        "search on the FP32 bits (fewer ops), or the NPU's native hifloat8 cast."
    ),
    "suite/wall_time": (
        "24 CLI runs each pay 10-30 s of start-up (imports, model build, kernel tracing) outside their steps; "
        "the step counts are already at the minimum for steady medians. Closing it: fewer 2-process runs, or "
        "an in-process runner that keeps one interpreter per configuration."
    ),
}
"""Figure name or fnmatch pattern -> account (first match wins: exact names, then patterns in order)."""

NO_ACCOUNT = "unmet; no account yet (profile it and add one to ACCOUNTS in benchmarks/suite/accounts.py)"


def account_for(name: str, accounts: dict[str, str] | None = None) -> str | None:
    """The account of figure ``name``: an exact key, else the first matching pattern, else ``None``."""
    table = ACCOUNTS if accounts is None else accounts
    if name in table:
        return table[name]
    return next((text for pattern, text in table.items() if fnmatch.fnmatchcase(name, pattern)), None)


def apply_accounts(figures: dict[str, dict[str, Any]], accounts: dict[str, str] | None = None) -> None:
    """Sets ``account`` on every unmet figure (``met`` False) in place.

    An account the suite wrote itself (a figure that could not be measured says why:
    ``account_source`` ``"suite"``, see ``suite.common.missing``) is kept; otherwise the :data:`ACCOUNTS` entry, or
    :data:`NO_ACCOUNT`. A met or informational figure loses a table account it no longer needs.
    """
    for name, fig in figures.items():
        if fig.get("account_source") == "suite":
            continue
        if fig.get("met") is False:
            text = account_for(name, accounts)
            fig["account"] = text if text is not None else NO_ACCOUNT
            fig["account_source"] = "ACCOUNTS" if text is not None else "none"
        else:
            fig.pop("account", None)
            fig.pop("account_source", None)
