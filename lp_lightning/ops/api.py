"""The one low-precision GEMM interface, its contract checks and backend selection (design spec §8, §13.4).

``low_precision_matmul(left, right, layout=..., output_dtype=...)`` computes ``op(left) @ op(right)``
and ``low_precision_grouped_matmul(left, right, group_list, ...)`` the same per group, where
``layout`` is two letters, one per operand: ``N`` uses the operand's logical data as is, ``T`` its
transpose. Operands are ``QuantizedOperand``s of one format; the GEMM accumulates in FP32 and
rounds once to ``output_dtype``. There is no high-precision path: an unsupported case raises.

The contract (a format with physical orientation, MXFP8: both operands carry their 32-blocks
along the contraction dim, so the orientation is fixed by the layout and checked; HiF8:
orientation is metadata and not checked):

=============  ======  =======================  =========================  ===========
GEMM           layout  left                     right                      result
=============  ======  =======================  =========================  ===========
dense fprop    NT      x ``[M, K]`` row         W ``[N, K]`` row           ``[M, N]``
dense dgrad    NN      dy ``[M, N]`` row        W ``[N, K]`` col           ``[M, K]``
dense wgrad    TN      dy ``[M, N]`` col        x ``[M, K]`` col           ``[N, K]``
grouped fprop  NN      x ``[T, K]`` row         W ``[E, K, N]`` col        ``[T, N]``
grouped dgrad  NT      dy ``[T, N]`` row        W ``[E, K, N]`` row        ``[T, K]``
grouped wgrad  TN      x ``[T, K]`` col-groups  dy ``[T, N]`` col-groups   ``[E, K, N]``
=============  ======  =======================  =========================  ===========

Rule behind it: a left ``N`` contracts the left's last dim (MX row), a left ``T`` its dim −2 (col);
a right ``N`` contracts the right's dim −2 (col), a right ``T`` its last dim (row). Grouped weights
are in the GMM view ``[E, K, N]`` (torch_npu / ``torch._grouped_mm``); the HF parameter ``[E, N, K]``
is its transpose. Tokens are sorted by group; ``group_list`` holds the ``int64 [E]`` row counts
(torch_npu ``group_list_type=1``), summing to ``T``. An empty group contributes no rows (fprop,
dgrad) and an exactly zero ``[K, N]`` slice (wgrad). This is design spec §8's orientation table: forward
weight row for Dense / col for Grouped, dgrad weight col for Dense / row for Grouped.

Quantisation goes through the backend too (:func:`quantize`, :func:`quantize_dual`): the
``emulated`` backend runs the quantizer's portable codec, ``npu`` torch_npu's quantize ops (MXFP8:
the dynamic MX quant ops; HiF8: the quantizer's amax and scale, codes from ``npu_quantize``).
Backends and their choice (``auto``, ``emulated``, ``npu``): :mod:`lp_lightning.ops.backend`.

Tensor-name legend: ``M`` rows, ``K`` contraction, ``N`` output columns, ``T`` tokens, ``E``
groups (experts).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from lp_lightning.formats.operand import QuantizedOperand
from lp_lightning.formats.quantizer import Quantizer
from lp_lightning.formats.spec import FormatSpec, Orientation
from lp_lightning.ops import trace
from lp_lightning.ops.backend import BackendName, get_backend_impl, resolve_backend

__all__ = [
    "Layout",
    "low_precision_grouped_matmul",
    "low_precision_matmul",
    "quantize",
    "quantize_dual",
]

Layout = Literal["NN", "NT", "TN"]

_LAYOUTS: tuple[str, ...] = get_args(Layout)
_OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ------------------------------------------------------------------------------------------------
# Quantize.


def quantize(
    quantizer: Quantizer,
    tensor: torch.Tensor,
    *,
    orientation: Orientation,
    group_list: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    backend: BackendName | None = None,
    role: str | None = None,
    weight_fqn: str | None = None,
) -> QuantizedOperand:
    """``quantizer``'s operand of ``tensor``, computed by the backend in force for its device.

    Args:
        quantizer: A role's quantizer (``recipe.quantizer(role)``).
        tensor: High-precision tensor (float32/bfloat16/float16).
        orientation: ``"row"`` or ``"col"`` (the GEMM contract of design spec §8 picks it).
        group_list: Optional ``int64 [G]`` row counts of a token-sorted 2-D tensor.
        amax: Optional precomputed amax (current-scaling formats only).
        backend: Optional per-call backend.
        role: ``QuantizationRole`` value of the operand, for the quantize trace event only.
        weight_fqn: FQN of the weight whose GEMMs read the operand, for the trace event only.

    Returns:
        The operand; the portable codec is the reference every backend must match bit for bit
        (the npu backend's open points are listed in docs/formats.md §3.3).

    Raises:
        TypeError, ValueError: as the quantizer.
        LowPrecisionUnsupportedError: the chosen backend cannot run the format here.
    """
    name = resolve_backend(quantizer.format, tensor.device, backend)
    with trace.profiled(trace.QUANTIZE_LABEL):
        operand = get_backend_impl(name).quantize(
            quantizer, tensor, orientation=orientation, group_list=group_list, amax=amax
        )
    if trace.quantize_observed():
        trace.emit_quantize(
            op="quantize", backend=name, role=role, input=tensor, operands=(operand,), amax=amax,
            grouped=group_list is not None or tensor.dim() == 3, weight_fqn=weight_fqn,
        )
    return operand


def quantize_dual(
    quantizer: Quantizer,
    tensor: torch.Tensor,
    *,
    amax: torch.Tensor | None = None,
    backend: BackendName | None = None,
    role: str | None = None,
    weight_fqn: str | None = None,
) -> tuple[QuantizedOperand, QuantizedOperand]:
    """``(row, col)`` operands of ``tensor`` in one call (a persistent weight's storage, design spec §7.2).

    Args:
        quantizer: The weight role's quantizer.
        tensor: ≥ 2-D high-precision tensor (``w_NK``, or ``w_EKN`` of a grouped weight).
        amax: Optional precomputed amax (current-scaling formats only).
        backend: Optional per-call backend.
        role: Role label of the trace event (a weight refresh passes ``"weight"``).
        weight_fqn: FQN of the weight, for the trace event only.

    Raises:
        TypeError, ValueError: as the quantizer.
        LowPrecisionUnsupportedError: the chosen backend cannot run the format here.
    """
    name = resolve_backend(quantizer.format, tensor.device, backend)
    with trace.profiled(trace.QUANTIZE_LABEL):
        operands = get_backend_impl(name).quantize_dual(quantizer, tensor, amax=amax)
    if trace.quantize_observed():
        trace.emit_quantize(
            op="quantize_dual", backend=name, role=role, input=tensor, operands=tuple(operands), amax=amax,
            grouped=tensor.dim() == 3, weight_fqn=weight_fqn,
        )
    return operands


# ------------------------------------------------------------------------------------------------
# Contract checks.


def _required_orientations(layout: str) -> tuple[str, str]:
    """MX orientation each operand needs so that its blocks run along the contraction dim."""
    left = "row" if layout[0] == "N" else "col"
    right = "col" if layout[1] == "N" else "row"
    return left, right


def _check_common(
    who: str, left: object, right: object, layout: object, output_dtype: object
) -> FormatSpec:
    for name, operand in (("left", left), ("right", right)):
        if not isinstance(operand, QuantizedOperand):
            raise TypeError(
                f"{who}: {name} must be a QuantizedOperand (from a Quantizer or a weight's select()), "
                f"got {type(operand).__name__}; high-precision tensors are never multiplied here."
            )
    assert isinstance(left, QuantizedOperand) and isinstance(right, QuantizedOperand)
    left.check_alive(f"{who} (left)")
    right.check_alive(f"{who} (right)")
    if layout not in _LAYOUTS:
        raise ValueError(f"{who}: layout={layout!r}; legal values: 'NN', 'NT', 'TN'.")
    if output_dtype not in _OUTPUT_DTYPES:
        raise ValueError(
            f"{who}: output_dtype={output_dtype!r}; legal values: torch.bfloat16, torch.float16, torch.float32."
        )
    if left.format is not right.format:
        raise ValueError(
            f"{who}: left is {left.format.name} but right is {right.format.name}; "
            "both operands must share one format."
        )
    if left.device != right.device:
        raise ValueError(f"{who}: left is on {left.device} but right is on {right.device}; move them to one device.")
    if left.format.physical_orientation:
        need_left, need_right = _required_orientations(layout)  # type: ignore[arg-type]
        for name, operand, need in (("left", left, need_left), ("right", right, need_right)):
            if operand.orientation != need:
                raise ValueError(
                    f"{who}: layout {layout!r} contracts the {name} operand along dim "
                    f"{-1 if need == 'row' else -2}, so an {left.format.label} {name} operand must be {need!r}; got "
                    f"{operand.orientation!r} with shape {tuple(operand.shape)}. Quantize it with orientation={need!r}."
                )
    return left.format


def _check_role(who: str, grouped: bool, layout: str) -> trace.GemmRole | None:
    role = trace.current_gemm_role()
    if role is not None and (role.grouped != grouped or role.layout != layout):
        raise ValueError(
            f"{who}: the declared GEMM role {role.value!r} needs a "
            f"{'grouped' if role.grouped else 'dense'} GEMM with layout {role.layout!r}; "
            f"got a {'grouped' if grouped else 'dense'} GEMM with layout {layout!r}."
        )
    return role


def _check_result(who: str, backend: str, out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """A backend (torch_npu included) must return exactly the contracted shape and dtype."""
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise RuntimeError(
            f"{who}: the {backend!r} backend returned {tuple(out.shape)} {out.dtype}, but the contract is "
            f"{tuple(shape)} {dtype}; refusing to pass on a mis-shaped GEMM result."
        )


def _oriented(shape: torch.Size, transpose: bool) -> tuple[int, int]:
    rows, cols = shape[-2], shape[-1]
    return (cols, rows) if transpose else (rows, cols)


def low_precision_matmul(
    left: QuantizedOperand,
    right: QuantizedOperand,
    *,
    layout: Layout,
    output_dtype: torch.dtype,
    backend: BackendName | None = None,
) -> torch.Tensor:
    """Dense ``op(left) @ op(right)`` from quantized operands, FP32 accumulation, one rounding.

    Args:
        left: 2-D ``QuantizedOperand`` (``x_MK`` for fprop, ``dy_MN`` for dgrad/wgrad).
        right: 2-D ``QuantizedOperand`` of the same format (``w_NK`` or ``x_MK``).
        layout: ``"NT"`` (fprop ``x·Wᵀ``), ``"NN"`` (dgrad ``dy·W``) or ``"TN"`` (wgrad ``dyᵀ·x``);
            MXFP8 orientations must follow the module's table.
        output_dtype: ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``.
        backend: Optional per-call backend (``"auto"``, ``"emulated"``, ``"npu"``).

    Returns:
        ``[rows of op(left), cols of op(right)]`` tensor of ``output_dtype`` on the operands' device.

    Raises:
        TypeError: if an operand is not a ``QuantizedOperand``.
        ValueError: for an illegal layout/output dtype, mixed formats or devices, an MXFP8
            orientation that does not match the layout, non-2-D operands, mismatched contraction
            dims, or a declared ``gemm_role`` that disagrees with the call.
        LowPrecisionUnsupportedError: if the ``npu`` backend is selected and cannot run here.
    """
    who = "low_precision_matmul"
    fmt = _check_common(who, left, right, layout, output_dtype)
    if left.data.dim() != 2 or right.data.dim() != 2:
        raise ValueError(
            f"{who}: dense operands must be 2-D, got left {tuple(left.shape)} and right {tuple(right.shape)}; "
            "flatten leading dims of activations to [M, K] first, use low_precision_grouped_matmul for [E, K, N]."
        )
    m, k_left = _oriented(left.shape, layout[0] == "T")
    k_right, n = _oriented(right.shape, layout[1] == "T")
    if k_left != k_right:
        raise ValueError(
            f"{who}: layout {layout!r} contracts left {tuple(left.shape)} over {k_left} but right "
            f"{tuple(right.shape)} over {k_right}; the contraction dims must match."
        )
    role = _check_role(who, grouped=False, layout=layout)
    name = resolve_backend(fmt, left.device, backend)
    with trace.profiled(trace.MATMUL_LABEL):
        out = get_backend_impl(name).matmul(left, right, layout, output_dtype)
    _check_result(who, name, out, (m, n), output_dtype)
    trace.emit(
        op=who, backend=name, format=fmt.name, layout=layout, left_shape=left.shape, right_shape=right.shape,
        output=out, num_groups=None, gemm_role=role, weight_fqn=trace.current_weight_fqn(),
    )
    if trace.gemm_operands_observed():
        trace.emit_gemm_operands(op=who, backend=name, layout=layout, left=left, right=right, group_list=None,
                                 output=out, gemm_role=role, weight_fqn=trace.current_weight_fqn())
    return out


def low_precision_grouped_matmul(
    left: QuantizedOperand,
    right: QuantizedOperand,
    group_list: torch.Tensor,
    *,
    layout: Layout,
    output_dtype: torch.dtype,
    backend: BackendName | None = None,
) -> torch.Tensor:
    """Grouped GEMM over token-sorted rows (MoE experts), FP32 accumulation, one rounding.

    Args:
        left: 2-D ``QuantizedOperand``: ``x_TK`` (fprop, wgrad) or ``dy_TN`` (dgrad).
        right: ``QuantizedOperand`` of the same format: ``w_EKN`` (3-D, fprop/dgrad; HiF8 scale
            ``[E]``) or ``dy_TN`` (2-D, wgrad).
        group_list: ``int64 [E]`` rows per group, in token order, summing to ``T`` (torch_npu
            ``group_list_type=1``); zeros allowed.
        layout: ``"NN"`` (fprop ``x_g·W_g``), ``"NT"`` (dgrad ``dy_g·W_gᵀ``) or ``"TN"`` (wgrad
            ``x_gᵀ·dy_g``). For MXFP8 wgrad both operands must be col operands quantized with this
            ``group_list`` (blocks stop at group boundaries).
        output_dtype: ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``.
        backend: Optional per-call backend (``"auto"``, ``"emulated"``, ``"npu"``).

    Returns:
        ``[T, N]`` (fprop), ``[T, K]`` (dgrad) or ``[E, K, N]`` (wgrad) of ``output_dtype``.

    Raises:
        TypeError: for a non-operand or a ``group_list`` that is not a 1-D int64 tensor.
        ValueError: as ``low_precision_matmul``, plus: operand ranks that do not fit the layout,
            ``len(group_list) != E``, an MXFP8 wgrad operand without (or with another)
            ``group_list``; group counts that are negative or do not sum to ``T`` (checked where
            the backend reads the counts).
        LowPrecisionUnsupportedError: if the ``npu`` backend is selected and cannot run here.
    """
    who = "low_precision_grouped_matmul"
    fmt = _check_common(who, left, right, layout, output_dtype)
    if not isinstance(group_list, torch.Tensor) or group_list.dtype != torch.int64 or group_list.dim() != 1:
        got = (
            f"{group_list.dtype} {tuple(group_list.shape)}"
            if isinstance(group_list, torch.Tensor)
            else type(group_list).__name__
        )
        raise TypeError(f"{who}: group_list must be a 1-D torch.int64 tensor of per-group row counts, got {got}.")
    num_groups = group_list.numel()
    if left.data.dim() != 2:
        raise ValueError(f"{who}: left must be 2-D token-sorted rows [T, C], got shape {tuple(left.shape)}.")
    tokens = left.shape[0]
    if layout == "TN":
        if right.data.dim() != 2 or right.shape[0] != tokens:
            raise ValueError(
                f"{who}: layout 'TN' (wgrad x_gᵀ·dy_g) needs left [T, K] and right [T, N] with the same T, "
                f"got left {tuple(left.shape)} and right {tuple(right.shape)}."
            )
        if fmt.physical_orientation:
            for name, operand in (("left", left), ("right", right)):
                if operand.group_list is None:
                    raise ValueError(
                        f"{who}: the {fmt.name} wgrad {name} operand was quantized without group_list, so its "
                        "blocks may straddle two groups; quantize it with orientation='col' and this group_list."
                    )
                if operand.group_list is not group_list and not torch.equal(
                    operand.group_list.to(group_list.device), group_list
                ):
                    raise ValueError(
                        f"{who}: the {fmt.name} wgrad {name} operand was quantized with group_list "
                        f"{operand.group_list.tolist()} but the GEMM got {group_list.tolist()}."
                    )
        out_shape: tuple[int, ...] = (num_groups, left.shape[1], right.shape[1])
    else:
        if right.data.dim() != 3:
            raise ValueError(
                f"{who}: layout {layout!r} needs right = stacked weights [E, K, N] (GMM view), got shape "
                f"{tuple(right.shape)}."
            )
        if right.shape[0] != num_groups:
            raise ValueError(
                f"{who}: right has {right.shape[0]} groups (shape {tuple(right.shape)}) but group_list has "
                f"{num_groups} entries; they must match."
            )
        k_left = left.shape[1]
        k_right, n = _oriented(right.shape, layout[1] == "T")
        if k_left != k_right:
            raise ValueError(
                f"{who}: layout {layout!r} contracts left {tuple(left.shape)} over {k_left} but right "
                f"{tuple(right.shape)} over {k_right}; the contraction dims must match."
            )
        out_shape = (tokens, n)
    role = _check_role(who, grouped=True, layout=layout)
    name = resolve_backend(fmt, left.device, backend)
    with trace.profiled(trace.GROUPED_MATMUL_LABEL):
        out = get_backend_impl(name).grouped_matmul(left, right, group_list, layout, output_dtype)
    _check_result(who, name, out, out_shape, output_dtype)
    trace.emit(
        op=who, backend=name, format=fmt.name, layout=layout, left_shape=left.shape, right_shape=right.shape,
        output=out, num_groups=num_groups, gemm_role=role, weight_fqn=trace.current_weight_fqn(),
    )
    if trace.gemm_operands_observed():
        trace.emit_gemm_operands(op=who, backend=name, layout=layout, left=left, right=right, group_list=group_list,
                                 output=out, gemm_role=role, weight_fqn=trace.current_weight_fqn())
    return out
