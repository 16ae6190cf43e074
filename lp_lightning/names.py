"""Config-level names: the product's low-precision formats and the parser of ``str`` Enums.

Pure Python (no torch, no package import), for the configuration layer (:mod:`lp_lightning.policy`,
which must stay torch-free). :class:`LowPrecisionFormat` holds the formats a ``--precision`` value
selects, with the same values as their entries in :mod:`lp_lightning.formats.registry` (tested);
below the config layer a format is its ``FormatSpec``, which equals its name, so a member parsed
from YAML compares equal to the spec the quantizers and backends use.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

__all__ = ["LowPrecisionFormat", "parse_enum"]

_E = TypeVar("_E", bound=Enum)


def parse_enum(enum_cls: type[_E], value: _E | str, *, argument: str, what: str) -> _E:
    """``value`` as a member of ``enum_cls`` (the member itself, or its string value).

    Args:
        enum_cls: A ``str``-valued Enum.
        value: A member or its value.
        argument: The argument's name, used in the error (e.g. ``"format"``).
        what: What the members are, used in the error (e.g. ``"a low-precision format"``).

    Raises:
        ValueError: ``value`` is not a member's value; the message names the legal values.
    """
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value)
    except ValueError:
        legal = ", ".join(repr(member.value) for member in enum_cls)
        raise ValueError(f"{argument}={value!r} is not {what}; legal values: {legal}.") from None


class LowPrecisionFormat(str, Enum):
    """Element format of the low-precision GEMM operands (design spec §3, §4.2, §13.1)."""

    MXFP8_E4M3 = "mxfp8_e4m3"
    """OCP MX FP8: E4M3 elements with one E8M0 scale per 32-element block (OCP MX v1.0 §5)."""
    HIF8 = "hif8"
    """HiFloat8 codes (arXiv 2409.16626) with an FP32 current-scaling scale (per tensor, or per
    leading group of a 3-D weight)."""

    @classmethod
    def parse(cls, value: LowPrecisionFormat | str) -> LowPrecisionFormat:
        """Accept the enum or its string value; anything else raises naming the legal values.

        Raises:
            ValueError: if ``value`` is not a legal format.
        """
        return parse_enum(cls, value, argument="format", what="a low-precision format")
