"""HiFloat8 (HiF8) codec: FP32 → 8-bit codes with TA rounding, and codes → float.

HiF8 is an 8-bit *tapered-precision* float (arXiv 2409.16626; docs/formats.md §1): a sign bit, a
prefix-coded exponent width ("Dot"), a sign-magnitude exponent and a mantissa whose width shrinks
as |exponent| grows — 3 bits for |E| ≤ 3, 2 bits for 4 ≤ |E| ≤ 7, 1 bit for 8 ≤ |E| ≤ 15 — plus
7 denormal codes 2^-22 … 2^-16 with no mantissa. Off-NPU the codes are stored as ``torch.uint8``
(on Ascend the same bytes are ``torch_npu.hifloat8``).

Bit layout (MSB → LSB, docs/formats.md §1.2), ``S`` sign, ``Es`` exponent sign, ``e`` the exponent
magnitude's bits below its implicit leading 1, ``M`` mantissa bits::

    Dot    D  |E|      mantissa  byte pattern    codes/sign
    11     4  8..15    1         S 11 Es eee M   32
    10     3  4..7     2         S 10 Es ee MM   32
    01     2  2..3     3         S 01 Es e MMM   32
    001    1  1        3         S 001 Es MMM    16
    0001   0  0        3         S 0001 MMM      8
    0000   —  denormal 0         S 0000 MMM      8   value 2^(MMM-23), MMM = 0 is zero

Specials (docs/formats.md §1.3): one zero 0x00 (−0 encodes to 0x00), one NaN 0x80, ±Inf 0x6F/0xEF,
largest finite 0x6E = 2^15 = 32768, smallest normal 0x7E = 2^-15, smallest denormal 0x01 = 2^-22.
The byte order is not monotonic in value; compare decoded values, never codes.

Encoding (binding decision, docs/formats.md "Decisions" and §1.5): round to nearest, ties away from
zero ("TA", CANN ``CAST_ROUND``); NaN → 0x80; |x| ≥ 40960 (the midpoint between 32768 and the Inf
slot's nominal 49152) → ±Inf, or ±32768 with ``saturate=True``; [2^-23, 2^-22) → 2^-22 and
|x| < 2^-23 → 0x00. Both rules at the bottom are exactly codebook-nearest with ties away, so the
encoder equals "nearest code, ties to the larger magnitude" over the whole finite range.

Speed: both kernels are branch-free integer arithmetic on bit patterns (no table gathers), written
as plain vectorised torch and wrapped in ``@fused``, so the compiled twin is one vectorised loop;
see ``_encode_kernel`` and ``_decode_kernel`` for the bit tricks and ``benchmarks/quantize.py``
for the cost against the native FP8 casts.

Tensor-name legend for this file:
    x        input of any shape (any floating dtype; converted to FP32 first)
    x_N      the same values flattened to one dimension of N elements
    x_RC     ``x_N`` (or its first R·C elements) as R rows of C = ``_TILE_C`` (the encoder's tiles)
    bound_C  the encoder's clamp bound repeated along a row of C elements
    bits_RC  FP32 bit patterns as ``int32`` (every ``*_RC`` / ``*_N`` inside a kernel is int32)
    code_N   HiF8 codes (``int32`` while computed, ``uint8`` when returned)
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
    "encode_scaled",
]

# ---------------------------------------------------------------------------------------------
# Format constants (docs/formats.md §1.3).
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

# Recipe constants (docs/formats.md §1.7, "Decisions": current scaling, scale = amax / format_max).
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
# The bit layout, declared once. The encoder's and the decoder's constants derive from it.


@dataclass(frozen=True, slots=True)
class _DotBand:
    """One row of docs/formats.md §1.2: a prefix code and the exponent/mantissa widths it selects."""

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
            return float("inf")  # the largest-magnitude pattern is Inf (docs/formats.md §1.3)
        return 2.0**magnitude * (1.0 + mantissa / (1 << band.man_width))
    dml = payload & ((1 << (_PAYLOAD_BITS - _DML_PREFIX_LEN)) - 1)
    return 0.0 if dml == 0 else 2.0 ** (dml - _DML_EXP_OFFSET)


_FP32_INF_BITS = 0x7F800000
_FP32_NAN_BITS = 0x7FC00000  # the quiet NaN torch produces for float("nan")
_FP32_SIGN_BIT = -(1 << 31)  # int32 with only bit 31 set

_cache_lock = threading.Lock()


# ---------------------------------------------------------------------------------------------
# Encoder constants. Every number the encode kernel uses is derived here from the layout above
# (``_NORMAL_BANDS``) and checked against it, so the kernel holds no hand-typed magic values.

_MAX_MAN_WIDTH = max(band.man_width for band in _NORMAL_BANDS)  # 3, the finest band
_ROUND_SHIFT_FINEST = _FP32_MAN_BITS - _MAX_MAN_WIDTH  # 20: FP32 mantissa bits the finest band drops
_HALF_ULP_FINEST = 1 << (_ROUND_SHIFT_FINEST - 1)  # half a HiF8 ulp at m = 3, in FP32 mantissa LSBs
_MAX_SHIFT = 31  # largest legal int32 shift; table reads past |E| = 15 are clamped to it
_ES_WEIGHT_UNIT = 8  # the Es bit weighs 8 (Dot 001) or 16 (Dot 01/10/11); tables store eighths


def _to_int32(value: int) -> int:
    """The Python int whose two's-complement int32 bit pattern is the low 32 bits of ``value``."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _band_constants(band: _DotBand) -> tuple[int, int, int]:
    """``(narrowing, base, es_weight)`` of one normal band (docs/formats.md §1.2).

    With ``y = (|E| << m) | M`` (the exponent magnitude, its implicit leading 1 included,
    followed by the ``m`` mantissa bits) the 7-bit payload is ``y + base + Es * es_weight``:
    ``base`` is the Dot prefix in place minus the implicit leading 1 of ``|E|`` that ``y``
    carries, ``es_weight`` the place of the Es bit, ``narrowing = 3 - m`` the number of mantissa
    bits the band has fewer than the finest one.
    """
    implicit = (1 << (band.exp_width - 1)) << band.man_width if band.exp_width else 0
    base = (band.prefix << (_PAYLOAD_BITS - band.prefix_len)) - implicit
    # Dot 0001 (E = 0) has no Es bit; its weight is never used (Es = 0) and 8 keeps the identity
    # ``base = base_step * narrowing + es_weight`` true for it too.
    es_weight = 1 << (_PAYLOAD_BITS - band.prefix_len - 1) if band.exp_width else _ES_WEIGHT_UNIT
    return _MAX_MAN_WIDTH - band.man_width, base, es_weight


def _build_band_tables() -> tuple[int, int, int]:
    """Per-``|E|`` tables packed two bits per entry into int32 constants, and the base step.

    Returns:
        ``(narrowing_table, es_table, base_step)``. Entry ``e`` (bits ``2e+1 .. 2e``) of
        ``narrowing_table`` is ``3 - m`` for ``|E| = e``, ``e = 0 … 15``; entry ``e`` of
        ``es_table`` is that band's ``es_weight / 8``. The kernel reads an entry with one
        variable shift, ``(table >> 2|E|) & 3``. For ``|E| >= 16`` the shift is clamped to 31 and
        reads the sign bit repeated: the top entry of ``narrowing_table`` (``|E| = 15``,
        narrowing 2 = 0b10) sets bit 31, so these reads give 3, i.e. ``m = 0``, which is exactly
        the denormal band. ``base_step`` is the slope of ``base = base_step * narrowing +
        es_weight``, an identity of this layout that lets the kernel get ``base`` (up to 80, too
        wide for a 2-bit entry) from the two tables.
    """
    narrowing_table = es_table = 0
    for e in range(_MAX_EXP + 1):
        narrowing, _, es_weight = _band_constants(_band_of(e))
        narrowing_table |= narrowing << (2 * e)
        es_table |= (es_weight // _ES_WEIGHT_UNIT) << (2 * e)
    steps = {(base - es) // n for n, base, es in map(_band_constants, _NORMAL_BANDS) if n}
    assert len(steps) == 1, f"base is not linear in the narrowing: {steps}"
    (base_step,) = steps
    for band in _NORMAL_BANDS:
        narrowing, base, es_weight = _band_constants(band)
        assert base == base_step * narrowing + es_weight, f"base identity fails for {band}"
        assert es_weight % _ES_WEIGHT_UNIT == 0 and 0 < es_weight // _ES_WEIGHT_UNIT <= 3
    assert narrowing_table >> _MAX_SHIFT == 1, "|E| >= 16 must read narrowing 3 (m = 0)"
    return _to_int32(narrowing_table), _to_int32(es_table), base_step


_NARROWING_TABLE, _ES_TABLE, _BASE_STEP = _build_band_tables()
_ZERO_BELOW = 2.0 ** (_MIN_DML_EXP - 1)  # 2^-23, half the smallest denormal: below it rounds to 0
assert _ZERO_BELOW == 2.0**-23  # the literal in ``_encode_kernel``
_INF_SLOT_MANTISSA = (1 << _band_of(_MAX_EXP).man_width) - 1  # 0x6F is E = 15 with all mantissa bits set
_INF_SLOT_VALUE = 2.0**_MAX_EXP * (1 + _INF_SLOT_MANTISSA / (_INF_SLOT_MANTISSA + 1))  # 49152
assert _normal_payload(_MAX_EXP, _INF_SLOT_MANTISSA) == HIF8_POS_INF_CODE
assert HIF8_OVERFLOW_THRESHOLD == (HIF8_MAX + _INF_SLOT_VALUE) / 2

# Decoder constants (the same layout read the other way).
_DOT2_SHIFT = _PAYLOAD_BITS - 2  # payload >> 5: the Dot if it is 2 bits long, else 0
_FIRST_ES_PAYLOAD = 1 << (_PAYLOAD_BITS - 3)  # 16: smallest payload under Dot 001 (first with Es)
_MAX_DML_PAYLOAD = (1 << (_PAYLOAD_BITS - _DML_PREFIX_LEN)) - 1  # 7: largest denormal payload


def _check_decoder_constants() -> None:
    """The decoder reads each band's narrowing and Es weight from the Dot's first two bits."""
    for band in _NORMAL_BANDS:
        narrowing, _, es_weight = _band_constants(band)
        dot2 = band.prefix if band.prefix_len == 2 else 0
        assert narrowing == max(dot2 - 1, 0) and es_weight == _ES_WEIGHT_UNIT << min(dot2, 1), band


_check_decoder_constants()

# The compiled encoder runs on [R, _TILE_C] tiles with a static inner width (see ``encode``).
_TILE_C = 1024
_bound_rows: dict[tuple[bool, torch.device], torch.Tensor] = {}


def _bound_row(saturate: bool, device: torch.device) -> torch.Tensor:
    """The clamp bound as a ``float32`` row of ``_TILE_C`` equal entries, cached per device.

    ``49152`` (the Inf slot 0x6F read as a normal value, 1.5·2^15) makes every |x| ≥ 40960 and
    ±Inf round to 0x6F; ``32768`` (HIF8_MAX, code 0x6E) saturates them. NaN is handled apart.
    """
    key = (saturate, device)
    row = _bound_rows.get(key)
    if row is None:
        value = HIF8_MAX if saturate else _INF_SLOT_VALUE
        row = torch.full((_TILE_C,), value, dtype=torch.float32, device=device)
        with _cache_lock:
            row = _bound_rows.setdefault(key, row)
    return row


# ---------------------------------------------------------------------------------------------
# Kernels (element-wise, vectorised; ``fused`` uses a torch.compile twin where it works).


@fused(static_dims={0: (1,), 1: (0,)})
def _encode_kernel(x_RC: torch.Tensor, bound_C: torch.Tensor) -> torch.Tensor:
    """FP32 ``x_RC`` → ``uint8`` HiF8 codes with TA rounding (docs/formats.md §1.5). See ``encode``.

    Branch-free integer arithmetic on the FP32 bit patterns and no table gathers, so that the
    compiled twin is a single vectorised loop (``at::vec`` on CPU). Per element, with ``E`` the
    unbiased FP32 exponent and ``m`` the mantissa width of the band that holds ``|E|``:

    1. ``mag = min(|bits|, bits(bound))``: |x| ≥ 40960 and ±Inf become the bound, which rounds
       to 0x6F (Inf), or is 0x6E (32768) when saturating (§1.5 step 3). Non-negative floats
       order like their bit patterns, so the clamp is an integer minimum.
    2. ``narrowing = 3 - m``, read from a 2-bit-per-entry table packed in one int32 constant by
       a variable shift of ``2|E|`` (``_build_band_tables``); ``|E| >= 16`` reads ``m = 0``.
    3. Nearest, ties away from zero: add half a HiF8 ulp, ``2^(19 + narrowing)`` FP32 mantissa
       LSBs, to the magnitude's bit pattern (step 6): the first dropped bit decides, and a carry
       out of the mantissa increments the exponent field by itself. The dropped bits stay in
       place and are shifted out in 5.
    4. The rounded exponent ``E'`` (``E``, or ``E + 1`` after a carry) selects the band ``m'``
       that packs the result, from the same tables.
    5. ``y = (|E'| << m') | M'``: the biased exponent field is swapped for ``|E'|`` and the
       ``23 - m'`` low bits are shifted out. The payload is ``y + base + Es * es_weight`` with
       ``base = 32 * narrowing' + es_weight`` (``_band_constants``).
    6. Denormal band (``m' = 0``, ``E' <= -16``, where the table index saturates at 31):
       payload ``E' + 23``, at least 1 so that [2^-23, 2^-22) gives 2^-22 (step 5). Last the
       sign bit, except for zero (|x| < 2^-23 → 0x00, steps 2 and 4), and NaN → 0x80 (step 1);
       these two tests compare floats (cheaper than integer ones in the compiled loop: their
       constants stay in memory operands).

    Args:
        x_RC: ``float32`` tensor ``[R, C]``, contiguous.
        bound_C: ``float32`` tensor ``[C]``, every entry the clamp bound of step 1, ``49152.0``
            or ``32768.0`` (``_bound_row``). A row rather than a scalar: it keeps the compiled
            twin a two-level loop whose inner trip count ``C`` is a compile-time constant
            (see ``encode``).

    Returns:
        ``uint8`` codes ``[R, C]``.
    """
    bits_RC = x_RC.view(torch.int32)
    abs_RC = bits_RC & 0x7FFFFFFF
    mag_RC = torch.minimum(abs_RC, bound_C.view(torch.int32))
    exp_RC = (mag_RC >> _FP32_MAN_BITS) - _FP32_BIAS
    narrowing_RC = (_NARROWING_TABLE >> torch.clamp(exp_RC.abs() * 2, max=_MAX_SHIFT)) & 3
    sum_RC = mag_RC + (_HALF_ULP_FINEST << narrowing_RC)
    field_RC = sum_RC >> _FP32_MAN_BITS  # biased exponent of the rounded magnitude
    rexp_RC = field_RC - _FP32_BIAS
    rmag_RC = rexp_RC.abs()
    index_RC = torch.clamp(rmag_RC * 2, max=_MAX_SHIFT)
    rnarrowing_RC = (_NARROWING_TABLE >> index_RC) & 3
    es_weight_RC = ((_ES_TABLE >> index_RC) & 3) * _ES_WEIGHT_UNIT
    # Adding (|E'| - field) * 2^23 swaps the exponent field for |E'|. A multiply rather than a
    # shift because the factor is negative when E' >= 0; compilers emit a shift for it anyway.
    swapped_RC = sum_RC + (rmag_RC - field_RC) * (1 << _FP32_MAN_BITS)
    y_RC = swapped_RC >> (rnarrowing_RC + _ROUND_SHIFT_FINEST)
    # base + Es * es_weight, with base = 32 * narrowing + es_weight (``_build_band_tables``).
    es_part_RC = torch.where(rexp_RC < 0, es_weight_RC + es_weight_RC, es_weight_RC)
    normal_RC = y_RC + rnarrowing_RC * _BASE_STEP + es_part_RC
    dml_RC = torch.clamp(_DML_EXP_OFFSET - rmag_RC, min=1)  # E' + 23, as E' = -|E'| here
    # The table index saturates (|E'| >= 16) exactly in the denormal band.
    code_RC = torch.where(index_RC == _MAX_SHIFT, dml_RC, normal_RC)
    code_RC = torch.where(bits_RC < 0, code_RC | 0x80, code_RC)
    # 2^-23 (= _ZERO_BELOW) written as a literal: torch.compile turns a global Python float into a
    # run-time input, which costs a load and a conversion per iteration.
    code_RC = torch.where(x_RC.abs() < 2.0**-23, HIF8_ZERO_CODE, code_RC)
    code_RC = torch.where(x_RC != x_RC, HIF8_NAN_CODE, code_RC)
    # Narrowed through float32 (exact for 0..255): compiled CPU code converts float → uint8 with
    # vector instructions but int32 → uint8 one element at a time.
    return code_RC.float().to(torch.uint8)


@fused
def _decode_kernel(code_N: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``uint8`` HiF8 codes → values of ``out_dtype`` (exact, see ``decode``).

    The inverse of ``_encode_kernel``'s packing, again branch-free integer arithmetic: the FP32
    bit pattern is assembled from the code's fields and reinterpreted. With ``p`` the 7-bit
    payload: its top two bits are the Dot for ``|E| >= 2`` (01, 10, 11 → ``narrowing`` 0, 1, 2)
    and 0 for the longer Dots 001/0001 (``narrowing`` 0, ``m = 3``); the Es bit weighs 16 under
    a 2-bit Dot and 8 under 001; then ``y = (|E| << m) | M = p - base - Es * es_weight`` and
    ``y << (20 + narrowing)`` is ``|E|`` in the FP32 exponent field followed by ``M`` at the top
    of the mantissa. Denormal payloads 1..7 are ``2^(p - 23)``, payload 0 is zero, 0x6F/0xEF
    are ±Inf and 0x80 is NaN.

    Args:
        code_N: ``uint8`` codes ``[N]``.
        out_dtype: floating dtype of the result.

    Returns:
        ``[N]`` tensor of ``out_dtype``.
    """
    code_N = code_N.to(torch.int32)
    payload_N = code_N & 0x7F
    dot2_N = payload_N >> _DOT2_SHIFT
    narrowing_N = torch.clamp(dot2_N - 1, min=0)
    es_weight_N = _ES_WEIGHT_UNIT << torch.clamp(dot2_N, max=1)
    es_bit_N = torch.where(payload_N >= _FIRST_ES_PAYLOAD, payload_N & es_weight_N, 0)
    y_N = payload_N - narrowing_N * _BASE_STEP - es_weight_N - es_bit_N
    z_N = y_N << (narrowing_N + _ROUND_SHIFT_FINEST)  # |E| << 23 | M << (23 - m)
    # A negative exponent (Es = 1) subtracts |E| from the bias instead of adding it.
    signed_N = torch.where(es_bit_N > 0, z_N - ((z_N >> _FP32_MAN_BITS) << (_FP32_MAN_BITS + 1)), z_N)
    normal_N = signed_N + (_FP32_BIAS << _FP32_MAN_BITS)
    dml_N = torch.where(payload_N > 0, (payload_N + _FP32_BIAS - _DML_EXP_OFFSET) << _FP32_MAN_BITS, 0)
    bits_N = torch.where(payload_N > _MAX_DML_PAYLOAD, normal_N, dml_N)
    bits_N = torch.where(payload_N == HIF8_POS_INF_CODE, _FP32_INF_BITS, bits_N)
    bits_N = torch.where(code_N > 0x7F, bits_N | _FP32_SIGN_BIT, bits_N)
    bits_N = torch.where(code_N == HIF8_NAN_CODE, _FP32_NAN_BITS, bits_N)
    return bits_N.view(torch.float32).to(out_dtype)


@fused(static_dims={0: (1,), 1: (0,)})
def _encode_scaled_kernel(
    x_RC: torch.Tensor, bound_C: torch.Tensor, scale: torch.Tensor, with_values: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_encode_kernel(x_RC.float() / scale)`` in one pass, plus the decoded FP32 codes when asked.

    Args:
        x_RC: ``[R, C]`` float32/bfloat16/float16 tiles.
        bound_C: As ``_encode_kernel``.
        scale: 0-d FP32 divisor (the current-scaling scale).
        with_values: Also return ``_decode_kernel(codes, float32)``.

    Returns:
        ``(codes_RC uint8, values_RC float32 or None)``.
    """
    codes_RC = _encode_kernel.eager(x_RC.to(torch.float32) / scale, bound_C)
    return codes_RC, (_decode_kernel.eager(codes_RC, torch.float32) if with_values else None)


# ---------------------------------------------------------------------------------------------
# Public API.


def encode(x: torch.Tensor, *, saturate: bool = False) -> torch.Tensor:
    """Encode a floating tensor to HiF8 codes with TA rounding (nearest, ties away from zero).

    The input is first converted to FP32 (exact for BF16/FP16/FP8/FP32). An FP64 input is
    therefore rounded twice (to FP32 with round-half-even, then to HiF8); the result can differ
    from a direct FP64 → HiF8 rounding only for values within half an FP32 ulp of a HiF8 midpoint.
    Rules (docs/formats.md "Decisions" and §1.5): NaN → 0x80; ±0 → 0x00; |x| ≥ 40960 → ±Inf
    (0x6F/0xEF); [2^-23, 2^-22) → 2^-22 (0x01/0x81); |x| < 2^-23, FP32 subnormals included →
    0x00 (the sign is dropped: HiF8 has only one zero code).

    Args:
        x: Tensor of any shape, floating dtype, on any device.
        saturate: If True, finite overflow (|x| ≥ 40960) and ±Inf map to ±32768 (0x6E/0xEE)
            instead of ±Inf; NaN still maps to 0x80. Default False (Inf on overflow, like the
            reference codecs cited in docs/formats.md §1.5).

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
    n = x_N.numel()
    if n == 0:
        return torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    # [R, 1024] tiles plus a ragged tail: with the inner width pinned (and the bound passed as a
    # row, which keeps the two loop levels apart) the compiled kernel's inner loop has a constant
    # trip count. With one flat dynamic loop the CPU compiler re-reads the loop bound after every
    # store inside the OpenMP region and rebuilds the kernel's constants on each iteration.
    bound_C = _bound_row(saturate, x_N.device)
    rows = n // _TILE_C
    code_parts = []
    if rows:
        x_RC = x_N[: rows * _TILE_C].view(rows, _TILE_C)
        code_parts.append(_encode_kernel(x_RC, bound_C).reshape(-1))
    tail = n - rows * _TILE_C
    if tail:  # fewer than _TILE_C elements: below MIN_FUSED_NUMEL, so ``fused`` runs them eagerly
        code_parts.append(_encode_kernel(x_N[rows * _TILE_C :].view(1, tail), bound_C[:tail]).reshape(-1))
    code_N = code_parts[0] if len(code_parts) == 1 else torch.cat(code_parts)
    return code_N.reshape(x.shape)


def encode_scaled(
    x: torch.Tensor, scale: torch.Tensor, *, with_values: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``encode(x.float() / scale)`` (and ``decode`` of the result) in one pass over ``x``.

    What a current-scaling quantizer does with a per-tensor scale, fused: the conversion to FP32,
    the IEEE division and the encoding run in one kernel, and the decoded FP32 values are written
    beside the codes when ``with_values`` (the emulated GEMMs consume them; docs/performance.md).
    Bit-identical to the separate calls.

    Args:
        x: float32/bfloat16/float16 tensor of any shape.
        scale: 0-d float32 tensor on ``x``'s device (> 0).
        with_values: Also return ``decode(codes, torch.float32)``.

    Returns:
        ``(codes uint8, values float32 or None)``, both with ``x``'s shape.

    Raises:
        TypeError: for a non-floating ``x`` or a ``scale`` that is not a 0-d float32 tensor.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"encode_scaled: x must be a floating tensor, got {getattr(x, 'dtype', type(x).__name__)}.")
    if not isinstance(scale, torch.Tensor) or scale.dim() != 0 or scale.dtype != torch.float32:
        got = (scale.dtype, tuple(scale.shape)) if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(f"encode_scaled: scale must be a 0-d torch.float32 tensor, got {got}.")
    x_N = x.detach().contiguous().reshape(-1)
    n = x_N.numel()
    rows = n // _TILE_C
    if rows == 0 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        codes = encode(x.detach().to(torch.float32) / scale)
        return codes, (decode(codes, torch.float32) if with_values else None)
    bound_C = _bound_row(False, x_N.device)
    codes_RC, values_RC = _encode_scaled_kernel(x_N[: rows * _TILE_C].view(rows, _TILE_C), bound_C, scale, with_values)
    code_parts, value_parts = [codes_RC.reshape(-1)], [values_RC.reshape(-1)] if with_values else []
    if n > rows * _TILE_C:  # the ragged tail (< _TILE_C elements) runs eagerly
        tail_codes = encode(x_N[rows * _TILE_C :].to(torch.float32) / scale)
        code_parts.append(tail_codes)
        if with_values:
            value_parts.append(decode(tail_codes, torch.float32))
    codes = (code_parts[0] if len(code_parts) == 1 else torch.cat(code_parts)).reshape(x.shape)
    if not with_values:
        return codes, None
    return codes, (value_parts[0] if len(value_parts) == 1 else torch.cat(value_parts)).reshape(x.shape)


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
    return _decode_kernel(code_N, dtype).reshape(codes.shape)
