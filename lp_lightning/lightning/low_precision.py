"""The low-precision precision plugins: ``LowPrecisionFabricPlugin`` (Fabric), ``LowPrecisionPlugin`` (Trainer).

Chosen by :func:`~lp_lightning.lightning.precision.precision_plugin` for ``mxfp8`` / ``hif8``; this
module imports the low-precision stack, which a ``bf16`` run never loads. Lifecycle (design spec
§12.1; the strategies call these in this order, see :mod:`lp_lightning.fsdp.parallelize`)::

    startup_gate(device_type)    # the backend gate: its choice becomes the policy's backend
    configure_sharding(reshard_after_forward=..., activation_checkpoint=...)   # the gather policy
    convert_module(model)        # replacement_plan on the META twin, plan.apply, FP32 masters (unbuilt)
    ... strategy: parallelize_causal_lm(..., lifecycle=plugin.lifecycle): FP32 upcast -> placements
        -> fully_shard -> refresh -> recompute ...
    optimizer_step(...)          # closure, finite check, optimizer.step(), ONE refresh of every weight
    rebuild_after_load(model)    # after a DCP load restored the FP32 masters: ONE refresh

The FSDP2 side of each step (gather policy, finalize, placements, refreshes and their counts) is
the plugin's :class:`~lp_lightning.fsdp.lifecycle.LowPrecisionLifecycle` (``lifecycle``); the
plugin converts modules and wraps the optimizer step.

The precision choice travels as data: ``--precision`` -> :class:`~lp_lightning.policy.LowPrecisionConfig`
-> :class:`~lp_lightning.policy.LowPrecisionPolicy` (format, scaling, backend) -> the factories build
each module and weight with ``recipe_for(format, backend)`` -> every quantisation and GEMM passes the
recipe's backend (docs/architecture.md "The path of one GEMM").
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from typing_extensions import override

from lp_lightning.fsdp.lifecycle import LowPrecisionLifecycle
from lp_lightning.lightning.nonfinite import DEFAULT_MAX_CONSECUTIVE_SKIPS
from lp_lightning.lightning.precision import (
    BackendChoice,
    FSDP2PrecisionPlugin,
    PrecisionMode,
    TrainerStep,
    check_precision,
)
from lp_lightning.models.adapter import adapter_for
from lp_lightning.models.replacement import PlanRules, replacement_plan
from lp_lightning.ops import resolve_backend
from lp_lightning.ops.gate import StartupGateResult
from lp_lightning.plan import ModuleReplacementPlan, ReplacementReport
from lp_lightning.policy import LowPrecisionConfig

__all__ = ["LowPrecisionFabricPlugin", "LowPrecisionPlugin"]

log = logging.getLogger(__name__)


class LowPrecisionFabricPlugin(FSDP2PrecisionPlugin):
    """Fabric precision plugin of MXFP8 / HiF8 GEMMs (design spec §12.1).

    Use with :class:`~lp_lightning.lightning.strategy.FSDP2FabricStrategy`::

        fabric = Fabric(strategy=FSDP2FabricStrategy(), plugins=[LowPrecisionFabricPlugin("mxfp8")])

    Args:
        precision: ``"mxfp8"`` (``mxfp8_e4m3`` + ``mx_block``) or ``"hif8"`` (``hif8`` + ``current``).
        plan_rules: Replacement rules, a ``plan_overrides`` YAML path, or ``None`` for the model
            adapter's defaults (:data:`~lp_lightning.models.replacement.PlanRules`).
        skip_nonfinite_steps, backend, max_consecutive_skips: See
            :class:`~lp_lightning.lightning.precision.FSDP2PrecisionPlugin`.

    Attributes:
        policy: The run's policy; its ``backend`` is the startup gate's choice once the gate ran
            (before: the ``backend`` setting, ``"auto"`` resolving by the device).
        lifecycle: The run's :class:`~lp_lightning.fsdp.lifecycle.LowPrecisionLifecycle` (gather policy,
            finalize, placements, refreshes); the strategy hands it to ``parallelize_causal_lm``.
        replacement_report: The plan's ``ReplacementReport`` after :meth:`convert_module` (with its
            ``low_precision_weights`` count).
        low_precision_weights: FQNs of the parameters turned into low-precision weights.

    Raises:
        ValueError: ``precision`` is ``"bf16"`` (use ``precision_plugin("bf16")`` or ``BF16Plugin``)
            or unknown, or another argument is invalid.
    """

    def __init__(
        self,
        precision: PrecisionMode = "mxfp8",
        *,
        skip_nonfinite_steps: bool = True,
        backend: BackendChoice = "auto",
        plan_rules: PlanRules = None,
        max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
    ) -> None:
        if check_precision(precision) == "bf16":
            raise ValueError(
                f"{type(self).__name__} computes in mxfp8 or hif8; precision='bf16' is the BF16 baseline: use "
                "precision_plugin('bf16') or BF16Plugin() (lp_lightning.lightning.precision)."
            )
        super().__init__(
            skip_nonfinite_steps=skip_nonfinite_steps, backend=backend, max_consecutive_skips=max_consecutive_skips
        )
        self.mode = precision
        self.low_precision_config = LowPrecisionConfig.from_precision(precision)
        self.policy = self.low_precision_config.to_policy(backend=backend)
        self.plan_rules = plan_rules
        self.lifecycle: LowPrecisionLifecycle = LowPrecisionLifecycle()
        self._report: ReplacementReport | None = None
        self._weights: tuple[str, ...] = ()
        self._elements = 0
        self._device: torch.device | None = None

    # -- what the run reports ----------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """Op backend of the GEMMs: the gate's choice, else resolved like the op entry points do."""
        if self.gate.result is not None:
            return self.gate.result.backend
        return resolve_backend(self.policy.format, self._device or torch.device("cpu"), self.policy.backend)

    @property
    def replacement_report(self) -> ReplacementReport | None:
        return self._report

    @property
    def low_precision_weights(self) -> tuple[str, ...]:
        return self._weights

    @property
    def low_precision_elements(self) -> int:
        return self._elements

    @property
    def refreshes(self) -> dict[str, int]:
        return self.lifecycle.refreshes

    # -- the strategy's hooks ----------------------------------------------------------------------
    @override
    def startup_gate(self, device_type: str) -> StartupGateResult | None:
        """Runs the gate once; its backend becomes the policy's, so every module and weight built later carries it.

        Raises:
            lp_lightning.ops.gate.StartupGateError: a check failed.
        """
        result = self.gate.run(self.policy.format.value, device_type)
        if result is not None and self.policy.backend != result.backend:
            self.policy = self.low_precision_config.to_policy(backend=result.backend)
        return result

    @override
    def configure_sharding(self, *, reshard_after_forward: bool, activation_checkpoint: str) -> None:
        """Fixes the MXFP8 gather policy before :meth:`convert_module` (FSDP2 sizes each gather once).

        After this call ``convert_module`` leaves the storage unbuilt: ``fully_shard`` replaces every
        parameter by a shard that the strategy's refresh builds.

        Raises:
            RuntimeError: The module was already converted; ValueError: a bad ``activation_checkpoint``.
        """
        super().configure_sharding(reshard_after_forward=reshard_after_forward, activation_checkpoint=activation_checkpoint)
        if self._report is not None:
            raise RuntimeError(
                "configure_sharding must run before convert_module: the MXFP8 gather policy is fixed when the "
                "low-precision weights are finalized."
            )
        self.lifecycle.configure(
            reshard_after_forward=reshard_after_forward, activation_checkpoint=activation_checkpoint  # type: ignore[arg-type]
        )

    def compile_plan(self, meta: nn.Module) -> ModuleReplacementPlan:
        """This run's plan on a structure-only model: ``replacement_plan(meta, policy, plan_rules)``
        (:mod:`lp_lightning.models.replacement`); what :meth:`convert_module` applies."""
        return replacement_plan(meta, self.policy, self.plan_rules)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Replaces the planned modules and finalizes their weights (FP32 masters); the strategy calls it before sharding.

        The plan is compiled on the adapter's meta twin, applied atomically (all or nothing) to
        ``module``, then ``finalize_low_precision_weights`` runs with the gather policy of
        :meth:`configure_sharding` (storage built at once only when no strategy configured sharding).

        Args:
            module: The plain, HF-initialised causal LM (or a wrapper holding it at ``.model``),
                identical on every rank, not yet sharded.

        Returns:
            ``module`` (replaced in place).

        Raises:
            TypeError, ValueError: From the plan (the model is untouched then) or from finalize; a
                ``TypeError`` when no adapter describes ``module``; RuntimeError: a second conversion.
        """
        adapter = adapter_for(module)
        causal_lm = adapter.causal_lm(module)
        if self._report is not None:
            if self.lifecycle.holds_weights(causal_lm):
                raise RuntimeError(
                    f"{type(self).__name__}.convert_module ran twice on {type(causal_lm).__name__}: it is already "
                    "converted; pass the converted model on, do not convert it again."
                )
            raise RuntimeError(
                f"{type(self).__name__} already converted another model ({len(self._weights)} "
                f"low-precision weights); one plugin serves one model. Create a new plugin (Fabric) for this "
                f"{type(causal_lm).__name__}."
            )
        report = self.compile_plan(adapter.build_meta_twin(causal_lm)).apply(causal_lm)
        records = self.lifecycle.finalize(causal_lm, recipe=self.policy)
        self._report = dataclasses.replace(report, low_precision_weights=len(records))
        self._weights = tuple(r.fqn for r in records)
        self._elements = sum(math.prod(r.shape) for r in records)
        self._device = next(causal_lm.parameters()).device
        log.info("%s\n%d low-precision weights finalized (FP32 masters)", self._report.format(), len(records))
        backend = self.backend  # resolved now: an NPU device whose capability check fails stops here
        rank_zero_info(
            f"lp-lightning: {self.mode} on {self.weights_summary}, op backend {backend!r} "
            f"(device {self._device.type}{', exact software emulation' if backend == 'emulated' else ''})."
        )
        return module

    @override
    def rebuild_after_load(self, module: nn.Module) -> None:
        """Rebuilds every low-precision weight from the FP32 masters a DCP load restored (design spec §11)."""
        self.lifecycle.after_load(adapter_for(module).causal_lm(module))

    @override
    def _after_applied_step(self, params: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return self.lifecycle.after_step(params)


class LowPrecisionPlugin(TrainerStep, Precision, LowPrecisionFabricPlugin):
    """Trainer twin of :class:`LowPrecisionFabricPlugin` (same arguments and hooks).

    Use with :class:`~lp_lightning.lightning.strategy.FSDP2Strategy`::

        Trainer(strategy=FSDP2Strategy(), plugins=[LowPrecisionPlugin("hif8")])
    """
