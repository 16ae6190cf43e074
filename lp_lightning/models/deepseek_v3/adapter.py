"""The DeepSeek-V3 model adapter: what the generic layers need to know about HF's DeepSeek-V3 (design spec §2, §6).

:data:`DEEPSEEK_V3` (a :class:`DeepseekV3Adapter`, registered by :mod:`lp_lightning.models`) gives the
replacement plan, the FSDP2 application and the precision plugin:

- the default replacement rules
  (:func:`~lp_lightning.models.deepseek_v3.rules.deepseek_v3_default_rules`: every MLA projection,
  the dense MLP and shared-expert Linears, the routed experts; design spec §1.1, §4.3);
- the never-replace rules (:func:`~lp_lightning.models.deepseek_v3.rules.deepseek_v3_never_replace`:
  LM head, embedding, MoE router, norms, rotary embedding, core attention);
- the causal LM inside a module or wrapper (:func:`resolve_causal_lm`), its decoder layers
  ``model.layers`` (:func:`decoder_layers`, the FSDP2 and recompute units), the MoE routers HF keeps
  in FP32 (:func:`modules_kept_in_fp32`), and the meta twin the plan is compiled on
  (:func:`~lp_lightning.models.deepseek_v3.spec.build_meta_model`);

and the planner, the acceptance harness and the CLI:

- the named specs (:data:`~lp_lightning.models.deepseek_v3.spec.SPECS`) and the meta model of a spec
  or config path;
- the design spec §1.1 target groups found from the model's structure (:func:`deepseek_v3_target_groups`);
- the saved-for-backward bytes per decoder layer
  (:func:`~lp_lightning.models.deepseek_v3.activations.deepseek_v3_activations`).

Nothing low-precision is imported here: the routed-experts factory is the dotted path
:data:`DEEPSEEK_V3_EXPERTS_FACTORY`, imported by ``plan.apply`` only (mxfp8/hif8 runs). The rules
are :mod:`lp_lightning.plan` objects, built in :mod:`lp_lightning.models.deepseek_v3.rules`, which
is loaded only when they are asked for, so a ``bf16`` run, which uses the structure lookups alone,
imports no part of the plan (design spec §13.1).
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from lp_lightning.models.adapter import ActivationTerms, hf_model_type
from lp_lightning.models.deepseek_v3.activations import deepseek_v3_activations
from lp_lightning.models.deepseek_v3.spec import SPECS, build_meta_model

if TYPE_CHECKING:
    from lp_lightning.formats.spec import FormatSpec
    from lp_lightning.plan import NeverReplaceRule, ReplacementRule

__all__ = [
    "DEEPSEEK_V3",
    "DEEPSEEK_V3_EXPERTS_FACTORY",
    "DEEPSEEK_V3_EXPERTS_TYPE",
    "DEEPSEEK_V3_GLOB_HINT",
    "DeepseekV3Adapter",
    "decoder_layers",
    "deepseek_v3_target_groups",
    "modules_kept_in_fp32",
    "resolve_causal_lm",
]

DEEPSEEK_V3_EXPERTS_FACTORY = (
    "lp_lightning.models.deepseek_v3.experts.replace_deepseek_v3_low_precision_experts"
)
"""Format-agnostic factory that replaces HF ``DeepseekV3Experts`` whole (design spec §5.2)."""

DEEPSEEK_V3_EXPERTS_TYPE = "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Experts"
"""Dotted path of HF's routed-experts container (stacked ``gate_up_proj [E, 2F, H]``, ``down_proj [E, H, F]``)."""

DEEPSEEK_V3_GLOB_HINT = "for DeepSeek-V3, q_lora_rank set means q_a_proj/q_b_proj instead of q_proj"
"""Appended to the plan's zero-hit glob error."""


def deepseek_v3_target_groups(model: nn.Module) -> dict[str, list[str]]:
    """The design spec §1.1 targets of a DeepSeek-V3 model, found from its structure (not from a plan).

    Groups, in ``named_modules()`` order: ``mla`` (the ``nn.Linear`` projections of every
    ``self_attn``), ``dense_mlp`` / ``shared_experts`` (the ``nn.Linear`` of a dense ``mlp`` / of
    ``mlp.shared_experts``) and ``routed_experts`` (HF's stacked experts module).
    """
    experts_type = DEEPSEEK_V3_EXPERTS_TYPE.rsplit(".", 1)[1]
    targets: dict[str, list[str]] = {"mla": [], "dense_mlp": [], "shared_experts": [], "routed_experts": []}
    for fqn, module in model.named_modules():
        parent = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        if type(module).__name__ == experts_type:
            targets["routed_experts"].append(fqn)
        elif type(module) is nn.Linear and parent.endswith(".self_attn"):
            targets["mla"].append(fqn)
        elif type(module) is nn.Linear and parent.endswith(".mlp.shared_experts"):
            targets["shared_experts"].append(fqn)
        elif type(module) is nn.Linear and parent.endswith(".mlp"):
            targets["dense_mlp"].append(fqn)
    return targets


def _local_model_type(path: str) -> str | None:
    """``model_type`` of a local ``config.json`` (file, or folder holding one; absent: DeepSeek-V3's), else ``None``."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return None
    return config.get("model_type", DeepseekV3Adapter.name) if isinstance(config, dict) else None


def resolve_causal_lm(module: nn.Module) -> nn.Module:
    """Finds the HF causal LM (``X.model.layers`` is its decoder-layer list) in ``module``.

    Args:
        module: Either the HF ``*ForCausalLM`` itself or a wrapper (e.g. the LightningModule)
            that holds it at ``.model``.

    Returns:
        The causal LM whose decoder layers are ``.model.layers``.

    Raises:
        TypeError: Neither ``module.model.layers`` nor ``module.model.model.layers`` is an
            ``nn.ModuleList``.
    """
    for candidate in (module, getattr(module, "model", None)):
        inner = getattr(candidate, "model", None)
        if isinstance(candidate, nn.Module) and isinstance(getattr(inner, "layers", None), nn.ModuleList):
            return candidate
    raise TypeError(
        f"cannot find a Hugging Face causal LM in {type(module).__name__}: no nn.ModuleList at "
        f"`module.model.layers` or `module.model.model.layers`. Pass a *ForCausalLM or a "
        f"wrapper holding one at `.model`."
    )


def decoder_layers(causal_lm: nn.Module) -> nn.ModuleList:
    """The decoder layers ``causal_lm.model.layers`` (the FSDP2 / recompute unit, design spec §9)."""
    layers = getattr(getattr(causal_lm, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"{type(causal_lm).__name__}.model.layers is not an nn.ModuleList; pass the HF "
            f"*ForCausalLM (see resolve_causal_lm)."
        )
    return layers


def modules_kept_in_fp32(causal_lm: nn.Module) -> tuple[str, ...]:
    """FQNs of the MoE routers whose Parameters HF keeps in FP32 while the model also holds BF16 ones.

    HF creates the router weight ``model.layers.<i>.mlp.gate.weight`` (``DeepseekV3TopkRouter``) in
    FP32 inside a BF16 model (``_keep_in_fp32_modules_strict``); its compute must stay FP32 after
    sharding. Call it before the FP32 upcast. A model built entirely in FP32 (or entirely in BF16)
    yields ``()``.

    Args:
        causal_lm: The plain (unsharded) model.

    Returns:
        FQNs in ``named_modules()`` order.
    """
    if not any(p.dtype == torch.bfloat16 for p in causal_lm.parameters()):
        return ()
    kept = []
    for fqn, sub in causal_lm.named_modules():
        own = list(sub.parameters(recurse=False))
        if isinstance(sub, DeepseekV3TopkRouter) and own and all(p.dtype == torch.float32 for p in own):
            kept.append(fqn)
    return tuple(kept)


class DeepseekV3Adapter:
    """:class:`~lp_lightning.models.adapter.ModelAdapter` of HF transformers' ``DeepseekV3ForCausalLM``."""

    name = "deepseek_v3"
    glob_hint: str | None = DEEPSEEK_V3_GLOB_HINT
    specs: Mapping[str, Mapping[str, Any]] = SPECS

    @property
    def never_replace(self) -> tuple[NeverReplaceRule, ...]:
        """See :func:`~lp_lightning.models.deepseek_v3.rules.deepseek_v3_never_replace` (imports :mod:`lp_lightning.plan`)."""
        return _rules().deepseek_v3_never_replace()

    def matches(self, model: nn.Module) -> bool:
        """Whether the HF ``config.model_type`` of ``model`` (or of a wrapper's ``.model``) is ``deepseek_v3``."""
        return hf_model_type(model) == self.name

    def causal_lm(self, module: nn.Module) -> nn.Module:
        """See :func:`resolve_causal_lm`."""
        return resolve_causal_lm(module)

    def decoder_layers(self, causal_lm: nn.Module) -> nn.ModuleList:
        """See :func:`decoder_layers`."""
        return decoder_layers(causal_lm)

    def fp32_compute_modules(self, causal_lm: nn.Module) -> tuple[str, ...]:
        """See :func:`modules_kept_in_fp32`."""
        return modules_kept_in_fp32(causal_lm)

    def default_replacement_rules(self, config: Any) -> tuple[ReplacementRule, ...]:
        """See :func:`~lp_lightning.models.deepseek_v3.rules.deepseek_v3_default_rules` (default factories)."""
        return _rules().deepseek_v3_default_rules(config)

    def build_meta_twin(self, causal_lm: nn.Module) -> nn.Module:
        """``build_meta_model`` of ``causal_lm``'s config with its attention backend (``sdpa`` when unset)."""
        config = causal_lm.config
        return build_meta_model(config, attn_implementation=getattr(config, "_attn_implementation", None) or "sdpa")

    def builds(self, config_name_or_path: str | os.PathLike[str]) -> bool:
        """A key of :data:`SPECS`, or a local ``config.json`` (file or folder) of ``model_type`` ``deepseek_v3``."""
        name = os.fspath(config_name_or_path)
        return name in SPECS or _local_model_type(name) == self.name

    def build_meta_model(
        self, config: Any, *, config_overrides: Mapping[str, Any] | None = None, attn_implementation: str = "sdpa"
    ) -> nn.Module:
        """See :func:`~lp_lightning.models.deepseek_v3.spec.build_meta_model` (BF16, eager experts)."""
        return build_meta_model(config, config_overrides=config_overrides, attn_implementation=attn_implementation)

    def target_groups(self, model: nn.Module) -> dict[str, list[str]]:
        """See :func:`deepseek_v3_target_groups`."""
        return deepseek_v3_target_groups(model)

    def activation_terms(
        self,
        config: Any,
        *,
        micro_batch_size: int,
        seq_len: int,
        low_precision_modules: Collection[str],
        format: FormatSpec | None,
        activation_dtype: torch.dtype,
    ) -> ActivationTerms:
        """See :func:`~lp_lightning.models.deepseek_v3.activations.deepseek_v3_activations`."""
        return deepseek_v3_activations(
            config, micro_batch_size=micro_batch_size, seq_len=seq_len, low_precision_modules=low_precision_modules,
            format=format, activation_dtype=activation_dtype,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _rules() -> ModuleType:
    """:mod:`lp_lightning.models.deepseek_v3.rules`, the adapter's replacement and never-replace rules."""
    # Imported here: the rules are lp_lightning.plan objects, which a bf16 run never loads.
    from lp_lightning.models.deepseek_v3 import rules

    return rules


DEEPSEEK_V3 = DeepseekV3Adapter()
"""The DeepSeek-V3 adapter instance (registered by :mod:`lp_lightning.models`)."""
