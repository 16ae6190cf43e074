"""Persistent low-precision weights (design spec §7.2–7.3, §10, §11, §13.4; requirement R1 (docs/design.md), R8, R9).

Checks the storage against the quantizers bit for bit, that ``select`` is a view (never a
quantisation), the dispatch rule of ``lp_lightning.tensor.weight`` (aliases, fresh shards,
in-place optimizer ops on the master, GEMM refusal, unknown structural ops), AdamW on the wrapper,
and ``finalize_low_precision_weights`` (FQNs, sharing, ``requires_grad``, plain state dict that
loads with ``weights_only=True``).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from lp_lightning.formats import QuantizationRole, recipe_for
from lp_lightning.formats.spec import WeightKind
from lp_lightning.fsdp.gather import GatherPolicy
from lp_lightning.fsdp.weights import finalize_low_precision_weights, iter_low_precision_weights, low_precision_param_names, register_low_precision_params
from lp_lightning.tensor import GatheredWeightTensor, QuantizedWeightTensor, is_master_of, storage_spec, total_refresh_count
from lp_lightning.tensor.weight import _WeightState



FORMATS = ("mxfp8_e4m3", "hif8")
SHAPES = {"dense": (64, 96), "grouped": (3, 64, 96)}


def _weight(fmt: str, kind: str, **kw) -> QuantizedWeightTensor:
    return QuantizedWeightTensor.from_master(torch.randn(SHAPES[kind]), recipe=fmt, kind=kind, fqn=f"{kind}.w", **kw)


def _reference_storage(master: torch.Tensor, fmt: str, kind: str) -> dict[str, torch.Tensor]:
    """Storage composed by hand from the recipe's WEIGHT quantizer (dense: w_NK; grouped: GMM view w_EKN)."""
    view = master if kind == "dense" else master.transpose(-1, -2)
    quantizer = recipe_for(fmt).quantizer(QuantizationRole.WEIGHT_FWD)
    if fmt == "mxfp8_e4m3":
        row, col = quantizer.quantize_dual(view)
        return {"row_data": row.data, "row_scale": row.scale, "col_data": col.data, "col_scale": col.scale}
    op = quantizer.quantize(view, orientation="row")
    return {"data": op.data, "scale": op.scale}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


# ------------------------------------------------------------------------------------------------
# Storage and select.


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["dense", "grouped"])
def test_storage_is_the_recipe_quantization_of_the_master_bit_for_bit(fmt, kind):
    w = _weight(fmt, kind)
    assert (w.refresh_count, w.is_built, tuple(w.shape), w.dtype) == (1, True, SHAPES[kind], torch.float32)
    spec = storage_spec(fmt, kind, SHAPES[kind])
    storage = w.low_precision_storage
    assert list(storage) == list(spec)
    for name, (shape, dtype) in spec.items():
        assert tuple(storage[name].shape) == shape and storage[name].dtype == dtype, name
    ref = _reference_storage(w.master, fmt, kind)
    for name, tensor in ref.items():
        assert _bits_equal(storage[name], tensor.contiguous()), name


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["dense", "grouped"])
def test_select_is_a_view_of_the_storage_never_a_quantization(fmt, kind):
    w = _weight(fmt, kind)
    before = total_refresh_count()
    gemm_shape = SHAPES[kind] if kind == "dense" else (3, 96, 64)  # grouped: GMM view [E, K, N]
    for orientation in ("row", "col", "row"):
        op = w.select(orientation)
        assert op.orientation == orientation and tuple(op.data.shape) == gemm_shape
        assert op.logical_dtype == torch.float32 and op.format.name == fmt
        name = f"{orientation}_data" if fmt == "mxfp8_e4m3" else "data"
        assert op.data.data_ptr() == w.low_precision_storage[name].data_ptr()
    assert total_refresh_count() == before and w.refresh_count == 1
    if fmt == "hif8":  # one data copy serves both orientations (design spec §7.3)
        assert w.select("row").data is w.select("col").data and w.select("row").format_max == 15.0
    else:  # the two MX copies are different bytes
        assert w.select("row").data.data_ptr() != w.select("col").data.data_ptr()


def test_select_rejects_integer_indexing_and_bad_orientations():
    w = _weight("hif8", "dense")
    with pytest.raises(TypeError, match="one orientation"):
        w.select(0, 1)
    with pytest.raises(ValueError, match="legal values: 'row', 'col'"):
        w.select("rows")


def test_dequantized_operands_are_close_to_the_master():
    # Sanity of the composition (not a numerics test): relative error below the format's epsilon scale.
    for fmt, bound in (("mxfp8_e4m3", 2.0**-3), ("hif8", 2.0**-2)):
        w = _weight(fmt, "grouped")
        deq = w.select("col").dequantize().transpose(-1, -2)
        err = (deq - w.master).norm() / w.master.norm()
        assert err < bound, (fmt, float(err))


# ------------------------------------------------------------------------------------------------
# Dispatch rule.


def test_aliases_share_the_weight_state_and_fresh_ops_are_unbuilt():
    w = _weight("hif8", "dense")
    p = nn.Parameter(w)
    assert isinstance(p, QuantizedWeightTensor) and isinstance(p, nn.Parameter) and p.requires_grad
    for alias in (p.detach(), p.view_as(p), p.view(64, 96), p.data, torch.as_strided(p, p.shape, p.stride())):
        assert isinstance(alias, QuantizedWeightTensor) and alias._state is p._state
    p.detach().refresh_from_master()
    assert p.refresh_count == 2
    fresh = [p.narrow(0, 0, 32), *torch.chunk(p, 2), *p.split([16, 48]), p.new_zeros(4, 96), torch.empty_like(p)]
    for t in fresh:
        assert isinstance(t, QuantizedWeightTensor) and not t.is_built and t._state is not p._state
        assert t.fqn == "dense.w" and t.recipe is p.recipe
    assert is_master_of(fresh[0].master, w) is False and torch.equal(fresh[0].master, w.master[:32])
    with pytest.raises(ValueError, match="not built"):
        fresh[0].select("row")


def test_reshaping_view_and_compute_ops_return_plain_tensors_of_the_master():
    w = _weight("mxfp8_e4m3", "dense")
    flat = w.view(-1)
    assert type(flat) is torch.Tensor and flat.data_ptr() == w.master.data_ptr()
    zeros = torch.zeros_like(w)  # AdamW's exp_avg / exp_avg_sq must be plain tensors
    assert type(zeros) is torch.Tensor and zeros.dtype == torch.float32
    assert type(w.abs()) is torch.Tensor and torch.equal(w.abs(), w.master.abs())
    assert float(w.norm()) == float(w.master.norm())
    as_f64 = w.to(torch.float64)
    assert type(as_f64) is torch.Tensor and torch.equal(as_f64, w.master.double())


def test_gemms_on_the_wrapper_raise_instead_of_running_in_high_precision():
    w = _weight("mxfp8_e4m3", "dense")
    x = torch.randn(4, 96)
    for call in (lambda: torch.mm(w, x.t()), lambda: torch.addmm(torch.zeros(64, 4), w, x.t()), lambda: torch.matmul(w, x.t())):
        with pytest.raises(TypeError, match="high-precision GEMM"):
            call()
    with pytest.raises(NotImplementedError) as info:  # F.linear transposes the weight first
        nn.functional.linear(x, w)
    assert info.value.args[0] == torch.ops.aten.t.default and "select(orientation)" in info.value.args[2]


def test_unknown_structural_ops_raise_not_implemented():
    w = _weight("hif8", "dense")
    for call in (lambda: w.t(), lambda: w.transpose(0, 1), lambda: w.unsqueeze(0), lambda: w.permute(1, 0)):
        with pytest.raises(NotImplementedError) as info:
            call()
        assert info.value.args[1] is QuantizedWeightTensor
    with pytest.raises(NotImplementedError):
        w.detach().t_()  # metadata-changing in-place op


def test_in_place_ops_update_the_master_and_keep_the_storage_until_refresh():
    w = _weight("mxfp8_e4m3", "dense")
    master_before = w.master.clone()
    storage_before = {k: v.clone() for k, v in w.low_precision_storage.items()}
    other = torch.randn(3)
    with torch.no_grad():
        assert w.mul_(0.5) is w
        w.add_(1.0)
        torch._foreach_add_([w, other], 2.0)  # a list mixing the wrapper and a plain tensor
        w.copy_(w.master * 2)  # copy_ from a plain tensor
    assert torch.equal(w.master, (master_before * 0.5 + 1.0 + 2.0) * 2)
    for name, tensor in w.low_precision_storage.items():
        assert _bits_equal(tensor, storage_before[name]), name  # no refresh happened
    w.refresh_from_master()
    ref = _reference_storage(w.master, "mxfp8_e4m3", "dense")
    assert all(_bits_equal(w.low_precision_storage[n], ref[n]) for n in ref) and w.refresh_count == 2


@pytest.mark.parametrize("foreach", [False, True])
def test_adamw_updates_the_fp32_master_exactly_like_a_plain_parameter(foreach):
    master = torch.randn(64, 96)
    plain = nn.Parameter(master.clone())
    lp = nn.Parameter(QuantizedWeightTensor.from_master(master.clone(), recipe="hif8", kind="dense"))
    opt_plain = torch.optim.AdamW([plain], lr=1e-2, weight_decay=0.1, foreach=foreach)
    opt_lp = torch.optim.AdamW([lp], lr=1e-2, weight_decay=0.1, foreach=foreach)
    for _ in range(2):
        grad = torch.randn(64, 96)
        plain.grad, lp.grad = grad.clone(), grad.clone()
        opt_plain.step()
        opt_lp.step()
    assert torch.equal(lp.master, plain.detach())
    state = opt_lp.state[lp]
    for key in ("exp_avg", "exp_avg_sq"):
        assert type(state[key]) is torch.Tensor and state[key].dtype == torch.float32
        assert torch.equal(state[key], opt_plain.state[plain][key])
    assert lp.refresh_count == 1  # the optimizer never rebuilds the storage (design spec §10)


def test_clone_deepcopy_and_device_copy_keep_an_independent_built_weight():
    w = _weight("hif8", "grouped")
    for twin in (w.clone(), copy.deepcopy(w), w.to("cpu", copy=True)):
        assert isinstance(twin, QuantizedWeightTensor) and twin.is_built and twin._state is not w._state
        assert twin.master.data_ptr() != w.master.data_ptr() and torch.equal(twin.master, w.master)
        assert _bits_equal(twin.low_precision_storage["data"], w.low_precision_storage["data"])
    p = nn.Parameter(w)
    q = copy.deepcopy(p)
    assert isinstance(q, nn.Parameter) and isinstance(q, QuantizedWeightTensor) and q.requires_grad


def test_flatten_unflatten_round_trip_and_repr_come_from_the_declaration():
    w = _weight("mxfp8_e4m3", "grouped", gather_policy=GatherPolicy(reshard_after_forward=False))
    names, ctx = w.__tensor_flatten__()
    assert names == ["master", "storage_row_data", "storage_row_scale", "storage_col_data", "storage_col_scale"]
    inner = {n: getattr(w, n) for n in names}
    twin = QuantizedWeightTensor.__tensor_unflatten__(inner, ctx, w.shape, w.stride())
    assert twin.gather_policy == w.gather_policy and twin.fqn == w.fqn and twin.refresh_count == 1
    assert all(_bits_equal(twin.low_precision_storage[n], w.low_precision_storage[n]) for n in w.low_precision_storage)
    text = repr(w)
    for piece in ("QuantizedWeightTensor(", "kind='grouped'", "fqn='grouped.w'", "mxfp8_e4m3_mx_block",
                  "master=torch.float32[3, 64, 96]", "col_scale=torch.float8_e8m0fnu[3, 3, 64]", "refresh_count=1"):
        assert piece in text, piece
    assert "storage=<not built>" in repr(w.new_zeros(2, 64, 96))


def test_refresh_from_master_guards_its_source():
    w = _weight("hif8", "dense")
    w.refresh_from_master(w.master)
    w.refresh_from_master(w.master.view(64, 96))
    with pytest.raises(ValueError, match="not this weight's master"):
        w.refresh_from_master(w.master.clone())
    with pytest.raises(ValueError, match="not this weight's master"):
        w.refresh_from_master(w.select("row").dequantize())
    with pytest.raises(ValueError, match="only used by per-tensor scales"):
        _weight("mxfp8_e4m3", "dense").refresh_from_master(amax=torch.tensor(1.0))
    w.refresh_from_master(amax=torch.tensor(30.0))  # a MAX-reduced amax sets the scale (design spec §9.2)
    assert float(w.select("row").scale) == 2.0


def test_from_master_rejects_wrong_shapes_and_dtypes():
    with pytest.raises(ValueError, match="dense weight must be a 2-D"):
        QuantizedWeightTensor.from_master(torch.randn(2, 3, 4), recipe="hif8", kind="dense")
    with pytest.raises(ValueError, match="no empty dimension"):
        QuantizedWeightTensor.from_master(torch.randn(0, 4), recipe="hif8", kind="dense")
    with pytest.raises(TypeError, match="not float32"):
        QuantizedWeightTensor.from_master(torch.ones(2, 4, dtype=torch.int32), recipe="hif8", kind="dense")
    with pytest.raises(ValueError, match="legal values: 'dense', 'grouped'"):
        QuantizedWeightTensor.from_master(torch.randn(2, 4), recipe="hif8", kind="linear")
    with pytest.raises(ValueError, match="activation_checkpoint"):
        GatherPolicy(activation_checkpoint="selective")


# ------------------------------------------------------------------------------------------------
# GatheredWeightTensor rules.


def test_gathered_weight_allows_only_aliases_and_zero_gradients():
    w = _weight("mxfp8_e4m3", "dense")
    storage = {"row_data": w.low_precision_storage["row_data"], "row_scale": w.low_precision_storage["row_scale"]}
    g = GatheredWeightTensor(
        (64, 96), logical_dtype=torch.bfloat16, recipe=w.recipe, kind=WeightKind.DENSE, fqn="g",
        state=_WeightState(storage, 0, ("row",)), device=torch.device("cpu"),
    )
    assert g.select("row").logical_dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"carries only \('row',\)"):
        g.select("col")
    param = nn.Parameter(torch.as_strided(g, (64, 96), (96, 1), 0))  # what FSDP2 does with the output
    assert isinstance(param, GatheredWeightTensor) and param._state is g._state and param.requires_grad
    zeros = torch.zeros_like(param)
    assert type(zeros) is torch.Tensor and zeros.dtype == torch.bfloat16 and zeros.shape == (64, 96)
    with pytest.raises(TypeError, match="no high-precision"):
        param.sum()
    with pytest.raises(TypeError, match="high-precision GEMM"):
        torch.mm(param, torch.randn(96, 2, dtype=torch.bfloat16))
    with pytest.raises(NotImplementedError):
        param.t()


# ------------------------------------------------------------------------------------------------
# finalize_low_precision_weights.


class _DenseLP(nn.Module):
    low_precision_weight_names = ("weight",)
    low_precision_weight_kind = "dense"

    def __init__(self, n: int, k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, k))
        self.bias = nn.Parameter(torch.zeros(n))


class _ExpertsLP(nn.Module):
    def __init__(self, e: int, h: int, f: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * f, h))
        self.down_proj = nn.Parameter(torch.randn(e, h, f))


register_low_precision_params(_ExpertsLP, ("gate_up_proj", "down_proj"), "grouped")


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 32)
        self.proj = _DenseLP(64, 32)
        self.experts = _ExpertsLP(2, 32, 64)
        self.head = nn.Linear(32, 10)
        self.proj_alias = self.proj  # the same module under two FQNs


def _state_dict_summary(model: nn.Module) -> dict[str, tuple]:
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("fmt", FORMATS)
def test_finalize_keeps_fqns_keys_sharing_and_requires_grad(fmt):
    model = _Toy()
    model.experts.down_proj.requires_grad_(False)
    before_keys = _state_dict_summary(model)
    before_names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    before_values = {k: v.clone() for k, v in model.state_dict().items()}
    records = finalize_low_precision_weights(model, recipe=fmt)
    assert [r.fqn for r in records] == ["proj.weight", "experts.gate_up_proj", "experts.down_proj"]
    assert {r.kind for r in records} == {"dense", "grouped"} and all(r.format == fmt for r in records)
    assert [n for n, _ in model.named_parameters(remove_duplicate=False)] == before_names
    assert model.proj_alias.weight is model.proj.weight  # sharing kept
    assert isinstance(model.proj.weight, QuantizedWeightTensor) and model.proj.weight.requires_grad
    assert not model.experts.down_proj.requires_grad and isinstance(model.experts.down_proj, QuantizedWeightTensor)
    assert type(model.proj.bias) is nn.Parameter and type(model.head.weight) is nn.Parameter
    assert [fqn for fqn, _ in iter_low_precision_weights(model)] == [r.fqn for r in records]
    state = model.state_dict()
    assert _state_dict_summary(model) == before_keys
    for key, value in state.items():
        assert type(value) is torch.Tensor, key  # no subclass in the model view (design spec §11)
        assert torch.equal(value, before_values[key]), key
    assert model.state_dict(keep_vars=True)["proj.weight"] is model.proj.weight


def test_state_dict_saves_and_loads_with_weights_only_and_load_updates_the_master():
    model = _Toy()
    finalize_low_precision_weights(model, recipe="mxfp8_e4m3")
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert set(loaded) == set(model.state_dict())
    plain = _Toy()  # a model that was never converted loads the checkpoint as is
    plain.load_state_dict(loaded)
    assert torch.equal(plain.proj.weight, model.proj.weight.master)
    other = _Toy()
    finalize_low_precision_weights(other, recipe="mxfp8_e4m3")
    old_storage = other.proj.weight.low_precision_storage["row_data"].clone()
    other.load_state_dict(loaded)  # copies into the master; storage is rebuilt only by a refresh
    assert torch.equal(other.proj.weight.master, model.proj.weight.master)
    assert _bits_equal(other.proj.weight.low_precision_storage["row_data"], old_storage)
    other.proj.weight.refresh_from_master()
    assert _bits_equal(other.proj.weight.low_precision_storage["row_data"], model.proj.weight.low_precision_storage["row_data"])


def test_finalize_without_build_leaves_the_storage_to_the_first_refresh():
    model = _Toy()
    before = total_refresh_count()
    finalize_low_precision_weights(model, recipe="mxfp8_e4m3", build=False)
    assert total_refresh_count() == before and not model.proj.weight.is_built
    with pytest.raises(ValueError, match="refresh_low_precision_weights"):
        model.proj.weight.select("row")
    model.proj.weight.refresh_from_master()
    assert model.proj.weight.refresh_count == 1 and model.proj.weight.select("row").orientation == "row"


def test_finalize_upcasts_bf16_parameters_to_an_fp32_master():
    model = _Toy().to(torch.bfloat16)
    finalize_low_precision_weights(model, recipe="hif8")
    assert model.proj.weight.dtype == torch.float32 and model.proj.weight.master.dtype == torch.float32
    assert model.head.weight.dtype == torch.bfloat16


def test_finalize_errors_name_the_parameter_and_the_fix():
    model = _Toy()
    finalize_low_precision_weights(model, recipe="hif8")
    with pytest.raises(TypeError, match="proj.weight: already a low-precision weight"):
        finalize_low_precision_weights(model, recipe="hif8")
    with torch.device("meta"):
        meta = _Toy()
    with pytest.raises(ValueError, match="proj.weight: the parameter is on the meta device"):
        finalize_low_precision_weights(meta, recipe="hif8")
    broken = _Toy()
    del broken.proj.weight
    with pytest.raises(ValueError, match="proj.weight: _DenseLP declares low-precision parameter 'weight' but has none"):
        finalize_low_precision_weights(broken, recipe="hif8")
    mismatch = _Toy()
    mismatch.proj.recipe = recipe_for("mxfp8_e4m3")
    with pytest.raises(ValueError, match="computes with recipe 'mxfp8_e4m3_mx_block'"):
        finalize_low_precision_weights(mismatch, recipe="hif8")


def test_registry_resolution_and_conflicts():
    assert low_precision_param_names(_DenseLP(64, 32)) == (("weight",), WeightKind.DENSE)
    assert low_precision_param_names(_ExpertsLP(1, 2, 2)) == (("gate_up_proj", "down_proj"), WeightKind.GROUPED)
    assert low_precision_param_names(nn.Linear(2, 2)) is None
    register_low_precision_params(_ExpertsLP, ("gate_up_proj", "down_proj"), "grouped")  # same rule: fine
    with pytest.raises(ValueError, match="already registered"):
        register_low_precision_params(_ExpertsLP, ("down_proj",), "grouped")
    with pytest.raises(TypeError, match="nn.Module subclass"):
        register_low_precision_params(int, ("x",), "dense")
