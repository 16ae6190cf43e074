"""Grouped SwiGLU experts autograd (design spec §6, §8; R6): shapes/dtypes, exactness against a reference
hand-composed from the format layer, empty/one/uneven expert groups, per-GEMM SQNR floors, the six
grouped GEMM events, SwiGLU backward, argument errors.

Per-GEMM SQNR method: each of the six grouped GEMMs is scored against an FP64 grouped product of
the *high-precision tensors that GEMM quantized* (x, h = silu(gate)·up in FP32, dy, dgu in FP32,
and the FP32 master weights), captured by spying on the function's quantize calls. That isolates
each GEMM's own quantisation noise from the error inherited through SwiGLU (the end-to-end error
against HF's BF16 eager experts is tested in ``tests/models/test_deepseek_v3_experts.py``). A
BF16 golden of the same GEMM is ≥ 45 dB from FP64, so the choice of golden moves the numbers by
< 0.2 dB. Inputs: T = 256 token rows in 4 uneven groups (one empty), H = 128, F = 96, x and dy
N(0, 1) BF16, weights N(0, 1)·0.05 FP32, seed 0.

Floors (dB), the same as the dense GEMMs (``tests/functional/test_linear.py`` gives the derivation):
MXFP8 fprop 26, dgrad 25, wgrad 24 (torchao's MXFP8 linear floors); HiF8 fprop 26, dgrad 22.5,
wgrad 22.5 (gradients scaled to amax = 224 keep 2 mantissa bits in their bulk). Measured (seed 0):
MXFP8 28.5–28.6 for all six GEMMs; HiF8 fprop 28.6 (gate_up) / 28.4 (down), dgrad and wgrad
24.6–24.9. The SwiGLU output h = silu(gate)·up has heavier tails than a Gaussian, yet its HiF8
per-tensor operand scores like a Gaussian one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lp_lightning.evidence.numerics import sqnr_db
from lp_lightning.formats import QuantizationRole, recipe_for
from lp_lightning.functional import (
    grouped_linear,
    low_precision_grouped_linear,
    low_precision_grouped_swiglu,
    swiglu_backward,
)
from lp_lightning.ops import GemmRole, record_gemms
from lp_reference import lp_weight, reference_grouped_gemm

R = QuantizationRole
FORMATS = ["mxfp8_e4m3", "hif8"]
H, FF = 64, 48  # hidden size, expert intermediate size

SQNR_FLOORS_DB = {
    ("mxfp8_e4m3", "fprop"): 26.0,
    ("mxfp8_e4m3", "dgrad"): 25.0,
    ("mxfp8_e4m3", "wgrad"): 24.0,
    ("hif8", "fprop"): 26.0,
    ("hif8", "dgrad"): 22.5,
    ("hif8", "wgrad"): 22.5,
}


def _swiglu_backward_by_hand(gu: torch.Tensor, dh32: torch.Tensor) -> torch.Tensor:
    g, u = gu.float().chunk(2, dim=-1)
    s = torch.sigmoid(g)
    return torch.cat([dh32 * u * s * (1.0 + g * (1.0 - s)), dh32 * g * s], dim=-1)


def reference_grouped_swiglu(x, group_list, gate_up_master, down_master, dy, fmt):
    """y, dx, d gate_up, d down of the grouped function, composed by hand from the recipe's quantizers."""
    q = recipe_for(fmt).quantizer
    gl = group_list
    gu_HN, dn_FH = gate_up_master.transpose(-2, -1), down_master.transpose(-2, -1)  # GMM views
    gu = reference_grouped_gemm(
        q(R.INPUT_FWD).quantize(x, orientation="row", group_list=gl),
        q(R.WEIGHT_FWD).quantize(gu_HN, orientation="col"),
        gl, "NN", x.dtype,
    )
    gate32, up32 = gu.float().chunk(2, dim=-1)
    h32 = F.silu(gate32) * up32
    y = reference_grouped_gemm(
        q(R.INPUT_FWD).quantize(h32, orientation="row", group_list=gl),
        q(R.WEIGHT_FWD).quantize(dn_FH, orientation="col"),
        gl, "NN", x.dtype,
    )
    dh32 = reference_grouped_gemm(
        q(R.GRAD_OUTPUT).quantize(dy, orientation="row", group_list=gl),
        q(R.WEIGHT_BWD).quantize(dn_FH, orientation="row"),
        gl, "NT", torch.float32,
    )
    d_down = reference_grouped_gemm(
        q(R.INPUT_BWD).quantize(h32, orientation="col", group_list=gl),
        q(R.GRAD_OUTPUT).quantize(dy, orientation="col", group_list=gl),
        gl, "TN", down_master.dtype,
    ).transpose(-2, -1)
    dgu32 = _swiglu_backward_by_hand(gu, dh32)
    dx = reference_grouped_gemm(
        q(R.GRAD_OUTPUT).quantize(dgu32, orientation="row", group_list=gl),
        q(R.WEIGHT_BWD).quantize(gu_HN, orientation="row"),
        gl, "NT", x.dtype,
    )
    d_gate_up = reference_grouped_gemm(
        q(R.INPUT_BWD).quantize(x, orientation="col", group_list=gl),
        q(R.GRAD_OUTPUT).quantize(dgu32, orientation="col", group_list=gl),
        gl, "TN", gate_up_master.dtype,
    ).transpose(-2, -1)
    return y, dx, d_gate_up, d_down


def _masters(num_experts: int, scale: float = 0.1):
    return torch.randn(num_experts, 2 * FF, H) * scale, torch.randn(num_experts, H, FF) * scale


def _run(x, group_list, gate_up, down, dy, fmt):
    x = x.detach().requires_grad_()
    y = low_precision_grouped_swiglu(x, group_list, gate_up, down, recipe=recipe_for(fmt))
    y.backward(dy)
    return y, x.grad


@pytest.mark.usefixtures("ieee_gemms")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "counts", [[30, 0, 50, 16], [96], [0, 0, 96, 0], [1, 33, 0, 62]], ids=["uneven-empty", "one-expert", "one-hot", "ragged"]
)
def test_shapes_dtypes_empty_experts_and_exact_match_with_format_layer_reference(fmt, counts):
    group_list = torch.tensor(counts, dtype=torch.int64)
    tokens, experts = sum(counts), len(counts)
    gate_up_master, down_master = _masters(experts)
    gate_up, down = lp_weight(gate_up_master, fmt, "grouped"), lp_weight(down_master, fmt, "grouped")
    x = torch.randn(tokens, H, dtype=torch.bfloat16)
    dy = torch.randn(tokens, H, dtype=torch.bfloat16)

    y, dx = _run(x, group_list, gate_up, down, dy, fmt)

    assert y.shape == (tokens, H) and y.dtype == torch.bfloat16
    assert dx.shape == (tokens, H) and dx.dtype == torch.bfloat16
    assert gate_up.grad.shape == (experts, 2 * FF, H) and gate_up.grad.dtype == torch.float32
    assert down.grad.shape == (experts, H, FF) and down.grad.dtype == torch.float32
    assert gate_up.grad.is_contiguous() and down.grad.is_contiguous()
    for e, count in enumerate(counts):
        if count == 0:
            assert torch.count_nonzero(gate_up.grad[e]) == 0 and torch.count_nonzero(down.grad[e]) == 0
        else:
            assert torch.count_nonzero(gate_up.grad[e]) > 0 and torch.count_nonzero(down.grad[e]) > 0
    ref_y, ref_dx, ref_dgu, ref_dd = reference_grouped_swiglu(x, group_list, gate_up_master, down_master, dy, fmt)
    assert torch.equal(y, ref_y)
    assert torch.equal(dx, ref_dx)
    assert torch.equal(gate_up.grad, ref_dgu)
    assert torch.equal(down.grad, ref_dd)


@pytest.mark.parametrize("fmt", FORMATS)
def test_trace_shows_the_six_grouped_gemms_in_order(fmt):
    group_list = torch.tensor([10, 0, 22], dtype=torch.int64)
    gate_up_master, down_master = _masters(3)
    with record_gemms() as events:
        _run(
            torch.randn(32, H, dtype=torch.bfloat16), group_list,
            lp_weight(gate_up_master, fmt, "grouped", fqn="experts.gate_up_proj"),
            lp_weight(down_master, fmt, "grouped", fqn="experts.down_proj"),
            torch.randn(32, H, dtype=torch.bfloat16), fmt,
        )
    got = [(e.gemm_role, e.layout, e.left_shape, e.right_shape, e.output_shape, e.backend) for e in events]
    fp, dg, wg = GemmRole.GROUPED_FPROP, GemmRole.GROUPED_DGRAD, GemmRole.GROUPED_WGRAD
    assert got == [
        (fp, "NN", (32, H), (3, H, 2 * FF), (32, 2 * FF), "emulated"),  # gate_up fprop
        (fp, "NN", (32, FF), (3, FF, H), (32, H), "emulated"),  # down fprop
        (dg, "NT", (32, H), (3, FF, H), (32, FF), "emulated"),  # down dgrad
        (wg, "TN", (32, FF), (32, H), (3, FF, H), "emulated"),  # down wgrad
        (dg, "NT", (32, 2 * FF), (3, H, 2 * FF), (32, H), "emulated"),  # gate_up dgrad
        (wg, "TN", (32, H), (32, 2 * FF), (3, H, 2 * FF), "emulated"),  # gate_up wgrad
    ]
    assert all(e.num_groups == 3 and e.format == fmt for e in events)
    gu, dn = "experts.gate_up_proj", "experts.down_proj"
    assert [e.weight_fqn for e in events] == [gu, dn, dn, dn, gu, gu]  # wgrad names its weight too


def _fp64_grouped(left, right, counts, layout):
    out = []
    start = 0
    for g, count in enumerate(counts):
        rows = slice(start, start + count)
        start += count
        if layout == "TN":
            out.append(left[rows].T @ right[rows])
        else:
            out.append(left[rows] @ (right[g].T if layout == "NT" else right[g]))
    return torch.stack(out) if layout == "TN" else torch.cat(out)


@pytest.mark.parametrize("fmt", FORMATS)
def test_per_gemm_sqnr_against_fp64_of_each_gemms_inputs_meets_floors(fmt, monkeypatch):
    torch.manual_seed(0)
    counts = [96, 0, 112, 48]
    hidden, inter = 128, 96
    group_list = torch.tensor(counts, dtype=torch.int64)
    gate_up_master = torch.randn(4, 2 * inter, hidden) * 0.05
    down_master = torch.randn(4, hidden, inter) * 0.05
    x = torch.randn(256, hidden, dtype=torch.bfloat16)
    dy = torch.randn(256, hidden, dtype=torch.bfloat16)

    quantized, outputs = [], []
    real_quantize, real_gemm = grouped_linear.quantize_for_gemms, grouped_linear.low_precision_grouped_matmul

    def quantize_spy(recipe, tensor, requests, **kwargs):
        quantized.append(tensor.detach().clone())
        return real_quantize(recipe, tensor, requests, **kwargs)

    def gemm_spy(left, right, group_list, *, layout, output_dtype, backend=None):
        out = real_gemm(left, right, group_list, layout=layout, output_dtype=output_dtype, backend=backend)
        outputs.append(out.detach().clone())
        return out

    monkeypatch.setattr(grouped_linear, "quantize_for_gemms", quantize_spy)
    monkeypatch.setattr(grouped_linear, "low_precision_grouped_matmul", gemm_spy)
    _run(x, group_list, lp_weight(gate_up_master, fmt, "grouped"), lp_weight(down_master, fmt, "grouped"), dy, fmt)

    x64, h64, dy64, dgu64 = (t.double() for t in quantized)  # the high-precision inputs, in call order
    gu_HN, dn_FH = gate_up_master.double().transpose(-2, -1), down_master.double().transpose(-2, -1)
    references = [
        ("fprop", "gate_up", _fp64_grouped(x64, gu_HN, counts, "NN")),
        ("fprop", "down", _fp64_grouped(h64, dn_FH, counts, "NN")),
        ("dgrad", "down", _fp64_grouped(dy64, dn_FH, counts, "NT")),
        ("wgrad", "down", _fp64_grouped(h64, dy64, counts, "TN")),
        ("dgrad", "gate_up", _fp64_grouped(dgu64, gu_HN, counts, "NT")),
        ("wgrad", "gate_up", _fp64_grouped(x64, dgu64, counts, "TN")),
    ]
    assert len(outputs) == len(references)
    inputs = {"fprop gate_up": (x64, gu_HN, "NN"), "dgrad down": (dy64, dn_FH, "NT"), "wgrad gate_up": (x64, dgu64, "TN")}
    for left, right, layout in inputs.values():  # a BF16 golden would score the same: it is ≥ 45 dB from FP64
        bf16 = _fp64_grouped(left.bfloat16(), right.bfloat16(), counts, layout)
        assert sqnr_db(bf16, _fp64_grouped(left, right, counts, layout)) >= 45.0
    measured = {f"{proj} {gemm}": (gemm, sqnr_db(out, ref)) for (gemm, proj, ref), out in zip(references, outputs)}
    print(f"grouped per-GEMM SQNR vs FP64, {fmt}: " + ", ".join(f"{k} {v:.2f} dB" for k, (_, v) in measured.items()))
    for name, (gemm, value) in measured.items():
        assert value >= SQNR_FLOORS_DB[(fmt, gemm)], (fmt, name, value)


def test_swiglu_backward_matches_autograd():
    gu = torch.randn(64, 2 * FF, dtype=torch.float64, requires_grad=True)
    dh = torch.randn(64, FF, dtype=torch.float64)
    gate, up = gu.chunk(2, dim=-1)
    (F.silu(gate) * up).backward(dh)
    ours = swiglu_backward(gu.detach(), dh)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), gu.grad, rtol=1e-5, atol=1e-6)


def test_frozen_weights_and_frozen_input_skip_their_gemms():
    fmt = "hif8"
    gate_up_master, down_master = _masters(2)
    gate_up = lp_weight(gate_up_master, fmt, "grouped").requires_grad_(False)
    down = lp_weight(down_master, fmt, "grouped")
    x = torch.randn(20, H, dtype=torch.bfloat16)  # no grad: first layer input
    with record_gemms() as events:
        low_precision_grouped_swiglu(x, torch.tensor([12, 8]), gate_up, down, recipe=recipe_for(fmt)).sum().backward()
    assert [e.gemm_role for e in events] == [GemmRole.GROUPED_FPROP, GemmRole.GROUPED_FPROP, GemmRole.GROUPED_WGRAD]
    assert gate_up.grad is None and down.grad.shape == down_master.shape


def test_argument_errors_name_the_problem():
    fmt = "hif8"
    gate_up_master, down_master = _masters(2)
    gate_up, down = lp_weight(gate_up_master, fmt, "grouped"), lp_weight(down_master, fmt, "grouped")
    x, gl, recipe = torch.randn(20, H), torch.tensor([12, 8]), recipe_for(fmt)
    with pytest.raises(TypeError, match="group_list must be a 1-D torch.int64"):
        low_precision_grouped_swiglu(x, gl.to(torch.int32), gate_up, down, recipe=recipe)
    with pytest.raises(ValueError, match="group_list \\[2\\]"):
        low_precision_grouped_swiglu(x, torch.tensor([20]), gate_up, down, recipe=recipe)
    with pytest.raises(ValueError, match="down_weight"):
        low_precision_grouped_swiglu(x, gl, gate_up, lp_weight(torch.randn(2, H, FF + 1), fmt, "grouped"), recipe=recipe)
    with pytest.raises(ValueError, match="sum"):
        low_precision_grouped_swiglu(x, torch.tensor([12, 7]), gate_up, down, recipe=recipe)
    with pytest.raises(ValueError, match="recipe 'mxfp8_e4m3_mx_block'"):
        low_precision_grouped_swiglu(x, gl, gate_up, down, recipe=recipe_for("mxfp8_e4m3"))
    with pytest.raises(TypeError, match="gate_up_weight is a plain Parameter"):
        low_precision_grouped_swiglu(x, gl, torch.nn.Parameter(gate_up_master), down, recipe=recipe)


# ------------------------------------------------------------------------------------------------
# One grouped linear on its own (the grouped operator of the layered numerics, lp_lightning.st.numerics)


@pytest.mark.usefixtures("ieee_gemms")
@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_linear_matches_format_layer_reference_and_traces_three_roles(fmt):
    counts = [30, 0, 50, 16]
    group_list = torch.tensor(counts, dtype=torch.int64)
    master = torch.randn(4, FF, H) * 0.1  # HF layout [E, N, K]
    weight = lp_weight(master, fmt, "grouped")
    x = torch.randn(96, H, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(96, FF, dtype=torch.bfloat16)
    with record_gemms() as events:
        y = low_precision_grouped_linear(x, group_list, weight, recipe=recipe_for(fmt))
        y.backward(dy)
    assert [(e.gemm_role, e.layout) for e in events] == [
        (GemmRole.GROUPED_FPROP, "NN"), (GemmRole.GROUPED_DGRAD, "NT"), (GemmRole.GROUPED_WGRAD, "TN"),
    ]
    q = recipe_for(fmt).quantizer
    w_KN = master.transpose(-2, -1)
    ref_y = reference_grouped_gemm(
        q(R.INPUT_FWD).quantize(x.detach(), orientation="row", group_list=group_list),
        q(R.WEIGHT_FWD).quantize(w_KN, orientation="col"), group_list, "NN", torch.bfloat16,
    )
    ref_dx = reference_grouped_gemm(
        q(R.GRAD_OUTPUT).quantize(dy, orientation="row", group_list=group_list),
        q(R.WEIGHT_BWD).quantize(w_KN, orientation="row"), group_list, "NT", torch.bfloat16,
    )
    ref_dw = reference_grouped_gemm(
        q(R.INPUT_BWD).quantize(x.detach(), orientation="col", group_list=group_list),
        q(R.GRAD_OUTPUT).quantize(dy, orientation="col", group_list=group_list), group_list, "TN", torch.float32,
    ).transpose(-2, -1)
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32
    assert torch.equal(y, ref_y) and torch.equal(x.grad, ref_dx) and torch.equal(weight.grad, ref_dw)
    assert torch.count_nonzero(weight.grad[1]) == 0  # the empty expert


def test_grouped_linear_frozen_weight_skips_wgrad_and_checks_arguments():
    weight = lp_weight(torch.randn(2, FF, H), "hif8", "grouped").requires_grad_(False)
    x = torch.randn(20, H, requires_grad=True)
    recipe = recipe_for("hif8")
    with record_gemms() as events:
        low_precision_grouped_linear(x, torch.tensor([12, 8]), weight, recipe=recipe).sum().backward()
    assert [e.gemm_role for e in events] == [GemmRole.GROUPED_FPROP, GemmRole.GROUPED_DGRAD]
    with pytest.raises(TypeError, match="group_list must be a 1-D torch.int64"):
        low_precision_grouped_linear(x, torch.tensor([12, 8], dtype=torch.int32), weight, recipe=recipe)
    with pytest.raises(ValueError, match=r"must be \[T, K=64\] and group_list \[2\]"):
        low_precision_grouped_linear(x, torch.tensor([20]), weight, recipe=recipe)
    with pytest.raises(ValueError, match="recipe 'mxfp8_e4m3_mx_block'"):
        low_precision_grouped_linear(x, torch.tensor([12, 8]), weight, recipe=recipe_for("mxfp8_e4m3"))
