"""E8M0 block scales (OCP MX v1.0 §5.4.1) and the RCEIL scale rule used by MXFP8 (docs/formats.md §2).

An E8M0 byte ``c`` is an unsigned biased exponent: ``c`` in ``0..254`` encodes ``2**(c - 127)``
(``0x00`` = 2^-127, an FP32 subnormal; ``0xFE`` = 2^127) and ``0xFF`` encodes NaN. There is no
sign, no zero and no infinity. In torch the bytes are carried as ``torch.float8_e8m0fnu``.

Scale rule **RCEIL** (binding decision in docs/formats.md; torch_npu ``npu_dynamic_mx_quant(scale_alg=1)``,
cuBLAS "UE8M0 scales", TransformerEngine): for a block with ``amax = max |x|``,

    S = fl32(amax / 448)                         (an FP32 division, subnormal results included)
    code = clamp(ceil(log2 S) + 127, 0, 254)     (S rounded *up* to a power of two)

written in the ops-nn golden (``_mx_calculate_share_exp_nv``) as: biased exponent ``E`` of ``S``,
plus one if ``S`` is normal, ``E < 254`` and its mantissa bits are non-zero, or if ``S`` is
subnormal and its mantissa exceeds 0.5 (i.e. ``S > 2^-127``). An all-zero block gets code 0
(2^-127) and a block holding NaN or ±Inf gets code ``0xFF``.

Because RCEIL rounds the scale up, ``amax / 2**(code-127) <= 448`` for every finite block except
one FP32 ``amax`` value (see ``rceil_codes``), so elements never saturate by more than rounding.

Tensor-name legend: ``amax_B`` one FP32 amax per block (any shape ``B``), ``code_B`` int32 E8M0
codes, ``rcp_B`` the FP32 reciprocal ``2**(127 - code)`` a block's elements are multiplied by.
"""

from __future__ import annotations

import torch

__all__ = [
    "E4M3_MAX",
    "E8M0_BIAS",
    "E8M0_MAX_CODE",
    "E8M0_NAN_CODE",
    "e8m0_code_values",
    "e8m0_to_float32",
    "rceil_codes",
]

E4M3_MAX: float = 448.0
"""Largest finite ``float8_e4m3fn`` value (1.75 · 2^8), the ``Amax(dtype)`` of the RCEIL rule."""

E8M0_BIAS: int = 127
"""Exponent bias of E8M0: code ``c`` encodes ``2**(c - 127)``."""

E8M0_MAX_CODE: int = 254
"""Largest finite E8M0 code (2^127); RCEIL clamps into ``0..254``."""

E8M0_NAN_CODE: int = 0xFF
"""The E8M0 NaN code, written for blocks that hold NaN or ±Inf."""

# FP32 bit patterns used by the integer form of RCEIL (see ``rceil_codes``).
_F32_EXP_ALL_ONES = 0xFF
_F32_SIGN_CLEAR = 0x7FFFFFFF
_MANTISSA_MASK = 0x7FFFFF
_MANTISSA_OF_1_75 = 0x600000  # 448 = 1.75 * 2^8
_SUBNORMAL_TIE_AMAX_BITS = 0x04600001  # 1.75*2^-119 + 2^-142: fl32(amax/448) == 2^-127 exactly
_F32_QUIET_NAN_BITS = 0x7FC00000
_F32_2_POW_M127_BITS = 0x00400000  # 2^-127, an FP32 subnormal


def rceil_codes(amax_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RCEIL E8M0 codes of FP32 block maxima, and the exact FP32 reciprocals of the scales.

    Exact integer form of ``code = clamp(ceil(log2(fl32(amax / 448))) + 127, 0, 254)``. Write
    ``amax = 1.f · 2^(ex-127)`` (``ex`` its biased FP32 exponent). For a normal quotient ``S``,
    ``fl32`` can only move ``amax / 448`` across a power of two ``2^e`` if some FP32 ``amax`` lies in
    ``(1.75·2^(e+8), 1.75·2^(e+8)·(1 + 2^-24)]``; the FP32 spacing there is ``2^(e+8-23) >
    1.75·2^(e+8-24)``, so none does, and ``ceil(log2 S)`` equals the exact ``ceil(log2(amax/448))``:
    ``ex - 135`` if ``f ≤ 0.75`` (mantissa bits ≤ ``0x600000``) else ``ex - 134``. Biased, that is
    ``ex - 8`` or ``ex - 7``, clamped to ``0..254``. In the subnormal range of ``S`` the FP32 grid is
    ``2^-149`` and exactly one FP32 ``amax`` (bits ``0x04600001``) has ``amax/448`` inside
    ``(2^-127, 2^-127 + 2^-150]``: ``S`` rounds down to 2^-127 there, the golden rule gives code 0,
    and that block's largest element becomes ``448·(1 + 2^-23/1.75)``, which the element cast
    rounds to 448 (the only case where RCEIL leans on saturation). An offline sweep over every
    non-negative finite FP32 ``amax`` matched the ops-nn golden rule bit for bit.

    ``amax`` that is NaN or +Inf (FP32 exponent all ones) gives code ``0xFF`` and a NaN reciprocal,
    so the whole block becomes NaN. Finite FP32 ``amax`` gives codes ``≤ 247`` (``amax/448 <
    2^120``), so ``rcp = 2^(127 - code) ≥ 2^-120`` is always a normal FP32 number and
    ``x * rcp`` is exact unless the product falls below 2^-126, far under E4M3's rounding threshold.

    Args:
        amax_B: ``float32`` block maxima of ``|x|`` (non-negative, or NaN/+Inf; the sign bit is
            ignored, so a NaN with its sign bit set is still NaN), any shape.

    Returns:
        ``(code_B, rcp_B)``: ``int32`` codes in ``0..254`` or ``255``, and ``float32`` reciprocals
        ``2**(127 - code)`` (NaN where ``code == 255``), both shaped like ``amax_B``.
    """
    bits_B = amax_B.view(torch.int32) & _F32_SIGN_CLEAR  # a NaN may carry a sign bit
    exp_B = bits_B >> 23
    round_up_B = ((bits_B & _MANTISSA_MASK) > _MANTISSA_OF_1_75).to(torch.int32)
    code_B = (exp_B - 8 + round_up_B).clamp(0, E8M0_MAX_CODE)
    code_B = torch.where(bits_B == _SUBNORMAL_TIE_AMAX_BITS, 0, code_B)
    not_finite_B = exp_B == _F32_EXP_ALL_ONES
    code_B = torch.where(not_finite_B, E8M0_NAN_CODE, code_B)
    rcp_bits_B = torch.where(not_finite_B, _F32_QUIET_NAN_BITS, (E8M0_MAX_CODE - code_B) << 23)
    return code_B, rcp_bits_B.view(torch.float32)


def e8m0_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 scales exactly: ``2**(code - 127)`` in FP32, NaN for ``0xFF``.

    Built from bit patterns, so it is exact for every code, including code 0 (2^-127, an FP32
    subnormal) and code 254 (2^127).

    Args:
        scale: ``torch.float8_e8m0fnu`` (or ``torch.uint8`` holding E8M0 bytes), any shape.

    Returns:
        ``float32`` tensor of ``scale``'s shape.

    Raises:
        TypeError: if ``scale`` is not a tensor of dtype ``float8_e8m0fnu`` or ``uint8``.
    """
    if not isinstance(scale, torch.Tensor) or scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(
            f"e8m0_to_float32: scale must be a torch.float8_e8m0fnu (or uint8) tensor, got {got}. "
            "Pass the scale returned by lp_lightning.formats.mxfp8.quantize."
        )
    return e8m0_code_values(scale.view(torch.uint8))


def e8m0_code_values(code: torch.Tensor) -> torch.Tensor:
    """``e8m0_to_float32`` without the checks, for use inside the codec's (compiled) kernels.

    Args:
        code: integer tensor (``uint8`` or ``int32``) of E8M0 codes 0..255, any shape.

    Returns:
        ``float32`` tensor ``2^(code - 127)`` (NaN for 255), same shape.
    """
    code = code.to(torch.int32)
    bits = torch.where(code == 0, _F32_2_POW_M127_BITS, code << 23)
    bits = torch.where(code == E8M0_NAN_CODE, _F32_QUIET_NAN_BITS, bits)
    return bits.view(torch.float32)
