"""The emulated backend's BF16-unit GEMMs against float64 and against its IEEE FP32 path.

The contract (docs/design.md "Where it runs", ``lp_lightning/ops/emulated.py`` "GEMM units"): exact
decode, FP32 accumulation, one rounding. On BF16 units only the order of the FP32 additions
differs from an IEEE FP32 matmul, so every result must lie within the FP32 accumulation bound
``K·2^-24·Σ|a·b|`` plus half an ulp of the output dtype of the exact (float64) product, for both
paths; and the two paths must agree on almost every element.
"""

from __future__ import annotations

import pytest
import torch

from lp_lightning.formats import QuantizationRole as R
from lp_lightning.formats import recipe_for
from lp_lightning.ops import low_precision_grouped_matmul, low_precision_matmul
from lp_lightning.ops.emulated import BACKEND, EmulatedBackend

FORMATS = ["mxfp8_e4m3", "hif8"]
HALF_ULP = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}  # relative, with room for the binade edge


def _operands(fmt: str, layout: str, m: int, k: int, n: int, spread: int = 6):
    """Quantized dense operands for ``layout`` with values spread over 2^±spread."""
    q = recipe_for(fmt).quantizer

    def values(*shape):
        return torch.randn(*shape) * torch.exp2(torch.randint(-spread, spread + 1, shape).float())

    if layout == "NT":  # fprop: x_MK · w_NKᵀ
        return q(R.INPUT_FWD).quantize(values(m, k), orientation="row"), q(R.WEIGHT_FWD).quantize(values(n, k), orientation="row")
    if layout == "NN":  # dgrad: dy_MK · w_KN
        return q(R.GRAD_OUTPUT).quantize(values(m, k), orientation="row"), q(R.WEIGHT_BWD).quantize(values(k, n), orientation="col")
    # wgrad: dy_KMᵀ · x_KN
    return q(R.GRAD_OUTPUT).quantize(values(k, m), orientation="col"), q(R.INPUT_BWD).quantize(values(k, n), orientation="col")


def _exact(left, right, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 product of the exactly decoded operands and the bound's ``Σ|a·b|``."""
    a = left.dequantize().double()
    b = right.dequantize().double()
    a = a.T if layout[0] == "T" else a
    b = b.T if layout[1] == "T" else b
    return a @ b, a.abs() @ b.abs()


def _assert_within_contract(out: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, k: int) -> None:
    tol = k * 2.0**-24 * magnitude + HALF_ULP[out.dtype] * exact.abs() + 1e-38
    err = (out.double() - exact).abs()
    assert (err <= tol).all(), f"max err/tol {(err / tol).max().item():.3g}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", ["NT", "NN", "TN"])
@pytest.mark.parametrize("output_dtype", [torch.bfloat16, torch.float32])
def test_dense_gemm_units_keep_the_contract_and_agree_with_ieee(fmt, layout, output_dtype):
    m, k, n = 96, 512, 80
    left, right = _operands(fmt, layout, m, k, n)
    expected_units = "bf16" if fmt == "mxfp8_e4m3" and output_dtype == torch.bfloat16 else "fp32"
    assert BACKEND._units(left, right, output_dtype) == expected_units
    fast = low_precision_matmul(left, right, layout=layout, output_dtype=output_dtype)
    ieee = EmulatedBackend(bf16_units=False).matmul(left, right, layout, output_dtype)
    exact, magnitude = _exact(left, right, layout)  # dequantize() applies every scale
    for out in (fast, ieee):
        assert out.dtype == output_dtype and out.shape == (m, n)
        _assert_within_contract(out, exact, magnitude, k)
    # Same numbers but for the order of FP32 additions: differences are rare.
    assert (fast != ieee).float().mean().item() < 0.02


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", ["NN", "NT", "TN"])
def test_grouped_gemm_units_keep_the_contract(fmt, layout):
    q = recipe_for(fmt).quantizer
    counts = torch.tensor([40, 0, 72, 16])
    tokens, k, n = int(counts.sum()), 64, 96
    x = torch.randn(tokens, k)
    if layout == "TN":  # wgrad: out[g] = x_gᵀ · dy_g
        dy = torch.randn(tokens, n)
        left = q(R.INPUT_BWD).quantize(x, orientation="col", group_list=counts)
        right = q(R.GRAD_OUTPUT).quantize(dy, orientation="col", group_list=counts)
    else:
        w = torch.randn(len(counts), k, n) if layout == "NN" else torch.randn(len(counts), n, k)
        left = q(R.INPUT_FWD).quantize(x, orientation="row", group_list=counts)
        right = q(R.WEIGHT_FWD).quantize(w, orientation="col" if layout == "NN" else "row")
    fast = low_precision_grouped_matmul(left, right, counts, layout=layout, output_dtype=torch.bfloat16)
    ieee = EmulatedBackend(bf16_units=False).grouped_matmul(left, right, counts, layout, torch.bfloat16)
    a, b = left.dequantize().double(), right.dequantize().double()
    start = 0
    for g, c in enumerate(counts.tolist()):
        rows = slice(start, start + c)
        start += c
        if layout == "TN":
            exact, magnitude, out, ref = a[rows].T @ b[rows], a[rows].abs().T @ b[rows].abs(), fast[g], ieee[g]
        else:
            w_g = b[g] if layout == "NN" else b[g].T
            exact, magnitude, out, ref = a[rows] @ w_g, a[rows].abs() @ w_g.abs(), fast[rows], ieee[rows]
        _assert_within_contract(out, exact, magnitude, c if layout == "TN" else k)
        _assert_within_contract(ref, exact, magnitude, c if layout == "TN" else k)


def test_mxfp8_blocks_with_scales_below_bf16_range_take_the_ieee_path_exactly():
    # A block of amax ~2^-130 has E8M0 code < 3: its values are below BF16's subnormal step 2^-133
    # and would round, so the GEMM multiplies in IEEE FP32 and equals the reference bit for bit.
    left, right = _operands("mxfp8_e4m3", "NT", 64, 128, 32)
    q = recipe_for("mxfp8_e4m3").quantizer(R.INPUT_FWD)
    tiny = torch.randn(64, 128) * 2.0**-130
    left = q.quantize(tiny, orientation="row")
    assert int(left.scale.view(torch.uint8).min()) < 3
    assert left.format.exact_gemm_dtype(left) == torch.float32
    assert BACKEND._units(left, right, torch.bfloat16) == "fp32"
    fast = low_precision_matmul(left, right, layout="NT", output_dtype=torch.float32)
    ieee = EmulatedBackend(bf16_units=False).matmul(left, right, "NT", torch.float32)
    assert torch.equal(fast, ieee) and fast.abs().max() > 0


def test_autocast_does_not_change_the_output_dtype_or_the_units():
    left, right = _operands("mxfp8_e4m3", "NT", 32, 64, 48)
    plain = low_precision_matmul(left, right, layout="NT", output_dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = low_precision_matmul(left, right, layout="NT", output_dtype=torch.float32)
    assert out.dtype == torch.float32 and torch.equal(out, plain)


@pytest.mark.parametrize("shape", [(1, 4096, 1), (3, 1000, 2), (64, 33, 5), (5, 2048, 700), (1, 65536, 1)])
def test_torch_bf16_matmul_accumulates_in_fp32_and_rounds_once(shape):
    # The assumption of the BF16-unit path, on the kernels torch picks for tiny, skinny and long-K
    # shapes: products of E4M3 values summed in FP32 and rounded once (a BF16 partial sum would
    # miss this bound by orders of magnitude at K = 65536).
    m, k, n = shape

    def e4m3_values(*size):
        return (torch.randn(*size) * torch.exp2(torch.randint(-6, 7, size).float())).to(torch.float8_e4m3fn)

    a, b = e4m3_values(m, k).to(torch.bfloat16), e4m3_values(k, n).to(torch.bfloat16)
    for right in (b, b.t().contiguous().t()):
        exact = a.double() @ right.double()
        _assert_within_contract(a @ right, exact, a.double().abs() @ right.double().abs(), k)
