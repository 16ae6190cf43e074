"""What autograd saves for backward in one DeepSeek-V3 training micro-batch (``lp-lightning plan``; docs/planner.md).

The DeepSeek-V3 adapter's ``activation_terms`` (:class:`~lp_lightning.models.adapter.ActivationTerms`);
the planner adds the terms up per ``activation_checkpoint`` mode.

Derived from HF transformers' DeepSeek-V3 modules (MLA attention, dense MLP, MoE with router,
routed and shared experts) and from this package's low-precision autograd functions, tensor by
tensor, for ``T = b·s`` tokens (micro batch ``b``, sequence length ``s``), activation dtype ``a``
bytes (BF16: 2) and, in mxfp8/hif8, 8-bit data of ``d`` bytes (1) per element:

- **RMSNorm** (HF upcasts): the FP32 input copy, the FP32 ``rsqrt`` per token, the normalised
  input in the activation dtype: ``T·(4D + 4 + a·D)``.
- **A high-precision linear** (``F.linear``) saves its input, once per distinct input tensor
  (``q_proj``/``kv_a_proj_with_mqa`` and ``gate_proj``/``up_proj`` read the same one): ``a·T·K``.
- **A low-precision linear** (``functional.linear``) saves its own ``INPUT_BWD`` col operand for
  wgrad, quantized in forward (design spec §8): ``d·T·K`` data plus the format's col scale
  (MXFP8: one E8M0 per 32 rows, ``ceil(T/32)·K`` bytes; HiF8: one FP32 per tensor). Two
  low-precision linears reading one tensor save two operands.
- **Attention** (``sdpa``, flash-style kernels): ``q`` and ``k`` ``[b, N, s, Dn+Dr]``, the value
  view's storage (the ``kv_b_proj`` output ``[T, N(Dn+Dv)]``), the output ``[b, N, s, Dv]`` and the
  FP32 logsumexp ``[b, N, s]``. (The Ascend fused kernel keeps FP32 softmax max and sum
  ``[b, N, s, 8]`` instead of the logsumexp: ``60·N·T`` bytes more per layer.) RoPE saves ``cos``
  and ``sin`` ``[1, s, Dr]``, computed once per forward and shared by every layer.
- **SwiGLU MLP** (dense and shared experts, width ``I``): gate, up and ``silu(gate)`` outputs
  ``3·a·T·I``, and the down projection's input (the product, or its operand).
- **Router** (FP32, HF's ``DeepseekV3TopkRouter``): the FP32 input ``4H``, the sigmoid scores
  ``4E``, the int64 expert indices the routing weights are gathered with and, with
  ``norm_topk_prob``, the denominator and normalised weights: per token ``4H + 4E + 8k (+ 4 + 4k)``.
  (The group top-k and the expert mask are saved by graph branches that die inside the router.)
- **Routed experts**, ``R = T·k`` routed rows. HF's per-expert loop (bf16): the ``torch.where``
  indices 16, the gathered input ``aH``, the gate_up output ``2aF``, ``silu`` and product ``2aF``,
  the routing weight 4, the down output ``aH`` and the ``index_add_`` source ``aH`` per row. The
  low-precision grouped SwiGLU (``functional.grouped_linear``): the two int64 orderings 16, the
  gate_up output ``2aF``, the col operands of ``x`` (``d·H``) and ``h`` (``d·F``) with their
  grouped scales, the FP32 routing weight 4, the FP32 expert output and the ``index_add`` source
  ``8H`` per row, and ``group_list`` ``8E``. MXFP8 grouped col scales stop at expert boundaries, so
  their rows depend on the routing; the bound used is ``E - 1`` experts with one row each
  (``ceil(R/32) + E - 1`` rows at most).
- **Outside the layers**: the embedding's int64 token ids ``8T``, the final norm, the LM head's
  input ``a·T·H``, the int64 labels of the cross entropy ``8T``. The logits are their own term
  (:attr:`~lp_lightning.models.adapter.ActivationTerms.loss_logits`): BF16 logits, their FP32 copy
  and the FP32 log-softmax output (saved) in forward (``10·T·V``), the saved log-softmax output,
  the NLL gradient and the log-softmax gradient at the start of backward (``12·T·V``).

``activation_checkpoint="full"`` keeps each decoder layer's input ``a·T·H`` (``layer_input``) and,
in backward, the saved tensors of the one layer being recomputed.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch

from lp_lightning.models.adapter import ActivationTerms

if TYPE_CHECKING:
    from lp_lightning.formats.spec import FormatSpec

__all__ = ["deepseek_v3_activations"]

_FP32, _INT64 = 4, 8


def deepseek_v3_activations(
    config: Any,
    *,
    micro_batch_size: int,
    seq_len: int,
    low_precision_modules: Collection[str],
    format: FormatSpec | None,
    activation_dtype: torch.dtype = torch.bfloat16,
    layer_prefix: str = "model.layers",
) -> ActivationTerms:
    """The saved-for-backward bytes of a DeepSeek-V3 micro-batch, per term (module docstring; docs/planner.md).

    Args:
        config: The model's ``DeepseekV3Config``.
        micro_batch_size: Sequences per rank per micro-batch ``b``.
        seq_len: Tokens per sequence ``s``.
        low_precision_modules: FQNs of the modules the plan made low precision.
        format: Their ``FormatSpec`` (``None`` in bf16).
        activation_dtype: The compute dtype (FSDP2 ``param_dtype``).
        layer_prefix: FQN of the decoder-layer list.

    Returns:
        The :class:`~lp_lightning.models.adapter.ActivationTerms` (no recompute applied).
    """
    c = _Counter(config, micro_batch_size * seq_len, seq_len, frozenset(low_precision_modules), format, activation_dtype)
    layers = tuple(c.layer(f"{layer_prefix}.{i}", i) for i in range(config.num_hidden_layers))
    outside = {
        "input_ids (embedding)": _INT64 * c.T,
        "rotary cos/sin": 2 * c.a * seq_len * config.qk_rope_head_dim,
        "final norm": c.rms_norm(config.hidden_size),
        "lm_head input": c.a * c.T * config.hidden_size,
        "labels (cross entropy)": _INT64 * c.T,
    }
    vocab_tokens = c.T * config.vocab_size
    loss_logits = max((c.a + 2 * _FP32) * vocab_tokens, 3 * _FP32 * vocab_tokens)
    return ActivationTerms(layers, outside, c.a * c.T * config.hidden_size, loss_logits)


class _Counter:
    """The terms of one model (module docstring); ``T`` tokens, ``a`` activation bytes."""

    def __init__(
        self, config: Any, tokens: int, seq_len: int, lp: frozenset[str], fmt: FormatSpec | None, dtype: torch.dtype
    ) -> None:
        self.config, self.T, self.s, self.lp, self.fmt, self.a = config, tokens, seq_len, lp, fmt, dtype.itemsize

    def rms_norm(self, dim: int) -> int:
        return self.T * (_FP32 * dim + _FP32 + self.a * dim)

    def operand(self, rows: int, cols: int, group_counts: list[int] | None = None) -> int:
        """A saved ``INPUT_BWD`` col operand ``[rows, cols]`` (8-bit data and the format's scale)."""
        assert self.fmt is not None
        scale = self.fmt.scale_shape((rows, cols), "col", group_counts)
        return rows * cols * self.fmt.data_dtype.itemsize + math.prod(scale) * self.fmt.scale_dtype.itemsize

    def linear_inputs(self, fqns: list[str], cols: int) -> int:
        """Linears reading one ``[T, cols]`` tensor: one high-precision copy shared, one operand each low-precision."""
        low = [fqn for fqn in fqns if fqn in self.lp]
        shared = self.a * self.T * cols if len(low) < len(fqns) else 0
        return shared + sum(self.operand(self.T, cols) for _ in low)

    def layer(self, prefix: str, index: int) -> dict[str, int]:
        cfg, T, a = self.config, self.T, self.a
        H, N = cfg.hidden_size, cfg.num_attention_heads
        dn, dr, dv, C = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        attn = f"{prefix}.self_attn"
        terms = {"input_layernorm": self.rms_norm(H)}
        if cfg.q_lora_rank is None:
            terms["q_proj/kv_a_proj input"] = self.linear_inputs([f"{attn}.q_proj", f"{attn}.kv_a_proj_with_mqa"], H)
        else:
            Q = cfg.q_lora_rank
            terms["q_a_proj/kv_a_proj input"] = self.linear_inputs([f"{attn}.q_a_proj", f"{attn}.kv_a_proj_with_mqa"], H)
            terms["q_a_layernorm"] = self.rms_norm(Q)
            terms["q_b_proj input"] = self.linear_inputs([f"{attn}.q_b_proj"], Q)
        terms["kv_a_layernorm"] = self.rms_norm(C)
        terms["kv_b_proj input"] = self.linear_inputs([f"{attn}.kv_b_proj"], C)
        terms["attention q, k, v, out, logsumexp"] = a * T * N * (2 * (dn + dr) + (dn + dv) + dv) + _FP32 * T * N
        terms["o_proj input"] = self.linear_inputs([f"{attn}.o_proj"], N * dv)
        terms["post_attention_layernorm"] = self.rms_norm(H)
        mlp = f"{prefix}.mlp"
        if index < cfg.first_k_dense_replace:
            terms.update(self.swiglu(mlp, cfg.intermediate_size, "mlp"))
            return terms
        E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
        router = _FP32 * H + _FP32 * E + _INT64 * k
        if cfg.norm_topk_prob:
            router += _FP32 + _FP32 * k
        terms["router (FP32)"] = T * router
        terms["routed experts"] = self.routed_experts(f"{mlp}.experts", H, cfg.moe_intermediate_size, E, T * k)
        terms.update(self.swiglu(f"{mlp}.shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts, "shared experts"))
        return terms

    def swiglu(self, prefix: str, width: int, name: str) -> dict[str, int]:
        H = self.config.hidden_size
        return {
            f"{name} gate/up input": self.linear_inputs([f"{prefix}.gate_proj", f"{prefix}.up_proj"], H),
            f"{name} gate, up, silu outputs": 3 * self.a * self.T * width,
            f"{name} down input": self.linear_inputs([f"{prefix}.down_proj"], width),
        }

    def routed_experts(self, fqn: str, H: int, F: int, E: int, R: int) -> int:
        a = self.a
        if fqn not in self.lp:  # HF's per-expert loop
            return R * (2 * _INT64 + 3 * a * H + 4 * a * F + _FP32)
        counts = [1] * min(E - 1, R) + [max(R - (E - 1), 0)]  # the scale-row bound (module docstring)
        counts += [0] * (E - len(counts))
        per_row = 2 * _INT64 + 2 * a * F + _FP32 + 2 * _FP32 * H
        return R * per_row + self.operand(R, H, counts) + self.operand(R, F, counts) + _INT64 * E
