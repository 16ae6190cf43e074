"""Format-agnostic module replacement plan: compile on the meta model, apply atomically (design spec §5, §13.2; R5).

The plan answers "which modules compute in low precision" (design spec §4); *how* they compute is the
:class:`~lp_lightning.policy.LowPrecisionPolicy` handed to each factory. This module imports no
low-precision type: rules name their factories by dotted path (``{"_target_": "pkg.mod.fn"}``,
exactly as the design spec YAML of §4.3) and the factories are imported only when the plan is applied.

Lifecycle (design spec §5, §12.1 steps 2-5)::

    meta model (structure only) --compile_plan(model, rules, policy)--> ModuleReplacementPlan (immutable)
    ... high-precision materialisation and init (same module tree) ...
    plan.apply(model) --> every factory runs and is validated, then all are installed, or none
                      --> ReplacementReport (replaced / skipped with reason / counts per rule)

Matching rules (one mechanism):

- ``match`` / ``exclude`` are :func:`fnmatch.fnmatchcase` globs over fully qualified module names
  (FQNs) from ``model.named_modules(remove_duplicate=False)``. ``*`` crosses dots
  (``model.layers.*.mlp.experts`` would also match ``model.layers.1.x.mlp.experts``), which is why
  the default DeepSeek-V3 rules list every target by its full FQN (design spec §1.1, §4.3).
- A module reachable under several FQNs (aliases) is one target: it is matched if any of its FQNs
  matches, skipped if any matches an ``exclude`` glob, replaced once, and the single replacement
  is installed at every FQN.
- ``module_type`` is an assertion, not a filter: every module a rule selects must be exactly that
  type (``exact_type=True``: ``type(module) is module_type``) or an instance of it
  (``exact_type=False``); anything else (a ``nn.Linear`` subclass, a PEFT/LoRA or custom wrapper)
  is a ``TypeError`` naming the FQN (design spec §15: unsupported modules fail, they are not replaced
  blindly).
- Errors at compile time: a glob of an active rule that matches no FQN (with the nearest FQNs as
  candidates), a rule that selects nothing, two rules on one module, one selected module inside
  another, a selected module that is or contains a never-replaced module (embedding, LM head,
  MoE router, normalization, rotary embedding, core attention; design spec §1.1), the root module.
- ``when: low_precision`` rules are active only when ``policy.enabled``. With ``enabled=False``
  :func:`compile_plan` returns an empty plan without scanning the model or importing anything,
  and :meth:`ModuleReplacementPlan.apply` calls nothing (design spec §4.3, §13.1).

Factory contract (design spec §13.2): ``factory(source, *, fqn, policy) -> nn.Module`` returns a new
module that reuses the source's Parameter and buffer objects (no copy, no re-initialisation) and
keeps submodule, parameter and buffer names, shapes, dtypes, devices, sharing, ``requires_grad``,
``training``, state_dict keys and the forward signature. It may change the module's type and add
plain Python attributes (policy, recipe, quantizers). It must not modify ``source``.
:meth:`ModuleReplacementPlan.apply` checks all of this before installing anything.

Factory resolution is lazy, by decision: :func:`compile_plan` checks only that a factory target is a
well-formed dotted path and never imports it, because importing a factory module imports the
low-precision module types (and possibly a backend), which the structural compile step and an
``enabled=False`` run must not do. ``apply`` imports every factory and checks that it accepts
``(source, *, fqn=..., policy=...)`` before it calls any of them, so an unimportable target still
fails before the model is touched.

No tensor data is read anywhere in this module: compile reads module types and FQNs only (it runs
on a meta model and dispatches no aten op); apply compares Parameter identity and metadata
(shape, dtype, device, requires_grad), never values.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from torch import nn

from lp_lightning.policy import LowPrecisionPolicy

__all__ = [
    "DEEPSEEK_V3_EXPERTS_FACTORY",
    "DEEPSEEK_V3_EXPERTS_TYPE",
    "LINEAR_FACTORY",
    "NEVER_REPLACED_GLOBS",
    "ModuleReplacementPlan",
    "PlannedReplacement",
    "ReplacedModule",
    "ReplacementCondition",
    "ReplacementReport",
    "ReplacementRule",
    "SkippedModule",
    "compile_plan",
    "deepseek_v3_default_rules",
    "load_rules",
    "rules_from_config",
]

ReplacementFactory = Callable[..., nn.Module]
"""``factory(source: nn.Module, *, fqn: str, policy: LowPrecisionPolicy) -> nn.Module`` (design spec §13.2)."""

LINEAR_FACTORY = "lp_lightning.modules.linear.replace_low_precision_linear"
"""Format-agnostic factory for exact ``nn.Linear`` targets (dense MLP, shared experts, MLA projections)."""

DEEPSEEK_V3_EXPERTS_FACTORY = (
    "lp_lightning.models.deepseek_v3.experts.replace_deepseek_v3_low_precision_experts"
)
"""Format-agnostic factory that replaces HF ``DeepseekV3Experts`` whole (design spec §5.2)."""

DEEPSEEK_V3_EXPERTS_TYPE = "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Experts"
"""Dotted path of HF's routed-experts container (stacked ``gate_up_proj [E, 2F, H]``, ``down_proj [E, H, F]``)."""

NEVER_REPLACED_GLOBS: tuple[tuple[str, str], ...] = (
    ("lm_head", "LM head"),
    ("*.lm_head", "LM head"),
    ("*embed_tokens", "embedding"),
    ("*.mlp.gate", "MoE router"),
    ("*norm", "normalization"),
    ("*rotary_emb", "rotary embedding"),
    ("*.self_attn", "core attention (QK, softmax, PV)"),
)
"""FQN globs (with the reason) of modules that stay high precision whatever the rules say (design spec §1.1).

A rule that selects such a module, or a module containing one, fails at compile time. Module types
are checked too (see ``_denied_type_reason``), so a renamed norm or router is caught as well.
"""

_BOUNDARY_HINT = (
    "design spec §1.1 keeps embedding, LM head, MoE router, normalization, rotary embedding and core "
    "attention in high precision"
)
_DOTTED_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")
_MAX_CANDIDATES = 5
_NORM_TYPES = (
    nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
)
_NORM_NAME = re.compile(r"Norm(\dd)?$")  # DeepseekV3RMSNorm, LlamaRMSNorm, FusedLayerNorm, BatchNorm2d


class ReplacementCondition(str, Enum):
    """When a rule is active (the ``when`` key of a rule, design spec §4.3)."""

    LOW_PRECISION = "low_precision"
    """Active only when the policy is enabled; with ``enabled=False`` the rule does nothing."""


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _callable_name(obj: Callable[..., Any]) -> str:
    module = getattr(obj, "__module__", None) or "?"
    qualname = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}.{qualname}"


def _as_glob_tuple(value: object, *, rule: str, key: str, allow_empty: bool) -> tuple[str, ...]:
    globs = (value,) if isinstance(value, str) else value
    if not isinstance(globs, Iterable) or isinstance(globs, Mapping):
        raise TypeError(
            f"rule {rule!r}: `{key}` must be a glob string or a list of them, got {type(value).__name__}."
        )
    globs = tuple(globs)
    if not globs and not allow_empty:
        raise ValueError(f"rule {rule!r}: `{key}` is empty; give at least one FQN or glob.")
    for glob in globs:
        if not isinstance(glob, str) or not glob or glob != glob.strip():
            raise ValueError(
                f"rule {rule!r}: every `{key}` entry must be a non-empty FQN glob without surrounding "
                f"whitespace, got {glob!r}."
            )
    if len(set(globs)) != len(globs):
        dupes = sorted({g for g in globs if globs.count(g) > 1})
        raise ValueError(f"rule {rule!r}: `{key}` lists {dupes} more than once.")
    return globs


def _check_dotted(path: object, *, rule: str, key: str) -> str:
    if not isinstance(path, str) or not _DOTTED_PATH.match(path):
        raise ValueError(
            f"rule {rule!r}: `{key}` must be a dotted import path such as "
            f"'torch.nn.Linear' or 'package.module.function', got {path!r}."
        )
    return path


@dataclass(frozen=True, kw_only=True)
class ReplacementRule:
    """One ``plan_overrides`` entry: which modules (FQN globs) a factory replaces (design spec §4.3).

    Args:
        name: Rule name used in errors, counts and the report (e.g. ``"mla_projections"``).
        match: FQN glob(s) (:func:`fnmatch.fnmatchcase`; ``*`` crosses dots). Each glob of an
            active rule must match at least one FQN.
        module_type: The type every selected module must have: a class or its dotted import path
            (``"torch.nn.Linear"``), resolved at compile time with :mod:`importlib`.
        replace_module: The factory ``factory(source, *, fqn, policy) -> nn.Module``: a dotted
            path, the design spec's ``{"_target_": "dotted.path"}`` mapping, or a callable. Paths are
            imported only by :meth:`ModuleReplacementPlan.apply`.
        exclude: FQN glob(s) whose modules this rule skips (reported with the glob as reason).
        exact_type: ``True``: ``type(module) is module_type`` (subclasses and wrappers fail);
            ``False``: ``isinstance(module, module_type)``.
        when: Activation condition; only ``"low_precision"`` (active iff the policy is enabled).

    Raises:
        TypeError: a field has the wrong type.
        ValueError: an empty/duplicated glob list, a malformed dotted path, a ``replace_module``
            mapping with keys other than ``_target_``, or an unknown ``when``.
    """

    name: str
    match: tuple[str, ...]
    module_type: str | type
    replace_module: str | ReplacementFactory
    exclude: tuple[str, ...] = ()
    exact_type: bool = True
    when: ReplacementCondition = ReplacementCondition.LOW_PRECISION

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"ReplacementRule.name must be a non-empty string, got {self.name!r}.")
        rule = self.name
        object.__setattr__(self, "match", _as_glob_tuple(self.match, rule=rule, key="match", allow_empty=False))
        object.__setattr__(
            self, "exclude", _as_glob_tuple(self.exclude, rule=rule, key="exclude", allow_empty=True)
        )
        if isinstance(self.module_type, str):
            _check_dotted(self.module_type, rule=rule, key="module_type")
        elif not isinstance(self.module_type, type):
            raise TypeError(
                f"rule {rule!r}: `module_type` must be a class or a dotted path, got {self.module_type!r}."
            )
        factory = self.replace_module
        if isinstance(factory, Mapping):
            if set(factory) != {"_target_"}:
                raise ValueError(
                    f"rule {rule!r}: `replace_module` must be {{'_target_': 'dotted.path'}} only, got keys "
                    f"{sorted(factory)}; a factory takes no extra arguments, it is called as "
                    "factory(source, *, fqn=..., policy=...) (design spec §13.2)."
                )
            factory = factory["_target_"]
        if isinstance(factory, str):
            factory = _check_dotted(factory, rule=rule, key="replace_module._target_")
        elif not callable(factory):
            raise TypeError(
                f"rule {rule!r}: `replace_module` must be a dotted path, {{'_target_': path}} or a "
                f"callable, got {type(factory).__name__}."
            )
        object.__setattr__(self, "replace_module", factory)
        if not isinstance(self.exact_type, bool):
            raise TypeError(f"rule {rule!r}: `exact_type` must be a bool, got {self.exact_type!r}.")
        try:
            object.__setattr__(self, "when", ReplacementCondition(self.when))
        except ValueError:
            raise ValueError(
                f"rule {rule!r}: `when` must be one of {[c.value for c in ReplacementCondition]}, "
                f"got {self.when!r}."
            ) from None

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any], *, default_name: str) -> ReplacementRule:
        """Build a rule from one ``plan_overrides`` YAML entry (design spec §4.3 layout).

        Args:
            spec: Mapping with keys ``match``, ``module_type``, ``replace_module`` and optionally
                ``name``, ``exclude``, ``exact_type`` (default true), ``when`` (default
                ``low_precision``).
            default_name: Name used when ``spec`` has no ``name`` (e.g. ``"plan_overrides[2]"``).

        Returns:
            The validated rule.

        Raises:
            TypeError: ``spec`` is not a mapping.
            ValueError: a required key is missing, an unknown key is present, or a value is invalid.
        """
        if not isinstance(spec, Mapping):
            raise TypeError(f"{default_name}: a rule must be a mapping, got {type(spec).__name__}.")
        known = {"name", "match", "exclude", "when", "module_type", "exact_type", "replace_module"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(
                f"{default_name}: unknown rule key(s) {unknown}; known keys are {sorted(known)}. "
                "Rules carry no format/scaling: that is the low_precision section (design spec §4.3)."
            )
        missing = [key for key in ("match", "module_type", "replace_module") if key not in spec]
        if missing:
            raise ValueError(f"{default_name}: rule is missing required key(s) {missing}.")
        return cls(**{"name": default_name, **spec})

    @property
    def factory_name(self) -> str:
        """The factory as a dotted path (for callables: ``module.qualname``)."""
        if isinstance(self.replace_module, str):
            return self.replace_module
        return _callable_name(self.replace_module)

    @property
    def module_type_name(self) -> str:
        """``module_type`` as a dotted path."""
        if isinstance(self.module_type, str):
            return self.module_type
        return _type_name(self.module_type)

    def as_dict(self) -> dict[str, Any]:
        """JSON/YAML-ready form in the design spec §4.3 layout (callables become their dotted names)."""
        return {
            "name": self.name,
            "match": list(self.match),
            "exclude": list(self.exclude),
            "when": self.when.value,
            "module_type": self.module_type_name,
            "exact_type": self.exact_type,
            "replace_module": {"_target_": self.factory_name},
        }


def rules_from_config(specs: Sequence[Mapping[str, Any]] | Mapping[str, Any]) -> tuple[ReplacementRule, ...]:
    """Build rules from a ``plan_overrides`` list (or a mapping holding one under that key).

    Args:
        specs: The list of rule mappings (design spec §4.3), or ``{"plan_overrides": [...]}``. A rule
            without ``name`` is named ``plan_overrides[i]``.

    Returns:
        The rules, in order.

    Raises:
        TypeError: ``specs`` is neither a list nor a mapping with ``plan_overrides``.
        ValueError: an invalid rule, or two rules with the same name.
    """
    if isinstance(specs, Mapping):
        if set(specs) != {"plan_overrides"}:
            raise ValueError(
                f"expected a mapping with the single key 'plan_overrides', got keys {sorted(specs)}."
            )
        specs = specs["plan_overrides"]
    if isinstance(specs, (str, bytes)) or not isinstance(specs, Sequence):
        raise TypeError(f"plan_overrides must be a list of rule mappings, got {type(specs).__name__}.")
    rules = tuple(
        ReplacementRule.from_dict(spec, default_name=f"plan_overrides[{index}]")
        for index, spec in enumerate(specs)
    )
    _check_unique_names(rules)
    return rules


def load_rules(path: str | Path) -> tuple[ReplacementRule, ...]:
    """Read rules from a YAML file holding a ``plan_overrides:`` list (e.g. ``configs/plan_deepseek_v3.yaml``).

    Args:
        path: YAML file path.

    Returns:
        The rules, in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError, TypeError: see :func:`rules_from_config`.
    """
    import yaml  # local: only this loader needs PyYAML

    with open(path, encoding="utf-8") as handle:
        data = yaml.safe_load(handle)
    try:
        return rules_from_config(data)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{path}: {exc}") from None


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
    targets. The glob form of the same plan is ``configs/plan_deepseek_v3.yaml``.

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


# --------------------------------------------------------------------------------------------
# Plan and report data
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedReplacement:
    """One module the plan will replace.

    Attributes:
        fqns: Every FQN the module is reachable under, in ``named_modules`` order; ``fqns[0]`` is
            the primary FQN passed to the factory, the rest are aliases that receive the same
            replacement.
        rule: The rule that selected it.
        source_type: ``type(module)`` at compile time (re-checked at apply time).
        matched_globs: The rule's ``match`` globs that hit one of ``fqns``.
    """

    fqns: tuple[str, ...]
    rule: ReplacementRule
    source_type: type
    matched_globs: tuple[str, ...]

    @property
    def fqn(self) -> str:
        """Primary FQN (first in ``named_modules`` order)."""
        return self.fqns[0]

    @property
    def aliases(self) -> tuple[str, ...]:
        """Other FQNs of the same module object."""
        return self.fqns[1:]


@dataclass(frozen=True)
class SkippedModule:
    """A module a rule's ``match`` glob hit but the plan leaves alone, with the reason."""

    fqn: str
    rule: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"fqn": self.fqn, "rule": self.rule, "reason": self.reason}


@dataclass(frozen=True)
class ReplacedModule:
    """One replacement as reported: FQN (+ aliases), rule, and module type before/after.

    ``to_type`` is ``None`` in a preview (:meth:`ModuleReplacementPlan.preview`), before any
    factory has run.
    """

    fqn: str
    aliases: tuple[str, ...]
    rule: str
    from_type: str
    to_type: str | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "fqn": self.fqn,
            "aliases": list(self.aliases),
            "rule": self.rule,
            "from_type": self.from_type,
            "to_type": self.to_type,
        }


@dataclass(frozen=True)
class ReplacementReport:
    """What the plan replaced and skipped, for the run log and ``run_summary.json`` (design spec §5).

    Attributes:
        policy: The policy the factories received.
        applied: ``True`` when returned by :meth:`ModuleReplacementPlan.apply`, ``False`` for a
            :meth:`ModuleReplacementPlan.preview`.
        rule_names: Every rule of the plan, in order (counts are reported for each, zeros included).
        replaced: One entry per replaced module object (aliases folded in), in ``named_modules`` order.
        skipped: Modules a ``match`` glob hit that were left alone, with the reason.
        inactive_rules: ``(rule name, reason)`` for rules that did not run (e.g. low precision off).
    """

    policy: LowPrecisionPolicy
    applied: bool
    rule_names: tuple[str, ...]
    replaced: tuple[ReplacedModule, ...]
    skipped: tuple[SkippedModule, ...]
    inactive_rules: tuple[tuple[str, str], ...]

    @property
    def counts(self) -> dict[str, int]:
        """Replaced module objects per rule name (aliases count once), every rule listed."""
        counts = dict.fromkeys(self.rule_names, 0)
        for item in self.replaced:
            counts[item.rule] += 1
        return counts

    @property
    def num_replaced(self) -> int:
        return len(self.replaced)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``json.dumps`` works on it) for ``run_summary.json``."""
        return {
            "policy": self.policy.as_dict(),
            "applied": self.applied,
            "counts": self.counts,
            "num_replaced": self.num_replaced,
            "num_skipped": len(self.skipped),
            "replaced": [item.as_dict() for item in self.replaced],
            "skipped": [item.as_dict() for item in self.skipped],
            "inactive_rules": [{"rule": name, "reason": reason} for name, reason in self.inactive_rules],
        }

    def to_json(self, **kwargs: Any) -> str:
        """``json.dumps(self.as_dict(), **kwargs)``."""
        return json.dumps(self.as_dict(), **kwargs)

    def format(self, *, verbose: bool = False) -> str:
        """Log-friendly multi-line text: a headline, one line per rule, skipped modules.

        Args:
            verbose: Also list every replaced FQN (with aliases).

        Returns:
            The text, without a trailing newline.
        """
        verb = "replaced" if self.applied else "to replace"
        lines = [
            f"module replacement ({self.policy.describe()}): {self.num_replaced} module(s) {verb}, "
            f"{len(self.skipped)} skipped"
        ]
        inactive = dict(self.inactive_rules)
        by_rule: dict[str, list[ReplacedModule]] = {name: [] for name in self.rule_names}
        for item in self.replaced:
            by_rule[item.rule].append(item)
        for name, items in by_rule.items():
            if name in inactive:
                lines.append(f"  {name}: inactive ({inactive[name]})")
                continue
            transitions = sorted({f"{i.from_type} -> {i.to_type or '?'}" for i in items})
            lines.append(f"  {name}: {len(items)} {verb} ({'; '.join(transitions)})")
            if verbose:
                for item in items:
                    alias = f" (aliases: {', '.join(item.aliases)})" if item.aliases else ""
                    lines.append(f"    {item.fqn}{alias}")
        for item in self.skipped:
            lines.append(f"  skipped {item.fqn} [{item.rule}]: {item.reason}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Compile
# --------------------------------------------------------------------------------------------


def _check_unique_names(rules: Sequence[ReplacementRule]) -> None:
    names = [rule.name for rule in rules]
    dupes = sorted({name for name in names if names.count(name) > 1})
    if dupes:
        raise ValueError(f"replacement rule names must be unique; {dupes} appear more than once.")


@dataclass
class _AliasGroup:
    module: nn.Module
    fqns: list[str] = field(default_factory=list)


def _alias_groups(model: nn.Module) -> tuple[dict[int, _AliasGroup], dict[str, _AliasGroup]]:
    """Group ``named_modules(remove_duplicate=False)`` by module identity (structure only)."""
    by_id: dict[int, _AliasGroup] = {}
    by_fqn: dict[str, _AliasGroup] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        group = by_id.setdefault(id(module), _AliasGroup(module))
        group.fqns.append(fqn)
        by_fqn[fqn] = group
    return by_id, by_fqn


def _import_object(path: str, *, rule: str, key: str) -> Any:
    """Import ``pkg.mod.attr[.attr]`` with importlib, trying the longest importable module prefix.

    Raises:
        ValueError: no prefix is an importable module, or an attribute is missing.
        ImportError: the module exists but importing it failed (its own import error is chained).
    """
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # Only "this prefix is not a module" moves on to a shorter prefix; a missing
            # dependency *inside* an existing module is a real error.
            if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
                continue
            raise ImportError(
                f"rule {rule!r}: importing {module_name!r} for `{key}`={path!r} failed: {exc}"
            ) from exc
        for depth, attr in enumerate(parts[split:], start=split):
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                raise ValueError(
                    f"rule {rule!r}: `{key}`={path!r}: {'.'.join(parts[:depth])!r} has no attribute or "
                    f"submodule {attr!r}; check the dotted path."
                ) from None
        return obj
    raise ValueError(f"rule {rule!r}: `{key}`={path!r}: no importable module in this path.")


def _resolve_module_type(rule: ReplacementRule) -> type:
    if isinstance(rule.module_type, type):
        return rule.module_type
    cls = _import_object(rule.module_type, rule=rule.name, key="module_type")
    if not isinstance(cls, type):
        raise TypeError(f"rule {rule.name!r}: `module_type`={rule.module_type!r} is not a class ({cls!r}).")
    return cls


def _denied_type_reason(module: nn.Module) -> str | None:
    """Why a module type is never replaced (design spec §1.1), or ``None``."""
    if isinstance(module, nn.Embedding):
        return "embedding"
    name = type(module).__name__
    if isinstance(module, _NORM_TYPES) or _NORM_NAME.search(name):
        return "normalization"
    if name.endswith("RotaryEmbedding"):
        return "rotary embedding"
    if name.endswith("Router"):
        return "MoE router"
    if name.endswith("Attention"):
        return "core attention (QK, softmax, PV)"
    return None


def _denied_fqn_reason(fqn: str) -> str | None:
    for glob, reason in NEVER_REPLACED_GLOBS:
        if fnmatchcase(fqn, glob):
            return reason
    return None


def _check_boundary(group: _AliasGroup, rule: ReplacementRule) -> None:
    """Fail if the selected module is, or contains, a never-replaced module (design spec §1.1)."""
    primary = group.fqns[0]
    for sub_name, sub in group.module.named_modules(remove_duplicate=False):
        if sub_name:
            fqns = [f"{fqn}.{sub_name}" for fqn in group.fqns]
        else:
            fqns = list(group.fqns)
        for fqn in fqns:
            reason = _denied_fqn_reason(fqn) or _denied_type_reason(sub)
            if reason is not None:
                where = "is" if not sub_name else f"contains {fqn!r}, which is"
                raise ValueError(
                    f"rule {rule.name!r} selects {primary!r}, which {where} a {reason} module "
                    f"({_type_name(type(sub))}); {_BOUNDARY_HINT}. Narrow the rule's `match` globs "
                    "or add an `exclude` glob."
                )


def _check_type(group: _AliasGroup, rule: ReplacementRule, required: type) -> None:
    module = group.module
    ok = type(module) is required if rule.exact_type else isinstance(module, required)
    if ok:
        return
    fqn = group.fqns[0]
    relation = f"exactly {_type_name(required)} (exact_type=true)" if rule.exact_type else (
        f"an instance of {_type_name(required)} (exact_type=false)"
    )
    wrapped = [
        f"{fqn}.{name}" for name, sub in module.named_modules() if name and type(sub) is required
    ]
    detail = ""
    if isinstance(module, required):
        detail = " It is a subclass of the required type."
    elif wrapped:
        detail = f" It wraps {_type_name(required)} at {wrapped[:3]} (a PEFT/LoRA or custom wrapper)."
    raise TypeError(
        f"rule {rule.name!r}: module {fqn!r} is {_type_name(type(module))}, but the rule requires "
        f"{relation}.{detail} Subclassed and wrapped modules are not replaced (design spec §15); fix the "
        "rule's `match` globs, add an `exclude` glob, or remove the wrapper."
    )


def _zero_hit_error(rule: ReplacementRule, globs: list[str], fqns: Sequence[str]) -> ValueError:
    lines = [
        f"rule {rule.name!r} ({rule.module_type_name} -> {rule.factory_name}) is enabled but "
        f"{len(globs)} of its `match` globs match no module FQN (design spec §4.3: zero hits are an error):"
    ]
    for glob in globs[:10]:
        nearest = difflib.get_close_matches(glob, fqns, n=_MAX_CANDIDATES, cutoff=0.0)
        lines.append(f"  {glob!r}; nearest FQNs: {nearest}")
    if len(globs) > 10:
        lines.append(f"  ... and {len(globs) - 10} more: {globs[10:]}")
    lines.append(
        "Print the candidates with `for fqn, m in model.named_modules(): print(fqn, type(m).__name__)` "
        "on the meta model and fix the globs (for DeepSeek-V3, q_lora_rank set means q_a_proj/q_b_proj "
        "instead of q_proj)."
    )
    return ValueError("\n".join(lines))


def compile_plan(
    model: nn.Module, rules: Iterable[ReplacementRule], policy: LowPrecisionPolicy
) -> ModuleReplacementPlan:
    """Compile rules against a model's module structure into an immutable plan (design spec §5).

    Reads only ``named_modules(remove_duplicate=False)`` and module types: no tensor data, no
    kernel, no collective; meant for the meta model (design spec §12.1 step 3). Factories are not
    imported (see the module docstring).

    Args:
        model: The model, typically on the meta device.
        rules: The replacement rules (e.g. :func:`deepseek_v3_default_rules`, :func:`load_rules`).
        policy: The low-precision policy; with ``policy.enabled`` false the plan is empty and the
            model is not even scanned.

    Returns:
        The plan; apply it with :meth:`ModuleReplacementPlan.apply` after high-precision init.

    Raises:
        TypeError: wrong argument types; a selected module whose type is not the rule's
            ``module_type`` (subclass / wrapper where exact type is required), naming the FQN,
            the actual and the required type.
        ValueError: a glob with zero hits (with up to 5 nearest FQNs), a rule selecting nothing
            after ``exclude``, a module selected by two rules, nested selections, a selected
            module that is or contains a never-replaced module, the root module selected,
            duplicate rule names, an unresolvable ``module_type``.
        ImportError: importing a ``module_type`` module failed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_plan: model must be a torch.nn.Module, got {type(model).__name__}.")
    if not isinstance(policy, LowPrecisionPolicy):
        raise TypeError(
            f"compile_plan: policy must be a LowPrecisionPolicy (LowPrecisionConfig.to_policy()), "
            f"got {type(policy).__name__}."
        )
    rules = tuple(rules)
    for rule in rules:
        if not isinstance(rule, ReplacementRule):
            raise TypeError(
                f"compile_plan: rules must be ReplacementRule objects (see rules_from_config), got "
                f"{type(rule).__name__}."
            )
    _check_unique_names(rules)

    if not policy.enabled:
        reason = "low_precision.enabled is false"
        return ModuleReplacementPlan(
            policy=policy, rules=rules, entries=(), skipped=(),
            inactive_rules=tuple((rule.name, reason) for rule in rules),
        )

    by_id, by_fqn = _alias_groups(model)
    all_fqns = list(by_fqn)
    order = {id(group.module): index for index, group in enumerate(by_id.values())}
    selected: dict[int, PlannedReplacement] = {}
    skipped: list[SkippedModule] = []
    for rule in rules:
        required = _resolve_module_type(rule)
        hits: dict[int, list[str]] = {}
        zero_hit: list[str] = []
        for glob in rule.match:
            if any(ch in glob for ch in "*?["):
                glob_hits = [fqn for fqn in all_fqns if fnmatchcase(fqn, glob)]
            else:
                glob_hits = [glob] if glob in by_fqn else []
            if not glob_hits:
                zero_hit.append(glob)
            for fqn in glob_hits:
                globs = hits.setdefault(id(by_fqn[fqn].module), [])
                if glob not in globs:
                    globs.append(glob)
        if zero_hit:
            raise _zero_hit_error(rule, zero_hit, all_fqns)

        num_selected = 0
        for module_id in sorted(hits, key=order.__getitem__):
            group = by_id[module_id]
            if "" in group.fqns:
                raise ValueError(
                    f"rule {rule.name!r} selects the root module (globs {hits[module_id]}); the plan "
                    "replaces submodules only."
                )
            excluded_by = next(
                (glob for glob in rule.exclude for fqn in group.fqns if fnmatchcase(fqn, glob)), None
            )
            if excluded_by is not None:
                skipped.append(SkippedModule(group.fqns[0], rule.name, f"excluded by {excluded_by!r}"))
                continue
            _check_boundary(group, rule)
            _check_type(group, rule, required)
            previous = selected.get(module_id)
            if previous is not None:
                raise ValueError(
                    f"module {group.fqns[0]!r} (FQNs {group.fqns}) is selected by two rules: "
                    f"{previous.rule.name!r} ({previous.rule.factory_name}, via {list(previous.matched_globs)}) "
                    f"and {rule.name!r} ({rule.factory_name}, via {hits[module_id]}); one module takes one "
                    "factory (design spec §4.3). Narrow one rule's globs or add an `exclude` glob."
                )
            selected[module_id] = PlannedReplacement(
                fqns=tuple(group.fqns),
                rule=rule,
                source_type=type(group.module),
                matched_globs=tuple(hits[module_id]),
            )
            num_selected += 1
        if num_selected == 0:
            raise ValueError(
                f"rule {rule.name!r} is enabled but selects no module: every module its globs match is "
                f"excluded by {list(rule.exclude)} (design spec §4.3: zero hits are an error). Remove the rule "
                "or narrow `exclude`."
            )

    for module_id, entry in selected.items():
        for sub_name, sub in by_id[module_id].module.named_modules(remove_duplicate=False):
            inner = selected.get(id(sub)) if sub_name else None
            if inner is not None:
                raise ValueError(
                    f"module {inner.fqn!r} (rule {inner.rule.name!r}) lies inside {entry.fqn!r} (rule "
                    f"{entry.rule.name!r}), which is replaced whole; nested replacements are ambiguous. "
                    "Drop one of the two selections."
                )

    entries = tuple(sorted(selected.values(), key=lambda e: order[id(by_fqn[e.fqn].module)]))
    return ModuleReplacementPlan(
        policy=policy, rules=rules, entries=entries, skipped=tuple(skipped), inactive_rules=()
    )


# --------------------------------------------------------------------------------------------
# Apply
# --------------------------------------------------------------------------------------------


def _signature_key(module: nn.Module) -> tuple[tuple[str, str, str], ...] | str:
    """``forward`` parameters as (name, kind, repr(default)); annotations are ignored."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError) as exc:  # builtins without a signature
        return f"<no signature: {exc}>"
    return tuple(
        (param.name, param.kind.name, repr(param.default)) for param in signature.parameters.values()
    )


@dataclass(frozen=True)
class _TensorMeta:
    obj: Any
    shape: tuple[int, ...]
    dtype: Any
    device: Any
    requires_grad: bool


def _tensor_meta(tensor: Any) -> _TensorMeta:
    return _TensorMeta(tensor, tuple(tensor.shape), tensor.dtype, tensor.device, bool(tensor.requires_grad))


@dataclass(frozen=True)
class _ModuleSchema:
    """Everything the factory contract preserves, captured from metadata only (no tensor values)."""

    module_names: tuple[str, ...]
    params: tuple[tuple[str, _TensorMeta], ...]
    buffers: tuple[tuple[str, _TensorMeta | None], ...]
    state_dict_keys: tuple[str, ...]
    training: tuple[tuple[str, bool], ...]

    @classmethod
    def capture(cls, module: nn.Module) -> _ModuleSchema:
        return cls(
            module_names=tuple(name for name, _ in module.named_modules(remove_duplicate=False)),
            params=tuple(
                (name, _tensor_meta(p)) for name, p in module.named_parameters(remove_duplicate=False)
            ),
            buffers=tuple(
                (name, None if b is None else _tensor_meta(b))
                for name, b in module.named_buffers(remove_duplicate=False)
            ),
            state_dict_keys=tuple(module.state_dict(keep_vars=True).keys()),
            training=tuple((name, m.training) for name, m in module.named_modules(remove_duplicate=False)),
        )

    def differences(self, other: _ModuleSchema) -> list[str]:
        """Human-readable differences of ``other`` w.r.t. ``self`` (empty when the contract holds)."""
        problems: list[str] = []
        if self.module_names != other.module_names:
            problems.append(
                f"submodule names changed: {list(self.module_names)} -> {list(other.module_names)}"
            )
        pairs = (("parameter", self.params, other.params), ("buffer", self.buffers, other.buffers))
        for kind, mine, theirs in pairs:
            names_mine = [n for n, _ in mine]
            names_theirs = [n for n, _ in theirs]
            if names_mine != names_theirs:
                problems.append(f"{kind} names changed: {names_mine} -> {names_theirs}")
                continue
            for (name, a), (_, b) in zip(mine, theirs):
                if a is None or b is None:
                    if (a is None) != (b is None):
                        problems.append(f"{kind} {name!r} changed between None and a tensor")
                    continue
                if a.obj is not b.obj:
                    problems.append(
                        f"{kind} {name!r} is a different object (the factory must reuse the source "
                        f"{kind}, no copy or re-initialisation: design spec §5.1)"
                    )
                for attr in ("shape", "dtype", "device", "requires_grad"):
                    if getattr(a, attr) != getattr(b, attr):
                        problems.append(
                            f"{kind} {name!r} {attr} changed: {getattr(a, attr)} -> {getattr(b, attr)}"
                        )
        if self.state_dict_keys != other.state_dict_keys:
            problems.append(
                f"state_dict keys changed: {list(self.state_dict_keys)} -> {list(other.state_dict_keys)}"
            )
        if self.training != other.training:
            changed = [
                f"{name or '<self>'}: {a} -> {b}"
                for (name, a), (_, b) in zip(self.training, other.training)
                if a != b
            ]
            problems.append(f"`training` flags changed: {changed or 'module list differs'}")
        return problems


def _parent_and_name(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    parent_fqn, _, name = fqn.rpartition(".")
    return (model.get_submodule(parent_fqn) if parent_fqn else model), name


def _check_factory_signature(factory: Callable[..., Any], rule: ReplacementRule) -> None:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # no introspectable signature (e.g. a C callable); the call itself will tell
    try:
        signature.bind(object(), fqn="", policy=None)
    except TypeError as exc:
        raise TypeError(
            f"rule {rule.name!r}: factory {rule.factory_name} must accept (source, *, fqn, policy) "
            f"(design spec §13.2); its signature is {signature}: {exc}."
        ) from None


def _add_context(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(note)


@dataclass(frozen=True)
class ModuleReplacementPlan:
    """An immutable replacement plan: which module objects get which factory (design spec §5, §13.2).

    Built by :func:`compile_plan`; it stores FQNs and types, not module references, so it can be
    applied to the materialised model (same structure) after high-precision init.

    Attributes:
        policy: Passed to every factory.
        rules: The rules it was compiled from.
        entries: Modules to replace, in ``named_modules`` order.
        skipped: Modules a glob hit but an ``exclude`` glob removed.
        inactive_rules: ``(rule name, reason)`` for rules that were not evaluated.
    """

    policy: LowPrecisionPolicy
    rules: tuple[ReplacementRule, ...]
    entries: tuple[PlannedReplacement, ...]
    skipped: tuple[SkippedModule, ...]
    inactive_rules: tuple[tuple[str, str], ...]

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def counts(self) -> dict[str, int]:
        """Planned replacements per rule name (every rule listed)."""
        return self.preview().counts

    def preview(self) -> ReplacementReport:
        """The report :meth:`apply` would return, without running anything (``to_type`` unknown)."""
        return self._report(applied=False, to_types=[None] * len(self.entries))

    def _report(self, *, applied: bool, to_types: Sequence[str | None]) -> ReplacementReport:
        return ReplacementReport(
            policy=self.policy,
            applied=applied,
            rule_names=tuple(rule.name for rule in self.rules),
            replaced=tuple(
                ReplacedModule(
                    fqn=entry.fqn,
                    aliases=entry.aliases,
                    rule=entry.rule.name,
                    from_type=_type_name(entry.source_type),
                    to_type=to_type,
                )
                for entry, to_type in zip(self.entries, to_types)
            ),
            skipped=self.skipped,
            inactive_rules=self.inactive_rules,
        )

    def _resolve_sources(self, model: nn.Module) -> list[nn.Module]:
        """Find each entry's module in ``model`` and check the structure is the compiled one."""
        by_id, by_fqn = _alias_groups(model)
        sources: list[nn.Module] = []
        for entry in self.entries:
            group = by_fqn.get(entry.fqn)
            if group is None:
                raise ValueError(
                    f"plan.apply: module {entry.fqn!r} (rule {entry.rule.name!r}) does not exist in this "
                    "model; the plan was compiled for a different module tree. Compile the plan on the "
                    "meta model of the same config."
                )
            if type(group.module) is not entry.source_type:
                raise TypeError(
                    f"plan.apply: module {entry.fqn!r} is {_type_name(type(group.module))} but was "
                    f"{_type_name(entry.source_type)} at compile time (rule {entry.rule.name!r}); was the "
                    "model converted twice or modified after compile_plan?"
                )
            if tuple(group.fqns) != entry.fqns:
                raise ValueError(
                    f"plan.apply: module {entry.fqn!r} is reachable under {group.fqns} but under "
                    f"{list(entry.fqns)} at compile time; the aliasing changed after compile_plan."
                )
            sources.append(group.module)
        return sources

    def apply(self, model: nn.Module) -> ReplacementReport:
        """Run every factory, validate every result, then install all of them — or none.

        Order (design spec §5): (1) check the model has the compiled structure; (2) import each rule's
        factory and check its signature; (3) call each factory once per module object as
        ``factory(source, *, fqn=primary_fqn, policy=self.policy)`` and check the result against the
        factory contract (module docstring); (4) ``setattr`` the replacement on the parent at every
        FQN (aliases included); (5) check the whole model's module FQNs, parameter/buffer names and
        objects, state_dict keys, ``requires_grad`` and ``training`` flags are unchanged.
        If anything fails in (1)-(5) the model is left as it was (installed modules are put back,
        and ``requires_grad``/``training`` flags are restored) and the error propagates.

        Args:
            model: The model the plan was compiled for, after high-precision init (design spec §12.1
                step 5; any device, meta included).

        Returns:
            The report. An empty plan (low precision off) returns at once and calls nothing.

        Raises:
            TypeError: ``model`` is not a module; a factory has the wrong signature or returned
                something that is not an ``nn.Module``; the model's types differ from compile time.
            ValueError: the model's structure differs from compile time; a replacement breaks
                the factory contract (message names FQN, rule, factory and each difference).
            ImportError: a factory module cannot be imported.
            Exception: whatever a factory raises (with the FQN and rule added as a note).
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"plan.apply: model must be a torch.nn.Module, got {type(model).__name__}.")
        if not self.entries:
            return self._report(applied=True, to_types=[])

        sources = self._resolve_sources(model)
        factories: dict[str, Callable[..., Any]] = {}
        for entry in self.entries:
            rule = entry.rule
            if rule.name in factories:
                continue
            factory = rule.replace_module
            if isinstance(factory, str):
                factory = _import_object(factory, rule=rule.name, key="replace_module._target_")
                if not callable(factory):
                    raise TypeError(f"rule {rule.name!r}: factory {rule.factory_name} is not callable.")
            _check_factory_signature(factory, rule)
            factories[rule.name] = factory

        model_before = _ModuleSchema.capture(model)
        source_schemas = [_ModuleSchema.capture(source) for source in sources]
        source_signatures = [_signature_key(source) for source in sources]
        replacements: list[nn.Module] = []
        installed: list[tuple[nn.Module, str, nn.Module]] = []
        try:
            for entry, source, schema, signature in zip(
                self.entries, sources, source_schemas, source_signatures
            ):
                where = f"rule {entry.rule.name!r}, factory {entry.rule.factory_name}, module {entry.fqn!r}"
                try:
                    new = factories[entry.rule.name](source, fqn=entry.fqn, policy=self.policy)
                except Exception as exc:
                    _add_context(exc, f"raised while replacing {where}; the model was left unchanged")
                    raise
                if not isinstance(new, nn.Module):
                    raise TypeError(f"{where}: the factory returned {type(new).__name__}, not an nn.Module.")
                if new is source:
                    raise ValueError(
                        f"{where}: the factory returned the source module itself; it must return the "
                        "replacement module (reusing the source's Parameters)."
                    )
                problems = schema.differences(_ModuleSchema.capture(new))
                new_signature = _signature_key(new)
                if new_signature != signature:
                    problems.append(f"forward signature changed: {signature} -> {new_signature}")
                if problems:
                    raise ValueError(
                        f"{where}: the replacement breaks the factory contract (design spec §5, §13.2):\n  - "
                        + "\n  - ".join(problems)
                    )
                replacements.append(new)
            for entry, source, schema in zip(self.entries, sources, source_schemas):
                problems = schema.differences(_ModuleSchema.capture(source))
                if problems:
                    raise ValueError(
                        f"rule {entry.rule.name!r}: the source module {entry.fqn!r} was modified by a "
                        "factory (factories must not touch their source):\n  - " + "\n  - ".join(problems)
                    )
            if len({id(new) for new in replacements}) != len(replacements):
                raise ValueError("plan.apply: two factories returned the same module object.")

            for entry, new in zip(self.entries, replacements):
                for fqn in entry.fqns:
                    parent, name = _parent_and_name(model, fqn)
                    old = parent._modules[name]
                    setattr(parent, name, new)
                    installed.append((parent, name, old))
            problems = model_before.differences(_ModuleSchema.capture(model))
            if problems:
                raise ValueError(
                    "plan.apply: the installed replacements changed the model's schema (design spec §5):\n  - "
                    + "\n  - ".join(problems[:20])
                )
        except BaseException:
            for parent, name, old in reversed(installed):
                setattr(parent, name, old)
            _restore_flags(model, model_before)
            raise

        return self._report(applied=True, to_types=[_type_name(type(new)) for new in replacements])

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict: rules and the preview report."""
        return {"rules": [rule.as_dict() for rule in self.rules], "plan": self.preview().as_dict()}


def _restore_flags(model: nn.Module, schema: _ModuleSchema) -> None:
    """Put back ``requires_grad`` and ``training`` flags a failing factory may have flipped."""
    for _, meta in schema.params:
        if meta.obj.requires_grad != meta.requires_grad:
            meta.obj.requires_grad_(meta.requires_grad)
    modules = dict(model.named_modules(remove_duplicate=False))
    for name, training in schema.training:
        module = modules.get(name)
        if module is not None and module.training != training:
            module.training = training
