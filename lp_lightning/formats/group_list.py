"""The per-group row counts of a token-sorted (MoE) tensor, checked once for every layer (design spec §5.2).

``group_list`` is torch_npu's ``group_list_type=1``: an ``int64 [G]`` tensor of rows per group, in
token order, each ≥ 0, summing to the tensor's ``T`` rows (not cumulative ends). The format codecs
(:mod:`lp_lightning.formats.mxfp8`) and the backends (:mod:`lp_lightning.ops`) read it on the host
with :func:`group_row_counts`.
"""

from __future__ import annotations

import torch

__all__ = ["group_row_counts"]


def group_row_counts(group_list: object, rows: int | None, who: str, *, operand: str = "tensor") -> list[int]:
    """Host list of the per-group row counts in ``group_list``, checked.

    Args:
        group_list: int64 ``[G]`` per-group row counts.
        rows: The token rows (dim 0) the counts must add up to; ``None``: no sum check.
        who: Caller name for error messages.
        operand: What holds the rows, for error messages (``"tensor"``, ``"operand"``).

    Returns:
        The counts as Python ints (one device sync for an accelerator tensor).

    Raises:
        TypeError: ``group_list`` is not a tensor, or not int64.
        ValueError: it is not 1-D, holds a negative count, or (``rows`` given) does not sum to ``rows``.
    """
    if not isinstance(group_list, torch.Tensor):
        raise TypeError(
            f"{who}: group_list must be a torch.Tensor of int64 per-group row counts "
            f"(torch_npu group_list_type=1), got {type(group_list).__name__}."
        )
    if group_list.dtype != torch.int64:
        raise TypeError(
            f"{who}: group_list must have dtype torch.int64 (per-group row counts), got {group_list.dtype}. "
            "Use group_list.to(torch.int64)."
        )
    if group_list.dim() != 1:
        raise ValueError(f"{who}: group_list must be 1-D [G], got shape {tuple(group_list.shape)}.")
    counts = [int(c) for c in group_list.detach().cpu().tolist()]
    negative = [(g, c) for g, c in enumerate(counts) if c < 0]
    if negative:
        listed = ", ".join(f"group {g}: {c}" for g, c in negative[:8])
        total = "" if rows is None else f", summing to the {rows} token rows"
        raise ValueError(
            f"{who}: group_list holds negative row counts ({listed}); counts are rows per group, each >= 0{total}."
        )
    if rows is not None and sum(counts) != rows:
        raise ValueError(
            f"{who}: group_list {counts[:16]}{' ...' if len(counts) > 16 else ''} sums to {sum(counts)} rows but "
            f"the {operand} has {rows} token rows (dim 0); group_list holds per-group row counts "
            "(torch_npu group_list_type=1), not cumulative ends."
        )
    return counts
