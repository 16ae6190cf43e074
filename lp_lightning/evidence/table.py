"""The number-format table of docs/numerics.md §2 (section 二), derived from bit patterns, plus E8M0 and HiF8.

docs/numerics.md §2 lists max / min normal / min subnormal / ε for FP32, FP16, BF16, E4M3 and E5M2 from
the formulas ``x_max = (2 − 2^-M)·2^(2^(E−1)−1)`` etc., and §9.1 (九.1) checks them by building
each boundary value from its bit pattern. Here every 8- and 16-bit format is derived by
*enumerating all of its bit patterns* (``torch.arange`` viewed as the format's dtype, or the HiF8
decoder for HiF8) and reading the quantities off the decoded values; nothing comes from
``torch.finfo`` (the tests compare against it). FP32 is derived from its exponent/mantissa
widths, because enumerating 2^32 patterns is too slow; the tests check it against ``torch.finfo``.

The MXFP8 recipe's two components are rows of their own: ``fp8_e4m3fn`` (elements) and ``e8m0``
(one power-of-two scale per 32 elements, OCP MX v1.0 §5.4.1); HiF8 is the ``hif8`` row.

Tensor-name legend for this file:
    value_P      decoded values of all P bit patterns of a format, float64
    subnormal_P  bool, True where the bit pattern is a subnormal/denormal one (per the layout)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from lp_lightning.formats import hif8

__all__ = ["FormatInfo", "format_info", "format_table", "format_table_markdown"]


@dataclass(frozen=True, slots=True, kw_only=True)
class FormatInfo:
    """Key quantities of one number format, derived from its bit patterns.

    Attributes:
        name: Short format name (``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp8_e4m3fn"``,
            ``"fp8_e5m2"``, ``"e8m0"``, ``"hif8"``).
        bits: Storage width in bits.
        layout: Sign/exponent/mantissa widths as text, e.g. ``"1/8/7"``; HiF8's is tapered.
        max: Largest finite value.
        min_normal: Smallest positive value whose bit pattern is normal (not subnormal /
            denormal). Equals ``min_subnormal`` for a format without subnormals (E8M0).
        min_subnormal: Smallest positive value (a subnormal/denormal where the format has them).
        eps: Spacing at 1.0, i.e. (smallest value > 1) − 1 (machine epsilon, docs/numerics.md §2.1).
            The unit roundoff of round-to-nearest is ``eps / 2``.
        binades: Number of binades [2^k, 2^(k+1)) that hold at least one positive finite
            value: ``floor(log2(max)) − floor(log2(min_subnormal)) + 1``, which is
            ``floor(log2(max / min_subnormal)) + 1`` because every ``min_subnormal`` here is a
            power of two (HiF8: 15 − (−22) + 1 = 38, the HiF8 paper's "31 → 38 binades").
        finite_count: Number of distinct finite real values, zero included once: IEEE-style
            formats have two zero patterns (±0) that count as one value; HiF8 has a single zero
            code; E8M0 has no zero at all.
        has_inf: Whether the format encodes ±Inf (FP8 E4M3 "fn" and E8M0 do not).
    """

    name: str
    bits: int
    layout: str
    max: float
    min_normal: float
    min_subnormal: float
    eps: float
    binades: int
    finite_count: int
    has_inf: bool


def _binades(max_value: float, min_subnormal: float) -> int:
    return math.floor(math.log2(max_value)) - math.floor(math.log2(min_subnormal)) + 1


def _from_patterns(
    name: str, bits: int, layout: str, value_P: torch.Tensor, subnormal_P: torch.Tensor
) -> FormatInfo:
    """Read a FormatInfo off the decoded values of every bit pattern of a format."""
    finite_P = torch.isfinite(value_P)
    positive_P = finite_P & (value_P > 0)
    above_one_P = finite_P & (value_P > 1)
    max_value = value_P[finite_P].max().item()
    min_subnormal = value_P[positive_P].min().item()
    return FormatInfo(
        name=name,
        bits=bits,
        layout=layout,
        max=max_value,
        min_normal=value_P[positive_P & ~subnormal_P].min().item(),
        min_subnormal=min_subnormal,
        eps=value_P[above_one_P].min().item() - 1.0,
        binades=_binades(max_value, min_subnormal),
        finite_count=int(torch.unique(value_P[finite_P]).numel()),  # unique() merges −0 and +0
        has_inf=bool(torch.isinf(value_P).any()),
    )


def _torch_format(
    name: str, view_dtype: torch.dtype, exp_bits: int, man_bits: int, *, sign_bits: int = 1
) -> FormatInfo:
    """Enumerate all patterns of an 8/16-bit torch dtype with the given field widths."""
    bits = sign_bits + exp_bits + man_bits
    storage = {8: torch.uint8, 16: torch.int16}[bits]
    pattern_P = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32) if bits == 16 else torch.arange(256)
    value_P = pattern_P.to(storage).view(view_dtype).to(torch.float64)
    unsigned_P = pattern_P & ((1 << bits) - 1)
    exp_field_P = (unsigned_P >> man_bits) & ((1 << exp_bits) - 1)
    man_field_P = unsigned_P & ((1 << man_bits) - 1)
    # IEEE-style layout: exponent field 0 with a non-zero mantissa is subnormal (docs/numerics.md §2.1).
    subnormal_P = (exp_field_P == 0) & (man_field_P != 0)
    return _from_patterns(name, bits, f"{sign_bits}/{exp_bits}/{man_bits}", value_P, subnormal_P)


def _ieee_from_widths(name: str, exp_bits: int, man_bits: int) -> FormatInfo:
    """An IEEE-754 binary format (subnormals, ±0, ±Inf, NaN) from its field widths alone.

    docs/numerics.md §2.1: bias = 2^(E−1) − 1, max = (2 − 2^−M)·2^bias, min normal = 2^(1−bias),
    min subnormal = 2^(1−bias−M), ε = 2^−M. Finite patterns: 2 signs × (2^E − 1) exponent fields
    × 2^M mantissas, minus one for the duplicate zero.
    """
    bias = (1 << (exp_bits - 1)) - 1
    min_subnormal = 2.0 ** (1 - bias - man_bits)
    max_value = (2.0 - 2.0**-man_bits) * 2.0**bias
    return FormatInfo(
        name=name,
        bits=1 + exp_bits + man_bits,
        layout=f"1/{exp_bits}/{man_bits}",
        max=max_value,
        min_normal=2.0 ** (1 - bias),
        min_subnormal=min_subnormal,
        eps=2.0**-man_bits,
        binades=_binades(max_value, min_subnormal),
        finite_count=2 * ((1 << exp_bits) - 1) * (1 << man_bits) - 1,
        has_inf=True,
    )


def _hif8_format() -> FormatInfo:
    """HiF8 from the codec's decoder over all 256 codes (docs/formats.md §1.2–1.4)."""
    code_P = torch.arange(256, dtype=torch.uint8)
    value_P = hif8.decode(code_P, torch.float64)
    # Dot ``0000`` (the payload's top 4 bits zero) marks the denormals, docs/formats.md §1.2.
    subnormal_P = ((code_P & 0x7F) >> 3 == 0) & ((code_P & 0x07) != 0)
    layout = "1/Dot/tapered (3,2,1 mantissa bits; 0 in denormals)"
    return _from_patterns("hif8", 8, layout, value_P, subnormal_P)


@functools.cache
def _table() -> tuple[FormatInfo, ...]:
    return (
        _ieee_from_widths("fp32", 8, 23),
        _torch_format("bf16", torch.bfloat16, 8, 7),
        _torch_format("fp16", torch.float16, 5, 10),
        _torch_format("fp8_e4m3fn", torch.float8_e4m3fn, 4, 3),
        _torch_format("fp8_e5m2", torch.float8_e5m2, 5, 2),
        _torch_format("e8m0", torch.float8_e8m0fnu, 8, 0, sign_bits=0),
        _hif8_format(),
    )


def format_table() -> list[FormatInfo]:
    """Every format lp-lightning meets, in the order FP32, BF16, FP16, E4M3, E5M2, E8M0, HiF8.

    Returns:
        A new list of frozen ``FormatInfo`` rows (computed once per process, in well under 1 s).
    """
    return list(_table())


def format_info(name: str) -> FormatInfo:
    """The ``FormatInfo`` row called ``name``.

    Args:
        name: One of ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp8_e4m3fn"``, ``"fp8_e5m2"``,
            ``"e8m0"``, ``"hif8"``.

    Raises:
        ValueError: for any other name.
    """
    rows = {row.name: row for row in _table()}
    if name not in rows:
        raise ValueError(f"format_info: name={name!r} is not in the table; allowed: {sorted(rows)}.")
    return rows[name]


def _fmt(value: float) -> str:
    """Integers below 10^6 as integers, powers of two as ``2^k (≈ 1.2e-07)``, else 4 digits."""
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    mantissa, exponent = math.frexp(value)
    if mantissa == 0.5:
        return f"2^{exponent - 1} (≈{value:.3g})"
    return f"{value:.4g}"


def format_table_markdown() -> str:
    """The format table as a GitHub-flavoured Markdown table (one row per format)."""
    header = (
        "| format | bits | layout S/E/M | max | min normal | min subnormal | eps (spacing at 1) "
        "| binades | finite values | Inf |"
    )
    lines = [header, "|---" * (header.count("|") - 1) + "|"]
    for row in _table():
        lines.append(
            f"| {row.name} | {row.bits} | {row.layout} | {_fmt(row.max)} | {_fmt(row.min_normal)} | "
            f"{_fmt(row.min_subnormal)} | {_fmt(row.eps)} | {row.binades} | {row.finite_count} | "
            f"{'yes' if row.has_inf else 'no'} |"
        )
    return "\n".join(lines)
