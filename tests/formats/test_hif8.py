"""HiF8 codec against an independent reference: docs/formats.md §1.4's code table, transcribed by hand,
and a codebook-nearest encoder (ties to the larger magnitude) written here in float64."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from lp_lightning.formats.hif8 import codec as hif8
from lp_lightning.formats import set_compiled_kernels
from lp_lightning.formats.hif8 import decode, encode

# docs/formats.md §1.4, rows of 8 non-negative codes each (0x6F is +Inf). Typed in from the table;
# deliberately not computed from the bit layout, which is what the codec itself uses.
P = 2.0
INF = math.inf
TABLE_1_4 = [
    # 0x00
    0.0, P**-22, P**-21, P**-20, P**-19, P**-18, P**-17, P**-16,
    # 0x08
    1, 1.125, 1.25, 1.375, 1.5, 1.625, 1.75, 1.875,
    # 0x10
    2, 2.25, 2.5, 2.75, 3, 3.25, 3.5, 3.75,
    # 0x18
    0.5, 0.5625, 0.625, 0.6875, 0.75, 0.8125, 0.875, 0.9375,
    # 0x20
    4, 4.5, 5, 5.5, 6, 6.5, 7, 7.5,
    # 0x28
    8, 9, 10, 11, 12, 13, 14, 15,
    # 0x30
    0.25, 0.28125, 0.3125, 0.34375, 0.375, 0.40625, 0.4375, 0.46875,
    # 0x38
    0.125, 0.140625, 0.15625, 0.171875, 0.1875, 0.203125, 0.21875, 0.234375,
    # 0x40
    16, 20, 24, 28, 32, 40, 48, 56,
    # 0x48
    64, 80, 96, 112, 128, 160, 192, 224,
    # 0x50
    1 * P**-4, 1.25 * P**-4, 1.5 * P**-4, 1.75 * P**-4, 1 * P**-5, 1.25 * P**-5, 1.5 * P**-5, 1.75 * P**-5,
    # 0x58
    1 * P**-6, 1.25 * P**-6, 1.5 * P**-6, 1.75 * P**-6, 1 * P**-7, 1.25 * P**-7, 1.5 * P**-7, 1.75 * P**-7,
    # 0x60
    256, 384, 512, 768, 1024, 1536, 2048, 3072,
    # 0x68
    4096, 6144, 8192, 12288, 16384, 24576, 32768, INF,
    # 0x70
    1 * P**-8, 1.5 * P**-8, 1 * P**-9, 1.5 * P**-9, 1 * P**-10, 1.5 * P**-10, 1 * P**-11, 1.5 * P**-11,
    # 0x78
    1 * P**-12, 1.5 * P**-12, 1 * P**-13, 1.5 * P**-13, 1 * P**-14, 1.5 * P**-14, 1 * P**-15, 1.5 * P**-15,
]
assert len(TABLE_1_4) == 128


def _reference_values() -> torch.Tensor:
    """All 256 codes' values per docs/formats.md §1.4: negative = code | 0x80, 0x80 = NaN."""
    pos = torch.tensor(TABLE_1_4, dtype=torch.float64)
    neg = -pos
    neg[0] = math.nan
    return torch.cat([pos, neg])


REF_VALUES_256 = _reference_values()


def reference_encode(x: torch.Tensor, *, saturate: bool = False) -> torch.Tensor:
    """Codebook nearest (ties to larger magnitude) over the finite non-negative codes, float64.

    Plus the rules that are not nearest-codebook: NaN → 0x80, |x| ≥ 40960 → Inf (or 32768 when
    saturating; ±Inf input as well), sign dropped on zero.
    """
    x64 = x.double().reshape(-1)
    finite = REF_VALUES_256[:128]
    keep = torch.isfinite(finite)
    grid_values = finite[keep]
    grid_codes = torch.arange(128)[keep]
    order = torch.argsort(grid_values)
    grid_values, grid_codes = grid_values[order], grid_codes[order]
    a = x64.abs()
    hi = torch.searchsorted(grid_values, a, right=True).clamp(max=len(grid_values) - 1)
    lo = (hi - 1).clamp(min=0)
    lo_v, hi_v = grid_values[lo], grid_values[hi]
    # 2a, lo + hi are exact in float64 for these magnitudes; `>=` sends ties to the larger magnitude.
    pick_hi = (2 * a >= lo_v + hi_v) & (a >= lo_v)
    code = torch.where(pick_hi, grid_codes[hi], grid_codes[lo])
    code = torch.where(a > grid_values[-1], grid_codes[-1], code)  # 32768 < a < 40960
    overflow = a >= 40960.0
    code = torch.where(overflow, torch.tensor(0x6E if saturate else 0x6F), code)
    code = torch.where((x64 < 0) & (code != 0), code | 0x80, code)
    code = torch.where(torch.isnan(x64), torch.tensor(0x80), code)
    return code.to(torch.uint8).reshape(x.shape)


def _assert_codes_equal(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor) -> None:
    bad = (got != want).nonzero().flatten()
    if bad.numel():
        rows = [
            f"x={x.reshape(-1)[i].item()!r} got=0x{got.reshape(-1)[i].item():02X} "
            f"want=0x{want.reshape(-1)[i].item():02X}"
            for i in bad[:10].tolist()
        ]
        pytest.fail(f"{bad.numel()} mismatches, first: " + "; ".join(rows))


def _midpoint_probes() -> torch.Tensor:
    """Every midpoint between adjacent non-negative values (0, codes, Inf slot's nominal 49152)
    and its FP32 neighbours one ulp away, both signs."""
    finite = REF_VALUES_256[:128]
    grid = torch.sort(torch.cat([finite[torch.isfinite(finite)], torch.tensor([49152.0])])).values
    mids = ((grid[1:] + grid[:-1]) / 2).float()
    assert torch.equal(mids.double(), (grid[1:] + grid[:-1]) / 2)  # midpoints are exact in FP32
    up = torch.nextafter(mids, torch.full_like(mids, math.inf))
    down = torch.nextafter(mids, torch.zeros_like(mids))
    probes = torch.cat([mids, up, down, grid.float()])
    return torch.cat([probes, -probes])


SPECIALS = torch.tensor(
    [0.0, -0.0, math.inf, -math.inf, math.nan, 40959.99, -40959.99, 40960.0, -40960.0,
     2.0**-23, -(2.0**-23), 2.0**-24, -(2.0**-24), 1e-45, -1e-45, 1.1754942e-38, 1.1754944e-38,
     3.4028235e38, -3.4028235e38, 32768.0, 36864.0, 2.0**-22, 2.0**-16, 1.5 * 2.0**-16],
    dtype=torch.float32,
)


def test_decode_all_codes_matches_formats_table():
    got = decode(torch.arange(256, dtype=torch.uint8), torch.float64)
    nan = torch.isnan(REF_VALUES_256)
    assert torch.equal(torch.isnan(got), nan)
    assert nan.nonzero().flatten().tolist() == [0x80]
    assert torch.equal(got[~nan], REF_VALUES_256[~nan])
    assert got[0x6F] == math.inf and got[0xEF] == -math.inf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_decode_is_exact_in_every_wide_float(dtype):
    got = decode(torch.arange(256, dtype=torch.uint8), dtype)
    assert got.dtype == dtype
    nan = torch.isnan(REF_VALUES_256)
    assert torch.equal(got.double()[~nan], REF_VALUES_256[~nan])


def test_worked_checks_from_formats_1_5():
    cases = {1.0625: 0x09, 15.5: 0x40, 240.0: 0x60, 40959.99: 0x6E, 40960.0: 0x6F,
             2.0**-23: 0x01, 1.5 * 2.0**-16: 0x7E, -1e-30: 0x00}
    x = torch.tensor(list(cases), dtype=torch.float32)
    assert encode(x).tolist() == list(cases.values())


def test_specials():
    got = encode(SPECIALS)
    _assert_codes_equal(got, reference_encode(SPECIALS), SPECIALS)
    assert got[:5].tolist() == [0x00, 0x00, 0x6F, 0xEF, 0x80]
    sat = encode(SPECIALS, saturate=True)
    _assert_codes_equal(sat, reference_encode(SPECIALS, saturate=True), SPECIALS)
    assert sat[:9].tolist() == [0x00, 0x00, 0x6E, 0xEE, 0x80, 0x6E, 0xEE, 0x6E, 0xEE]


def test_encode_matches_reference_bit_for_bit():
    gen = torch.Generator().manual_seed(1234)
    n = 1_000_000
    log2_mag = torch.rand(n, generator=gen, dtype=torch.float64) * (17 - (-26)) - 26
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    x = torch.cat([(sign * torch.exp2(log2_mag)).float(), _midpoint_probes(), SPECIALS])
    for saturate in (False, True):
        _assert_codes_equal(encode(x, saturate=saturate), reference_encode(x, saturate=saturate), x)


def test_round_trip_every_non_nan_code():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[codes != hif8.HIF8_NAN_CODE]
    assert torch.equal(encode(decode(codes)), codes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn])
def test_other_input_dtypes_convert_through_fp32(dtype):
    x = (torch.randn(4, 33) * 50).to(dtype)
    got = encode(x)
    assert got.shape == x.shape and got.dtype == torch.uint8
    assert torch.equal(got, encode(x.float()))


@pytest.mark.parametrize("n", [1, 1023, 1024, 1025, 3 * 1024 + 5])
def test_tile_boundaries(n):
    # encode() runs whole [R, 1024] tiles and a ragged tail separately, then joins them.
    x = torch.randn(n) * torch.exp2(torch.randint(-24, 17, (n,)).float())
    _assert_codes_equal(encode(x), reference_encode(x), x)
    _assert_codes_equal(encode(x, saturate=True), reference_encode(x, saturate=True), x)


def test_shapes_and_non_contiguous_inputs():
    x = torch.randn(3, 4, 5) * 10
    xt = x.transpose(0, 2)
    assert torch.equal(encode(xt), encode(xt.contiguous()))
    assert encode(torch.empty(0, 3)).shape == (0, 3)
    assert encode(torch.tensor(1.0)).shape == ()
    assert decode(encode(torch.tensor(1.5))).item() == 1.5


@pytest.mark.compiled
def test_fused_kernel_is_bitwise_equal_to_eager():
    # Large enough (> MIN_FUSED_NUMEL) that the wrapper really takes the compiled path.
    n = 1 << 15
    x = torch.cat([(torch.randn(n) * torch.exp2(torch.randint(-24, 17, (n,)).float())),
                   _midpoint_probes(), SPECIALS])
    x = torch.cat([x, torch.randn(-x.numel() % hif8._TILE_C)])  # whole [R, C] tiles
    x_RC = x.view(-1, hif8._TILE_C)
    with warnings.catch_warnings():
        # The fused wrapper falls back to eager with a RuntimeWarning when compiling fails: here
        # that must be an error, or this test would compare eager with eager.
        warnings.filterwarnings("error", message="torch.compile of", category=RuntimeWarning)
        for saturate in (False, True):
            bound_C = hif8._bound_row(saturate, x.device)
            fused_codes = hif8._encode_kernel(x_RC, bound_C)
            eager_codes = hif8._encode_kernel.eager(x_RC, bound_C)
            assert torch.equal(fused_codes, eager_codes)
            _assert_codes_equal(fused_codes, reference_encode(x_RC, saturate=saturate), x_RC)
        # The public path: [R, C] tiles compiled, a ragged tail (37 elements) eager, joined.
        x_ragged = x[: 20 * hif8._TILE_C + 37]
        _assert_codes_equal(encode(x_ragged), reference_encode(x_ragged), x_ragged)
        codes = torch.arange(256, dtype=torch.uint8).repeat(128)  # every code, past MIN_FUSED_NUMEL
        for out_dtype, bits_dtype in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
            fused_vals = hif8._decode_kernel(codes, out_dtype)
            eager_vals = hif8._decode_kernel.eager(codes, out_dtype)
            assert torch.equal(fused_vals.view(bits_dtype), eager_vals.view(bits_dtype))


def test_decoder_arithmetic_matches_a_parse_of_the_layout():
    # The kernel's bit assembly against the field-by-field parse of docs/formats.md §1.2 (the code
    # table test above checks both against the hand-typed §1.4 table); bit-exact incl. NaN.
    got = decode(torch.arange(256, dtype=torch.uint8))
    parsed = [hif8._decode_payload(code & 0x7F) * (-1.0 if code & 0x80 else 1.0) for code in range(256)]
    parsed[hif8.HIF8_NAN_CODE] = math.nan
    assert torch.equal(got.view(torch.int32), torch.tensor(parsed, dtype=torch.float32).view(torch.int32))


def test_encoder_band_tables_follow_the_layout():
    # Entry |E| of the packed tables, read the way the kernel reads them (shift clamped to 31):
    # 3 - m for the band of |E|, and m = 0 (the denormal band) for every |E| >= 16.
    for magnitude in range(0, 128):
        shift = torch.tensor(min(2 * magnitude, 31), dtype=torch.int32)
        narrowing = int((hif8._NARROWING_TABLE >> shift) & 3)
        man_width = hif8._band_of(magnitude).man_width if magnitude <= 15 else 0
        assert narrowing == 3 - man_width, magnitude
        if magnitude <= 15:
            es_weight = int((hif8._ES_TABLE >> shift) & 3) * 8
            band = hif8._band_of(magnitude)
            base = hif8._BASE_STEP * narrowing + es_weight
            # The payload of 2^|E| (mantissa 0) from y = |E| << m, as the kernel forms it.
            assert (magnitude << man_width) + base == hif8._normal_payload(magnitude, 0), magnitude
            if band.exp_width:
                assert (magnitude << man_width) + base + es_weight == hif8._normal_payload(-magnitude, 0)


def test_constants_agree_with_the_code_table():
    assert decode(torch.tensor([0x6E], dtype=torch.uint8)).item() == hif8.HIF8_MAX == 32768.0
    assert decode(torch.tensor([0x7E], dtype=torch.uint8)).item() == hif8.HIF8_MIN_NORMAL == 2.0**-15
    assert decode(torch.tensor([0x01], dtype=torch.uint8)).item() == hif8.HIF8_MIN_SUBNORMAL == 2.0**-22
    assert decode(torch.tensor([hif8.HIF8_POS_INF_CODE], dtype=torch.uint8)).item() == math.inf
    assert decode(torch.tensor([hif8.HIF8_NEG_INF_CODE], dtype=torch.uint8)).item() == -math.inf
    # Recipe targets (docs/formats.md §1.7): 15 is the top of the 3-bit-mantissa band, 224 of the ≥2-bit band.
    assert hif8.FORMAT_MAX_INPUT_WEIGHT == 15.0 == 1.875 * 2**3
    assert hif8.FORMAT_MAX_GRADIENT == 224.0 == 1.75 * 2**7
    assert encode(torch.tensor([15.0, 224.0])).tolist() == [0x2F, 0x4F]


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match="encode: x must have a floating dtype"):
        encode(torch.arange(4))
    with pytest.raises(TypeError, match="encode: x must be a torch.Tensor"):
        encode([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="decode: codes must be a torch.uint8"):
        decode(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="decode: dtype must be a floating"):
        decode(torch.zeros(3, dtype=torch.uint8), torch.int32)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.compiled)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_scaled_equals_divide_then_encode_and_decode(compiled, dtype):
    # The fused current-scaling cast: conversion, IEEE division, encoding and the decoded values in
    # one pass, bit-identical to the separate calls, on whole tiles plus a ragged tail.
    set_compiled_kernels(compiled)
    n = 20 * hif8._TILE_C + 37
    x = (torch.randn(n) * torch.exp2(torch.randint(-20, 12, (n,)).float())).to(dtype)
    x[:8] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-30, -5e4, 3.0])
    scale = torch.tensor(0.37109375 * 3, dtype=torch.float32)
    codes, values = hif8.encode_scaled(x.view(2, -1) if n % 2 == 0 else x, scale, with_values=True)
    ref = encode(x.to(torch.float32) / scale)
    assert torch.equal(codes.reshape(-1), ref)
    ref_values = decode(ref, torch.float32)
    assert torch.equal(values.reshape(-1).isnan(), ref_values.isnan())
    assert torch.equal(values.reshape(-1).nan_to_num(), ref_values.nan_to_num())
    assert hif8.encode_scaled(x, scale)[1] is None
