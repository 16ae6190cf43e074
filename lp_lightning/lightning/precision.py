"""Precision plugins of the FSDP2 job: Fabric ``LowPrecisionFabricPlugin``, Trainer ``LowPrecisionPlugin``.

The plugin owns everything precision-specific that the strategy must not hard-code (docs/design.md,
"Lightning glue"). ``--precision`` maps onto
:meth:`~lp_lightning.policy.LowPrecisionConfig.from_precision` (``bf16`` = low precision off,
``mxfp8`` = ``mxfp8_e4m3+mx_block``, ``hif8`` = ``hif8+current``); an unknown value fails in the
constructor, naming the choices, before any model exists.

Lifecycle (design spec §12.1; the strategy calls these in this order, see
:mod:`lp_lightning.distributed.fsdp` and :mod:`lp_lightning.integration`)::

    configure_sharding(reshard_after_forward=..., activation_checkpoint=...)   # strategy, first
    convert_module(model)        # 1. compile the replacement plan on the model adapter's META twin
                                 #    (structure only), 2. plan.apply(model) on the materialised,
                                 #    HF-initialised model, 3. finalize_low_precision_weights(model,
                                 #    build=False, gather_policy=gather_policy_for(...)): FP32 masters
    ... strategy: FP32 upcast -> fully_shard (replicated fallback modules first) ->
        refresh_low_precision_weights (builds every shard once) -> activation checkpointing ...
    ... Lightning: configure_optimizers over the sharded FP32 masters ...
    optimizer_step(...)          # per optimizer step: closure (forward/backward/clip), finite
                                 # check, optimizer.step(), then ONE refresh of every weight
    rebuild_after_load(model)    # after a DCP load restored the FP32 masters: ONE refresh

In ``bf16`` nothing of this runs: ``convert_module`` returns the module untouched and imports
neither :mod:`lp_lightning.plan`, the low-precision layers (:mod:`lp_lightning.integration`, :mod:`lp_lightning.formats`) nor
``torch_npu``; no weight is refreshed (design spec §13.1, R3).

Skipped steps. With ``skip_nonfinite_steps=True`` (default, all precisions) the plugin runs the
training closure itself, then computes the total gradient norm over the optimizer's parameters
(after Lightning's gradient clipping; a NaN/Inf norm stays non-finite through clipping). A
non-finite norm skips ``optimizer.step()`` *and* the refresh, logs a warning and counts the step
in :attr:`~LowPrecisionFabricPlugin.optimizer_steps_skipped` (R8: a skipped or failed step
refreshes nothing). Lightning still advances ``global_step`` and the LR scheduler, as it does for
a step skipped by AMP's grad scaler. A step whose parameters have no gradient at all (every
micro-batch's ``training_step`` returned ``None``) is a no-op: ``optimizer.step()`` is not called,
nothing is refreshed and it is not counted as applied.

The non-finite guard (:class:`~lp_lightning.lightning.nonfinite.NonFiniteGuard`, :attr:`guard`)
diagnoses each skipped step (a NaN/Inf master, the first non-finite gradient, or a norm overflow),
checks the masters after every applied step (from the refresh's amax for the low-precision
weights) and stops the run with :class:`~lp_lightning.distributed.finite.NonFiniteStateError`
after ``max_consecutive_skips`` skipped steps in a row, or at once when a master holds NaN/Inf.

Plugins are passed to Lightning as instances (``plugins=[LowPrecisionPlugin("mxfp8")]``), which
bypasses the built-in precision strings of Lightning's connector. There is no
autocast: FSDP2's ``MixedPrecisionPolicy`` casts the gathered plain weights to BF16, the
low-precision weights are gathered as 8-bit payloads (:mod:`lp_lightning.integration.gather`), and HF
modules keep the activations in the weights' dtype.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins import Precision as FabricPrecision
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from typing_extensions import override

from lp_lightning.distributed.fsdp import default_mixed_precision_policy, total_grad_norm
from lp_lightning.lightning.nonfinite import DEFAULT_MAX_CONSECUTIVE_SKIPS, NonFiniteGuard
from lp_lightning.policy import LowPrecisionConfig, LowPrecisionPolicy, PrecisionName

if TYPE_CHECKING:
    from lp_lightning.models.adapter import ModelAdapter
    from lp_lightning.ops.gate import StartupGateResult
    from lp_lightning.plan import ModuleReplacementPlan, ReplacementReport, ReplacementRule

__all__ = [
    "BACKEND_CHOICES",
    "SUPPORTED_PRECISIONS",
    "BackendChoice",
    "LowPrecisionFabricPlugin",
    "LowPrecisionPlugin",
    "PrecisionMode",
]

log = logging.getLogger(__name__)

PrecisionMode = Literal["bf16", "mxfp8", "hif8"]
"""Values of ``--precision`` (see :class:`~lp_lightning.policy.PrecisionName`)."""

SUPPORTED_PRECISIONS: tuple[str, ...] = tuple(p.value for p in PrecisionName)
"""Runtime form of :data:`PrecisionMode`: ``("bf16", "mxfp8", "hif8")``."""

BackendChoice = Literal["auto", "emulated", "npu"]
"""Values of ``--backend`` (``lp_lightning.ops.gate``: ``auto`` = ``npu`` on the npu accelerator, else
``emulated``)."""

BACKEND_CHOICES: tuple[str, ...] = ("auto", "emulated", "npu")
"""Runtime form of :data:`BackendChoice` (tested equal to ``"auto"`` + the registered op backends)."""


class LowPrecisionFabricPlugin(FabricPrecision):
    """Fabric precision plugin of the FSDP2 job: BF16 baseline, or MXFP8 / HiF8 GEMMs.

    Use with :class:`~lp_lightning.lightning.strategy.FSDP2FabricStrategy`::

        fabric = Fabric(strategy=FSDP2FabricStrategy(), plugins=[LowPrecisionFabricPlugin("mxfp8")])

    Args:
        precision: ``"bf16"`` (no low-precision GEMM, the design spec's baseline), ``"mxfp8"``
            (``mxfp8_e4m3`` + ``mx_block``) or ``"hif8"`` (``hif8`` + ``current``).
        skip_nonfinite_steps: Skip ``optimizer.step()`` (and the refresh) when the total gradient
            norm is NaN/Inf; see the module docstring. ``False`` steps unconditionally.
        backend: The op backend of the low-precision GEMMs: ``"auto"`` (``npu`` on the npu
            accelerator, ``emulated`` elsewhere), ``"emulated"`` or ``"npu"``; chosen and checked by
            the startup gate (:meth:`startup_gate`, ``lp_lightning.ops.gate``). Unused in ``bf16``.
        plan_rules: Replacement rules (``lp_lightning.plan.ReplacementRule``) or the path of a
            ``plan_overrides`` YAML (``configs/plan_deepseek_v3.yaml``); ``None`` uses the model
            adapter's ``default_replacement_rules`` of the model's config
            (:class:`~lp_lightning.models.adapter.ModelAdapter`). Ignored in ``bf16``.
        max_consecutive_skips: Stop the run after this many skipped steps in a row (``0``: no
            limit); see :class:`~lp_lightning.lightning.nonfinite.NonFiniteGuard`.

    Attributes:
        mode: The ``precision`` string.
        policy: The read-only :class:`~lp_lightning.policy.LowPrecisionPolicy` of ``mode``.
        optimizer_steps_applied: ``optimizer.step()`` calls that completed (restored on resume).
        optimizer_steps_skipped: Steps skipped for a non-finite gradient norm (restored on resume).
        guard: The :class:`~lp_lightning.lightning.nonfinite.NonFiniteGuard` (skip streak,
            ``events`` per skipped step, the ``stop`` error); its ``consecutive_skips`` is restored
            on resume.
        last_step_applied: Whether the last ``optimizer_step`` call stepped the optimizer.
        replacement_report: The plan's ``ReplacementReport`` after :meth:`convert_module`
            (``None`` in ``bf16`` or before conversion).
        low_precision_weights: FQNs of the parameters turned into low-precision weights.
        refreshes: Low-precision refresh calls by reason: ``{"startup": n, "step": n, "resume": n}``
            (each call rebuilds every weight once).

    Raises:
        ValueError: ``precision`` is not one of :data:`SUPPORTED_PRECISIONS`, or
            ``max_consecutive_skips`` is negative.
    """

    precision = "bf16-mixed"

    def __init__(
        self,
        precision: PrecisionMode = "bf16",
        *,
        skip_nonfinite_steps: bool = True,
        backend: BackendChoice = "auto",
        plan_rules: Sequence[ReplacementRule] | str | None = None,
        max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
    ) -> None:
        if backend not in BACKEND_CHOICES:
            raise ValueError(f"backend={backend!r} is not an op backend; choose one of {list(BACKEND_CHOICES)}.")
        if precision not in SUPPORTED_PRECISIONS:
            raise ValueError(
                f"precision={precision!r} is not supported; choose one of {list(SUPPORTED_PRECISIONS)} "
                f"(bf16 = no low-precision GEMM, mxfp8 = mxfp8_e4m3+mx_block, hif8 = hif8+current)."
            )
        if not isinstance(skip_nonfinite_steps, bool):
            raise TypeError(f"skip_nonfinite_steps must be a bool, got {skip_nonfinite_steps!r}.")
        self.mode: str = precision
        self.low_precision_config: LowPrecisionConfig = LowPrecisionConfig.from_precision(precision)
        self.policy: LowPrecisionPolicy = self.low_precision_config.to_policy()
        self.skip_nonfinite_steps = skip_nonfinite_steps
        self.requested_backend: str = backend
        self.gate_result: StartupGateResult | None = None
        self._gate_done = False
        self._backend_before_gate: str | None = None
        self.plan_rules = plan_rules
        self.optimizer_steps_applied: int = 0
        self.optimizer_steps_skipped: int = 0
        self.guard = NonFiniteGuard(max_consecutive_skips)
        self.last_step_applied: bool = False
        self.replacement_report: ReplacementReport | None = None
        self.low_precision_weights: tuple[str, ...] = ()
        self.refreshes: dict[str, int] = {"startup": 0, "step": 0, "resume": 0}
        self._gather_policy: Any = None  # GatherPolicy once a strategy called configure_sharding
        self._device: torch.device | None = None

    # -- what the run reports ----------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """Op backend of the low-precision GEMMs: ``"none"`` (``bf16``), ``"emulated"`` or ``"npu"``.

        The startup gate's choice once it ran (:meth:`startup_gate`); before that (a plugin used
        without the FSDP2 strategies) resolved like the GEMM entry points do
        (``lp_lightning.ops.resolve_backend`` for the policy's format on the model's device).
        Printed at startup and conversion and recorded in ``run_summary.json``; the GEMM trace
        events carry the backend that actually ran each GEMM (``kernels``).
        """
        if not self.policy.enabled:
            return "none"
        if self.gate_result is not None:
            return self.gate_result.backend
        from lp_lightning.ops import resolve_backend

        return resolve_backend(
            self.policy.format, self._device or torch.device("cpu"), None if self.requested_backend == "auto"
            else self.requested_backend,
        )

    def startup_gate(self, device_type: str) -> StartupGateResult | None:
        """Run the startup gate once, before the model is built (design spec §15 rows 1–3).

        Chooses the op backend (``backend``, ``lp_lightning.ops.gate``), runs its checks, prints the
        result (rank zero) and selects the backend for this process until :meth:`teardown`. The
        strategies call it first thing in ``setup_environment``.

        Args:
            device_type: The accelerator's device type (``"npu"`` for the npu accelerator).

        Returns:
            The gate's result (kept in :attr:`gate_result`); ``None`` in ``bf16`` off the npu
            accelerator, where no check applies.

        Raises:
            lp_lightning.ops.gate.StartupGateError: a check failed (printed first, with every check).
        """
        if self._gate_done:
            return self.gate_result
        if not self.policy.enabled and device_type != "npu":  # bf16 off NPU: no check applies, nothing imported
            self._gate_done = True
            return None
        from lp_lightning.ops import get_backend, set_backend
        from lp_lightning.ops.gate import StartupGateError, run_startup_gate

        try:
            result = run_startup_gate(
                self.policy.format if self.policy.enabled else None, device_type=device_type,
                backend=self.requested_backend,
            )
        except StartupGateError as err:
            rank_zero_only(print)(err.result.describe(), file=sys.stderr)  # every check, then the error
            raise
        rank_zero_info(result.describe())
        if self.policy.enabled:
            self._backend_before_gate = get_backend()
            set_backend(result.backend)
        self.gate_result, self._gate_done = result, True
        return result

    @override
    def teardown(self) -> None:
        """Restores the process's op backend selection of before :meth:`startup_gate`."""
        if self._backend_before_gate is not None:
            from lp_lightning.ops import set_backend

            set_backend(self._backend_before_gate)
            self._backend_before_gate = None
        super().teardown()

    def fsdp_mixed_precision_policy(self) -> MixedPrecisionPolicy:
        """The FSDP2 policy the strategy shards with.

        Returns:
            ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``: FP32
            master shards, BF16 all-gathered plain weights (the low-precision weights travel as
            their 8-bit payloads and take ``param_dtype`` only as logical dtype), FP32 gradient
            reduce-scatter.
        """
        return default_mixed_precision_policy()

    # -- conversion (before fully_shard) -----------------------------------------------------------
    def configure_sharding(self, *, reshard_after_forward: bool, activation_checkpoint: str) -> None:
        """Tell the plugin how the strategy will shard, before :meth:`convert_module` runs.

        The MXFP8 weights need it at finalize time: FSDP2 sizes each weight's all-gather buffers
        once, so whether a gather carries one orientation or both is fixed per run
        (:func:`~lp_lightning.integration.gather_policy_for`). After this call
        ``convert_module`` leaves the storage unbuilt (``build=False``): ``fully_shard`` replaces
        every parameter by a fresh shard that the strategy's refresh builds.

        Args:
            reshard_after_forward: ``fsdp_config.reshard_after_forward``.
            activation_checkpoint: ``"off"`` or ``"full"``.

        Raises:
            RuntimeError: The module was already converted (the gather policy is baked in).
            ValueError: ``activation_checkpoint`` is neither ``"off"`` nor ``"full"``.
        """
        if activation_checkpoint not in ("off", "full"):
            raise ValueError(f"activation_checkpoint must be 'off' or 'full', got {activation_checkpoint!r}.")
        if not self.policy.enabled:
            return
        if self.replacement_report is not None:
            raise RuntimeError(
                "configure_sharding must run before convert_module: the MXFP8 gather policy is fixed when the "
                "low-precision weights are finalized."
            )
        from lp_lightning.integration import gather_policy_for

        self._gather_policy = gather_policy_for(
            reshard_after_forward=reshard_after_forward, activation_checkpoint=activation_checkpoint
        )

    def _rules(self, adapter: ModelAdapter, config: Any) -> Sequence[ReplacementRule]:
        from lp_lightning import plan

        if self.plan_rules is None:
            return adapter.default_replacement_rules(config)
        if isinstance(self.plan_rules, str):
            return plan.load_rules(self.plan_rules)
        return tuple(self.plan_rules)

    def compile_plan(self, meta: nn.Module) -> ModuleReplacementPlan:
        """This run's replacement plan compiled on a structure-only model (design spec §5, §12.1 step 3).

        What :meth:`convert_module` applies, and what ``lp-lightning fit`` compiles once at launch on
        the meta model of its config (design spec §15: zero hits, wrong types and rule conflicts fail
        there, before any process starts).

        Args:
            meta: The model's meta twin (its adapter's ``build_meta_model``/``build_meta_twin``), or any
                model with the same module tree.

        Returns:
            The compiled plan (empty when the policy is disabled).

        Raises:
            TypeError, ValueError, ImportError: from :func:`~lp_lightning.plan.compile_plan` (a rule
                with zero hits, a module of the wrong type, two rules on one module, ...), when no
                model adapter describes ``meta``, or (ValueError) when a low-precision plan replaces
                no module at all (e.g. ``plan_overrides: []``).
        """
        from lp_lightning.models.adapter import adapter_for
        from lp_lightning.plan import compile_plan

        adapter = adapter_for(meta)
        causal_lm = adapter.causal_lm(meta)
        plan = compile_plan(
            causal_lm,
            self._rules(adapter, causal_lm.config),
            self.policy,
            never_replace=adapter.never_replace,
            glob_hint=adapter.glob_hint,
        )
        if self.policy.enabled and not plan.entries:  # no 8-bit GEMM at all, although one was asked for
            raise ValueError(
                f"the replacement plan replaces no module, so precision={self.mode!r} would run every GEMM in "
                "BF16; remove plan_overrides (the model's default targets) or list target FQNs in it."
            )
        return plan

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Replace the planned modules and finalize their weights; the strategy calls it before sharding.

        Steps (design spec §5, §12.1): find the model's adapter
        (:func:`~lp_lightning.models.adapter.adapter_for`), build its meta twin (structure only, no
        memory), ``compile_plan`` on it with the adapter's default rules (or :attr:`plan_rules`) and
        never-replace rules, ``plan.apply`` on ``module`` (atomic: all or nothing),
        then ``finalize_low_precision_weights`` (FP32 masters, gather policy of
        :meth:`configure_sharding`; storage built only when no strategy configured sharding).
        The report is kept in :attr:`replacement_report` and logged.

        Args:
            module: The plain, HF-initialised causal LM (or a wrapper holding it at ``.model``),
                identical on every rank, not yet sharded.

        Returns:
            ``module`` (replacement happens in place; the object identity is kept).

        Raises:
            TypeError, ValueError: From the plan (zero-hit rule, double match, subclassed Linear;
                the model is untouched then) or from finalize (sharded or meta parameters); a
                ``TypeError`` when no model adapter describes ``module``.
        """
        if not self.policy.enabled:
            return module
        from lp_lightning import integration as lp_weight
        from lp_lightning.models.adapter import adapter_for

        adapter = adapter_for(module)
        causal_lm = adapter.causal_lm(module)
        if self.replacement_report is not None:
            if any(True for _ in lp_weight.iter_low_precision_weights(causal_lm)):
                raise RuntimeError(
                    f"{type(self).__name__}.convert_module ran twice on {type(causal_lm).__name__}: it is already "
                    "converted; pass the converted model on, do not convert it again."
                )
            raise RuntimeError(
                f"{type(self).__name__} already converted another model ({len(self.low_precision_weights)} "
                f"low-precision weights); one plugin serves one model. Create a new plugin (Fabric) for this "
                f"{type(causal_lm).__name__}."
            )
        plan = self.compile_plan(adapter.build_meta_twin(causal_lm))
        report = plan.apply(causal_lm)
        sharded_later = self._gather_policy is not None
        records = lp_weight.finalize_low_precision_weights(
            causal_lm,
            recipe=self.policy,
            gather_policy=self._gather_policy if sharded_later else lp_weight.GatherPolicy(),
            master_dtype=torch.float32,
            build=not sharded_later,
        )
        self.replacement_report = report
        self.low_precision_weights = tuple(r.fqn for r in records)
        self._device = next(causal_lm.parameters()).device
        log.info("%s\n%d low-precision weights finalized (FP32 masters)", report.format(), len(records))
        backend = self.backend  # resolved now: an NPU device whose capability check fails stops here
        rank_zero_info(
            f"lp-lightning: {self.mode} on {len(records)} weights, op backend {backend!r} "
            f"(device {self._device.type}{', exact software emulation' if backend == 'emulated' else ''})."
        )
        return module

    def note_startup_refresh(self) -> None:
        """Counts the refresh the strategy runs once after ``fully_shard`` (builds every shard)."""
        self.refreshes["startup"] += 1

    def rebuild_after_load(self, module: nn.Module) -> None:
        """Rebuild every low-precision weight from the FP32 masters a checkpoint load restored (design spec §11).

        Called by the strategies right after the DCP load, on every rank (HiF8 dense weights
        MAX-reduce their amax over the shard group). No-op in ``bf16``.

        Args:
            module: The sharded causal LM (or a wrapper holding it).
        """
        if not self.policy.enabled:
            return
        from lp_lightning.integration import refresh_low_precision_weights
        from lp_lightning.models.adapter import adapter_for

        refresh_low_precision_weights(adapter_for(module).causal_lm(module).parameters())
        self.refreshes["resume"] += 1

    # -- optimizer step ----------------------------------------------------------------------------
    @staticmethod
    def _optimizer_params(optimizer: Any) -> list[torch.Tensor]:
        return [p for group in optimizer.param_groups for p in group["params"]]

    @property
    def _step_index(self) -> int:
        return self.optimizer_steps_applied + self.optimizer_steps_skipped

    def _step_and_refresh(self, optimizer: Any, **kwargs: Any) -> Any:
        """Finite check, ``optimizer.step(**kwargs)``, refresh, master check. Returns what ``optimizer.step`` returned.

        Raises:
            NonFiniteStateError: The guard stops the run (module docstring), on every rank alike.
        """
        params = self._optimizer_params(optimizer)
        with_grad = [p for p in params if p.grad is not None]
        if not with_grad:
            self.last_step_applied = False
            return None
        if self.skip_nonfinite_steps:
            norm = total_grad_norm(with_grad)
            if not bool(torch.isfinite(norm)):
                self.optimizer_steps_skipped += 1
                self.last_step_applied = False
                self.guard.skipped(params, step=self._step_index, norm=float(norm), low_precision=self.policy.enabled)
                return None
        out = optimizer.step(**kwargs)
        self.optimizer_steps_applied += 1
        self.last_step_applied = True
        refreshed_amax: tuple[torch.Tensor, ...] = ()
        if self.policy.enabled:
            from lp_lightning.integration import refresh_low_precision_weights

            refreshed_amax = refresh_low_precision_weights(params).master_amax
            self.refreshes["step"] += 1
        self.guard.applied(params, step=self._step_index, low_precision=self.policy.enabled,
                           refreshed_amax=refreshed_amax)
        return out

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """Checks the gradients, runs ``optimizer.step(**kwargs)`` and refreshes the low-precision weights.

        Fabric calls it after the user's ``fabric.backward``; see the module docstring for the
        skip rules. The refresh covers every parameter of ``optimizer`` once (design spec §10).

        Returns:
            What ``optimizer.step`` returned (``None`` when the step was skipped).
        """
        return self._step_and_refresh(optimizer, **kwargs)

    # -- checkpoint state --------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        """``{"mode", "optimizer_steps_applied", "optimizer_steps_skipped", "consecutive_skips"}`` (``meta.pt``)."""
        return {
            "mode": self.mode,
            "optimizer_steps_applied": self.optimizer_steps_applied,
            "optimizer_steps_skipped": self.optimizer_steps_skipped,
            "consecutive_skips": self.guard.consecutive_skips,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the step counters; a checkpoint of another precision resumes with a log line.

        The checkpoint holds only high-precision state (FP32 masters and moments, design spec §11), so a
        run written in ``mxfp8`` resumes in ``hif8`` or ``bf16`` (and back): the low-precision
        storage is rebuilt from the restored masters in this run's format.
        """
        mode = state_dict.get("mode", self.mode)
        if mode != self.mode:
            rebuilt = (
                "no low-precision weight is built (bf16 GEMMs)"
                if self.mode == "bf16"
                else f"the low-precision weights are rebuilt from them in {self.mode}"
            )
            rank_zero_warn(
                f"resuming a checkpoint trained with precision={mode!r} in precision={self.mode!r}: the FP32 "
                f"masters and AdamW state are restored and {rebuilt}."
            )
        self.optimizer_steps_applied = int(state_dict.get("optimizer_steps_applied", 0))
        self.optimizer_steps_skipped = int(state_dict.get("optimizer_steps_skipped", 0))
        self.guard.consecutive_skips = int(state_dict.get("consecutive_skips", 0))  # a skip streak spans a resume


class LowPrecisionPlugin(Precision, LowPrecisionFabricPlugin):
    """Trainer twin of :class:`LowPrecisionFabricPlugin` (same arguments and hooks).

    Use with :class:`~lp_lightning.lightning.strategy.FSDP2Strategy`::

        Trainer(strategy=FSDP2Strategy(), plugins=[LowPrecisionPlugin("hif8")])

    Only ``optimizer_step`` differs from the Fabric plugin, because the Trainer passes the
    training closure: the plugin runs it (forward, backward, ``on_before_optimizer_step``, gradient
    clipping) *before* deciding whether to call ``optimizer.step()``, exactly as Lightning's AMP
    plugin does, so a non-finite step never reaches the optimizer.

    Args:
        precision: ``"bf16"``, ``"mxfp8"`` or ``"hif8"``.
        skip_nonfinite_steps, backend, plan_rules, max_consecutive_skips: See
            :class:`LowPrecisionFabricPlugin`.
    """

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Any, **kwargs: Any
    ) -> Any:
        """Runs the closure, then the checked optimizer step and the refresh (module docstring).

        Returns:
            The closure's loss (``None`` when ``training_step`` skipped the batch).
        """
        loss = self._wrap_closure(model, optimizer, closure)
        self._step_and_refresh(optimizer, **kwargs)
        return loss
