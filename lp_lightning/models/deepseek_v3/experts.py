"""DeepSeek-V3 routed experts in low precision: an adapter over the generic grouped SwiGLU (design spec §5.2, §6).

``replace_deepseek_v3_low_precision_experts(source, fqn=..., policy=...)`` is the replacement-plan
factory for HF transformers' ``DeepseekV3Experts`` (``model.layers.*.mlp.experts``). It replaces
the container whole (design spec §5.2: HF has no per-expert Linear to swap) and only adapts names,
signature and top-k aggregation; the GEMMs live in
``lp_lightning.functional.low_precision_grouped_swiglu``.

The new ``DeepseekV3LowPrecisionExperts``:

- registers the *same* ``gate_up_proj [E, 2F, H]`` and ``down_proj [E, H, F]`` ``Parameter``
  objects and the same ``act_fn`` submodule, in HF's order, so FQNs and ``state_dict`` keys are
  unchanged; it keeps ``num_experts``, ``hidden_dim``, ``intermediate_dim`` and every other plain
  attribute HF set (``config``, the ``@use_experts_implementation`` flags), and the ``training``
  flag;
- has HF's ``forward(hidden_states, top_k_index, top_k_weights)`` signature and is a plain
  ``nn.Module`` subclass, not decorated with ``@use_experts_implementation``: HF's
  ``config._experts_implementation`` dispatch cannot route around this forward.

Forward (``S`` tokens, top-``k`` routing, ``T = S·k`` token slots, slot ``t = s·k + j``)::

    flat_T        = top_k_index.reshape(-1)                    expert of each slot
    order_T       = argsort(flat_T, stable=True)               slots sorted by expert (ties keep token order)
    group_list_E  = per-expert slot counts (int64)             torch_npu group_list_type=1
    x_TH          = hidden_states[order_T // k]                token rows in expert order
    y_TH          = low_precision_grouped_swiglu(x_TH, group_list_E, gate_up_proj, down_proj)
    out_SH (FP32) = index_add over slots of y_TH · top_k_weights[slot]
    return out_SH.to(hidden_states.dtype)

The weighting and the scatter-add run in FP32 and round once (HF rounds each expert's weighted
output to the activation dtype before its ``index_add_``); the output dtype is HF's
(``hidden_states.dtype``). Gradients flow to ``hidden_states``, both weights and
``top_k_weights`` (the router is trained). Experts with no slot get an exactly zero gradient.

``top_k_index`` values must lie in ``[0, E)``. HF's sentinel ``E`` (slots owned by another
expert-parallel rank) never occurs here: expert parallelism > 1 is rejected at startup (requirement
R7, docs/design.md), and checking the range would cost a device→host sync per layer.

Tensor-name legend: ``S`` tokens, ``k`` top-k, ``T`` token slots, ``H`` hidden size, ``F``
expert intermediate size, ``E`` experts.
"""

from typing import ClassVar

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

from lp_lightning.formats.recipe import LowPrecisionRecipe, recipe_for
from lp_lightning.functional.grouped_linear import low_precision_grouped_swiglu
from lp_lightning.functional.linear import selects_low_precision_operand
from lp_lightning.modules.linear import check_factory_arguments, copy_plain_attributes
from lp_lightning.policy import LowPrecisionPolicy

__all__ = ["DeepseekV3LowPrecisionExperts", "replace_deepseek_v3_low_precision_experts"]


class DeepseekV3LowPrecisionExperts(nn.Module):
    """HF ``DeepseekV3Experts`` with its six GEMMs (gate_up/down × fprop/dgrad/wgrad) in low precision.

    Build it with ``replace_deepseek_v3_low_precision_experts``.

    Attributes:
        num_experts: ``E``.
        hidden_dim: ``H``.
        intermediate_dim: ``F`` (``moe_intermediate_size``).
        gate_up_proj: The source's ``Parameter`` ``[E, 2F, H]`` (gate rows first, then up); after the
            low-precision weights are built, a tensor whose ``select`` yields GMM-view operands.
        down_proj: The source's ``Parameter`` ``[E, H, F]``.
        act_fn: The source's activation module (SiLU; SwiGLU is fixed by the grouped function).
        policy: The ``LowPrecisionPolicy`` the module was built with.
        recipe: The ``LowPrecisionRecipe`` of ``policy.format``.
        fqn: The module's fully qualified name.
        low_precision_weight_names: Class attribute ``("gate_up_proj", "down_proj")``: the
            parameters ``lp_lightning.fsdp.weights.finalize_low_precision_weights`` turns into
            persistent low-precision weights (``low_precision_weight_kind = "grouped"``: GEMM
            views ``[E, H, 2F]`` and ``[E, F, H]``).
    """

    low_precision_weight_names: ClassVar[tuple[str, ...]] = ("gate_up_proj", "down_proj")
    low_precision_weight_kind: ClassVar[str] = "grouped"
    num_experts: int
    hidden_dim: int
    intermediate_dim: int
    policy: LowPrecisionPolicy
    recipe: LowPrecisionRecipe
    fqn: str

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError(
            "DeepseekV3LowPrecisionExperts is built from an existing HF DeepseekV3Experts: use "
            "lp_lightning.models.deepseek_v3.experts.replace_deepseek_v3_low_precision_experts(source, fqn=..., policy=...)."
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Routed-expert SwiGLU of every token's top-k experts, weighted and summed per token.

        Args:
            hidden_states: ``[S, H]`` token activations (HF flattens batch and sequence first).
            top_k_index: ``[S, k]`` integer expert ids in ``[0, E)``.
            top_k_weights: ``[S, k]`` floating routing weights (any float dtype; used in FP32).

        Returns:
            ``[S, H]`` in ``hidden_states.dtype``: ``Σ_j top_k_weights[s, j] · expert_{top_k_index[s, j]}(h_s)``.

        Raises:
            TypeError: for a non-integer ``top_k_index``, a non-floating ``top_k_weights`` or
                weights that are still plain high-precision Parameters.
            ValueError: for shapes that do not match ``[S, H]``, ``[S, k]``, ``[S, k]``, or an
                expert id outside ``[0, E)``.
        """
        self._check_inputs(hidden_states, top_k_index, top_k_weights)
        num_slots_per_token = top_k_index.shape[1]
        flat_T = top_k_index.reshape(-1)
        order_T = torch.argsort(flat_T, stable=True)
        token_T = order_T // num_slots_per_token
        group_list_E = torch.zeros(self.num_experts, dtype=torch.int64, device=flat_T.device)
        group_list_E.scatter_add_(0, flat_T.to(torch.int64), torch.ones_like(flat_T, dtype=torch.int64))

        x_TH = hidden_states[token_T]
        y_TH = low_precision_grouped_swiglu(x_TH, group_list_E, self.gate_up_proj, self.down_proj, recipe=self.recipe)
        weight_T = top_k_weights.reshape(-1)[order_T].to(torch.float32)
        out32_SH = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
        out32_SH = out32_SH.index_add(0, token_T, y_TH.to(torch.float32) * weight_T[:, None])
        return out32_SH.to(hidden_states.dtype)

    def _check_inputs(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        who = f"DeepseekV3LowPrecisionExperts {self.fqn!r}"
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(self, name)
            if not selects_low_precision_operand(weight):
                raise TypeError(
                    f"{who}: {name} is still the plain high-precision Parameter {tuple(weight.shape)}; build the "
                    f"{self.recipe.format.name} weights after applying the plan with "
                    "lp_lightning.fsdp.weights.finalize_low_precision_weights."
                )
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.hidden_dim:
            raise ValueError(
                f"{who}: hidden_states must be [S, H={self.hidden_dim}] (tokens flattened), got {tuple(hidden_states.shape)}."
            )
        if top_k_index.dtype.is_floating_point or top_k_index.dtype.is_complex or top_k_index.dtype == torch.bool:
            raise TypeError(f"{who}: top_k_index must be an integer tensor of expert ids, got {top_k_index.dtype}.")
        if not top_k_weights.is_floating_point():
            raise TypeError(f"{who}: top_k_weights must be a floating-point tensor, got {top_k_weights.dtype}.")
        expected = (hidden_states.shape[0],)
        if top_k_index.dim() != 2 or top_k_index.shape[:1] != expected or top_k_weights.shape != top_k_index.shape:
            raise ValueError(
                f"{who}: top_k_index and top_k_weights must both be [S={hidden_states.shape[0]}, k], got "
                f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}."
            )
        outside = (top_k_index < 0) | (top_k_index >= self.num_experts)
        if bool(outside.any()):  # one host sync; an out-of-range id would otherwise fail inside scatter_add_
            bad = top_k_index[outside].unique()[:8].tolist()
            raise ValueError(
                f"{who}: top_k_index holds expert ids {bad} outside [0, {self.num_experts}); the router must pick "
                "experts of this layer (no expert parallelism: HF's sentinel E is not accepted)."
            )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}, "
            f"format={self.recipe.format.name}, fqn={self.fqn!r}"
        )


def replace_deepseek_v3_low_precision_experts(
    source: DeepseekV3Experts, *, fqn: str, policy: LowPrecisionPolicy
) -> DeepseekV3LowPrecisionExperts:
    """Replacement factory: a ``DeepseekV3LowPrecisionExperts`` that takes over ``source``'s state.

    ``source`` is not modified; the new module registers the same ``gate_up_proj``/``down_proj``
    ``Parameter`` objects and ``act_fn`` module (no copy, no allocation, no re-init).

    Args:
        source: An exact HF ``DeepseekV3Experts`` (``type(source) is DeepseekV3Experts``).
        fqn: Its fully qualified name, e.g. ``"model.layers.1.mlp.experts"``.
        policy: An enabled ``LowPrecisionPolicy``; ``recipe_for(policy.format, policy.backend)`` gives the recipe.

    Returns:
        The new module (same ``training`` flag).

    Raises:
        TypeError: if ``source`` is not exactly ``DeepseekV3Experts`` or its ``act_fn`` is not
            SiLU (the grouped function computes SwiGLU), naming ``fqn``; for a wrong ``policy`` type.
        ValueError: for an empty ``fqn``, a disabled policy, or parameter shapes that are not
            ``[E, 2F, H]`` / ``[E, H, F]``.
    """
    who = "replace_deepseek_v3_low_precision_experts"
    check_factory_arguments(who, source, DeepseekV3Experts, fqn, policy)
    if type(source.act_fn) is not SiLUActivation and type(source.act_fn) is not nn.SiLU:
        raise TypeError(
            f"{who}: {fqn!r} has act_fn {type(source.act_fn).__name__}; the low-precision grouped experts compute "
            "SwiGLU (silu(gate) * up) only. Set hidden_act='silu' or exclude this module from the plan."
        )
    num_experts, hidden, inter = source.num_experts, source.hidden_dim, source.intermediate_dim
    shapes = {"gate_up_proj": (num_experts, 2 * inter, hidden), "down_proj": (num_experts, hidden, inter)}
    for name, shape in shapes.items():
        if tuple(getattr(source, name).shape) != shape:
            raise ValueError(
                f"{who}: {fqn}.{name} has shape {tuple(getattr(source, name).shape)}, expected {shape} from "
                f"num_experts={num_experts}, hidden_dim={hidden}, intermediate_dim={inter}."
            )
    module = DeepseekV3LowPrecisionExperts.__new__(DeepseekV3LowPrecisionExperts)
    nn.Module.__init__(module)
    module.gate_up_proj = source.gate_up_proj
    module.down_proj = source.down_proj
    module.act_fn = source.act_fn
    copy_plain_attributes(source, module)
    module.policy = policy
    module.recipe = recipe_for(policy.format, policy.backend)
    module.fqn = fqn
    module.training = source.training
    return module
