"""Format-agnostic module replacement plan: compile on the meta model, apply atomically (design spec §5, §13.2; R5).

The plan answers "which modules compute in low precision" (design spec §4); *how* they compute is the
:class:`~lp_lightning.policy.LowPrecisionPolicy` handed to each factory. This package imports no
low-precision type and knows no model: rules name their factories by dotted path
(``{"_target_": "pkg.mod.fn"}``, exactly as the design spec YAML of §4.3) and the factories are
imported only when the plan is applied; what a model never replaces, its default rules and its meta
twin come from the model's adapter (:class:`~lp_lightning.models.adapter.ModelAdapter`) as data.

Modules: :mod:`~lp_lightning.plan.rules` (``ReplacementRule``, ``NeverReplaceRule``,
``rules_from_config``, ``load_rules``), :mod:`~lp_lightning.plan.compile` (``compile_plan`` and its
checks), :mod:`~lp_lightning.plan.apply` (``ModuleReplacementPlan`` and the atomic install/restore),
:mod:`~lp_lightning.plan.report` (``PlannedReplacement``, ``SkippedModule``, ``ReplacedModule``,
``ReplacementReport``).

Lifecycle (design spec §5, §12.1 steps 2-5)::

    meta model (structure only) --compile_plan(model, rules, policy, never_replace=...)--> ModuleReplacementPlan
    ... high-precision materialisation and init (same module tree) ...
    plan.apply(model) --> every factory runs and is validated, then all are installed, or none
                      --> ReplacementReport (replaced / skipped with reason / counts per rule)

Matching rules (one mechanism):

- ``match`` / ``exclude`` list full module FQNs from ``model.named_modules(remove_duplicate=False)``
  (design spec §1.1: "targets are listed by full FQN; no ``*_proj`` wildcard"). An entry holding a
  wildcard (``*``, ``?``, ``[``) is refused when the rule is built: ``model.layers.*.self_attn.*_proj``
  would silently miss ``kv_a_proj_with_mqa``. A model adapter's default rules list every target
  of the model's config; only its never-replace rules (the boundary, not targets) use globs.
- A module reachable under several FQNs (aliases) is one target: it is matched if ``match`` names
  any of its FQNs, skipped if ``exclude`` names any, replaced once, and the single replacement is
  installed at every FQN.
- ``module_type`` is an assertion, not a filter: every module a rule selects must be exactly that
  type (``exact_type=True``: ``type(module) is module_type``) or an instance of it
  (``exact_type=False``); anything else (a ``nn.Linear`` subclass, a PEFT/LoRA or custom wrapper)
  is a ``TypeError`` naming the FQN (design spec §15: unsupported modules fail, they are not replaced
  blindly).
- Errors at compile time: a ``match`` FQN of an active rule that names no module (with the nearest
  FQNs as candidates), a rule that selects nothing, two rules on one module, one selected module inside
  another, a selected module that is or contains a never-replaced module (design spec §1.1: the
  plan always refuses embeddings and normalization modules; LM head, MoE router, rotary embedding,
  core attention and the like are the ``never_replace`` rules of the model's adapter).
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

No tensor data is read anywhere in this package: compile reads module types and FQNs only (it runs
on a meta model and dispatches no aten op); apply compares Parameter identity and metadata
(shape, dtype, device, requires_grad), never values.
"""

from lp_lightning.plan.apply import ModuleReplacementPlan
from lp_lightning.plan.compile import compile_plan
from lp_lightning.plan.report import PlannedReplacement, ReplacedModule, ReplacementReport, SkippedModule
from lp_lightning.plan.rules import (
    NeverReplaceRule,
    ReplacementCondition,
    ReplacementFactory,
    ReplacementRule,
    load_rules,
    rules_from_config,
)

__all__ = [
    "ModuleReplacementPlan",
    "NeverReplaceRule",
    "PlannedReplacement",
    "ReplacedModule",
    "ReplacementCondition",
    "ReplacementFactory",
    "ReplacementReport",
    "ReplacementRule",
    "SkippedModule",
    "compile_plan",
    "load_rules",
    "rules_from_config",
]
