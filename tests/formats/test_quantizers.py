"""Quantizers, recipes and ``QuantizedOperand`` (design spec §7, §13.3, §16.2; requirement R1 (docs/design.md)–R2).

Scales are checked against hand-computed values, bits against the codecs, and the
quantize → dequantize SQNR against the floors of ``lp_lightning.formats.recipe.SQNR_FLOORS_DB``
(derivation in that module's docstring).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lp_lightning.evidence.numerics import sqnr_db
from lp_lightning.formats import (
    HIF8_CURRENT,
    MXFP8_E4M3_MX_BLOCK,
    HiF8Quantizer,
    LowPrecisionFormat,
    LowPrecisionRecipe,
    MXFP8Quantizer,
    QuantizationRole,
    QuantizedOperand,
    Quantizer,
    format_spec,
    hif8,
    mxfp8,
    recipe_for,
)
from lp_lightning.formats.recipe import SQNR_FLOORS_DB, SQNR_MEASURED_DB, SqnrCase, sqnr_reference_input

R = QuantizationRole
HIF8_15 = HiF8Quantizer(format_max=15.0)
HIF8_224 = HiF8Quantizer(format_max=224.0)


# ------------------------------------------------------------------------------------------------
# Enums and recipes.


def test_enums_are_str_valued_with_the_seed_names():
    assert [r.value for r in QuantizationRole] == ["input_fwd", "weight_fwd", "grad_output", "input_bwd", "weight_bwd"]
    assert LowPrecisionFormat.MXFP8_E4M3 == "mxfp8_e4m3" and LowPrecisionFormat.HIF8 == "hif8"
    with pytest.raises(ValueError, match="legal values: 'mxfp8_e4m3', 'hif8'"):
        LowPrecisionFormat.parse("fp8")
    with pytest.raises(ValueError, match="'input_fwd'.*'weight_bwd'"):
        QuantizationRole.parse("bias")


@pytest.mark.parametrize("key", [LowPrecisionFormat.MXFP8_E4M3, "mxfp8_e4m3"])
def test_mxfp8_recipe_maps_every_role_to_one_stateless_quantizer(key):
    recipe = recipe_for(key)
    assert recipe is MXFP8_E4M3_MX_BLOCK
    assert (recipe.name, recipe.format, recipe.scaling) == (
        "mxfp8_e4m3_mx_block", LowPrecisionFormat.MXFP8_E4M3, "mx_block"
    )
    quantizers = {id(recipe.quantizer(role)) for role in QuantizationRole}
    assert len(quantizers) == 1
    assert isinstance(recipe.quantizer("grad_output"), MXFP8Quantizer)
    assert isinstance(recipe.quantizer(R.INPUT_FWD), Quantizer)


@pytest.mark.parametrize("key", [LowPrecisionFormat.HIF8, "hif8"])
def test_hif8_recipe_format_max_per_role(key):
    recipe = recipe_for(key)
    assert recipe is HIF8_CURRENT and (recipe.name, recipe.scaling) == ("hif8_current", "current")
    expected = {R.INPUT_FWD: 15.0, R.WEIGHT_FWD: 15.0, R.INPUT_BWD: 15.0, R.WEIGHT_BWD: 15.0, R.GRAD_OUTPUT: 224.0}
    assert {role: recipe.quantizer(role).format_max for role in QuantizationRole} == expected
    # Roles with one format_max share one immutable quantizer; the gradient has its own (design spec §7.1).
    assert recipe.quantizer(R.INPUT_FWD) is recipe.quantizer(R.WEIGHT_BWD)
    assert recipe.quantizer(R.GRAD_OUTPUT) is not recipe.quantizer(R.INPUT_FWD)
    assert (hif8.FORMAT_MAX_INPUT_WEIGHT, hif8.FORMAT_MAX_GRADIENT) == (15.0, 224.0)


def test_recipe_for_rejects_unknown_formats_naming_the_legal_ones():
    with pytest.raises(ValueError, match=r"format='e5m2'.*legal values: 'mxfp8_e4m3', 'hif8'"):
        recipe_for("e5m2")


def test_recipes_and_quantizers_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        HIF8_CURRENT.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        HIF8_CURRENT.quantizers[R.GRAD_OUTPUT] = HIF8_15  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        HIF8_15.format_max = 1.0  # type: ignore[misc]


def test_recipe_validation():
    with pytest.raises(ValueError, match="no quantizer for roles"):
        LowPrecisionRecipe(name="x", format="hif8", scaling="current", quantizers={R.INPUT_FWD: HIF8_15})
    with pytest.raises(ValueError, match="quantizers produce"):
        LowPrecisionRecipe(
            name="x", format="hif8", scaling="current", quantizers={role: MXFP8Quantizer() for role in QuantizationRole}
        )


# ------------------------------------------------------------------------------------------------
# HiF8 current scaling.


def test_hif8_scale_is_amax_over_format_max_and_exact_values_round_trip():
    x = torch.tensor([[3.0, -7.5], [1.0, 0.25]])
    op = HIF8_15.quantize(x, orientation="row")
    assert op.scale.dtype == torch.float32 and op.scale.shape == () and op.scale.item() == 0.5  # 7.5 / 15
    assert op.data.dtype == torch.uint8 and op.data.shape == x.shape
    assert torch.equal(op.data, hif8.encode(torch.tensor([[6.0, -15.0], [2.0, 0.5]])))
    assert torch.equal(op.dequantize(), x)  # 6, 15, 2, 0.5 are HiF8 values
    assert (op.format, op.orientation, op.logical_dtype, op.format_max) == (
        LowPrecisionFormat.HIF8, "row", torch.float32, 15.0
    )
    grad = HIF8_224.quantize(torch.tensor([-448.0, 1.0]), orientation="row")
    assert grad.scale.item() == 2.0 and grad.format_max == 224.0


@pytest.mark.parametrize(
    "values",
    [[0.0, 0.0], [float("nan"), 1.0], [float("inf"), 1.0], [-float("inf"), 2.0], [1e-45, 0.0], []],
    ids=["zeros", "nan", "inf", "-inf", "underflow", "empty"],
)
def test_hif8_invalid_amax_falls_back_to_scale_one(values):
    x = torch.tensor(values, dtype=torch.float32)
    op = HIF8_15.quantize(x, orientation="row")
    assert op.scale.item() == 1.0
    assert torch.equal(op.data, hif8.encode(x))  # unscaled: NaN → 0x80, ±Inf → 0x6F/0xEF, zeros → 0x00


def test_hif8_divides_in_fp32_for_every_input_dtype():
    x = torch.randn(64, 48) * 3
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        op = HIF8_15.quantize(xd, orientation="row")
        x32 = xd.float()
        scale = x32.abs().amax() / 15.0
        assert op.scale.item() == scale.item() and op.logical_dtype == dtype
        assert torch.equal(op.data, hif8.encode(x32 / scale))  # division in FP32, not a reciprocal multiply


def test_hif8_grouped_weight_has_one_scale_per_leading_group():
    w = torch.randn(4, 16, 24)
    w[2] = 0.0  # an expert that is all zeros keeps scale 1.0
    w[3, 0, 0] = float("nan")
    op = HIF8_15.quantize(w, orientation="col")
    assert op.scale.shape == (4,) and op.scale.dtype == torch.float32
    for e in range(4):
        single = HIF8_15.quantize(w[e], orientation="col")
        assert op.scale[e].item() == single.scale.item()
        assert torch.equal(op.data[e], single.data)
    assert op.scale[2].item() == 1.0 and op.scale[3].item() == 1.0
    assert op.scale[0].item() == (w[0].abs().amax() / 15.0).item()


@pytest.mark.parametrize("values", [False, True])
def test_hif8_grouped_transposed_view_equals_its_contiguous_copy(values):
    # A grouped weight's w_EKN view of its w_ENK master is encoded in place and its codes transposed.
    w_ENK = torch.randn(3, 40, 24) * torch.exp2(torch.randint(-8, 8, (3, 40, 24)).float())
    view = w_ENK.mT
    dtype = torch.float32 if values else None
    got = HIF8_15.quantize(view, orientation="col", values_dtype=dtype)
    want = HIF8_15.quantize(view.contiguous(), orientation="col", values_dtype=dtype)
    assert got.data.is_contiguous() and got.data.shape == view.shape
    assert torch.equal(got.data, want.data) and torch.equal(got.scale, want.scale)
    assert (got.values is None) == (not values) and (not values or torch.equal(got.values, want.values))


def test_hif8_one_data_serves_both_orientations():
    x = torch.randn(32, 40)
    row, col = HIF8_15.quantize_dual(x)
    assert (row.orientation, col.orientation) == ("row", "col")
    assert col.data is row.data and col.scale is row.scale
    again = HIF8_15.quantize(x, orientation="col")
    assert torch.equal(again.data, row.data) and torch.equal(again.scale, row.scale)
    assert row.with_orientation("col").data.data_ptr() == row.data.data_ptr()
    assert row.with_orientation("row") is row


def test_hif8_explicit_amax_for_a_shared_scale():
    x = torch.randn(8, 8)
    op = HIF8_15.quantize(x, orientation="row", amax=torch.tensor(30.0))
    assert op.scale.item() == 2.0
    assert torch.equal(op.data, hif8.encode(x / 2.0))
    with pytest.raises(TypeError, match=r"amax must be a tensor of shape \(\)"):
        HIF8_15.quantize(x, orientation="row", amax=torch.ones(8))


def test_hif8_quantizer_errors():
    with pytest.raises(TypeError, match="float32, bfloat16, float16"):
        HIF8_15.quantize(torch.ones(4, dtype=torch.int32), orientation="row")
    with pytest.raises(ValueError, match=r"1-D/2-D .* or 3-D"):
        HIF8_15.quantize(torch.ones(2, 2, 2, 2), orientation="row")
    with pytest.raises(ValueError, match="orientation='diag'"):
        HIF8_15.quantize(torch.ones(4), orientation="diag")  # type: ignore[arg-type]
    for bad in (0.0, -1.0, math.inf, math.nan, 65536.0, True):
        with pytest.raises(ValueError, match="format_max"):
            HiF8Quantizer(format_max=bad)


# ------------------------------------------------------------------------------------------------
# MXFP8.


@pytest.mark.parametrize("orientation", ["row", "col"])
@pytest.mark.parametrize("shape", [(64, 96), (50, 70), (3, 40, 33)])
def test_mxfp8_quantizer_matches_the_codec(orientation, shape):
    x = torch.randn(shape, dtype=torch.bfloat16)
    op = MXFP8Quantizer().quantize(x, orientation=orientation)
    data, scale = mxfp8.quantize(x, orientation=orientation)
    assert torch.equal(op.data.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(op.scale.view(torch.uint8), scale.view(torch.uint8))
    assert (op.data.dtype, op.scale.dtype) == (torch.float8_e4m3fn, torch.float8_e8m0fnu)
    assert (op.orientation, op.logical_dtype, op.format, op.format_max) == (
        orientation, torch.bfloat16, LowPrecisionFormat.MXFP8_E4M3, None
    )
    blocks = math.ceil((shape[-1] if orientation == "row" else shape[-2]) / 32)
    expected = shape[:-1] + (blocks,) if orientation == "row" else shape[:-2] + (blocks, shape[-1])
    assert tuple(op.scale.shape) == expected


def test_mxfp8_grouped_col_keeps_blocks_inside_groups():
    x = torch.randn(100, 48)
    group_list = torch.tensor([40, 0, 7, 53])
    op = MXFP8Quantizer().quantize(x, orientation="col", group_list=group_list)
    data, scale = mxfp8.quantize_grouped(x, group_list, orientation="col")
    assert torch.equal(op.data.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(op.scale.view(torch.uint8), scale.view(torch.uint8))
    assert op.scale.shape == (2 + 0 + 1 + 2, 48) and op.group_list is group_list
    # Each group dequantizes exactly like that group quantized on its own.
    start = 0
    deq = op.dequantize()
    for n in group_list.tolist():
        alone = MXFP8Quantizer().quantize(x[start : start + n], orientation="col") if n else None
        if alone is not None:
            assert torch.equal(deq[start : start + n], alone.dequantize())
        start += n
    row = MXFP8Quantizer().quantize(x, orientation="row", group_list=group_list)
    plain_row = MXFP8Quantizer().quantize(x, orientation="row")
    assert torch.equal(row.data.view(torch.uint8), plain_row.data.view(torch.uint8))


def test_mxfp8_dual_equals_two_single_quantizations():
    w = torch.randn(96, 80)
    row, col = MXFP8Quantizer().quantize_dual(w)
    for op, orientation in ((row, "row"), (col, "col")):
        single = MXFP8Quantizer().quantize(w, orientation=orientation)
        assert op.orientation == orientation
        assert torch.equal(op.data.view(torch.uint8), single.data.view(torch.uint8))
        assert torch.equal(op.scale.view(torch.uint8), single.scale.view(torch.uint8))


def test_mxfp8_orientation_is_physical():
    op = MXFP8Quantizer().quantize(torch.randn(64, 64), orientation="row")
    with pytest.raises(ValueError, match="Quantize the high-precision tensor with orientation='col'"):
        op.with_orientation("col")


def test_mxfp8_quantizer_errors():
    q = MXFP8Quantizer()
    with pytest.raises(ValueError, match="at least 2 dims"):
        q.quantize(torch.randn(64), orientation="col")
    with pytest.raises(TypeError, match="1-D torch.int64"):
        q.quantize(torch.randn(64, 8), orientation="col", group_list=torch.tensor([64], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"2-D tensor \[T, C\]"):
        q.quantize(torch.randn(2, 64, 8), orientation="col", group_list=torch.tensor([64]))


# ------------------------------------------------------------------------------------------------
# QuantizedOperand validation.


def test_operand_validates_dtypes_and_scale_shapes():
    data = torch.zeros(64, 40, dtype=torch.float8_e4m3fn)
    good = torch.zeros(64, 2, dtype=torch.float8_e8m0fnu)
    op = QuantizedOperand(data, good, torch.bfloat16, "mxfp8_e4m3", "row")
    assert op.format is format_spec(LowPrecisionFormat.MXFP8_E4M3)
    with pytest.raises(ValueError, match=r"needs scale shape \(2, 40\)"):
        QuantizedOperand(data, good, torch.bfloat16, LowPrecisionFormat.MXFP8_E4M3, "col")
    with pytest.raises(TypeError, match="float8_e4m3fn/torch.float8_e8m0fnu"):
        QuantizedOperand(data.view(torch.uint8), good, torch.bfloat16, LowPrecisionFormat.MXFP8_E4M3, "row")
    with pytest.raises(ValueError, match=r"needs scale shape \(\)"):
        QuantizedOperand(torch.zeros(4, 4, dtype=torch.uint8), torch.ones(4), torch.float32, "hif8", "row")
    with pytest.raises(TypeError, match="logical_dtype"):
        QuantizedOperand(torch.zeros(4, dtype=torch.uint8), torch.ones(()), torch.int8, "hif8", "row")
    with pytest.raises(ValueError, match="orientation"):
        QuantizedOperand(torch.zeros(4, dtype=torch.uint8), torch.ones(()), torch.float32, "hif8", "both")
    with pytest.raises(dataclasses.FrozenInstanceError):
        op.orientation = "col"  # type: ignore[misc]


# ------------------------------------------------------------------------------------------------
# SQNR floors of quantize → dequantize (table and derivation: lp_lightning/formats/recipe.py).

_QUANTIZERS = {"mxfp8": MXFP8Quantizer(), "hif8_15": HIF8_15, "hif8_224": HIF8_224}
_QUANTIZE_KEYS = sorted(k for k in SQNR_FLOORS_DB if k[2] == SqnrCase.QUANTIZE.value)


def test_the_floor_table_covers_every_quantizer_and_distribution():
    expected = {(q, d) for q in _QUANTIZERS for d in ("gaussian", "student_t3", "outliers", "outliers_bulk")}
    assert {(q, d) for q, d, _ in _QUANTIZE_KEYS} == expected
    for key, floor in SQNR_FLOORS_DB.items():
        assert floor < SQNR_MEASURED_DB[key], key


@pytest.mark.parametrize("key", _QUANTIZE_KEYS, ids=["/".join(k[:2]) for k in _QUANTIZE_KEYS])
def test_quantize_dequantize_sqnr_floor(key):
    quantizer_name, distribution, _ = key
    x, scored = sqnr_reference_input(distribution, (256, 256), seed=0)
    op = _QUANTIZERS[quantizer_name].quantize(x, orientation="row")
    measured = sqnr_db(op.dequantize(torch.float64)[scored], x.double()[scored])
    print(f"SQNR {key}: {measured:.2f} dB (floor {SQNR_FLOORS_DB[key]})")
    assert measured >= SQNR_FLOORS_DB[key]
    assert abs(measured - SQNR_MEASURED_DB[key]) < 0.05  # the table records this very measurement


def test_per_tensor_hif8_loses_bulk_precision_to_outliers_where_mx_blocks_do_not():
    """0.1 % outliers ×100 push HiF8-15's bulk from the 3-bit band into the 2-bit band; MX blocks
    without an outlier keep their own scale (module docstring of recipe.py)."""
    bulk = {q: SQNR_MEASURED_DB[(q, "outliers_bulk", "quantize")] for q in _QUANTIZERS}
    gaussian = {q: SQNR_MEASURED_DB[(q, "gaussian", "quantize")] for q in _QUANTIZERS}
    assert bulk["mxfp8"] > bulk["hif8_15"] + 3.0
    assert gaussian["hif8_15"] > bulk["hif8_15"] + 3.0
    assert abs(bulk["mxfp8"] - gaussian["mxfp8"]) < 1.0
