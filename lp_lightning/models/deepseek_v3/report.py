"""Structure report of a HF DeepSeek-V3 model and its analytic expectation (design spec §4.1, requirement R4 (docs/design.md)).

Two independent sources describe the same structure:

* :func:`structure_report` reads a *built* ``DeepseekV3ForCausalLM`` (meta or materialised): layer
  layout, every parameter's shape grouped by FQN glob, parameter counts.
* :func:`expected_structure` derives the same :class:`StructureReport` *analytically* from the config
  fields alone (shape formulas of ``modeling_deepseek_v3.py`` and a closed-form parameter count),
  without building anything.

:func:`lp_lightning.models.deepseek_v3.spec.validate_spec` compares the two.

Dimension legend (DeepseekV3Config field names):
    V   vocab_size                 H   hidden_size
    I   intermediate_size          F   moe_intermediate_size
    L   num_hidden_layers          K   first_k_dense_replace (layers ``0..K-1`` are dense)
    N   num_attention_heads        Q   q_lora_rank (None: plain ``q_proj``)
    C   kv_lora_rank               Dn  qk_nope_head_dim     Dr  qk_rope_head_dim    Dv  v_head_dim
    E   n_routed_experts           S   n_shared_experts     k   num_experts_per_tok

Parameter shapes follow ``nn.Linear`` (``[out_features, in_features]``) and the stacked 3-D experts
of transformers 5.x: ``gate_up_proj [E, 2F, H]``, ``down_proj [E, H, F]``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = [
    "LAYER_GLOB",
    "STRUCTURE_FIELDS",
    "StructureReport",
    "expected_structure",
    "format_layers",
    "param_dtype_summary",
    "structure_report",
]

#: Placeholder that replaces the decoder-layer index in parameter FQNs of the report.
LAYER_GLOB = "*"

#: Config fields that determine the structure (shapes and parameter count) of the model.
#: ``num_key_value_heads`` is absent on purpose: HF's MLA attention does not read it for any shape.
STRUCTURE_FIELDS: tuple[str, ...] = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "first_k_dense_replace",
    "num_attention_heads",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "attention_bias",
    "tie_word_embeddings",
)

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
# Weights that are GEMM operands inside decoder layers (2-D Linear weights and 3-D expert stacks).
_PROJECTION_RE = re.compile(r"(_proj\.weight|_proj_with_mqa\.weight|experts\.gate_up_proj|experts\.down_proj)$")


@dataclass(frozen=True, kw_only=True, slots=True)
class StructureReport:
    """Structure of a DeepSeek-V3 causal LM, comparable field by field.

    Attributes:
        layers: Number of decoder layers (``L``).
        dense_layers: Indices of layers with a dense ``DeepseekV3MLP`` (``0..K-1``).
        moe_layers: Indices of layers with a ``DeepseekV3MoE`` (``K..L-1``).
        n_routed_experts: Routed experts per MoE layer (``E``); 0 when there is no MoE layer.
        n_shared_experts: Shared experts per MoE layer (``S``), derived as the shared MLP width
            divided by ``F``; 0 when there is no MoE layer.
        num_experts_per_tok: Router top-k (``k``); 0 when there is no MoE layer.
        parameter_shapes: ``(fqn_glob, shape)`` pairs, sorted by glob, for every parameter; the
            decoder-layer index is replaced by ``*``. Every layer matching a glob has that shape.
        projection_shapes: The subset of ``parameter_shapes`` that are GEMM weights inside the
            decoder layers (MLA projections, dense/shared MLP ``*_proj``, expert stacks).
        total_params: Number of parameter elements (shared/tied parameters counted once).
        embedding_params: Elements of ``embed_tokens`` plus an untied ``lm_head``.
        routed_expert_params: Elements of all routed-expert stacks (``3·E·H·F`` per MoE layer).
        activated_params: Elements one token touches: ``total - (E - k)/E · routed_expert_params``.
    """

    layers: int
    dense_layers: tuple[int, ...]
    moe_layers: tuple[int, ...]
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    parameter_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    projection_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    total_params: int
    embedding_params: int
    routed_expert_params: int
    activated_params: int

    def as_dict(self) -> dict[str, Any]:
        """Returns a JSON-serialisable dict (tuples become lists, shape tables become dicts)."""
        return {
            "layers": self.layers,
            "dense_layers": list(self.dense_layers),
            "moe_layers": list(self.moe_layers),
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "parameter_shapes": {glob: list(shape) for glob, shape in self.parameter_shapes},
            "projection_shapes": {glob: list(shape) for glob, shape in self.projection_shapes},
            "total_params": self.total_params,
            "embedding_params": self.embedding_params,
            "routed_expert_params": self.routed_expert_params,
            "activated_params": self.activated_params,
        }

    def to_json(self) -> str:
        """Returns :meth:`as_dict` as indented JSON."""
        return json.dumps(self.as_dict(), indent=2)

    def format(self) -> str:
        """Returns a human-readable multi-line summary (counts in elements and billions)."""
        lines = [
            f"layers               {self.layers}  (dense {format_layers(self.dense_layers)}, "
            f"MoE {format_layers(self.moe_layers)})",
            f"experts              {self.n_routed_experts} routed (top-{self.num_experts_per_tok}) "
            f"+ {self.n_shared_experts} shared per MoE layer",
            f"total parameters     {self.total_params:,} ({self.total_params / 1e9:.3f} B)",
            f"  embedding + head   {self.embedding_params:,}",
            f"  routed experts     {self.routed_expert_params:,}",
            f"activated per token  {self.activated_params:,} ({self.activated_params / 1e9:.3f} B)",
            "projection shapes [out, in] / [E, out, in]:",
        ]
        width = max((len(glob) for glob, _ in self.projection_shapes), default=0)
        lines += [f"  {glob:<{width}}  {list(shape)}" for glob, shape in self.projection_shapes]
        return "\n".join(lines)


def format_layers(indices: tuple[int, ...]) -> str:
    """Formats sorted layer indices compactly, e.g. ``(0, 1, 2, 5)`` -> ``'[0-2, 5]'``."""
    if not indices:
        return "[]"
    parts: list[str] = []
    start = prev = indices[0]
    for i in indices[1:] + (None,):
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return "[" + ", ".join(parts) + "]"


def _glob(fqn: str) -> str:
    return _LAYER_RE.sub(f"model.layers.{LAYER_GLOB}.", fqn, count=1)


def structure_report(model: nn.Module) -> StructureReport:
    """Reads the structure of a built ``DeepseekV3ForCausalLM`` (meta, CPU or accelerator).

    Only parameter names and shapes are read, so this works on the meta device and allocates
    nothing. Modules are recognised by parameter names (``mlp.experts.gate_up_proj`` marks a MoE
    layer), so the report stays valid after a module replacement that keeps the FQNs (R5).

    Args:
        model: A ``DeepseekV3ForCausalLM`` (or a module with the same parameter FQNs).

    Returns:
        The :class:`StructureReport` of ``model``.

    Raises:
        ValueError: If ``model`` has no ``model.layers.<i>.`` parameters, or two decoder layers
            disagree on the shape of one parameter glob (not a uniform DeepSeek-V3 stack).
    """
    shapes: dict[str, tuple[int, ...]] = {}
    layer_ids: set[int] = set()
    moe_ids: set[int] = set()
    total = embedding = routed = 0
    experts_shape: tuple[int, ...] | None = None
    for fqn, param in model.named_parameters():  # de-duplicates tied parameters
        shape = tuple(param.shape)
        total += param.numel()
        match = _LAYER_RE.match(fqn)
        if match is not None:
            layer_ids.add(int(match.group(1)))
            if fqn.endswith("mlp.experts.gate_up_proj"):
                moe_ids.add(int(match.group(1)))
                experts_shape = shape
            if ".mlp.experts." in fqn:
                routed += param.numel()
        elif fqn in ("model.embed_tokens.weight", "lm_head.weight"):
            embedding += param.numel()
        glob = _glob(fqn)
        if shapes.setdefault(glob, shape) != shape:
            raise ValueError(
                f"model: parameter {fqn!r} has shape {list(shape)} but another layer has "
                f"{list(shapes[glob])} for {glob!r}; structure_report expects a uniform "
                "DeepSeek-V3 decoder stack (build it with from_hf_config/build_meta_model)."
            )
    if not layer_ids:
        layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
        if layers is not None and layers < 1:
            raise ValueError(
                f"model: num_hidden_layers={layers} builds no decoder layer; a DeepSeek-V3 needs at "
                "least 1 (remove the num_hidden_layers override or set it >= 1)."
            )
        raise ValueError(
            f"model: {type(model).__name__} has no 'model.layers.<i>.' parameters; pass a "
            "transformers DeepseekV3ForCausalLM (e.g. from build_meta_model)."
        )
    n_layers = max(layer_ids) + 1
    moe_layers = tuple(sorted(moe_ids))
    dense_layers = tuple(i for i in range(n_layers) if i not in moe_ids)
    n_routed = top_k = n_shared = 0
    if experts_shape is not None:
        n_routed, two_f, _ = experts_shape
        shared = shapes.get(f"model.layers.{LAYER_GLOB}.mlp.shared_experts.gate_proj.weight")
        n_shared = shared[0] // (two_f // 2) if shared is not None else 0
        top_k = int(model.get_submodule(f"model.layers.{moe_layers[0]}.mlp.gate").top_k)
    activated = total - (routed * (n_routed - top_k) // n_routed if n_routed else 0)
    parameter_shapes = tuple(sorted(shapes.items()))
    return StructureReport(
        layers=n_layers,
        dense_layers=dense_layers,
        moe_layers=moe_layers,
        n_routed_experts=n_routed,
        n_shared_experts=n_shared,
        num_experts_per_tok=top_k,
        parameter_shapes=parameter_shapes,
        projection_shapes=tuple((g, s) for g, s in parameter_shapes if _is_projection(g)),
        total_params=total,
        embedding_params=embedding,
        routed_expert_params=routed,
        activated_params=activated,
    )


def _is_projection(glob: str) -> bool:
    return glob.startswith(f"model.layers.{LAYER_GLOB}.") and _PROJECTION_RE.search(glob) is not None


def expected_structure(fields: Mapping[str, Any]) -> StructureReport:
    """Derives the :class:`StructureReport` of a DeepSeek-V3 model from config fields alone.

    Shapes follow the constructors in transformers' ``modeling_deepseek_v3.py`` (5.x); the total
    parameter count is a closed form, not a sum over the shape table, so the two cross-check::

        attention  = [H·N(Dn+Dr)  |  H·Q + Q + Q·N(Dn+Dr)]  + H(C+Dr) + C + C·N(Dn+Dv) + N·Dv·H
                     (+ Q + C+Dr + H with attention_bias)
        dense MLP  = 3·H·I                    MoE = E·H + 3·E·H·F + 3·H·S·F
        total      = V·H·(2 - tied) + H + L·(attention + 2H) + K·dense + (L-K)·MoE

    Args:
        fields: Mapping holding every name of :data:`STRUCTURE_FIELDS` (e.g. a spec merged onto the
            DeepseekV3Config defaults, or ``config.to_dict()``).

    Returns:
        The expected :class:`StructureReport`.

    Raises:
        ValueError: If a field of :data:`STRUCTURE_FIELDS` is missing, or
            ``first_k_dense_replace`` is outside ``[0, num_hidden_layers]``.
    """
    missing = [name for name in STRUCTURE_FIELDS if name not in fields]
    if missing:
        raise ValueError(f"fields: missing {missing}; expected_structure needs all of {list(STRUCTURE_FIELDS)}.")
    f = fields
    V, H, I, F = f["vocab_size"], f["hidden_size"], f["intermediate_size"], f["moe_intermediate_size"]
    L, K, N = f["num_hidden_layers"], f["first_k_dense_replace"], f["num_attention_heads"]
    E, S, k = f["n_routed_experts"], f["n_shared_experts"], f["num_experts_per_tok"]
    Q, C = f["q_lora_rank"], f["kv_lora_rank"]
    Dn, Dr, Dv = f["qk_nope_head_dim"], f["qk_rope_head_dim"], f["v_head_dim"]
    bias, tied = bool(f["attention_bias"]), bool(f["tie_word_embeddings"])
    if not 0 <= K <= L:
        raise ValueError(
            f"first_k_dense_replace={K} is outside [0, num_hidden_layers={L}]; HF would build "
            f"{min(max(K, 0), L)} dense layers. Set first_k_dense_replace within that range."
        )
    layer = f"model.layers.{LAYER_GLOB}."
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (V, H),
        "model.norm.weight": (H,),
        layer + "input_layernorm.weight": (H,),
        layer + "post_attention_layernorm.weight": (H,),
        layer + "self_attn.kv_a_proj_with_mqa.weight": (C + Dr, H),
        layer + "self_attn.kv_a_layernorm.weight": (C,),
        layer + "self_attn.kv_b_proj.weight": (N * (Dn + Dv), C),
        layer + "self_attn.o_proj.weight": (H, N * Dv),
    }
    if not tied:
        shapes["lm_head.weight"] = (V, H)
    if Q is None:
        shapes[layer + "self_attn.q_proj.weight"] = (N * (Dn + Dr), H)
    else:
        shapes[layer + "self_attn.q_a_proj.weight"] = (Q, H)
        shapes[layer + "self_attn.q_a_layernorm.weight"] = (Q,)
        shapes[layer + "self_attn.q_b_proj.weight"] = (N * (Dn + Dr), Q)
    if bias:
        shapes[layer + "self_attn.kv_a_proj_with_mqa.bias"] = (C + Dr,)
        shapes[layer + "self_attn.o_proj.bias"] = (H,)
        if Q is not None:
            shapes[layer + "self_attn.q_a_proj.bias"] = (Q,)
    if K > 0:
        shapes[layer + "mlp.gate_proj.weight"] = (I, H)
        shapes[layer + "mlp.up_proj.weight"] = (I, H)
        shapes[layer + "mlp.down_proj.weight"] = (H, I)
    if K < L:
        shapes[layer + "mlp.gate.weight"] = (E, H)
        shapes[layer + "mlp.experts.gate_up_proj"] = (E, 2 * F, H)
        shapes[layer + "mlp.experts.down_proj"] = (E, H, F)
        shapes[layer + "mlp.shared_experts.gate_proj.weight"] = (S * F, H)
        shapes[layer + "mlp.shared_experts.up_proj.weight"] = (S * F, H)
        shapes[layer + "mlp.shared_experts.down_proj.weight"] = (H, S * F)

    q_params = H * N * (Dn + Dr) if Q is None else H * Q + Q + Q * N * (Dn + Dr)
    attention = q_params + H * (C + Dr) + C + C * N * (Dn + Dv) + N * Dv * H
    if bias:
        attention += (C + Dr) + H + (Q if Q is not None else 0)
    dense_mlp = 3 * H * I
    routed_per_layer = 3 * E * H * F
    moe = E * H + routed_per_layer + 3 * H * S * F
    embedding = V * H * (1 if tied else 2)
    total = embedding + H + L * (attention + 2 * H) + K * dense_mlp + (L - K) * moe
    routed = (L - K) * routed_per_layer
    n_moe = L - K
    activated = total - (routed * (E - k) // E if n_moe and E else 0)
    parameter_shapes = tuple(sorted(shapes.items()))
    return StructureReport(
        layers=L,
        dense_layers=tuple(range(K)),
        moe_layers=tuple(range(K, L)),
        n_routed_experts=E if n_moe else 0,
        n_shared_experts=S if n_moe else 0,
        num_experts_per_tok=k if n_moe else 0,
        parameter_shapes=parameter_shapes,
        projection_shapes=tuple((g, s) for g, s in parameter_shapes if _is_projection(g)),
        total_params=total,
        embedding_params=embedding,
        routed_expert_params=routed,
        activated_params=activated,
    )


def param_dtype_summary(model: nn.Module) -> dict[str, int]:
    """Counts parameter elements per dtype, e.g. ``{"torch.bfloat16": 15_700_000_000, ...}``.

    Args:
        model: Any module (meta allowed).

    Returns:
        Mapping ``str(dtype) -> elements``.
    """
    counts: dict[str, int] = {}
    for param in model.parameters():
        key = str(param.dtype)
        counts[key] = counts.get(key, 0) + param.numel()
    return counts
