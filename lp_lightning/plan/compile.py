"""Compile replacement rules against a model's module structure into an immutable plan (design spec §5).

:func:`compile_plan` reads only ``named_modules(remove_duplicate=False)`` and module types, in named
steps: check the arguments (:func:`_check_arguments`), then per rule resolve its ``module_type``,
look up the modules its full FQNs name (:func:`_match_hits`) and select them (:func:`_select`:
``exclude``, never-replaced boundary, type, one rule per module), and finally refuse nested
selections (:func:`_check_not_nested`). The model's never-replace rules
(:class:`~lp_lightning.plan.rules.NeverReplaceRule`) are data the caller passes, normally
``adapter.never_replace`` of the model's :class:`~lp_lightning.models.adapter.ModelAdapter`; the plan
itself only refuses embeddings and normalization modules, which no model may replace.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase

from torch import nn

from lp_lightning.plan.apply import ModuleReplacementPlan, _alias_groups, _AliasGroup
from lp_lightning.plan.report import PlannedReplacement, SkippedModule
from lp_lightning.plan.rules import (
    NeverReplaceRule,
    ReplacementRule,
    _check_unique_names,
    _import_object,
    _type_name,
)
from lp_lightning.policy import LowPrecisionPolicy

__all__ = ["compile_plan"]

_BOUNDARY_HINT = (
    "design spec §1.1 keeps embedding, LM head, MoE router, normalization, rotary embedding and core "
    "attention in high precision"
)
_MAX_CANDIDATES = 5
_NORM_TYPES = (
    nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
)
_NORM_NAME = re.compile(r"Norm(\dd)?$")  # LlamaRMSNorm, FusedLayerNorm, BatchNorm2d


def _resolve_module_type(rule: ReplacementRule) -> type:
    if isinstance(rule.module_type, type):
        return rule.module_type
    cls = _import_object(rule.module_type, rule=rule.name, key="module_type")
    if not isinstance(cls, type):
        raise TypeError(f"rule {rule.name!r}: `module_type`={rule.module_type!r} is not a class ({cls!r}).")
    return cls


def _generic_denied_reason(module: nn.Module) -> str | None:
    """Why the plan refuses a module of any model (embedding, normalization), or ``None``."""
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, _NORM_TYPES) or _NORM_NAME.search(type(module).__name__):
        return "normalization"
    return None


def _denied_reason(fqn: str, module: nn.Module, never_replace: Sequence[NeverReplaceRule]) -> str | None:
    """Why ``module`` at ``fqn`` is never replaced (design spec §1.1), or ``None``.

    FQN globs first, then the generic types, then the class-name globs, each in rule order.
    """
    for boundary in never_replace:
        if any(fnmatchcase(fqn, glob) for glob in boundary.fqn_globs):
            return boundary.reason
    reason = _generic_denied_reason(module)
    if reason is not None:
        return reason
    name = type(module).__name__
    for boundary in never_replace:
        if any(fnmatchcase(name, pattern) for pattern in boundary.type_names):
            return boundary.reason
    return None


def _check_boundary(group: _AliasGroup, rule: ReplacementRule, never_replace: Sequence[NeverReplaceRule]) -> None:
    """Fail if the selected module is, or contains, a never-replaced module (design spec §1.1)."""
    primary = group.fqns[0]
    for sub_name, sub in group.module.named_modules(remove_duplicate=False):
        if sub_name:
            fqns = [f"{fqn}.{sub_name}" for fqn in group.fqns]
        else:
            fqns = list(group.fqns)
        for fqn in fqns:
            reason = _denied_reason(fqn, sub, never_replace)
            if reason is not None:
                where = "is" if not sub_name else f"contains {fqn!r}, which is"
                raise ValueError(
                    f"rule {rule.name!r} selects {primary!r}, which {where} a {reason} module "
                    f"({_type_name(type(sub))}); {_BOUNDARY_HINT}. Remove {primary!r} from the rule's `match`."
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
        f"{relation}.{detail} It is not replaced: remove {fqn!r} from `match` or add it to `exclude`, or "
        "remove the wrapper (design spec §15)."
    )


def _zero_hit_error(
    rule: ReplacementRule, missing: list[str], fqns: Sequence[str], glob_hint: str | None
) -> ValueError:
    lines = [
        f"rule {rule.name!r} ({rule.module_type_name} -> {rule.factory_name}) is enabled but "
        f"{len(missing)} of its `match` FQNs name no module (design spec §4.3: zero hits are an error):"
    ]
    for fqn in missing[:10]:
        nearest = difflib.get_close_matches(fqn, fqns, n=_MAX_CANDIDATES, cutoff=0.0)
        lines.append(f"  {fqn!r}; nearest FQNs: {nearest}")
    if len(missing) > 10:
        lines.append(f"  ... and {len(missing) - 10} more, from {missing[10]!r} to {missing[-1]!r}")
    hint = f" ({glob_hint})" if glob_hint else ""
    lines.append(
        "Print the candidates with `for fqn, m in model.named_modules(): print(fqn, type(m).__name__)` "
        f"on the meta model and fix the FQNs{hint}."
    )
    return ValueError("\n".join(lines))


def _check_arguments(
    model: object, rules: Iterable[object], policy: object, never_replace: Iterable[object]
) -> tuple[tuple[ReplacementRule, ...], tuple[NeverReplaceRule, ...]]:
    """Type checks of :func:`compile_plan`; returns the rules and never-replace rules as tuples."""
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
    never_replace = tuple(never_replace)
    for boundary in never_replace:
        if not isinstance(boundary, NeverReplaceRule):
            raise TypeError(
                f"compile_plan: never_replace must hold NeverReplaceRule objects (a model adapter's "
                f"`never_replace`), got {type(boundary).__name__}."
            )
    return rules, never_replace  # type: ignore[return-value]


def _match_hits(
    rule: ReplacementRule, by_fqn: dict[str, _AliasGroup], glob_hint: str | None
) -> dict[int, list[str]]:
    """``id(module) -> [entries of rule.match that name it]`` (aliases: several); a missing FQN is an error."""
    hits: dict[int, list[str]] = {}
    missing = [fqn for fqn in rule.match if fqn not in by_fqn]
    if missing:
        raise _zero_hit_error(rule, missing, list(by_fqn), glob_hint)
    for fqn in rule.match:
        hits.setdefault(id(by_fqn[fqn].module), []).append(fqn)
    return hits


def _select(
    rule: ReplacementRule,
    required: type,
    hits: dict[int, list[str]],
    by_id: dict[int, _AliasGroup],
    order: dict[int, int],
    never_replace: Sequence[NeverReplaceRule],
    selected: dict[int, PlannedReplacement],
    skipped: list[SkippedModule],
) -> None:
    """Add the modules ``rule`` hits to ``selected`` (excluded ones to ``skipped``), checking each."""
    num_selected = 0
    for module_id in sorted(hits, key=order.__getitem__):
        group = by_id[module_id]
        excluded_by = next((fqn for fqn in rule.exclude if fqn in group.fqns), None)
        if excluded_by is not None:
            skipped.append(SkippedModule(group.fqns[0], rule.name, f"excluded by {excluded_by!r}"))
            continue
        _check_boundary(group, rule, never_replace)
        _check_type(group, rule, required)
        previous = selected.get(module_id)
        if previous is not None:
            raise ValueError(
                f"module {group.fqns[0]!r} (FQNs {group.fqns}) is selected by two rules: "
                f"{previous.rule.name!r} ({previous.rule.factory_name}, via {list(previous.matched_fqns)}) "
                f"and {rule.name!r} ({rule.factory_name}, via {hits[module_id]}). Remove it from one rule's "
                "`match`."
            )
        selected[module_id] = PlannedReplacement(
            fqns=tuple(group.fqns),
            rule=rule,
            source_type=type(group.module),
            matched_fqns=tuple(hits[module_id]),
        )
        num_selected += 1
    if num_selected == 0:
        raise ValueError(
            f"rule {rule.name!r} is enabled but selects no module: every module its `match` names is "
            f"excluded by {list(rule.exclude)} (design spec §4.3: zero hits are an error). Remove the rule "
            "or shorten `exclude`."
        )


def _check_not_nested(selected: dict[int, PlannedReplacement], by_id: dict[int, _AliasGroup]) -> None:
    """Fail if one selected module lies inside another (replaced whole)."""
    for module_id, entry in selected.items():
        for sub_name, sub in by_id[module_id].module.named_modules(remove_duplicate=False):
            inner = selected.get(id(sub)) if sub_name else None
            if inner is not None:
                raise ValueError(
                    f"module {inner.fqn!r} (rule {inner.rule.name!r}) lies inside {entry.fqn!r} (rule "
                    f"{entry.rule.name!r}), which is replaced whole; nested replacements are ambiguous. "
                    "Drop one of the two selections."
                )


def compile_plan(
    model: nn.Module,
    rules: Iterable[ReplacementRule],
    policy: LowPrecisionPolicy,
    *,
    never_replace: Iterable[NeverReplaceRule] = (),
    glob_hint: str | None = None,
) -> ModuleReplacementPlan:
    """Compile rules against a model's module structure into an immutable plan (design spec §5).

    Reads only ``named_modules(remove_duplicate=False)`` and module types: no tensor data, no
    kernel, no collective; meant for the meta model (design spec §12.1 step 3). Factories are not
    imported (see :mod:`lp_lightning.plan`).

    Args:
        model: The model, typically on the meta device.
        rules: The replacement rules (e.g. a model adapter's ``default_replacement_rules(config)``,
            :func:`~lp_lightning.plan.load_rules`).
        policy: The low-precision policy; with ``policy.enabled`` false the plan is empty and the
            model is not even scanned.
        never_replace: The model's boundary (its adapter's ``never_replace``): modules no rule may
            select or contain. Embeddings and normalization modules are refused regardless.
        glob_hint: Model-specific advice appended to a zero-hit error (its adapter's ``glob_hint``).

    Returns:
        The plan; apply it with :meth:`ModuleReplacementPlan.apply` after high-precision init.

    Raises:
        TypeError: wrong argument types; a selected module whose type is not the rule's
            ``module_type`` (subclass / wrapper where exact type is required), naming the FQN,
            the actual and the required type.
        ValueError: a `match` FQN naming no module (with up to 5 nearest FQNs), a rule selecting nothing
            after ``exclude``, a module selected by two rules, nested selections, a selected
            module that is or contains a never-replaced module,
            duplicate rule names, an unresolvable ``module_type``.
        ImportError: importing a ``module_type`` module failed.
    """
    rules, never_replace = _check_arguments(model, rules, policy, never_replace)
    if not policy.enabled:
        reason = "low_precision.enabled is false"
        return ModuleReplacementPlan(
            policy=policy, rules=rules, entries=(), skipped=(),
            inactive_rules=tuple((rule.name, reason) for rule in rules), never_replace=never_replace,
        )

    by_id, by_fqn = _alias_groups(model)
    order = {id(group.module): index for index, group in enumerate(by_id.values())}
    selected: dict[int, PlannedReplacement] = {}
    skipped: list[SkippedModule] = []
    for rule in rules:
        required = _resolve_module_type(rule)
        hits = _match_hits(rule, by_fqn, glob_hint)
        _select(rule, required, hits, by_id, order, never_replace, selected, skipped)
    _check_not_nested(selected, by_id)

    entries = tuple(sorted(selected.values(), key=lambda e: order[id(by_fqn[e.fqn].module)]))
    return ModuleReplacementPlan(
        policy=policy, rules=rules, entries=entries, skipped=tuple(skipped), inactive_rules=(),
        never_replace=never_replace,
    )
