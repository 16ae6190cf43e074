"""The npu backend against a recording fake torch_npu: every call and argument is pinned, results
equal the emulated backend, the capability gate names what is missing, nothing falls back
(design spec §15, §16.2; requirement R6 (docs/design.md), R11)."""

from __future__ import annotations

import math
import re
import sys

import pytest
import torch
from packaging.version import Version

from fake_torch_npu import (
    DATA,
    FLOAT8_E8M0FNU,
    HIFLOAT8,
    SCHEMAS,
    CallRecord,
    load_schemas,
    pack_grouped_pairs,
    pairs_along,
    spec,
    unpack_grouped_pairs,
)
from lp_lightning.formats import HiF8Quantizer, MXFP8Quantizer, recipe_for
from lp_lightning.functional import low_precision_grouped_swiglu, low_precision_linear
from lp_lightning.ops import (
    LowPrecisionUnsupportedError,
    low_precision_grouped_matmul,
    low_precision_matmul,
    quantize,
    quantize_dual,
    record_gemms,
    resolve_backend,
    use_backend,
)
from lp_lightning.ops import emulated, npu
from lp_lightning.ops.npu import GateCheck, check_npu_capability
from lp_lightning.tensor import QuantizedWeightTensor

E4M3, E8M0, U8, F32, I64, BF16 = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.uint8, torch.float32,
                                  torch.int64, torch.bfloat16)
T2, T3, T4 = (1, 0), (1, 0, 2), (0, 2, 1, 3)  # dim orders of the transposed views
MX, HI, GRAD = MXFP8Quantizer(), HiF8Quantizer(format_max=15.0), HiF8Quantizer(format_max=224.0)
# Block counts 3 (odd: padded pair), 3 and 4 along M, K, N.
M, K, N = 80, 70, 100
COUNTS = [37, 0, 64, 5]
T, E = sum(COUNTS), len(COUNTS)


def P(extent: int) -> int:
    """Pair rows of the NPU MX scale layout: ceil(ceil(d / 32) / 2)."""
    return math.ceil(math.ceil(extent / 32) / 2)


def _both(fn, *args, **kwargs):
    """Run a GEMM on the npu backend (fake) and on the emulated backend."""
    return fn(*args, **kwargs, backend="npu"), fn(*args, **kwargs, backend="emulated")


# ------------------------------------------------------------------------------------------------
# Dense GEMMs.

MX_DENSE = {"output_dtype": BF16, "scale_dtype": FLOAT8_E8M0FNU, "pertoken_scale_dtype": FLOAT8_E8M0FNU,
            "group_sizes": (1, 1, 32)}
HIF8_DENSE = {"output_dtype": BF16, "x1_dtype": HIFLOAT8, "x2_dtype": HIFLOAT8}


def _dense(fmt, layout):
    x, w, dy = torch.randn(M, K), torch.randn(N, K), torch.randn(M, N)
    q = (lambda t, o, grad=False: MX.quantize(t, orientation=o)) if fmt == "mx" else (
        lambda t, o, grad=False: (GRAD if grad else HI).quantize(t, orientation=o))
    if layout == "NT":
        return q(x, "row"), q(w, "row")
    if layout == "NN":
        return q(dy, "row", True), q(w, "col")
    return q(dy, "col", True), q(x, "col")


EXPECTED_DENSE = {
    ("mx", "NT"): {"x1": spec(E4M3, (M, K)), "x2": spec(E4M3, (K, N), T2), "scale": spec(E8M0, (P(K), N, 2), T3),
                   "pertoken_scale": spec(E8M0, (M, P(K), 2)), **MX_DENSE},
    ("mx", "NN"): {"x1": spec(E4M3, (M, N)), "x2": spec(E4M3, (N, K)), "scale": spec(E8M0, (P(N), K, 2)),
                   "pertoken_scale": spec(E8M0, (M, P(N), 2)), **MX_DENSE},
    ("mx", "TN"): {"x1": spec(E4M3, (N, M), T2), "x2": spec(E4M3, (M, K)), "scale": spec(E8M0, (P(M), K, 2)),
                   "pertoken_scale": spec(E8M0, (N, P(M), 2), T3), **MX_DENSE},
    ("hif8", "NT"): {"x1": spec(U8, (M, K)), "x2": spec(U8, (K, N), T2), "scale": spec(F32, (1,)),
                     "pertoken_scale": spec(F32, (1,)), **HIF8_DENSE},
    ("hif8", "NN"): {"x1": spec(U8, (M, N)), "x2": spec(U8, (N, K)), "scale": spec(F32, (1,)),
                     "pertoken_scale": spec(F32, (1,)), **HIF8_DENSE},
    ("hif8", "TN"): {"x1": spec(U8, (N, M), T2), "x2": spec(U8, (M, K)), "scale": spec(F32, (1,)),
                     "pertoken_scale": spec(F32, (1,)), **HIF8_DENSE},
}


@pytest.mark.parametrize(("fmt", "layout"), sorted(EXPECTED_DENSE), ids=["-".join(k) for k in sorted(EXPECTED_DENSE)])
def test_dense_call_records_and_results(fake_npu, fmt, layout):
    left, right = _dense(fmt, layout)
    with record_gemms() as events:
        out, reference = _both(low_precision_matmul, left, right, layout=layout, output_dtype=BF16)
    assert fake_npu.calls == [CallRecord("npu_quant_matmul", EXPECTED_DENSE[(fmt, layout)])]
    assert torch.equal(out, reference)
    assert [e.backend for e in events] == ["npu", "emulated"]


# ------------------------------------------------------------------------------------------------
# Grouped GEMMs.


def _grouped(fmt, layout, group_list):
    x, w, dy = torch.randn(T, K), torch.randn(E, K, N), torch.randn(T, N)
    def q(t, o, grad=False, gl=None):
        quantizer = MX if fmt == "mx" else (GRAD if grad else HI)
        return quantizer.quantize(t, orientation=o, group_list=gl)

    if layout == "NN":
        return q(x, "row"), q(w, "col")
    if layout == "NT":
        return q(dy, "row", True), q(w, "row")
    return q(x, "col", gl=group_list), q(dy, "col", True, gl=group_list)


def _gmm(split_k: bool, **extra):
    return {"group_list": spec(I64, (E,)), "split_item": 3, "group_type": 2 if split_k else 0,
            "group_list_type": 1, "output_dtype": BF16, **extra}


MX_KINDS = {"scale_dtype": FLOAT8_E8M0FNU, "per_token_scale_dtype": FLOAT8_E8M0FNU}
HIF8_KINDS = {"x_dtype": HIFLOAT8, "weight_dtype": HIFLOAT8}
PK = T // 64 + E  # rows of the NPU grouped MX scale

EXPECTED_GROUPED = {
    ("mx", "NN"): {"x": (spec(E4M3, (T, K)),), "weight": (spec(E4M3, (E, K, N)),),
                   "scale": (spec(E8M0, (E, P(K), N, 2)),), "per_token_scale": (spec(E8M0, (T, P(K), 2)),),
                   **_gmm(False, **MX_KINDS)},
    ("mx", "NT"): {"x": (spec(E4M3, (T, N)),), "weight": (spec(E4M3, (E, N, K), (0, 2, 1)),),
                   "scale": (spec(E8M0, (E, P(N), K, 2), T4),), "per_token_scale": (spec(E8M0, (T, P(N), 2)),),
                   **_gmm(False, **MX_KINDS)},
    ("mx", "TN"): {"x": (spec(E4M3, (K, T), T2),), "weight": (spec(E4M3, (T, N)),),
                   "scale": (spec(E8M0, (PK, N, 2)),), "per_token_scale": (spec(E8M0, (K, PK, 2), T3),),
                   **_gmm(True, **MX_KINDS)},
    ("hif8", "NN"): {"x": (spec(U8, (T, K)),), "weight": (spec(U8, (E, K, N)),), "scale": (spec(F32, (E,)),),
                     "per_token_scale": (spec(F32, (T,)),), **_gmm(False, **HIF8_KINDS)},
    ("hif8", "NT"): {"x": (spec(U8, (T, N)),), "weight": (spec(U8, (E, N, K), (0, 2, 1)),),
                     "scale": (spec(F32, (E,)),), "per_token_scale": (spec(F32, (T,)),), **_gmm(False, **HIF8_KINDS)},
    ("hif8", "TN"): {"x": (spec(U8, (K, T), T2),), "weight": (spec(U8, (T, N)),), "scale": (spec(F32, (E,)),),
                     "per_token_scale": (spec(F32, (E,)),), **_gmm(True, **HIF8_KINDS)},
}


@pytest.mark.parametrize(
    ("fmt", "layout"), sorted(EXPECTED_GROUPED), ids=["-".join(k) for k in sorted(EXPECTED_GROUPED)]
)
def test_grouped_call_records_and_results(fake_npu, fmt, layout):
    group_list = torch.tensor(COUNTS)
    left, right = _grouped(fmt, layout, group_list)
    out, reference = _both(low_precision_grouped_matmul, left, right, group_list, layout=layout, output_dtype=BF16)
    assert fake_npu.calls == [CallRecord("npu_grouped_matmul", EXPECTED_GROUPED[(fmt, layout)])]
    assert torch.equal(out, reference)


# ------------------------------------------------------------------------------------------------
# MX scale layout conversion (against the fake's element-by-element index rule).


@pytest.mark.parametrize("shape", [(5, 70), (3, 96, 33), (2, 4, 40, 64)])
def test_mx_scale_layout_round_trip(shape):
    x = torch.randn(shape)
    for orientation, axis in (("row", -1), ("col", -2)):
        scale = MX.quantize(x, orientation=orientation).scale
        ours_u8 = scale.view(torch.uint8)
        npu_scale = npu.mx_scale_to_npu(scale, orientation=orientation)
        assert npu_scale.dtype == E8M0 and npu_scale.is_contiguous()
        assert torch.equal(npu_scale.view(torch.uint8), pairs_along(ours_u8, axis))
        back = npu.mx_scale_from_npu(npu_scale, orientation=orientation, num_blocks=math.ceil(shape[axis] / 32))
        assert torch.equal(back.view(torch.uint8), ours_u8)


@pytest.mark.parametrize("counts", [[37, 0, 64, 5], [0, 0], [33, 31, 1, 200]])
def test_mx_grouped_scale_layout_round_trip(counts):
    tokens = sum(counts)
    group_list = torch.tensor(counts)
    op = MX.quantize(torch.randn(tokens, 24), orientation="col", group_list=group_list)
    npu_scale = npu.mx_grouped_scale_to_npu(op.scale, group_list, tokens)
    assert npu_scale.shape == (tokens // 64 + len(counts), 24, 2)
    assert torch.equal(npu_scale.view(torch.uint8), pack_grouped_pairs(op.scale.view(torch.uint8), counts, tokens))
    assert torch.equal(unpack_grouped_pairs(npu_scale.view(torch.uint8), counts), op.scale.view(torch.uint8))
    back = npu.mx_grouped_scale_from_npu(npu_scale, group_list)
    assert torch.equal(back.view(torch.uint8), op.scale.view(torch.uint8))


# ------------------------------------------------------------------------------------------------
# Quantize on the npu backend.


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _same_operand(a, b):
    assert (a.orientation, a.format, a.logical_dtype, a.format_max) == (
        b.orientation, b.format, b.logical_dtype, b.format_max)
    assert torch.equal(_bits(a.data), _bits(b.data)) and torch.equal(_bits(a.scale), _bits(b.scale))


def test_mx_quantize_on_the_npu_backend(fake_npu):
    x = torch.randn(M, K, dtype=BF16)
    group_list = torch.tensor([30, 0, 50])
    with use_backend("npu"):  # quantisation goes through the backend (lp_lightning.ops.quantize)
        row = quantize(MX, x, orientation="row")
        col = quantize(MX, x, orientation="col")
        dual = quantize_dual(MX, x)
        grouped = quantize(MX, x, orientation="col", group_list=group_list)
    quant = {"input": spec(BF16, (M, K)), "dst_type": E4M3, "scale_alg": 1}
    assert fake_npu.calls == [
        CallRecord("npu_dynamic_mx_quant", {**quant, "axis": -1}),
        CallRecord("npu_dynamic_mx_quant", {**quant, "axis": -2}),
        CallRecord("npu_dynamic_mx_quant_with_dual_axis", quant),
        CallRecord("npu_grouped_dynamic_mx_quant", {"x": spec(BF16, (M, K)), "group_index": spec(torch.int32, (3,)),
                                                    "round_mode": "rint", "dst_type": E4M3, "blocksize": 32,
                                                    "scale_alg": 1}),
    ]
    with use_backend("emulated"):
        _same_operand(row, MX.quantize(x, orientation="row"))
        _same_operand(col, MX.quantize(x, orientation="col"))
        _same_operand(dual[0], row)
        _same_operand(dual[1], col)
        _same_operand(grouped, MX.quantize(x, orientation="col", group_list=group_list))


def test_an_fp32_master_is_dual_quantized_per_axis_without_a_cast(fake_npu):
    """npu_dynamic_mx_quant_with_dual_axis takes FP16/BF16 only (its 2.13.0 docs); a BF16 cast would round twice."""
    w = torch.randn(2, N, K)  # e.g. a stacked FP32 master
    with use_backend("npu"):
        row, col = quantize_dual(MX, w)
    quant = {"input": spec(F32, (2, N, K)), "dst_type": E4M3, "scale_alg": 1}
    assert fake_npu.calls == [CallRecord("npu_dynamic_mx_quant", {**quant, "axis": axis}) for axis in (-1, -2)]
    _same_operand(row, MX.quantize(w, orientation="row"))
    _same_operand(col, MX.quantize(w, orientation="col"))


@pytest.mark.parametrize("counts", [COUNTS, [0, 33, 0, 31, 64], [0, 0, 0]])
def test_an_fp32_grouped_col_operand_is_quantized_on_block_aligned_groups(fake_npu, counts):
    """npu_grouped_dynamic_mx_quant takes FP16/BF16 only; the FP32 SwiGLU output and gradient are quantized by one
    npu_dynamic_mx_quant(axis=-2) over rows re-laid so each group starts at a multiple of 32 (gaps zero)."""
    group_list = torch.tensor(counts)
    x = torch.randn(sum(counts), K) * torch.logspace(-3, 3, sum(counts))[:, None]  # blocks of very different amax
    with use_backend("npu"):
        col = quantize(MX, x, orientation="col", group_list=group_list)
    blocks = sum(-(-n // 32) for n in counts)
    expected = [CallRecord("npu_dynamic_mx_quant", {"input": spec(F32, (32 * blocks, K)), "axis": -2,
                                                    "dst_type": E4M3, "scale_alg": 1})] if blocks else []
    assert fake_npu.calls == expected
    _same_operand(col, MX.quantize(x, orientation="col", group_list=group_list))


def test_an_input_dtype_the_op_refuses_propagates(fake_npu):
    """The op's own error for an input it refuses (FP64 here) reaches the caller; there is no fallback."""
    with use_backend("npu"), pytest.raises(RuntimeError, match="npu_grouped_dynamic_mx_quant takes input of"):
        quantize(MX, torch.randn(T, K, dtype=torch.float64), orientation="col", group_list=torch.tensor(COUNTS))


# ------------------------------------------------------------------------------------------------
# HiF8 quantize on the npu backend: our amax and scale, the codes from one npu_quantize call.


def _forbid_portable_hif8(monkeypatch):
    """Make the portable HiF8 quantizer and the emulated backend's quantize raise when called."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the npu backend must quantize HiF8 with torch_npu, not the portable codec")

    for owner, names in ((HiF8Quantizer, ("quantize", "quantize_dual")),
                         (emulated.EmulatedBackend, ("quantize", "quantize_dual"))):
        for name in names:
            monkeypatch.setattr(owner, name, forbidden)


def _npu_quantize_call(x_spec, scales_shape, axis):
    return CallRecord("npu_quantize", {"self": x_spec, "scales": spec(F32, scales_shape), "zero_points": None,
                                       "dtype": HIFLOAT8, "axis": axis, "div_mode": True})


def _grouped_master():
    return torch.randn(E, N, K).transpose(-1, -2)  # the GMM view [E, K, N] of an FP32 master [E, N, K]


# name: (quantizer, tensor, orientation or "dual", amax factor (None: computed), group_list, expected call)
HIF8_QUANTIZE = {
    "fprop-input": (HI, lambda: torch.randn(M, K, dtype=BF16), "row", None, None,
                    _npu_quantize_call(spec(F32, (M, K)), (1,), -1)),
    "input-1d": (HI, lambda: torch.randn(K, dtype=torch.float16), "col", None, None,
                       _npu_quantize_call(spec(F32, (K,)), (1,), -1)),
    "gradient": (GRAD, lambda: torch.randn(M, N, dtype=BF16), "col", None, None,
                 _npu_quantize_call(spec(F32, (M, N)), (1,), -1)),
    "grouped-gradient": (GRAD, lambda: torch.randn(T, N, dtype=BF16), "col", None, COUNTS,
                         _npu_quantize_call(spec(F32, (T, N)), (1,), -1)),
    "dense-weight": (HI, lambda: torch.randn(N, K), "dual", 2.0, None,
                     _npu_quantize_call(spec(F32, (N, K)), (1,), -1)),
    "grouped-weight": (HI, _grouped_master, "dual", 1.5, None,
                       _npu_quantize_call(spec(F32, (E, K, N), (0, 2, 1)), (E,), 0)),
}


@pytest.mark.parametrize("case", HIF8_QUANTIZE)
def test_hif8_quantize_is_one_npu_quantize_call_with_our_scale(fake_npu, monkeypatch, case):
    """Inputs (amax → 15), gradients (→ 224), dense and grouped weights with a given amax (e.g. the MAX
    over an FSDP group; per expert for [E, K, N]): one call, FP32 input, our FP32 scale, ``axis`` -1
    (per tensor) or 0 (per group), ``div_mode=True``; the operand equals the portable quantizer's."""
    quantizer, make, orientation, amax_factor, counts, expected = HIF8_QUANTIZE[case]
    x = make()
    group_list = None if counts is None else torch.tensor(counts)
    amax = None if amax_factor is None else quantizer.compute_amax(x) * amax_factor
    if orientation == "dual":
        reference = quantizer.quantize_dual(x, amax=amax)
    else:
        reference = (quantizer.quantize(x, orientation=orientation, group_list=group_list, amax=amax),)
    _forbid_portable_hif8(monkeypatch)
    with use_backend("npu"):
        if orientation == "dual":
            got = quantize_dual(quantizer, x, amax=amax)
        else:
            got = (quantize(quantizer, x, orientation=orientation, group_list=group_list, amax=amax),)
    assert fake_npu.calls == [expected]
    (x_passed, scales_passed, *_), _ = fake_npu.calls[0].raw
    scale = quantizer.scale_from_amax(quantizer.compute_amax(x) if amax is None else amax)
    assert torch.equal(scales_passed, scale.reshape(-1)) and torch.equal(x_passed, x.float())
    for ours, ref in zip(got, reference):
        _same_operand(ours, ref)
        assert ours.format_max == quantizer.format_max and ours.group_list is group_list
    if orientation == "dual":
        assert got[1].data is got[0].data and got[1].scale is got[0].scale


@pytest.mark.parametrize(
    "make",
    [lambda: torch.zeros(M, K), lambda: torch.full((M, K), 1e-44), lambda: torch.randn(M, K) * 1e-30,
     lambda: torch.randn(M, K) * torch.where(torch.rand(M, K) < 0.01, 1e4, 1.0), lambda: torch.empty(0, K),
     lambda: torch.randn(E, 3, 5) * torch.tensor([0.0, 1e-3, 1.0, 1e3]).reshape(E, 1, 1)],
    ids=["zeros", "amax-underflows", "tiny", "outliers", "empty", "per-group-incl-zero"],
)
@pytest.mark.parametrize("quantizer", [HI, GRAD], ids=["format_max-15", "format_max-224"])
def test_hif8_npu_operands_equal_the_emulated_ones_through_the_fake(fake_npu, make, quantizer):
    """Scale fall-backs (amax 0, amax / format_max underflowing to 0: scale 1.0) and extreme ranges.
    The fake divides with correctly rounded FP32 division (its docstring): equality here pins our
    side of the contract; whether the 950's ≤ 1-ulp division agrees is the A5 system test's."""
    x = make()
    with use_backend("npu"):
        got = quantize(quantizer, x, orientation="row")
    _same_operand(got, quantize(quantizer, x, orientation="row", backend="emulated"))
    assert [c.name for c in fake_npu.calls] == ["npu_quantize"]


def test_hif8_quantize_argument_errors_on_the_npu_backend(fake_npu):
    with use_backend("npu"):
        with pytest.raises(TypeError, match=r"amax must be a tensor of shape \(\), got \(2,\)"):
            quantize(HI, torch.randn(M, K), orientation="row", amax=torch.ones(2))
        with pytest.raises(TypeError, match=r"amax must be a tensor of shape \(4,\), got float"):
            quantize_dual(HI, torch.randn(E, 3, 5), amax=1.0)
        with pytest.raises(ValueError, match=r"1-D, 2-D \(per-tensor scale\) or 3-D \(per-group scale\), got shape"):
            quantize(HI, torch.randn(2, 2, 2, 2), orientation="row")
        with pytest.raises(TypeError, match="tensor dtype torch.int64 is not a high-precision dtype"):
            quantize(HI, torch.ones(M, K, dtype=torch.int64), orientation="row")
    assert fake_npu.calls == []


# ------------------------------------------------------------------------------------------------
# Capability gate.

TORCH_RELEASE = Version(torch.__version__).public
INSTALL = re.escape("pip install torch==2.13.0 torch-npu==2.13.0")
FORMATS = ("mxfp8_e4m3", "hif8")


def _fails(fmt, pattern):
    """The gate, the auto choice on an NPU device and an explicit npu choice all fail with ``pattern``."""
    with pytest.raises(LowPrecisionUnsupportedError, match=pattern):
        check_npu_capability(fmt)
    with pytest.raises(LowPrecisionUnsupportedError, match=pattern):  # auto on an NPU device never emulates
        resolve_backend(fmt, "npu:0")
    with pytest.raises(LowPrecisionUnsupportedError, match=pattern):
        resolve_backend(fmt, "cpu", backend="npu")


def _failed(fmt):
    """The gate's failing checks (a failing stage ends the list)."""
    return [c for c in npu.npu_gate_checks(fmt) if not c.ok]


@pytest.mark.parametrize(("fmt", "dtype"), [(f, d) for f in FORMATS for d in npu.REQUIRED_DTYPES[f]])
def test_a_missing_required_dtype_fails_naming_it(install_fake_npu, monkeypatch, fmt, dtype):
    module, _, attribute = dtype.partition(".")
    if module == "torch":
        monkeypatch.delattr(torch, attribute)
        install_fake_npu()
    else:
        install_fake_npu(missing=(attribute,))
    _fails(fmt, rf"needs {re.escape(dtype)}, missing from torch .* run {INSTALL}")
    assert [(c.name, c.seen) for c in _failed(fmt)] == [(f"dtype {dtype}", "missing")]


@pytest.mark.parametrize(("fmt", "op"), [(f, op) for f in FORMATS for op in npu.REQUIRED_OPS[f]])
def test_a_missing_required_op_fails_naming_it(install_fake_npu, fmt, op):
    install_fake_npu(missing=(op,))
    _fails(fmt, rf"needs the op torch_npu\.{op}, missing in torch_npu 2\.13\.0; run {INSTALL}")
    assert [(c.name, c.seen) for c in _failed(fmt)] == [(f"op {op}", "missing")]


def test_every_missing_op_is_listed_and_each_format_checks_only_its_own(install_fake_npu):
    install_fake_npu(missing=("npu_dynamic_mx_quant", "npu_grouped_matmul"))
    assert [c.name for c in _failed("mxfp8_e4m3")] == ["op npu_dynamic_mx_quant", "op npu_grouped_matmul"]
    assert [c.name for c in _failed("hif8")] == ["op npu_grouped_matmul"]
    install_fake_npu(missing=("npu_dynamic_mx_quant", "npu_grouped_dynamic_mx_quant"))  # HiF8 needs no MX quant
    check_npu_capability("hif8")
    install_fake_npu(missing=("npu_quantize",))  # HiF8's quant with a given scale; MXFP8 does not use it
    check_npu_capability("mxfp8_e4m3")
    assert [(c.name, c.seen) for c in _failed("hif8")] == [("op npu_quantize", "missing")]


def test_an_op_whose_schema_lacks_a_keyword_fails_naming_it(install_fake_npu):
    """torch_npu 2.7.1.post6's real schema of npu_grouped_dynamic_mx_quant has no scale_alg (RCEIL)."""
    old = load_schemas(DATA / "torch_npu_2.7.1.post6_schemas.txt")
    install_fake_npu(schemas={**SCHEMAS.schemas, **old.schemas})
    _fails("mxfp8_e4m3", r"passes scale_alg to torch_npu\.npu_grouped_dynamic_mx_quant, whose schema in torch_npu "
           rf"2\.13\.0 lacks it; run {INSTALL}")
    assert [(c.name, c.seen) for c in _failed("mxfp8_e4m3")] == [("op npu_grouped_dynamic_mx_quant", "lacks scale_alg")]
    check_npu_capability("hif8")


def test_an_op_without_a_schema_is_not_taken_for_a_torch_npu_op(fake_npu, monkeypatch):
    monkeypatch.setattr(fake_npu, "npu_quant_matmul", lambda *args, **kwargs: None)
    _fails("hif8", r"needs the op torch_npu\.npu_quant_matmul, no op schema in torch_npu 2\.13\.0")


@pytest.mark.parametrize(
    ("version", "message", "failed"),
    [
        ("2.7.1.post6", rf"needs torch_npu >= 2\.7\.1\.post8 .* found 2\.7\.1\.post6; install a newer pair, e.g. {INSTALL}",
         ("torch_npu version", "2.7.1.post6")),
        ("2.7.1.post26.0.0", rf"torch_npu.__version__ '2\.7\.1\.post26\.0\.0' is not a PEP 440 version; .*{INSTALL}",
         ("torch_npu version", "2.7.1.post26.0.0")),
        ("2.12.0", rf"torch_npu 2\.12\.0 is built for torch 2\.12 but torch {re.escape(torch.__version__)} is "
                   rf"installed; install a matching pair, e.g. {INSTALL}",
         ("torch_npu matches torch", f"torch_npu 2.12.0, torch {torch.__version__}")),
    ],
    ids=["too-old", "not-pep440", "other-torch-line"],
)
def test_a_wrong_torch_npu_version_fails_with_both_versions_and_the_fix(install_fake_npu, version, message, failed):
    install_fake_npu(version=version)
    for fmt in FORMATS:
        _fails(fmt, message)
    assert [(c.name, c.seen) for c in _failed("hif8")] == [failed]


@pytest.mark.parametrize(
    ("kwargs", "message", "failed"),
    [
        ({"device_name": "Ascend910B1"}, r"needs an Ascend950 \(Ascend A5\) SoC; .* is 'Ascend910B1'",
         ("SoC Ascend950", "Ascend910B1")),
        ({"available": False}, r"needs an NPU device; torch_npu\.npu\.is_available\(\) is False",
         ("NPU device", "none")),
    ],
    ids=["soc", "no-device"],
)
def test_the_device_must_be_an_ascend_950(install_fake_npu, kwargs, message, failed):
    install_fake_npu(**kwargs)
    for fmt in FORMATS:
        _fails(fmt, message)
    assert [(c.name, c.seen) for c in _failed("hif8")] == [failed]


def test_a_device_query_that_raises_is_reported(fake_npu, monkeypatch):
    def broken(device=None):
        raise RuntimeError("drvGetDevNum failed")

    monkeypatch.setattr(fake_npu.npu, "get_device_name", broken)
    _fails("hif8", r"could not query the NPU \(RuntimeError: drvGetDevNum failed\)")


def test_the_gate_lists_every_check_in_order_with_what_it_saw(install_fake_npu, no_torch_npu):
    assert npu.npu_gate_checks("hif8") == (
        GateCheck("torch_npu installed", "not installed", False, npu.npu_capability_error("hif8")),
    )
    assert "not installed: pip install torch==2.13.0 torch-npu==2.13.0" in npu.npu_capability_error("hif8")
    install_fake_npu()
    checks = npu.npu_gate_checks("mxfp8_e4m3")
    assert [(c.name, c.seen, c.ok, c.message) for c in checks] == [
        ("torch_npu installed", "installed", True, None),
        ("torch_npu version", "2.13.0", True, None),
        ("torch_npu matches torch", f"torch_npu 2.13.0, torch {torch.__version__}", True, None),
        ("dtype torch.float8_e4m3fn", "present", True, None),
        ("dtype torch_npu.float8_e8m0fnu", "present", True, None),
        ("NPU device", "available", True, None),
        ("SoC Ascend950", "Ascend950PR_9579", True, None),
        *[(f"op {op}", "present", True, None) for op in npu.REQUIRED_OPS["mxfp8_e4m3"]],
    ]
    assert npu.npu_gate_checks("mxfp8_e4m3") is checks  # cached
    assert [c.name for c in npu.npu_gate_checks("hif8")][3:] == [
        "dtype torch_npu.hifloat8", "NPU device", "SoC Ascend950", "op npu_quantize", "op npu_quant_matmul",
        "op npu_grouped_matmul",
    ]
    assert resolve_backend("hif8", "npu:0") == "npu" and resolve_backend("hif8", "cpu") == "emulated"


def test_a_format_without_npu_kernels_is_refused(fake_npu):
    toy = type("ToySpec", (type(HI.format),), {"name": "toy"})()
    assert npu.npu_gate_checks(toy) == (GateCheck("npu backend kernels", "toy", False, npu.npu_capability_error(toy)),)
    _fails(toy, r"the npu backend has no kernels for format 'toy'; it implements \['hif8', 'mxfp8_e4m3'\]")


# ------------------------------------------------------------------------------------------------
# No fallback.


def test_a_failing_npu_op_propagates_without_any_fallback(fake_npu, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("aclnnQuantMatmulV5 failed: unsupported shape")

    def forbidden(*args, **kwargs):
        raise AssertionError("the emulated backend must not run when the npu backend was selected")

    check_npu_capability("mxfp8_e4m3")  # the startup gate passed; the op fails at run time
    monkeypatch.setattr(fake_npu, "npu_quant_matmul", broken)
    monkeypatch.setattr(emulated.EmulatedBackend, "matmul", forbidden)
    left, right = _dense("mx", "NT")
    with record_gemms() as events, pytest.raises(RuntimeError, match="aclnnQuantMatmulV5 failed"):
        low_precision_matmul(left, right, layout="NT", output_dtype=BF16, backend="npu")
    assert events == []


def test_a_mis_shaped_npu_result_is_refused(fake_npu, monkeypatch):
    check_npu_capability("hif8")
    real = fake_npu.npu_quant_matmul
    monkeypatch.setattr(fake_npu, "npu_quant_matmul", lambda *a, **k: real(*a, **k).float())
    left, right = _dense("hif8", "NT")
    expected = r"returned \(80, 100\) torch.float32, but the contract is \(80, 100\) torch.bfloat16"
    with pytest.raises(RuntimeError, match=expected):
        low_precision_matmul(left, right, layout="NT", output_dtype=BF16, backend="npu")


def test_a_torch_npu_that_fails_to_import_is_not_reported_as_missing(monkeypatch):
    """An installed torch_npu whose import fails (CANN libraries not on the path) names the error and the fix."""
    import importlib.abc

    class BrokenTorchNpu(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch_npu":
                raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")
            return None

    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "meta_path", [BrokenTorchNpu(), *sys.meta_path])
    npu.clear_capability_cache()
    message = npu.npu_capability_error("hif8")
    assert "installed but fails to import" in message and "libhccl.so" in message and "set_env.sh" in message
    assert "not installed" not in message
    with pytest.raises(LowPrecisionUnsupportedError, match="fails to import"):
        resolve_backend("hif8", "npu:0")


# ------------------------------------------------------------------------------------------------
# A low-precision training step on the npu backend: every quantise and GEMM is a torch_npu call.


def _step(fmt):
    """Dense linear and routed-expert SwiGLU, forward and backward (weights built from FP32 masters)."""
    recipe = recipe_for(fmt)
    dense = QuantizedWeightTensor.from_master(torch.randn(N, K) * 0.05, recipe=recipe, kind="dense",
                                              requires_grad=True)
    gate_up = QuantizedWeightTensor.from_master(torch.randn(E, 2 * 48, K) * 0.05, recipe=recipe, kind="grouped",
                                                requires_grad=True)
    down = QuantizedWeightTensor.from_master(torch.randn(E, K, 48) * 0.05, recipe=recipe, kind="grouped",
                                             requires_grad=True)
    x = torch.randn(M, K, dtype=BF16, requires_grad=True)
    x_T = torch.randn(T, K, dtype=BF16, requires_grad=True)
    y = low_precision_linear(x, dense, recipe=recipe)
    y_T = low_precision_grouped_swiglu(x_T, torch.tensor(COUNTS), gate_up, down, recipe=recipe)
    (y.float().square().mean() + y_T.float().square().mean()).backward()
    return [y, y_T, x.grad, x_T.grad, dense.grad, gate_up.grad, down.grad]


def test_a_hif8_step_quantizes_and_multiplies_only_through_torch_npu(fake_npu, monkeypatch):
    """Weights, activations, SwiGLU intermediates and gradients are quantised by ``npu_quantize`` (the
    portable quantizer and the emulated backend's quantize raise if called), every GEMM is an npu one,
    and the step equals the emulated one bit for bit (through the fake, see its docstring)."""
    torch.manual_seed(0)
    with use_backend("emulated"):
        reference = _step("hif8")
    fake_npu.calls.clear()
    _forbid_portable_hif8(monkeypatch)
    torch.manual_seed(0)
    with use_backend("npu"), record_gemms() as events:
        got = _step("hif8")
    assert [e.backend for e in events] == ["npu"] * 9  # dense fprop/dgrad/wgrad, six grouped GEMMs
    names = [c.name for c in fake_npu.calls]
    # 3 weights (one dual call each), x and dy of the dense linear, x, h, dy and dgu of the SwiGLU.
    counts = {name: names.count(name) for name in set(names)}
    assert counts == {"npu_quantize": 9, "npu_quant_matmul": 3, "npu_grouped_matmul": 6}
    for ours, ref in zip(got, reference, strict=True):
        assert torch.equal(ours, ref)
