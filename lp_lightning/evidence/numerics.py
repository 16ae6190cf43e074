"""Numerics yardstick: error metrics of a result against a reference, and the rounding-noise band.

How to read the numbers (docs/numerics.md §8.3, 八.3): measure both implementations against a high-precision
reference (FP32, better FP64) and compare the error with what the format allows.

* Normal rounding noise: relative error between ``eps·O(1)`` and ``eps·√k`` (``eps`` the format's
  spacing at 1.0, ``k`` the length of the reduction), and **zero-mean**.
* Orders of magnitude above that band: a bug (low-precision accumulation, a lost scale, a wrong
  dtype conversion).
* Within the band but with a **systematic sign** (``bias_over_rms`` far from 0): not rounding but an
  algorithmic difference (a different epsilon, scale position, RoPE precision ...).
* Caveat: heavy cancellation (true result much smaller than Σ|a_i·b_i|) inflates the relative
  error beyond ``eps·√k`` without any bug; judge it together with the input's conditioning.

Expected SQNR of one round-to-nearest cast of data that stays in the normal range (error uniform
in ±ulp/2, values log-uniform within each binade): 10·log10(12 / (4^-m · 0.541)) ≈ 6.02·m + 13.5 dB
for an ``m``-bit mantissa. E4M3 (m = 3, eps 2^-3, unit roundoff 2^-4): ≈ 31.5 dB (a Gaussian scaled
to amax = 448 measures 31.6 dB); BF16 (m = 7): ≈ 55.6 dB. HiF8 has 3 mantissa bits near 1
(|E| ≤ 3, [2^-3, 16)) and tapers to 2/1/0 bits further out: with amax scaled to 15 a Gaussian
measures the same ≈ 31.6 dB as E4M3, and values outside [2^-3, 16) lose 6 dB per mantissa bit.

All metrics are computed on the CPU in float64 so that a report does not depend on the device's
reduction order.

Tensor-name legend: ``result`` and ``reference`` have the same (any) shape; ``err = result −
reference`` element-wise.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

__all__ = ["NumericsReport", "RoundingBand", "compare", "expected_rounding_error", "sqnr_db"]


@dataclass(frozen=True, slots=True, kw_only=True)
class NumericsReport:
    """Error of ``result`` against ``reference`` (see ``compare``).

    The error metrics are taken over the positions where both tensors are finite; ``nonfinite``
    and ``reference_nonfinite`` count the rest, so check ``nonfinite == 0`` before trusting the
    other fields.

    Attributes:
        numel: Number of elements of each tensor.
        max_abs: max |err|, in the tensors' units.
        mse: mean(err²).
        nrmse: RMS(err) / RMS(reference) (dimensionless); ``inf`` if the reference is all zero
            and the error is not.
        cosine: ⟨result, reference⟩ / (‖result‖·‖reference‖); 1.0 when both are all zero, 0.0
            when exactly one of them is.
        sqnr_db: 10·log10(Σ reference² / Σ err²) in dB; ``+inf`` when err is exactly 0
            (``= −20·log10(nrmse)``).
        bias: mean(err), i.e. mean signed error ``result − reference``.
        bias_over_rms: bias / RMS(err); 0.0 when err is exactly 0. Zero-mean rounding noise over
            n elements gives |bias_over_rms| ≈ 1/√n; values near ±1 mean the error is almost all
            a systematic offset (docs/numerics.md §8.3: a bug or an algorithmic difference, not noise).
        nonfinite: Number of NaN/±Inf elements in ``result``.
        reference_nonfinite: Number of NaN/±Inf elements in ``reference``.
    """

    numel: int
    max_abs: float
    mse: float
    nrmse: float
    cosine: float
    sqnr_db: float
    bias: float
    bias_over_rms: float
    nonfinite: int
    reference_nonfinite: int

    def as_dict(self) -> dict[str, float | int]:
        """The fields as a plain ``dict`` (JSON-ready apart from ``inf``/``nan`` floats)."""
        return asdict(self)


def _as_float64_cpu(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"compare: {name} must be a torch.Tensor, got {type(t).__name__}.")
    if not t.is_floating_point():
        raise TypeError(
            f"compare: {name} must have a floating dtype, got {t.dtype}; decode quantized codes "
            "(e.g. lp_lightning.formats.hif8.decode) before comparing."
        )
    return t.detach().to("cpu").to(torch.float64).reshape(-1)


def compare(result: torch.Tensor, reference: torch.Tensor) -> NumericsReport:
    """Error metrics of ``result`` against ``reference`` (docs/numerics.md §8.3; requirement R12 (docs/design.md)).

    Args:
        result: Floating tensor, any shape, dtype and device (e.g. a low-precision GEMM output).
        reference: Floating tensor of the same shape (e.g. an FP32/FP64 or BF16 golden).

    Returns:
        A ``NumericsReport``; metrics over the positions where both are finite, computed on the
        CPU in float64. With no such position every error metric is NaN.

    Raises:
        TypeError: if either argument is not a floating tensor.
        ValueError: if the shapes differ.
    """
    both_tensors = isinstance(result, torch.Tensor) and isinstance(reference, torch.Tensor)
    if both_tensors and result.shape != reference.shape:
        raise ValueError(
            f"compare: result.shape={tuple(result.shape)} must equal reference.shape="
            f"{tuple(reference.shape)}; reshape or slice one of them explicitly."
        )
    res = _as_float64_cpu("result", result)
    ref = _as_float64_cpu("reference", reference)
    res_finite = torch.isfinite(res)
    ref_finite = torch.isfinite(ref)
    both = res_finite & ref_finite
    res, ref = res[both], ref[both]
    nonfinite = int((~res_finite).sum())
    reference_nonfinite = int((~ref_finite).sum())
    numel = int(res_finite.numel())
    if res.numel() == 0:
        nan = math.nan
        return NumericsReport(
            numel=numel, max_abs=nan, mse=nan, nrmse=nan, cosine=nan, sqnr_db=nan, bias=nan,
            bias_over_rms=nan, nonfinite=nonfinite, reference_nonfinite=reference_nonfinite,
        )
    err = res - ref
    noise = float((err * err).sum())
    signal = float((ref * ref).sum())
    res_power = float((res * res).sum())
    n = err.numel()
    mse = noise / n
    bias = float(err.mean())
    if noise == 0.0:
        nrmse, sqnr, bias_over_rms = 0.0, math.inf, 0.0
    else:
        nrmse = math.sqrt(noise / signal) if signal > 0 else math.inf
        sqnr = 10.0 * math.log10(signal / noise) if signal > 0 else -math.inf
        bias_over_rms = bias / math.sqrt(mse)
    if signal == 0.0 and res_power == 0.0:
        cosine = 1.0
    elif signal == 0.0 or res_power == 0.0:
        cosine = 0.0
    else:
        cosine = float((res * ref).sum()) / math.sqrt(signal * res_power)
    return NumericsReport(
        numel=numel,
        max_abs=float(err.abs().max()),
        mse=mse,
        nrmse=nrmse,
        cosine=cosine,
        sqnr_db=sqnr,
        bias=bias,
        bias_over_rms=bias_over_rms,
        nonfinite=nonfinite,
        reference_nonfinite=reference_nonfinite,
    )


def sqnr_db(result: torch.Tensor, reference: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB, ``compare(result, reference).sqnr_db``.

    Args:
        result: Floating tensor, any shape/dtype/device.
        reference: Floating tensor of the same shape.

    Returns:
        10·log10(Σ reference² / Σ (result − reference)²) over finite positions; ``+inf`` if exact.
    """
    return compare(result, reference).sqnr_db


class RoundingBand(NamedTuple):
    """Expected relative rounding error ``low ≤ err ≤ high`` (a 2-tuple)."""

    low: float
    high: float


def expected_rounding_error(eps: float, k: int) -> RoundingBand:
    """The band of normal relative rounding noise for a length-``k`` reduction (docs/numerics.md §8.3).

    Rule: if an implementation's relative error against a high-precision reference lies between
    ``eps·1`` and ``eps·√k`` and is zero-mean, it is ordinary rounding noise (bitwise differences
    are expected). Orders of magnitude above ``eps·√k`` mean a bug (accumulation in low precision,
    a lost scale, a wrong conversion); a systematic sign (``NumericsReport.bias_over_rms`` far
    from 0) means an algorithmic difference, not rounding, even when the size is in the band. The
    band assumes random signs and no severe cancellation. Example: BF16 accumulation of a
    k = 4096 dot product, unit roundoff u = 2^-8 → u·√k = 0.25 (docs/numerics.md §5.1).

    Args:
        eps: Relative precision of the format or accumulator in question (machine epsilon
            2^-M, or the unit roundoff 2^-(M+1) for round-to-nearest), > 0.
        k: Number of terms accumulated (the GEMM's contraction length), ≥ 1.

    Returns:
        ``RoundingBand(low=eps, high=eps·sqrt(k))``.

    Raises:
        ValueError: if ``eps`` is not a finite positive number or ``k`` is not an integer ≥ 1.
    """
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"expected_rounding_error: eps={eps!r} must be a finite number > 0 (e.g. 2**-8).")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"expected_rounding_error: k={k!r} must be an int >= 1 (the reduction length).")
    return RoundingBand(low=float(eps), high=float(eps) * math.sqrt(k))
