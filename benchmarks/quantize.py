"""Cost of the codec kernels (MXFP8 dual-axis quantisation, HiF8 encode/decode) against fair peers.

Every case is timed in one process in interleaved rounds (round ``r`` runs every case once, the
order reversed on odd rounds: A B … B A), after ``--warmup`` untimed rounds that also compile
every ``torch.compile``'d case; each figure reports the medians, the median of the **per-round
ratios** and their spread (min / quartiles / max over ``--rounds`` rounds). Cases (``S = --size``;
MXFP8 cases and copies on an ``S×S`` BF16 tensor, HiF8 and E4M3 cases on an ``S×S`` FP32 one):

- ``copy_``: ``out.copy_(x)`` into a buffer allocated and first-touched once — the memory-bound
  floor. The old ``x.clone()`` floor was bimodal (2.6-95 ms): each call allocates 32 MiB, which
  glibc serves with a fresh ``mmap`` and returns on free, so every call page-faults 8192 new pages
  that the kernel zeroes, at a cost that swings with the host. ``clone`` is still timed (detail).
- ``mxfp8_dual``: ``lp_lightning.formats.mxfp8.quantize_dual(x)`` (row + col MXFP8, RCEIL) with the
  compiled kernels (it allocates its outputs on every call, page faults included).
- ``torchao_compiled``: torchao's ``to_mx(t, float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)`` under
  ``torch.compile``, called on ``x`` and on ``x.t().contiguous()``: torchao's emulated dim0 + dim1
  MX cast, compiled — the fair peer (eager torchao is in the eager phase only). Compiled per call,
  not as one graph with the transpose: that graph is 3.6× slower (0.59 s against 0.16 s for
  4096², 2 threads, torch 2.13), and a peer gets its faster form.
- ``hif8_encode`` / ``hif8_decode``: ``lp_lightning.formats.hif8.encode`` of the FP32 tensor and
  ``decode`` of its codes; peers ``e4m3_cast_compiled`` / ``e4m3_decode_compiled``:
  ``torch.compile`` of ``x.to(torch.float8_e4m3fn)`` and of ``e4m3.to(torch.float32)`` (the eager
  casts ``e4m3_cast`` / ``e4m3_decode`` are timed too, detail).

Figures (``benchmarks/README.md``; targets of issue 14):

- ``codec/mxfp8_dual_vs_torchao_compiled``: speed-up (``torchao_compiled / mxfp8_dual``) ≥ 2;
- ``codec/mxfp8_dual_vs_clone``: ``mxfp8_dual / copy_`` ≤ 3;
- ``codec/hif8_encode_vs_compiled_e4m3_cast``, ``codec/hif8_decode_vs_compiled_e4m3_decode`` ≤ 1.5.

``--eager-rounds N`` (default 3, 0 skips) adds a second phase, apart so that the eager kernels'
large temporaries do not disturb the first: each compiled codec next to its eager reference
(``set_compiled_kernels(False)``) and eager torchao, plus a bit-identity check of compiled against
eager on the benchmark inputs. ``compile_s`` is each compiled case's first call minus its median.

Prints one JSON object (``figures`` in the results.json schema of ``benchmarks/suite/common.py``)::

    python benchmarks/quantize.py --size 4096 --rounds 20 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # suite/ and this checkout's lp_lightning
from suite.common import missing, quantiles, time_interleaved, timed_figure  # noqa: E402

from lp_lightning.formats import hif8, mxfp8, set_compiled_kernels  # noqa: E402

FIGURES = {  # name: (case, peer, target, criterion, speed-up)
    "codec/mxfp8_dual_vs_torchao_compiled": ("mxfp8_dual", "torchao_compiled", 2.0, "ratio >= target", True),
    "codec/mxfp8_dual_vs_clone": ("mxfp8_dual", "copy_", 3.0, "ratio <= target", False),
    "codec/hif8_encode_vs_compiled_e4m3_cast": ("hif8_encode", "e4m3_cast_compiled", 1.5, "ratio <= target", False),
    "codec/hif8_decode_vs_compiled_e4m3_decode": ("hif8_decode", "e4m3_decode_compiled", 1.5, "ratio <= target",
                                                  False),
}  # fmt: skip


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=4096, help="side S of the S×S inputs (default 4096)")
    parser.add_argument("--rounds", type=int, default=20, help="timed interleaved rounds (default 20)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (compiles; default 2)")
    parser.add_argument("--eager-rounds", type=int, default=3, help="rounds of the eager-vs-compiled phase; 0 skips")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def _with_compiled(enabled: bool, fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        set_compiled_kernels(enabled)
        try:
            return fn()
        finally:
            set_compiled_kernels(True)

    return run


def _torchao_both() -> tuple[Callable[[torch.Tensor], object] | None, Callable[[torch.Tensor], object] | None, str]:
    """torchao's MX cast of both orientations: eager, compiled (module docstring), and torchao's
    version or why it is unavailable."""
    try:
        import torchao
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except Exception as exc:  # noqa: BLE001 - optional benchmark dependency
        return None, None, f"unavailable ({type(exc).__name__}: {exc})"

    def cast(t: torch.Tensor) -> object:
        return to_mx(t, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)

    compiled_cast = torch.compile(cast, dynamic=False)
    eager = lambda x: (cast(x), cast(x.t().contiguous()))  # noqa: E731
    compiled = lambda x: (compiled_cast(x), compiled_cast(x.t().contiguous()))  # noqa: E731
    return eager, compiled, getattr(torchao, "__version__", "unknown")


def _first_call_s(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _bit_identity(x_bf16: torch.Tensor, x_f32: torch.Tensor, codes: torch.Tensor) -> dict[str, bool]:
    """Compiled against eager codec outputs on the benchmark inputs (bitwise)."""
    fused = mxfp8.quantize_dual(x_bf16)
    eager = _with_compiled(False, lambda: mxfp8.quantize_dual(x_bf16))()
    pairs = [(a, b) for f, e in zip(fused, eager) for a, b in zip(f, e)]  # type: ignore[arg-type]
    out = {"mxfp8_dual": all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs)}
    out["hif8_encode"] = torch.equal(hif8.encode(x_f32), _with_compiled(False, lambda: hif8.encode(x_f32))())
    dec_eager = _with_compiled(False, lambda: hif8.decode(codes, torch.float32))()
    out["hif8_decode"] = torch.equal(hif8.decode(codes, torch.float32).view(torch.int32), dec_eager.view(torch.int32))
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Times every case (module docstring) and returns the report with its ``figures``."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    S = args.size
    x_bf16 = torch.randn(S, S).to(torch.bfloat16)
    x_f32 = torch.randn(S, S)
    e4m3 = x_f32.to(torch.float8_e4m3fn)
    codes = hif8.encode(x_f32)
    out = torch.empty_like(x_bf16)
    out.copy_(x_bf16)  # first touch: the pages exist before the first timed copy

    cast_compiled = torch.compile(lambda t: t.to(torch.float8_e4m3fn), dynamic=False)
    decode_compiled = torch.compile(lambda t: t.to(torch.float32), dynamic=False)
    cases: dict[str, Callable[[], object]] = {
        "copy_": lambda: out.copy_(x_bf16),
        "clone": lambda: x_bf16.clone(),
        "mxfp8_dual": lambda: mxfp8.quantize_dual(x_bf16),
        "hif8_encode": lambda: hif8.encode(x_f32),
        "e4m3_cast_compiled": lambda: cast_compiled(x_f32),
        "e4m3_cast": lambda: x_f32.to(torch.float8_e4m3fn),
        "hif8_decode": lambda: hif8.decode(codes, torch.float32),
        "e4m3_decode_compiled": lambda: decode_compiled(e4m3),
        "e4m3_decode": lambda: e4m3.to(torch.float32),
    }
    torchao_both, torchao_compiled, torchao_version = _torchao_both()
    if torchao_compiled is not None:
        cases["torchao_compiled"] = lambda: torchao_compiled(x_bf16)
    compiled = [n for n in cases if n in ("mxfp8_dual", "hif8_encode", "hif8_decode", "torchao_compiled")
                or n.endswith("_compiled")]
    first_call = {name: _first_call_s(cases[name]) for name in compiled}
    samples = time_interleaved(cases, warmup=args.warmup, rounds=args.rounds)

    figures: dict[str, Any] = {}
    for name, (case, peer, target, criterion, speedup) in FIGURES.items():
        if peer not in samples:
            figures[name] = missing(f"torchao {torchao_version}", target=target, criterion=criterion, unit="s",
                                    ratio_is="baseline / value" if speedup else "value / baseline")
            continue
        detail: dict[str, Any] = {"size": [S, S]}
        if peer == "copy_":  # the allocating clone, for comparison with the old baseline
            detail["clone_s"] = quantiles(samples["clone"])
            detail["ratio_vs_allocating_clone"] = statistics.median(samples[case]) / statistics.median(samples["clone"])
        elif peer.endswith("_compiled") and peer.startswith("e4m3"):
            eager_peer = peer.removesuffix("_compiled")
            detail[f"{eager_peer}_eager_s"] = quantiles(samples[eager_peer])
            detail["ratio_vs_eager_cast"] = statistics.median(samples[case]) / statistics.median(samples[eager_peer])
        figures[name] = timed_figure(samples, case, peer, target=target, criterion=criterion, speedup=speedup,
                                     detail=detail)

    eager: dict[str, Any] = {}
    if args.eager_rounds > 0:
        eager_cases: dict[str, Callable[[], object]] = {
            "mxfp8_dual": cases["mxfp8_dual"],
            "mxfp8_dual_eager": _with_compiled(False, lambda: mxfp8.quantize_dual(x_bf16)),
            "hif8_encode": cases["hif8_encode"],
            "hif8_encode_eager": _with_compiled(False, lambda: hif8.encode(x_f32)),
            "hif8_decode": cases["hif8_decode"],
            "hif8_decode_eager": _with_compiled(False, lambda: hif8.decode(codes, torch.float32)),
        }
        if torchao_both is not None:
            eager_cases["torchao_eager"] = lambda: torchao_both(x_bf16)
        eager_samples = time_interleaved(eager_cases, warmup=1, rounds=args.eager_rounds)
        med = {k: statistics.median(v) for k, v in eager_samples.items()}
        eager = {
            "median_s": {k: round(v, 6) for k, v in med.items()},
            "eager_over_compiled": {n: round(med[f"{n}_eager"] / med[n], 3)
                                    for n in ("mxfp8_dual", "hif8_encode", "hif8_decode")},
            "compiled_equals_eager": _bit_identity(x_bf16, x_f32, codes),
        }
        if "torchao_eager" in med:
            eager["torchao_eager_over_mxfp8_dual"] = round(med["torchao_eager"] / med["mxfp8_dual"], 3)

    medians = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "benchmark": "quantize",
        "size": S,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torchao": torchao_version,
        "platform": platform.platform(),
        "median_s": {k: round(v, 6) for k, v in medians.items()},
        "compile_s": {k: round(max(0.0, v - medians[k]), 3) for k, v in first_call.items()},
        "figures": figures,
        "eager_phase": eager or None,
    }


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(measure(_parse_args(argv)), indent=2))


if __name__ == "__main__":
    main()
