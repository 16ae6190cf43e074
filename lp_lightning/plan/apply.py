"""Apply a compiled replacement plan atomically: all replacements installed, or none (design spec §5, §13.2).

:class:`ModuleReplacementPlan` is what :func:`~lp_lightning.plan.compile_plan` returns. Its
:meth:`~ModuleReplacementPlan.apply` runs in named steps: find the compiled modules in the model
(:meth:`~ModuleReplacementPlan._resolve_sources`), import and check the factories
(:meth:`~ModuleReplacementPlan._import_factories`), build and check every replacement against the
factory contract (:meth:`~ModuleReplacementPlan._build_replacements`), install them at every FQN
(:func:`_install`), and check the whole model's schema; any failure restores the model
(:func:`_rollback`). Only metadata is compared (Parameter identity, shape, dtype, device,
``requires_grad``), never tensor values.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lp_lightning.plan.report import PlannedReplacement, ReplacedModule, ReplacementReport, SkippedModule
from lp_lightning.plan.rules import NeverReplaceRule, ReplacementRule, _import_object, _type_name
from lp_lightning.policy import LowPrecisionPolicy

__all__ = ["ModuleReplacementPlan"]


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

    Built by :func:`~lp_lightning.plan.compile_plan`; it stores FQNs and types, not module references, so it can be
    applied to the materialised model (same structure) after high-precision init.

    Attributes:
        policy: Passed to every factory.
        rules: The rules it was compiled from.
        entries: Modules to replace, in ``named_modules`` order.
        skipped: Modules a rule's ``match`` named but its ``exclude`` removed.
        inactive_rules: ``(rule name, reason)`` for rules that were not evaluated.
        never_replace: The model's never-replace rules the compile step enforced (besides the
            plan's own embedding/normalization denials).
    """

    policy: LowPrecisionPolicy
    rules: tuple[ReplacementRule, ...]
    entries: tuple[PlannedReplacement, ...]
    skipped: tuple[SkippedModule, ...]
    inactive_rules: tuple[tuple[str, str], ...]
    never_replace: tuple[NeverReplaceRule, ...] = ()

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
                    f"{_type_name(entry.source_type)} at compile time (rule {entry.rule.name!r}); a subclass or "
                    "PEFT/custom wrapper at a target is never replaced (design spec §15): remove it."
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
        factory contract (:mod:`lp_lightning.plan`); (4) ``setattr`` the replacement on the parent at
        every FQN (aliases included); (5) check the whole model's module FQNs, parameter/buffer names and
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
        factories = self._import_factories()
        model_before = _ModuleSchema.capture(model)
        installed: list[tuple[nn.Module, str, nn.Module]] = []
        try:
            replacements = self._build_replacements(sources, factories)
            _install(model, self.entries, replacements, installed)
            problems = model_before.differences(_ModuleSchema.capture(model))
            if problems:
                raise ValueError(
                    "plan.apply: the installed replacements changed the model's schema (design spec §5):\n  - "
                    + "\n  - ".join(problems[:20])
                )
        except BaseException:
            _rollback(model, installed, model_before)
            raise

        return self._report(applied=True, to_types=[_type_name(type(new)) for new in replacements])

    def _import_factories(self) -> dict[str, Callable[..., Any]]:
        """Step (2) of :meth:`apply`: each rule's factory, imported and signature-checked, by rule name."""
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
        return factories

    def _build_replacements(
        self, sources: Sequence[nn.Module], factories: Mapping[str, Callable[..., Any]]
    ) -> list[nn.Module]:
        """Step (3) of :meth:`apply`: call every factory once and check its result; installs nothing.

        Raises:
            TypeError, ValueError: a result is not a module, is its source, breaks the factory
                contract, a source was modified, or two factories returned one object.
            Exception: whatever a factory raises (with the FQN and rule added as a note).
        """
        source_schemas = [_ModuleSchema.capture(source) for source in sources]
        source_signatures = [_signature_key(source) for source in sources]
        replacements: list[nn.Module] = []
        for entry, source, schema, signature in zip(self.entries, sources, source_schemas, source_signatures):
            where = f"rule {entry.rule.name!r}, factory {entry.rule.factory_name}, module {entry.fqn!r}"
            try:
                new = factories[entry.rule.name](source, fqn=entry.fqn, policy=self.policy)
            except Exception as exc:
                _add_context(exc, f"raised while replacing {where}; the model was left unchanged")
                raise
            _check_replacement(new, source, schema, signature, where=where)
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
        return replacements

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict: rules and the preview report."""
        return {"rules": [rule.as_dict() for rule in self.rules], "plan": self.preview().as_dict()}


def _check_replacement(
    new: object,
    source: nn.Module,
    schema: _ModuleSchema,
    signature: tuple[tuple[str, str, str], ...] | str,
    *,
    where: str,
) -> None:
    """Check one factory result against the factory contract (module docstring of :mod:`lp_lightning.plan`)."""
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


def _install(
    model: nn.Module,
    entries: Sequence[PlannedReplacement],
    replacements: Sequence[nn.Module],
    installed: list[tuple[nn.Module, str, nn.Module]],
) -> None:
    """Step (4) of :meth:`ModuleReplacementPlan.apply`: ``setattr`` each replacement at every FQN.

    Appends ``(parent, name, old module)`` to ``installed`` as it goes, so :func:`_rollback` can
    undo a partial install.
    """
    for entry, new in zip(entries, replacements):
        for fqn in entry.fqns:
            parent, name = _parent_and_name(model, fqn)
            old = parent._modules[name]
            setattr(parent, name, new)
            installed.append((parent, name, old))


def _rollback(
    model: nn.Module, installed: Sequence[tuple[nn.Module, str, nn.Module]], model_before: _ModuleSchema
) -> None:
    """Put back every installed module (last first) and the flags a failing factory may have flipped."""
    for parent, name, old in reversed(installed):
        setattr(parent, name, old)
    _restore_flags(model, model_before)


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
