"""What a replacement plan replaces and skips: the entries of a plan and its report (design spec §5).

:class:`PlannedReplacement` is one entry of a compiled plan; :class:`ReplacementReport` (built from
:class:`ReplacedModule` and :class:`SkippedModule` items) is what
:meth:`~lp_lightning.plan.ModuleReplacementPlan.apply` returns and what ``run_summary.json`` and the
run log show.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lp_lightning.plan.rules import ReplacementRule
from lp_lightning.policy import LowPrecisionPolicy

__all__ = ["PlannedReplacement", "ReplacedModule", "ReplacementReport", "SkippedModule"]


@dataclass(frozen=True)
class PlannedReplacement:
    """One module the plan will replace.

    Attributes:
        fqns: Every FQN the module is reachable under, in ``named_modules`` order; ``fqns[0]`` is
            the primary FQN passed to the factory, the rest are aliases that receive the same
            replacement.
        rule: The rule that selected it.
        source_type: ``type(module)`` at compile time (re-checked at apply time).
        matched_fqns: The entries of the rule's ``match`` that name one of ``fqns``.
    """

    fqns: tuple[str, ...]
    rule: ReplacementRule
    source_type: type
    matched_fqns: tuple[str, ...]

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
    """A module a rule's ``match`` names but the plan leaves alone (``exclude``), with the reason."""

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
        skipped: Modules a rule's ``match`` named that were left alone, with the reason.
        inactive_rules: ``(rule name, reason)`` for rules that did not run (e.g. low precision off).
        low_precision_weights: Low-precision weights the replaced modules hold (an experts module holds
            two), set by whoever finalized them (the precision plugin); ``None`` when not counted.
    """

    policy: LowPrecisionPolicy
    applied: bool
    rule_names: tuple[str, ...]
    replaced: tuple[ReplacedModule, ...]
    skipped: tuple[SkippedModule, ...]
    inactive_rules: tuple[tuple[str, str], ...]
    low_precision_weights: int | None = None

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
            "low_precision_weights": self.low_precision_weights,
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
        weights = "" if self.low_precision_weights is None else f" holding {self.low_precision_weights} low-precision weights"
        lines = [
            f"module replacement ({self.policy.describe()}): {self.num_replaced} module(s) {verb}{weights}, "
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
