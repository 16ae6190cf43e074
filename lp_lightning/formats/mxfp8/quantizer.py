"""``MXFP8Quantizer`` and the v1 recipe ``mxfp8_e4m3_mx_block`` (design spec §7.1, §7.2, §13.3).

Stateless: E4M3 elements, one E8M0 scale per 32-element block, scale rule RCEIL
(docs/formats.md "Decisions"); ``orientation`` picks the block direction (row: along the last
dim, col: along dim −2), ``group_list`` keeps col blocks inside each group (grouped wgrad). One
quantizer serves every role. This is the portable codec; the ``npu`` op backend runs torch_npu's
``npu_dynamic_mx_quant`` family instead (``lp_lightning.ops.npu``), bit-identical by contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lp_lightning.formats.mxfp8 import codec
from lp_lightning.formats.mxfp8.spec import SPEC, MXFP8Spec
from lp_lightning.formats.operand import QuantizationRole, QuantizedOperand
from lp_lightning.formats.quantizer import check_quantize_args
from lp_lightning.formats.recipe import LowPrecisionRecipe
from lp_lightning.formats.spec import Orientation

__all__ = ["MXFP8Quantizer", "MXFP8_E4M3_MX_BLOCK"]


def _no_amax(who: str, amax: object) -> None:
    if amax is not None:
        raise ValueError(f"{who}: MXFP8 computes one scale per 32-block from the block itself; amax must be None.")


@dataclass(frozen=True, slots=True)
class MXFP8Quantizer:
    """Stateless MXFP8 (E4M3 + E8M0, 32-element blocks, RCEIL) quantizer; one serves every role."""

    format: ClassVar[MXFP8Spec] = SPEC

    def quantize(
        self,
        tensor: torch.Tensor,
        *,
        orientation: Orientation,
        group_list: torch.Tensor | None = None,
        amax: torch.Tensor | None = None,
        values_dtype: torch.dtype | None = None,
    ) -> QuantizedOperand:
        """Quantize with 32-element blocks along the orientation's dim.

        Args:
            tensor: float32/bfloat16/float16, ≥ 1-D for ``"row"`` (blocks along the last dim),
                ≥ 2-D for ``"col"`` (blocks along dim −2). E.g. an activation ``x_MK``, a dense
                weight ``w_NK``, a grouped weight ``w_EKN``.
            orientation: ``"row"`` or ``"col"``.
            group_list: For a token-sorted 2-D ``[T, C]`` tensor, ``int64 [G]`` per-group row
                counts. With ``"col"`` the blocks restart at every group boundary (each group is
                padded logically to a multiple of 32 rows) so the grouped wgrad never mixes two
                experts in one scale; the scale is ``[sum_g ceil(n_g/32), C]``. With ``"row"``
                blocks never cross rows, so the layout is the plain row one; the list is kept as
                metadata. Default None.
            amax: Must be None (block scales come from each block).
            values_dtype: ``torch.bfloat16`` (``SPEC.gemm_values_dtype``) to also attach the decoded
                values as ``QuantizedOperand.values`` where the cast produces them in the same pass:
                row blocks (emulation; docs/performance.md). Col operands get none (a second pass
                costs what the GEMM's own decode costs). Default None.

        Returns:
            ``QuantizedOperand`` with ``float8_e4m3fn`` data (same shape as ``tensor``) and
            ``float8_e8m0fnu`` scale (shapes in ``lp_lightning.formats.operand``).

        Raises:
            TypeError: for a non-tensor, a non-float input or a malformed ``group_list``.
            ValueError: for an illegal orientation, too few dims, or an ``amax``.
        """
        check_quantize_args("MXFP8Quantizer", tensor, orientation, group_list)
        _no_amax("MXFP8Quantizer.quantize", amax)
        if tensor.dim() < (1 if orientation == "row" else 2):
            raise ValueError(
                f"MXFP8Quantizer.quantize: orientation={orientation!r} needs a tensor with at least "
                f"{1 if orientation == 'row' else 2} dims, got shape {tuple(tensor.shape)}."
            )
        values = None
        if orientation == "col" and group_list is not None:
            data, scale = codec.quantize_grouped(tensor, group_list, orientation="col")
        elif orientation == "row" and values_dtype is not None:
            data, scale, values = codec.quantize_with_values(tensor, orientation="row", values_dtype=values_dtype)
        else:
            data, scale = codec.quantize(tensor, orientation=orientation)
        return QuantizedOperand(
            data=data,
            scale=scale,
            logical_dtype=tensor.dtype,
            format=self.format,
            orientation=orientation,
            group_list=group_list,
            values=values,
        )

    def quantize_dual(
        self, tensor: torch.Tensor, *, amax: torch.Tensor | None = None
    ) -> tuple[QuantizedOperand, QuantizedOperand]:
        """Quantize once into both orientations (a persistent weight keeps both, design spec §7.2).

        Bit-identical to ``quantize(tensor, orientation="row")`` and ``(..., "col")``.

        Args:
            tensor: float32/bfloat16/float16, ≥ 2-D (e.g. ``w_NK`` or ``w_EKN``).
            amax: Must be None.

        Returns:
            ``(row_operand, col_operand)``.

        Raises:
            TypeError, ValueError: as ``quantize``.
        """
        check_quantize_args("MXFP8Quantizer", tensor, "col", None)
        _no_amax("MXFP8Quantizer.quantize_dual", amax)
        if tensor.dim() < 2:
            raise ValueError(
                f"MXFP8Quantizer.quantize_dual: needs a tensor with at least 2 dims, got shape {tuple(tensor.shape)}."
            )
        (row_data, row_scale), (col_data, col_scale) = codec.quantize_dual(tensor)
        return self.operands_from_dual(tensor.dtype, (row_data, row_scale), (col_data, col_scale))

    def operands_from_dual(
        self,
        logical_dtype: torch.dtype,
        row: tuple[torch.Tensor, torch.Tensor],
        col: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[QuantizedOperand, QuantizedOperand]:
        """Wrap ``(data, scale)`` pairs of both orientations (from the codec or a device kernel)."""
        make = lambda pair, o: QuantizedOperand(  # noqa: E731
            data=pair[0], scale=pair[1], logical_dtype=logical_dtype, format=self.format, orientation=o
        )
        return make(row, "row"), make(col, "col")

    def compute_amax(self, tensor: torch.Tensor) -> torch.Tensor:
        """Not defined for MXFP8 (every 32-block has its own scale).

        Raises:
            TypeError: always.
        """
        raise TypeError("MXFP8Quantizer has no tensor amax: every 32-element block computes its own E8M0 scale.")


_MX_QUANTIZER = MXFP8Quantizer()

MXFP8_E4M3_MX_BLOCK = LowPrecisionRecipe(
    name="mxfp8_e4m3_mx_block",
    format=SPEC,
    scaling="mx_block",
    quantizers={role: _MX_QUANTIZER for role in QuantizationRole},
)
"""MXFP8 recipe v1: E4M3 + E8M0 per 32-block, RCEIL, one stateless quantizer for every role."""
