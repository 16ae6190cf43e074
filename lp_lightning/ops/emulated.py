"""The ``emulated`` backend: portable quantizers, exact decode, FP32 matmul, one rounding (docs/design.md "Where it runs").

It is the reference the ``npu`` backend is checked against and what CPU runs use. It runs on any
torch device and is labelled ``"emulated"`` in every trace event.

Quantisation runs the quantizer's portable codec (the format package's bit-exact reference). Each
GEMM asks the operands' ``FormatSpec`` for its exact factors (``gemm_factors``): FP32 values to
multiply, and a scale for the FP32 product (or none). Per format:

- MXFP8: each operand is dequantized per 32-block *before* accumulation
  (``lp_lightning.formats.mxfp8.dequantize``). An E4M3 value (4 significant bits, |v| ≤ 448) times
  an E8M0 power of two is exact in FP32, so the decoded operands equal the quantized values exactly
  (the one exception, inputs within 3 % of the FP32 maximum overflowing to ±Inf, is documented in
  ``mxfp8``); the matmul then accumulates in FP32.
- HiF8: codes are decoded to FP32 (exact: ≤ 4 significant bits), multiplied in FP32, and the
  FP32 product is multiplied by ``left_scale * right_scale`` (per group for a grouped weight) —
  the order of the hardware formula ``out = (Σ x1·x2) · x1Scale · x2Scale`` (aclnnQuantMatmulV5.md).

The FP32 result is rounded once to ``output_dtype``.

GEMM units (speed, same contract). A decoded MXFP8 operand has at most 4 significant bits per
value, so it is exact in BF16 too unless a block scale is below 2^-124
(``FormatSpec.exact_gemm_dtype``). When such a GEMM has no product scale and a BF16 result (every
training GEMM of an MXFP8 layer: activations, gradients and FSDP2's gathered weights are BF16), a
BF16 ``matmul`` on the CPU is the contract itself: oneDNN and torch's own CPU kernels accumulate
BF16 products in FP32 and round the FP32 sum once. Only the order of the FP32 additions differs
from an IEEE FP32 matmul: ``tests/ops/test_emulated_units.py`` bounds the difference and
``benchmarks/gemm.py`` reports how often the rounded results differ. Everything else multiplies in
IEEE FP32: HiF8 (the per-tensor scales must multiply the FP32 product before the one rounding, and
no CPU BF16 GEMM returns FP32; oneDNN's ``fp32_precision = "bf16"`` mode was measured to round
more than that), FP32 results, other devices, and ``EmulatedBackend(bf16_units=False)``.

Grouped GEMMs loop over the groups with row slices (host copy of ``group_list``). A ``[E, K, N]``
weight is decoded in one call per GEMM: a transient copy of the gathered weight in BF16 (MXFP8; the
size of the BF16 baseline's gathered weight) or FP32 (HiF8), freed when the GEMM returns.

Cost: decoding is O(M·K + K·N) element-wise work (compiled codec kernels) against the O(M·N·K)
matmul; ``benchmarks/gemm.py`` measures it against BF16 and FP32 matmuls.

Tensor-name legend: ``a_MK``/``b_KN`` decoded operand matrices after ``op()``, ``x_TK`` /
``dy_TN`` token-sorted rows, ``w_KN`` one group's weight, ``out_*`` results.
"""

from __future__ import annotations

import torch

from lp_lightning.formats.group_list import group_row_counts
from lp_lightning.formats.operand import QuantizedOperand
from lp_lightning.formats.quantizer import Quantizer
from lp_lightning.formats.spec import FormatSpec, Orientation
from lp_lightning.ops.backend import GateCheck

__all__ = ["BACKEND", "EmulatedBackend"]


def _no_autocast(method):
    """Run ``method`` with autocast off on the operands' device: the FP32 matmul of decoded
    operands must stay FP32 even when the caller runs under BF16 autocast."""

    def wrapper(self, left: QuantizedOperand, *args, **kwargs):
        device_type = left.device.type
        if not torch.is_autocast_enabled(device_type):  # entering the context costs more than checking
            return method(self, left, *args, **kwargs)
        with torch.autocast(device_type=device_type, enabled=False):
            return method(self, left, *args, **kwargs)

    wrapper.__name__, wrapper.__doc__ = method.__name__, method.__doc__
    return wrapper


def _op(matrix: torch.Tensor, transpose: bool) -> torch.Tensor:
    return matrix.transpose(-2, -1) if transpose else matrix


def _scaled(product: torch.Tensor, left_scale: torch.Tensor | None, right_scale: torch.Tensor | None) -> torch.Tensor:
    """Apply the operands' product scales to an FP32 product (their product first, as the hardware)."""
    if left_scale is None and right_scale is None:
        return product
    if left_scale is None or right_scale is None:
        return product * (left_scale if right_scale is None else right_scale)
    return product * (left_scale * right_scale)


def _factors(operand: QuantizedOperand, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``gemm_factors`` in ``dtype``; FP32 is asked for with the format's default (any format)."""
    fmt = operand.format
    return fmt.gemm_factors(operand) if dtype == torch.float32 else fmt.gemm_factors(operand, dtype)


class EmulatedBackend:
    """Exact software model of the low-precision quantize and GEMMs (see the module docstring).

    Args:
        bf16_units: Multiply on BF16 GEMM units where that is exact (CPU, both operands exact in
            BF16; module docstring "GEMM units"). ``False`` keeps every GEMM in IEEE FP32: the
            reference the tests and ``benchmarks/gemm.py`` compare the fast path against.
    """

    name = "emulated"

    def __init__(self, *, bf16_units: bool = True) -> None:
        self.bf16_units = bool(bf16_units)

    def capability_error(self, format: FormatSpec) -> None:
        """Always ``None``: the emulation runs every registered format on every torch device."""
        return None

    def startup_checks(self, format: FormatSpec | None) -> tuple[GateCheck, ...]:
        """One passing check: the exact software emulation of ``format`` (nothing for ``None``)."""
        if format is None:
            return ()
        return (GateCheck(f"emulated {format.name} kernels", "exact software emulation, FP32 accumulation", True),)

    def quantize(
        self,
        quantizer: Quantizer,
        tensor: torch.Tensor,
        *,
        orientation: Orientation,
        group_list: torch.Tensor | None = None,
        amax: torch.Tensor | None = None,
    ) -> QuantizedOperand:
        """The quantizer's portable codec, which also returns the decoded GEMM values when the
        format can (``FormatSpec.gemm_values_dtype``): the GEMMs that consume the operand at once
        skip a decode pass (``QuantizedOperand.values``; docs/performance.md)."""
        values_dtype = quantizer.format.gemm_values_dtype
        if values_dtype is None:
            return quantizer.quantize(tensor, orientation=orientation, group_list=group_list, amax=amax)
        return quantizer.quantize(
            tensor, orientation=orientation, group_list=group_list, amax=amax, values_dtype=values_dtype
        )

    def quantize_dual(
        self, quantizer: Quantizer, tensor: torch.Tensor, *, amax: torch.Tensor | None = None
    ) -> tuple[QuantizedOperand, QuantizedOperand]:
        """Both orientations from the quantizer's portable codec."""
        return quantizer.quantize_dual(tensor, amax=amax)

    def _units(self, left: QuantizedOperand, right: QuantizedOperand, output_dtype: torch.dtype) -> str:
        """``"bf16"`` (a BF16 GEMM gives the contract's result, module docstring) or ``"fp32"``."""
        if not self.bf16_units or left.device.type != "cpu" or output_dtype != torch.bfloat16:
            return "fp32"
        if not (left.format.values_carry_scale and right.format.values_carry_scale):
            return "fp32"  # a product scale must multiply the FP32 result before the rounding
        if left.format.exact_gemm_dtype(left) != torch.bfloat16 or right.format.exact_gemm_dtype(right) != torch.bfloat16:
            return "fp32"
        return "bf16"

    @_no_autocast
    def matmul(
        self, left: QuantizedOperand, right: QuantizedOperand, layout: str, output_dtype: torch.dtype
    ) -> torch.Tensor:
        """Dense ``op(left) @ op(right)``; inputs already validated by ``lp_lightning.ops.api``."""
        dtype = torch.bfloat16 if self._units(left, right, output_dtype) == "bf16" else torch.float32
        a_MK, left_scale = _factors(left, dtype)
        b_KN, right_scale = _factors(right, dtype)
        out_MN = _op(a_MK, layout[0] == "T") @ _op(b_KN, layout[1] == "T")
        return _scaled(out_MN, left_scale, right_scale).to(output_dtype)

    @_no_autocast
    def grouped_matmul(
        self,
        left: QuantizedOperand,
        right: QuantizedOperand,
        group_list: torch.Tensor,
        layout: str,
        output_dtype: torch.dtype,
    ) -> torch.Tensor:
        """Grouped GEMM; see ``lp_lightning.ops.api.low_precision_grouped_matmul`` for the contract."""
        tokens = left.shape[0]
        counts = group_row_counts(group_list, tokens, "low_precision_grouped_matmul", operand="operand")
        dtype = torch.bfloat16 if self._units(left, right, output_dtype) == "bf16" else torch.float32
        rows_TC, left_scale = _factors(left, dtype)
        device = left.device
        if layout == "TN":  # wgrad: out[g] = x_gᵀ · dy_g
            dy_TN, right_scale = _factors(right, dtype)
            out_EKN = torch.zeros((len(counts), left.shape[1], right.shape[1]), dtype=output_dtype, device=device)
            start = 0
            for g, count in enumerate(counts):
                if count:
                    rows = slice(start, start + count)
                    out_KN = rows_TC[rows].transpose(0, 1) @ dy_TN[rows]
                    out_EKN[g] = _scaled(out_KN, left_scale, right_scale).to(output_dtype)
                start += count
            return out_EKN
        # fprop (NN): out_g = x_g · W_g ; dgrad (NT): out_g = dy_g · W_gᵀ, W in the GMM view [E, K, N],
        # decoded in one call (module docstring "Grouped GEMMs").
        width = right.shape[2] if layout == "NN" else right.shape[1]
        out_TC = torch.empty((tokens, width), dtype=output_dtype, device=device)
        w_EKN, w_scale = _factors(right, dtype)
        start = 0
        for g, count in enumerate(counts):
            if count:
                rows = slice(start, start + count)
                right_scale = None if w_scale is None else (w_scale if w_scale.dim() == 0 else w_scale[g])
                out_g = rows_TC[rows] @ _op(w_EKN[g], layout[1] == "T")
                out_TC[rows] = _scaled(out_g, left_scale, right_scale).to(output_dtype)
            start += count
        return out_TC


BACKEND = EmulatedBackend()
