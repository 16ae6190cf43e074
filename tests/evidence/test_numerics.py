"""Numerics metrics on hand-computed cases, non-finite inputs, exact equality and the noise band."""

from __future__ import annotations

import math

import pytest
import torch

from lp_lightning.evidence.numerics import (
    NumericsReport,
    RoundingBand,
    compare,
    expected_rounding_error,
    sqnr_db,
)


def test_hand_computed_case():
    reference = torch.tensor([1.0, 2.0, 3.0, 4.0])
    result = torch.tensor([1.5, 2.0, 2.0, 4.0])  # err = [0.5, 0, -1, 0]
    r = compare(result, reference)
    assert r.numel == 4
    assert r.max_abs == 1.0
    assert r.mse == pytest.approx(1.25 / 4, abs=0, rel=1e-15)
    # Σref² = 30, Σerr² = 1.25
    assert r.nrmse == pytest.approx(math.sqrt(1.25 / 30), rel=1e-15)
    assert r.sqnr_db == pytest.approx(10 * math.log10(30 / 1.25), rel=1e-15)
    assert r.sqnr_db == pytest.approx(-20 * math.log10(r.nrmse), rel=1e-12)
    # ⟨res, ref⟩ = 1.5 + 4 + 6 + 16 = 27.5, Σres² = 2.25 + 4 + 4 + 16 = 26.25
    assert r.cosine == pytest.approx(27.5 / math.sqrt(30 * 26.25), rel=1e-15)
    assert r.bias == -0.125  # mean(err) = -0.5 / 4, sign is result − reference
    assert r.bias_over_rms == pytest.approx(-0.125 / math.sqrt(1.25 / 4), rel=1e-15)
    assert r.nonfinite == 0 and r.reference_nonfinite == 0


def test_exact_equality_gives_infinite_sqnr_and_no_bias():
    x = torch.randn(5, 7)
    r = compare(x.clone(), x)
    assert (r.max_abs, r.mse, r.nrmse, r.bias, r.bias_over_rms) == (0.0, 0.0, 0.0, 0.0, 0.0)
    assert r.sqnr_db == math.inf == sqnr_db(x, x)
    assert r.cosine == pytest.approx(1.0, abs=1e-15)


def test_pure_offset_is_all_bias():
    reference = torch.randn(1000, dtype=torch.float64)
    r = compare(reference + 0.01, reference)
    assert r.bias == pytest.approx(0.01, rel=1e-12)
    assert r.bias_over_rms == pytest.approx(1.0, rel=1e-12)
    assert r.max_abs == pytest.approx(0.01, rel=1e-12)


def test_rounding_noise_is_zero_mean_and_inside_the_band():
    """BF16 rounding of Gaussian data: nrmse within [u, eps] and |bias/rms| ~ 1/sqrt(n)."""
    n = 100_000
    reference = torch.randn(n)
    r = compare(reference.bfloat16(), reference)
    eps = 2.0**-7
    band = expected_rounding_error(eps / 2, 1)  # single cast: k = 1, unit roundoff u = eps/2
    assert band.low / 4 < r.nrmse < band.high
    assert abs(r.bias_over_rms) < 5 / math.sqrt(n)


def test_nonfinite_entries_are_counted_and_excluded():
    reference = torch.tensor([1.0, 2.0, 3.0, math.inf, 5.0])
    result = torch.tensor([1.0, math.nan, 3.5, math.inf, -math.inf])
    r = compare(result, reference)
    assert r.numel == 5
    assert r.nonfinite == 3 and r.reference_nonfinite == 1
    # Only positions 0 and 2 are finite in both: err = [0, 0.5], ref = [1, 3].
    assert r.max_abs == 0.5
    assert r.mse == 0.125
    assert r.sqnr_db == pytest.approx(10 * math.log10(10 / 0.25), rel=1e-15)


def test_all_nonfinite_gives_nan_metrics():
    r = compare(torch.full((3,), math.nan), torch.ones(3))
    assert r.nonfinite == 3
    assert all(math.isnan(v) for v in (r.max_abs, r.mse, r.nrmse, r.cosine, r.sqnr_db, r.bias))


def test_zero_reference():
    r = compare(torch.tensor([0.0, 1.0]), torch.zeros(2))
    assert r.nrmse == math.inf and r.sqnr_db == -math.inf and r.cosine == 0.0
    r = compare(torch.zeros(2), torch.zeros(2))
    assert r.sqnr_db == math.inf and r.cosine == 1.0 and r.nrmse == 0.0


def test_computed_in_float64_from_any_dtype():
    # A 2^-30 difference at magnitude 1 vanishes in float32; its square (2^-60) would be lost too.
    reference = torch.tensor([1.0, 1.0], dtype=torch.float64)
    r = compare(reference + torch.tensor([2.0**-30, 0.0], dtype=torch.float64), reference)
    assert r.max_abs == 2.0**-30 and r.mse == 2.0**-61
    # Mixed input dtypes: BF16 result against an FP64 reference, exact error 2^-20.
    r = compare(torch.ones(2, dtype=torch.bfloat16), torch.tensor([1.0, 1.0 + 2.0**-20], dtype=torch.float64))
    assert r.max_abs == 2.0**-20 and r.bias == -(2.0**-21)


def test_as_dict_round_trips():
    r = compare(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
    d = r.as_dict()
    assert set(d) == {
        "numel", "max_abs", "mse", "nrmse", "cosine", "sqnr_db", "bias", "bias_over_rms",
        "nonfinite", "reference_nonfinite",
    }
    assert NumericsReport(**d) == r


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"result.shape=\(3,\) must equal reference.shape=\(4,\)"):
        compare(torch.zeros(3), torch.zeros(4))
    with pytest.raises(TypeError, match="compare: reference must be a torch.Tensor"):
        compare(torch.zeros(3), [0.0, 0.0, 0.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="compare: result must have a floating dtype"):
        compare(torch.zeros(3, dtype=torch.uint8), torch.zeros(3))


def test_expected_rounding_error_band():
    band = expected_rounding_error(2.0**-8, 4096)
    assert isinstance(band, RoundingBand) and isinstance(band, tuple)
    assert band == (2.0**-8, 0.25)  # docs/numerics.md §5.1: u·sqrt(k) = 2^-8 · 64
    low, high = expected_rounding_error(0.125, 1)
    assert low == high == 0.125
    for bad_eps in (0.0, -1.0, math.inf, math.nan, "0.1"):
        with pytest.raises(ValueError, match="eps="):
            expected_rounding_error(bad_eps, 4)  # type: ignore[arg-type]
    for bad_k in (0, 2.5, True):
        with pytest.raises(ValueError, match="k="):
            expected_rounding_error(0.1, bad_k)  # type: ignore[arg-type]
