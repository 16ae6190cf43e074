"""MXFP8 codec against an independent RCEIL reference written here.

The reference (``_ref_quantize``) works in numpy float64: block amax in float64 (exact), the scale
quotient ``amax / 448`` as the spec defines it (an IEEE float32 division, numpy keeps subnormals),
the exponent rounded up with ``math``-style ``frexp`` on float64, and the elements rounded by
``ml_dtypes.float8_e4m3fn`` (round-half-even). Nothing in it calls ``lp_lightning``.

Error bound used below (derived from the E4M3 format, the numerics notes (docs/numerics.md) yardstick): RCEIL puts every
block's ``amax / scale`` in ``(224, 448]``. An element whose ``|x| / scale`` lies in E4M3's normal
range ``[2^-6, 448]`` is rounded to 3 mantissa bits, so its error is at most half an ulp,
``2^(e-4)`` for ``|x|/scale`` in ``[2^e, 2^(e+1))``: relative error ``<= 2^-4``. Below ``2^-6``
(E4M3 subnormals, spacing ``2^-9``) the absolute error is at most ``2^-10 * scale``.

Compiled kernels are switched off in this file (each ``torch.compile`` costs tens of seconds on
2 cores); ``test_fused_kernels_equal_eager_bit_for_bit`` switches them on and is marked slow.
"""

from __future__ import annotations

import math
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lp_lightning.formats import compiled_kernels_enabled, set_compiled_kernels
from lp_lightning.formats.mxfp8 import codec as mxfp8
from lp_lightning.formats.mxfp8.e8m0 import e8m0_to_float32, rceil_codes

FP32_TINY = float(np.finfo(np.float32).tiny)  # 2^-126
FP32_MAX = float(np.finfo(np.float32).max)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _eager_kernels():
    previous = compiled_kernels_enabled()
    set_compiled_kernels(False)
    yield
    set_compiled_kernels(previous)


# ------------------------------------------------------------------------------------------
# Independent reference
# ------------------------------------------------------------------------------------------


def _ref_row_blocks(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """RCEIL reference for row blocks of a float64 array ``[..., K]`` → (uint8 data, int codes)."""
    K = a.shape[-1]
    Kb = -(-K // 32)
    padded = np.zeros(a.shape[:-1] + (Kb * 32,), dtype=np.float64)
    padded[..., :K] = a
    blocks = padded.reshape(a.shape[:-1] + (Kb, 32))
    finite = np.isfinite(blocks).all(axis=-1)
    with np.errstate(invalid="ignore"):
        amax = np.where(finite, np.abs(np.where(np.isfinite(blocks), blocks, 0.0)).max(axis=-1), 0.0)
    quotient = (amax.astype(np.float32) / np.float32(448.0)).astype(np.float64)  # spec: FP32 division
    mant, exp = np.frexp(quotient)  # quotient = mant * 2^exp, mant in [0.5, 1)
    ceil_log2 = np.where(mant == 0.5, exp - 1, exp)  # exact power of two stays, anything above rounds up
    code = np.where(quotient == 0.0, 0, np.clip(ceil_log2 + 127, 0, 254))
    code = np.where(finite, code, 255)
    scale = np.ldexp(1.0, np.where(finite, code, 127) - 127)
    with np.errstate(invalid="ignore"):
        values = np.clip(blocks / scale[..., None], -448.0, 448.0)
    data = values.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    data = np.where(finite[..., None], data, np.uint8(0x7F))
    data = data.reshape(a.shape[:-1] + (Kb * 32,))[..., :K]
    return data.astype(np.uint8), code.astype(np.int64)


def _ref_quantize(x: torch.Tensor, orientation: str) -> tuple[np.ndarray, np.ndarray]:
    a = x.to(torch.float32).numpy().astype(np.float64)  # exact for all three input dtypes
    if orientation == "row":
        return _ref_row_blocks(a)
    data, code = _ref_row_blocks(np.swapaxes(a, -1, -2))
    return np.swapaxes(data, -1, -2), np.swapaxes(code, -1, -2)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


def _assert_matches_reference(x: torch.Tensor, orientation: str) -> tuple[torch.Tensor, torch.Tensor]:
    data, scale = mxfp8.quantize(x, orientation=orientation)
    ref_data, ref_code = _ref_quantize(x, orientation)
    assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape
    assert scale.dtype == torch.float8_e8m0fnu and tuple(scale.shape) == ref_code.shape
    np.testing.assert_array_equal(_bytes(scale).astype(np.int64), ref_code)
    np.testing.assert_array_equal(_bytes(data), ref_data)
    return data, scale


def _spread(shape: tuple[int, ...], dtype: torch.dtype, lo: int = -12, hi: int = 8) -> torch.Tensor:
    """Normal values whose magnitudes vary per element over 2^lo..2^hi (so scales differ per block)."""
    x = torch.randn(shape) * torch.exp2(torch.randint(lo, hi, shape).float())
    return x.to(dtype)


# ------------------------------------------------------------------------------------------
# Dense quantize: bits against the reference
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("shape", "orientation"),
    [
        ((3, 33), "row"),
        ((5, 70), "row"),
        ((2, 3, 45), "row"),
        ((1,), "row"),
        ((64,), "row"),
        ((45, 7), "col"),
        ((70, 33), "col"),
        ((2, 45, 9), "col"),
        ((32, 5), "col"),
        ((1, 3), "col"),
    ],
)
def test_quantize_matches_reference_on_partial_blocks(shape, orientation, dtype):
    _assert_matches_reference(_spread(shape, dtype), orientation)


@pytest.mark.parametrize("orientation", ["row", "col"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_blocks_zero_nan_inf(orientation, dtype):
    x = _spread((64, 96), dtype)
    view = x if orientation == "row" else x.transpose(0, 1)  # view[i, 32b:32b+32] is one block
    view[0, 0:32] = 0.0  # all-zero block
    view[1, 32:64] = -0.0  # all-negative-zero block
    view[2, 5] = math.nan
    view[3, 40] = math.inf
    view[4, 50] = -math.inf
    view[5, 0:32] = -1e-30  # tiny negatives: some round to -0 (0x80)
    data, scale = _assert_matches_reference(x, orientation)
    codes = _bytes(scale) if orientation == "row" else _bytes(scale).T
    data_view = _bytes(data) if orientation == "row" else _bytes(data).T
    assert codes[0, 0] == 0 and (data_view[0, 0:32] == 0).all()
    assert codes[1, 1] == 0 and (data_view[1, 32:64] == 0x80).all()
    for row, block in ((2, 0), (3, 1), (4, 1)):
        assert codes[row, block] == 0xFF
        assert (data_view[row, 32 * block : 32 * block + 32] == 0x7F).all()  # documented: whole block NaN
    assert codes[2, 1] != 0xFF  # neighbouring blocks are untouched


@pytest.mark.parametrize("orientation", ["row", "col"])
def test_blocks_near_two_pow_minus_127_and_fp32_subnormals(orientation):
    rng = np.random.default_rng(1)
    mags = np.array([1e-38, 2e-38, 1e-39, 1e-40, 3e-42, 1e-44, 1e-45, FP32_TINY, FP32_TINY / 2, 5.3e-36, 5.4e-36])
    a = rng.choice(mags, size=(40, 64)) * rng.choice([-1.0, 1.0], size=(40, 64))
    a[0, :] = 1e-45  # a block of the smallest FP32 subnormal only
    x = torch.tensor(a, dtype=torch.float32)
    data, scale = _assert_matches_reference(x, orientation)
    assert (_bytes(scale) <= 2).all()  # amax <= 5.4e-36 < 448 * 2^-124


def test_subnormal_quotient_tie_amax_rounds_scale_down_and_saturates():
    # amax = 1.75*2^-119 + 2^-142: fl32(amax/448) is exactly 2^-127, so the golden rule gives code 0
    # and the element (448.00003 after scaling) saturates to 448 (0x7E) instead of overflowing.
    amax = np.array([0x04600001], dtype=np.uint32).view(np.float32)[0]
    x = torch.zeros(1, 32)
    x[0, 3] = float(amax)
    x[0, 4] = -float(amax)
    data, scale = _assert_matches_reference(x, "row")
    assert _bytes(scale)[0, 0] == 0
    assert _bytes(data)[0, 3] == 0x7E and _bytes(data)[0, 4] == 0xFE
    next_up = np.array([0x04600002], dtype=np.uint32).view(np.float32)[0]
    x[0, 3] = float(next_up)
    _, scale = _assert_matches_reference(x, "row")
    assert _bytes(scale)[0, 0] == 1


@pytest.mark.parametrize("orientation", ["row", "col"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_near_fp32_max(orientation, dtype):
    x = _spread((64, 64), dtype, lo=100, hi=120)
    x[0, 0] = FP32_MAX if dtype == torch.float32 else float(torch.finfo(torch.bfloat16).max)
    x[1, 0] = -3.0e38
    x[0:32, 10] = 3.3e38  # rounds up to E4M3 256 under scale 2^120
    data, scale = _assert_matches_reference(x, orientation)
    assert (_bytes(scale) <= 247).all() and (_bytes(scale) == 247).any()
    # Documented overflow: e4m3 256 * 2^120 = 2^128 is +Inf in FP32.
    back = mxfp8.dequantize(data, scale, orientation=orientation)
    assert torch.isinf(back[0, 0]) and back[0, 0] > 0
    assert torch.isfinite(back[2:, 20:]).all()


def test_rceil_codes_follow_the_ops_nn_golden_rule_near_every_binade_edge():
    # Golden rule (docs/formats.md §2, ops-nn _mx_calculate_share_exp_nv) on S = fl32(amax/448): biased
    # exponent E of S, +1 if S is normal, E < 254 and mantissa != 0, or S is subnormal and its
    # mantissa > 0.5; computed here on the bits of numpy's float32 quotient.
    exps = np.arange(0, 255, dtype=np.int64)
    mants = np.concatenate([np.arange(0, 64), 0x600000 + np.arange(-64, 64), 0x7FFFFF - np.arange(0, 64),
                            np.random.default_rng(5).integers(0, 1 << 23, 256)])
    bits = ((exps[:, None] << 23) | mants[None, :]).reshape(-1).astype(np.uint32)
    amax = bits.view(np.float32)
    s_bits = (amax / np.float32(448.0)).view(np.uint32).astype(np.int64)
    e, m = s_bits >> 23, s_bits & 0x7FFFFF
    golden = np.clip(e + np.where(e > 0, (m > 0) & (e < 254), m > 0x400000), 0, 254)
    code, rcp = rceil_codes(torch.from_numpy(amax.copy()))
    np.testing.assert_array_equal(code.numpy(), golden)
    np.testing.assert_array_equal(rcp.numpy().astype(np.float64), np.ldexp(1.0, 127 - golden))
    special, _ = rceil_codes(torch.tensor([math.nan, math.inf, 0.0, -math.nan]))
    assert special.tolist() == [255, 255, 0, 255]


def test_amax_exactly_448_scale_one_and_449_scale_two():
    x = torch.zeros(2, 32)
    x[0, 0], x[1, 0] = 448.0, 449.0
    x[0, 1], x[1, 1] = 1.0, 1.0
    data, scale = _assert_matches_reference(x, "row")
    assert _bytes(scale)[:, 0].tolist() == [127, 128]
    assert _bytes(data)[0, 0] == 0x7E  # 448 stays 448
    assert _bytes(data)[1, 0] == 0x76  # 449/2 = 224.5 -> 224


@pytest.mark.parametrize("orientation", ["row", "col"])
def test_three_d_inputs_block_per_matrix(orientation):
    x = _spread((3, 40, 50), torch.bfloat16)
    data, scale = _assert_matches_reference(x, orientation)
    for e in range(3):
        d_e, s_e = mxfp8.quantize(x[e], orientation=orientation)
        assert torch.equal(_bits8(d_e), _bits8(data[e])) and torch.equal(_bits8(s_e), _bits8(scale[e]))


def _bits8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_non_contiguous_input_equals_contiguous():
    base = _spread((70, 45), torch.float32)
    x = base.t()  # [45, 70], non-contiguous
    for orientation in ("row", "col"):
        d1, s1 = mxfp8.quantize(x, orientation=orientation)
        d2, s2 = mxfp8.quantize(x.contiguous(), orientation=orientation)
        assert torch.equal(_bits8(d1), _bits8(d2)) and torch.equal(_bits8(s1), _bits8(s2))


def test_empty_tensors():
    cases = (((0, 40), "row", (0, 2)), ((4, 0), "row", (4, 0)), ((0, 5), "col", (0, 5)))
    for shape, orientation, scale_shape in cases:
        data, scale = mxfp8.quantize(torch.zeros(shape), orientation=orientation)
        assert tuple(data.shape) == shape and tuple(scale.shape) == scale_shape
        assert mxfp8.dequantize(data, scale, orientation=orientation).shape == shape


@settings(max_examples=40, deadline=None)
@given(
    a=hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=70),
        elements=st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
    ),
    orientation=st.sampled_from(["row", "col"]),
)
def test_property_any_fp32_tensor_matches_reference(a, orientation):
    _assert_matches_reference(torch.from_numpy(a.copy()), orientation)


def _e4m3_probe_values() -> np.ndarray:
    """Every E4M3 value, every midpoint between neighbours, and their FP32 neighbours (±2 ulp)."""
    grid = np.arange(0, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    mids = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(np.float32)
    base = np.concatenate([grid, mids, np.float32([448.0, 449.0, 464.0, 465.0, 1e30, np.inf, FP32_TINY, 1e-45])])
    bits = base.view(np.int32)
    around = np.concatenate([(bits + d).view(np.float32) for d in (-2, -1, 0, 1, 2)])
    around = around[np.isfinite(around) | np.isinf(around)]
    return np.concatenate([around, -around, np.float32([np.nan, -np.nan])])


def test_e4m3_rounding_all_three_paths_match_ml_dtypes():
    # Eager uses torch's cast; compiled graphs use the bit form (FP32 inputs) or the bit-cast-free
    # form (16-bit inputs). All three must give ml_dtypes' round-half-even bytes.
    rng = np.random.default_rng(3)
    random = (rng.standard_normal(20000) * np.exp2(rng.integers(-14, 10, 20000))).astype(np.float32)
    values = np.concatenate([_e4m3_probe_values(), random])
    expected = np.clip(values.astype(np.float64), -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    expected = np.where(np.isnan(values), np.uint8(0x7F), expected)  # documented canonical NaN
    q = torch.from_numpy(values)
    np.testing.assert_array_equal(mxfp8._e4m3_bytes(q).numpy(), expected)
    np.testing.assert_array_equal(mxfp8._e4m3_bytes_float_only(q).numpy(), expected)
    np.testing.assert_array_equal(mxfp8._e4m3_bytes_native(q).numpy(), expected)


# ------------------------------------------------------------------------------------------
# Dequantize
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("orientation", ["row", "col"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_is_exact_and_within_e4m3_bound(orientation, dtype):
    x = _spread((70, 45), dtype)
    data, scale = mxfp8.quantize(x, orientation=orientation)
    back = mxfp8.dequantize(data, scale, orientation=orientation)
    assert back.dtype == torch.float32 and back.shape == x.shape
    # Exact: equals e4m3 value * 2^(code-127) computed in float64.
    codes = _bytes(scale).astype(np.int64)
    if orientation == "row":
        codes_full = np.repeat(codes, 32, axis=-1)[..., :45]
    else:
        codes_full = np.repeat(codes, 32, axis=-2)[:70]
    expected = data.to(torch.float64).numpy() * np.ldexp(1.0, codes_full - 127)
    np.testing.assert_array_equal(back.numpy().astype(np.float64), expected)
    # Error bound (module docstring): rel <= 2^-4 in E4M3's normal range, abs <= 2^-10*scale below.
    xs = x.to(torch.float64).numpy()
    block_scale = np.ldexp(1.0, codes_full - 127)
    err = np.abs(back.numpy().astype(np.float64) - xs)
    normal = np.abs(xs) >= 2.0**-6 * block_scale
    assert (err[normal] <= 2.0**-4 * np.abs(xs[normal])).all()
    assert (err[~normal] <= 2.0**-10 * block_scale[~normal]).all()
    assert normal.mean() > 0.5  # the bound above is not vacuous


def test_dequantize_nan_scale_and_output_dtypes():
    x = _spread((4, 64), torch.float32)
    x[1, 3] = math.nan
    data, scale = mxfp8.quantize(x, orientation="row")
    back = mxfp8.dequantize(data, scale, orientation="row")
    assert torch.isnan(back[1, :32]).all() and torch.isfinite(back[1, 32:]).all()
    for out_dtype in (torch.bfloat16, torch.float16):
        low = mxfp8.dequantize(data, scale, orientation="row", output_dtype=out_dtype)
        assert low.dtype == out_dtype and torch.equal(low[0], back[0].to(out_dtype))


def test_e8m0_decode_matches_torch_and_powers_of_two():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = e8m0_to_float32(codes.view(torch.float8_e8m0fnu))
    expected = torch.tensor([math.ldexp(1.0, c - 127) for c in range(255)] + [math.nan], dtype=torch.float64)
    assert torch.equal(ours[:255].to(torch.float64), expected[:255]) and torch.isnan(ours[255])
    native = codes.view(torch.float8_e8m0fnu).to(torch.float32)
    assert torch.equal(native[:255], ours[:255])


# ------------------------------------------------------------------------------------------
# quantize_dual
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(64, 96), (70, 45), (2, 64, 32)])
def test_quantize_dual_equals_two_single_calls(shape):
    x = _spread(shape, torch.bfloat16)
    (rd, rs), (cd, cs) = mxfp8.quantize_dual(x)
    for (d, s), orientation in (((rd, rs), "row"), ((cd, cs), "col")):
        d1, s1 = _assert_matches_reference(x, orientation)
        assert torch.equal(_bits8(d), _bits8(d1)) and torch.equal(_bits8(s), _bits8(s1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 64, 96), (3, 70, 45), (96, 64)])
def test_quantize_dual_of_a_transposed_view_reads_it_in_place(shape, dtype):
    # A grouped weight's w_EKN view of its w_ENK master: the in-place path (row blocks of x are col
    # blocks of x.mT) must equal the reference bit for bit and return contiguous results.
    x = _spread(shape, dtype).mT.contiguous().mT
    assert not x.is_contiguous()
    (rd, rs), (cd, cs) = mxfp8.quantize_dual(x)
    for (d, s), orientation in (((rd, rs), "row"), ((cd, cs), "col")):
        d1, s1 = _assert_matches_reference(x, orientation)
        assert d.is_contiguous() and s.is_contiguous()
        assert torch.equal(_bits8(d), _bits8(d1)) and torch.equal(_bits8(s), _bits8(s1))


# ------------------------------------------------------------------------------------------
# Grouped (MoE token-sorted)
# ------------------------------------------------------------------------------------------


def _per_group_col(x: torch.Tensor, counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Reference: each group quantized on its own (zero-padded to 32 rows), results concatenated."""
    datas, codes, start = [], [], 0
    for n in counts:
        if n:
            d, c = _ref_quantize(x[start : start + n], "col")
            datas.append(d)
            codes.append(c)
        start += n
    K = x.shape[1]
    data = np.concatenate(datas, axis=0) if datas else np.zeros((0, K), np.uint8)
    code = np.concatenate(codes, axis=0) if codes else np.zeros((0, K), np.int64)
    return data, code


@pytest.mark.parametrize(
    "counts",
    [[5, 0, 40, 25], [33, 31, 1, 0, 64], [0, 0, 7], [32, 64, 0, 32], [70], [0]],
)
def test_grouped_col_equals_per_group_padded_quantization(counts):
    x = _spread((sum(counts), 40), torch.bfloat16)
    group_list = torch.tensor(counts, dtype=torch.int64)
    data, scale = mxfp8.quantize_grouped(x, group_list, orientation="col")
    ref_data, ref_code = _per_group_col(x, counts)
    assert tuple(scale.shape) == (sum(-(-n // 32) for n in counts), 40) == ref_code.shape
    assert mxfp8.grouped_scale_rows(group_list) == scale.shape[0]
    np.testing.assert_array_equal(_bytes(scale).astype(np.int64), ref_code)
    np.testing.assert_array_equal(_bytes(data), ref_data)
    back = mxfp8.dequantize_grouped(data, scale, group_list, orientation="col")
    start, parts = 0, []
    for n in counts:  # per-group dequantize must agree with the grouped one
        if n:
            d, s = mxfp8.quantize(x[start : start + n], orientation="col")
            parts.append(mxfp8.dequantize(d, s, orientation="col"))
        start += n
    expected = torch.cat(parts) if parts else torch.zeros(0, 40)
    assert torch.equal(back, expected)


@settings(max_examples=25, deadline=None)
@given(counts=st.lists(st.integers(min_value=0, max_value=70), min_size=1, max_size=5), k=st.integers(1, 40))
def test_property_grouped_col_equals_per_group_reference(counts, k):
    x = _spread((sum(counts), k), torch.float32)
    data, scale = mxfp8.quantize_grouped(x, torch.tensor(counts, dtype=torch.int64), orientation="col")
    ref_data, ref_code = _per_group_col(x, counts)
    np.testing.assert_array_equal(_bytes(scale).astype(np.int64), ref_code)
    np.testing.assert_array_equal(_bytes(data), ref_data)


def test_grouped_blocks_do_not_cross_group_boundaries():
    # Group 0 tiny values, group 1 huge: a block crossing the boundary would crush group 0 to zero.
    x = torch.cat([torch.full((20, 8), 1e-3), torch.full((20, 8), 1e3)])
    data, scale = mxfp8.quantize_grouped(x, torch.tensor([20, 20]), orientation="col")
    back = mxfp8.dequantize_grouped(data, scale, torch.tensor([20, 20]), orientation="col")
    assert torch.allclose(back, x, rtol=2.0**-4)


def test_grouped_row_equals_plain_row_and_validates():
    x = _spread((50, 70), torch.float16)
    group_list = torch.tensor([10, 0, 40])
    d, s = mxfp8.quantize_grouped(x, group_list, orientation="row")
    d1, s1 = mxfp8.quantize(x, orientation="row")
    assert torch.equal(_bits8(d), _bits8(d1)) and torch.equal(_bits8(s), _bits8(s1))
    back = mxfp8.dequantize_grouped(d, s, group_list, orientation="row")
    assert torch.equal(back, mxfp8.dequantize(d1, s1, orientation="row"))
    with pytest.raises(ValueError, match="sums to 49"):
        mxfp8.quantize_grouped(x, torch.tensor([10, 39]), orientation="row")


@pytest.mark.parametrize(
    ("group_list", "error", "match"),
    [
        ([10, 10], TypeError, "torch.Tensor"),
        (torch.tensor([10, 10], dtype=torch.int32), TypeError, "torch.int64"),
        (torch.tensor([[10, 10]]), ValueError, "1-D"),
        (torch.tensor([25, -5]), ValueError, "negative"),
        (torch.tensor([10, 5]), ValueError, "sums to 15 rows but the tensor has 20"),
    ],
)
def test_group_list_validation(group_list, error, match):
    with pytest.raises(error, match=match):
        mxfp8.quantize_grouped(torch.zeros(20, 8), group_list, orientation="col")


# ------------------------------------------------------------------------------------------
# Argument validation
# ------------------------------------------------------------------------------------------


def test_quantize_validation_messages():
    with pytest.raises(TypeError, match="float64"):
        mxfp8.quantize(torch.zeros(4, 32, dtype=torch.float64), orientation="row")
    with pytest.raises(TypeError, match="torch.Tensor"):
        mxfp8.quantize([1.0, 2.0], orientation="row")
    with pytest.raises(ValueError, match="'diag'"):
        mxfp8.quantize(torch.zeros(4, 32), orientation="diag")
    with pytest.raises(ValueError, match="at least 2 dims"):
        mxfp8.quantize(torch.zeros(32), orientation="col")
    with pytest.raises(ValueError, match="at least 1 dims"):
        mxfp8.quantize(torch.tensor(1.0), orientation="row")
    with pytest.raises(ValueError, match="2-D"):
        mxfp8.quantize_grouped(torch.zeros(2, 4, 8), torch.tensor([2]), orientation="col")


def test_dequantize_validation_messages():
    data, scale = mxfp8.quantize(torch.randn(40, 64), orientation="row")
    with pytest.raises(ValueError, match=r"expected \(40, 2\)"):
        mxfp8.dequantize(data, scale[:, :1], orientation="row")
    with pytest.raises(ValueError, match="expected"):
        mxfp8.dequantize(data, scale, orientation="col")
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        mxfp8.dequantize(data.view(torch.uint8), scale, orientation="row")
    with pytest.raises(TypeError, match="float8_e8m0fnu"):
        mxfp8.dequantize(data, scale.view(torch.uint8), orientation="row")
    with pytest.raises(TypeError, match="output_dtype"):
        mxfp8.dequantize(data, scale, orientation="row", output_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"expected \(2, 64\)"):
        mxfp8.dequantize_grouped(data, scale, torch.tensor([40]), orientation="col")


def test_scale_shape_helper():
    assert mxfp8.scale_shape((3, 5, 70), "row") == (3, 5, 3)
    assert mxfp8.scale_shape((3, 45, 7), "col") == (3, 2, 7)


# ------------------------------------------------------------------------------------------
# Fused (torch.compile) kernels == eager, bit for bit
# ------------------------------------------------------------------------------------------


def _kernel_inputs(dtype: torch.dtype) -> torch.Tensor:
    x = _spread((96, 64), torch.float32, lo=-30, hi=30)
    x[0, 0:32] = 0.0
    x[1, 0:32] = -0.0
    x[2, 7] = math.nan
    x[3, 40] = math.inf
    x[4, 0:32] = -1e-30
    if dtype == torch.float32:
        x[5, 0:32] = 1e-45  # FP32 subnormals
        x[6, 0:32] = 3.3e38
        x[7, 9] = float(np.array([0x04600001], dtype=np.uint32).view(np.float32)[0])
    return x.to(dtype)


@pytest.mark.slow
@pytest.mark.compiled
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_kernels_equal_eager_bit_for_bit(dtype):
    # Tiled past MIN_FUSED_NUMEL so that the wrappers really take the compiled path.
    x = _kernel_inputs(dtype).repeat(8, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a compile failure would fall back silently-ish
        for kernel, arg in (
            (mxfp8._quantize_row_blocks, x.view(-1, 32)),
            (mxfp8._quantize_col_blocks, x.view(-1, 32, 64)),
        ):
            fused_out = kernel(arg)
            eager_out = kernel.eager(arg)
            for f, e in zip(fused_out, eager_out):
                assert f.dtype == e.dtype and f.shape == e.shape
                assert torch.equal(f.view(torch.uint8), e.view(torch.uint8))
    # And the public API with compiled kernels still matches the independent reference.
    _assert_matches_reference(x, "row")
    _assert_matches_reference(x, "col")


@pytest.mark.compiled
def test_fused_dequantize_equals_eager_bit_for_bit_on_every_byte_and_code():
    # Every E4M3 byte (NaN, ±0, subnormals, ±448) under every E8M0 code (2^-127 … 2^127, NaN),
    # tiled past MIN_FUSED_NUMEL so that the wrappers really take the compiled path.
    bytes_ = torch.arange(256, dtype=torch.uint8).repeat(256)  # 256 blocks of 32 per code
    codes = torch.arange(256, dtype=torch.uint8).repeat_interleave(8)  # [2048] = one per block
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for out_dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16), (torch.float16, torch.int16)):
            row = (bytes_.view(-1, 32), codes)
            col = (bytes_.view(-1, 32, 64), codes.view(-1, 64))
            for kernel, (data, code) in ((mxfp8._dequantize_row_blocks, row), (mxfp8._dequantize_col_blocks, col)):
                fused_out = kernel(data, code, out_dtype)
                eager_out = kernel.eager(data, code, out_dtype)
                assert fused_out.dtype == out_dtype and fused_out.shape == data.shape
                assert torch.equal(fused_out.isnan(), eager_out.isnan())
                finite = ~eager_out.isnan()
                assert torch.equal(fused_out.view(bits)[finite], eager_out.view(bits)[finite])
    # The public API with compiled kernels equals the float64 product e4m3 · 2^(code - 127), exactly
    # (converting it to FP32 is exact, bar the documented overflow to ±Inf above FP32's maximum).
    data = bytes_.view(-1, 64).view(torch.float8_e4m3fn)
    scale = codes.view(-1, 2).view(torch.float8_e8m0fnu)
    back = mxfp8.dequantize(data, scale, orientation="row")
    expected = data.to(torch.float64) * torch.exp2(codes.view(-1, 2).double() - 127).repeat_interleave(32, -1)
    expected[(codes.view(-1, 2) == 255).repeat_interleave(32, -1)] = math.nan
    assert torch.equal(back.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(back[finite], expected[finite].float())
    assert (back.isinf() == (expected.abs() >= 2.0**128)).all()


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.compiled)])
@pytest.mark.parametrize("shape", [(256, 128), (70, 45), (3, 64, 96)])
@pytest.mark.parametrize("orientation", ["row", "col"])
def test_quantize_with_values_equals_quantize_then_dequantize(compiled, shape, orientation):
    # The emulated backend's fused cast (data, scale and the decoded values from one kernel) must
    # be the two public calls bit for bit, special blocks included.
    set_compiled_kernels(compiled)
    x = _spread(shape, torch.bfloat16)
    x.view(-1)[:32] = 0.0  # an all-zero block (code 0)
    x.view(-1)[40] = math.nan
    for values_dtype in (torch.bfloat16, torch.float32):
        data, scale, values = mxfp8.quantize_with_values(x, orientation=orientation, values_dtype=values_dtype)
        ref_data, ref_scale = mxfp8.quantize(x, orientation=orientation)
        assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
        assert torch.equal(scale.view(torch.uint8), ref_scale.view(torch.uint8))
        ref_values = mxfp8.dequantize(ref_data, ref_scale, orientation=orientation, output_dtype=values_dtype)
        assert values.dtype == values_dtype and values.shape == x.shape
        assert torch.equal(values.isnan(), ref_values.isnan())
        assert torch.equal(values.nan_to_num(), ref_values.nan_to_num())
