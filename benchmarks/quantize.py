"""Cost of the codec kernels (MXFP8 dual-axis quantisation, HiF8 encode/decode) against baselines.

Everything is timed side by side in one process, in interleaved rounds (round ``r`` runs every
case once), and each case reports the median over ``--repeats`` rounds after a warm-up, so the
ratios compare the same machine state. The slow eager reference kernels run in a second phase
(``--eager-repeats`` rounds, each next to its compiled twin) so that their large temporaries do not
disturb the first. Cases (``S = --size``):

- ``clone``: ``x.clone()`` of the ``S×S`` BF16 input — the memory-bound floor.
- ``mxfp8_dual``: ``lp_lightning.formats.mxfp8.quantize_dual(x)`` (row + col MXFP8, RCEIL) with the
  compiled (``@fused``) kernels; ``mxfp8_dual_eager`` the same with ``set_compiled_kernels(False)``.
- ``torchao_mx_both``: torchao's MX cast of both orientations, ``to_mx(x, float8_e4m3fn, 32,
  ScaleCalculationMode.RCEIL)`` and ``to_mx(x.t().contiguous(), ...)`` — what torchao's emulated
  MXFP8 training does for dim0 and dim1 (``_to_mxfp8_dim1_kernel_wrapper``).
- ``hif8_encode`` / ``hif8_decode`` (+ ``_eager``): ``lp_lightning.formats.hif8.encode`` of an
  ``S×S`` FP32 tensor and ``decode`` of its codes to FP32; baselines ``native_e4m3_cast``
  (``x.to(torch.float8_e4m3fn)``) and ``native_e4m3_decode`` (E4M3 → FP32 ``.to``).

Compile cost is one-off and reported apart (``compile_s``: first call minus the steady median;
small when torch's on-disk inductor cache is warm). Ratios (lower is faster for ``*_over_*``):

- ``mxfp8_dual_over_clone`` — acceptance: ≤ 3.
- ``torchao_over_mxfp8_dual`` — speed-up over torchao; acceptance: ≥ 5.
- ``mxfp8_dual_eager_over_fused``, ``hif8_*_eager_over_fused`` — what compilation buys.
- ``hif8_encode_over_native_e4m3_cast``, ``hif8_decode_over_native_e4m3_decode`` — software HiF8
  against the native FP8 cast of the same FP32 tensor; acceptance: ≤ 1.5 each.

Prints one JSON object to stdout. Example::

    python benchmarks/quantize.py --size 4096 --repeats 10 --threads 2

Timings on a shared machine are noisy; compare ratios from one run, not absolute seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Callable

import torch

from lp_lightning.formats import mxfp8, set_compiled_kernels

TARGETS = {
    "mxfp8_dual_over_clone_max": 3.0,
    "torchao_over_mxfp8_dual_min": 5.0,
    "hif8_encode_over_native_e4m3_cast_max": 1.5,
    "hif8_decode_over_native_e4m3_decode_max": 1.5,
}


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=4096, help="side S of the S×S input (default 4096)")
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds per case (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds before timing")
    parser.add_argument(
        "--eager-repeats", type=int, default=3, help="timed rounds of the (slow) eager-vs-fused phase; 0 skips it"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's current setting)"
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def _with_compiled(enabled: bool, fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        set_compiled_kernels(enabled)
        try:
            return fn()
        finally:
            set_compiled_kernels(True)

    return run


def _first_call_seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _torchao_case(x: torch.Tensor) -> tuple[Callable[[], object] | None, str]:
    try:
        import torchao
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except Exception as exc:  # optional bench dependency
        return None, f"unavailable ({type(exc).__name__}: {exc})"

    def both() -> object:
        row = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
        col = to_mx(x.t().contiguous(), torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
        return row, col

    return both, getattr(torchao, "__version__", "unknown")


def _time_interleaved(cases: dict[str, Callable[[], object]], warmup: int, repeats: int) -> dict[str, float]:
    """Median seconds per case; round ``r`` runs every case once, so all cases share machine state."""
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) for name, v in samples.items()}


def main() -> None:
    args = _parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    S = args.size
    x_bf16 = torch.randn(S, S).to(torch.bfloat16)
    x_f32 = torch.randn(S, S)
    e4m3 = x_f32.to(torch.float8_e4m3fn)

    # One-off compile cost: the first calls build the compiled kernels for these shapes/dtypes.
    first_call: dict[str, float] = {
        "mxfp8_dual": _first_call_seconds(lambda: mxfp8.quantize_dual(x_bf16)),
    }
    main_cases: dict[str, Callable[[], object]] = {
        "clone": lambda: x_bf16.clone(),
        "mxfp8_dual": _with_compiled(True, lambda: mxfp8.quantize_dual(x_bf16)),
        "native_e4m3_cast": lambda: x_f32.to(torch.float8_e4m3fn),
        "native_e4m3_decode": lambda: e4m3.to(torch.float32),
    }
    eager_cases: dict[str, Callable[[], object]] = {
        "mxfp8_dual": main_cases["mxfp8_dual"],
        "mxfp8_dual_eager": _with_compiled(False, lambda: mxfp8.quantize_dual(x_bf16)),
    }

    torchao_fn, torchao_version = _torchao_case(x_bf16)
    if torchao_fn is not None:
        main_cases["torchao_mx_both"] = torchao_fn

    hif8_status = "ok"
    try:  # the HiF8 codec is written by another helper: report its absence, do not fail
        from lp_lightning.formats import hif8

        first_call["hif8_encode"] = _first_call_seconds(lambda: hif8.encode(x_f32))
        codes = hif8.encode(x_f32)
        first_call["hif8_decode"] = _first_call_seconds(lambda: hif8.decode(codes, torch.float32))
    except Exception as exc:
        hif8 = None
        hif8_status = f"unavailable ({type(exc).__name__}: {exc})"
        first_call.pop("hif8_encode", None)
    if hif8 is not None:
        main_cases["hif8_encode"] = _with_compiled(True, lambda: hif8.encode(x_f32))
        main_cases["hif8_decode"] = _with_compiled(True, lambda: hif8.decode(codes, torch.float32))
        eager_cases["hif8_encode"] = main_cases["hif8_encode"]
        eager_cases["hif8_encode_eager"] = _with_compiled(False, lambda: hif8.encode(x_f32))
        eager_cases["hif8_decode"] = main_cases["hif8_decode"]
        eager_cases["hif8_decode_eager"] = _with_compiled(False, lambda: hif8.decode(codes, torch.float32))

    # Phase 1: the acceptance ratios. Phase 2 (apart, so that the eager kernels' large temporaries
    # do not disturb phase 1): eager vs fused, each pair timed side by side again.
    median = _time_interleaved(main_cases, args.warmup, args.repeats)
    eager_median = _time_interleaved(eager_cases, 1, args.eager_repeats) if args.eager_repeats > 0 else {}
    compile_s = {name: max(0.0, first - median[name]) for name, first in first_call.items()}

    # Bit-identity of the compiled path (cheap; the unit tests check it on special values too).
    fused_equals_eager = {}
    (rd, rs), (cd, cs) = main_cases["mxfp8_dual"]()  # type: ignore[misc]
    (erd, ers), (ecd, ecs) = _with_compiled(False, lambda: mxfp8.quantize_dual(x_bf16))()  # type: ignore[misc]
    pairs = ((rd, erd), (rs, ers), (cd, ecd), (cs, ecs))
    fused_equals_eager["mxfp8_dual"] = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs)
    if hif8 is not None:
        enc_eager = _with_compiled(False, lambda: hif8.encode(x_f32))()
        dec_eager = _with_compiled(False, lambda: hif8.decode(codes, torch.float32))()
        enc_fused = main_cases["hif8_encode"]()
        fused_equals_eager["hif8_encode"] = torch.equal(enc_fused, enc_eager)  # type: ignore[arg-type]
        fused_equals_eager["hif8_decode"] = torch.equal(
            main_cases["hif8_decode"]().view(torch.int32), dec_eager.view(torch.int32)  # type: ignore[union-attr]
        )

    ratios: dict[str, float | str] = {
        "mxfp8_dual_over_clone": median["mxfp8_dual"] / median["clone"],
    }
    if torchao_fn is not None:
        ratios["torchao_over_mxfp8_dual"] = median["torchao_mx_both"] / median["mxfp8_dual"]
        ratios["torchao_over_clone"] = median["torchao_mx_both"] / median["clone"]
    else:
        ratios["torchao_over_mxfp8_dual"] = torchao_version
    if hif8 is not None:
        ratios["hif8_encode_over_native_e4m3_cast"] = median["hif8_encode"] / median["native_e4m3_cast"]
        ratios["hif8_decode_over_native_e4m3_decode"] = median["hif8_decode"] / median["native_e4m3_decode"]
    else:
        for key in ("hif8_encode_over_native_e4m3_cast", "hif8_decode_over_native_e4m3_decode"):
            ratios[key] = hif8_status
    for name in ("mxfp8_dual", "hif8_encode", "hif8_decode"):
        if f"{name}_eager" in eager_median:
            ratios[f"{name}_eager_over_fused"] = eager_median[f"{name}_eager"] / eager_median[name]

    meets = {
        "mxfp8_dual_over_clone<=3": ratios["mxfp8_dual_over_clone"] <= TARGETS["mxfp8_dual_over_clone_max"],
    }
    if torchao_fn is not None:
        speedup = float(ratios["torchao_over_mxfp8_dual"])
        meets["torchao_over_mxfp8_dual>=5"] = speedup >= TARGETS["torchao_over_mxfp8_dual_min"]
    if hif8 is not None:
        for key in ("hif8_encode_over_native_e4m3_cast", "hif8_decode_over_native_e4m3_decode"):
            meets[f"{key}<=1.5"] = float(ratios[key]) <= TARGETS[f"{key}_max"]

    report = {
        "benchmark": "quantize",
        "size": S,
        "repeats": args.repeats,
        "eager_repeats": args.eager_repeats,
        "warmup": args.warmup,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torchao": torchao_version,
        "hif8": hif8_status,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "median_s": {k: round(v, 6) for k, v in median.items()},
        "median_s_eager_phase": {k: round(v, 6) for k, v in eager_median.items()},
        "compile_s": {k: round(v, 3) for k, v in compile_s.items()},
        "ratios": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in ratios.items()},
        "targets": TARGETS,
        "meets_targets": meets,
        "fused_equals_eager": fused_equals_eager,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
