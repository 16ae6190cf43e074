"""Format table rows (derived from bit patterns) against torch.finfo, ml_dtypes.finfo, docs/numerics.md §2's
formulas and docs/formats.md §1.3 for HiF8."""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import pytest
import torch

from lp_lightning.evidence.table import FormatInfo, format_info, format_table, format_table_markdown

TORCH_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "e8m0": torch.float8_e8m0fnu,
}
ML_DTYPES = {
    "fp32": ml_dtypes.finfo(torch.zeros(0).numpy().dtype),
    "bf16": ml_dtypes.finfo(ml_dtypes.bfloat16),
    "fp16": ml_dtypes.finfo(torch.zeros(0, dtype=torch.float16).numpy().dtype),
    "fp8_e4m3fn": ml_dtypes.finfo(ml_dtypes.float8_e4m3fn),
    "fp8_e5m2": ml_dtypes.finfo(ml_dtypes.float8_e5m2),
    "e8m0": ml_dtypes.finfo(ml_dtypes.float8_e8m0fnu),
}


def test_names_and_order():
    assert [row.name for row in format_table()] == [
        "fp32", "bf16", "fp16", "fp8_e4m3fn", "fp8_e5m2", "e8m0", "hif8"
    ]
    assert all(dataclasses.is_dataclass(row) for row in format_table())
    with pytest.raises(dataclasses.FrozenInstanceError):
        format_table()[0].max = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("name", list(TORCH_DTYPES))
def test_agrees_with_torch_and_ml_dtypes_finfo(name):
    row = format_info(name)
    tf = torch.finfo(TORCH_DTYPES[name])
    mf = ML_DTYPES[name]
    assert row.bits == tf.bits
    assert row.max == tf.max == float(mf.max)
    assert row.min_normal == tf.smallest_normal == float(mf.smallest_normal)
    assert row.eps == tf.eps == float(mf.eps)
    assert row.min_subnormal == float(mf.smallest_subnormal)


# docs/numerics.md §2.1 formulas and hand counts: finite distinct values = 2·(2^E − 1)·2^M − 1 for IEEE
# formats (±0 once); E4M3fn: 256 − 2 NaN − 1 duplicate zero; E5M2: 256 − 6 NaN − 2 Inf − 1;
# E8M0: 255 (0xFF is NaN, no zero); HiF8: 256 − NaN − 2 Inf (one zero code).
EXPECTED = {
    #            max                     min normal  min sub    eps      binades finite
    "fp32": ((2 - 2**-23) * 2.0**127, 2.0**-126, 2.0**-149, 2.0**-23, 277, 2 * 255 * 2**23 - 1),
    "bf16": ((2 - 2**-7) * 2.0**127, 2.0**-126, 2.0**-133, 2.0**-7, 261, 2 * 255 * 2**7 - 1),
    "fp16": (65504.0, 2.0**-14, 2.0**-24, 2.0**-10, 40, 2 * 31 * 2**10 - 1),
    "fp8_e4m3fn": (448.0, 2.0**-6, 2.0**-9, 0.125, 18, 253),
    "fp8_e5m2": (57344.0, 2.0**-14, 2.0**-16, 0.25, 32, 247),
    "e8m0": (2.0**127, 2.0**-127, 2.0**-127, 1.0, 255, 255),
    "hif8": (32768.0, 2.0**-15, 2.0**-22, 0.125, 38, 253),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_rows_match_formulas_and_hand_counts(name):
    row = format_info(name)
    got = (row.max, row.min_normal, row.min_subnormal, row.eps, row.binades, row.finite_count)
    assert got == EXPECTED[name]
    assert row.binades == math.floor(math.log2(row.max / row.min_subnormal)) + 1


def test_hif8_row_matches_formats_md_1_3():
    row = format_info("hif8")
    assert row == FormatInfo(
        name="hif8", bits=8, layout=row.layout, max=32768.0, min_normal=2.0**-15,
        min_subnormal=2.0**-22, eps=0.125, binades=38, finite_count=253, has_inf=True,
    )


def test_has_inf():
    assert {row.name: row.has_inf for row in format_table()} == {
        "fp32": True, "bf16": True, "fp16": True, "fp8_e4m3fn": False, "fp8_e5m2": True,
        "e8m0": False, "hif8": True,
    }


def test_markdown_has_one_row_per_format():
    text = format_table_markdown()
    lines = text.splitlines()
    assert len(lines) == 2 + len(format_table())
    assert all(line.startswith("| ") or line.startswith("|---") for line in lines)
    assert "| hif8 | 8 |" in text and "32768" in text and "2^-22" in text
    assert "| fp8_e4m3fn | 8 | 1/4/3 | 448 | 2^-6" in text


def test_unknown_name_lists_the_allowed_ones():
    with pytest.raises(ValueError, match=r"name='fp4'.*allowed: \['bf16', 'e8m0'"):
        format_info("fp4")
