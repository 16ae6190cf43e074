"""Dense low-precision linear autograd: fprop, dgrad and wgrad all on quantized operands (design spec §8).

``low_precision_linear(input, weight, bias, recipe=...)`` is ``F.linear`` whose three GEMMs run
through ``lp_lightning.ops.low_precision_matmul`` with the operand roles and orientations of design spec
§8 (layouts as in the ``lp_lightning.ops`` contract)::

    fprop  y_MN  = x_MK · w_NKᵀ    "NT"   INPUT_FWD row    × WEIGHT_FWD row  (weight.select("row"))
    dgrad  dx_MK = dy_MN · w_NK    "NN"   GRAD_OUTPUT row  × WEIGHT_BWD col  (weight.select("col"))
    wgrad  dw_NK = dy_MNᵀ · x_MK   "TN"   GRAD_OUTPUT col  × INPUT_BWD col   (x quantized in forward)

There is no high-precision GEMM on any path: an operand that cannot be quantized, or a backend
that cannot run, raises.

The weight. ``weight`` is the module's persistent low-precision weight tensor (requirement R1 (docs/design.md), design spec
§7.2–7.3): a tensor of the logical parameter shape ``[N, K]`` whose ``select(orientation)``
returns a ``QuantizedOperand`` in the GEMM view, as a lookup, never a requantisation (a
``QuantizedWeightTensor`` from ``lp_lightning.tensor.weight``, or what its FSDP2
``fsdp_post_all_gather`` returned). This function never quantizes the weight: the operand the
GEMM uses was derived from the FP32 master once per optimizer step (design spec §8.1–8.2). It is an input
of the autograd function, so autograd returns its gradient — a plain tensor of the parameter's
shape and dtype — and it is saved for backward as a tensor, with ``select`` called again there:
no weight operand is kept alive from forward to backward (FSDP2 frees the unsharded weight after
forward and re-gathers it for backward). A plain tensor (``torch.Tensor.select`` is the integer
indexing op) raises ``TypeError``.

What is saved for backward (decision). wgrad needs the input as an ``INPUT_BWD`` col operand.
It is quantized in forward and saved instead of the high-precision input: 1 byte per element plus
one E8M0 per 32 (MXFP8) or a 0-d FP32 scale (HiF8), against 2 bytes per element for a BF16 input
(TransformerEngine saves its columnwise cast the same way). For HiF8 the ``INPUT_FWD`` and
``INPUT_BWD`` quantizers are the same (amax → 15.0) and one code tensor serves both orientations
(design spec §7.3), so the saved operand is the fprop operand itself: no extra quantisation. For MXFP8
the col operand is a second quantisation of ``x`` (32×1 blocks differ from 1×32 blocks), paid in
forward. Nothing is saved when no weight gradient is needed (frozen weight or ``no_grad``). All
saved tensors go through ``ctx.save_for_backward`` so activation checkpointing's saved-tensor
hooks see them.

Dtypes. The output and ``dx`` have the activation dtype: the autocast dtype when autocast is on
for the input's device (as ``F.linear``), else ``input.dtype``. Autocast is disabled inside the
function (the emulated backend's FP32 matmul of decoded operands must not be downcast). Each
GEMM rounds once from its FP32 accumulator. A bias is added in FP32 to the FP32 GEMM result and
the sum is rounded once; its gradient is the FP32 sum of ``dy`` over all rows, cast to the bias
dtype. ``dw`` has the weight's dtype.

Tensor-name legend: ``M`` rows (all leading dims of the input flattened), ``K`` in-features,
``N`` out-features; ``x_MK`` input, ``w_NK`` weight, ``y_MN`` output, ``dy_MN`` output gradient,
``*_op`` a ``QuantizedOperand``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lp_lightning.formats.operand import Orientation, QuantizationRole, QuantizedOperand
from lp_lightning.formats.spec import FormatSpec
from lp_lightning.formats.recipe import LowPrecisionRecipe
from lp_lightning.ops import GemmRole, gemm_role, low_precision_matmul, quantize

__all__ = [
    "activation_dtype",
    "low_precision_linear",
    "quantize_for_gemms",
    "select_weight",
    "selects_low_precision_operand",
    "weight_fqn_of",
]

_ROLE = QuantizationRole


# ------------------------------------------------------------------------------------------------
# Helpers shared with ``lp_lightning.functional.grouped_linear``.


def selects_low_precision_operand(tensor: object) -> bool:
    """Whether ``tensor`` selects a low-precision operand per GEMM orientation (``select(orientation)``).

    ``torch.Tensor.select(dim, index)`` is the integer indexing op; a low-precision weight class
    overrides it with ``select(orientation) -> QuantizedOperand`` (design spec §7.2–7.3). A duck-type
    test of what the GEMM functions need (any such class, e.g. a test format's), unlike
    :func:`lp_lightning.tensor.is_low_precision_weight`, which asks for this package's weight classes.

    Args:
        tensor: Any object.

    Returns:
        True for a tensor whose class overrides ``select``; False for plain tensors/Parameters.
    """
    return isinstance(tensor, torch.Tensor) and getattr(type(tensor), "select", None) is not torch.Tensor.select


def select_weight(weight: torch.Tensor, orientation: Orientation, *, who: str, name: str = "weight") -> QuantizedOperand:
    """The weight's operand for one GEMM direction (a lookup in the persistent weight).

    Args:
        weight: A low-precision weight tensor (see ``selects_low_precision_operand``).
        orientation: ``"row"`` or ``"col"``.
        who: Caller name for error messages.
        name: Argument name for error messages.

    Returns:
        ``weight.select(orientation)``.

    Raises:
        TypeError: if ``weight`` is a plain tensor, or ``select`` returns no ``QuantizedOperand``.
    """
    if not selects_low_precision_operand(weight):
        raise TypeError(
            f"{who}: {name} is a plain {type(weight).__name__} of shape {tuple(weight.shape)}, not a low-precision "
            "weight; build it once after init with lp_lightning.fsdp.weights.finalize_low_precision_weights "
            "(no high-precision fallback)."
        )
    operand = weight.select(orientation)
    if not isinstance(operand, QuantizedOperand):
        raise TypeError(
            f"{who}: {name}.select({orientation!r}) returned {type(operand).__name__}, expected a QuantizedOperand."
        )
    return operand


def quantize_for_gemms(
    recipe: LowPrecisionRecipe,
    tensor: torch.Tensor,
    requests: Sequence[tuple[QuantizationRole, Orientation]],
    *,
    group_list: torch.Tensor | None = None,
    weight_fqn: str | None = None,
) -> tuple[QuantizedOperand, ...]:
    """The one cast helper: quantize an activation or gradient for the GEMMs that read it.

    Each distinct physical layout is quantized once. MXFP8 row and col blocks are different
    bytes, so each orientation is one quantisation. A HiF8 scale does not depend on a block
    direction, so when two requests use the same quantizer (same ``format_max``), the second is
    the first's codes with the other orientation label (``with_orientation``, design spec §7.3) —
    bit-identical to quantizing again, because the quantizer is a pure function of the tensor.

    Args:
        recipe: The recipe whose per-role quantizers are used, on its backend.
        tensor: High-precision 2-D tensor, e.g. ``x_MK``, ``dy_MN``, token-sorted ``x_TK``.
        requests: ``(role, orientation)`` pairs, one per operand wanted.
        group_list: ``int64 [E]`` per-group row counts of a token-sorted tensor (grouped GEMMs);
            MXFP8 col blocks then stop at group boundaries. None for dense GEMMs.
        weight_fqn: FQN of the weight whose GEMMs read the operands (quantize trace events only).

    Returns:
        One ``QuantizedOperand`` per request, in order.
    """
    done: dict[tuple[int, str], QuantizedOperand] = {}
    operands = []
    for role, orientation in requests:
        quantizer = recipe.quantizer(role)
        layout_key = orientation if quantizer.format.physical_orientation else "shared"
        key = (id(quantizer), layout_key)
        if key not in done:
            done[key] = quantize(
                quantizer, tensor, orientation=orientation, group_list=group_list, role=role.value,
                weight_fqn=weight_fqn, backend=recipe.backend,
            )
        operands.append(done[key].with_orientation(orientation))
    return tuple(operands)


def weight_fqn_of(weight: torch.Tensor) -> str | None:
    """The FQN a low-precision weight carries (``.fqn``; ``""`` or none gives None), for trace events."""
    return getattr(weight, "fqn", None) or None


def activation_dtype(tensor: torch.Tensor) -> torch.dtype:
    """Dtype of a low-precision GEMM's activation output: autocast's dtype if on, else the input's."""
    device_type = tensor.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return tensor.dtype


@contextlib.contextmanager
def autocast_disabled(tensor: torch.Tensor) -> Iterator[None]:
    """Run the block with autocast off for ``tensor``'s device (the GEMM dtypes are explicit)."""
    with torch.autocast(tensor.device.type, enabled=False):
        yield


@dataclass(frozen=True, slots=True)
class _OperandMeta:
    """The non-tensor fields of a ``QuantizedOperand`` kept on ``ctx`` (tensors are saved)."""

    logical_dtype: torch.dtype
    format: FormatSpec
    orientation: str
    format_max: float | None
    has_group_list: bool


def pack_operand(operand: QuantizedOperand) -> tuple[list[torch.Tensor], _OperandMeta]:
    """Split an operand into the tensors for ``ctx.save_for_backward`` and its metadata."""
    tensors = [operand.data, operand.scale]
    if operand.group_list is not None:
        tensors.append(operand.group_list)
    meta = _OperandMeta(
        logical_dtype=operand.logical_dtype,
        format=operand.format,
        orientation=operand.orientation,
        format_max=operand.format_max,
        has_group_list=operand.group_list is not None,
    )
    return tensors, meta


def unpack_operand(tensors: Iterator[torch.Tensor], meta: _OperandMeta) -> QuantizedOperand:
    """Rebuild an operand from ``pack_operand``'s output (tensors consumed from an iterator)."""
    data, scale = next(tensors), next(tensors)
    group_list = next(tensors) if meta.has_group_list else None
    return QuantizedOperand(
        data=data,
        scale=scale,
        logical_dtype=meta.logical_dtype,
        format=meta.format,
        orientation=meta.orientation,  # type: ignore[arg-type]
        group_list=group_list,
        format_max=meta.format_max,
    )


# ------------------------------------------------------------------------------------------------
# The dense autograd function.


class _LowPrecisionLinearFunction(torch.autograd.Function):
    """``y = x · wᵀ (+ b)`` with three low-precision GEMMs (see the module docstring):

    fprop ``x_MK·w_NKᵀ`` (NT: INPUT_FWD row × WEIGHT_FWD row), dgrad ``dy_MN·w_NK`` (NN:
    GRAD_OUTPUT row × WEIGHT_BWD col), wgrad ``dy_MNᵀ·x_MK`` (TN: GRAD_OUTPUT col × INPUT_BWD col).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        recipe: LowPrecisionRecipe,
        output_dtype: torch.dtype,
        save_for_wgrad: bool,
    ) -> torch.Tensor:
        who = "low_precision_linear"
        with autocast_disabled(x):
            x_MK = x.reshape(-1, x.shape[-1])
            requests = [(_ROLE.INPUT_FWD, "row")] + ([(_ROLE.INPUT_BWD, "col")] if save_for_wgrad else [])
            fqn = weight_fqn_of(weight)
            x_ops = quantize_for_gemms(recipe, x_MK, requests, weight_fqn=fqn)
            gemm_dtype = torch.float32 if bias is not None else output_dtype
            with gemm_role(GemmRole.DENSE_FPROP, weight_fqn=fqn):
                y_MN = low_precision_matmul(
                    x_ops[0], select_weight(weight, "row", who=who), layout="NT", output_dtype=gemm_dtype,
                    backend=recipe.backend,
                )
            if bias is not None:
                y_MN = (y_MN + bias.to(torch.float32)).to(output_dtype)

        saved: list[torch.Tensor] = [weight]
        ctx.x_meta = None
        if save_for_wgrad:
            x_tensors, ctx.x_meta = pack_operand(x_ops[1])
            saved += x_tensors
        ctx.save_for_backward(*saved)
        ctx.recipe = recipe
        ctx.x_shape = x.shape
        ctx.x_dtype = x.dtype
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        # ``detach`` makes the output a tensor of its own rather than a view of ``y_MN`` (same
        # storage, no copy; nothing else holds ``y_MN``). A module whose output is a view gets a
        # warning from FSDP2 when it is a sharding unit of its own (a replicated fallback module),
        # because an in-place op on a view would drop FSDP2's pre-backward hook.
        return y_MN.reshape(*x.shape[:-1], y_MN.shape[-1]).detach()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        who = "low_precision_linear (backward)"
        weight, *rest = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx = dw = db = None
        with autocast_disabled(dy):
            dy_MN = dy.reshape(-1, dy.shape[-1])
            requests = ([(_ROLE.GRAD_OUTPUT, "row")] if need_dx else []) + (
                [(_ROLE.GRAD_OUTPUT, "col")] if need_dw else []
            )
            fqn = weight_fqn_of(weight)
            dy_ops = list(quantize_for_gemms(ctx.recipe, dy_MN, requests, weight_fqn=fqn))
            if need_dx:
                with gemm_role(GemmRole.DENSE_DGRAD, weight_fqn=fqn):
                    dx_MK = low_precision_matmul(
                        dy_ops.pop(0), select_weight(weight, "col", who=who), layout="NN", output_dtype=ctx.x_dtype,
                        backend=ctx.recipe.backend,
                    )
                dx = dx_MK.reshape(ctx.x_shape)
            if need_dw:
                assert ctx.x_meta is not None, "forward saves the INPUT_BWD operand whenever dw is needed"
                x_col = unpack_operand(iter(rest), ctx.x_meta)
                with gemm_role(GemmRole.DENSE_WGRAD, weight_fqn=fqn):
                    dw = low_precision_matmul(
                        dy_ops.pop(0), x_col, layout="TN", output_dtype=weight.dtype, backend=ctx.recipe.backend
                    )
            if need_db and ctx.has_bias:
                db = dy_MN.to(torch.float32).sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None


def low_precision_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    recipe: LowPrecisionRecipe,
) -> torch.Tensor:
    """``F.linear`` with fprop, dgrad and wgrad as low-precision GEMMs (see the module docstring).

    Args:
        input: Activation ``[..., K]`` (``[M, K]`` or ``[B, S, K]``), float32/bfloat16/float16.
        weight: Persistent low-precision weight of logical shape ``[N, K]`` (``select(orientation)``
            gives ``QuantizedOperand``s ``w_NK``: ``"row"`` for fprop, ``"col"`` for dgrad).
        bias: Optional high-precision ``[N]``; added in FP32 outside the GEMM.
        recipe: The recipe whose quantizers cast the input (``INPUT_FWD``/``INPUT_BWD``) and the
            output gradient (``GRAD_OUTPUT``); it must have the weight's format.

    Returns:
        ``[..., N]`` in the activation dtype (autocast's dtype if autocast is on, else
        ``input.dtype``). Backward gives ``dx`` like ``input``, ``dw`` ``[N, K]`` in
        ``weight.dtype`` and ``db`` ``[N]`` in ``bias.dtype``.

    Raises:
        TypeError: if ``input`` is not a floating tensor or ``weight`` is a plain tensor.
        ValueError: for a 0-d input, mismatched K, a bias that is not ``[N]``, or a recipe whose
            format differs from the weight's.
    """
    who = "low_precision_linear"
    if not isinstance(input, torch.Tensor) or not input.is_floating_point():
        got = input.dtype if isinstance(input, torch.Tensor) else type(input).__name__
        raise TypeError(f"{who}: input must be a floating-point tensor, got {got}.")
    if input.dim() < 1:
        raise ValueError(f"{who}: input must be [..., K] with at least 1 dim, got a 0-d tensor.")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"{who}: weight must be a 2-D [N, K] tensor, got {got}.")
    n, k = weight.shape
    if input.shape[-1] != k:
        raise ValueError(
            f"{who}: input {tuple(input.shape)} has K={input.shape[-1]} but weight {tuple(weight.shape)} "
            f"expects K={k}; the last input dim must equal the weight's in_features."
        )
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"{who}: bias must be [N]=[{n}] to match weight {tuple(weight.shape)}, got {tuple(bias.shape)}.")
    weight_format = select_weight(weight, "row", who=who).format
    if weight_format is not recipe.format:
        raise ValueError(
            f"{who}: weight holds {weight_format.name} operands but recipe {recipe.name!r} is "
            f"{recipe.format.name}; build the weight with the same recipe."
        )
    save_for_wgrad = torch.is_grad_enabled() and weight.requires_grad
    return _LowPrecisionLinearFunction.apply(input, weight, bias, recipe, activation_dtype(input), save_for_wgrad)
