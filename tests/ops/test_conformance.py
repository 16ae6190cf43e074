"""Backend conformance (``lp_lightning.ops.conformance``) on the recording fake torch_npu.

The faithful fake (it answers through the emulation) passes, and every quantisation and GEMM went
through its torch_npu op; each fake of ``deviant_torch_npu`` differs in one way and fails exactly
the cases of that operation, naming it and its worst element.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
from deviant_torch_npu import DEVIATIONS
from fake_torch_npu import FakeTorchNpu

from lp_lightning.ops.backend import LowPrecisionUnsupportedError
from lp_lightning.ops.conformance import (
    ConformanceResult,
    gemm_error_bound,
    run_conformance,
)
from lp_lightning.ops.npu import clear_capability_cache


def _run(monkeypatch: pytest.MonkeyPatch, fake: FakeTorchNpu) -> ConformanceResult:
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    clear_capability_cache()
    return run_conformance("npu", "cpu")


def _expected_calls(result: ConformanceResult) -> Counter:
    """The torch_npu calls each case must make (docs: lp_lightning/ops/npu.py's op table)."""
    calls: Counter = Counter()
    for case in result.cases:
        if case.op == "low_precision_matmul":
            calls["npu_quant_matmul"] += 1
        elif case.op == "low_precision_grouped_matmul":
            calls["npu_grouped_matmul"] += 1
        elif case.format == "hif8":
            calls["npu_quantize"] += 1  # one call: the dual quantisation shares its codes
        elif case.op == "quantize_dual":
            calls["npu_dynamic_mx_quant_with_dual_axis" if case.params["dtype"] == "bfloat16"
                  else "npu_dynamic_mx_quant"] += 1 if case.params["dtype"] == "bfloat16" else 2
        elif "group_list" in case.params and case.params["dtype"] == "bfloat16":
            calls["npu_grouped_dynamic_mx_quant"] += 1
        else:
            calls["npu_dynamic_mx_quant"] += 1
    return calls


def test_faithful_fake_passes_and_every_op_went_through_torch_npu(monkeypatch):
    fake = FakeTorchNpu()
    result = _run(monkeypatch, fake)
    assert result.ok, [(c.name, c.error, c.worst) for c in result.failures()]
    ops = {(c.op, c.format) for c in result.cases}
    assert ops == {(op, fmt) for fmt in ("mxfp8_e4m3", "hif8") for op in
                   ("quantize", "quantize_dual", "low_precision_matmul", "low_precision_grouped_matmul")}
    assert {(c.params["layout"], c.params["output_dtype"]) for c in result.cases if c.op.endswith("matmul")} == {
        (layout, dtype) for layout in ("NN", "NT", "TN") for dtype in ("bfloat16", "float16", "float32")}
    assert all(c.ran_on == ["emulated", "npu"] and c.compared > 0 for c in result.cases)
    assert Counter(c.name for c in fake.calls) == _expected_calls(result)
    lines = {v.question: v for v in result.verdicts}
    assert list(lines) == [f"Q{i}" for i in range(1, 8)]
    assert lines["Q7"].status == "as emulated" and "+Inf -> 0x6F as the emulation" in lines["Q7"].line
    assert lines["Q3"].line.startswith("Q3: HiF8 quantize maps x / scale in [2^-23, 2^-22) -> 0x01/0x81")
    assert lines["Q1"].status == "not settled" and lines["Q1"].line.endswith("not settled by this run")
    assert result.as_dict()["summary"] == {"cases": len(result.cases), "failed": 0}


@pytest.mark.parametrize("name", list(DEVIATIONS))
def test_a_fake_deviating_in_one_way_fails_that_operation_only(monkeypatch, name):
    fake_class, ops, fmt, output_dtype = DEVIATIONS[name]
    result = _run(monkeypatch, fake_class())
    failed = result.failures()
    assert failed and not result.ok
    for case in failed:  # every failure is of the deviating operation, with its worst element named
        assert case.op in ops and (fmt is None or case.format == fmt), case.name
        assert output_dtype is None or case.params["output_dtype"] == output_dtype, case.name
        assert case.worst is not None and (case.error or case.mismatches), case.name
    assert all(c.ok for c in result.cases if c.op not in ops)  # the other operations still pass
    lines = {v.question: v for v in result.verdicts}
    if name == "hif8_ties_to_even":
        assert lines["Q7"].status == "deviates" and "exact ties (away from zero) -> " in lines["Q7"].text
        assert any(c.worst.get("input") == 1.0625 * 2**-3 or "tie" in c.observations for c in failed)
    if name == "inf_not_saturated":
        assert "+Inf -> 0x80 at" in lines["Q7"].text and "-Inf -> 0xEF as the emulation" in lines["Q7"].text
    if name == "mx_pair_transposed":
        assert lines["Q6"].status == "deviates" and all("scale" in c.worst["tensor"] for c in failed)
    if name == "fp32_out_via_bf16":
        assert all(c.worst["ratio"] > 1 for c in failed) and len(failed) == 6  # NN/NT/TN x two formats
    if name == "gmm_drops_empty":
        assert lines["Q6"].status == "deviates" and {c.params["layout"] for c in failed} == {"NN", "NT", "TN"}


def test_the_gemm_bound_separates_accumulation_order_from_a_bf16_rounding():
    torch.manual_seed(0)
    a, b = torch.randn(64, 96, dtype=torch.float64), torch.randn(96, 32, dtype=torch.float64)
    exact = a @ b
    fp32 = (a.float() @ b.float()).double()  # another accumulation order: within the bound
    reordered = (a.float().flip(1) @ b.float().flip(0)).double()
    bound = gemm_error_bound(a.abs() @ b.abs(), fp32, 96, torch.float32)
    assert bool(((fp32 - reordered).abs() <= bound).all()) and bool(((fp32 - exact).abs() <= bound).all())
    via_bf16 = fp32.to(torch.bfloat16).double()
    assert int(((via_bf16 - fp32).abs() > bound).sum()) > 0.9 * fp32.numel()


def test_conformance_refuses_auto_unknown_formats_and_a_backend_that_cannot_run(monkeypatch):
    with pytest.raises(ValueError, match="backend='auto'; name the backend"):
        run_conformance("auto", "cpu")
    with pytest.raises(ValueError, match="conformance cases exist for"):
        run_conformance("emulated", "cpu", formats=("fp4",))
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    clear_capability_cache()
    with pytest.raises(LowPrecisionUnsupportedError, match="the 'npu' backend cannot run mxfp8_e4m3"):
        run_conformance("npu", "cpu")


def test_on_the_emulated_backend_no_open_question_is_settled():
    result = run_conformance("emulated", "cpu", formats=("hif8",))
    assert result.ok and {v.status for v in result.verdicts} == {"not settled"}
    assert "the emulated backend is the reference itself" in result.verdicts[0].line
