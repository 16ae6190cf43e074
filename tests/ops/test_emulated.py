"""The emulated backend: exact against FP32 products of the dequantized operands, grouped == per-group
dense, one output rounding, and SQNR floors vs FP64 of the unquantized operands (design spec §8; R6)."""

from __future__ import annotations

import pytest
import torch

from lp_lightning.evidence.numerics import sqnr_db
from lp_lightning.formats import QuantizationRole as R
from lp_lightning.formats import QuantizedOperand, recipe_for
from lp_lightning.formats.recipe import SQNR_FLOORS_DB, SQNR_MEASURED_DB, SqnrCase, sqnr_reference_input
from lp_lightning.ops import low_precision_grouped_matmul, low_precision_matmul

FORMATS = ["mxfp8_e4m3", "hif8"]
# Dense shapes that are not multiples of 32 (partial blocks everywhere).
M, K, N = 50, 70, 45


def _rel_frobenius(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _quant(fmt, role, x, orientation, group_list=None):
    return recipe_for(fmt).quantizer(role).quantize(x, orientation=orientation, group_list=group_list)


def _dense_operands(fmt, layout):
    x, w, dy = torch.randn(M, K), torch.randn(N, K), torch.randn(M, N)
    if layout == "NT":
        return _quant(fmt, R.INPUT_FWD, x, "row"), _quant(fmt, R.WEIGHT_FWD, w, "row")
    if layout == "NN":
        return _quant(fmt, R.GRAD_OUTPUT, dy, "row"), _quant(fmt, R.WEIGHT_BWD, w, "col")
    return _quant(fmt, R.GRAD_OUTPUT, dy, "col"), _quant(fmt, R.INPUT_BWD, x, "col")


def _op(t: torch.Tensor, letter: str) -> torch.Tensor:
    return t.T if letter == "T" else t


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", ["NN", "NT", "TN"])
def test_dense_equals_fp32_matmul_of_dequantized_operands(fmt, layout):
    left, right = _dense_operands(fmt, layout)
    out = low_precision_matmul(left, right, layout=layout, output_dtype=torch.float32)
    reference = _op(left.dequantize(), layout[0]) @ _op(right.dequantize(), layout[1])
    assert _rel_frobenius(out, reference) <= 1e-6
    for dtype in (torch.bfloat16, torch.float16):  # rounded once from the FP32 result
        assert torch.equal(low_precision_matmul(left, right, layout=layout, output_dtype=dtype), out.to(dtype))


def test_mx_dequantize_is_exact_so_the_product_matches_fp64():
    """MX dequantization is exact: an FP64 product of the decoded operands agrees to FP32 accumulation."""
    left, right = _dense_operands("mxfp8_e4m3", "NT")
    out = low_precision_matmul(left, right, layout="NT", output_dtype=torch.float32)
    exact = left.dequantize(torch.float64) @ right.dequantize(torch.float64).T
    assert torch.equal(left.dequantize(torch.float64), left.dequantize(torch.float32).double())
    assert _rel_frobenius(out, exact) <= 1e-6


def _slice_rows(op: QuantizedOperand, start: int, stop: int, block_start: int | None = None,
                block_stop: int | None = None) -> QuantizedOperand:
    """Rows [start, stop) of a 2-D operand as a dense operand (row: scale rows; grouped col: its blocks)."""
    if op.format.name == "hif8":
        return QuantizedOperand(op.data[start:stop], op.scale, op.logical_dtype, op.format, op.orientation)
    scale = op.scale[start:stop] if op.orientation == "row" else op.scale[block_start:block_stop]
    return QuantizedOperand(op.data[start:stop], scale, op.logical_dtype, op.format, op.orientation)


def _group(op: QuantizedOperand, g: int) -> QuantizedOperand:
    scale = op.scale[g]
    return QuantizedOperand(op.data[g], scale, op.logical_dtype, op.format, op.orientation)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("counts", [[37, 0, 64, 5, 0], [0, 0, 17], [96]], ids=["uneven", "leading-empty", "one"])
def test_grouped_equals_per_group_dense(fmt, counts):
    group_list = torch.tensor(counts, dtype=torch.int64)
    tokens, groups, k, n = sum(counts), len(counts), 40, 72
    x, dy, w = torch.randn(tokens, k), torch.randn(tokens, n), torch.randn(groups, k, n)
    x_row = _quant(fmt, R.INPUT_FWD, x, "row")
    dy_row = _quant(fmt, R.GRAD_OUTPUT, dy, "row")
    w_col, w_row = _quant(fmt, R.WEIGHT_FWD, w, "col"), _quant(fmt, R.WEIGHT_BWD, w, "row")
    x_col = _quant(fmt, R.INPUT_BWD, x, "col", group_list)
    dy_col = _quant(fmt, R.GRAD_OUTPUT, dy, "col", group_list)

    fprop = low_precision_grouped_matmul(x_row, w_col, group_list, layout="NN", output_dtype=torch.float32)
    dgrad = low_precision_grouped_matmul(dy_row, w_row, group_list, layout="NT", output_dtype=torch.float32)
    wgrad = low_precision_grouped_matmul(x_col, dy_col, group_list, layout="TN", output_dtype=torch.float32)
    assert fprop.shape == (tokens, n) and dgrad.shape == (tokens, k) and wgrad.shape == (groups, k, n)

    start, block = 0, 0
    for g, count in enumerate(counts):
        blocks = -(-count // 32)
        if count == 0:
            assert torch.equal(wgrad[g], torch.zeros(k, n))  # exactly zero slice
            continue
        rows = slice(start, start + count)
        dense_fprop = low_precision_matmul(_slice_rows(x_row, start, start + count), _group(w_col, g),
                                           layout="NN", output_dtype=torch.float32)
        dense_dgrad = low_precision_matmul(_slice_rows(dy_row, start, start + count), _group(w_row, g),
                                           layout="NT", output_dtype=torch.float32)
        dense_wgrad = low_precision_matmul(_slice_rows(x_col, start, start + count, block, block + blocks),
                                           _slice_rows(dy_col, start, start + count, block, block + blocks),
                                           layout="TN", output_dtype=torch.float32)
        torch.testing.assert_close(fprop[rows], dense_fprop, rtol=1e-6, atol=0)
        torch.testing.assert_close(dgrad[rows], dense_dgrad, rtol=1e-6, atol=0)
        torch.testing.assert_close(wgrad[g], dense_wgrad, rtol=1e-6, atol=0)
        start, block = start + count, block + blocks


def test_grouped_rounds_once_to_the_output_dtype():
    counts = torch.tensor([33, 0, 31])
    x_row = _quant("hif8", R.INPUT_FWD, torch.randn(64, 48), "row")
    w_col = _quant("hif8", R.WEIGHT_FWD, torch.randn(3, 48, 24), "col")
    out32 = low_precision_grouped_matmul(x_row, w_col, counts, layout="NN", output_dtype=torch.float32)
    out16 = low_precision_grouped_matmul(x_row, w_col, counts, layout="NN", output_dtype=torch.bfloat16)
    assert torch.equal(out16, out32.to(torch.bfloat16))


def test_grouped_with_no_tokens():
    counts = torch.tensor([0, 0])
    x_row = _quant("mxfp8_e4m3", R.INPUT_FWD, torch.randn(0, 64), "row")
    w_col = _quant("mxfp8_e4m3", R.WEIGHT_FWD, torch.randn(2, 64, 32), "col")
    assert low_precision_grouped_matmul(x_row, w_col, counts, layout="NN", output_dtype=torch.bfloat16).shape == (0, 32)
    x_col = _quant("mxfp8_e4m3", R.INPUT_BWD, torch.randn(0, 64), "col", counts)
    dy_col = _quant("mxfp8_e4m3", R.GRAD_OUTPUT, torch.randn(0, 32), "col", counts)
    wgrad = low_precision_grouped_matmul(x_col, dy_col, counts, layout="TN", output_dtype=torch.bfloat16)
    assert torch.equal(wgrad, torch.zeros(2, 64, 32, dtype=torch.bfloat16))


# ------------------------------------------------------------------------------------------------
# SQNR of the GEMMs vs an FP64 product of the unquantized operands (floors: formats/recipe.py).

_GEMM_KEYS = sorted(k for k in SQNR_FLOORS_DB if k[2] != SqnrCase.QUANTIZE.value)
_RECIPES = {"mxfp8": "mxfp8_e4m3", "hif8": "hif8"}


def test_gemm_floor_table_covers_every_case():
    expected = {(r, d, c.value) for r in _RECIPES for d in ("gaussian", "student_t3", "outliers")
                for c in (SqnrCase.FPROP, SqnrCase.DGRAD, SqnrCase.WGRAD)}
    assert set(_GEMM_KEYS) == expected


@pytest.mark.parametrize("key", _GEMM_KEYS, ids=["/".join(k) for k in _GEMM_KEYS])
def test_gemm_sqnr_floor(key):
    recipe_name, distribution, case = key
    recipe = recipe_for(_RECIPES[recipe_name])
    a, _ = sqnr_reference_input(distribution, (256, 512 if case == "fprop" else 384), seed=0)
    g = torch.Generator().manual_seed(1)
    if case == "fprop":  # x[256, 512] · W[384, 512]ᵀ
        w = torch.randn(384, 512, generator=g)
        left = recipe.quantizer(R.INPUT_FWD).quantize(a, orientation="row")
        right = recipe.quantizer(R.WEIGHT_FWD).quantize(w, orientation="row")
        layout, reference = "NT", a.double() @ w.double().T
    elif case == "dgrad":  # dy[256, 384] · W[384, 512]
        w = torch.randn(384, 512, generator=g)
        left = recipe.quantizer(R.GRAD_OUTPUT).quantize(a, orientation="row")
        right = recipe.quantizer(R.WEIGHT_BWD).quantize(w, orientation="col")
        layout, reference = "NN", a.double() @ w.double()
    else:  # dy[256, 384]ᵀ · x[256, 512]
        x = torch.randn(256, 512, generator=g)
        left = recipe.quantizer(R.GRAD_OUTPUT).quantize(a, orientation="col")
        right = recipe.quantizer(R.INPUT_BWD).quantize(x, orientation="col")
        layout, reference = "TN", a.double().T @ x.double()
    out = low_precision_matmul(left, right, layout=layout, output_dtype=torch.bfloat16)
    measured = sqnr_db(out, reference)
    print(f"SQNR {key}: {measured:.2f} dB (floor {SQNR_FLOORS_DB[key]})")
    assert measured >= SQNR_FLOORS_DB[key]
    assert abs(measured - SQNR_MEASURED_DB[key]) < 0.05


@pytest.mark.parametrize("fmt", FORMATS)
def test_autocast_does_not_downcast_the_emulated_fp32_matmul(fmt):
    left, right = _dense_operands(fmt, "NT")
    plain = low_precision_matmul(left, right, layout="NT", output_dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = low_precision_matmul(left, right, layout="NT", output_dtype=torch.float32)
    assert torch.equal(under_autocast, plain)
