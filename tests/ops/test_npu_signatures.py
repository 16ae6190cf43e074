"""The fake torch_npu and the npu backend's calls against the real torch_npu 2.13.0 op schemas.

Source: the PyPI wheel ``torch_npu-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl`` (``torch-npu==2.13.0``,
``git_version`` c798c6532a0d05c1863489e83cb7e3985be4e830), file
``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``: the ``func:`` lines of the ops the
npu backend calls are vendored verbatim in ``data/torch_npu_2.13.0_schemas.txt`` and parsed with
torch's own schema parser (``torch._C.parse_schema``). Checked here:

- every fake op's Python signature equals its schema (argument names and order, keyword-only-ness,
  defaults with their types);
- every call the npu backend makes (dense and grouped fprop/dgrad/wgrad and every quantise path,
  for MXFP8 and HiF8) passes only arguments its schema has, the keywords ``REQUIRED_OPS`` declares
  per format (what the startup gate checks on the installed torch_npu) are exactly the ones the
  backend passes, and each call replays through the torch dispatcher against the real schema:
  argument kinds and types are accepted, every argument arrives as passed (by schema name, whether
  the dispatcher forwards it positionally or not), and a ``torch.dtype`` given to an ``int`` dtype
  argument arrives as its ScalarType id (``torch.bfloat16`` → 15, ``torch.float8_e4m3fn`` → 24), the ids
  the op-plugin reads (``op_plugin/meta/_meta_registrations.py``);
- the fake's ScalarType-id table equals the dispatcher's conversion.
"""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

from fake_torch_npu import OPS, SCALAR_TYPE_IDS, SCHEMAS, SCHEMAS_2_13_0, FakeTorchNpu, dtype_id
from lp_lightning.formats import HiF8Quantizer, MXFP8Quantizer
from lp_lightning.ops import low_precision_grouped_matmul, low_precision_matmul, quantize, quantize_dual, use_backend
from lp_lightning.ops.npu import REQUIRED_OPS, clear_capability_cache

NAMESPACE = "lp_torch_npu_2_13_0"
NO_DEFAULT = "<no default>"


def test_the_excerpt_names_its_source_and_covers_every_op_the_backend_calls():
    assert (SCHEMAS.version, SCHEMAS.wheel, SCHEMAS.file, SCHEMAS.git_version) == (
        "2.13.0",
        "torch_npu-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl",
        "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml",
        "c798c6532a0d05c1863489e83cb7e3985be4e830",
    )
    assert SCHEMAS_2_13_0.name == "torch_npu_2.13.0_schemas.txt"
    assert set(SCHEMAS.schemas) == set(OPS) == {op for ops in REQUIRED_OPS.values() for op in ops}


def _default(value):
    return NO_DEFAULT if value is inspect.Parameter.empty else (type(value), value)


@pytest.mark.parametrize("op", OPS)
def test_every_fake_op_signature_equals_the_real_schema(op):
    fake_op = getattr(FakeTorchNpu(), op)
    assert fake_op.default._schema is SCHEMAS.schemas[op]  # what the gate reads, like a torch.ops packet
    parameters = inspect.signature(fake_op.impl).parameters.values()
    fake = [(p.name, p.kind is inspect.Parameter.KEYWORD_ONLY, _default(p.default)) for p in parameters]
    real = [
        (a.name, a.kwarg_only, _default(a.default_value) if a.has_default_value() else NO_DEFAULT)
        for a in SCHEMAS.schemas[op].arguments
    ]
    assert fake == real
    assert all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in parameters)


# ------------------------------------------------------------------------------------------------
# Every backend call, replayed through the dispatcher against the real schemas.

M, K, N = 70, 64, 40
COUNTS = [30, 0, 45, 21]
T, E = sum(COUNTS), len(COUNTS)
QUANTIZERS = {  # (input/weight, gradient)
    "mxfp8_e4m3": (MXFP8Quantizer(), MXFP8Quantizer()),
    "hif8": (HiF8Quantizer(format_max=15.0), HiF8Quantizer(format_max=224.0)),
}


def _run_every_npu_path(fmt: str) -> None:
    """Quantise through the npu backend (single, dual, grouped) and run the six GEMMs of api.py's table."""
    q, q_grad = QUANTIZERS[fmt]
    group_list = torch.tensor(COUNTS)
    bf16 = torch.bfloat16
    x, w, dy = torch.randn(M, K, dtype=bf16), torch.randn(N, K), torch.randn(M, N, dtype=bf16)
    x_T, dy_T, w_E = torch.randn(T, K, dtype=bf16), torch.randn(T, N, dtype=bf16), torch.randn(E, K, N, dtype=bf16)
    with use_backend("npu"):
        w_row, w_col = quantize_dual(q, w)
        low_precision_matmul(quantize(q, x, orientation="row"), w_row, layout="NT", output_dtype=torch.bfloat16)
        dy_row, dy_col = quantize(q_grad, dy, orientation="row"), quantize(q_grad, dy, orientation="col")
        low_precision_matmul(dy_row, w_col, layout="NN", output_dtype=torch.bfloat16)
        low_precision_matmul(dy_col, quantize(q, x, orientation="col"), layout="TN", output_dtype=torch.float32)
        wE_row, wE_col = quantize_dual(q, w_E)
        x_row = quantize(q, x_T, orientation="row")
        low_precision_grouped_matmul(x_row, wE_col, group_list, layout="NN", output_dtype=torch.bfloat16)
        dyT_row = quantize(q_grad, dy_T, orientation="row")
        low_precision_grouped_matmul(dyT_row, wE_row, group_list, layout="NT", output_dtype=torch.bfloat16)
        x_cols = quantize(q, x_T, orientation="col", group_list=group_list)
        dy_cols = quantize(q_grad, dy_T, orientation="col", group_list=group_list)
        low_precision_grouped_matmul(x_cols, dy_cols, group_list, layout="TN", output_dtype=torch.float32)


@pytest.fixture(scope="module")
def backend_calls():
    """``{format: [CallRecord, ...]}`` of every npu path, each format on a fresh fake."""
    calls, saved = {}, sys.modules.get("torch_npu")
    try:
        for fmt in QUANTIZERS:
            fake = sys.modules["torch_npu"] = FakeTorchNpu()
            clear_capability_cache()
            _run_every_npu_path(fmt)
            calls[fmt] = list(fake.calls)
    finally:
        sys.modules.pop("torch_npu")
        if saved is not None:
            sys.modules["torch_npu"] = saved
        clear_capability_cache()
    return calls


@pytest.fixture(scope="module")
def dispatcher_ops():
    """The vendored schemas registered as real torch ops whose kernels capture what they receive."""
    received: list[tuple[str, tuple, dict]] = []
    library = torch.library.Library(NAMESPACE, "DEF")

    def kernel_for(name: str, schema: torch._C.FunctionSchema):
        def kernel(*args, **kwargs):
            received.append((name, args, kwargs))
            outputs = [[] if str(r.type).startswith("List") else torch.empty(0) for r in schema.returns]
            return outputs[0] if len(outputs) == 1 else tuple(outputs)

        return kernel

    for name, line in SCHEMAS.lines.items():
        library.define(line)
        library.impl(name, kernel_for(name, SCHEMAS.schemas[name]), "CompositeExplicitAutograd")
    library.define("dtype_probe(int? value) -> Tensor")
    library.impl("dtype_probe", lambda value=None: torch.tensor(value), "CompositeExplicitAutograd")
    yield getattr(torch.ops, NAMESPACE), received
    library._destroy()


def test_the_backend_calls_every_required_op_with_exactly_the_declared_keywords(backend_calls):
    for fmt, calls in backend_calls.items():
        passed: dict[str, set[str]] = {}
        for call in calls:
            passed.setdefault(call.name, set()).update(call.raw[1])
        assert passed == {op: set(keywords) for op, keywords in REQUIRED_OPS[fmt].items()}, fmt


def test_every_backend_call_passes_only_schema_arguments(backend_calls):
    for fmt, calls in backend_calls.items():
        assert calls, f"{fmt}: no torch_npu call was recorded"
        for call in calls:
            schema = SCHEMAS.schemas[call.name]
            positional = [a.name for a in schema.arguments if not a.kwarg_only]
            keywords = {a.name for a in schema.arguments if a.kwarg_only}
            args, kwargs = call.raw
            assert len(args) <= len(positional), (fmt, call.name)
            assert set(kwargs) <= keywords | set(positional[len(args):]), (fmt, call.name, set(kwargs) - keywords)


def _by_name(schema: torch._C.FunctionSchema, args: tuple, kwargs: dict) -> dict:
    """Arguments by schema name, the defaults of those not given filled in (the dispatcher may pass a
    positional-or-keyword argument either way, and drops one equal to its default)."""
    bound = {**dict(zip([a.name for a in schema.arguments], args)), **kwargs}
    return {a.name: bound.get(a.name, a.default_value if a.has_default_value() else None) for a in schema.arguments}


def test_every_backend_call_replays_through_the_dispatcher_against_the_real_schema(backend_calls, dispatcher_ops):
    ops, received = dispatcher_ops
    for fmt, calls in backend_calls.items():
        for call in calls:
            args, kwargs = call.raw
            received.clear()
            getattr(ops, call.name)(*args, **kwargs)  # raises on any argument the real schema refuses
            [(name, got_args, got_kwargs)] = received
            assert name == call.name
            schema = SCHEMAS.schemas[name]
            sent, got = _by_name(schema, args, kwargs), _by_name(schema, got_args, got_kwargs)
            for key, value in sent.items():
                if key.endswith("dtype") or key == "dst_type":  # `int` in the schema: the op receives an id
                    assert got[key] == dtype_id(value, key) and isinstance(got[key], (int, type(None))), (fmt, key)
                elif isinstance(value, torch.Tensor):
                    assert got[key] is value, (fmt, name, key)
                elif not isinstance(value, (list, tuple)):
                    assert got[key] == value, (fmt, name, key, got[key], value)


def test_the_fake_dtype_ids_are_the_dispatcher_conversion(dispatcher_ops):
    ops, _ = dispatcher_ops
    for dtype, scalar_type_id in SCALAR_TYPE_IDS.items():
        assert int(ops.dtype_probe(value=dtype)) == scalar_type_id, dtype
