"""What the generic layers need to know about a model, provided by its package (design spec §2, §6).

The replacement plan (:mod:`lp_lightning.plan`), the FSDP2 application
(:mod:`lp_lightning.fsdp.parallelize`) and the precision plugin know no model. A model package
describes its model with a :class:`ModelAdapter` (pure data and structure lookups; it imports no
low-precision type) and registers it; the generic layers find it with :func:`adapter_for`::

    adapter = adapter_for(module)                 # by the HF config's model_type
    causal_lm = adapter.causal_lm(module)         # the HF *ForCausalLM (module or a wrapper of it)
    adapter.decoder_layers(causal_lm)             # FSDP2 / recompute units
    adapter.fp32_compute_modules(causal_lm)       # sharded with param_dtype=fp32 (HF keeps them FP32)
    adapter.build_meta_twin(causal_lm)            # structure-only model the plan is compiled on
    adapter.default_replacement_rules(config)     # the plan's default rules
    adapter.never_replace, adapter.glob_hint      # the plan's boundary and zero-hit advice

The planner, the acceptance harness and the CLI start from a config name or path, and ask the
adapter that builds it (:func:`adapter_for_config`) for the model knowledge they need::

    adapter = adapter_for_config("dsv3-16b")      # a spec name of adapter.specs, or a local config.json
    meta = adapter.build_meta_model("dsv3-16b", config_overrides={...})
    adapter.target_groups(meta)                   # design spec §1.1 targets, from the structure
    adapter.activation_terms(meta.config, ...)    # saved-for-backward bytes per decoder layer

Built-in adapters are registered by :mod:`lp_lightning.models` (whose ``__init__`` runs before this
module, so the registry is complete whenever it is imported; DeepSeek-V3:
:data:`lp_lightning.models.deepseek_v3.adapter.DEEPSEEK_V3`). Another model is supported by
registering its adapter with :func:`register_model_adapter` before the strategy sets the model up.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

if TYPE_CHECKING:  # the plan is imported by whoever compiles one, never by a bf16 run (design spec §13.1)
    from lp_lightning.plan import NeverReplaceRule, ReplacementRule

__all__ = [
    "LINEAR_FACTORY",
    "ActivationTerms",
    "ModelAdapter",
    "adapter_for",
    "adapter_for_config",
    "hf_model_type",
    "register_model_adapter",
    "registered_model_adapters",
    "registered_specs",
]

LINEAR_FACTORY = "lp_lightning.modules.linear.replace_low_precision_linear"
"""Format-agnostic replacement factory for exact ``nn.Linear`` targets (a dotted path: ``plan.apply`` imports it)."""


@dataclass(frozen=True)
class ActivationTerms:
    """What autograd saves for backward in one training micro-batch, term by term (docs/planner.md).

    Counted by a model's adapter (:meth:`ModelAdapter.activation_terms`) without recompute; the
    planner adds them up per ``activation_checkpoint`` mode.

    Attributes:
        layers: Per decoder layer, ``{term: bytes}`` saved with ``activation_checkpoint="off"``.
        outside: ``{term: bytes}`` saved outside the decoder layers.
        layer_input: Bytes of one decoder layer's input (what ``"full"`` keeps per layer).
        loss_logits: Peak bytes of the logits-sized tensors around the loss.
    """

    layers: tuple[dict[str, int], ...]
    outside: dict[str, int]
    layer_input: int
    loss_logits: int


class ModelAdapter(Protocol):
    """A model family as the generic layers see it (implemented by a model package, e.g. DeepSeek-V3).

    Attributes:
        name: Registry key, e.g. ``"deepseek_v3"``.
        never_replace: Modules the replacement plan refuses to replace (design spec §1.1), passed
            to :func:`~lp_lightning.plan.compile_plan` as ``never_replace``.
        glob_hint: Advice appended to the plan's zero-hit glob error (``None``: none).
        specs: The named specs it builds (``config_name_or_path`` values), each ``{config field: value}``.
    """

    name: str
    never_replace: tuple[NeverReplaceRule, ...]
    glob_hint: str | None
    specs: Mapping[str, Mapping[str, Any]]

    def matches(self, model: nn.Module) -> bool:
        """Whether this adapter describes ``model`` (the HF model or a wrapper holding it at ``.model``)."""
        ...

    def causal_lm(self, module: nn.Module) -> nn.Module:
        """The HF causal LM in ``module`` (the model itself or a wrapper holding it).

        Raises:
            TypeError: ``module`` holds no such model.
        """
        ...

    def decoder_layers(self, causal_lm: nn.Module) -> nn.ModuleList:
        """The decoder layers: the FSDP2 units and the activation-recompute units (design spec §9)."""
        ...

    def fp32_compute_modules(self, causal_lm: nn.Module) -> tuple[str, ...]:
        """FQNs of the modules the model keeps in FP32 inside a BF16 model (sharded with FP32 compute).

        Called on the plain model before the FP32 upcast; ``()`` when none.
        """
        ...

    def default_replacement_rules(self, config: Any) -> tuple[ReplacementRule, ...]:
        """The replacement rules used when the run gives none, for the model's config (design spec §4.3)."""
        ...

    def build_meta_twin(self, causal_lm: nn.Module) -> nn.Module:
        """A structure-only (meta device) model with ``causal_lm``'s module tree, to compile the plan on."""
        ...

    def builds(self, config_name_or_path: str | os.PathLike[str]) -> bool:
        """Whether :meth:`build_meta_model` takes ``config_name_or_path`` (a key of ``specs`` or a local config)."""
        ...

    def build_meta_model(
        self, config: Any, *, config_overrides: Mapping[str, Any] | None = None, attn_implementation: str = "sdpa"
    ) -> nn.Module:
        """The model of ``config`` (a config object, a spec name or a local config path) on the meta device.

        Structure only, nothing allocated; ``config_overrides`` are config fields set on top.

        Raises:
            ValueError: an unknown name or path, or overrides the config rejects.
        """
        ...

    def target_groups(self, model: nn.Module) -> dict[str, list[str]]:
        """The design spec §1.1 low-precision targets of ``model``, ``{group: [module FQN, ...]}``.

        Found from the model's structure, not from a replacement plan, so that a plan leaving a
        target out is caught by whoever compares the two (the acceptance rows Q3-02/03/04).
        """
        ...

    def activation_terms(
        self,
        config: Any,
        *,
        micro_batch_size: int,
        seq_len: int,
        low_precision_modules: Collection[str],
        format: Any,
        activation_dtype: Any,
    ) -> ActivationTerms:
        """The saved-for-backward bytes of one micro-batch of the model of ``config`` (docs/planner.md).

        Args:
            config: The model's HF config.
            micro_batch_size: Sequences per rank per micro-batch.
            seq_len: Tokens per sequence.
            low_precision_modules: FQNs of the modules the plan made low precision.
            format: Their ``FormatSpec`` (``None`` in bf16).
            activation_dtype: The compute ``torch.dtype`` (FSDP2 ``param_dtype``).
        """
        ...


_ADAPTERS: dict[str, ModelAdapter] = {}
_PROTOCOL_MEMBERS = (
    "name", "never_replace", "glob_hint", "matches", "causal_lm", "decoder_layers", "fp32_compute_modules",
    "default_replacement_rules", "build_meta_twin", "specs", "builds", "build_meta_model", "target_groups",
    "activation_terms",
)
_MISSING = object()


def _lookup_static(obj: object, attr: str) -> object:
    return inspect.getattr_static(obj, attr, _MISSING)


def register_model_adapter(adapter: ModelAdapter) -> ModelAdapter:
    """Adds ``adapter`` to the registry :func:`adapter_for` searches (in registration order).

    Registering the same object twice is a no-op.

    Args:
        adapter: An object with the :class:`ModelAdapter` attributes and methods.

    Returns:
        ``adapter`` (so it can be used as ``X = register_model_adapter(XAdapter())``).

    Raises:
        TypeError: ``adapter`` lacks part of the protocol.
        ValueError: another adapter is registered under the same ``name``.
    """
    # getattr_static: `never_replace` may be a property that imports the plan (not in a bf16 run).
    missing = [attr for attr in _PROTOCOL_MEMBERS if _lookup_static(adapter, attr) is _MISSING]
    if missing:
        raise TypeError(f"{type(adapter).__name__} is not a ModelAdapter; it lacks {missing}.")
    if not isinstance(adapter.name, str) or not adapter.name:
        raise TypeError(f"a model adapter's name must be a non-empty string, got {adapter.name!r}.")
    registered = _ADAPTERS.get(adapter.name)
    if registered is not None and registered is not adapter:
        raise ValueError(
            f"a model adapter named {adapter.name!r} is already registered ({type(registered).__name__}); "
            "give the new adapter another name."
        )
    _ADAPTERS[adapter.name] = adapter
    return adapter


def registered_model_adapters() -> tuple[ModelAdapter, ...]:
    """Every registered adapter, in registration order."""
    return tuple(_ADAPTERS.values())


def registered_specs() -> tuple[str, ...]:
    """The spec names every registered adapter builds (sorted)."""
    return tuple(sorted(name for adapter in _ADAPTERS.values() for name in adapter.specs))


def adapter_for_config(config_name_or_path: str | os.PathLike[str]) -> ModelAdapter:
    """The registered adapter that builds ``config_name_or_path`` (a spec name or a local config path).

    Raises:
        ValueError: no adapter builds it (the message lists the specs), or several do.
    """
    matching = [a for a in _ADAPTERS.values() if a.builds(config_name_or_path)]
    if len(matching) == 1:
        return matching[0]
    if not matching:
        raise ValueError(
            f"config_name_or_path={os.fspath(config_name_or_path)!r} is neither a built-in spec "
            f"{list(registered_specs())} nor a local config.json of a registered model type {sorted(_ADAPTERS)}; "
            "pass a spec name or the path of the model's config.json."
        )
    raise ValueError(
        f"{len(matching)} model adapters build {os.fspath(config_name_or_path)!r}: "
        f"{[a.name for a in matching]}; make their `builds` exclusive."
    )


def hf_model_type(module: nn.Module) -> str | None:
    """``config.model_type`` of a Hugging Face model, or of the one a wrapper holds at ``.model``.

    Returns:
        The model type (``"deepseek_v3"``), or ``None`` when neither has a HF config.
    """
    for candidate in (module, getattr(module, "model", None)):
        model_type = getattr(getattr(candidate, "config", None), "model_type", None)
        if isinstance(model_type, str):
            return model_type
    return None


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The registered adapter that describes ``model`` (the HF model or a wrapper holding it at ``.model``).

    Args:
        model: The model.

    Returns:
        The one adapter whose ``matches(model)`` is true.

    Raises:
        TypeError: no adapter matches (the message names the model type and how to add one).
        ValueError: several adapters match.
    """
    matching: Sequence[ModelAdapter] = [a for a in _ADAPTERS.values() if a.matches(model)]
    if len(matching) == 1:
        return matching[0]
    inner = getattr(model, "model", None)
    described = type(model).__name__
    if getattr(model, "config", None) is None and isinstance(inner, nn.Module):  # a wrapper
        described += f" holding {type(inner).__name__}"
    if not matching:
        raise TypeError(
            f"no model adapter for model type {hf_model_type(model)!r} ({described}); registered adapters: "
            f"{sorted(_ADAPTERS)}. Use a registered type, or register yours with "
            "lp_lightning.models.register_model_adapter(adapter) before strategy setup."
        )
    raise ValueError(
        f"{len(matching)} model adapters match {described} (model type {hf_model_type(model)!r}): "
        f"{[a.name for a in matching]}; make their `matches` exclusive."
    )
