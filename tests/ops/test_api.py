"""The GEMM interface: the orientation contract, errors, backend selection, GEMM and quantize trace
events and profiler ranges (design spec §8, §13.4, §16.2; requirement R6 (docs/design.md), R12)."""

from __future__ import annotations

import dataclasses
import importlib.abc
import subprocess
import sys
import textwrap

import pytest
import torch

from lp_lightning.formats import MXFP8Quantizer, recipe_for
from lp_lightning.formats.hif8 import HiF8Quantizer
from lp_lightning.ops import (
    GemmRole,
    LowPrecisionUnsupportedError,
    add_gemm_observer,
    add_quantize_observer,
    add_range_observer,
    current_gemm_role,
    current_weight_fqn,
    gemm_role,
    get_backend,
    low_precision_grouped_matmul,
    low_precision_matmul,
    quantize,
    quantize_dual,
    record_gemms,
    record_quantizes,
    resolve_backend,
    use_backend,
)

MX = MXFP8Quantizer()
HI = HiF8Quantizer(format_max=15.0)
GRAD = HiF8Quantizer(format_max=224.0)
M, K, N, E = 48, 64, 40, 3
GROUPS = torch.tensor([20, 0, 28])


def _q(fmt, x, orientation, group_list=None, grad=False):
    if fmt == "mxfp8":
        return MX.quantize(x, orientation=orientation, group_list=group_list)
    return (GRAD if grad else HI).quantize(x, orientation=orientation, group_list=group_list)


def _dense_case(fmt, role):
    """Operands of the dense contract table (api.py) for ``role``; returns (left, right, layout, out_shape)."""
    x, w, dy = torch.randn(M, K), torch.randn(N, K), torch.randn(M, N)
    if role == "fprop":
        return _q(fmt, x, "row"), _q(fmt, w, "row"), "NT", (M, N)
    if role == "dgrad":
        return _q(fmt, dy, "row", grad=True), _q(fmt, w, "col"), "NN", (M, K)
    return _q(fmt, dy, "col", grad=True), _q(fmt, x, "col"), "TN", (N, K)


def _grouped_case(fmt, role):
    x, w, dy = torch.randn(M, K), torch.randn(E, K, N), torch.randn(M, N)
    if role == "fprop":
        return _q(fmt, x, "row"), _q(fmt, w, "col"), "NN", (M, N)
    if role == "dgrad":
        return _q(fmt, dy, "row", grad=True), _q(fmt, w, "row"), "NT", (M, K)
    return _q(fmt, x, "col", GROUPS), _q(fmt, dy, "col", GROUPS, grad=True), "TN", (E, K, N)


@pytest.mark.parametrize("fmt", ["mxfp8", "hif8"])
@pytest.mark.parametrize("role", ["fprop", "dgrad", "wgrad"])
def test_contract_table_shapes_roles_and_trace(fmt, role):
    left, right, layout, shape = _dense_case(fmt, role)
    with record_gemms() as events, gemm_role(f"dense_{role}"):
        out = low_precision_matmul(left, right, layout=layout, output_dtype=torch.bfloat16)
    assert out.shape == shape and out.dtype == torch.bfloat16
    left, right, layout, shape = _grouped_case(fmt, role)
    with record_gemms() as grouped_events, gemm_role(f"grouped_{role}"):
        out = low_precision_grouped_matmul(left, right, GROUPS, layout=layout, output_dtype=torch.float32)
    assert out.shape == shape and out.dtype == torch.float32
    (dense_event,), (grouped_event,) = events, grouped_events
    assert dense_event.backend == "emulated" and grouped_event.backend == "emulated"
    assert dense_event.gemm_role == GemmRole(f"dense_{role}") and grouped_event.gemm_role == GemmRole(f"grouped_{role}")
    assert grouped_event.op == "low_precision_grouped_matmul" and grouped_event.num_groups == E
    assert grouped_event.format == ("mxfp8_e4m3" if fmt == "mxfp8" else "hif8")
    assert grouped_event.layout == layout and grouped_event.output_shape == shape
    assert grouped_event.left_shape == tuple(left.shape) and grouped_event.right_shape == tuple(right.shape)
    assert grouped_event.output_dtype == "torch.float32" and grouped_event.device == "cpu"


@pytest.mark.parametrize(
    ("role", "which", "bad"),
    [("fprop", "right", "col"), ("fprop", "left", "col"), ("dgrad", "right", "row"), ("wgrad", "left", "row")],
)
def test_mx_orientation_must_match_the_layout(role, which, bad):
    left, right, layout, _ = _dense_case("mxfp8", role)
    source = torch.randn(left.shape if which == "left" else right.shape)
    if which == "left":
        left = MX.quantize(source, orientation=bad)
    else:
        right = MX.quantize(source, orientation=bad)
    need = "row" if bad == "col" else "col"
    with pytest.raises(ValueError, match=rf"MXFP8 {which} operand must be '{need}'.*orientation='{need}'"):
        low_precision_matmul(left, right, layout=layout, output_dtype=torch.bfloat16)


def test_hif8_orientation_is_metadata_only():
    x, w = torch.randn(M, K), torch.randn(N, K)
    xq, wq = HI.quantize(x, orientation="row"), HI.quantize(w, orientation="row")
    a = low_precision_matmul(xq, wq, layout="NT", output_dtype=torch.float32)
    xc, wc = xq.with_orientation("col"), wq.with_orientation("col")
    b = low_precision_matmul(xc, wc, layout="NT", output_dtype=torch.float32)
    assert torch.equal(a, b)


def test_argument_errors_name_the_problem():
    x, w = torch.randn(M, K), torch.randn(N, K)
    xq, wq = MX.quantize(x, orientation="row"), MX.quantize(w, orientation="row")
    with pytest.raises(TypeError, match="right must be a QuantizedOperand"):
        low_precision_matmul(xq, w, layout="NT", output_dtype=torch.bfloat16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layout='TT'; legal values: 'NN', 'NT', 'TN'"):
        low_precision_matmul(xq, wq, layout="TT", output_dtype=torch.bfloat16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="output_dtype=torch.float8_e4m3fn"):
        low_precision_matmul(xq, wq, layout="NT", output_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="share one format"):
        low_precision_matmul(xq, HI.quantize(w, orientation="row"), layout="NT", output_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contraction dims must match"):
        wide = MX.quantize(torch.randn(N, K + 1), orientation="row")
        low_precision_matmul(xq, wide, layout="NT", output_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dense operands must be 2-D"):
        stacked = MX.quantize(torch.randn(E, N, K), orientation="row")
        low_precision_matmul(xq, stacked, layout="NT", output_dtype=torch.bfloat16)


def test_grouped_argument_errors():
    xq = MX.quantize(torch.randn(M, K), orientation="row")
    wq = MX.quantize(torch.randn(E, K, N), orientation="col")
    with pytest.raises(TypeError, match="group_list must be a 1-D torch.int64"):
        low_precision_grouped_matmul(xq, wq, GROUPS.int(), layout="NN", output_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="group_list has 2 entries"):
        low_precision_grouped_matmul(xq, wq, torch.tensor([20, 28]), layout="NN", output_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"group_list \[20, 0, 27\] sums to 47 rows but the operand has 48 token rows"):
        low_precision_grouped_matmul(xq, wq, torch.tensor([20, 0, 27]), layout="NN", output_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"group_list holds negative row counts \(group 1: -2\)"):
        low_precision_grouped_matmul(xq, wq, torch.tensor([50, -2, 0]), layout="NN", output_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"stacked weights \[E, K, N\]"):
        flat = MX.quantize(torch.randn(K, N), orientation="col")
        low_precision_grouped_matmul(xq, flat, GROUPS, layout="NN", output_dtype=torch.bfloat16)
    x_col = MX.quantize(torch.randn(M, K), orientation="col")
    dy_col = MX.quantize(torch.randn(M, N), orientation="col", group_list=GROUPS)
    with pytest.raises(ValueError, match="quantized without group_list"):
        low_precision_grouped_matmul(x_col, dy_col, GROUPS, layout="TN", output_dtype=torch.bfloat16)
    x_col = MX.quantize(torch.randn(M, K), orientation="col", group_list=torch.tensor([28, 0, 20]))
    with pytest.raises(ValueError, match=r"quantized with group_list \[28, 0, 20\] but the GEMM got \[20, 0, 28\]"):
        low_precision_grouped_matmul(x_col, dy_col, GROUPS, layout="TN", output_dtype=torch.bfloat16)


def test_declared_gemm_role_must_agree_with_the_call():
    left, right, layout, _ = _dense_case("hif8", "fprop")
    expected = "role 'dense_wgrad' needs a dense GEMM with layout 'TN'"
    with gemm_role("dense_wgrad"), pytest.raises(ValueError, match=expected):
        low_precision_matmul(left, right, layout=layout, output_dtype=torch.bfloat16)
    with gemm_role(GemmRole.GROUPED_FPROP), pytest.raises(ValueError, match="needs a grouped GEMM"):
        low_precision_matmul(left, right, layout=layout, output_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="legal values: 'dense_fprop'"):
        with gemm_role("fprop"):
            pass
    with record_gemms() as events:
        low_precision_matmul(left, right, layout=layout, output_dtype=torch.bfloat16)
    assert events[0].gemm_role is None
    assert [GemmRole(r).layout for r in ("dense_fprop", "dense_dgrad", "dense_wgrad")] == ["NT", "NN", "TN"]
    assert [GemmRole(r).layout for r in ("grouped_fprop", "grouped_dgrad", "grouped_wgrad")] == ["NN", "NT", "TN"]


def test_observers_are_read_only_removable_and_loud():
    left, right, layout, _ = _dense_case("hif8", "fprop")
    seen = []
    handle = add_gemm_observer(seen.append)
    out = low_precision_matmul(left, right, layout=layout, output_dtype=torch.bfloat16)
    handle.remove()
    handle.remove()  # idempotent
    low_precision_matmul(left, right, layout=layout, output_dtype=torch.bfloat16)
    assert len(seen) == 1
    with pytest.raises(AttributeError):
        seen[0].backend = "npu"  # frozen event
    assert not any(isinstance(getattr(seen[0], f.name), torch.Tensor) for f in dataclasses.fields(seen[0]))

    def broken(event):
        raise RuntimeError("probe failed")

    with add_gemm_observer(broken), pytest.raises(RuntimeError, match="probe failed"):
        low_precision_matmul(left, right, layout=layout, output_dtype=torch.bfloat16)
    assert out.shape == (M, N)
    with pytest.raises(TypeError, match="callable"):
        add_gemm_observer("not a function")  # type: ignore[arg-type]


def test_gemm_role_declares_the_weight_fqn_of_every_gemm():
    left, right, layout, _ = _dense_case("hif8", "wgrad")
    with record_gemms() as events:
        with gemm_role("dense_wgrad", weight_fqn="model.layers.0.mlp.down_proj.weight"):
            assert current_weight_fqn() == "model.layers.0.mlp.down_proj.weight"
            low_precision_matmul(left, right, layout=layout, output_dtype=torch.float32)
            with gemm_role("dense_wgrad", weight_fqn=""):  # nests; "" means unknown
                low_precision_matmul(left, right, layout=layout, output_dtype=torch.float32)
        low_precision_matmul(left, right, layout=layout, output_dtype=torch.float32)
    assert [e.weight_fqn for e in events] == ["model.layers.0.mlp.down_proj.weight", None, None]
    assert current_weight_fqn() is None and current_gemm_role() is None


@pytest.mark.parametrize("fmt", ["mxfp8", "hif8"])
def test_quantize_events_carry_role_fqn_tensors_and_amax(fmt):
    quantizer = MX if fmt == "mxfp8" else HI
    x, w = torch.randn(M, K), torch.randn(E, K, N)
    with record_quantizes() as events, gemm_role("grouped_fprop"):
        op = quantize(quantizer, x, orientation="row", group_list=GROUPS, role="input_fwd", weight_fqn="experts.w")
        amax = None if fmt == "mxfp8" else w.abs().amax(dim=(1, 2))
        row, col = quantize_dual(quantizer, w, amax=amax, role="weight", weight_fqn="experts.w")
    first, dual = events
    assert (first.op, first.backend, first.role, first.orientations, first.grouped) == (
        "quantize", "emulated", "input_fwd", ("row",), True)
    assert first.input is x and len(first.operands) == 1 and first.operands[0] is op and first.amax is None
    assert first.weight_fqn == "experts.w" and first.gemm_role is GemmRole.GROUPED_FPROP and first.device == "cpu"
    assert dual.op == "quantize_dual" and [o is r for o, r in zip(dual.operands, (row, col))] == [True, True]
    assert dual.orientations == ("row", "col")
    assert dual.input is w and dual.amax is amax and dual.grouped and dual.role == "weight"
    assert first.format == dual.format == ("mxfp8_e4m3" if fmt == "mxfp8" else "hif8")
    assert first.format_max == (None if fmt == "mxfp8" else 15.0)
    with pytest.raises(AttributeError):
        first.role = "grad_output"  # frozen event


def test_no_quantize_event_is_built_without_an_observer(monkeypatch):
    from lp_lightning.ops import trace

    def fail(**kwargs):
        raise AssertionError("a quantize event was built with no observer registered")

    monkeypatch.setattr(trace, "emit_quantize", fail)
    quantize(HI, torch.randn(M, K), orientation="row")
    quantize_dual(MX, torch.randn(N, K))
    with add_quantize_observer(lambda event: None), pytest.raises(AssertionError, match="no observer"):
        quantize(HI, torch.randn(M, K), orientation="row")


def test_profiler_ranges_only_while_the_profiler_records(monkeypatch):
    from torch.profiler import ProfilerActivity, profile

    left, right, layout, _ = _dense_case("mxfp8", "fprop")
    gl, gr, glayout, _ = _grouped_case("mxfp8", "fprop")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        quantize(MX, torch.randn(M, K), orientation="row")
        low_precision_matmul(left, right, layout=layout, output_dtype=torch.bfloat16)
        low_precision_grouped_matmul(gl, gr, GROUPS, layout=glayout, output_dtype=torch.bfloat16)
    names = [e.name for e in prof.events()]
    assert names.count("lp_lightning::quantize") == 1
    assert names.count("lp_lightning::matmul") == names.count("lp_lightning::grouped_matmul") == 1
    (mm_range,) = [e for e in prof.events() if e.name == "lp_lightning::matmul"]
    assert any(child.name == "aten::matmul" or child.name == "aten::mm" for child in mm_range.cpu_children)

    def fail(name):
        raise AssertionError(f"record_function({name!r}) opened with the profiler off")

    monkeypatch.setattr(torch.profiler, "record_function", fail)
    quantize(MX, torch.randn(M, K), orientation="row")
    low_precision_matmul(left, right, layout=layout, output_dtype=torch.bfloat16)


def test_range_observers_see_every_backend_call_begin_and_end_with_or_without_the_profiler(monkeypatch):
    from torch.profiler import ProfilerActivity, profile

    from lp_lightning.ops.emulated import EmulatedBackend

    left, right, layout, _ = _dense_case("mxfp8", "fprop")
    gl, gr, glayout, _ = _grouped_case("mxfp8", "fprop")
    ranges = []
    with add_range_observer(ranges.append):
        quantize(MX, torch.randn(M, K), orientation="row")
        quantize_dual(MX, torch.randn(N, K))
        low_precision_matmul(left, right, layout=layout, output_dtype=torch.bfloat16)
        with profile(activities=[ProfilerActivity.CPU]) as prof:  # both: the profiler range and the observers
            low_precision_grouped_matmul(gl, gr, GROUPS, layout=glayout, output_dtype=torch.bfloat16)

        def broken(*args, **kwargs):
            raise RuntimeError("backend failed")

        monkeypatch.setattr(EmulatedBackend, "matmul", broken)
        with pytest.raises(RuntimeError, match="backend failed"):  # a failing backend call still ends its range
            low_precision_matmul(left, right, layout=layout, output_dtype=torch.bfloat16)
    quantize(MX, torch.randn(M, K), orientation="row")  # removed: not seen
    q, mm, gmm = "lp_lightning::quantize", "lp_lightning::matmul", "lp_lightning::grouped_matmul"
    assert ranges == [(q, True), (q, False), (q, True), (q, False), (mm, True), (mm, False), (gmm, True),
                      (gmm, False), (mm, True), (mm, False)]
    assert [e.name for e in prof.events()].count(gmm) == 1


# ------------------------------------------------------------------------------------------------
# Backend selection.


def test_backend_selection_precedence(no_torch_npu):
    """An explicit backend (a recipe's), else the innermost use_backend block, else the device's; no process global."""
    left, right, layout, _ = _dense_case("hif8", "fprop")
    assert get_backend() == "auto"
    assert resolve_backend("hif8", torch.device("cpu")) == "emulated"
    with pytest.raises(LowPrecisionUnsupportedError, match="torch_npu"):  # auto on an NPU device: never emulated
        resolve_backend("hif8", "npu:0")
    not_installed = r"needs torch_npu, which is not installed: pip install torch==2\.13\.0 torch-npu==2\.13\.0"
    with pytest.raises(LowPrecisionUnsupportedError, match=not_installed):
        low_precision_matmul(left, right, layout=layout, output_dtype=torch.bfloat16, backend="npu")
    with use_backend("npu"):
        with pytest.raises(LowPrecisionUnsupportedError, match=not_installed):
            low_precision_matmul(left, right, layout=layout, output_dtype=torch.bfloat16)
        with pytest.raises(LowPrecisionUnsupportedError, match=not_installed):  # "auto" (a recipe's default) too
            low_precision_matmul(left, right, layout=layout, output_dtype=torch.bfloat16, backend="auto")
        with use_backend("emulated"):
            assert get_backend() == "emulated"
            with record_gemms() as events:
                low_precision_matmul(left, right, layout=layout, output_dtype=torch.bfloat16)
            assert events[0].backend == "emulated"
            with pytest.raises(LowPrecisionUnsupportedError):
                low_precision_matmul(left, right, layout=layout, output_dtype=torch.bfloat16, backend="npu")
        assert get_backend() == "npu"
    assert get_backend() == "auto"
    with pytest.raises(ValueError, match="backend='cuda'; legal values: 'auto', 'emulated', 'npu'"):
        with use_backend("cuda"):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError, match="backend='cpu'"):
        low_precision_matmul(
            left, right, layout=layout, output_dtype=torch.bfloat16, backend="cpu"  # type: ignore[arg-type]
        )


def test_a_recipe_carries_its_backend_to_every_op(no_torch_npu):
    """recipe_for(format, backend): one shared copy per backend; its quantisations and GEMMs go to that backend."""
    from lp_lightning.functional import low_precision_linear
    from lp_lightning.tensor import QuantizedWeightTensor

    auto = recipe_for("hif8")
    emulated = recipe_for("hif8", "emulated")
    assert auto.backend == "auto" and emulated.backend == "emulated" and recipe_for("hif8", "emulated") is emulated
    assert emulated.quantizers == auto.quantizers and emulated.name == auto.name and recipe_for("hif8", "auto") is auto
    npu = recipe_for("hif8", "npu")
    weight = QuantizedWeightTensor.from_master(torch.randn(N, K), recipe=emulated, kind="dense")
    with use_backend("npu"), record_gemms() as events:  # the recipe's explicit choice wins over the block
        low_precision_linear(torch.randn(M, K), weight, recipe=emulated)
    assert [e.backend for e in events] == ["emulated"]
    with pytest.raises(LowPrecisionUnsupportedError, match="torch_npu"):
        QuantizedWeightTensor.from_master(torch.randn(N, K), recipe=npu, kind="dense")  # its refresh runs on the npu backend


class _ForbidTorchNpu(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.attempts = 0

    def find_spec(self, name, path, target=None):
        if name == "torch_npu" or name.startswith("torch_npu."):
            self.attempts += 1
        return None


def test_auto_on_cpu_never_tries_to_import_torch_npu(monkeypatch):
    finder = _ForbidTorchNpu()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    recipe = recipe_for("mxfp8_e4m3")
    x = recipe.quantizer("input_fwd").quantize(torch.randn(M, K), orientation="row")
    w = recipe.quantizer("weight_fwd").quantize(torch.randn(N, K), orientation="row")
    low_precision_matmul(x, w, layout="NT", output_dtype=torch.bfloat16)
    recipe_for("mxfp8_e4m3", "npu")  # naming the backend alone imports nothing
    with use_backend("npu"):
        pass
    assert finder.attempts == 0 and "torch_npu" not in sys.modules


def test_importing_the_package_does_not_import_torch_npu():
    code = textwrap.dedent(
        """
        import sys
        import lp_lightning, lp_lightning.formats, lp_lightning.ops
        import lp_lightning.ops.npu, lp_lightning.ops.emulated, lp_lightning.ops.backend
        assert "torch_npu" not in sys.modules, "torch_npu was imported"
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_gemm_operand_events_carry_the_operands_and_result_only_while_observed():
    from lp_lightning.formats.operand import QuantizationRole
    from lp_lightning.formats.registry import format_spec
    from lp_lightning.ops import add_gemm_operands_observer, gemm_role, low_precision_matmul, quantize
    from lp_lightning.ops import trace

    spec = format_spec("mxfp8_e4m3")
    quantizer = spec.recipe.quantizer(QuantizationRole.INPUT_FWD)
    x, w = quantize(quantizer, torch.randn(4, 64), orientation="row"), quantize(quantizer, torch.randn(8, 64), orientation="row")
    assert not trace.gemm_operands_observed()
    events = []
    with add_gemm_operands_observer(events.append), gemm_role("dense_fprop", weight_fqn="layer.weight"):
        out = low_precision_matmul(x, w, layout="NT", output_dtype=torch.float32)
    low_precision_matmul(x, w, layout="NT", output_dtype=torch.float32)  # after remove(): no event
    (event,) = events
    assert event.left is x and event.right is w and event.output is out and event.group_list is None
    assert (event.layout, event.gemm_role.value, event.weight_fqn, event.backend) == ("NT", "dense_fprop", "layer.weight", "emulated")
