"""The per-layer numerics probe (lp_lightning.telemetry.layer_numerics; issue 25).

Per format: one in-process Trainer run of dsv3-tiny with the probe (3 steps, steps 1 and 2 sampled, a
CSVLogger) and the same run without it; the trained values are bitwise equal, the series are in the
logger and in run_summary.json, each GEMM's SQNR against BF16 sits where the format puts it. The
2-process run (sharded masters gathered whole) is in tests/telemetry/test_probe_callbacks.py.
"""

from __future__ import annotations

import csv
import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from torch.distributed.tensor import DTensor

from _inprocess import fit_tiny, tiny_datamodule
from lp_lightning.lightning import LowPrecisionPlugin
from lp_lightning.telemetry import LayerNumericsProbe
from lp_lightning.telemetry.layer_numerics import OPERAND_NAMES, reference_gemm

WEIGHTS = 25  # 21 replaced Linears + gate_up_proj and down_proj of the 2 routed-experts modules
STEPS = 3
SAMPLED = [1, 2]  # the first step and the multiples of sample_every=2


def _fit(root, token_cache_dir, precision, probe):
    env, threads = dict(os.environ), torch.get_num_threads()
    try:
        _, module, summary = fit_tiny(
            root, datamodule=tiny_datamodule(token_cache_dir), max_steps=STEPS, plugin=LowPrecisionPlugin(precision),
            callbacks=[probe] if probe is not None else [], logger=CSVLogger(root, name="logs"), log_every_n_steps=1,
        )  # fmt: skip
        with torch.no_grad():
            masters = {}
            for name, param in module.named_parameters():
                local = param.to_local() if isinstance(param, DTensor) else param
                masters[name] = getattr(local, "master", local).detach().clone()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(threads)
    return summary, masters


@pytest.fixture(scope="module")
def runs(tmp_path_factory, token_cache_dir):
    """``runs(precision)`` -> (root, summary with the probe, probe, summary without, masters with, masters without)."""
    cache = {}

    def get(precision):
        if precision not in cache:
            on_root, off_root = tmp_path_factory.mktemp(f"{precision}_on"), tmp_path_factory.mktemp(f"{precision}_off")
            probe = LayerNumericsProbe(sample_every=2)
            on, on_masters = _fit(on_root, token_cache_dir, precision, probe)
            off, off_masters = _fit(off_root, token_cache_dir, precision, None)
            cache[precision] = (on_root, on, probe, off, on_masters, off_masters)
        return cache[precision]

    return get


@pytest.mark.parametrize("precision", ["mxfp8", "hif8"])
def test_the_trained_values_are_bitwise_the_same_with_the_probe_on_and_off(runs, precision):
    _, on, _, off, on_masters, off_masters = runs(precision)
    assert on["losses"] == off["losses"] and on["grad_norms"] == off["grad_norms"]
    assert on_masters.keys() == off_masters.keys() and len(on_masters) > WEIGHTS
    assert [n for n in on_masters if not torch.equal(on_masters[n], off_masters[n])] == []
    assert on["compile"]["recompiles_after_first_step"] == off["compile"]["recompiles_after_first_step"] == 0
    assert off["layer_numerics"] is None


@pytest.mark.parametrize("precision", ["mxfp8", "hif8"])
def test_every_weight_and_role_is_compared_on_the_sampled_steps(runs, precision):
    root, on, probe, *_ = runs(precision)
    section = on["layer_numerics"]
    assert section["sampled_steps"] == SAMPLED and section["sample_every"] == 2
    assert section["unmatched_operands"] == 0 and section["nonfinite_outputs"] == 0
    grouped = {n for n in section["series"] if "/grouped_" in n}
    assert len(section["series"]) == 3 * WEIGHTS and len(grouped) == 3 * 4
    for name, series in section["series"].items():
        role = name.rsplit("/", 1)[1]
        assert series["steps"] == SAMPLED, name
        assert set(series["operands"]) == set(OPERAND_NAMES[role]), name
        for op in series["operands"].values():
            assert op["saturated_frac_max"] == 0.0, name  # RCEIL (MXFP8) and format_max (HiF8) never clamp
            # gradients of a column block spread over many binades: up to ~1 % of q_proj's dy flushes in MXFP8
            assert 0.0 <= op["flush_frac_max"] < 0.05 and op["amax_max"] > 0, name
    # the cost per sampled step is measured and left out of the step times
    assert section["cost_s_per_sampled_step"] > 0 and section["cost_vs_step_time"] > 0
    assert all(on["non_training_s"][s - 1] >= 0.5 * r["cost_s"] for s, r in zip(SAMPLED, probe.steps_recorded))
    assert len(section["worst_sqnr"]) == 10 and (root / "probes" / "layer_numerics.png").is_file()
    assert section["plot"] == str(root / "probes" / "layer_numerics.png")
    rank_file = json.loads((root / "probes" / "layer_numerics_rank0.json").read_text())
    assert [r["step"] for r in rank_file["records"]] == SAMPLED and rank_file["low_precision"] is True


# The GEMM of two operands each quantized at ~31.5 dB adds their noise powers: ~28.5 dB for independent Gaussian
# operands (formats' sqnr_table, docs/numerics.md §8): the floor is the table's floor minus 2 dB (HiF8 gradients
# use format_max 224, 6 dB coarser). Real operands are correlated: a contraction whose products add coherently
# while their rounding errors do not (wgrad over M tokens above all) gains up to 10·log10(k) dB (ε·O(1) against
# ε·√k, docs/numerics.md §5), so there is no upper bound below the BF16 reference's own.
BANDS = {"mxfp8": {"fprop": 24.5, "dgrad": 24.5, "wgrad": 24.5}, "hif8": {"fprop": 24.5, "dgrad": 20.0, "wgrad": 20.0}}
BF16_CEILING_DB = 55.0  # the BF16 reference's own rounding (2^-9 relative) caps what can be resolved


@pytest.mark.parametrize("precision", ["mxfp8", "hif8"])
def test_gemm_sqnr_against_bf16_sits_where_the_format_puts_it(runs, precision):
    _, on, *_ = runs(precision)
    for name, series in on["layer_numerics"]["series"].items():
        low = BANDS[precision][name.rsplit("_", 1)[1]]
        for sqnr, cosine, bias in zip(series["sqnr_db"], series["cosine"], series["rel_bias"]):
            assert low <= sqnr <= BF16_CEILING_DB, (name, sqnr)
            assert cosine > 0.99 and abs(bias) < 0.02, (name, cosine, bias)
        for op_name, op in series["operands"].items():
            floor = 24.5 if op_name == "grad_output" and precision == "hif8" else 29.0  # HiF8 gradients: format_max 224
            assert op["sqnr_db_min"] >= floor, (name, op_name, op["sqnr_db_min"])
            if precision == "mxfp8":  # E8M0 scales: whole powers of two
                assert op["scale_log2_min"] == int(op["scale_log2_min"]) <= op["scale_log2_max"], (name, op)


@pytest.mark.parametrize("precision", ["mxfp8"])
def test_the_series_appear_in_the_logger_under_stable_names(runs, precision):
    root, on, *_ = runs(precision)
    (metrics,) = (root / "logs").glob("version_*/metrics.csv")
    with open(metrics) as handle:
        rows = list(csv.DictReader(handle))
    name = "probe/layer_numerics/model.layers.0.self_attn.q_proj.weight/dense_fprop"
    logged = {int(r["step"]): float(r[f"{name}/sqnr_db"]) for r in rows if r.get(f"{name}/sqnr_db")}  # probe steps
    assert sorted(logged) == SAMPLED
    series = on["layer_numerics"]["series"]["model.layers.0.self_attn.q_proj.weight/dense_fprop"]
    assert [logged[s] for s in SAMPLED] == pytest.approx(series["sqnr_db"], abs=1e-5)
    columns = set(rows[0])
    for role in ("dense_fprop", "dense_dgrad", "dense_wgrad"):
        for metric in ("sqnr_db", "cosine", "rel_bias", "nonfinite"):
            assert f"probe/layer_numerics/model.layers.0.mlp.down_proj.weight/{role}/{metric}" in columns
    experts = "probe/layer_numerics/model.layers.1.mlp.experts.gate_up_proj/grouped_wgrad"
    for metric in ("amax", "sqnr_db", "flush_frac", "saturated_frac", "scale_log2_min", "scale_log2_max"):
        assert f"{experts}/activation.{metric}" in columns and f"{experts}/grad_output.{metric}" in columns


def test_reference_gemm_is_the_bf16_gemm_of_each_layout():
    torch.manual_seed(0)
    a, b = torch.randn(6, 4), torch.randn(5, 4)
    bf = lambda t: t.to(torch.bfloat16)  # noqa: E731
    assert torch.equal(reference_gemm(a, b, "NT", None), (bf(a) @ bf(b).T).float())
    assert torch.equal(reference_gemm(a, b.T.contiguous(), "NN", None), (bf(a) @ bf(b).T).float())
    c = torch.randn(6, 3)
    assert torch.equal(reference_gemm(a, c, "TN", None), (bf(a).T @ bf(c)).float())
    x, w, dy = torch.randn(7, 4), torch.randn(3, 4, 5), torch.randn(7, 5)
    groups = torch.tensor([3, 0, 4])
    fprop = reference_gemm(x, w, "NN", groups)
    assert torch.equal(fprop[:3], (bf(x[:3]) @ bf(w[0])).float()) and torch.equal(fprop[3:], (bf(x[3:]) @ bf(w[2])).float())
    dgrad = reference_gemm(dy, w, "NT", groups)
    assert dgrad.shape == (7, 4) and torch.equal(dgrad[3:], (bf(dy[3:]) @ bf(w[2]).T).float())
    wgrad = reference_gemm(x, dy, "TN", groups)
    assert wgrad.shape == (3, 4, 5) and torch.equal(wgrad[1], torch.zeros(4, 5))
    assert torch.equal(wgrad[2], (bf(x[3:]).T @ bf(dy[3:])).float())


def test_operand_statistics_count_flushed_elements_and_the_e8m0_range():
    from lp_lightning.formats.operand import QuantizationRole
    from lp_lightning.formats.registry import format_spec
    from lp_lightning.ops import quantize
    from lp_lightning.telemetry.layer_numerics import _OperandSums

    mx = format_spec("mxfp8_e4m3")
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 2] = 448.0, 2.0**-9, 2.0**-11  # block 0 (scale 2^0): 2^-9 is E4M3's smallest step
    x[0, 32], x[0, 33] = 3.0 * 2.0**-20, 2.0**-38  # block 1: amax 3·2^-20 -> scale 2^-27, 2^-38 = 2^-11 steps
    operand = quantize(mx.recipe.quantizer(QuantizationRole.INPUT_FWD), x, orientation="row")
    sums = _OperandSums()
    sums.add(operand, x)
    metrics = sums.metrics()
    assert metrics["flush_frac"] == pytest.approx(2 / 5)  # the two elements below half E4M3's smallest step
    assert (metrics["scale_log2_min"], metrics["scale_log2_max"], metrics["amax"]) == (-27.0, 0.0, 448.0)
    assert metrics["saturated_frac"] == 0.0 and metrics["sqnr_db"] > 80


def test_cast_saturated_counts_only_values_beyond_the_largest_element():
    from lp_lightning.formats.hif8 import codec as hif8_codec
    from lp_lightning.formats.operand import QuantizationRole, QuantizedOperand
    from lp_lightning.formats.registry import format_spec
    from lp_lightning.ops import quantize

    mx = format_spec("mxfp8_e4m3")
    x = torch.randn(2, 64)
    x[0, 5], x[1, 40] = 448.0, -448.0  # block amax 448: RCEIL scale 2^0, the element's code is ±448
    operand = quantize(mx.recipe.quantizer(QuantizationRole.INPUT_FWD), x, orientation="row")
    assert operand.data.float()[0, 5] == 448 and not mx.cast_saturated(operand, x).any()
    beyond = x.clone()
    beyond[0, 5], beyond[1, 40] = 500.0, -440.0  # 500 was clamped to 448; -440 merely rounds to -448
    assert mx.cast_saturated(operand, beyond).nonzero().tolist() == [[0, 5]]

    hif8 = format_spec("hif8")
    codes = hif8_codec.encode(torch.tensor([[32768.0, -32768.0, 1.0]]))
    operand = QuantizedOperand(data=codes, scale=torch.tensor(0.5), logical_dtype=torch.float32, format=hif8,
                               orientation="row", format_max=15.0)
    source = torch.tensor([[16384.0, -20000.0, 0.5]])  # 16384 / 0.5 = 32768 exactly; 20000 / 0.5 = 40000 clamped
    assert hif8.cast_saturated(operand, source).tolist() == [[False, True, False]]


def test_a_format_that_cannot_tell_saturation_reports_none():
    from types import SimpleNamespace

    from lp_lightning.telemetry.layer_numerics import _OperandSums

    source = torch.tensor([1.0, -2.0, 0.0, 3.0])
    fmt = SimpleNamespace(dequantize=lambda op: op.values, cast_saturated=lambda op, src: None)  # FormatSpec's default
    operand = SimpleNamespace(format=fmt, values=torch.tensor([1.0, -2.0, 0.0, 0.0]), scale=torch.tensor(0.25))
    sums = _OperandSums()
    sums.add(operand, source)
    metrics = sums.metrics()
    assert metrics["saturated_frac"] is None and metrics["flush_frac"] == pytest.approx(1 / 3)
    assert metrics["scale_log2_min"] == metrics["scale_log2_max"] == -2.0 and metrics["amax"] == 3.0
