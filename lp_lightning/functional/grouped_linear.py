"""Grouped SwiGLU experts autograd: two grouped GEMMs per direction, all low precision (design spec §6, §8).

``low_precision_grouped_swiglu(x, group_list, gate_up_weight, down_weight, recipe=...)`` runs the
routed-expert MLP over tokens already sorted by expert. It is model-agnostic: a model adapter
(e.g. ``lp_lightning.models.deepseek_v3.experts``) sorts the token slots, builds ``group_list``
and applies the router weights. ``low_precision_grouped_linear(x, group_list, weight, recipe=...)``
is one of its projections on its own (the same fprop/dgrad/wgrad helpers), the grouped operator
that the layered numerics of design spec §17.3.2 score GEMM by GEMM (``lp_lightning.st.numerics``).

The six GEMMs (layouts as in the ``lp_lightning.ops`` contract; weights in the GMM view
``[E, K, N]``, the transpose of the HF parameter ``[E, N, K]``)::

    gate_up fprop  gu_T2F   = x_g · Wgu_g          "NN"  INPUT_FWD row     × WEIGHT_FWD col  (Wgu.select("col"))
    down    fprop  y_TH     = h_g · Wd_g           "NN"  INPUT_FWD row     × WEIGHT_FWD col  (Wd.select("col"))
    down    dgrad  dh_TF    = dy_g · Wd_gᵀ         "NT"  GRAD_OUTPUT row   × WEIGHT_BWD row  (Wd.select("row"))
    down    wgrad  dWd_FH   = h_gᵀ · dy_g          "TN"  INPUT_BWD col-grp × GRAD_OUTPUT col-grp
    gate_up dgrad  dx_TH    = dgu_g · Wgu_gᵀ       "NT"  GRAD_OUTPUT row   × WEIGHT_BWD row  (Wgu.select("row"))
    gate_up wgrad  dWgu_H2F = x_gᵀ · dgu_g         "TN"  INPUT_BWD col-grp × GRAD_OUTPUT col-grp

with ``gu = [gate | up]`` (gate = first F columns, as HF's ``.chunk(2, dim=-1)``) and
``h = silu(gate) · up``. Between the GEMMs everything is high precision: the gate_up GEMM rounds
its FP32 accumulator once to the activation dtype (what is saved for backward), SwiGLU and its
backward run in FP32, and ``h`` and ``dgu`` are quantized straight from FP32 (no intermediate
BF16 rounding); ``dh`` comes out of its GEMM in FP32. wgrad results are transposed back to the
HF layout and have the weight's dtype.

"col-grp" operands are quantized with ``group_list``: MXFP8 32-row blocks stop at expert
boundaries, so no E8M0 scale spans two experts. An expert with zero tokens contributes no rows
and gets an exactly zero gradient slice; one expert and uneven counts are ordinary cases of the
same code.

Saved for backward (decision, as in ``lp_lightning.functional.linear``): the ``INPUT_BWD``
col-grouped operands of ``x`` (for the gate_up wgrad) and of ``h`` (for the down wgrad), the
gate_up output ``gu`` in the activation dtype (for SwiGLU backward), ``group_list`` and the two
weight tensors (``select`` is called again in backward; no weight operand is kept across). An
operand is saved only when its gradient is needed.

Tensor-name legend: ``T`` token slots (tokens × top-k, sorted by expert), ``H`` hidden size,
``F`` expert intermediate size, ``E`` experts; ``x_TH`` input rows, ``gu_T2F`` gate_up output,
``h_TF`` SwiGLU output, ``y_TH`` expert output, ``group_list_E`` int64 rows per expert;
``*_op`` a ``QuantizedOperand``; ``*32`` an FP32 tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lp_lightning.formats.operand import QuantizationRole, QuantizedOperand
from lp_lightning.formats.recipe import LowPrecisionRecipe
from lp_lightning.functional.linear import (
    activation_dtype,
    autocast_disabled,
    pack_operand,
    quantize_for_gemms,
    select_weight,
    unpack_operand,
    weight_fqn_of,
)
from lp_lightning.ops import GemmRole, gemm_role, low_precision_grouped_matmul

__all__ = ["low_precision_grouped_linear", "low_precision_grouped_swiglu", "swiglu_backward"]

_ROLE = QuantizationRole


def swiglu_backward(
    gate_up: torch.Tensor, grad_h: torch.Tensor
) -> torch.Tensor:
    """Gradient of ``h = silu(gate) · up`` w.r.t. ``[gate | up]``, in FP32.

    ``d silu(g)/dg = σ(g) · (1 + g · (1 − σ(g)))``.

    Args:
        gate_up: ``[T, 2F]`` gate_up GEMM output (any float dtype; computed in FP32).
        grad_h: ``[T, F]`` gradient of ``h`` (any float dtype).

    Returns:
        ``[T, 2F]`` FP32 gradient ``[d gate | d up]``.
    """
    gate32, up32 = gate_up.to(torch.float32).chunk(2, dim=-1)
    grad_h32 = grad_h.to(torch.float32)
    sig32 = torch.sigmoid(gate32)
    d_gate32 = grad_h32 * up32 * sig32 * (1.0 + gate32 * (1.0 - sig32))
    d_up32 = grad_h32 * gate32 * sig32
    return torch.cat([d_gate32, d_up32], dim=-1)


def _grouped_linear_forward(
    recipe: LowPrecisionRecipe,
    a_TK: torch.Tensor,
    weight: torch.Tensor,
    group_list_E: torch.Tensor,
    need_dweight: bool,
    output_dtype: torch.dtype,
    *,
    who: str,
    name: str,
) -> tuple[torch.Tensor, QuantizedOperand | None]:
    """fprop of one grouped linear ``y_g = a_g · W_g`` ("NN", INPUT_FWD row × WEIGHT_FWD col).

    Args:
        recipe: The quantization recipe.
        a_TK: ``[T, K]`` input rows sorted by expert, any floating dtype.
        weight: The low-precision weight, HF layout ``[E, N, K]``.
        group_list_E: ``int64`` rows per expert ``[E]``.
        need_dweight: Also quantize ``a`` as the col-grouped ``INPUT_BWD`` operand that the wgrad
            GEMM needs (saved for backward).
        output_dtype: dtype the FP32 accumulator is rounded to.
        who: The caller, named in errors.
        name: The weight's argument name, named in errors.

    Returns:
        ``(y_TN, a_col)``: the output and the ``INPUT_BWD`` operand (``None`` unless
        ``need_dweight``).
    """
    requests = [(_ROLE.INPUT_FWD, "row")] + ([(_ROLE.INPUT_BWD, "col")] if need_dweight else [])
    fqn = weight_fqn_of(weight)
    a_ops = quantize_for_gemms(recipe, a_TK, requests, group_list=group_list_E, weight_fqn=fqn)
    with gemm_role(GemmRole.GROUPED_FPROP, weight_fqn=fqn):
        y_TN = low_precision_grouped_matmul(
            a_ops[0],
            select_weight(weight, "col", who=who, name=name),
            group_list_E,
            layout="NN",
            output_dtype=output_dtype,
            backend=recipe.backend,
        )
    return y_TN, (a_ops[1] if need_dweight else None)


def _grouped_linear_backward(
    recipe: LowPrecisionRecipe,
    dy_TN: torch.Tensor,
    weight: torch.Tensor,
    input_col: QuantizedOperand | None,
    group_list_E: torch.Tensor,
    *,
    need_dinput: bool,
    dinput_dtype: torch.dtype,
    need_dweight: bool,
    who: str,
    name: str,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dgrad and wgrad of one grouped linear ``y_g = a_g · W_g`` (the two backward GEMMs of it).

    ``dy`` is quantized once per needed orientation (GRAD_OUTPUT row for dgrad, col-grouped for
    wgrad), then ``da = dy_g · W_gᵀ`` ("NT", WEIGHT_BWD row) and ``dW_g = a_gᵀ · dy_g`` ("TN",
    INPUT_BWD col-grouped × GRAD_OUTPUT col-grouped), in that order.

    Args:
        recipe: The quantization recipe of the forward.
        dy_TN: ``[T, N]`` gradient of the output, any floating dtype (FP32 straight from SwiGLU
            backward, or the activation dtype).
        weight: The low-precision weight, HF layout ``[E, N, K]``.
        input_col: ``INPUT_BWD`` col-grouped operand of the forward input ``a`` ``[T, K]``;
            required when ``need_dweight``.
        group_list_E: ``int64`` rows per expert ``[E]``.
        need_dinput: Compute ``da`` ``[T, K]`` in ``dinput_dtype``.
        dinput_dtype: Output dtype of the dgrad GEMM.
        need_dweight: Compute ``dW`` in the HF layout ``[E, N, K]`` and the weight's dtype.
        who: The caller, named in errors.
        name: The weight's argument name, named in errors.

    Returns:
        ``(da_TK, dW_ENK)``, each ``None`` when not needed.
    """
    requests = ([(_ROLE.GRAD_OUTPUT, "row")] if need_dinput else []) + (
        [(_ROLE.GRAD_OUTPUT, "col")] if need_dweight else []
    )
    fqn = weight_fqn_of(weight)
    dy_ops = list(quantize_for_gemms(recipe, dy_TN, requests, group_list=group_list_E, weight_fqn=fqn))
    d_input = d_weight = None
    if need_dinput:
        with gemm_role(GemmRole.GROUPED_DGRAD, weight_fqn=fqn):
            d_input = low_precision_grouped_matmul(
                dy_ops.pop(0),
                select_weight(weight, "row", who=who, name=name),
                group_list_E,
                layout="NT",
                output_dtype=dinput_dtype,
                backend=recipe.backend,
            )
    if need_dweight:
        assert input_col is not None, f"forward saves the INPUT_BWD operand of {name}'s input whenever it needs a gradient"
        with gemm_role(GemmRole.GROUPED_WGRAD, weight_fqn=fqn):
            d_weight_EKN = low_precision_grouped_matmul(
                input_col, dy_ops.pop(0), group_list_E, layout="TN", output_dtype=weight.dtype, backend=recipe.backend
            )
        d_weight = d_weight_EKN.transpose(-2, -1).contiguous()
    return d_input, d_weight


class _GroupedSwiGLUFunction(torch.autograd.Function):
    """Routed-expert SwiGLU MLP on token-sorted rows with six low-precision grouped GEMMs:

    gate_up fprop (NN) → SwiGLU (FP32) → down fprop (NN); backward: down dgrad (NT), down wgrad
    (TN), SwiGLU backward (FP32), gate_up dgrad (NT), gate_up wgrad (TN). See the module docstring.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x_TH: torch.Tensor,
        group_list_E: torch.Tensor,
        gate_up_weight: torch.Tensor,
        down_weight: torch.Tensor,
        recipe: LowPrecisionRecipe,
        output_dtype: torch.dtype,
        grad_enabled: bool,
    ) -> torch.Tensor:
        who = "low_precision_grouped_swiglu"
        need_dx, _, need_dgu, need_dd = (grad_enabled and n for n in ctx.needs_input_grad[:4])
        with autocast_disabled(x_TH):
            gu_T2F, x_col = _grouped_linear_forward(
                recipe, x_TH, gate_up_weight, group_list_E, need_dgu, output_dtype, who=who, name="gate_up_weight"
            )
            gate32, up32 = gu_T2F.to(torch.float32).chunk(2, dim=-1)
            h32_TF = F.silu(gate32) * up32
            y_TH, h_col = _grouped_linear_forward(
                recipe, h32_TF, down_weight, group_list_E, need_dd, output_dtype, who=who, name="down_weight"
            )

        saved: list[torch.Tensor] = [group_list_E, gate_up_weight, down_weight]
        ctx.x_meta = ctx.h_meta = None
        ctx.saved_gu = need_dx or need_dgu
        if ctx.saved_gu:
            saved.append(gu_T2F)
        if x_col is not None:
            tensors, ctx.x_meta = pack_operand(x_col)
            saved += tensors
        if h_col is not None:
            tensors, ctx.h_meta = pack_operand(h_col)
            saved += tensors
        ctx.save_for_backward(*saved)
        ctx.recipe = recipe
        ctx.x_dtype = x_TH.dtype
        return y_TH

    @staticmethod
    def backward(ctx: Any, dy_TH: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        who = "low_precision_grouped_swiglu (backward)"
        group_list_E, gate_up_weight, down_weight, *rest = ctx.saved_tensors
        tensors = iter(rest)
        gu_T2F = next(tensors) if ctx.saved_gu else None
        x_col = unpack_operand(tensors, ctx.x_meta) if ctx.x_meta is not None else None
        h_col = unpack_operand(tensors, ctx.h_meta) if ctx.h_meta is not None else None
        need_dx, _, need_dgu, need_dd = ctx.needs_input_grad[:4]
        need_dh = need_dx or need_dgu
        dx_TH = d_gate_up = None
        recipe = ctx.recipe
        with autocast_disabled(dy_TH):
            # down: dh = dy · Wdᵀ (FP32, feeds SwiGLU backward) and dWd = hᵀ · dy.
            dh32_TF, d_down = _grouped_linear_backward(
                recipe,
                dy_TH,
                down_weight,
                h_col,
                group_list_E,
                need_dinput=need_dh,
                dinput_dtype=torch.float32,
                need_dweight=need_dd,
                who=who,
                name="down_weight",
            )
            if need_dh:
                assert gu_T2F is not None, "forward saves gate_up's output whenever a gradient flows through SwiGLU"
                assert dh32_TF is not None
                # gate_up: dx = dgu · Wguᵀ and dWgu = xᵀ · dgu, dgu quantized straight from FP32.
                dx_TH, d_gate_up = _grouped_linear_backward(
                    recipe,
                    swiglu_backward(gu_T2F, dh32_TF),
                    gate_up_weight,
                    x_col,
                    group_list_E,
                    need_dinput=need_dx,
                    dinput_dtype=ctx.x_dtype,
                    need_dweight=need_dgu,
                    who=who,
                    name="gate_up_weight",
                )
        return dx_TH, None, d_gate_up, d_down, None, None, None


def _check_rows_and_group_list(who: str, x: object, group_list: object, rows: str) -> None:
    """``x`` is a 2-D floating tensor of expert-sorted rows and ``group_list`` a 1-D int64 tensor.

    Raises:
        TypeError: naming ``who``, the expected shape ``rows`` and what was passed.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{who}: x must be a floating-point {rows} tensor of expert-sorted rows, got {got}.")
    if not isinstance(group_list, torch.Tensor) or group_list.dtype != torch.int64 or group_list.dim() != 1:
        got = f"{group_list.dtype} {tuple(group_list.shape)}" if isinstance(group_list, torch.Tensor) else type(group_list).__name__
        raise TypeError(f"{who}: group_list must be a 1-D torch.int64 tensor of rows per expert, got {got}.")


def _check_weight_format(who: str, name: str, weight: torch.Tensor, recipe: LowPrecisionRecipe) -> None:
    """The low-precision ``weight`` holds operands of ``recipe``'s format.

    Raises:
        TypeError: for a plain-tensor weight (from ``select_weight``).
        ValueError: for a weight of another format, naming both.
    """
    weight_format = select_weight(weight, "col", who=who, name=name).format
    if weight_format is not recipe.format:
        raise ValueError(
            f"{who}: {name} holds {weight_format.name} operands but recipe {recipe.name!r} is "
            f"{recipe.format.name}; build the weights with the same recipe."
        )


def low_precision_grouped_swiglu(
    x: torch.Tensor,
    group_list: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    *,
    recipe: LowPrecisionRecipe,
) -> torch.Tensor:
    """Routed-expert SwiGLU ``down(silu(gate) · up)`` per expert, six low-precision grouped GEMMs.

    Args:
        x: ``[T, H]`` token slots sorted by expert (rows of expert 0 first), float32/bfloat16/float16.
        group_list: ``int64 [E]`` rows per expert in that order, summing to ``T`` (torch_npu
            ``group_list_type=1``); zeros allowed.
        gate_up_weight: Persistent low-precision weight of logical (HF) shape ``[E, 2F, H]``;
            ``select`` gives the GMM view ``[E, H, 2F]`` (``"col"`` fprop, ``"row"`` dgrad).
        down_weight: Persistent low-precision weight of logical (HF) shape ``[E, H, F]``;
            ``select`` gives ``[E, F, H]``.
        recipe: The recipe whose quantizers cast activations and gradients; the weights must have
            its format.

    Returns:
        ``[T, H]`` in the activation dtype (autocast's if on, else ``x.dtype``). Backward gives
        ``dx`` like ``x`` and weight gradients of the weights' shapes and dtypes (an expert with
        no rows gets an exactly zero slice).

    Raises:
        TypeError: for a non-floating ``x``, a ``group_list`` that is not a 1-D int64 tensor, or
            plain-tensor weights.
        ValueError: for shapes that do not fit together, or weights of another format than the
            recipe. Counts that are negative or do not sum to ``T`` raise in the GEMM.
    """
    who = "low_precision_grouped_swiglu"
    _check_rows_and_group_list(who, x, group_list, "[T, H]")
    for name, weight in (("gate_up_weight", gate_up_weight), ("down_weight", down_weight)):
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
            got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"{who}: {name} must be a 3-D [E, *, *] tensor (HF layout), got {got}.")
    num_experts, two_f, hidden = gate_up_weight.shape
    expected_down = (num_experts, hidden, two_f // 2)
    if two_f % 2 or tuple(down_weight.shape) != expected_down:
        raise ValueError(
            f"{who}: gate_up_weight {tuple(gate_up_weight.shape)} must be [E, 2F, H] and down_weight "
            f"{expected_down} = [E, H, F]; got down_weight {tuple(down_weight.shape)}."
        )
    if x.shape[1] != hidden or group_list.numel() != num_experts:
        raise ValueError(
            f"{who}: x {tuple(x.shape)} must be [T, H={hidden}] and group_list [{num_experts}] for weights "
            f"gate_up {tuple(gate_up_weight.shape)}; got group_list of {group_list.numel()} entries."
        )
    for name, weight in (("gate_up_weight", gate_up_weight), ("down_weight", down_weight)):
        _check_weight_format(who, name, weight, recipe)
    return _GroupedSwiGLUFunction.apply(
        x, group_list, gate_up_weight, down_weight, recipe, activation_dtype(x), torch.is_grad_enabled()
    )


class _GroupedLinearFunction(torch.autograd.Function):
    """One grouped linear ``y_g = x_g · W_gᵀ`` (HF layout ``W [E, N, K]``) with three low-precision GEMMs:

    fprop (NN: INPUT_FWD row × WEIGHT_FWD col), dgrad (NT: GRAD_OUTPUT row × WEIGHT_BWD row),
    wgrad (TN: INPUT_BWD col-grp × GRAD_OUTPUT col-grp) — the same helpers, hence the same
    quantisations and GEMMs, as each projection of ``_GroupedSwiGLUFunction``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x_TK: torch.Tensor,
        group_list_E: torch.Tensor,
        weight: torch.Tensor,
        recipe: LowPrecisionRecipe,
        output_dtype: torch.dtype,
        grad_enabled: bool,
    ) -> torch.Tensor:
        need_dw = grad_enabled and ctx.needs_input_grad[2]
        with autocast_disabled(x_TK):
            y_TN, x_col = _grouped_linear_forward(
                recipe, x_TK, weight, group_list_E, need_dw, output_dtype, who="low_precision_grouped_linear",
                name="weight",
            )
        saved: list[torch.Tensor] = [group_list_E, weight]
        ctx.x_meta = None
        if x_col is not None:
            tensors, ctx.x_meta = pack_operand(x_col)
            saved += tensors
        ctx.save_for_backward(*saved)
        ctx.recipe = recipe
        ctx.x_dtype = x_TK.dtype
        return y_TN

    @staticmethod
    def backward(ctx: Any, dy_TN: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        group_list_E, weight, *rest = ctx.saved_tensors
        x_col = unpack_operand(iter(rest), ctx.x_meta) if ctx.x_meta is not None else None
        need_dx, _, need_dw = ctx.needs_input_grad[:3]
        with autocast_disabled(dy_TN):
            dx_TK, d_weight = _grouped_linear_backward(
                ctx.recipe,
                dy_TN,
                weight,
                x_col,
                group_list_E,
                need_dinput=need_dx,
                dinput_dtype=ctx.x_dtype,
                need_dweight=need_dw,
                who="low_precision_grouped_linear (backward)",
                name="weight",
            )
        return dx_TK, None, d_weight, None, None, None


def low_precision_grouped_linear(
    x: torch.Tensor, group_list: torch.Tensor, weight: torch.Tensor, *, recipe: LowPrecisionRecipe
) -> torch.Tensor:
    """Per-expert ``y_g = x_g · W_gᵀ`` on token-sorted rows: fprop, dgrad and wgrad as grouped GEMMs.

    One projection of the routed-expert MLP on its own, built from the same helpers as
    :func:`low_precision_grouped_swiglu` (design spec §8; the layered per-operator numerics of
    design spec §17.3.2 score it, docs/numerics.md): fprop ``"NN"`` (INPUT_FWD row × WEIGHT_FWD
    col), dgrad ``"NT"`` (GRAD_OUTPUT row × WEIGHT_BWD row), wgrad ``"TN"`` (INPUT_BWD col-grouped
    × GRAD_OUTPUT col-grouped). Saved for backward: the col-grouped ``INPUT_BWD`` operand of ``x``
    (only when the weight needs a gradient), ``group_list`` and the weight tensor.

    Args:
        x: ``[T, K]`` token slots sorted by expert, float32/bfloat16/float16.
        group_list: ``int64 [E]`` rows per expert in that order, summing to ``T``; zeros allowed.
        weight: Persistent low-precision weight of logical (HF) shape ``[E, N, K]``; ``select``
            gives the GMM view ``[E, K, N]`` (``"col"`` fprop, ``"row"`` dgrad).
        recipe: The recipe whose quantizers cast ``x`` and the output gradient; it must have the
            weight's format.

    Returns:
        ``[T, N]`` in the activation dtype (autocast's if on, else ``x.dtype``). Backward gives
        ``dx`` like ``x`` and ``dW`` ``[E, N, K]`` in the weight's dtype (an expert with no rows
        gets an exactly zero slice).

    Raises:
        TypeError: for a non-floating or non-2-D ``x``, a ``group_list`` that is not a 1-D int64
            tensor, or a plain-tensor weight.
        ValueError: for a weight that is not ``[E, N, K]`` with ``K = x.shape[1]`` and
            ``E = len(group_list)``, or of another format than the recipe. Counts that are
            negative or do not sum to ``T`` raise in the GEMM.
    """
    who = "low_precision_grouped_linear"
    _check_rows_and_group_list(who, x, group_list, "[T, K]")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"{who}: weight must be a 3-D [E, N, K] tensor (HF layout), got {got}.")
    num_experts, _, k = weight.shape
    if x.shape[1] != k or group_list.numel() != num_experts:
        raise ValueError(
            f"{who}: x {tuple(x.shape)} must be [T, K={k}] and group_list [{num_experts}] for weight "
            f"{tuple(weight.shape)}; got group_list of {group_list.numel()} entries."
        )
    _check_weight_format(who, "weight", weight, recipe)
    return _GroupedLinearFunction.apply(x, group_list, weight, recipe, activation_dtype(x), torch.is_grad_enabled())
