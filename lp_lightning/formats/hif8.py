"""HiFloat8 (HiF8) codec: FP32 → 8-bit codes with TA rounding, and codes → float.

HiF8 is an 8-bit *tapered-precision* float (arXiv 2409.16626; FORMATS.md §1): a sign bit, a
prefix-coded exponent width ("Dot"), a sign-magnitude exponent and a mantissa whose width shrinks
as |exponent| grows — 3 bits for |E| ≤ 3, 2 bits for 4 ≤ |E| ≤ 7, 1 bit for 8 ≤ |E| ≤ 15 — plus
7 denormal codes 2^-22 … 2^-16 with no mantissa. Off-NPU the codes are stored as ``torch.uint8``
(on Ascend the same bytes are ``torch_npu.hifloat8``).

Bit layout (MSB → LSB, FORMATS.md §1.2), ``S`` sign, ``Es`` exponent sign, ``e`` the exponent
magnitude's bits below its implicit leading 1, ``M`` mantissa bits::

    Dot    D  |E|      mantissa  byte pattern    codes/sign
    11     4  8..15    1         S 11 Es eee M   32
    10     3  4..7     2         S 10 Es ee MM   32
    01     2  2..3     3         S 01 Es e MMM   32
    001    1  1        3         S 001 Es MMM    16
    0001   0  0        3         S 0001 MMM      8
    0000   —  denormal 0         S 0000 MMM      8   value 2^(MMM-23), MMM = 0 is zero

Specials (FORMATS.md §1.3): one zero 0x00 (−0 encodes to 0x00), one NaN 0x80, ±Inf 0x6F/0xEF,
largest finite 0x6E = 2^15 = 32768, smallest normal 0x7E = 2^-15, smallest denormal 0x01 = 2^-22.
The byte order is not monotonic in value; compare decoded values, never codes.

Encoding (binding decision, FORMATS.md "Decisions" and §1.5): round to nearest, ties away from
zero ("TA", CANN ``CAST_ROUND``); NaN → 0x80; |x| ≥ 40960 (the midpoint between 32768 and the Inf
slot's nominal 49152) → ±Inf, or ±32768 with ``saturate=True``; [2^-23, 2^-22) → 2^-22 and
|x| < 2^-23 → 0x00. Both rules at the bottom are exactly codebook-nearest with ties away, so the
encoder equals "nearest code, ties to the larger magnitude" over the whole finite range.

Tensor-name legend for this file:
    x       input of any shape (any floating dtype; converted to FP32 first)
    x_N     the same values flattened to one dimension of N elements
    bits_N  the FP32 bit patterns of ``x_N`` as ``int32``
    code_N  HiF8 codes (``int32`` while computed, ``uint8`` when returned)
    tab_256 a 256-entry lookup table indexed by the 8-bit FP32 exponent field (or by a code)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from lp_lightning.formats._compile import fused

__all__ = [
    "FORMAT_MAX_GRADIENT",
    "FORMAT_MAX_INPUT_WEIGHT",
    "HIF8_MAX",
    "HIF8_MIN_NORMAL",
    "HIF8_MIN_SUBNORMAL",
    "HIF8_NAN_CODE",
    "HIF8_NEG_INF_CODE",
    "HIF8_OVERFLOW_THRESHOLD",
    "HIF8_POS_INF_CODE",
    "HIF8_ZERO_CODE",
    "decode",
    "encode",
]

# ---------------------------------------------------------------------------------------------
# Format constants (FORMATS.md §1.3).
HIF8_MAX: float = 32768.0
"""Largest finite magnitude, code 0x6E = 2^15."""
HIF8_MIN_NORMAL: float = 2.0**-15
"""Smallest normal magnitude, code 0x7E = 2^-15 (Dot ``11``, E = −15, M = 0)."""
HIF8_MIN_SUBNORMAL: float = 2.0**-22
"""Smallest positive magnitude, denormal code 0x01 = 2^-22."""
HIF8_OVERFLOW_THRESHOLD: float = 40960.0
"""|x| at or above this (1.25·2^15) encodes to ±Inf, or to ±HIF8_MAX when saturating (§1.5 step 3)."""
HIF8_ZERO_CODE: int = 0x00
HIF8_NAN_CODE: int = 0x80
HIF8_POS_INF_CODE: int = 0x6F
HIF8_NEG_INF_CODE: int = 0xEF

# Recipe constants (FORMATS.md §1.7, "Decisions": current scaling, scale = amax / format_max).
FORMAT_MAX_INPUT_WEIGHT: float = 15.0
"""Target for amax of the input and weight roles. 15 = 1.875·2^3 is the largest HiF8 value with a
3-bit mantissa (|E| ≤ 3), so scaling amax to 15 puts the largest activations/weights at the top of
the most precise band (E4M3-like precision) and leaves ≈26 binades below it, down to 2^-22.
Same as MindSpeed ``HIF8_15`` (inputs and weights)."""
FORMAT_MAX_GRADIENT: float = 224.0
"""Target for amax of the gradient role. 224 = 1.75·2^7 is the largest HiF8 value with a mantissa
of at least 2 bits (|E| ≤ 7): the largest gradients never fall into the 1-bit band (≥ 256) while
≈30 binades of headroom remain for small gradients. Same as MindSpeed ``HIF8_224`` (grads)."""

# ---------------------------------------------------------------------------------------------
# The bit layout, declared once. Both the encoder's tables and the decoder's table derive from it.


@dataclass(frozen=True, slots=True)
class _DotBand:
    """One row of FORMATS.md §1.2: a prefix code and the exponent/mantissa widths it selects."""

    prefix: int  # the Dot bits, right-aligned
    prefix_len: int  # number of Dot bits
    exp_width: int  # D: bits of |E| including its implicit leading 1 (0 means E = 0)
    man_width: int  # m: stored mantissa bits

    def exponents(self) -> range:
        """Magnitudes |E| this band encodes: 0 for D = 0, else 2^(D-1) … 2^D − 1."""
        if self.exp_width == 0:
            return range(0, 1)
        return range(1 << (self.exp_width - 1), 1 << self.exp_width)


_NORMAL_BANDS: tuple[_DotBand, ...] = (
    _DotBand(prefix=0b11, prefix_len=2, exp_width=4, man_width=1),
    _DotBand(prefix=0b10, prefix_len=2, exp_width=3, man_width=2),
    _DotBand(prefix=0b01, prefix_len=2, exp_width=2, man_width=3),
    _DotBand(prefix=0b001, prefix_len=3, exp_width=1, man_width=3),
    _DotBand(prefix=0b0001, prefix_len=4, exp_width=0, man_width=3),
)
_DML_PREFIX_LEN = 4  # Dot ``0000``: denormal, value 2^(M - 23), M = 1..7 in the low 3 bits
_DML_EXP_OFFSET = 23
_MAX_EXP = 15  # largest normal |E|
_MIN_DML_EXP = 1 - _DML_EXP_OFFSET  # −22: exponent of the smallest denormal
_PAYLOAD_BITS = 7  # bits after the sign

_FP32_MAN_BITS = 23
_FP32_BIAS = 127


def _band_of(exponent: int) -> _DotBand:
    for band in _NORMAL_BANDS:
        if abs(exponent) in band.exponents():
            return band
    raise AssertionError(f"no HiF8 Dot band holds exponent {exponent}")


def _normal_payload(exponent: int, mantissa: int) -> int:
    """The 7 bits after the sign for normal value 2^exponent · (1 + mantissa / 2^m)."""
    band = _band_of(exponent)
    assert 0 <= mantissa < (1 << band.man_width)
    payload = band.prefix << (_PAYLOAD_BITS - band.prefix_len)
    if band.exp_width > 0:
        es_shift = _PAYLOAD_BITS - band.prefix_len - 1
        low_bits = abs(exponent) & ((1 << (band.exp_width - 1)) - 1)
        payload |= int(exponent < 0) << es_shift
        payload |= low_bits << band.man_width
    return payload | mantissa


def _decode_payload(payload: int) -> float:
    """Non-negative value of a 7-bit payload (0x6F is +Inf), parsed from the bit layout."""
    assert 0 <= payload < (1 << _PAYLOAD_BITS)
    for band in _NORMAL_BANDS:
        if payload >> (_PAYLOAD_BITS - band.prefix_len) != band.prefix:
            continue
        mantissa = payload & ((1 << band.man_width) - 1)
        if band.exp_width == 0:
            magnitude = 0
        else:
            es_shift = _PAYLOAD_BITS - band.prefix_len - 1
            low_bits = (payload >> band.man_width) & ((1 << (band.exp_width - 1)) - 1)
            magnitude = (1 << (band.exp_width - 1)) | low_bits
            if (payload >> es_shift) & 1:
                magnitude = -magnitude
        if magnitude == _MAX_EXP and mantissa == (1 << band.man_width) - 1:
            return float("inf")  # the largest-magnitude pattern is Inf (FORMATS.md §1.3)
        return 2.0**magnitude * (1.0 + mantissa / (1 << band.man_width))
    dml = payload & ((1 << (_PAYLOAD_BITS - _DML_PREFIX_LEN)) - 1)
    return 0.0 if dml == 0 else 2.0 ** (dml - _DML_EXP_OFFSET)


def _build_decode_table() -> torch.Tensor:
    """FP32 value of every code 0x00..0xFF, derived from the bit layout (not typed in)."""
    values = []
    for code in range(256):
        magnitude = _decode_payload(code & 0x7F)
        sign = -1.0 if code & 0x80 else 1.0
        values.append(float("nan") if code == HIF8_NAN_CODE else sign * magnitude)
    return torch.tensor(values, dtype=torch.float32)


def _build_encode_tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-FP32-exponent-field tables for the encoder (index = biased exponent 0..255).

    Returns:
        ``(half_ulp_256, shift_256, pack_256)``, all ``int32``:
        ``half_ulp_256[f]`` is added to the 23-bit FP32 mantissa to round to nearest, ties away
        (half a HiF8 ulp of that binade; 2^23 at E = −23 forces the carry to 2^-22, 0 where the
        value flushes to zero); ``shift_256[f]`` drops the FP32 mantissa bits HiF8 does not keep;
        ``pack_256[f]`` is the code of 2^E (mantissa 0), or 0 where E flushes to zero. ``f`` above
        142 (E > 15) never reaches the tables: those inputs are overflow or NaN.
    """
    half_ulp, shift, pack = [0] * 256, [_FP32_MAN_BITS] * 256, [0] * 256
    for field in range(256):
        exponent = field - _FP32_BIAS
        if exponent < _MIN_DML_EXP - 1 or exponent > _MAX_EXP:
            continue  # flush to zero below 2^-23; overflow/NaN handled outside the tables
        if exponent == _MIN_DML_EXP - 1:  # [2^-23, 2^-22): always round up to 2^-22
            half_ulp[field] = 1 << _FP32_MAN_BITS
        elif exponent < -_MAX_EXP:  # denormal binade: no mantissa, round at 1.5 · 2^E
            half_ulp[field] = 1 << (_FP32_MAN_BITS - 1)
            pack[field] = exponent + _DML_EXP_OFFSET
        else:
            man_width = _band_of(exponent).man_width
            half_ulp[field] = 1 << (_FP32_MAN_BITS - man_width - 1)
            shift[field] = _FP32_MAN_BITS - man_width
            pack[field] = _normal_payload(exponent, 0)
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return as_tensor(half_ulp), as_tensor(shift), as_tensor(pack)


_DECODE_TABLE_256 = _build_decode_table()
_ENCODE_TABLES = _build_encode_tables()
_OVERFLOW_BITS = int(torch.tensor(HIF8_OVERFLOW_THRESHOLD, dtype=torch.float32).view(torch.int32))
_FP32_INF_BITS = 0x7F800000

_table_lock = threading.Lock()
_tables_on_device: dict[tuple[str, torch.device], tuple[torch.Tensor, ...]] = {}


def _tables(kind: str, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The lookup tables of ``kind`` ("encode" or "decode") copied once to ``device``."""
    key = (kind, device)
    cached = _tables_on_device.get(key)
    if cached is None:
        source = _ENCODE_TABLES if kind == "encode" else (_DECODE_TABLE_256,)
        with _table_lock:
            cached = _tables_on_device.setdefault(key, tuple(t.to(device) for t in source))
    return cached


# ---------------------------------------------------------------------------------------------
# Kernels (element-wise, vectorised; ``fused`` uses a torch.compile twin where it works).


@fused
def _encode_kernel(
    x_N: torch.Tensor,
    half_ulp_256: torch.Tensor,
    shift_256: torch.Tensor,
    pack_256: torch.Tensor,
    overflow_code: int,
) -> torch.Tensor:
    """FP32 ``x_N`` → ``uint8`` HiF8 codes, TA rounding (FORMATS.md §1.5). See ``encode``."""
    bits_N = x_N.view(torch.int32)
    negative_N = bits_N < 0
    abs_bits_N = bits_N & 0x7FFFFFFF
    is_nan_N = abs_bits_N > _FP32_INF_BITS
    overflow_N = (abs_bits_N >= _OVERFLOW_BITS) & ~is_nan_N
    # Specials leave the table path (their exponent field 255 would index past E = 15).
    abs_bits_N = torch.where(is_nan_N | overflow_N, 0, abs_bits_N)
    field_N = (abs_bits_N >> _FP32_MAN_BITS).long()
    mantissa_N = abs_bits_N & ((1 << _FP32_MAN_BITS) - 1)
    # Step 6: add half a HiF8 ulp and truncate; a carry moves to the next binade with mantissa 0.
    rounded_N = mantissa_N + half_ulp_256[field_N]
    carry_N = rounded_N >> _FP32_MAN_BITS
    kept_N = (rounded_N & ((1 << _FP32_MAN_BITS) - 1)) >> shift_256[field_N]
    code_N = pack_256[field_N + carry_N] | kept_N
    # Step 7: sign bit, except for zero (HiF8 has a single zero code).
    code_N = torch.where(negative_N & (code_N != 0), code_N | 0x80, code_N)
    code_N = torch.where(overflow_N, torch.where(negative_N, overflow_code | 0x80, overflow_code), code_N)
    code_N = torch.where(is_nan_N, HIF8_NAN_CODE, code_N)
    return code_N.to(torch.uint8)


@fused
def _decode_kernel(code_N: torch.Tensor, value_256: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``uint8`` codes → values of ``out_dtype`` by lookup in the FP32 table (exact, see ``decode``)."""
    return value_256[code_N.long()].to(out_dtype)


# ---------------------------------------------------------------------------------------------
# Public API.


def encode(x: torch.Tensor, *, saturate: bool = False) -> torch.Tensor:
    """Encode a floating tensor to HiF8 codes with TA rounding (nearest, ties away from zero).

    The input is first converted to FP32 (exact for BF16/FP16/FP8/FP32). An FP64 input is
    therefore rounded twice (to FP32 with round-half-even, then to HiF8); the result can differ
    from a direct FP64 → HiF8 rounding only for values within half an FP32 ulp of a HiF8 midpoint.
    Rules (FORMATS.md "Decisions" and §1.5): NaN → 0x80; ±0 → 0x00; |x| ≥ 40960 → ±Inf
    (0x6F/0xEF); [2^-23, 2^-22) → 2^-22 (0x01/0x81); |x| < 2^-23, FP32 subnormals included →
    0x00 (the sign is dropped: HiF8 has only one zero code).

    Args:
        x: Tensor of any shape, floating dtype, on any device.
        saturate: If True, finite overflow (|x| ≥ 40960) and ±Inf map to ±32768 (0x6E/0xEE)
            instead of ±Inf; NaN still maps to 0x80. Default False (Inf on overflow, like the
            reference codecs cited in FORMATS.md §1.5).

    Returns:
        ``torch.uint8`` tensor of codes, same shape and device as ``x`` (contiguous).

    Raises:
        TypeError: if ``x`` is not a tensor with a floating dtype.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"encode: x must be a torch.Tensor, got {type(x).__name__}.")
    if not x.is_floating_point():
        raise TypeError(
            f"encode: x must have a floating dtype (float32, bfloat16, float16, float64, float8_*), "
            f"got {x.dtype}; convert it with x.float() first."
        )
    x_N = x.detach().to(torch.float32).contiguous().reshape(-1)
    if x_N.numel() == 0:
        return torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    overflow_code = 0x6E if saturate else HIF8_POS_INF_CODE
    code_N = _encode_kernel(x_N, *_tables("encode", x_N.device), overflow_code)
    return code_N.reshape(x.shape)


def decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode HiF8 codes to floating values.

    Every HiF8 value has at most 4 significant bits and lies in [2^-22, 2^15], so it is exact in
    float64, float32, bfloat16 and float16 (2^-22 is an FP16 subnormal); an FP8 ``dtype`` rounds.

    Args:
        codes: ``torch.uint8`` tensor of any shape on any device (the HiF8 bit patterns).
        dtype: Floating output dtype (default float32).

    Returns:
        Tensor of ``dtype``, same shape and device as ``codes``: 0x80 → NaN, 0x6F/0xEF → ±Inf.

    Raises:
        TypeError: if ``codes`` is not a ``torch.uint8`` tensor or ``dtype`` is not floating.
    """
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        got = codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise TypeError(
            f"decode: codes must be a torch.uint8 tensor of HiF8 bit patterns, got {got}; "
            "on torch_npu, view a hifloat8 tensor as uint8 first."
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"decode: dtype must be a floating torch.dtype (e.g. torch.float32), got {dtype!r}.")
    code_N = codes.contiguous().reshape(-1)
    if code_N.numel() == 0:
        return torch.empty(codes.shape, dtype=dtype, device=codes.device)
    (value_256,) = _tables("decode", code_N.device)
    return _decode_kernel(code_N, value_256, dtype).reshape(codes.shape)
