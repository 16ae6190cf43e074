"""Fakes of ``torch_npu`` that each deviate from the emulation in exactly one way (backend conformance tests).

Every class is the recording :class:`~fake_torch_npu.FakeTorchNpu` (which answers through the
emulation, i.e. a faithful backend) with one op changed, modelling a kernel bug or an unconfirmed
hardware choice that ``lp_lightning.ops.conformance`` must catch and attribute to that op alone:

======================  =======================================================================
``hif8_ties_to_even``   ``npu_quantize`` rounds exact HiF8 ties to the even code, not away from zero
``inf_not_saturated``   ``npu_quantize`` lets +Inf through as NaN (0x80) instead of the Inf code 0x6F
``mx_pair_transposed``  the MX quant ops return each scale pair with its two slots swapped
``gmm_drops_empty``     ``npu_grouped_matmul`` drops the empty groups of ``group_list`` (and the
                        weights of the last groups with them)
``fp32_out_via_bf16``   ``npu_quant_matmul`` rounds an FP32 result through BF16
======================  =======================================================================

``DEVIATIONS`` maps each name to its class and to the ``(op, format-or-None, output dtype-or-None)``
of the conformance cases it must fail (``None``: any).
"""

from __future__ import annotations

import math

import torch
from fake_torch_npu import FakeTorchNpu

from lp_lightning.formats import hif8

__all__ = ["DEVIATIONS"]


def _quotient(x: torch.Tensor, scales: torch.Tensor, axis: int) -> torch.Tensor:
    """``x / scales`` as the fake's ``npu_quantize`` forms it (per tensor, or along ``axis``)."""
    if scales.numel() == 1:
        return x / scales.reshape(())
    shape = [1] * x.dim()
    shape[axis] = scales.shape[0]
    return x / scales.reshape(shape)


class HiF8TiesToEven(FakeTorchNpu):
    @staticmethod
    def _npu_quantize(self, scales, zero_points, dtype, axis=1, div_mode=True):  # noqa: PLW0211 - the schema's input
        away = FakeTorchNpu._npu_quantize(self, scales, zero_points, dtype, axis, div_mode)
        q = _quotient(self, scales, axis)
        toward = hif8.encode(torch.nextafter(q, torch.zeros_like(q)))
        a, t = hif8.decode(away, torch.float64).abs(), hif8.decode(toward, torch.float64).abs()
        tie = (away != toward) & torch.isfinite(q) & ((a - q.abs().double()) == (q.abs().double() - t))
        even = torch.where((away & 1) == 0, away, toward)
        return torch.where(tie, even, away)


class InfNotSaturated(FakeTorchNpu):
    @staticmethod
    def _npu_quantize(self, scales, zero_points, dtype, axis=1, div_mode=True):  # noqa: PLW0211 - the schema's input
        codes = FakeTorchNpu._npu_quantize(self, scales, zero_points, dtype, axis, div_mode)
        return torch.where(self == math.inf, torch.full_like(codes, hif8.HIF8_NAN_CODE), codes)


class MXPairTransposed(FakeTorchNpu):
    def _npu_dynamic_mx_quant(self, input, **kwargs):
        data, scale = super()._npu_dynamic_mx_quant(input, **kwargs)
        return data, scale.flip(-1).contiguous()

    def _npu_dynamic_mx_quant_with_dual_axis(self, input, **kwargs):
        row, row_scale, col, col_scale = super()._npu_dynamic_mx_quant_with_dual_axis(input, **kwargs)
        return row, row_scale.flip(-1).contiguous(), col, col_scale.flip(-1).contiguous()

    def _npu_grouped_dynamic_mx_quant(self, x, group_index, **kwargs):
        data, scale = super()._npu_grouped_dynamic_mx_quant(x, group_index, **kwargs)
        return data, scale.flip(-1).contiguous()


class GmmDropsEmptyGroups(FakeTorchNpu):
    def _npu_grouped_matmul(self, x, weight, *, group_list=None, group_type=None, scale=None, **kwargs):
        kept = group_list[group_list > 0]
        if group_type == 0:  # split M: the kept counts meet the first weights (and their scales)
            weight = [w[: kept.numel()] for w in weight]
            scale = [s[: kept.numel()] if s.dim() and s.shape[0] == group_list.numel() else s for s in scale]
        return super()._npu_grouped_matmul(x, weight, group_list=kept, group_type=group_type, scale=scale, **kwargs)


class Fp32OutViaBf16(FakeTorchNpu):
    def _npu_quant_matmul(self, x1, x2, scale, **kwargs):
        out = super()._npu_quant_matmul(x1, x2, scale, **kwargs)
        return out.to(torch.bfloat16).to(torch.float32) if out.dtype == torch.float32 else out


DEVIATIONS: dict[str, tuple[type[FakeTorchNpu], tuple[str, ...], str | None, str | None]] = {
    "hif8_ties_to_even": (HiF8TiesToEven, ("quantize", "quantize_dual"), "hif8", None),
    "inf_not_saturated": (InfNotSaturated, ("quantize", "quantize_dual"), "hif8", None),
    "mx_pair_transposed": (MXPairTransposed, ("quantize", "quantize_dual"), "mxfp8_e4m3", None),
    "gmm_drops_empty": (GmmDropsEmptyGroups, ("low_precision_grouped_matmul",), None, None),
    "fp32_out_via_bf16": (Fp32OutViaBf16, ("low_precision_matmul",), None, "float32"),
}
"""name → (fake class, the ops its failing cases may have, their format (None: any), their output dtype (None: any))."""
