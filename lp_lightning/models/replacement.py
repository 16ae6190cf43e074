"""The replacement plan of a run: ``model, policy, rules -> plan``, one pure function (design spec §5, §12.1 step 3).

The precision plugin (before ``plan.apply``), the CLI's launch check and the memory planner all call
:func:`replacement_plan` on the model's meta twin; nothing builds a plugin to get a plan. The
model's adapter (:func:`~lp_lightning.models.adapter.adapter_for`) supplies the default rules, the
never-replace rules and the glob hint; the policy says how to compute (design spec §4: which
modules is the plan's question, how is the policy's).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lp_lightning.models.adapter import ModelAdapter, adapter_for
from lp_lightning.observers import stage
from lp_lightning.plan import ModuleReplacementPlan, ReplacementRule, compile_plan, load_rules
from lp_lightning.policy import LowPrecisionPolicy

__all__ = ["PlanRules", "replacement_plan"]

PlanRules = Sequence[ReplacementRule] | str | None
"""Replacement rules, the path of a ``plan_overrides`` YAML (``configs/plan_deepseek_v3.yaml``), or
``None`` for the adapter's ``default_replacement_rules``."""


def replacement_plan(
    model: nn.Module, policy: LowPrecisionPolicy, rules: PlanRules = None, *, adapter: ModelAdapter | None = None
) -> ModuleReplacementPlan:
    """The replacement plan of ``policy`` compiled on ``model`` (its structure only: a meta twin will do).

    Args:
        model: The causal LM (or a wrapper holding it), usually its adapter's meta twin
            (``build_meta_model`` / ``build_meta_twin``); nothing is modified.
        policy: The run's :class:`~lp_lightning.policy.LowPrecisionPolicy`; a disabled one gives
            an empty plan.
        rules: See :data:`PlanRules`.
        adapter: The model's adapter; ``None`` looks it up (``adapter_for(model)``).

    Returns:
        The compiled plan; apply it with ``plan.apply(causal_lm)``.

    Raises:
        TypeError, ValueError, ImportError: from :func:`~lp_lightning.plan.compile_plan` (a rule with
            zero hits, a module of the wrong type, two rules on one module, ...) or when no model
            adapter describes ``model``; a ``ValueError`` when an enabled policy's plan replaces no
            module at all (e.g. ``plan_overrides: []``), since every GEMM would then run in BF16.
    """
    with stage("plan_compile"):  # a stage event for observers (the st harness's §15 table)
        adapter = adapter if adapter is not None else adapter_for(model)
        causal_lm = adapter.causal_lm(model)
        if rules is None:
            resolved: Sequence[ReplacementRule] = adapter.default_replacement_rules(causal_lm.config)
        elif isinstance(rules, str):
            resolved = load_rules(rules)
        else:
            resolved = tuple(rules)
        plan = compile_plan(
            causal_lm, resolved, policy, never_replace=adapter.never_replace, glob_hint=adapter.glob_hint
        )
        if policy.enabled and not plan.entries:
            raise ValueError(
                f"the replacement plan replaces no module, so precision={policy.precision_name.value!r} would run "
                "every GEMM in BF16; remove plan_overrides (the model's default targets) or list target FQNs in it."
            )
    return plan
