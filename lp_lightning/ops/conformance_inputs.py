"""Deterministic inputs with labelled edge elements for :mod:`lp_lightning.ops.conformance` (docs/acceptance.md).

Each input is a high-precision tensor and, per label, the mask of its edge elements: for MXFP8 an
``[80, cols]`` grid of 32x32 tiles (exact E4M3 ties, an all-zero block, blocks holding NaN / ±Inf,
the smallest E8M0 scales and FP32 subnormals, blocks near the FP32 maximum, and a partial row tile);
for HiF8 the codec's specials under scale 1 (ties of every mantissa band, [2^-23, 2^-22), the
overflow threshold, zeros and subnormals, ±Inf, NaN), exact midpoints under a power-of-two scale,
values next to a rounding boundary under a non-power-of-two scale, and a 3-D weight whose groups
are each scaled on their own. The labels are what the open-question verdicts read back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["EdgeInput", "edge_generator", "hif8_inputs", "mx_input", "wide_random"]

_SEED = 20260424


@dataclass
class EdgeInput:
    """A high-precision input and the masks of its edge elements (label → bool mask of ``x``'s shape)."""

    x: torch.Tensor
    labels: dict[str, torch.Tensor]


def edge_generator() -> torch.Generator:
    return torch.Generator().manual_seed(_SEED)


def wide_random(gen: torch.Generator, shape: tuple[int, ...], low: int = -6, high: int = 6) -> torch.Tensor:
    """Gaussian values times a per-row power of two in [2^low, 2^high] (exercises many scales)."""
    rows = shape[0] if len(shape) == 2 else math.prod(shape[:-1])
    exponents = torch.randint(low, high + 1, (rows, 1), generator=gen).to(torch.float32)
    x = torch.randn((rows, shape[-1]), generator=gen) * torch.exp2(exponents)
    return x.reshape(shape)


def _mx_tile(kind: str, gen: torch.Generator, rows: int) -> tuple[torch.Tensor, str | None]:
    """A ``[rows, 32]`` tile of one edge kind and its label; a 32x32 tile is one block in both orientations."""
    eye = torch.zeros((rows, 32), dtype=torch.bool)
    eye[torch.arange(rows), torch.arange(rows) % 32] = True
    if kind == "ties":  # amax 448 per block (scale 2^0), the rest exact E4M3 midpoints of both signs
        ties = torch.tensor([t * 2.0**e for t in (1.0625, 1.1875, 1.3125) for e in range(-6, 8)]
                            + [2.0**-10, 1.5 * 2.0**-9, 2.5 * 2.0**-9, 3.5 * 2.0**-9])
        pick = torch.randint(0, ties.numel(), (rows, 32), generator=gen)
        sign = torch.where(torch.rand((rows, 32), generator=gen) < 0.5, -1.0, 1.0)
        return torch.where(eye, 448.0, ties[pick] * sign), "tie"
    if kind == "zero":
        return torch.zeros((rows, 32)), "zero_block"
    if kind in ("nan", "+inf", "-inf"):
        special = {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf}[kind]
        return torch.where(eye, special, torch.randn((rows, 32), generator=gen)), f"{kind}_block"
    if kind == "tiny":  # the smallest E8M0 scales (2^-127 clamps) and FP32 subnormal inputs
        exponents = torch.randint(-149, -108, (rows, 32), generator=gen).to(torch.float32)
        return torch.exp2(exponents) * torch.where(torch.rand((rows, 32), generator=gen) < 0.5, -1.0, 1.0), "tiny_block"
    if kind == "fp32_max":  # within 3 % of the FP32 maximum (RCEIL's one overflow case)
        return (torch.rand((rows, 32), generator=gen) * 0.02 + 0.975) * 3.4e38, "fp32_max_block"
    return wide_random(gen, (rows, 32)), None


_MX_TILES = (("ties", "zero", "random"), ("nan", "+inf", "-inf"), ("tiny", "fp32_max", "random"))


def mx_input(dtype: torch.dtype, cols: int = 96) -> EdgeInput:
    """``[80, cols]``: tile rows 0–31, 32–63 and a partial 64–79, tile columns of 32 (module docstring)."""
    gen = edge_generator()
    x = torch.empty((80, cols))
    labels: dict[str, torch.Tensor] = {}
    for ti, (r0, r1) in enumerate(((0, 32), (32, 64), (64, 80))):
        for tj in range(cols // 32):
            tile, label = _mx_tile(_MX_TILES[ti][tj], gen, r1 - r0)
            x[r0:r1, 32 * tj: 32 * tj + 32] = tile
            if label is not None:
                mask = labels.setdefault(label, torch.zeros(x.shape, dtype=torch.bool))
                mask[r0:r1, 32 * tj: 32 * tj + 32] = True
    x = x.to(dtype)
    if "tie" in labels:  # the amax elements are exact, not ties
        labels["tie"] &= x.abs().to(torch.float32) != 448.0
    return EdgeInput(x, labels)


def _hif8_specials() -> dict[str, list[float]]:
    """HiF8 edge values under scale 1.0 (the quantizer's scale when amax is not finite)."""
    ties = [t * s for s in (1.0, -1.0) for t in (
        1.0625, 1.1875, 2.125, 4.25, 8.5, 14.5, 18.0, 320.0, 0.53125, 1.125 * 2**-4, 1.25 * 2**-8, 1.5 * 2**-18,
        1.5 * 2**-22, 5120.0, 28672.0)]
    sub = [2.0**-23, 1.5 * 2**-23, 1.999 * 2**-23, -(2.0**-23), -1.25 * 2**-23]
    overflow = [40960.0, 1e9, -40960.0]
    below = [40959.99, -40959.99, 32768.0]
    tiny = [2.0**-24, 1e-40, -1e-40, 0.0, -0.0]
    groups = {"tie": ties, "sub_2^-22": sub, "overflow": overflow, "below_overflow": below, "zero_or_tiny": tiny,
              "+inf": [math.inf], "-inf": [-math.inf], "nan": [math.nan]}
    return groups


def _labelled(shape: tuple[int, ...], gen: torch.Generator, groups: dict[str, list[float]], dtype: torch.dtype,
              scale: float = 1.0, fill: Callable[[], torch.Tensor] | None = None) -> EdgeInput:
    """Random finite values (``fill``) with the labelled values ``groups`` (times ``scale``) at fixed places."""
    x = (fill() if fill is not None else torch.randn(shape, generator=gen)).reshape(-1).clone()
    labels: dict[str, torch.Tensor] = {}
    position = 0
    stride = max(1, x.numel() // max(1, sum(len(v) for v in groups.values())) - 1)
    assert stride * sum(len(v) for v in groups.values()) <= x.numel(), "conformance: too many edge values"
    for label, values in groups.items():
        mask = torch.zeros(x.numel(), dtype=torch.bool)
        for value in values:
            x[position] = value * scale
            mask[position] = True
            position += stride
        labels[label] = mask.reshape(shape)
    x = x.reshape(shape).to(dtype)
    return EdgeInput(x, labels)


_HIF8_TIES = (1.0625, 1.1875, 2.125, 4.25, 8.5, 14.5, 0.53125, 1.125 * 2**-4, 1.25 * 2**-8)
"""HiF8 midpoints in the 3-, 2- and 1-bit mantissa bands (below 15, so they fit under amax 15 · scale)."""


def _hif8_input(kind: str, shape: tuple[int, int], dtype: torch.dtype, gen: torch.Generator) -> EdgeInput:
    """One HiF8 input of ``shape`` (module docstring); ``"amax"`` is placed first, so every input holds it.

    - ``specials``: scale 1 (amax is not finite): ties of every band, [2^-23, 2^-22), the overflow
      threshold, zeros and FP32 subnormals, ±Inf and NaN, as the codec sees them;
    - ``ties``: amax 15 · 2^-3, so the scale is exactly 2^-3 and each x / scale an exact midpoint;
    - ``near_ties``: amax 3.7, a non-power-of-two scale; x = fl32(m · scale) and its FP32 neighbours
      for midpoints m sit next to a rounding boundary (the division's last bit decides the code).
    """
    numel = shape[0] * shape[1]
    if kind == "specials":
        return _labelled(shape, gen, _hif8_specials(), dtype)
    if kind == "ties":
        ties = [t * s for s in (1.0, -1.0) for t in (*_HIF8_TIES, 1.5 * 2**-18, 1.5 * 2**-22)]
        groups = {"amax": [15.0], "tie": ties, "sub_2^-22": [2.0**-23, 1.5 * 2**-23]}
        return _labelled(shape, gen, groups, dtype, scale=2.0**-3,
                         fill=lambda: (torch.rand(numel, generator=gen) * 2 - 1) * 1.8)
    scale = torch.tensor(3.7, dtype=torch.float32) / 15.0
    near = []
    for m in _HIF8_TIES:
        centre = torch.tensor(m, dtype=torch.float32) * scale
        near += [float(torch.nextafter(centre, torch.tensor(-math.inf))), float(centre),
                 float(torch.nextafter(centre, torch.tensor(math.inf)))]
    return _labelled(shape, gen, {"amax": [3.7], "near_tie": near}, torch.float32,
                     fill=lambda: (torch.rand(numel, generator=gen) * 2 - 1) * 3.6)


def hif8_inputs(dtype: torch.dtype) -> dict[str, EdgeInput]:
    """The HiF8 inputs of :func:`_hif8_input`, 2-D, and a 3-D ``[4, 16, 24]`` weight whose groups are
    ``ties``, ``specials``, all zero (scale 1) and ``near_ties``, each scaled on its own."""
    gen = edge_generator()
    inputs = {kind: _hif8_input(kind, shape, dtype, gen)
              for kind, shape in (("specials", (16, 64)), ("ties", (32, 48)), ("near_ties", (32, 48)))}
    parts = [_hif8_input("ties", (16, 24), dtype, gen), _hif8_input("specials", (16, 24), dtype, gen),
             EdgeInput(torch.zeros((16, 24), dtype=dtype), {}), _hif8_input("near_ties", (16, 24), dtype, gen)]
    labels: dict[str, torch.Tensor] = {}
    for index, part in enumerate(parts):
        for label, mask in part.labels.items():
            labels.setdefault(label, torch.zeros((4, 16, 24), dtype=torch.bool))[index] = mask
    inputs["grouped"] = EdgeInput(torch.stack([p.x.to(torch.float32) for p in parts]), labels)
    for item in inputs.values():
        item.labels.pop("amax", None)
    return inputs
