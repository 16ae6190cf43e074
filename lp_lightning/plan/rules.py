"""Replacement rules: which modules a factory replaces, and which modules are never replaced (design spec §4.3, §1.1).

:class:`ReplacementRule` is one ``plan_overrides`` entry (full module FQNs, the asserted module type,
the factory by dotted path); :func:`rules_from_config` / :func:`load_rules` build them from the design
spec's YAML layout. :class:`NeverReplaceRule` is a model's boundary (embedding, LM head, router, ...)
that :func:`~lp_lightning.plan.compile_plan` enforces; the model adapter
(:mod:`lp_lightning.models.adapter`) provides them as data. Nothing here imports a factory or a
model: dotted paths are only checked for form (:func:`_import_object` resolves them later).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from torch import nn

__all__ = [
    "NeverReplaceRule",
    "ReplacementCondition",
    "ReplacementFactory",
    "ReplacementRule",
    "load_rules",
    "rules_from_config",
]

ReplacementFactory = Callable[..., nn.Module]
"""``factory(source: nn.Module, *, fqn: str, policy: LowPrecisionPolicy) -> nn.Module`` (design spec §13.2)."""

_DOTTED_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


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


_WILDCARDS = "*?["
"""fnmatch's special characters: a ``match``/``exclude`` entry holding one is a pattern, not a full FQN."""


def _as_name_tuple(value: object, *, rule: str, key: str, allow_empty: bool, wildcards: bool) -> tuple[str, ...]:
    """``value`` (one string or a list) as a tuple of names; ``wildcards=False``: full FQNs only."""
    what = "glob" if wildcards else "full module FQN"
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, Iterable) or isinstance(names, Mapping):
        raise TypeError(f"rule {rule!r}: `{key}` must be a {what} or a list of them, got {type(value).__name__}.")
    names = tuple(names)
    if not names and not allow_empty:
        raise ValueError(f"rule {rule!r}: `{key}` is empty; give at least one {what}.")
    for name in names:
        if not isinstance(name, str) or not name or name != name.strip():
            raise ValueError(
                f"rule {rule!r}: every `{key}` entry must be a non-empty {what} without surrounding "
                f"whitespace, got {name!r}."
            )
        if not wildcards and any(ch in name for ch in _WILDCARDS):
            raise ValueError(
                f"rule {rule!r}: `{key}` entry {name!r} is a wildcard; targets are full FQNs (design spec §1.1, "
                "no `*`, `?` or `[`). List each module, as configs/plan_deepseek_v3.yaml does."
            )
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"rule {rule!r}: `{key}` lists {dupes} more than once.")
    return names


def _check_dotted(path: object, *, rule: str, key: str) -> str:
    if not isinstance(path, str) or not _DOTTED_PATH.match(path):
        raise ValueError(
            f"rule {rule!r}: `{key}` must be a dotted import path such as "
            f"'torch.nn.Linear' or 'package.module.function', got {path!r}."
        )
    return path


@dataclass(frozen=True, kw_only=True)
class ReplacementRule:
    """One ``plan_overrides`` entry: which modules (full FQNs) a factory replaces (design spec §4.3).

    Args:
        name: Rule name used in errors, counts and the report (e.g. ``"mla_projections"``).
        match: Full module FQN(s) from ``named_modules()`` (``"model.layers.0.mlp.gate_proj"``).
            Design spec §1.1 lists targets by full FQN, so an entry holding a wildcard (``*``,
            ``?``, ``[``) is refused: ``*_proj`` would also silently miss or add modules. Each entry
            of an active rule must name an existing module.
        module_type: The type every selected module must have: a class or its dotted import path
            (``"torch.nn.Linear"``), resolved at compile time with :mod:`importlib`.
        replace_module: The factory ``factory(source, *, fqn, policy) -> nn.Module``: a dotted
            path, the design spec's ``{"_target_": "dotted.path"}`` mapping, or a callable. Paths are
            imported only by :meth:`ModuleReplacementPlan.apply`.
        exclude: Full FQN(s) among ``match`` that this rule skips (reported as skipped).
        exact_type: ``True``: ``type(module) is module_type`` (subclasses and wrappers fail);
            ``False``: ``isinstance(module, module_type)``.
        when: Activation condition; only ``"low_precision"`` (active iff the policy is enabled).

    Raises:
        TypeError: a field has the wrong type.
        ValueError: an empty/duplicated FQN list, a wildcard entry, a malformed dotted path, a ``replace_module``
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
        for key, allow_empty in (("match", False), ("exclude", True)):
            names = _as_name_tuple(getattr(self, key), rule=rule, key=key, allow_empty=allow_empty, wildcards=False)
            object.__setattr__(self, key, names)
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
                    f"{sorted(factory)}; drop the extra keys, a factory takes no arguments (design spec §13.2)."
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


@dataclass(frozen=True, kw_only=True)
class NeverReplaceRule:
    """Modules that stay high precision whatever the rules say (design spec §1.1), as data a model adapter gives.

    :func:`~lp_lightning.plan.compile_plan` fails when a rule selects such a module or a module
    containing one. The plan itself always refuses ``nn.Embedding`` and normalization modules (torch's
    norm types and any class named ``*Norm``/``*Norm<k>d``); everything that depends on a model's
    naming (``lm_head``, the MoE router, core attention, ...) comes from these rules.

    Args:
        reason: What the module is, as the error names it (``"LM head"``, ``"MoE router"``).
        fqn_globs: :func:`fnmatch.fnmatchcase` globs over module FQNs (``"*.mlp.gate"``).
        type_names: :func:`fnmatch.fnmatchcase` globs over the module's class name
            (``"*Router"``), so a renamed module of that kind is caught too.

    Raises:
        ValueError: an empty ``reason``, no glob at all, or an invalid/duplicated glob.
    """

    reason: str
    fqn_globs: tuple[str, ...] = ()
    type_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError(f"NeverReplaceRule.reason must be a non-empty string, got {self.reason!r}.")
        where = f"never-replace {self.reason}"
        for key in ("fqn_globs", "type_names"):
            names = _as_name_tuple(getattr(self, key), rule=where, key=key, allow_empty=True, wildcards=True)
            object.__setattr__(self, key, names)
        if not self.fqn_globs and not self.type_names:
            raise ValueError(f"rule {where!r}: give at least one of `fqn_globs`, `type_names`.")


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


def _check_unique_names(rules: Sequence[ReplacementRule]) -> None:
    names = [rule.name for rule in rules]
    dupes = sorted({name for name in names if names.count(name) > 1})
    if dupes:
        raise ValueError(f"replacement rule names must be unique; {dupes} appear more than once.")


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
