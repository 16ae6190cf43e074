"""A fake ``torch_npu`` for CPU tests of the npu backend (design spec §16.2: fake operators record calls).

``FakeTorchNpu`` is a module object to install as ``sys.modules["torch_npu"]``. Its ops have the
real calling convention of torch_npu 2.13.0: each op's Python signature equals the op's schema in
``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`` of the PyPI wheel (vendored excerpt:
``data/torch_npu_2.13.0_schemas.txt``; ``test_npu_signatures.py`` checks the two agree), and the op
object carries that schema at ``op.default._schema`` like a ``torch.ops`` packet, which the
capability gate reads. Each op:

1. records a ``CallRecord``: the op name and every argument that was passed, tensors reduced to
   ``TensorSpec(dtype, shape, dim_order)`` (``dim_order`` lists dims from the largest stride to
   the smallest, so a transposed view of a contiguous ``[a, b]`` tensor is ``(1, 0)``), plus the
   raw arguments (not compared) for replaying the call through the torch dispatcher;
2. reads its ``int`` dtype arguments as the real op receives them (the dispatcher turns a
   ``torch.dtype`` into its ScalarType id, ``SCALAR_TYPE_IDS``) and checks the argument values the
   fake understands (anything else raises ``NotImplementedError``, so the backend cannot silently
   pass something the fake does not model); an input dtype the op's docs do not allow raises
   ``RuntimeError``, as the real op refuses it;
3. answers through lp-lightning's *emulated* backend: the NPU scale layout is read back with the
   documented index rule ``scale_for_block[b] = npu_scale[..., b // 2, ..., b % 2]`` (written here
   independently of ``lp_lightning.ops.npu``'s converters), the padding codes are checked to be 0,
   the operands are rebuilt as ``QuantizedOperand``s and ``EmulatedBackend`` computes the result.
   MX quant ops return their scales as ``uint8``, as the real ones do (their docs and meta
   registrations). ``npu_quantize`` (HiF8 only) returns ``hif8.encode(x / scale)`` as ``uint8``
   (the op-plugin's carrier of ``torch_npu.hifloat8``, ``QuantizeKernelNpuOpApi.cpp``): the
   division is correctly rounded FP32 division and the cast our codec, so it equals the
   ``HiF8Quantizer``'s codes for the same scale. The Ascend 950 kernel divides with
   ``DivSpecificMode{precisionMode = false}`` (≤ 1 ulp) and casts with ``SatMode::SAT`` (ops-nn
   ``quant/quantize/op_kernel/arch35/quantize_per_tensor_no_offset_regbase.h``, ``quantize.h``):
   whether its codes differ next to a HiF8 rounding boundary, or for ±Inf/NaN inputs, is for the
   A5 system test to settle (docs/formats.md §3.3), not something this fake can show.

The fake's numbers are the emulation's numbers, never a statement about hardware accuracy (design spec
§16.2). Capability attributes: ``__version__`` (default ``"2.13.0"``), ``hifloat8 = 290``,
``float8_e8m0fnu = 293`` (docs/formats.md §3.1), ``npu.is_available()``, ``npu.get_device_name()``;
any of them and any op can be left out with ``missing=``, and ``schemas=`` replaces op schemas (to
model an older release).
"""

from __future__ import annotations

import inspect
import math
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lp_lightning.formats import hif8, mxfp8
from lp_lightning.formats.operand import QuantizedOperand
from lp_lightning.ops.emulated import BACKEND as EMULATED

HIFLOAT8 = 290
FLOAT8_E8M0FNU = 293
BLOCK = 32
MX_MODE = (FLOAT8_E8M0FNU, FLOAT8_E8M0FNU, [1, 1, BLOCK])  # scale_dtype, pertoken_scale_dtype, group_sizes

SCALAR_TYPE_IDS: dict[torch.dtype, int] = {
    torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4, torch.float16: 5,
    torch.float32: 6, torch.float64: 7, torch.bool: 11, torch.bfloat16: 15, torch.float8_e5m2: 23,
    torch.float8_e4m3fn: 24, torch.float8_e8m0fnu: 44,
}
"""c10::ScalarType ids: what an op receives for a ``torch.dtype`` passed to an ``int`` schema
argument (``test_npu_signatures.py`` checks this table against the dispatcher)."""

OUTPUT_DTYPES = {5: torch.float16, 6: torch.float32, 15: torch.bfloat16}
E4M3_IDS = (24, 292)  # torch.float8_e4m3fn, torch_npu.float8_e4m3fn
"""Excerpts of ``TORCH_DTYPE_ENUM_VALUE_TO_SCALAR_TYPE_MAP`` (torch_npu 2.13.0
``op_plugin/meta/_meta_registrations.py``): the GEMM output dtypes and the E4M3 ``dst_type`` ids."""

DATA = Path(__file__).resolve().parent / "data"
SCHEMAS_2_13_0 = DATA / "torch_npu_2.13.0_schemas.txt"


@dataclass(frozen=True)
class SchemaExcerpt:
    """Op schemas vendored from a torch_npu wheel, with the header that says where they come from."""

    version: str
    wheel: str
    file: str
    git_version: str
    lines: dict[str, str]
    schemas: dict[str, torch._C.FunctionSchema]


def load_schemas(path: Path) -> SchemaExcerpt:
    """Parse a vendored excerpt: ``# key: value`` header lines, then one schema line per op."""
    header, lines = {}, {}
    for raw in path.read_text().splitlines():
        if raw.startswith("# torch_npu "):
            header["version"] = raw.removeprefix("# torch_npu ")
        elif raw.startswith("# "):
            key, sep, value = raw[2:].partition(": ")
            if sep:
                header[key] = value.split(" (")[0]
        elif raw.strip():
            lines[raw.split("(", 1)[0]] = raw
    schemas = {name: torch._C.parse_schema(f"npu::{line}") for name, line in lines.items()}
    return SchemaExcerpt(header["version"], header["wheel"], header["file"], header["git_version"], lines, schemas)


SCHEMAS = load_schemas(SCHEMAS_2_13_0)


def dtype_id(value: Any, name: str) -> int | None:
    """An ``int``-typed dtype argument as the op receives it: an int stays, a ``torch.dtype`` becomes
    its ScalarType id (the dispatcher's conversion), None stays None."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, torch.dtype) and value in SCALAR_TYPE_IDS:
        return SCALAR_TYPE_IDS[value]
    raise TypeError(f"fake torch_npu: {name}={value!r} is neither an int nor a torch.dtype it models")


def _check_input(op: str, x: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    """The input dtypes an MX quant op's docs allow; the real op refuses others (modelled as RuntimeError)."""
    if x.dtype not in dtypes:
        raise RuntimeError(f"fake torch_npu: {op} takes input of {dtypes} (its docs), got {x.dtype}")


def _output_dtype(value: Any) -> torch.dtype:
    output = OUTPUT_DTYPES.get(dtype_id(value, "output_dtype"))
    if output is None:
        raise NotImplementedError(f"fake torch_npu: output_dtype={value!r}; the GEMMs model float16/bfloat16/float32")
    return output


@dataclass(frozen=True)
class TensorSpec:
    """What a call record keeps of a tensor argument."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    dim_order: tuple[int, ...]


def spec(dtype: torch.dtype, shape: tuple[int, ...], dim_order: tuple[int, ...] | None = None) -> TensorSpec:
    """Expected ``TensorSpec`` for tests; ``dim_order`` defaults to contiguous."""
    return TensorSpec(dtype, tuple(shape), tuple(range(len(shape))) if dim_order is None else tuple(dim_order))


def _dim_order(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), d)))


def _normalise(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorSpec(value.dtype, tuple(value.shape), _dim_order(value))
    if isinstance(value, (list, tuple)):
        return tuple(_normalise(v) for v in value)
    return value


@dataclass(frozen=True)
class CallRecord:
    """One fake op call: its name, the arguments passed (normalised) and, not compared, the raw ones."""

    name: str
    args: dict[str, Any]
    raw: tuple[tuple, dict] = field(default=((), {}), compare=False, repr=False)


def _is_transposed(t: torch.Tensor) -> bool:
    """True for a view whose last two dims are swapped relative to its storage order."""
    order = _dim_order(t)
    return t.dim() >= 2 and order[-2:] == (t.dim() - 1, t.dim() - 2)


def _blocks_from_pairs(pairs_u8: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``pairs [P, X, 2]`` → per-block ``[num_blocks, X]`` by ``out[b] = pairs[b // 2, :, b % 2]``.

    Checks that the slot padding an odd block count holds code 0 (docs/formats.md §2).
    """
    if num_blocks % 2 and pairs_u8.shape[0]:
        pad = pairs_u8[num_blocks // 2, :, 1]
        if bool((pad != 0).any()):
            raise AssertionError("fake torch_npu: the padding slot of an odd MX block count must be code 0")
    b = torch.arange(num_blocks)
    return pairs_u8[b // 2, :, b % 2]


def _pairs_from_blocks(blocks_u8: torch.Tensor) -> torch.Tensor:
    """Per-block ``[nb, X]`` → ``pairs [ceil(nb/2), X, 2]``, padding slot code 0."""
    nb, width = blocks_u8.shape
    out = blocks_u8.new_zeros((math.ceil(nb / 2), width, 2))
    for b in range(nb):
        out[b // 2, :, b % 2] = blocks_u8[b]
    return out


def _u8(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise NotImplementedError(f"fake torch_npu: MX scale dtype {scale.dtype}")
    return scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale


def _e8m0(u8: torch.Tensor) -> torch.Tensor:
    return u8.contiguous().view(torch.float8_e8m0fnu)


def _operand(data, scale, fmt, orientation, group_list=None) -> QuantizedOperand:
    return QuantizedOperand(
        data=data, scale=scale, logical_dtype=torch.bfloat16, format=fmt, orientation=orientation, group_list=group_list
    )


def _uniform(scale_vec: torch.Tensor, what: str) -> torch.Tensor:
    """The single value of a broadcast per-tensor scale vector (0-d)."""
    if scale_vec.numel() == 0:
        return torch.ones((), dtype=torch.float32)
    if not bool((scale_vec == scale_vec.reshape(-1)[0]).all()):
        raise NotImplementedError(f"fake torch_npu: {what} must repeat one per-tensor scale")
    return scale_vec.reshape(-1)[0].clone()


class FakeOp:
    """A fake op as torch_npu exposes one: callable, recording, with the real schema at ``.default._schema``.

    Attributes:
        impl: The Python implementation, whose signature mirrors the schema.
        default: Namespace holding ``_schema`` (a ``torch._C.FunctionSchema``, or None when the
            modelled release has no schema for the op).
    """

    def __init__(self, fake: FakeTorchNpu, name: str, impl: Callable, schema: torch._C.FunctionSchema | None):
        self.__name__ = name
        self._fake = fake
        self.impl = impl
        self.default = types.SimpleNamespace(_schema=schema)

    def __call__(self, *args, **kwargs):
        bound = inspect.signature(self.impl).bind(*args, **kwargs)
        passed = {k: _normalise(v) for k, v in bound.arguments.items()}
        self._fake.calls.append(CallRecord(self.__name__, passed, (args, kwargs)))
        return self.impl(*args, **kwargs)


def pack_grouped_pairs(blocks_u8: torch.Tensor, counts: list[int], tokens: int) -> torch.Tensor:
    """Ours ``[sum_g ceil(n_g/32), C]`` → NPU grouped ``[T // 64 + G, C, 2]`` (GroupedDynamicMxQuant:
    each group's blocks padded to an even count, groups packed in order, unused rows code 0)."""
    out = torch.zeros((tokens // (2 * BLOCK) + len(counts), blocks_u8.shape[1], 2), dtype=torch.uint8)
    row, block = 0, 0
    for count in counts:
        nb = math.ceil(count / BLOCK)
        pairs = _pairs_from_blocks(blocks_u8[block: block + nb])
        out[row: row + pairs.shape[0]] = pairs
        row, block = row + pairs.shape[0], block + nb
    return out


def unpack_grouped_pairs(pairs_u8: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """NPU grouped ``[P, C, 2]`` → ours ``[sum_g ceil(n_g/32), C]``; unused rows must be code 0."""
    pieces, row = [], 0
    for count in counts:
        nb = math.ceil(count / BLOCK)
        pairs = math.ceil(nb / 2)
        pieces.append(_blocks_from_pairs(pairs_u8[row: row + pairs], nb))
        row += pairs
    if bool((pairs_u8[row:] != 0).any()):
        raise AssertionError("fake torch_npu: unused grouped MX scale rows must be code 0")
    return torch.cat(pieces) if pieces else pairs_u8.new_zeros((0, pairs_u8.shape[1]))


def pairs_along(scale_u8: torch.Tensor, axis: int) -> torch.Tensor:
    """Ours → NPU pairs along ``axis`` (−1: ``[..., R, nb] → [..., R, P, 2]``; −2: ``[..., nb, C] →
    [..., P, C, 2]`` interleaved), built element by element from ``out[p, :, j] = ours[2p + j]``."""
    if axis == -1:
        flat = scale_u8.reshape(-1, scale_u8.shape[-1]).T  # [nb, rows]
        pairs = _pairs_from_blocks(flat)  # [P, rows, 2]
        return pairs.transpose(0, 1).reshape(*scale_u8.shape[:-1], pairs.shape[0], 2).contiguous()
    lead = scale_u8.shape[:-2]
    per = [_pairs_from_blocks(m) for m in scale_u8.reshape(-1, *scale_u8.shape[-2:])]
    return torch.stack(per).reshape(*lead, *per[0].shape).contiguous()


OPS = (
    "npu_quant_matmul",
    "npu_grouped_matmul",
    "npu_dynamic_mx_quant",
    "npu_dynamic_mx_quant_with_dual_axis",
    "npu_grouped_dynamic_mx_quant",
    "npu_quantize",
)
"""The ops the fake models (every op ``lp_lightning.ops.npu`` calls)."""


class FakeTorchNpu(types.ModuleType):
    """Recording fake of the torch_npu ops the npu backend uses (see the module docstring)."""

    def __init__(
        self,
        *,
        device_name: str = "Ascend950PR_9579",
        available: bool = True,
        missing: tuple[str, ...] = (),
        version: str = "2.13.0",
        schemas: Mapping[str, torch._C.FunctionSchema] | None = None,
    ) -> None:
        super().__init__("torch_npu")
        self.__version__ = version
        self.calls: list[CallRecord] = []
        schemas = SCHEMAS.schemas if schemas is None else schemas
        attributes: dict[str, Any] = {"hifloat8": HIFLOAT8, "float8_e8m0fnu": FLOAT8_E8M0FNU}
        for name in OPS:
            attributes[name] = FakeOp(self, name, getattr(self, f"_{name}"), schemas.get(name))
        for name, value in attributes.items():
            if name not in missing:
                setattr(self, name, value)
        self.npu = types.SimpleNamespace(
            is_available=lambda: available,
            get_device_name=lambda device=None: device_name,
        )

    # -- quant matmul ------------------------------------------------------------------------------

    def _npu_quant_matmul(self, x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                          x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None,
                          group_sizes=None, y_scale=None):
        if offset is not None or bias is not None or y_scale is not None:
            raise NotImplementedError("fake torch_npu: offset/bias/y_scale unsupported")
        output = _output_dtype(output_dtype)
        x1_dtype, x2_dtype = dtype_id(x1_dtype, "x1_dtype"), dtype_id(x2_dtype, "x2_dtype")
        scale_dtype = dtype_id(scale_dtype, "scale_dtype")
        pertoken_scale_dtype = dtype_id(pertoken_scale_dtype, "pertoken_scale_dtype")
        left_t, right_t = _is_transposed(x1), _is_transposed(x2)
        left_data = x1.transpose(-2, -1) if left_t else x1
        right_data = x2.transpose(-2, -1) if right_t else x2
        layout = ("T" if left_t else "N") + ("T" if right_t else "N")
        if x1_dtype == HIFLOAT8 and x2_dtype == HIFLOAT8:
            if scale.shape != (1,) or pertoken_scale.shape != (1,) or scale.dtype != torch.float32:
                raise NotImplementedError("fake torch_npu: HiF8 T-T mode takes FP32 scales of shape (1,)")
            fmt = "hif8"
            left = _operand(left_data, pertoken_scale.reshape(()), fmt, "col" if left_t else "row")
            right = _operand(right_data, scale.reshape(()), fmt, "row" if right_t else "col")
        elif (scale_dtype, pertoken_scale_dtype, list(group_sizes or ())) == MX_MODE:
            k = x1.shape[-1]
            nb = math.ceil(k / BLOCK)
            # pertoken_scale is (m, ceil(k/64), 2): element (i, kk) uses [i, kk // 64, (kk // 32) % 2].
            left_blocks = _blocks_from_pairs(_u8(pertoken_scale).transpose(0, 1), nb)  # [nb, m]
            # scale is (ceil(k/64), n, 2): element (kk, j) uses [kk // 64, j, (kk // 32) % 2].
            right_blocks = _blocks_from_pairs(_u8(scale), nb)  # [nb, n]
            fmt = "mxfp8_e4m3"
            left = (_operand(left_data, _e8m0(left_blocks), fmt, "col") if left_t
                    else _operand(left_data, _e8m0(left_blocks.T), fmt, "row"))
            right = (_operand(right_data, _e8m0(right_blocks.T), fmt, "row") if right_t
                     else _operand(right_data, _e8m0(right_blocks), fmt, "col"))
        else:
            raise NotImplementedError("fake torch_npu: only MX (E8M0, group_sizes [1,1,32]) and HiF8 T-T modes")
        return EMULATED.matmul(left, right, layout, output)

    # -- grouped matmul ----------------------------------------------------------------------------

    def _npu_grouped_matmul(self, x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                            antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                            activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
                            group_list_type=0, act_type=0, tuning_config=None, output_dtype=None, x_dtype=None,
                            weight_dtype=None, scale_dtype=None, per_token_scale_dtype=None):
        kwargs = dict(bias=bias, scale=scale, offset=offset, antiquant_scale=antiquant_scale,
                      antiquant_offset=antiquant_offset, per_token_scale=per_token_scale, group_list=group_list,
                      activation_input=activation_input, activation_quant_scale=activation_quant_scale,
                      activation_quant_offset=activation_quant_offset, split_item=split_item, group_type=group_type,
                      group_list_type=group_list_type, act_type=act_type, tuning_config=tuning_config,
                      output_dtype=output_dtype, x_dtype=x_dtype, weight_dtype=weight_dtype,
                      scale_dtype=scale_dtype, per_token_scale_dtype=per_token_scale_dtype)
        unmodelled = ("bias", "offset", "antiquant_scale", "antiquant_offset", "activation_input",
                      "activation_quant_scale", "activation_quant_offset", "tuning_config")
        unsupported = [k for k in unmodelled if kwargs[k] is not None]
        if unsupported or split_item != 3 or group_list_type != 1 or group_type not in (0, 2) or act_type != 0:
            raise NotImplementedError(f"fake torch_npu: unsupported grouped matmul arguments {unsupported or kwargs}")
        output = _output_dtype(output_dtype)
        x_dtype, weight_dtype = dtype_id(x_dtype, "x_dtype"), dtype_id(weight_dtype, "weight_dtype")
        scale_dtype = dtype_id(scale_dtype, "scale_dtype")
        per_token_scale_dtype = dtype_id(per_token_scale_dtype, "per_token_scale_dtype")
        (x,), (weight,), (scale,), (per_token_scale,) = x, weight, scale, per_token_scale
        counts = [int(c) for c in group_list.tolist()]
        hif8 = x_dtype == HIFLOAT8 and weight_dtype == HIFLOAT8
        mx = scale_dtype == FLOAT8_E8M0FNU and per_token_scale_dtype == FLOAT8_E8M0FNU
        if hif8 == mx:
            raise NotImplementedError("fake torch_npu: need either HiF8 x/weight dtypes or E8M0 scale dtypes")
        fmt = "hif8" if hif8 else "mxfp8_e4m3"
        if group_type == 2:  # split K (wgrad): x is a transposed view [K, T], weight [T, N]
            if not _is_transposed(x) or _is_transposed(weight):
                raise NotImplementedError("fake torch_npu: split-K expects x transposed, weight not")
            x_rows = x.transpose(0, 1)
            if hif8:
                left = _operand(x_rows, _uniform(per_token_scale, "per_token_scale"), fmt, "col")
                right = _operand(weight, _uniform(scale, "scale"), fmt, "col")
            else:
                left = _operand(x_rows, _e8m0(unpack_grouped_pairs(_u8(per_token_scale).transpose(0, 1), counts)),
                                fmt, "col", group_list)
                right = _operand(weight, _e8m0(unpack_grouped_pairs(_u8(scale), counts)), fmt, "col", group_list)
            return [EMULATED.grouped_matmul(left, right, group_list, "TN", output)]
        # split M (fprop / dgrad): x [T, k]; weight [E, k, n], a transposed view for dgrad.
        weight_t = _is_transposed(weight)
        w_data = weight.transpose(-2, -1) if weight_t else weight
        if hif8:
            left = _operand(x, _uniform(per_token_scale, "per_token_scale"), fmt, "row")
            right = _operand(w_data, scale.reshape(-1), fmt, "row" if weight_t else "col")
        else:
            nb = math.ceil(x.shape[-1] / BLOCK)
            left = _operand(x, _e8m0(_blocks_from_pairs(_u8(per_token_scale).transpose(0, 1), nb).T), fmt, "row")
            # scale is (E, ceil(k/64), n, 2): element (e, kk, j) uses [e, kk // 64, j, (kk // 32) % 2].
            w_blocks = torch.stack([_blocks_from_pairs(_u8(scale[e]), nb) for e in range(scale.shape[0])])  # [E, nb, n]
            right = (_operand(w_data, _e8m0(w_blocks.transpose(1, 2)), fmt, "row") if weight_t
                     else _operand(w_data, _e8m0(w_blocks), fmt, "col"))
        return [EMULATED.grouped_matmul(left, right, group_list, "NT" if weight_t else "NN", output)]

    # -- quantize ----------------------------------------------------------------------------------

    @staticmethod
    def _check_mx_quant(dst_type, scale_alg, round_mode, dst_type_max):
        if dtype_id(dst_type, "dst_type") not in E4M3_IDS or scale_alg != 1 or round_mode != "rint" or dst_type_max:
            raise NotImplementedError(
                "fake torch_npu: MX quant is modelled for E4M3, scale_alg=1 (RCEIL), rint, dst_type_max 0 only"
            )

    def _npu_dynamic_mx_quant(self, input, *, axis=-1, round_mode="rint", dst_type=296, block_size=32, scale_alg=0,
                              dst_type_max=0.0, max_low_bound=0.0):
        self._check_mx_quant(dst_type, scale_alg, round_mode, dst_type_max)
        if axis not in (-1, -2) or block_size != BLOCK or max_low_bound:
            raise NotImplementedError("fake torch_npu: axis -1/-2, block_size 32 and max_low_bound 0 only")
        _check_input("npu_dynamic_mx_quant", input, (torch.float16, torch.bfloat16, torch.float32))
        if input.dtype == torch.float32 and input.shape[axis] < BLOCK:
            raise RuntimeError(f"fake torch_npu: npu_dynamic_mx_quant: float32 input needs axis {axis} >= 32 long "
                               f"(its docs), got shape {tuple(input.shape)}")
        data, scale = mxfp8.quantize(input, orientation="row" if axis == -1 else "col")
        return data, pairs_along(scale.view(torch.uint8), axis)

    def _npu_dynamic_mx_quant_with_dual_axis(self, input, *, round_mode="rint", dst_type=296, scale_alg=0,
                                             dst_type_max=0.0):
        self._check_mx_quant(dst_type, scale_alg, round_mode, dst_type_max)
        _check_input("npu_dynamic_mx_quant_with_dual_axis", input, (torch.float16, torch.bfloat16))
        row_data, row_scale = mxfp8.quantize(input, orientation="row")
        col_data, col_scale = mxfp8.quantize(input, orientation="col")
        row_pairs = pairs_along(row_scale.view(torch.uint8), -1)
        col_pairs = pairs_along(col_scale.view(torch.uint8), -2)
        return row_data, row_pairs, col_data, col_pairs

    def _npu_grouped_dynamic_mx_quant(self, x, group_index, *, round_mode="rint", dst_type=23, blocksize=32,
                                      scale_alg=0, dst_type_max=0.0):
        self._check_mx_quant(dst_type, scale_alg, round_mode, dst_type_max)
        if group_index.dtype != torch.int32 or blocksize != BLOCK:
            raise NotImplementedError("fake torch_npu: group_index int32 cumulative ends, blocksize 32")
        _check_input("npu_grouped_dynamic_mx_quant", x, (torch.float16, torch.bfloat16))
        ends = group_index.to(torch.int64)
        counts = torch.diff(ends, prepend=ends.new_zeros(1))
        data, scale = mxfp8.quantize_grouped(x, counts, orientation="col")
        return data, pack_grouped_pairs(scale.view(torch.uint8), counts.tolist(), x.shape[0])

    @staticmethod
    def _npu_quantize(self, scales, zero_points, dtype, axis=1, div_mode=True):
        # A staticmethod whose first parameter is the schema's input ``Tensor self``, not the fake.
        x = self
        if dtype_id(dtype, "dtype") != HIFLOAT8 or zero_points is not None or div_mode is not True:
            raise NotImplementedError(
                "fake torch_npu: npu_quantize is modelled for dtype=torch_npu.hifloat8, zero_points=None, div_mode=True"
            )
        if scales.dtype != torch.float32:
            raise NotImplementedError("fake torch_npu: npu_quantize is modelled for FP32 scales")
        if x.dtype != torch.float32:
            raise RuntimeError(f"fake torch_npu: npu_quantize: FP32 scales need FP32 input (aclnnQuantize.md), "
                               f"got {x.dtype}")
        if scales.dim() != 1:
            raise RuntimeError(f"fake torch_npu: npu_quantize: scales must be 1-D (aclnn_quantize.cpp), "
                               f"got {tuple(scales.shape)}")
        if scales.numel() == 1:  # per tensor: the axis is not used
            return hif8.encode(x / scales.reshape(()))
        if not -x.dim() <= axis < x.dim() or scales.shape[0] != x.shape[axis]:
            raise RuntimeError(f"fake torch_npu: npu_quantize: scales {tuple(scales.shape)} must have 1 element or "
                               f"x.shape[axis] for x {tuple(x.shape)}, axis {axis} (aclnn_quantize.cpp)")
        shape = [1] * x.dim()
        shape[axis] = scales.shape[0]
        return hif8.encode(x / scales.reshape(shape))
