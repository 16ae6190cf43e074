"""Shared by the low-precision autograd tests: persistent weights and the hand-composed GEMM references."""

from __future__ import annotations

import torch

from lp_lightning.formats import QuantizedOperand, hif8, recipe_for
from lp_lightning.tensor import QuantizedWeightTensor


def lp_weight(master: torch.Tensor, fmt: str, kind: str = "dense", fqn: str = "") -> QuantizedWeightTensor:
    """The persistent low-precision weight of ``master`` (a requires-grad leaf; the master is shared)."""
    return QuantizedWeightTensor.from_master(master, recipe=recipe_for(fmt), kind=kind, fqn=fqn, requires_grad=True)


def reference_gemm(left: QuantizedOperand, right: QuantizedOperand, layout: str, output_dtype: torch.dtype) -> torch.Tensor:
    """Hand-composed from the format layer: MX dequantize / HiF8 decode, FP32 matmul, HiF8 scales, one rounding."""
    values = [
        op.dequantize(torch.float32) if op.format.name == "mxfp8_e4m3" else hif8.decode(op.data, torch.float32)
        for op in (left, right)
    ]
    a, b = (v.T if letter == "T" else v for v, letter in zip(values, layout))
    out = a @ b
    if left.format.name == "hif8":
        out = out * (left.scale * right.scale)
    return out.to(output_dtype)


def reference_grouped_gemm(
    left: QuantizedOperand, right: QuantizedOperand, group_list: torch.Tensor, layout: str, output_dtype: torch.dtype
) -> torch.Tensor:
    """Hand-composed grouped GEMM: per group, the values of ``reference_gemm`` on that group's rows.

    fprop/dgrad (``NN``/``NT``): ``out[rows_g] = left[rows_g] · op(right[g])``; wgrad (``TN``):
    ``out[g] = left[rows_g]ᵀ · right[rows_g]``, zero for an empty group. HiF8 scales multiply the
    FP32 product (per group for a 3-D weight).
    """
    hif8_scales = left.format.name == "hif8"

    def values(op: QuantizedOperand) -> torch.Tensor:
        return op.dequantize(torch.float32) if not hif8_scales else hif8.decode(op.data, torch.float32)

    a, b = values(left), values(right)
    counts = group_list.tolist()
    if layout == "TN":
        out = torch.zeros(len(counts), a.shape[1], b.shape[1], dtype=output_dtype)
    else:
        out = torch.empty(a.shape[0], b.shape[2] if layout == "NN" else b.shape[1], dtype=output_dtype)
    start = 0
    for g, count in enumerate(counts):
        rows = slice(start, start + count)
        start += count
        if not count:
            continue
        if layout == "TN":
            product = a[rows].T @ b[rows]
            scale = left.scale * right.scale if hif8_scales else None
        else:
            product = a[rows] @ (b[g].T if layout == "NT" else b[g])
            scale = left.scale * right.scale[g] if hif8_scales else None
        if scale is not None:
            product = product * scale
        if layout == "TN":
            out[g] = product.to(output_dtype)
        else:
            out[rows] = product.to(output_dtype)
    return out
