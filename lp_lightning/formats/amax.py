"""``amax = max |x|`` in one read of the data (current scaling's and the non-finite guard's reduction).

``x.abs().amax()`` writes a temporary as large as ``x`` and reads it back; ``torch.aminmax`` reads
``x`` once, and ``|max(-min, max)|`` is the same value (negation, max and abs are exact; the outer
abs makes an all-zero result +0 and a NaN's sign positive, as ``abs().amax()`` gives them). NaN
anywhere gives NaN and ±Inf gives Inf, as ``torch.amax`` does (docs/performance.md).
"""

from __future__ import annotations

import torch

__all__ = ["abs_max"]


def abs_max(tensor: torch.Tensor, *, per_group: bool = False) -> torch.Tensor:
    """``max |x|`` of ``tensor`` as FP32: 0-d, or ``[E]`` over dims 1.. with ``per_group``.

    Args:
        tensor: A floating-point tensor of any strides (a transposed ``[E, A, B]`` view is read in place).
        per_group: Reduce each leading index ``e`` on its own (a grouped ``[E, ...]`` tensor, ≥ 1 dim).

    Returns:
        ``torch.float32``; 0 where there is nothing to reduce (an empty tensor or group).

    Raises:
        TypeError: ``tensor`` is not floating point (integer ``-min`` can overflow).
    """
    if not tensor.is_floating_point():
        raise TypeError(f"abs_max: tensor must be floating point, got {tensor.dtype}.")
    x = tensor.detach()
    if per_group:
        if x.numel() == 0:
            return torch.zeros(x.shape[:1], dtype=torch.float32, device=x.device)
        if x.dim() >= 3 and not x.is_contiguous() and x.mT.is_contiguous():
            x = x.mT  # the same elements in each group e, now contiguous
        low, high = torch.aminmax(x.reshape(x.shape[0], -1), dim=1)
    else:
        if x.numel() == 0:
            return torch.zeros((), dtype=torch.float32, device=x.device)
        low, high = torch.aminmax(x)
    return torch.maximum(high, low.neg()).abs().to(torch.float32)
