"""The DeepSeek-V3 replacement rules (design spec §1.1, §4.3): the default rules and the never-replace rules.

:func:`deepseek_v3_default_rules` lists every target by its full FQN (every MLA projection, the dense
MLP and shared-expert Linears, the routed experts); :func:`deepseek_v3_never_replace` is the model's
boundary (LM head, embedding, MoE router, norms, rotary embedding, core attention). The adapter
(:data:`~lp_lightning.models.deepseek_v3.adapter.DEEPSEEK_V3`) hands them out as
``default_replacement_rules`` and ``never_replace``. This module builds :mod:`lp_lightning.plan`
objects; the adapter loads it only when the rules are asked for, so a ``bf16`` run, which uses the
adapter's structure lookups alone, imports no part of the plan (design spec §13.1).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from lp_lightning.models.adapter import LINEAR_FACTORY
from lp_lightning.models.deepseek_v3.adapter import DEEPSEEK_V3_EXPERTS_FACTORY, DEEPSEEK_V3_EXPERTS_TYPE
from lp_lightning.plan import NeverReplaceRule, ReplacementFactory, ReplacementRule

__all__ = ["deepseek_v3_default_rules", "deepseek_v3_never_replace"]


@functools.cache
def deepseek_v3_never_replace() -> tuple[NeverReplaceRule, ...]:
    """Modules of a DeepSeek-V3 model that stay high precision whatever the rules say (design spec §1.1).

    LM head, embedding, MoE router (``mlp.gate``, ``DeepseekV3TopkRouter``), norms, rotary
    embedding and core attention (``self_attn``). A rule that selects such a module, or a module
    containing one, fails at compile time. The class-name globs catch a renamed router, rotary
    embedding or attention module as well; embeddings and norms are refused by type by the plan
    itself.
    """
    return (
        NeverReplaceRule(reason="LM head", fqn_globs=("lm_head", "*.lm_head")),
        NeverReplaceRule(reason="embedding", fqn_globs=("*embed_tokens",)),
        NeverReplaceRule(reason="MoE router", fqn_globs=("*.mlp.gate",), type_names=("*Router",)),
        NeverReplaceRule(reason="normalization", fqn_globs=("*norm",)),
        NeverReplaceRule(reason="rotary embedding", fqn_globs=("*rotary_emb",), type_names=("*RotaryEmbedding",)),
        NeverReplaceRule(
            reason="core attention (QK, softmax, PV)", fqn_globs=("*.self_attn",), type_names=("*Attention",)
        ),
    )


def _config_value(config: Any, key: str) -> Any:
    if isinstance(config, Mapping):
        if key not in config:
            raise ValueError(f"DeepSeek-V3 config has no {key!r}; it is needed to list the replacement targets.")
        return config[key]
    if not hasattr(config, key):
        raise ValueError(
            f"DeepSeek-V3 config {type(config).__name__} has no {key!r}; it is needed to list the "
            "replacement targets."
        )
    return getattr(config, key)


def deepseek_v3_default_rules(
    config: Any,
    *,
    linear_factory: str | ReplacementFactory = LINEAR_FACTORY,
    experts_factory: str | ReplacementFactory = DEEPSEEK_V3_EXPERTS_FACTORY,
) -> tuple[ReplacementRule, ...]:
    """The default DeepSeek-V3 rules with every target listed by its full FQN (design spec §1.1, §4.3).

    Four rules (names are the keys of the report's counts):

    - ``mla_projections``: per layer ``self_attn.q_proj`` (``q_lora_rank`` null) or
      ``self_attn.q_a_proj`` + ``self_attn.q_b_proj`` (``q_lora_rank`` set), plus
      ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``; exact ``nn.Linear``.
    - ``dense_mlp``: ``mlp.{gate,up,down}_proj`` of layers ``0 .. first_k_dense_replace-1``.
    - ``shared_experts``: ``mlp.shared_experts.{gate,up,down}_proj`` of the MoE layers.
    - ``routed_experts``: ``mlp.experts`` of the MoE layers, exact ``DeepseekV3Experts``.

    For the frozen 16B spec (28 layers, 1 dense, q_lora_rank null) that is 112 / 3 / 81 / 27
    targets; ``configs/plan_deepseek_v3.yaml`` is the same plan for dsv3-16b as a ``plan_overrides`` YAML.

    Args:
        config: A ``DeepseekV3Config`` (or a mapping) with ``num_hidden_layers``,
            ``first_k_dense_replace`` and ``q_lora_rank``.
        linear_factory: Factory for the Linear rules (dotted path or callable).
        experts_factory: Factory for the routed-experts rule (dotted path or callable).

    Returns:
        The four rules, in the order above (``dense_mlp`` is omitted when there is no dense layer,
        ``shared_experts``/``routed_experts`` when there is no MoE layer).

    Raises:
        ValueError: a config field is missing or out of range.
    """
    num_layers = _config_value(config, "num_hidden_layers")
    first_dense = _config_value(config, "first_k_dense_replace")
    q_lora_rank = _config_value(config, "q_lora_rank")
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_hidden_layers must be a positive int, got {num_layers!r}.")
    if not isinstance(first_dense, int) or not 0 <= first_dense <= num_layers:
        raise ValueError(
            f"first_k_dense_replace must be an int in [0, num_hidden_layers={num_layers}], got {first_dense!r}."
        )
    q_names = ("q_proj",) if q_lora_rank is None else ("q_a_proj", "q_b_proj")
    mla_names = (*q_names, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    mlp_names = ("gate_proj", "up_proj", "down_proj")
    dense_layers = range(first_dense)
    moe_layers = range(first_dense, num_layers)
    linear = {"module_type": "torch.nn.Linear", "exact_type": True, "replace_module": linear_factory}
    rules = [
        ReplacementRule(
            name="mla_projections",
            match=tuple(f"model.layers.{i}.self_attn.{n}" for i in range(num_layers) for n in mla_names),
            **linear,
        )
    ]
    if dense_layers:
        rules.append(
            ReplacementRule(
                name="dense_mlp",
                match=tuple(f"model.layers.{i}.mlp.{n}" for i in dense_layers for n in mlp_names),
                **linear,
            )
        )
    if moe_layers:
        rules.append(
            ReplacementRule(
                name="shared_experts",
                match=tuple(f"model.layers.{i}.mlp.shared_experts.{n}" for i in moe_layers for n in mlp_names),
                **linear,
            )
        )
        rules.append(
            ReplacementRule(
                name="routed_experts",
                match=tuple(f"model.layers.{i}.mlp.experts" for i in moe_layers),
                module_type=DEEPSEEK_V3_EXPERTS_TYPE,
                exact_type=True,
                replace_module=experts_factory,
            )
        )
    return tuple(rules)
