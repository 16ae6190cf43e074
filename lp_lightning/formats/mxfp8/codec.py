"""MXFP8 codec: E4M3 elements with one E8M0 scale per 32-element block (OCP MX v1.0, design spec §3/§7.2).

This is the bit-exact software model of the format that the emulated backend computes with and the
npu backend is checked against. Binding numerics (docs/formats.md "Decisions for recipe v1" and §2):

- **Blocks.** ``orientation="row"``: 32 consecutive elements along the last dim (1×32,
  ``ScalingType.BlockWise1x32``). ``orientation="col"``: 32 consecutive elements along dim −2
  (32×1), what the wgrad GEMM contracts over. A partial last block is padded with zeros
  *logically*: padding never changes a block's amax and is never stored.
- **Scale (RCEIL).** ``S = fl32(amax / 448)`` and the E8M0 code is ``S`` rounded *up* to a power of
  two, clamped to ``0..254`` (``lp_lightning.formats.mxfp8.e8m0.rceil_codes`` gives the exact integer form
  and its proof). All-zero block → code ``0x00`` (2^-127) and zero data. Block holding NaN or ±Inf →
  code ``0xFF`` (NaN) and **every** element byte ``0x7F`` (E4M3 NaN), so NaN never leaks into a
  finite-looking value.
- **Elements.** ``round_half_even(x / 2^(code-127))`` to ``float8_e4m3fn``, saturated to ±448. The
  division is a multiplication by the exact FP32 power of two ``2^(127-code)`` (always a normal
  FP32 number for finite blocks), so it is exact except where the quotient is below 2^-126, where
  E4M3 rounds to zero anyway. Signed zeros are kept (``-0.0`` and negative values that round to zero
  give ``0x80``, as IEEE casts and ``ml_dtypes`` do).
- **Dequantisation** is exact: ``e4m3(data) * 2^(code-127)`` in FP32 (NaN for code ``0xFF``). The only
  inexact case is FP32 overflow: inputs within 3 % of the FP32 maximum (``|x| >= 248 * 2^120``) round
  to the E4M3 value 256 under scale 2^120 and dequantise to ±Inf.

Layouts (plain, row-major, no padding, no swizzle):

=============  ==================  ==========================  ===============================
orientation    data                scale                       block ``b`` covers
=============  ==================  ==========================  ===============================
row            ``[..., R, K]``     ``[..., R, ceil(K/32)]``    ``data[..., r, 32b:32b+32]``
col            ``[..., M, N]``     ``[..., ceil(M/32), N]``    ``data[..., 32b:32b+32, n]``
col, grouped   ``[T, K]``          ``[sum_g ceil(n_g/32), K]`` rows of one group only
=============  ==================  ==========================  ===============================

Ascend (torch_npu ``npu_dynamic_mx_quant``, QuantMatmulV5) stores *pairs* of consecutive blocks:
row ``[..., R, ceil(Kb/2), 2]`` and col ``[..., ceil(Mb/2), N, 2]`` with an odd block count padded by
code 0 (docs/formats.md §2). From the plain layout: row ``pad(scale, Kb→even).view(..., R, Kb/2, 2)``;
col ``pad(scale, Mb→even).view(..., Mb/2, 2, N).transpose(-1, -2)``. That conversion belongs to the
npu backend (``lp_lightning.ops.npu``); this module keeps the plain layout.

Speed: the block kernels are plain vectorised torch code wrapped in ``@fused``
(``lp_lightning.formats._compile``), so on CPU each orientation runs as one ``torch.compile``d C++
loop nest with no full-size temporaries. Inside a compiled graph the E4M3 rounding is arithmetic
(``_e4m3_bytes`` on FP32 bits for FP32 inputs, the bit-cast-free ``_e4m3_bytes_float_only`` for
16-bit inputs), because the compiled CPU form of ``.to(torch.float8_e4m3fn)`` converts one element
at a time; the eager path (the reference) uses torch's cast. All give identical bytes: offline
sweeps over every FP32 value with ``|q| <= 448`` (both signs) found no difference, and the tests
compare them on special values and against ``ml_dtypes``. See ``benchmarks/quantize.py``.

Tensor-name legend: ``x_MK`` 2-D input of M rows and K columns, ``x_NbB`` row blocks (``Nb``
blocks × ``B`` = 32 elements), ``x_GBN`` col blocks (``G`` block rows × 32 rows × ``N`` columns),
``amax_*``/``code_*``/``rcp_*`` one FP32 amax / int32 E8M0 code / FP32 reciprocal scale per block,
``x_TK`` token-sorted activations (``T`` tokens) with ``group_list_G`` int64 row counts per group
(torch_npu ``group_list_type=1``).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from lp_lightning.formats._compile import fused
from lp_lightning.formats.group_list import group_row_counts
from lp_lightning.formats.mxfp8.e8m0 import E4M3_MAX, e8m0_code_values, rceil_codes

__all__ = [
    "BLOCK_SIZE",
    "INPUT_DTYPES",
    "OUTPUT_DTYPES",
    "dequantize",
    "dequantize_grouped",
    "grouped_scale_rows",
    "quantize",
    "quantize_dual",
    "quantize_grouped",
    "quantize_with_values",
    "scale_shape",
]

BLOCK_SIZE: int = 32
"""Elements per E8M0 scale block (OCP MX v1.0 §5, ``k = 32``)."""

INPUT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
"""High-precision dtypes ``quantize`` accepts (all convert to FP32 exactly)."""

OUTPUT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes ``dequantize`` can return (FP32 is exact; the others round the exact FP32 value once)."""

MXOrientation = Literal["row", "col"]
_ORIENTATIONS: tuple[str, ...] = ("row", "col")

# E4M3 (float8_e4m3fn) encoding constants, all in FP32 bit space.
_F32_SIGN_CLEAR = 0x7FFFFFFF
_F32_INF_BITS = 0x7F800000
_E4M3_MIN_NORMAL_BITS = 121 << 23  # 2^-6, the smallest normal E4M3 magnitude
_E4M3_REBIAS = (127 - 7) << 3  # FP32 (exponent, top-3 mantissa) field minus this = E4M3 code
_E4M3_SUBNORMAL_STEPS = 512.0  # E4M3 subnormals are multiples of 2^-9
_E4M3_NAN_CODE = 0x7F
_E4M3_SIGN_CODE = 128.0
_INT_TO_FLOAT_MAGIC_BITS = 0x4B000000  # bits of 2^23: (n | magic) as FP32 equals 2^23 + n
_TWO_POW_23 = 8388608.0


# --------------------------------------------------------------------------------------------
# Block kernels (``@fused``: compiled where torch.compile works, ``.eager`` is the reference).
# --------------------------------------------------------------------------------------------


def _e4m3_bytes(q: torch.Tensor) -> torch.Tensor:
    """Round FP32 values to ``float8_e4m3fn`` bytes: RNE, saturated to ±448, NaN → ``0x7F``.

    Normal range (``|q| >= 2^-6``): adding ``0x7FFFF`` plus the lowest kept mantissa bit to the FP32
    magnitude bits and shifting right by 20 rounds the 23-bit mantissa to 3 bits half-to-even (a
    carry moves into the exponent, as it should); subtracting ``(127-7)<<3`` rebiases the exponent.
    Subnormal range (``|q| < 2^-6``): the code is ``|q|·2^9`` rounded half-to-even (``torch.round``),
    exact because scaling by 2^9 is exact. The result is assembled in FP32 (small integers are
    exact) and converted to ``uint8`` once; this keeps the compiled CPU loop vectorised.

    Args:
        q: ``float32`` tensor, any shape.

    Returns:
        ``uint8`` tensor of E4M3 bytes, same shape.
    """
    q = q.clamp(-E4M3_MAX, E4M3_MAX)  # NaN stays NaN
    bits = q.view(torch.int32)
    magnitude = bits & _F32_SIGN_CLEAR
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - _E4M3_REBIAS
    normal_f = (normal | _INT_TO_FLOAT_MAGIC_BITS).view(torch.float32) - _TWO_POW_23
    subnormal_f = (q.abs() * _E4M3_SUBNORMAL_STEPS).round()
    code = torch.where(magnitude < _E4M3_MIN_NORMAL_BITS, subnormal_f, normal_f)
    code = torch.where(bits < 0, code + _E4M3_SIGN_CODE, code)
    code = torch.where(magnitude > _F32_INF_BITS, float(_E4M3_NAN_CODE), code)
    return code.to(torch.uint8)


def _e4m3_bytes_float_only(q: torch.Tensor) -> torch.Tensor:
    """``_e4m3_bytes`` without bit casts: a branch-free binary search for the binade, in FP32.

    With ``a = |q|`` and ``R`` starting at ``2^9`` (the E4M3 subnormal step is ``2^-9``), four steps
    ``k = 8, 4, 2, 1`` test ``a·R ≥ 8·2^k`` and, where true, divide ``R`` by ``2^k`` and add ``8k`` to
    an offset. Afterwards ``a·R`` lies in ``[8, 16)`` for E4M3 normals (``R = 8 / 2^floor(log2 a)``)
    or ``[0, 8)`` below ``2^-6``, every product is an exact power-of-two scaling, and the code is
    ``round_half_even(a·R) + offset`` (a round-up to 16 carries into the next binade by itself).
    Used inside compiled graphs for 16-bit inputs: there, reading FP32 bits costs more than these
    extra float operations (``benchmarks/quantize.py``).

    Args:
        q: ``float32`` tensor, any shape.

    Returns:
        ``uint8`` tensor of E4M3 bytes (identical to ``_e4m3_bytes``), same shape.
    """
    q = q.clamp(-E4M3_MAX, E4M3_MAX)
    a = q.abs()
    recip = torch.full_like(a, _E4M3_SUBNORMAL_STEPS)
    offset = torch.zeros_like(a)
    for k in (8, 4, 2, 1):
        up = a * recip >= float(8 * 2**k)
        recip = torch.where(up, recip * float(2.0**-k), recip)
        offset = torch.where(up, offset + float(8 * k), offset)
    code = (a * recip).round() + offset
    code = torch.where(torch.copysign(torch.ones_like(q), q) < 0, code + _E4M3_SIGN_CODE, code)
    code = torch.where(a != a, float(_E4M3_NAN_CODE), code)
    return code.to(torch.uint8)


def _e4m3_bytes_native(q: torch.Tensor) -> torch.Tensor:
    """Same bytes as ``_e4m3_bytes`` through torch's own cast (the eager path; fewer temporaries).

    ``x.to(torch.float8_e4m3fn)`` rounds half-to-even; values are clamped to ±448 first and every
    NaN is replaced by +NaN so that it becomes ``0x7F`` whatever its sign bit. An offline sweep over
    all FP32 values with ``|q| <= 448`` found no difference to ``_e4m3_bytes``; the tests compare the
    two on special values and against ``ml_dtypes``.
    """
    q = torch.where(torch.isnan(q), float("nan"), q.clamp(-E4M3_MAX, E4M3_MAX))
    return q.to(torch.float8_e4m3fn).view(torch.uint8)


def _encode_e4m3(q: torch.Tensor, input_dtype: torch.dtype) -> torch.Tensor:
    """E4M3 bytes of ``q``: torch's cast in eager mode, arithmetic forms in compiled graphs.

    The compiled CPU loop for a 16-bit input runs on 16-lane vector pairs, where reading FP32 bits
    back from a float vector is slow; the bit-cast-free form wins there, the bit form wins for
    FP32 inputs. All three forms give identical bytes.
    """
    if not torch.compiler.is_compiling():
        return _e4m3_bytes_native(q)
    if input_dtype == torch.float32:
        return _e4m3_bytes(q)
    return _e4m3_bytes_float_only(q)


@fused(static_dims={0: (1,)})
def _quantize_row_blocks(x_NbB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize contiguous 32-element blocks, one block per row of ``x_NbB``.

    Args:
        x_NbB: ``[Nb, 32]`` float32/bfloat16/float16, contiguous.

    Returns:
        ``(data_NbB uint8 E4M3 bytes, code_Nb uint8 E8M0 codes, rcp_Nb float32)``; ``rcp`` is
        returned so that the compiled graph computes it once per block, not per element.
    """
    amax_Nb = x_NbB.abs().amax(dim=-1).to(torch.float32)
    code_Nb, rcp_Nb = rceil_codes(amax_Nb)
    data_NbB = _encode_e4m3(x_NbB.to(torch.float32) * rcp_Nb[:, None], x_NbB.dtype)
    return data_NbB, code_Nb.to(torch.uint8), rcp_Nb


@fused(static_dims={0: (1,)})
def _quantize_col_blocks(x_GBN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize 32-row column blocks: block ``(g, n)`` is ``x_GBN[g, :, n]``.

    Args:
        x_GBN: ``[G, 32, N]`` float32/bfloat16/float16, contiguous.

    Returns:
        ``(data_GBN uint8 E4M3 bytes, code_GN uint8 E8M0 codes, rcp_GN float32)``.
    """
    amax_GN = x_GBN.abs().amax(dim=1).to(torch.float32)
    code_GN, rcp_GN = rceil_codes(amax_GN)
    data_GBN = _encode_e4m3(x_GBN.to(torch.float32) * rcp_GN[:, None, :], x_GBN.dtype)
    return data_GBN, code_GN.to(torch.uint8), rcp_GN


@fused(static_dims={0: (1,)})
def _dequantize_row_blocks(data_NbB: torch.Tensor, code_Nb: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Decode contiguous 32-element row blocks: ``e4m3(data) * 2^(code - 127)`` in FP32, then ``out_dtype``.

    Args:
        data_NbB: ``[Nb, 32]`` ``uint8`` E4M3 bytes, contiguous.
        code_Nb: ``[Nb]`` ``uint8`` E8M0 codes.
        out_dtype: float32 (exact), bfloat16 or float16 (one rounding of the exact FP32 value).

    Returns:
        ``[Nb, 32]`` tensor of ``out_dtype``.
    """
    values_NbB = data_NbB.view(torch.float8_e4m3fn).to(torch.float32)
    return (values_NbB * e8m0_code_values(code_Nb)[:, None]).to(out_dtype)


@fused(static_dims={0: (1,)})
def _dequantize_col_blocks(data_GBN: torch.Tensor, code_GN: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Decode 32-row column blocks: block ``(g, n)`` is ``data_GBN[g, :, n]`` with code ``code_GN[g, n]``.

    Args:
        data_GBN: ``[G, 32, N]`` ``uint8`` E4M3 bytes, contiguous.
        code_GN: ``[G, N]`` ``uint8`` E8M0 codes.
        out_dtype: as ``_dequantize_row_blocks``.

    Returns:
        ``[G, 32, N]`` tensor of ``out_dtype``.
    """
    values_GBN = data_GBN.view(torch.float8_e4m3fn).to(torch.float32)
    return (values_GBN * e8m0_code_values(code_GN)[:, None, :]).to(out_dtype)


def _e4m3_values(q: torch.Tensor) -> torch.Tensor:
    """FP32 values of ``_e4m3_bytes(q)`` computed in float arithmetic (no byte round trip).

    The binade search of ``_e4m3_bytes_float_only``: with ``a = |q|`` clamped to 448 and ``R``
    from 2^9 divided down until ``a·R`` lies in [8, 16) (normals) or stays below 8 (subnormals),
    ``round_half_even(a·R) / R`` is the rounded magnitude exactly (``R`` is a power of two); the
    sign of ``q`` is kept (``-0.0`` too) and NaN stays NaN, as decoding the bytes gives.
    """
    q = q.clamp(-E4M3_MAX, E4M3_MAX)
    a = q.abs()
    recip = torch.full_like(a, _E4M3_SUBNORMAL_STEPS)
    for k in (8, 4, 2, 1):
        recip = torch.where(a * recip >= float(8 * 2**k), recip * float(2.0**-k), recip)
    return torch.copysign((a * recip).round() / recip, q)


@fused(static_dims={0: (1,)})
def _quantize_row_blocks_with_values(
    x_NbB: torch.Tensor, values_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_quantize_row_blocks`` plus the decoded values, in one pass over ``x_NbB``.

    Returns:
        ``(data_NbB, code_Nb, values_NbB)``: the values equal ``_dequantize_row_blocks(data_NbB,
        code_Nb, values_dtype)`` bit for bit, computed from the rounded FP32 values
        (``_e4m3_values``) rather than from the bytes.
    """
    amax_Nb = x_NbB.abs().amax(dim=-1).to(torch.float32)
    code_Nb, rcp_Nb = rceil_codes(amax_Nb)
    q_NbB = x_NbB.to(torch.float32) * rcp_Nb[:, None]
    values_NbB = (_e4m3_values(q_NbB) * e8m0_code_values(code_Nb)[:, None]).to(values_dtype)
    return _encode_e4m3(q_NbB, x_NbB.dtype), code_Nb.to(torch.uint8), values_NbB


# --------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------


def _check_orientation(fn: str, orientation: object) -> str:
    if orientation not in _ORIENTATIONS:
        raise ValueError(
            f"{fn}: orientation={orientation!r} is not one of {list(_ORIENTATIONS)}. Use 'row' for "
            "32-element blocks along the last dim (forward/dgrad operands) or 'col' for blocks along "
            "dim -2 (wgrad operands)."
        )
    return "row" if orientation == "row" else "col"  # plain str even for a str-valued Enum member


def _check_input(fn: str, x: object, orientation: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}.")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(
            f"{fn}: x has dtype {x.dtype}; MXFP8 quantizes {[str(d) for d in INPUT_DTYPES]}. "
            "Cast the tensor to one of them first (float64 would need a second rounding)."
        )
    min_dim = 1 if orientation == "row" else 2
    if x.dim() < min_dim:
        hint = " Col blocks run along dim -2; unsqueeze a 1-D tensor first." if min_dim == 2 else ""
        raise ValueError(
            f"{fn}: orientation={orientation!r} needs x with at least {min_dim} dims, got shape "
            f"{tuple(x.shape)}.{hint}"
        )


def _num_blocks(extent: int) -> int:
    return math.ceil(extent / BLOCK_SIZE)


def scale_shape(data_shape: tuple[int, ...] | torch.Size, orientation: MXOrientation) -> tuple[int, ...]:
    """Shape of the E8M0 scale for data of ``data_shape`` (plain layout, see the module table).

    Args:
        data_shape: Shape of the (high-precision or E4M3) data; ≥ 1 dim for row, ≥ 2 for col.
        orientation: ``"row"`` or ``"col"``.

    Returns:
        ``(..., R, ceil(K/32))`` for row, ``(..., ceil(M/32), N)`` for col.

    Raises:
        ValueError: for an unknown orientation or too few dims.
    """
    orientation = _check_orientation("scale_shape", orientation)
    shape = tuple(int(d) for d in data_shape)
    if orientation == "row":
        if len(shape) < 1:
            raise ValueError(f"scale_shape: orientation='row' needs at least 1 dim, got shape {shape}.")
        return (*shape[:-1], _num_blocks(shape[-1]))
    if len(shape) < 2:
        raise ValueError(f"scale_shape: orientation='col' needs at least 2 dims, got shape {shape}.")
    return (*shape[:-2], _num_blocks(shape[-2]), shape[-1])


# --------------------------------------------------------------------------------------------
# Dense quantize / dequantize
# --------------------------------------------------------------------------------------------


def _empty_result(x: torch.Tensor, orientation: str) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.zeros(scale_shape(x.shape, orientation), dtype=torch.uint8, device=x.device)
    return data, scale.view(torch.float8_e8m0fnu)


def _quantize_row(
    x: torch.Tensor, values_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    K = x.shape[-1]
    Kb = _num_blocks(K)
    x_RK = x.reshape(-1, K)
    if K % BLOCK_SIZE:
        x_RK = F.pad(x_RK, (0, Kb * BLOCK_SIZE - K))
    x_NbB = x_RK.contiguous().view(-1, BLOCK_SIZE)
    values = None
    if values_dtype is None:
        data_NbB, code_Nb, _ = _quantize_row_blocks(x_NbB)
    else:
        data_NbB, code_Nb, values_NbB = _quantize_row_blocks_with_values(x_NbB, values_dtype)
        values = values_NbB.view(-1, Kb * BLOCK_SIZE)[:, :K].reshape(x.shape)
    data_RK = data_NbB.view(-1, Kb * BLOCK_SIZE)[:, :K]
    data = data_RK.reshape(x.shape).view(torch.float8_e4m3fn)
    scale = code_Nb.view(*x.shape[:-1], Kb).view(torch.float8_e8m0fnu)
    return data, scale, values


def _quantize_col(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    M, N = x.shape[-2], x.shape[-1]
    Mb = _num_blocks(M)
    x_BMN = x.reshape(-1, M, N)
    if M % BLOCK_SIZE:
        x_BMN = F.pad(x_BMN, (0, 0, 0, Mb * BLOCK_SIZE - M))
    data_GBN, code_GN, _ = _quantize_col_blocks(x_BMN.contiguous().view(-1, BLOCK_SIZE, N))
    data_BMN = data_GBN.view(-1, Mb * BLOCK_SIZE, N)[:, :M]
    data = data_BMN.reshape(x.shape).view(torch.float8_e4m3fn)
    scale = code_GN.view(*x.shape[:-2], Mb, N).view(torch.float8_e8m0fnu)
    return data, scale, None


def quantize(x: torch.Tensor, *, orientation: MXOrientation) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to MXFP8 (E4M3 data, E8M0 RCEIL scales, 32-element blocks).

    Args:
        x: float32/bfloat16/float16 tensor; ≥ 1 dim for ``"row"``, ≥ 2 dims for ``"col"``. Any
            strides (a non-contiguous input is copied once).
        orientation: ``"row"`` — blocks of 32 along the last dim; ``"col"`` — blocks of 32 along
            dim −2 (per column, per leading batch index).

    Returns:
        ``(data, scale)``: ``data`` is ``torch.float8_e4m3fn`` with ``x``'s shape; ``scale`` is
        ``torch.float8_e8m0fnu`` of shape ``scale_shape(x.shape, orientation)``, i.e.
        ``[..., R, ceil(K/32)]`` (row) or ``[..., ceil(M/32), N]`` (col). Both on ``x``'s device.

    Raises:
        TypeError: if ``x`` is not a tensor of an accepted dtype (``INPUT_DTYPES``).
        ValueError: for an unknown orientation or too few dims.
    """
    orientation = _check_orientation("mxfp8.quantize", orientation)
    _check_input("mxfp8.quantize", x, orientation)
    if x.numel() == 0:
        return _empty_result(x, orientation)
    data, scale, _ = _quantize_row(x) if orientation == "row" else _quantize_col(x)
    return data, scale


def quantize_with_values(
    x: torch.Tensor, *, orientation: MXOrientation, values_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize`` plus ``dequantize(data, scale, output_dtype=values_dtype)``, from one kernel.

    The emulated backend's GEMMs consume the decoded values of an operand they use at once; for
    row blocks the kernel writes them while it has each rounded value, instead of a second pass
    over the bytes (docs/performance.md); col blocks take the two passes. Bit-identical to the two
    calls.

    Args:
        x, orientation: As ``quantize``.
        values_dtype: ``OUTPUT_DTYPES`` member of the values.

    Returns:
        ``(data, scale, values)``; ``values`` has ``x``'s shape and ``values_dtype``.

    Raises:
        TypeError, ValueError: as ``quantize`` and ``dequantize``.
    """
    orientation = _check_orientation("mxfp8.quantize_with_values", orientation)
    _check_input("mxfp8.quantize_with_values", x, orientation)
    _check_output_dtype("mxfp8.quantize_with_values", values_dtype)
    if x.numel() == 0:
        data, scale = _empty_result(x, orientation)
        return data, scale, torch.empty(x.shape, dtype=values_dtype, device=x.device)
    if orientation == "row":
        return _quantize_row(x, values_dtype)  # type: ignore[return-value]
    # Col blocks: a fused kernel measured slower than the two passes (strided block reduction).
    data, scale, _ = _quantize_col(x)
    return data, scale, dequantize(data, scale, orientation="col", output_dtype=values_dtype)


def quantize_dual(
    x: torch.Tensor,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Quantize into both orientations (a persistent MXFP8 weight keeps both, design spec §7.2).

    Bit-identical to ``(quantize(x, orientation="row"), quantize(x, orientation="col"))``. When
    ``x`` is contiguous with both trailing dims multiples of 32 (every weight in the recipe), both
    block kernels read the input in place with no copy or padding; otherwise each orientation pads
    only its own dim. A transposed view of a contiguous tensor (a grouped weight's ``w_EKN`` view
    of its ``w_ENK`` master) is read in place too, and its results are made contiguous.

    Args:
        x: float32/bfloat16/float16 tensor with ≥ 2 dims (``w_NK`` or grouped ``w_EKN``).

    Returns:
        ``((row_data, row_scale), (col_data, col_scale))`` as ``quantize`` returns them.

    Raises:
        TypeError: if ``x`` is not a tensor of an accepted dtype.
        ValueError: if ``x`` has fewer than 2 dims.
    """
    _check_input("mxfp8.quantize_dual", x, "col")
    if x.numel() and not x.is_contiguous() and x.mT.is_contiguous():
        # A transposed view (a grouped master ``w_ENK`` seen as ``w_EKN``): x's row blocks are the
        # col blocks of the contiguous ``x.mT`` and vice versa, so quantize that in place and
        # transpose the 1-byte results, instead of copying the FP32 input once per orientation.
        x_t = x.mT
        (row_t, row_scale_t), (col_t, col_scale_t) = quantize(x_t, orientation="col"), quantize(x_t, orientation="row")
        return (
            (row_t.mT.contiguous(), row_scale_t.mT.contiguous()),
            (col_t.mT.contiguous(), col_scale_t.mT.contiguous()),
        )
    return quantize(x, orientation="row"), quantize(x, orientation="col")


def _check_quantized(
    fn: str, data: object, scale: object, orientation: str, expected_scale_shape: tuple[int, ...] | None = None
) -> None:
    if not isinstance(data, torch.Tensor) or data.dtype != torch.float8_e4m3fn:
        got = data.dtype if isinstance(data, torch.Tensor) else type(data).__name__
        raise TypeError(f"{fn}: data must be a torch.float8_e4m3fn tensor (from mxfp8.quantize), got {got}.")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float8_e8m0fnu:
        got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(f"{fn}: scale must be a torch.float8_e8m0fnu tensor (from mxfp8.quantize), got {got}.")
    min_dim = 1 if orientation == "row" else 2
    if data.dim() < min_dim:
        raise ValueError(
            f"{fn}: orientation={orientation!r} needs data with at least {min_dim} dims, "
            f"got shape {tuple(data.shape)}."
        )
    expected = expected_scale_shape if expected_scale_shape is not None else scale_shape(data.shape, orientation)
    if tuple(scale.shape) != tuple(expected):
        raise ValueError(
            f"{fn}: scale shape {tuple(scale.shape)} does not match data shape {tuple(data.shape)} for "
            f"orientation={orientation!r}; expected {tuple(expected)}. Pass data and scale from the same "
            "quantize call."
        )


def _check_output_dtype(fn: str, output_dtype: object) -> None:
    if output_dtype not in OUTPUT_DTYPES:
        raise TypeError(f"{fn}: output_dtype={output_dtype!r} is not one of {[str(d) for d in OUTPUT_DTYPES]}.")


def dequantize(
    data: torch.Tensor,
    scale: torch.Tensor,
    *,
    orientation: MXOrientation,
    output_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Reconstruct ``e4m3(data) * 2^(code - 127)`` per block, exactly in FP32.

    Every product is exact in FP32 (E4M3 values have ≤ 4 significant bits and the scale is a power
    of two; products down to 2^-136 are FP32 subnormals on the 2^-149 grid), except overflow to ±Inf
    for ``|x| >= 248 * 2^120`` inputs (module docstring). Scale code ``0xFF`` and data bytes
    ``0x7F``/``0xFF`` give NaN.

    Args:
        data: ``torch.float8_e4m3fn`` ``[..., R, K]`` (row) or ``[..., M, N]`` (col).
        scale: ``torch.float8_e8m0fnu`` of shape ``scale_shape(data.shape, orientation)``.
        orientation: ``"row"`` or ``"col"``, as passed to ``quantize``.
        output_dtype: float32 (default, exact), bfloat16 or float16 (one rounding of the FP32 value).

    Returns:
        Tensor of ``output_dtype`` with ``data``'s shape and device.

    Raises:
        TypeError: for wrong data/scale/output dtypes.
        ValueError: for an unknown orientation or mismatched shapes.
    """
    orientation = _check_orientation("mxfp8.dequantize", orientation)
    _check_quantized("mxfp8.dequantize", data, scale, orientation)
    _check_output_dtype("mxfp8.dequantize", output_dtype)
    if data.numel() == 0:
        return torch.empty(data.shape, dtype=output_dtype, device=data.device)
    bytes_ = data.view(torch.uint8)
    codes = scale.view(torch.uint8)
    if orientation == "row":
        K = data.shape[-1]
        Kb = scale.shape[-1]
        data_RK = bytes_.reshape(-1, K)
        if K % BLOCK_SIZE:
            data_RK = F.pad(data_RK, (0, Kb * BLOCK_SIZE - K))  # byte 0x00 is +0.0
        out_NbB = _dequantize_row_blocks(data_RK.contiguous().view(-1, BLOCK_SIZE), codes.reshape(-1), output_dtype)
        out = out_NbB.view(-1, Kb * BLOCK_SIZE)[:, :K]
    else:
        M, N = data.shape[-2], data.shape[-1]
        Mb = scale.shape[-2]
        data_BMN = bytes_.reshape(-1, M, N)
        if M % BLOCK_SIZE:
            data_BMN = F.pad(data_BMN, (0, 0, 0, Mb * BLOCK_SIZE - M))
        out_GBN = _dequantize_col_blocks(
            data_BMN.contiguous().view(-1, BLOCK_SIZE, N), codes.reshape(-1, N), output_dtype
        )
        out = out_GBN.view(-1, Mb * BLOCK_SIZE, N)[:, :M]
    return out.reshape(data.shape).contiguous()


# --------------------------------------------------------------------------------------------
# Grouped (MoE token-sorted) variant
# --------------------------------------------------------------------------------------------


def grouped_scale_rows(group_list: torch.Tensor) -> int:
    """Number of col-scale rows of a grouped tensor: ``sum_g ceil(n_g / 32)`` (empty groups add 0).

    Args:
        group_list: int64 ``[G]`` per-group row counts (each ≥ 0).

    Returns:
        Dim 0 of the scale that ``quantize_grouped(..., orientation="col")`` returns.

    Raises:
        TypeError, ValueError: for a malformed ``group_list``.
    """
    counts = group_row_counts(group_list, None, "mxfp8.grouped_scale_rows")
    return sum(_num_blocks(c) for c in counts)


def _padded_rows(counts: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
    """Row index of each token in the group-padded layout (each group padded to a multiple of 32)."""
    start, pad_start, shifts = 0, 0, []
    for c in counts:
        shifts.append(pad_start - start)
        start += c
        pad_start += _num_blocks(c) * BLOCK_SIZE
    counts_t = torch.tensor(counts, dtype=torch.int64)
    shift_T = torch.repeat_interleave(torch.tensor(shifts, dtype=torch.int64), counts_t, output_size=start)
    dest_T = torch.arange(start, dtype=torch.int64) + shift_T
    return dest_T.to(device), pad_start


def _check_grouped_input(fn: str, x_TK: object, orientation: str) -> torch.Tensor:
    _check_input(fn, x_TK, orientation)
    assert isinstance(x_TK, torch.Tensor)  # narrowed by _check_input
    if x_TK.dim() != 2:
        raise ValueError(
            f"{fn}: x_TK must be 2-D [tokens, features] (token-sorted by group), got shape {tuple(x_TK.shape)}."
        )
    return x_TK


def quantize_grouped(
    x_TK: torch.Tensor, group_list: torch.Tensor, *, orientation: MXOrientation
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 quantization of token-sorted MoE activations whose col blocks stop at group ends.

    ``"col"`` (wgrad operands, blocks along the token dim): every group is padded logically with
    zero rows to a multiple of 32, so no block mixes tokens of two groups; group ``g`` owns
    ``ceil(n_g/32)`` consecutive scale rows, in group order, and an empty group owns none. This is
    exactly ``quantize(concat_g(pad32(x_g)), orientation="col")`` with the padding rows dropped from
    the data. ``"row"`` blocks run along K inside one token and never cross groups, so the result
    equals ``quantize(x_TK, orientation="row")`` (``group_list`` is still validated).

    Args:
        x_TK: float32/bfloat16/float16 ``[T, K]``, rows sorted by group.
        group_list: int64 ``[G]`` row counts per group (torch_npu ``group_list_type=1``), each ≥ 0,
            summing to ``T``. Read on the host (one device sync for accelerator tensors).
        orientation: ``"row"`` or ``"col"``.

    Returns:
        ``(data, scale)``: ``float8_e4m3fn [T, K]`` and ``float8_e8m0fnu`` scale of shape
        ``[T, ceil(K/32)]`` (row) or ``[sum_g ceil(n_g/32), K]`` (col).

    Raises:
        TypeError: for a non-tensor/wrong-dtype ``x_TK`` or ``group_list``.
        ValueError: for an unknown orientation, a non-2-D ``x_TK``, a non-1-D ``group_list``, negative
            counts or counts that do not sum to ``T``.
    """
    orientation = _check_orientation("mxfp8.quantize_grouped", orientation)
    x_TK = _check_grouped_input("mxfp8.quantize_grouped", x_TK, orientation)
    counts = group_row_counts(group_list, x_TK.shape[0], "mxfp8.quantize_grouped")
    if orientation == "row" or all(c % BLOCK_SIZE == 0 for c in counts):
        # Row blocks never cross tokens; with 32-aligned groups col blocks never cross groups either.
        return quantize(x_TK, orientation=orientation)
    dest_T, padded_rows = _padded_rows(counts, x_TK.device)
    x_PK = x_TK.new_zeros((padded_rows, x_TK.shape[1]))
    x_PK.index_copy_(0, dest_T, x_TK)
    data_PK, scale = quantize(x_PK, orientation="col")
    data_TK = data_PK.view(torch.uint8).index_select(0, dest_T).view(torch.float8_e4m3fn)
    return data_TK, scale


def dequantize_grouped(
    data: torch.Tensor,
    scale: torch.Tensor,
    group_list: torch.Tensor,
    *,
    orientation: MXOrientation,
    output_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of ``quantize_grouped``: exact ``e4m3(data) * 2^(code - 127)`` with group-local blocks.

    Args:
        data: ``float8_e4m3fn [T, K]``.
        scale: ``float8_e8m0fnu`` ``[T, ceil(K/32)]`` (row) or ``[sum_g ceil(n_g/32), K]`` (col).
        group_list: int64 ``[G]`` per-group row counts summing to ``T``.
        orientation: ``"row"`` or ``"col"``.
        output_dtype: float32 (default, exact), bfloat16 or float16.

    Returns:
        ``[T, K]`` tensor of ``output_dtype``.

    Raises:
        TypeError, ValueError: as ``dequantize`` and ``quantize_grouped``.
    """
    fn = "mxfp8.dequantize_grouped"
    orientation = _check_orientation(fn, orientation)
    _check_output_dtype(fn, output_dtype)
    if not isinstance(data, torch.Tensor) or data.dim() != 2:
        shape = tuple(data.shape) if isinstance(data, torch.Tensor) else type(data).__name__
        raise ValueError(f"{fn}: data must be a 2-D [T, K] float8_e4m3fn tensor, got {shape}.")
    counts = group_row_counts(group_list, data.shape[0], fn)
    if orientation == "row":
        return dequantize(data, scale, orientation="row", output_dtype=output_dtype)
    expected = (sum(_num_blocks(c) for c in counts), data.shape[1])
    _check_quantized(fn, data, scale, "col", expected_scale_shape=expected)
    dest_T, padded_rows = _padded_rows(counts, data.device)
    data_PK = torch.zeros((padded_rows, data.shape[1]), dtype=torch.uint8, device=data.device)
    data_PK.index_copy_(0, dest_T, data.view(torch.uint8))
    out_PK = dequantize(data_PK.view(torch.float8_e4m3fn), scale, orientation="col", output_dtype=torch.float32)
    return out_PK.index_select(0, dest_T).to(output_dtype)
