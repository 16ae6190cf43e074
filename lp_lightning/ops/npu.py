"""The ``npu`` backend: thin wrappers over torch_npu's quantize / quant-MM / quant-GMM ops (design spec §13.4).

Nothing here imports ``torch_npu`` at module level; each wrapper imports it when called (so only
selecting and using this backend loads it). Every argument the wrappers pass is explicit, so the
call records of the fake ``torch_npu`` in the tests pin the whole hardware contract. Any error
raised by torch_npu propagates unchanged: there is no fallback to a high-precision GEMM.

Ops and arguments (docs/formats.md §3.3; MindSpeed ``mindspeed/ops/gmm_mxfp8.py`` and
hicann/torchtitan-npu ``converters/kernels/quant_gmm.py`` use the same conventions):

==================  ====================================================================
dense MXFP8         ``npu_quant_matmul(x1, x2, scale=x2 scale, pertoken_scale=x1 scale,
                    scale_dtype=pertoken_scale_dtype=torch_npu.float8_e8m0fnu,
                    group_sizes=[1, 1, 32], output_dtype=...)``
dense HiF8          ``npu_quant_matmul(x1, x2, scale=[1] FP32, pertoken_scale=[1] FP32,
                    x1_dtype=x2_dtype=torch_npu.hifloat8, output_dtype=...)`` (T-T mode)
grouped (both)      ``npu_grouped_matmul([x], [weight], scale=[...], per_token_scale=[...],
                    group_list=counts, group_list_type=1, group_type=0 (split M: fprop,
                    dgrad) or 2 (split K: wgrad), split_item=3, output_dtype=...)`` plus
                    ``scale_dtype/per_token_scale_dtype=float8_e8m0fnu`` (MXFP8) or
                    ``x_dtype/weight_dtype=hifloat8`` (HiF8)
MXFP8 quantize      ``npu_dynamic_mx_quant(x, axis=-1|-2, dst_type=torch.float8_e4m3fn,
                    scale_alg=1)`` (RCEIL), ``npu_dynamic_mx_quant_with_dual_axis`` (FP16/BF16
                    only, per its docs: an FP32 master gets one single-axis call per axis),
                    ``npu_grouped_dynamic_mx_quant`` (wgrad col operands, FP16/BF16 only)
HiF8 quantize       ``npu_quantize(x_fp32, scale, None, torch_npu.hifloat8, axis=-1,
                    div_mode=True)`` with our FP32 scale ``[1]`` (1-D/2-D tensors), or
                    ``axis=0`` and scale ``[E]`` for a 3-D ``[E, D1, D2]`` weight; one call,
                    also for the dual quantisation (one code tensor serves both orientations)
==================  ====================================================================

A transposed operand is passed as a transposed *view* (``t.transpose(-2, -1)``), never a copy,
and its NPU scale as the matching transposed view, as in the references above.

Ascend 950 MX scale layout (docs/formats.md §2 "Ascend 950 MX scale layout"; ops-nn
aclnnDynamicMxQuantV3.md, aclnnQuantMatmulV5.md): the quant axis of length ``d`` becomes
``ceil(ceil(d/32)/2)`` rows of *pairs* of consecutive 32-blocks, with a trailing dim of 2; an odd
block count is padded with code 0 (2^-127). For the last axis this is a plain reshape of our
``[..., R, nb]`` scale to ``[..., R, nb/2, 2]``; for axis −2 the pairs are interleaved:
``npu[..., p, c, j] = ours[..., 2p + j, c]``. Grouped col scales (GroupedDynamicMxQuant README)
pack the pairs of each group after the previous group's, every group padded to an even block
count, in a ``[T // 64 + G, C, 2]`` tensor (unused trailing rows are code 0).

HiF8 GMM scales follow the torchtitan-npu HiF8 GMM (its low-precision guide): the per-tensor
activation scale broadcast to ``[T]`` (``per_token_scale``) and the weight's ``[E]`` scale for
split-M; for wgrad (split-K) both per-tensor scales broadcast to ``[E]``.

Dtype arguments: the schemas type ``output_dtype``, ``dst_type`` and the ``*_dtype`` arguments as
``int``; the torch dispatcher turns a ``torch.dtype`` passed there into its ScalarType id
(``torch.bfloat16`` → 15, ``torch.float8_e4m3fn`` → 24), the ids the op-plugin's maps read
(``op_plugin/meta/_meta_registrations.py``; the op docs list 24 for ``torch.float8_e4m3fn``), while
``torch_npu.float8_e8m0fnu`` / ``torch_npu.hifloat8`` are already ints (293, 290). So the wrappers
pass torch dtypes for data/output types and torch_npu's ints for its custom types.

HiF8 quantisation (design spec §15: "current quant, quant with a given scale") is our recipe with
torch_npu computing the codes (docs/formats.md "Decisions", §3.3): amax is a torch reduction on the
device (the quantizer's ``compute_amax``, or the ``amax`` given for a dense weight, MAX-reduced over
its FSDP shard group), the FP32 scale is the quantizer's ``scale_from_amax`` (``amax / format_max``,
15 for inputs and weights, 224 for gradients; 1.0 where that is not finite and > 0), and
``npu_quantize`` (aclnnQuantize) divides by that scale and casts to HiF8 (TA rounding). So the
"current quant" is device amax + quant with a given scale, not the fused ``npu_dynamic_quant(
quant_mode="pertensor", dst_type=torch_npu.hifloat8, dst_type_max=...)``: that op computes its
scale as ``amax · fl32(1 / dst_type_max)``, which differs from ``amax / format_max`` in the last bit
for most amax values, gives scale 0 for an all-zero tensor (ours: 1.0), and cannot take the
cross-rank amax a sharded dense weight needs. Open points for the A5 system test (docs/formats.md
§3.3; the fake torch_npu computes ``encode(x / scale)`` with correctly rounded FP32 division, i.e.
our codec): (1) the Ascend 950 kernels (ops-nn
``quant/quantize/op_kernel/arch35/quantize_per_tensor_no_offset_regbase.h`` and
``quantize_per_head_no_offset_regbase.h``) divide with ``DivSpecificMode{precisionMode = false}``
(documented ≤ 1 ulp), so a code may differ where ``x / scale`` sits next to a HiF8 rounding
boundary; (2) their HiF8 cast saturates (``SatMode::SAT``): a finite ``x`` divided by our scale
never leaves ±format_max·(1 + 2^-22), so only ±Inf elements (ours 0x6F/0xEF) and NaN (ours 0x80)
can differ. The input is cast to FP32 first (exact): with FP32 scales the op takes FP32 input
only (aclnnQuantize.md).

Formats are looked up by name in per-format tables (``_KERNELS`` here, ``REQUIRED_DTYPES`` and
``REQUIRED_OPS`` of :mod:`lp_lightning.ops.npu_capability`): the backend declares what it
implements; a registered format without an entry fails the capability check, whose gate
(:func:`npu_gate_checks`, :func:`npu_capability_error`, :func:`check_npu_capability`) is
re-exported here. Importing this module never imports ``torch_npu``; only calling the gate or a
wrapper does.

Tensor-name legend: ``scale_*b`` our scales (one entry per 32-block), ``npu_scale_*2`` NPU pair
layout (trailing dim 2), ``P`` pair rows, ``G`` groups, ``C`` columns.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch

from lp_lightning.formats.mxfp8 import BLOCK_SIZE as MX_BLOCK_SIZE
from lp_lightning.formats.operand import QuantizedOperand
from lp_lightning.formats.quantizer import Quantizer, check_quantize_args
from lp_lightning.formats.spec import FormatSpec, Orientation
from lp_lightning.ops.npu_capability import (
    MIN_TORCH_NPU_VERSION,
    REQUIRED_DTYPES,
    REQUIRED_OPS,
    SOC_PREFIX,
    GateCheck,
    check_npu_capability,
    clear_capability_cache,
    npu_capability_error,
    npu_gate_checks,
)

__all__ = [
    "BACKEND",
    "MIN_TORCH_NPU_VERSION",
    "REQUIRED_DTYPES",
    "REQUIRED_OPS",
    "SOC_PREFIX",
    "GateCheck",
    "NpuBackend",
    "hif8_quantize",
    "check_npu_capability",
    "clear_capability_cache",
    "npu_capability_error",
    "npu_gate_checks",
    "mx_grouped_scale_from_npu",
    "mx_grouped_scale_to_npu",
    "mx_quantize",
    "mx_quantize_dual",
    "mx_quantize_grouped_col",
    "mx_scale_from_npu",
    "mx_scale_to_npu",
]

_DUAL_AXIS_INPUTS = (torch.bfloat16, torch.float16)  # npu_dynamic_mx_quant_with_dual_axis's input dtypes
_SCALE_ALG_RCEIL = 1  # npu_dynamic_mx_quant scale_alg=1: S = amax / 448 with exponent rounded up (RCEIL)
_MX_GROUP_SIZES = [1, 1, MX_BLOCK_SIZE]  # [gm, gn, gk] of QuantMatmulV5 MX mode
_GROUP_LIST_COUNTS = 1  # npu_grouped_matmul group_list_type=1: per-group counts
_GROUP_TYPE_SPLIT_M = 0
_GROUP_TYPE_SPLIT_K = 2
_SPLIT_ITEM_SINGLE = 3  # one output tensor
_HIF8_AXIS_PER_TENSOR = -1  # npu_quantize with a [1] scale: aclnnQuantize ignores the axis
_HIF8_AXIS_PER_GROUP = 0  # a [E] scale of an [E, D1, D2] weight: aclnnQuantize's per-head mode on dim 0


def _torch_npu() -> ModuleType:
    import torch_npu  # noqa: PLC0415 - imported only when the npu backend is used

    return torch_npu


def _as_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """torch_npu returns E8M0 scales as ``uint8`` or ``float8_e8m0fnu``; normalise to the latter."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale
    if scale.dtype == torch.uint8:
        return scale.view(torch.float8_e8m0fnu)
    raise TypeError(f"torch_npu returned an MX scale of dtype {scale.dtype}; expected uint8 or float8_e8m0fnu.")


def _pad_blocks_even(scale_u8: torch.Tensor, dim: int) -> torch.Tensor:
    """Append one code-0 (2^-127) block along ``dim`` when the block count is odd."""
    if scale_u8.shape[dim] % 2 == 0:
        return scale_u8
    pad_shape = list(scale_u8.shape)
    pad_shape[dim] = 1
    return torch.cat([scale_u8, scale_u8.new_zeros(pad_shape)], dim=dim)


# ------------------------------------------------------------------------------------------------
# Scale layout conversion (ours ↔ Ascend 950).


def mx_scale_to_npu(scale: torch.Tensor, *, orientation: Orientation) -> torch.Tensor:
    """Our MX scale → the Ascend 950 pair layout.

    Args:
        scale: ``float8_e8m0fnu``; row: ``[..., R, nb]``; col: ``[..., nb, C]``.
        orientation: ``"row"`` (blocks along the last dim) or ``"col"`` (along dim −2).

    Returns:
        Contiguous ``float8_e8m0fnu``; row: ``[..., R, ceil(nb/2), 2]``; col:
        ``[..., ceil(nb/2), C, 2]`` with ``out[..., p, c, j] = scale[..., 2p + j, c]``.
    """
    scale_u8 = scale.view(torch.uint8)
    if orientation == "row":
        padded = _pad_blocks_even(scale_u8, -1)
        out = padded.reshape(*padded.shape[:-1], padded.shape[-1] // 2, 2)
    else:
        padded = _pad_blocks_even(scale_u8, -2)
        pairs, cols = padded.shape[-2] // 2, padded.shape[-1]
        out = padded.reshape(*padded.shape[:-2], pairs, 2, cols).transpose(-2, -1)
    return out.contiguous().view(torch.float8_e8m0fnu)


def mx_scale_from_npu(npu_scale: torch.Tensor, *, orientation: Orientation, num_blocks: int) -> torch.Tensor:
    """The Ascend 950 pair layout → our MX scale (inverse of ``mx_scale_to_npu``).

    Args:
        npu_scale: ``uint8`` or ``float8_e8m0fnu``; row ``[..., R, P, 2]``, col ``[..., P, C, 2]``.
        orientation: ``"row"`` or ``"col"``.
        num_blocks: ``ceil(d / 32)`` for the quantized axis (drops the padding block).

    Returns:
        ``float8_e8m0fnu``; row ``[..., R, num_blocks]``, col ``[..., num_blocks, C]``.
    """
    npu_u8 = _as_e8m0(npu_scale).view(torch.uint8)
    if orientation == "row":
        flat = npu_u8.reshape(*npu_u8.shape[:-2], npu_u8.shape[-2] * 2)
        out = flat[..., :num_blocks]
    else:
        pairs, cols = npu_u8.shape[-3], npu_u8.shape[-2]
        flat = npu_u8.transpose(-2, -1).reshape(*npu_u8.shape[:-3], pairs * 2, cols)
        out = flat[..., :num_blocks, :]
    return out.contiguous().view(torch.float8_e8m0fnu)


def mx_grouped_scale_to_npu(scale: torch.Tensor, group_list: torch.Tensor, tokens: int) -> torch.Tensor:
    """Our grouped col scale ``[sum_g ceil(n_g/32), C]`` → NPU ``[T // 64 + G, C, 2]``.

    Computed on the device from ``group_list`` (no host sync): block row ``b`` of group ``g``
    (local index ``j``) goes to pair row ``pair_start_g + j // 2``, slot ``j % 2``.

    Args:
        scale: ``float8_e8m0fnu [B, C]``, ``B = sum_g ceil(n_g / 32)``.
        group_list: ``int64 [G]`` row counts.
        tokens: ``T = sum_g n_g``.

    Returns:
        Contiguous ``float8_e8m0fnu [T // 64 + G, C, 2]``, unused rows code 0.
    """
    scale_u8 = scale.view(torch.uint8)
    num_block_rows, cols = scale_u8.shape
    counts_G = group_list.to(scale_u8.device)
    blocks_G = (counts_G + MX_BLOCK_SIZE - 1) // MX_BLOCK_SIZE
    pairs_G = (blocks_G + 1) // 2
    block_end_G = torch.cumsum(blocks_G, 0)
    pair_start_G = torch.cumsum(pairs_G, 0) - pairs_G
    block_b = torch.arange(num_block_rows, device=scale_u8.device)
    group_b = torch.searchsorted(block_end_G, block_b, right=True)
    local_b = block_b - (block_end_G - blocks_G)[group_b]
    out = scale_u8.new_zeros((tokens // (2 * MX_BLOCK_SIZE) + group_list.numel(), cols, 2))
    out[pair_start_G[group_b] + local_b // 2, :, local_b % 2] = scale_u8
    return out.view(torch.float8_e8m0fnu)


def mx_grouped_scale_from_npu(npu_scale: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
    """NPU grouped col scale ``[P, C, 2]`` → ours ``[sum_g ceil(n_g/32), C]`` (reads the counts on host).

    Args:
        npu_scale: ``uint8`` or ``float8_e8m0fnu [P, C, 2]`` (P ≥ the pairs the groups need).
        group_list: ``int64 [G]`` row counts.

    Returns:
        Contiguous ``float8_e8m0fnu [sum_g ceil(n_g / 32), C]``.
    """
    npu_u8 = _as_e8m0(npu_scale).view(torch.uint8)
    cols = npu_u8.shape[1]
    pieces, pair_row = [], 0
    for count in group_list.tolist():
        blocks = math.ceil(count / MX_BLOCK_SIZE)
        pairs = math.ceil(blocks / 2)
        group = npu_u8[pair_row : pair_row + pairs]  # [pairs, C, 2]
        pieces.append(group.transpose(1, 2).reshape(pairs * 2, cols)[:blocks])
        pair_row += pairs
    out = torch.cat(pieces, 0) if pieces else npu_u8.new_zeros((0, cols))
    return out.contiguous().view(torch.float8_e8m0fnu)


# ------------------------------------------------------------------------------------------------
# Quantize (MXFP8).


def mx_quantize(x: torch.Tensor, *, orientation: Orientation) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 quantize with ``npu_dynamic_mx_quant`` (RCEIL); scale returned in our layout.

    Args:
        x: bfloat16/float16/float32 tensor, ≥ 1-D (row) or ≥ 2-D (col); float32 needs the quantised
            axis ≥ 32 long (the op's docs).
        orientation: ``"row"`` (``axis=-1``) or ``"col"`` (``axis=-2``).

    Returns:
        ``(data float8_e4m3fn, scale float8_e8m0fnu)`` in the layouts of ``lp_lightning.formats.mxfp8``.

    Raises:
        RuntimeError: from torch_npu, for an input the op refuses (propagated unchanged).
    """
    torch_npu = _torch_npu()
    axis = -1 if orientation == "row" else -2
    data, npu_scale = torch_npu.npu_dynamic_mx_quant(
        x, axis=axis, dst_type=torch.float8_e4m3fn, scale_alg=_SCALE_ALG_RCEIL
    )
    num_blocks = math.ceil(x.shape[axis] / MX_BLOCK_SIZE)
    return data, mx_scale_from_npu(npu_scale, orientation=orientation, num_blocks=num_blocks)


def mx_quantize_dual(
    x: torch.Tensor,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Row and col MXFP8 in one ``npu_dynamic_mx_quant_with_dual_axis`` call (RCEIL).

    Args:
        x: ≥ 2-D bfloat16/float16 tensor (the op takes no float32).

    Returns:
        ``((row_data, row_scale), (col_data, col_scale))`` in our layouts (the op returns the
        axis −1 result first, then axis −2).
    """
    torch_npu = _torch_npu()
    row_data, row_npu, col_data, col_npu = torch_npu.npu_dynamic_mx_quant_with_dual_axis(
        x, dst_type=torch.float8_e4m3fn, scale_alg=_SCALE_ALG_RCEIL
    )
    row_scale = mx_scale_from_npu(row_npu, orientation="row", num_blocks=math.ceil(x.shape[-1] / MX_BLOCK_SIZE))
    col_scale = mx_scale_from_npu(col_npu, orientation="col", num_blocks=math.ceil(x.shape[-2] / MX_BLOCK_SIZE))
    return (row_data, row_scale), (col_data, col_scale)


def mx_quantize_grouped_col(x_TC: torch.Tensor, group_list: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped col MXFP8 (blocks stop at group ends; RCEIL).

    bfloat16/float16: one ``npu_grouped_dynamic_mx_quant`` call. float32 (the SwiGLU output and its
    gradient, which recipe v1 quantizes straight from FP32), which that op does not take: one
    ``npu_dynamic_mx_quant(axis=-2)`` call over the rows re-laid so that every group starts at a
    multiple of 32, the gaps zero. Zero rows leave a block's amax, hence its scale and every real
    row's code, unchanged, so both paths equal the per-group quantization bit for bit.

    Args:
        x_TC: 2-D token-sorted bfloat16/float16/float32 tensor.
        group_list: ``int64 [G]`` row counts (passed to the grouped op as ``int32`` cumulative ends).

    Returns:
        ``(data float8_e4m3fn [T, C], scale float8_e8m0fnu [sum_g ceil(n_g/32), C])``.
    """
    torch_npu = _torch_npu()
    if x_TC.dtype == torch.float32:
        return _mx_quantize_grouped_col_fp32(torch_npu, x_TC, group_list)
    group_index = torch.cumsum(group_list, 0).to(torch.int32)
    data, npu_scale = torch_npu.npu_grouped_dynamic_mx_quant(
        x_TC, group_index, round_mode="rint", dst_type=torch.float8_e4m3fn, blocksize=MX_BLOCK_SIZE,
        scale_alg=_SCALE_ALG_RCEIL,
    )
    return data, mx_grouped_scale_from_npu(npu_scale, group_list)


def _mx_quantize_grouped_col_fp32(
    torch_npu: ModuleType, x_TC: torch.Tensor, group_list: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 grouped col MXFP8 through ``npu_dynamic_mx_quant`` on block-aligned groups (see the caller)."""
    counts_G = group_list.to(device=x_TC.device, dtype=torch.int64)
    blocks_G = (counts_G + MX_BLOCK_SIZE - 1) // MX_BLOCK_SIZE
    num_blocks = int(blocks_G.sum())  # host: the scale's row count depends on it (as for the grouped op)
    cols = x_TC.shape[1]
    if num_blocks == 0:
        return (x_TC.new_empty((0, cols), dtype=torch.float8_e4m3fn),
                x_TC.new_empty((0, cols), dtype=torch.uint8).view(torch.float8_e8m0fnu))
    # Row t of group g moves by (32 · first block of g) - (first row of g).
    shift_G = MX_BLOCK_SIZE * (torch.cumsum(blocks_G, 0) - blocks_G) - (torch.cumsum(counts_G, 0) - counts_G)
    rows_T = torch.arange(x_TC.shape[0], device=x_TC.device) + torch.repeat_interleave(shift_G, counts_G)
    aligned_PC = x_TC.new_zeros((num_blocks * MX_BLOCK_SIZE, cols))
    aligned_PC[rows_T] = x_TC
    data_PC, npu_scale = torch_npu.npu_dynamic_mx_quant(
        aligned_PC, axis=-2, dst_type=torch.float8_e4m3fn, scale_alg=_SCALE_ALG_RCEIL
    )
    return data_PC[rows_T], mx_scale_from_npu(npu_scale, orientation="col", num_blocks=num_blocks)


# ------------------------------------------------------------------------------------------------
# Quantize (HiF8).


def hif8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """HiF8 codes of ``x / scale`` from one ``npu_quantize`` call; the scale is given, never computed.

    Args:
        x: float32/bfloat16/float16, 1-D/2-D with a per-tensor scale, or 3-D ``[E, D1, D2]`` with
            one scale per leading group; cast to FP32 first (exact), as the op takes FP32 scales
            with FP32 input only (aclnnQuantize.md). Views are passed as they are (the op takes
            non-contiguous input).
        scale: FP32 0-d (1-D/2-D ``x``) or ``[E]`` (3-D ``x``), passed 1-D (``[1]`` / ``[E]``, the
            op's scale rank) with ``axis=-1`` (ignored for a one-element scale) or ``axis=0``.

    Returns:
        ``uint8`` HiF8 codes (torch_npu's carrier of ``torch_npu.hifloat8``), ``x``'s shape.

    Raises:
        RuntimeError: from torch_npu, for an input the op refuses (propagated unchanged).
    """
    torch_npu = _torch_npu()
    axis = _HIF8_AXIS_PER_GROUP if x.dim() == 3 else _HIF8_AXIS_PER_TENSOR
    return torch_npu.npu_quantize(
        x.detach().to(torch.float32), scale.reshape(-1), None, torch_npu.hifloat8, axis=axis, div_mode=True
    )


def _hif8_operand(
    quantizer: Quantizer,
    tensor: torch.Tensor,
    orientation: Orientation,
    group_list: torch.Tensor | None,
    amax: torch.Tensor | None,
) -> QuantizedOperand:
    """The HiF8 quantizer's operand with the codes from :func:`hif8_quantize` (module docstring)."""
    check_quantize_args("npu quantize(hif8)", tensor, orientation, group_list)
    amax_shape = quantizer.format.scale_shape(tuple(tensor.shape), orientation)  # raises unless 1-D/2-D/3-D
    if amax is None:
        amax = quantizer.compute_amax(tensor)
    elif not isinstance(amax, torch.Tensor) or tuple(amax.shape) != amax_shape:
        got = tuple(amax.shape) if isinstance(amax, torch.Tensor) else type(amax).__name__
        raise TypeError(f"npu quantize(hif8): amax must be a tensor of shape {amax_shape}, got {got}.")
    scale = quantizer.scale_from_amax(amax.to(tensor.device))  # type: ignore[attr-defined]
    return QuantizedOperand(
        data=hif8_quantize(tensor, scale), scale=scale, logical_dtype=tensor.dtype, format=quantizer.format,
        orientation=orientation, group_list=group_list, format_max=quantizer.format_max,  # type: ignore[attr-defined]
    )


# ------------------------------------------------------------------------------------------------
# GEMMs.


def _t(tensor: torch.Tensor, transpose: bool) -> torch.Tensor:
    return tensor.transpose(-2, -1) if transpose else tensor


_KERNELS: dict[str, str] = {"mxfp8_e4m3": "mx", "hif8": "hif8"}
"""Which torch_npu kernel family implements each format: ``"mx"`` (E8M0 block scales,
``group_sizes``/``*_scale_dtype``) or ``"hif8"`` (``torch_npu.hifloat8`` operands, FP32 scales)."""


class NpuBackend:
    """torch_npu quantize and quant MM/GMM wrappers; GEMM inputs arrive validated by ``lp_lightning.ops.api``."""

    name = "npu"

    def capability_error(self, format: FormatSpec) -> str | None:
        """See :func:`npu_capability_error`."""
        return npu_capability_error(format)

    def startup_checks(self, format: FormatSpec | None) -> tuple[GateCheck, ...]:
        """See :func:`npu_gate_checks`."""
        return npu_gate_checks(format)

    def quantize(
        self,
        quantizer: Quantizer,
        tensor: torch.Tensor,
        *,
        orientation: Orientation,
        group_list: torch.Tensor | None = None,
        amax: torch.Tensor | None = None,
    ) -> QuantizedOperand:
        """MX formats: ``npu_dynamic_mx_quant`` (``npu_grouped_dynamic_mx_quant`` for grouped col);
        HiF8: our amax and scale, codes from ``npu_quantize`` (module docstring)."""
        if _KERNELS[quantizer.format.name] == "hif8":
            return _hif8_operand(quantizer, tensor, orientation, group_list, amax)
        if amax is not None:
            raise ValueError(f"npu quantize: {quantizer.format.name} computes block scales; amax must be None.")
        if orientation == "col" and group_list is not None:
            data, scale = mx_quantize_grouped_col(tensor, group_list)
        else:
            data, scale = mx_quantize(tensor, orientation=orientation)
        return QuantizedOperand(
            data=data, scale=scale, logical_dtype=tensor.dtype, format=quantizer.format,
            orientation=orientation, group_list=group_list,
        )

    def quantize_dual(
        self, quantizer: Quantizer, tensor: torch.Tensor, *, amax: torch.Tensor | None = None
    ) -> tuple[QuantizedOperand, QuantizedOperand]:
        """MX formats: one ``npu_dynamic_mx_quant_with_dual_axis`` call for FP16/BF16, one
        ``npu_dynamic_mx_quant`` call per axis for an FP32 tensor (the dual-axis op takes no FP32, and
        a cast to BF16 first would round twice); HiF8: one ``npu_quantize`` call whose codes serve
        both orientations."""
        if _KERNELS[quantizer.format.name] == "hif8":
            row = _hif8_operand(quantizer, tensor, "row", None, amax)
            return row, row.with_orientation("col")
        if amax is not None:
            raise ValueError(f"npu quantize_dual: {quantizer.format.name} computes block scales; amax must be None.")
        if tensor.dtype in _DUAL_AXIS_INPUTS:
            row, col = mx_quantize_dual(tensor)
        else:
            row, col = mx_quantize(tensor, orientation="row"), mx_quantize(tensor, orientation="col")
        make = lambda pair, o: QuantizedOperand(  # noqa: E731
            data=pair[0], scale=pair[1], logical_dtype=tensor.dtype, format=quantizer.format, orientation=o
        )
        return make(row, "row"), make(col, "col")

    def matmul(
        self, left: QuantizedOperand, right: QuantizedOperand, layout: str, output_dtype: torch.dtype
    ) -> torch.Tensor:
        """Dense GEMM via ``npu_quant_matmul``: x1 = op(left) ``[m, k]``, x2 = op(right) ``[k, n]``."""
        torch_npu = _torch_npu()
        left_t, right_t = layout[0] == "T", layout[1] == "T"
        x1, x2 = _t(left.data, left_t), _t(right.data, right_t)
        if _KERNELS[left.format.name] == "mx":
            # x1 scale is (m, ceil(k/64), 2) and x2 scale (ceil(k/64), n, 2). A transposed operand's
            # scale is the matching view: its first two dims swapped, the pair slot stays last.
            x1_scale = mx_scale_to_npu(left.scale, orientation=left.orientation)
            x2_scale = mx_scale_to_npu(right.scale, orientation=right.orientation)
            if left_t:  # wgrad dyᵀ: col scale (ceil(M/64), N, 2) → (N, ceil(M/64), 2)
                x1_scale = x1_scale.transpose(0, 1)
            if right_t:  # fprop Wᵀ: row scale (N, ceil(K/64), 2) → (ceil(K/64), N, 2)
                x2_scale = x2_scale.transpose(0, 1)
            return torch_npu.npu_quant_matmul(
                x1, x2, x2_scale,
                pertoken_scale=x1_scale,
                output_dtype=output_dtype,
                scale_dtype=torch_npu.float8_e8m0fnu,
                pertoken_scale_dtype=torch_npu.float8_e8m0fnu,
                group_sizes=list(_MX_GROUP_SIZES),
            )
        return torch_npu.npu_quant_matmul(
            x1, x2, right.scale.reshape(1),
            pertoken_scale=left.scale.reshape(1),
            output_dtype=output_dtype,
            x1_dtype=torch_npu.hifloat8,
            x2_dtype=torch_npu.hifloat8,
        )

    def grouped_matmul(
        self,
        left: QuantizedOperand,
        right: QuantizedOperand,
        group_list: torch.Tensor,
        layout: str,
        output_dtype: torch.dtype,
    ) -> torch.Tensor:
        """Grouped GEMM via ``npu_grouped_matmul`` (split M for NN/NT, split K for TN)."""
        torch_npu = _torch_npu()
        tokens, num_groups = left.shape[0], group_list.numel()
        if layout == "TN":  # wgrad: x = left ᵀ [K, T], weight = right [T, N], split K over tokens
            x, weight, group_type = left.data.transpose(0, 1), right.data, _GROUP_TYPE_SPLIT_K
        else:  # fprop: weight [E, K, N]; dgrad: weight viewed [E, N, K]
            x, weight, group_type = left.data, _t(right.data, layout == "NT"), _GROUP_TYPE_SPLIT_M
        common = dict(
            group_list=group_list,
            group_list_type=_GROUP_LIST_COUNTS,
            group_type=group_type,
            split_item=_SPLIT_ITEM_SINGLE,
            output_dtype=output_dtype,
        )
        if _KERNELS[left.format.name] == "mx":
            if layout == "TN":
                x_scale = mx_grouped_scale_to_npu(left.scale, group_list, tokens).transpose(0, 1)  # (K, P, 2)
                w_scale = mx_grouped_scale_to_npu(right.scale, group_list, tokens)  # (P, N, 2)
            else:
                x_scale = mx_scale_to_npu(left.scale, orientation="row")  # (T, ceil(k/64), 2)
                w_scale = mx_scale_to_npu(right.scale, orientation=right.orientation)
                if layout == "NT":  # row scale [E, K, P, 2] → (E, P, K, 2) view, like the data view
                    w_scale = w_scale.transpose(1, 2)
            kinds = dict(scale_dtype=torch_npu.float8_e8m0fnu, per_token_scale_dtype=torch_npu.float8_e8m0fnu)
        else:
            if layout == "TN":
                x_scale = left.scale.reshape(1).expand(num_groups).contiguous()
                w_scale = right.scale.reshape(1).expand(num_groups).contiguous()
            else:
                x_scale = left.scale.reshape(1).expand(tokens).contiguous()
                w_scale = right.scale
            kinds = dict(x_dtype=torch_npu.hifloat8, weight_dtype=torch_npu.hifloat8)
        (out,) = torch_npu.npu_grouped_matmul(
            [x], [weight], scale=[w_scale], per_token_scale=[x_scale], **common, **kinds
        )
        return out


BACKEND = NpuBackend()
