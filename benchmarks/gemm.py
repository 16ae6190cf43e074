"""Cost of the emulated low-precision GEMMs relative to plain BF16 and FP32 matmuls of the same shape.

The emulated backend (``lp_lightning/ops/emulated.py``) decodes both operands exactly and
accumulates in FP32 with one rounding. This script times, for each format and each GEMM of the
contract (dense fprop/dgrad/wgrad ``M×K×N``, grouped fprop/dgrad/wgrad over ``T`` token rows in
``E`` uneven groups):

- ``emulated``: ``low_precision_matmul`` / ``low_precision_grouped_matmul`` on operands quantized
  beforehand (``quantize``: the two operands' quantisation, timed as its own case);
- ``bf16`` / ``fp32``: the same product with ``torch.matmul`` on BF16 / FP32 tensors (grouped: one
  matmul per group, the loop a high-precision grouped GEMM runs); shared by the formats.

All cases run in interleaved rounds (every case once per round, the order reversed on odd rounds:
A B … B A) after one warm-up round, so every case sees the same machine state; each figure
``gemm/<format>/<op>`` reports the medians, the median of the per-round ``emulated / bf16`` ratios
and their spread, and in ``detail`` the FP32 time, ``ratio_vs_fp32`` and the quantisation time.
Informational: no target (issue 14 asks for the step time, not the GEMM, to be within 1.5×).

Prints one JSON object (``figures`` in the results.json schema of ``benchmarks/suite/common.py``)::

    python benchmarks/gemm.py --m 1024 --k 1024 --n 1024 --tokens 1024 --experts 8 --rounds 10
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # suite/ and this checkout's lp_lightning
from suite.common import quantiles, time_interleaved, timed_figure  # noqa: E402

from lp_lightning.formats import QuantizationRole as R  # noqa: E402
from lp_lightning.formats import recipe_for  # noqa: E402
from lp_lightning.ops import low_precision_grouped_matmul, low_precision_matmul, use_backend  # noqa: E402

FORMATS = ("mxfp8_e4m3", "hif8")


def _counts(tokens: int, experts: int, generator: torch.Generator) -> torch.Tensor:
    """Uneven per-expert token counts summing to ``tokens`` (one expert left empty when E > 2)."""
    weights = torch.rand(experts, generator=generator) + 0.2
    if experts > 2:
        weights[1] = 0.0
    counts = torch.floor(weights / weights.sum() * tokens).to(torch.int64)
    counts[0] += tokens - int(counts.sum())
    return counts


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


def _operands(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    m, k, n, t, e = args.m, args.k, args.n, args.tokens, args.experts
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    counts = _counts(t, e, g).to(device)
    return {"x": rand(m, k), "w": rand(n, k), "dy": rand(m, n), "gx": rand(t, k), "gw": rand(e, k, n),
            "gdy": rand(t, n), "counts": counts}


def _cases(fmt: str, o: dict[str, Any]) -> dict[str, tuple[Callable[[], tuple[Any, Any]], str, bool]]:
    """op -> (quantize both operands, layout, grouped) for one format."""
    recipe = recipe_for(fmt)

    def q(role: R, t: torch.Tensor, orientation: str, group_list: torch.Tensor | None = None) -> Any:
        return recipe.quantizer(role).quantize(t, orientation=orientation, group_list=group_list)

    x, w, dy, gx, gw, gdy, counts = (o[k] for k in ("x", "w", "dy", "gx", "gw", "gdy", "counts"))
    return {
        "dense_fprop": (lambda: (q(R.INPUT_FWD, x, "row"), q(R.WEIGHT_FWD, w, "row")), "NT", False),
        "dense_dgrad": (lambda: (q(R.GRAD_OUTPUT, dy, "row"), q(R.WEIGHT_BWD, w, "col")), "NN", False),
        "dense_wgrad": (lambda: (q(R.GRAD_OUTPUT, dy, "col"), q(R.INPUT_BWD, x, "col")), "TN", False),
        "grouped_fprop": (lambda: (q(R.INPUT_FWD, gx, "row"), q(R.WEIGHT_FWD, gw, "col")), "NN", True),
        "grouped_dgrad": (lambda: (q(R.GRAD_OUTPUT, gdy, "row"), q(R.WEIGHT_BWD, gw, "row")), "NT", True),
        "grouped_wgrad": (lambda: (q(R.INPUT_BWD, gx, "col", counts), q(R.GRAD_OUTPUT, gdy, "col", counts)), "TN",
                          True),
    }  # fmt: skip


def _references(o: dict[str, Any], dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """op -> the high-precision product of the same shape in ``dtype``."""
    c = {k: v.to(dtype) if k != "counts" else v for k, v in o.items()}
    host = o["counts"].tolist()
    return {
        "dense_fprop": lambda: c["x"] @ c["w"].T,
        "dense_dgrad": lambda: c["dy"] @ c["w"],
        "dense_wgrad": lambda: c["dy"].T @ c["x"],
        "grouped_fprop": lambda: _grouped_reference(c["gx"], c["gw"], "NN", host),
        "grouped_dgrad": lambda: _grouped_reference(c["gdy"], c["gw"], "NT", host),
        "grouped_wgrad": lambda: _grouped_reference(c["gx"], c["gdy"], "TN", host),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Times every case (module docstring) and returns the report with its ``figures``."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    o = _operands(args, device)
    cases: dict[str, Callable[[], object]] = {}
    for dtype in (torch.bfloat16, torch.float32):
        for op, fn in _references(o, dtype).items():
            cases[f"{op}/{str(dtype).removeprefix('torch.')}"] = fn
    with use_backend("emulated"):
        for fmt in args.formats:
            for op, (quantize, layout, grouped) in _cases(fmt, o).items():
                left, right = quantize()
                if grouped:
                    emulated = (lambda l=left, r=right, lay=layout: low_precision_grouped_matmul(
                        l, r, o["counts"], layout=lay, output_dtype=torch.bfloat16))
                else:
                    emulated = (lambda l=left, r=right, lay=layout: low_precision_matmul(
                        l, r, layout=lay, output_dtype=torch.bfloat16))
                cases[f"{op}/{fmt}"] = emulated
                cases[f"{op}/{fmt}/quantize"] = quantize
        samples = time_interleaved(cases, warmup=1, rounds=args.rounds, sync=sync)
    shapes = {"dense_MKN": [args.m, args.k, args.n], "grouped_TKN_E": [args.tokens, args.k, args.n, args.experts],
              "group_counts": o["counts"].tolist()}
    figures = {}
    for fmt in args.formats:
        for op in _cases(fmt, o):
            emu, fp32 = statistics.median(samples[f"{op}/{fmt}"]), statistics.median(samples[f"{op}/float32"])
            figures[f"gemm/{fmt}/{op}"] = timed_figure(
                samples, f"{op}/{fmt}", f"{op}/bfloat16", target=None, criterion=None,
                detail={"fp32_s": quantiles(samples[f"{op}/float32"]), "ratio_vs_fp32": emu / fp32,
                        "quantize_s": quantiles(samples[f"{op}/{fmt}/quantize"]),
                        "shape": shapes["grouped_TKN_E" if op.startswith("grouped") else "dense_MKN"]},
            )
    return {
        "benchmark": "gemm", "backend": "emulated", "device": str(device), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "machine": platform.machine(), "rounds": args.rounds, **shapes,
        "figures": figures,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, default=1024, help="dense rows M (tokens)")
    parser.add_argument("--k", type=int, default=1024, help="contraction dim K (hidden)")
    parser.add_argument("--n", type=int, default=1024, help="output columns N")
    parser.add_argument("--tokens", type=int, default=1024, help="grouped GEMM token rows T")
    parser.add_argument("--experts", type=int, default=8, help="grouped GEMM groups E")
    parser.add_argument("--rounds", type=int, default=10, help="timed interleaved rounds (median reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads on CPU")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    print(json.dumps(measure(parser.parse_args(argv)), indent=2))


if __name__ == "__main__":
    main()
