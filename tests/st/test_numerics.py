"""Layered numerics of design spec §17.3.2 (``lp_lightning.st.numerics``; docs/numerics.md §8.3).

- Layer 1: every Dense/Grouped × MXFP8/HiF8 × output/dinput/dweight row reaches its unit-test floor
  (``SQNR_FLOORS_DB``, gaussian GEMM keys), has no non-finite value, ran on the emulated backend in
  the expected GEMM role, and agrees with the floors' own measurement (``SQNR_MEASURED_DB``) within
  0.3 dB — the same inputs and shapes, a BF16 golden ≥ 45 dB from FP64. A wrong HiF8 scale or a
  grouped GEMM off by 10 % makes exactly the affected rows fail.
- Layer 2: the one-layer model's loss, gradient norm and key gradients of mxfp8 and hif8 stay within
  the bands the module docstring derives from the formats' floors (ε·√k with ε = 10^(−S/20) and k
  the step's low-precision GEMMs); a wrong HiF8 scale fails the hif8 comparison.
- Both are deterministic, JSON-ready (``allow_nan=False``) and plot to non-empty PNGs.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from lp_lightning.formats import HiF8Quantizer
from lp_lightning.formats.recipe import SQNR_FLOORS_DB, SQNR_MEASURED_DB
from lp_lightning.ops.emulated import EmulatedBackend
from lp_lightning.st.numerics import (
    GOLDEN_MIN_SQNR_DB,
    KEY_GRADIENTS,
    json_float,
    json_metrics,
    one_layer_comparison,
    operator_numerics,
    plot_one_layer,
    plot_operator_numerics,
)

ROLES = {"output": "fprop", "dinput": "dgrad", "dweight": "wgrad"}


@pytest.fixture(scope="module")
def rows():
    return operator_numerics(seed=0)


@pytest.fixture(scope="module")
def one_layer():
    return one_layer_comparison(seed=0)


def test_every_operator_row_passes_its_unit_test_floor(rows):
    assert {(r["operator"], r["precision"], r["tensor"]) for r in rows} == {
        (op, p, t) for op in ("dense", "grouped") for p in ("mxfp8", "hif8") for t in ROLES
    }
    for r in rows:
        key = (r["precision"], "gaussian", ROLES[r["tensor"]])
        assert r["role"] == ROLES[r["tensor"]] and r["gemm_role"] == f"{r['operator']}_{r['role']}"
        assert r["backend"] == "emulated"
        assert r["sqnr_floor_db"] == SQNR_FLOORS_DB[key] and r["sqnr_floor_key"] == list(key)
        assert r["nonfinite"] == 0 and r["reference_nonfinite"] == 0
        assert r["sqnr_db"] >= r["sqnr_floor_db"] and r["pass"] is True, r
        assert abs(r["sqnr_db"] - SQNR_MEASURED_DB[key]) < 0.3, r  # the same kind of input as the floors
        assert r["golden_vs_fp64_sqnr_db"] >= GOLDEN_MIN_SQNR_DB
        assert 0.99 < r["cosine"] <= 1.0 and abs(r["bias_over_rms"]) < 0.05  # zero-mean noise
    json.dumps(rows, allow_nan=False)


def test_metrics_of_an_exact_result_are_perfect():
    t = torch.randn(64, 48)
    assert json_metrics(t, t.clone()) == {
        "numel": 64 * 48, "max_abs": 0.0, "mse": 0.0, "nrmse": 0.0, "cosine": 1.0, "sqnr_db": "inf",
        "bias": 0.0, "bias_over_rms": 0.0, "nonfinite": 0, "reference_nonfinite": 0,
    }
    broken = t.clone()
    broken[0, 0] = float("nan")
    assert json_metrics(broken, t)["nonfinite"] == 1
    assert [json_float(v) for v in (1.5, math.inf, -math.inf, math.nan)] == [1.5, "inf", "-inf", "nan"]


def test_a_wrong_hif8_scale_fails_every_hif8_row_and_no_mxfp8_row(rows, monkeypatch):
    real = HiF8Quantizer.quantize

    def doubled_scale(self, tensor, **kwargs):  # codes of x / s, recorded scale 2·s
        op = real(self, tensor, **kwargs)
        return dataclasses.replace(op, scale=op.scale * 2.0)

    monkeypatch.setattr(HiF8Quantizer, "quantize", doubled_scale)
    again = operator_numerics(seed=0)
    verdicts = {(r["operator"], r["precision"], r["tensor"]): r["pass"] for r in again}
    assert {k for k, ok in verdicts.items() if not ok} == {k for k in verdicts if k[1] == "hif8"}
    # Deterministic: the untouched format's rows are the same dicts as the first run's.
    assert [r for r in again if r["precision"] == "mxfp8"] == [r for r in rows if r["precision"] == "mxfp8"]


def test_a_grouped_gemm_off_by_ten_percent_fails_only_the_grouped_rows(monkeypatch):
    real = EmulatedBackend.grouped_matmul
    monkeypatch.setattr(EmulatedBackend, "grouped_matmul", lambda self, *a, **k: real(self, *a, **k) * 1.1)
    rows = operator_numerics(precisions=["mxfp8"])
    assert {r["operator"] for r in rows if not r["pass"]} == {"grouped"}
    assert sum(not r["pass"] for r in rows) == 3 and len(rows) == 6
    assert all(r["sqnr_db"] < 21.0 for r in rows if r["operator"] == "grouped")  # 20·log10(1/0.1) = 20 dB


def test_one_layer_losses_and_gradients_stay_within_the_format_bands(one_layer):
    cases = one_layer["cases"]
    assert set(cases) == {"bf16", "mxfp8", "hif8"}
    assert cases["bf16"]["low_precision_gemms"] == {} and cases["bf16"]["replaced"] == {}
    for precision in ("mxfp8", "hif8"):
        case, comparison = cases[precision], one_layer["comparisons"][precision]
        assert case["replaced"] == {"mla_projections": 4, "shared_experts": 3, "routed_experts": 1}
        assert case["low_precision_weights"] == 9 and case["gemm_backends"] == ["emulated"]
        bands = comparison["bands"]
        assert (bands["k_fprop"], bands["k_all"]) == (9, 27)
        floors = {role: SQNR_FLOORS_DB[(precision, "gaussian", role)] for role in ROLES.values()}
        # The bands are the formats' floors through the ε·√k rule (module docstring).
        assert bands["loss_rel_band"] == pytest.approx(10 ** (-floors["fprop"] / 20) * 3)
        assert bands["grad_norm_rel_band"] == pytest.approx(10 ** (-min(floors.values()) / 20) * math.sqrt(27))
        assert bands["gradient_sqnr_floor_db"] == pytest.approx(min(floors.values()) - 10 * math.log10(27))
        assert math.isfinite(case["loss"]) and math.isfinite(case["grad_norm"])
        assert comparison["loss_rel_diff"] <= bands["loss_rel_band"] and comparison["loss_pass"]
        assert comparison["grad_norm_rel_diff"] <= bands["grad_norm_rel_band"] and comparison["grad_norm_pass"]
        checked = {n: g for n, g in comparison["gradients"].items() if g["checked"]}
        assert set(checked) == set(KEY_GRADIENTS)
        for name, g in checked.items():
            assert g["nonfinite"] == 0 and g["pass"], (precision, name, g)
            assert g["cosine"] >= bands["gradient_cosine_floor"] and g["sqnr_db"] >= bands["gradient_sqnr_floor_db"]
        assert comparison["pass"] and 0 <= comparison["routing_changed_tokens"] < comparison["tokens"] // 10
    assert one_layer["pass"] is True
    json.dumps(one_layer, allow_nan=False)


def test_a_wrong_hif8_scale_fails_the_one_layer_hif8_comparison(monkeypatch):
    real = HiF8Quantizer.quantize
    monkeypatch.setattr(
        HiF8Quantizer, "quantize",
        lambda self, tensor, **kw: dataclasses.replace(op := real(self, tensor, **kw), scale=op.scale * 2.0),
    )
    result = one_layer_comparison(seed=0, precisions=["hif8"])
    assert list(result["comparisons"]) == ["hif8"]
    assert result["comparisons"]["hif8"]["pass"] is False and result["pass"] is False


def test_unknown_precision_names_the_choices():
    with pytest.raises(ValueError, match=r"names \['bf16'\]; choose from \['hif8', 'mxfp8'\]"):
        operator_numerics(precisions=["bf16"])


def test_plots_are_written(rows, one_layer, tmp_path):
    for path in (plot_operator_numerics(rows, tmp_path / "ops" / "operators.png"),
                 plot_one_layer(one_layer, tmp_path / "one_layer.png")):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    # The plots read JSON round-tripped results too (non-finite floats as strings).
    plot_operator_numerics(json.loads(json.dumps(rows)), tmp_path / "again.png")
