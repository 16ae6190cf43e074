"""The ``Quantizer`` protocol: high-precision tensor → ``QuantizedOperand`` (design spec §7, §13.3).

A quantizer is immutable and holds no running state: everything it needs comes from the tensor
it is given (block amax, current amax). It never traverses a model, runs a collective or touches
an optimizer (design spec §13.3). Each format package implements it with its portable codec
(``lp_lightning.formats.mxfp8.MXFP8Quantizer``, ``lp_lightning.formats.hif8.HiF8Quantizer``).

Callers quantize through the op backend (``lp_lightning.ops.quantize``), which runs the
quantizer's portable codec (``emulated``) or the device's own kernels (``npu``): the format layer
never imports the op layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from lp_lightning.formats.spec import Orientation

if TYPE_CHECKING:
    from lp_lightning.formats.operand import QuantizedOperand
    from lp_lightning.formats.spec import FormatSpec

__all__ = ["INPUT_DTYPES", "Quantizer", "check_quantize_args"]

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""High-precision dtypes a quantizer accepts."""


@runtime_checkable
class Quantizer(Protocol):
    """How one role's tensors become a ``QuantizedOperand`` (design spec §13.3)."""

    format: FormatSpec

    def quantize(
        self,
        tensor: torch.Tensor,
        *,
        orientation: Orientation,
        group_list: torch.Tensor | None = None,
        amax: torch.Tensor | None = None,
    ) -> QuantizedOperand:
        """Quantize ``tensor`` for one GEMM direction with the format's portable codec.

        Args:
            tensor: High-precision tensor (float32/bfloat16/float16).
            orientation: ``"row"`` or ``"col"`` (the GEMM contract of design spec §8 picks it).
            group_list: Optional ``int64 [G]`` per-group row counts of a token-sorted 2-D tensor.
            amax: Optional precomputed amax (current-scaling formats; e.g. the MAX over an FSDP
                shard group). Block formats raise when it is given.

        Returns:
            The quantized operand.
        """
        ...

    def quantize_dual(
        self, tensor: torch.Tensor, *, amax: torch.Tensor | None = None
    ) -> tuple[QuantizedOperand, QuantizedOperand]:
        """``(row, col)`` operands of one tensor (a persistent weight keeps both, design spec §7.2)."""
        ...

    def compute_amax(self, tensor: torch.Tensor) -> torch.Tensor:
        """The amax the scale is computed from (current-scaling formats; block formats raise)."""
        ...


def check_quantize_args(who: str, tensor: torch.Tensor, orientation: str, group_list: torch.Tensor | None) -> None:
    """The argument checks every quantizer shares (messages name ``who``).

    Raises:
        TypeError: a non-tensor or non-float input, or a malformed ``group_list``.
        ValueError: an illegal orientation, or a ``group_list`` with a tensor that is not 2-D.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{who}.quantize: tensor must be a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.dtype not in INPUT_DTYPES:
        raise TypeError(
            f"{who}.quantize: tensor dtype {tensor.dtype} is not a high-precision dtype; "
            "legal values: float32, bfloat16, float16."
        )
    if orientation not in ("row", "col"):
        raise ValueError(f"{who}.quantize: orientation={orientation!r}; legal values: 'row', 'col'.")
    if group_list is not None:
        if not isinstance(group_list, torch.Tensor) or group_list.dtype != torch.int64 or group_list.dim() != 1:
            got = (
                f"{group_list.dtype} {tuple(group_list.shape)}"
                if isinstance(group_list, torch.Tensor)
                else type(group_list).__name__
            )
            raise TypeError(f"{who}.quantize: group_list must be a 1-D torch.int64 tensor of row counts, got {got}.")
        if tensor.dim() != 2:
            raise ValueError(
                f"{who}.quantize: group_list applies to a token-sorted 2-D tensor [T, C], got shape "
                f"{tuple(tensor.shape)}."
            )


