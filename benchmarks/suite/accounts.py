"""Accounts of unmet figures: where the time (bytes) goes and what would close the gap.

Issue 14 asks every unmet target to carry a profile-based account in results.json. Write it here,
keyed by figure name or by an ``fnmatch`` pattern (``"step_time/mxfp8/*"``), after profiling the
run that missed; ``python benchmarks/run_all.py --render-only`` re-applies this table to the
committed results.json and rewrites the results tables (benchmarks/README.md, docs/performance.md)
without measuring again. An account is used only while its figure is unmet; an unmet figure
without one says so in the table. Figures sharing an account are rendered once, together.

Example entry::

    "step_time/mxfp8/*": "cProfile of 12 steps (w512, 1 process): emulated GEMMs 40% ... ; "
                         "closing it needs ...",
"""

from __future__ import annotations

import fnmatch
from typing import Any

ACCOUNTS: dict[str, str] = {
    "step_time/mxfp8/*": (
        "cProfile of 4 steady steps at width 1024 (1 process, 1 thread, quiet; docs/performance.md): 2.73 s a step "
        "against bf16's 1.39. The compiled codec kernels take 0.87 s of it (1,024 calls: the refresh's dual cast of "
        "every FP32 master, the weight decode of every GEMM, row and col casts of each activation and gradient) "
        "plus 0.13 s of torch.compile call overhead; the GEMMs, on BF16 units, 0.39 s. At width 256 the ~0.1-0.2 ms "
        "overhead of each of ~256 calls a step weighs more. Closing it: one kernel for the row+col casts and for "
        "the refresh, AOTInductor kernels instead of torch.compile (call overhead), decoded weights reused between "
        "fprop and dgrad."
    ),
    "step_time/hif8/*": (
        "cProfile of 4 steady steps at width 1024 (1 process, 1 thread, quiet): 3.89 s a step against bf16's 1.39. "
        "The GEMMs take 1.5 s (MXFP8's take 0.39): they must stay IEEE FP32, because the per-tensor scales "
        "multiply the FP32 product before the one rounding and no CPU BF16 GEMM returns FP32 (oneDNN's "
        "fp32_precision=bf16 measured 250x over the FP32 accumulation bound). Codec kernels 0.67 s, amax 0.14 s. "
        "The FP32 GEMM share grows with width (at width 256 with 1 process it measured 1.48-1.84 over two suite "
        "runs on these shared cores; with 2 processes each rank multiplies half the tokens but still decodes every gathered weight in full, so the weight-side work "
        "weighs twice as much). Closing it: an FP32-output BF16 GEMM "
        "(oneDNN has the primitive, torch 2.13 does not expose it on CPU; CUDA has mm(out_dtype)), then the "
        "MXFP8 levers."
    ),
    "first_step/bf16": (
        "BF16 compiles nothing (run_summary compile.compiled_graphs 0): its first step (~1.2 s against ~0.39) "
        "holds FSDP2's lazy initialisation and oneDNN's first primitive creation for every GEMM shape; not "
        "profiled yet. The 8-bit runs add the kernel tracing below."
    ),
    "first_step/*": (
        "The anchor run follows runs of the same kernels, so Inductor's on-disk cache is warm (the C++ compile, "
        "40-50 s cold, is not in it). A new process still imports Inductor (~2.2 s) and traces each codec kernel "
        "with dynamo, 0.5-2.5 s a graph with symbolic shapes (sympy): 8 graphs in a default MXFP8 run (row/col "
        "casts per input dtype, decodes), 3 in HiF8; Inductor's vector-ISA check (~3 s) is now once per machine. "
        "torch._dynamo.config.caching_precompile did not shorten the tracing. Closing it: AOTInductor packages of "
        "the kernels (no tracing at start-up)."
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
