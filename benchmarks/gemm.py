"""Cost of the emulated low-precision GEMMs relative to plain BF16 and FP32 matmuls of the same shape.

The emulated backend decodes both operands to FP32 (exact), multiplies in FP32 and rounds once
(``lp_lightning/ops/emulated.py``). Decoding is O(M·K + K·N) against the O(M·N·K) product, so the
emulated GEMM should cost little more than an FP32 matmul of the same shape, and be of the order of
a BF16 one. This script measures, in one run, for each format and each GEMM of the contract
(dense fprop/dgrad/wgrad, grouped fprop/dgrad/wgrad):

- ``emulated_s``: median seconds of ``low_precision_matmul`` / ``low_precision_grouped_matmul`` on
  operands quantized beforehand (quantization is timed separately as ``quantize_s``);
- ``bf16_s`` / ``fp32_s``: the same product with ``torch.matmul`` on BF16 / FP32 tensors (grouped:
  one matmul per group, the same loop the emulation runs);
- ``ratio_vs_bf16`` / ``ratio_vs_fp32``: ``emulated_s`` divided by those.

It prints one JSON object. Example::

    python benchmarks/gemm.py --m 1024 --k 1024 --n 1024 --tokens 2048 --experts 8 --repeats 5

Timings on a shared machine are noisy; the ratios, not the absolute numbers, are the result.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Callable

import torch

from lp_lightning.formats import QuantizationRole as R
from lp_lightning.formats import recipe_for
from lp_lightning.ops import low_precision_grouped_matmul, low_precision_matmul, use_backend


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    fn()  # warm-up (lazy tables, compiled codec kernels, allocator)
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _counts(tokens: int, experts: int, generator: torch.Generator) -> torch.Tensor:
    """Uneven per-expert token counts summing to ``tokens`` (one expert left empty when E > 2)."""
    weights = torch.rand(experts, generator=generator) + 0.2
    if experts > 2:
        weights[1] = 0.0
    counts = torch.floor(weights / weights.sum() * tokens).to(torch.int64)
    counts[0] += tokens - int(counts.sum())
    return counts


def _dense_cases(m: int, k: int, n: int, fmt: str, device: torch.device, g: torch.Generator):
    recipe = recipe_for(fmt)
    x = torch.randn(m, k, generator=g).to(device)
    w = torch.randn(n, k, generator=g).to(device)
    dy = torch.randn(m, n, generator=g).to(device)
    q = lambda role, t, o: recipe.quantizer(role).quantize(t, orientation=o)  # noqa: E731
    return {
        "dense_fprop": (lambda: (q(R.INPUT_FWD, x, "row"), q(R.WEIGHT_FWD, w, "row")), "NT", (x, w.T)),
        "dense_dgrad": (lambda: (q(R.GRAD_OUTPUT, dy, "row"), q(R.WEIGHT_BWD, w, "col")), "NN", (dy, w)),
        "dense_wgrad": (lambda: (q(R.GRAD_OUTPUT, dy, "col"), q(R.INPUT_BWD, x, "col")), "TN", (dy.T, x)),
    }


def _grouped_cases(tokens: int, experts: int, k: int, n: int, fmt: str, device: torch.device, g: torch.Generator):
    recipe = recipe_for(fmt)
    counts = _counts(tokens, experts, g).to(device)
    x = torch.randn(tokens, k, generator=g).to(device)
    w = torch.randn(experts, k, n, generator=g).to(device)
    dy = torch.randn(tokens, n, generator=g).to(device)
    q = lambda role, t, o, gl=None: recipe.quantizer(role).quantize(t, orientation=o, group_list=gl)  # noqa: E731
    return counts, {
        "grouped_fprop": (lambda: (q(R.INPUT_FWD, x, "row"), q(R.WEIGHT_FWD, w, "col")), "NN", (x, w, "NN")),
        "grouped_dgrad": (lambda: (q(R.GRAD_OUTPUT, dy, "row"), q(R.WEIGHT_BWD, w, "row")), "NT", (dy, w, "NT")),
        "grouped_wgrad": (
            lambda: (q(R.INPUT_BWD, x, "col", counts), q(R.GRAD_OUTPUT, dy, "col", counts)), "TN", (x, dy, "TN")
        ),
    }


def _grouped_reference(a: torch.Tensor, b: torch.Tensor, layout: str, counts: list[int]) -> list[torch.Tensor]:
    """The same per-group products with plain torch.matmul (what a high-precision GMM computes)."""
    outs, start = [], 0
    for g, count in enumerate(counts):
        rows = slice(start, start + count)
        if layout == "NN":
            outs.append(a[rows] @ b[g])
        elif layout == "NT":
            outs.append(a[rows] @ b[g].T)
        else:
            outs.append(a[rows].T @ b[rows])
        start += count
    return outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, default=1024, help="dense rows M (tokens)")
    parser.add_argument("--k", type=int, default=1024, help="contraction dim K (hidden)")
    parser.add_argument("--n", type=int, default=1024, help="output columns N")
    parser.add_argument("--tokens", type=int, default=1024, help="grouped GEMM token rows T")
    parser.add_argument("--experts", type=int, default=8, help="grouped GEMM groups E")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions (median reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads on CPU")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--formats", nargs="+", default=["mxfp8_e4m3", "hif8"], choices=["mxfp8_e4m3", "hif8"])
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    results = []
    with use_backend("emulated"):
        for fmt in args.formats:
            cases = _dense_cases(args.m, args.k, args.n, fmt, device, g)
            for op, (quantize, layout, (a, b)) in cases.items():
                left, right = quantize()
                emulated_s = _median_seconds(
                    lambda: low_precision_matmul(left, right, layout=layout, output_dtype=torch.bfloat16),
                    args.repeats, device,
                )
                a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
                bf16_s = _median_seconds(lambda: a16 @ b16, args.repeats, device)
                fp32_s = _median_seconds(lambda: a @ b, args.repeats, device)
                results.append({
                    "op": op, "format": fmt, "layout": layout, "shape_MKN": [args.m, args.k, args.n],
                    "quantize_s": _median_seconds(quantize, args.repeats, device),
                    "emulated_s": emulated_s, "bf16_s": bf16_s, "fp32_s": fp32_s,
                    "ratio_vs_bf16": emulated_s / bf16_s, "ratio_vs_fp32": emulated_s / fp32_s,
                })
            counts, grouped = _grouped_cases(args.tokens, args.experts, args.k, args.n, fmt, device, g)
            host_counts = counts.tolist()
            for op, (quantize, layout, (a, b, ref_layout)) in grouped.items():
                left, right = quantize()
                emulated_s = _median_seconds(
                    lambda: low_precision_grouped_matmul(
                        left, right, counts, layout=layout, output_dtype=torch.bfloat16
                    ),
                    args.repeats, device,
                )
                a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
                bf16_s = _median_seconds(
                    lambda: _grouped_reference(a16, b16, ref_layout, host_counts), args.repeats, device
                )
                fp32_s = _median_seconds(
                    lambda: _grouped_reference(a, b, ref_layout, host_counts), args.repeats, device
                )
                results.append({
                    "op": op, "format": fmt, "layout": layout,
                    "shape_TKN_E": [args.tokens, args.k, args.n, args.experts], "group_counts": host_counts,
                    "quantize_s": _median_seconds(quantize, args.repeats, device),
                    "emulated_s": emulated_s, "bf16_s": bf16_s, "fp32_s": fp32_s,
                    "ratio_vs_bf16": emulated_s / bf16_s, "ratio_vs_fp32": emulated_s / fp32_s,
                })
    print(json.dumps({
        "benchmark": "gemm", "backend": "emulated", "device": str(device), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "machine": platform.machine(), "repeats": args.repeats, "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()
