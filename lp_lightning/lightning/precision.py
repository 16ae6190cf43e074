"""Precision plugins of the FSDP2 job and the one factory that picks them (docs/architecture.md "The precision choice").

:func:`precision_plugin` turns ``--precision`` into a plugin:

=========  ===============================================  ==============================================
precision  Trainer / Fabric plugin                          module
=========  ===============================================  ==============================================
``bf16``   :class:`BF16Plugin` / :class:`BF16FabricPlugin`  this one: imports nothing low-precision
``mxfp8``  ``LowPrecisionPlugin`` / ``LowPrecisionFabric``  :mod:`lp_lightning.lightning.low_precision`
``hif8``   ``Plugin`` (same classes)                        (imports the low-precision stack)
=========  ===============================================  ==============================================

Every plugin does precision only: the FSDP2 mixed-precision policy, module conversion (low
precision: the replacement plan, FP32 masters) and the checked optimizer step. The parts it calls
are their own objects, read by the callbacks as typed attributes: :class:`StepCounters`
(:attr:`~FSDP2PrecisionPlugin.counters`), :class:`~lp_lightning.lightning.nonfinite.NonFiniteGuard`
(:attr:`~FSDP2PrecisionPlugin.guard`), :class:`BackendGate` (:attr:`~FSDP2PrecisionPlugin.gate`),
:class:`~lp_lightning.lightning.preemption.StopRequest` (:attr:`~FSDP2PrecisionPlugin.stop`) and,
in low precision, the FSDP2 lifecycle (:attr:`~FSDP2PrecisionPlugin.lifecycle`, a
:class:`~lp_lightning.fsdp.lifecycle.LowPrecisionLifecycle`) that the strategy hands to
``parallelize_causal_lm``.

Skipped steps. With ``skip_nonfinite_steps=True`` (default, all precisions) the plugin computes the
total gradient norm over the optimizer's parameters after the training closure (after Lightning's
gradient clipping; a NaN/Inf norm stays non-finite through clipping). A non-finite norm skips
``optimizer.step()`` and the low-precision refresh (R8), logs a warning, counts the step in
``counters.skipped`` and tells the guard, which diagnoses it and stops the run after
``max_consecutive_skips`` skips in a row or at once for a NaN/Inf master (docs/architecture.md
"The non-finite guard and verified checkpoints"). Lightning still advances ``global_step`` and
the LR scheduler, as for a step skipped by AMP's grad scaler. A step whose parameters have no
gradient at all is a no-op.

Stop signals. The guard's MAX-reduce of every optimizer step (applied or skipped) also carries this
rank's stop signal (:attr:`~FSDP2PrecisionPlugin.stop`), so every rank learns a SIGTERM, SIGUSR1 or
SIGINT sent to any of them at the same step, without a collective of its own
(:mod:`lp_lightning.lightning.preemption`).

Plugins are passed to Lightning as instances (``plugins=[precision_plugin("mxfp8")]``), which
bypasses the built-in precision strings of Lightning's connector. There is no autocast: FSDP2's
``MixedPrecisionPolicy`` casts the gathered plain weights to BF16, the low-precision weights are
gathered as 8-bit payloads, and HF modules keep the activations in the weights' dtype.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins import Precision as FabricPrecision
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from typing_extensions import override

from lp_lightning.config import check_activation_checkpoint
from lp_lightning.fsdp.parallelize import default_mixed_precision_policy, total_grad_norm
from lp_lightning.lightning.nonfinite import DEFAULT_MAX_CONSECUTIVE_SKIPS, NonFiniteGuard
from lp_lightning.lightning.preemption import StopRequest
from lp_lightning.policy import LowPrecisionPolicy, PrecisionName

if TYPE_CHECKING:
    from lp_lightning.fsdp.lifecycle import LowPrecisionLifecycle
    from lp_lightning.ops.gate import StartupGateResult
    from lp_lightning.plan import ReplacementReport

__all__ = [
    "BACKEND_CHOICES",
    "SUPPORTED_PRECISIONS",
    "BF16FabricPlugin",
    "BF16Plugin",
    "BackendChoice",
    "BackendGate",
    "FSDP2PrecisionPlugin",
    "PrecisionMode",
    "StepCounters",
    "precision_plugin",
]

PrecisionMode = Literal["bf16", "mxfp8", "hif8"]
"""Values of ``--precision`` (see :class:`~lp_lightning.policy.PrecisionName`)."""

SUPPORTED_PRECISIONS: tuple[str, ...] = tuple(p.value for p in PrecisionName)
"""Runtime form of :data:`PrecisionMode`: ``("bf16", "mxfp8", "hif8")``."""

BackendChoice = Literal["auto", "emulated", "npu"]
"""Values of ``--backend`` (``lp_lightning.ops.gate``: ``auto`` = ``npu`` on the npu accelerator, else
``emulated``)."""

BACKEND_CHOICES: tuple[str, ...] = ("auto", "emulated", "npu")
"""Runtime form of :data:`BackendChoice` (tested equal to ``"auto"`` + the registered op backends)."""


def check_precision(precision: object) -> str:
    """``precision`` if it is one of :data:`SUPPORTED_PRECISIONS`.

    Raises:
        ValueError: naming the choices.
    """
    if precision not in SUPPORTED_PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not supported; choose one of {list(SUPPORTED_PRECISIONS)} "
            f"(bf16 = no low-precision GEMM, mxfp8 = mxfp8_e4m3+mx_block, hif8 = hif8+current)."
        )
    return str(precision)


@dataclass
class StepCounters:
    """Optimizer steps of the run (restored on resume from the plugin's ``meta.pt`` state).

    Attributes:
        applied: ``optimizer.step()`` calls that completed.
        skipped: Steps skipped for a non-finite gradient norm.
        last_applied: Whether the last optimizer step stepped the optimizer.
    """

    applied: int = 0
    skipped: int = 0
    last_applied: bool = False

    @property
    def index(self) -> int:
        """The 1-based number of the step being finished (skipped ones counted, as ``global_step``)."""
        return self.applied + self.skipped


class BackendGate:
    """The startup gate of a run, once per process (design spec §15 rows 1–3; ``lp_lightning.ops.gate``).

    Args:
        requested: The ``backend`` setting: ``"auto"`` (``npu`` on the npu accelerator, ``emulated``
            elsewhere), ``"emulated"`` or ``"npu"``.

    Attributes:
        requested: As given.
        result: The gate's ``StartupGateResult`` once it ran (``None`` before, and in ``bf16`` off
            the npu accelerator, where no check applies).

    Raises:
        ValueError: ``requested`` is not one of :data:`BACKEND_CHOICES`.
    """

    def __init__(self, requested: str = "auto") -> None:
        if requested not in BACKEND_CHOICES:
            raise ValueError(f"backend={requested!r} is not an op backend; choose one of {list(BACKEND_CHOICES)}.")
        self.requested = requested
        self.result: StartupGateResult | None = None
        self._done = False

    def run(self, format_name: str | None, device_type: str) -> StartupGateResult | None:
        """Runs the checks of the chosen backend for ``format_name`` (``None``: bf16) and prints them (rank 0).

        Raises:
            lp_lightning.ops.gate.StartupGateError: a check failed (printed first, with every check).
        """
        if self._done:
            return self.result
        self._done = True
        if format_name is None and device_type != "npu":  # bf16 off NPU: nothing to check, nothing imported
            return None
        # Imported here: a bf16 run reaches the gate (and lp_lightning.ops) only on the npu accelerator.
        from lp_lightning.ops.gate import StartupGateError, run_startup_gate

        try:
            self.result = run_startup_gate(format_name, device_type=device_type, backend=self.requested)
        except StartupGateError as err:
            rank_zero_only(print)(err.result.describe(), file=sys.stderr)  # every check, then the error
            raise
        rank_zero_info(self.result.describe())
        return self.result


class FSDP2PrecisionPlugin(FabricPrecision):
    """What every precision plugin of the FSDP2 strategies offers; its own behaviour is the BF16 baseline.

    Args:
        skip_nonfinite_steps: Skip ``optimizer.step()`` (and the refresh) when the total gradient
            norm is NaN/Inf (module docstring); ``False`` steps unconditionally.
        backend: The op backend setting (:class:`BackendGate`); unused in ``bf16`` off the npu accelerator.
        max_consecutive_skips: Stop after this many skipped steps in a row (``0``: no limit).

    Attributes:
        mode: The ``--precision`` value.
        policy: The run's read-only :class:`~lp_lightning.policy.LowPrecisionPolicy` (disabled in ``bf16``).
        counters: The :class:`StepCounters`.
        guard: The :class:`~lp_lightning.lightning.nonfinite.NonFiniteGuard`.
        gate: The :class:`BackendGate`.
        stop: The :class:`~lp_lightning.lightning.preemption.StopRequest` (exchanged in the guard's reduce).
        lifecycle: The low-precision FSDP2 lifecycle the strategy passes to ``parallelize_causal_lm``
            (a :class:`~lp_lightning.fsdp.lifecycle.LowPrecisionLifecycle`); ``None`` in ``bf16``.

    Raises:
        ValueError: ``backend`` or ``max_consecutive_skips`` is invalid; TypeError: ``skip_nonfinite_steps``
            is not a bool.
    """

    precision = "bf16-mixed"
    mode: str = "bf16"

    def __init__(
        self,
        *,
        skip_nonfinite_steps: bool = True,
        backend: BackendChoice = "auto",
        max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
    ) -> None:
        if not isinstance(skip_nonfinite_steps, bool):
            raise TypeError(f"skip_nonfinite_steps must be a bool, got {skip_nonfinite_steps!r}.")
        self.gate = BackendGate(backend)
        self.skip_nonfinite_steps = skip_nonfinite_steps
        self.guard = NonFiniteGuard(max_consecutive_skips)
        self.counters = StepCounters()
        self.stop = StopRequest()
        self.policy: LowPrecisionPolicy = LowPrecisionPolicy.disabled()
        self.lifecycle: LowPrecisionLifecycle | None = None

    # -- what the run reports (typed, read by the callbacks) ---------------------------------------
    @property
    def backend(self) -> str:
        """Op backend of the low-precision GEMMs: ``"none"`` in ``bf16``."""
        return "none"

    @property
    def gate_result(self) -> StartupGateResult | None:
        """The startup gate's result (``None`` before it ran or where no check applies)."""
        return self.gate.result

    @property
    def replacement_report(self) -> ReplacementReport | None:
        """The plan's report after conversion (``None`` in ``bf16``)."""
        return None

    @property
    def low_precision_weights(self) -> tuple[str, ...]:
        """FQNs of the parameters turned into low-precision weights (none in ``bf16``)."""
        return ()

    @property
    def low_precision_elements(self) -> int:
        """Elements of the low-precision weights (their logical shapes; 0 in ``bf16``)."""
        return 0

    @property
    def weights_summary(self) -> str:
        """The low-precision weights and the modules holding them, in the words every message uses
        (``"25 low-precision weights in 23 modules"``; ``"no low-precision weight"`` in ``bf16``)."""
        report = self.replacement_report
        weights = len(self.low_precision_weights)
        if not weights:
            return "no low-precision weight"
        modules = "?" if report is None else report.num_replaced
        return f"{weights} low-precision weight{'s' if weights != 1 else ''} in {modules} module{'s' if modules != 1 else ''}"

    @property
    def refreshes(self) -> dict[str, int]:
        """Low-precision refresh calls by reason ``{"startup", "step", "resume"}`` (all 0 in ``bf16``)."""
        return {"startup": 0, "step": 0, "resume": 0}

    @property
    def optimizer_steps_applied(self) -> int:
        """``counters.applied``."""
        return self.counters.applied

    @optimizer_steps_applied.setter
    def optimizer_steps_applied(self, value: int) -> None:
        self.counters.applied = value

    @property
    def optimizer_steps_skipped(self) -> int:
        """``counters.skipped``."""
        return self.counters.skipped

    @optimizer_steps_skipped.setter
    def optimizer_steps_skipped(self, value: int) -> None:
        self.counters.skipped = value

    @property
    def last_step_applied(self) -> bool:
        """``counters.last_applied``."""
        return self.counters.last_applied

    # -- the strategy's hooks (design spec §12.1 order) --------------------------------------------
    def startup_gate(self, device_type: str) -> StartupGateResult | None:
        """Runs :attr:`gate` once, before the process group and the model exist (the strategies call it first).

        Args:
            device_type: The accelerator's device type (``"npu"`` for the npu accelerator).
        """
        return self.gate.run(None, device_type)

    def fsdp_mixed_precision_policy(self) -> MixedPrecisionPolicy:
        """``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: FP32 master shards, BF16
        all-gathered plain weights (low-precision weights travel as 8-bit payloads), FP32 reduce-scatter."""
        return default_mixed_precision_policy()

    def configure_sharding(self, *, reshard_after_forward: bool, activation_checkpoint: str) -> None:
        """Tells the plugin how the strategy will shard, before :meth:`convert_module` (nothing to do in ``bf16``).

        Raises:
            ValueError: ``activation_checkpoint`` is neither ``"off"`` nor ``"full"``.
        """
        check_activation_checkpoint(activation_checkpoint)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Returns ``module`` untouched: ``bf16`` replaces nothing (design spec §13.1, R3)."""
        return module

    def rebuild_after_load(self, module: nn.Module) -> None:
        """Rebuilds the low-precision weights after a DCP load restored the FP32 masters (none in ``bf16``)."""

    # -- optimizer step ----------------------------------------------------------------------------
    def _after_applied_step(self, params: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """What follows an applied ``optimizer.step()`` (low precision: the refresh); returns the refresh's amax."""
        return ()

    def _step_and_refresh(self, optimizer: Any, **kwargs: Any) -> Any:
        """Finite check, ``optimizer.step(**kwargs)``, refresh, master check. Returns what ``optimizer.step`` returned.

        The guard's reduce (master check, or the diagnosis of a skipped step) carries :attr:`stop`.

        Raises:
            NonFiniteStateError: The guard stops the run (module docstring), on every rank alike.
        """
        params = [p for group in optimizer.param_groups for p in group["params"]]
        with_grad = [p for p in params if p.grad is not None]
        counters = self.counters
        local_weight = None if self.lifecycle is None else self.lifecycle.local_weight
        if not with_grad:
            counters.last_applied = False
            return None
        if self.skip_nonfinite_steps:
            norm = total_grad_norm(with_grad)
            if not bool(torch.isfinite(norm)):
                counters.skipped += 1
                counters.last_applied = False
                stop = self.stop.flags()
                self.guard.skipped(params, step=counters.index, norm=float(norm), local_weight=local_weight, riders=stop)
                self.stop.agree(stop)
                return None
        out = optimizer.step(**kwargs)
        counters.applied += 1
        counters.last_applied = True
        refreshed_amax = self._after_applied_step(params)
        stop = self.stop.flags()
        self.guard.applied(params, step=counters.index, local_weight=local_weight, refreshed_amax=refreshed_amax,
                           riders=stop)
        self.stop.agree(stop)
        return out

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """Checks the gradients, runs ``optimizer.step(**kwargs)`` and refreshes the low-precision weights.

        Fabric calls it after the user's ``fabric.backward``; see the module docstring for the skip rules.

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
            "optimizer_steps_applied": self.counters.applied,
            "optimizer_steps_skipped": self.counters.skipped,
            "consecutive_skips": self.guard.consecutive_skips,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the step counters; a checkpoint of another precision resumes with a log line.

        The checkpoint holds only high-precision state (FP32 masters and moments, design spec §11), so a
        run written in ``mxfp8`` resumes in ``hif8`` or ``bf16`` (and back): the low-precision storage
        is rebuilt from the restored masters in this run's format.
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
        self.counters.applied = int(state_dict.get("optimizer_steps_applied", 0))
        self.counters.skipped = int(state_dict.get("optimizer_steps_skipped", 0))
        self.guard.consecutive_skips = int(state_dict.get("consecutive_skips", 0))  # a skip streak spans a resume


TRAINER_PLUGIN_STATE_KEYS: tuple[str, ...] = ("BF16Plugin", "LowPrecisionPlugin")
"""The keys under which Lightning saves the Trainer plugins' state in a checkpoint (their class names)."""


class TrainerStep:
    """What the Trainer twins add: ``optimizer_step`` with the training closure, and cross-precision resume.

    The plugin runs the closure (forward, backward, ``on_before_optimizer_step``, gradient clipping)
    *before* deciding whether to call ``optimizer.step()``, exactly as Lightning's AMP plugin does, so
    a non-finite step never reaches the optimizer. Mixed into the Trainer twins before Lightning's
    ``Precision``.
    """

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restores the counters from a checkpoint written by the other Trainer plugin (bf16 <-> mxfp8/hif8).

        Lightning keys a precision plugin's state by its class name and restores it only under the
        same name, so a run resumed in another precision would silently start its step counters and
        skip streak from zero. Under this plugin's own name Lightning restores it itself.
        """
        if type(self).__qualname__ in checkpoint:
            return
        state = next((checkpoint[key] for key in TRAINER_PLUGIN_STATE_KEYS if key in checkpoint), None)
        if state is not None:
            self.load_state_dict(state)  # type: ignore[attr-defined]

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Runs the closure, then the checked optimizer step and the refresh.

        Returns:
            The closure's loss (``None`` when ``training_step`` skipped the batch).
        """
        loss = self._wrap_closure(model, optimizer, closure)  # type: ignore[attr-defined]
        self._step_and_refresh(optimizer, **kwargs)  # type: ignore[attr-defined]
        return loss


class BF16FabricPlugin(FSDP2PrecisionPlugin):
    """Fabric precision plugin of the BF16 baseline (no low-precision GEMM; imports nothing low-precision).

    Use with :class:`~lp_lightning.lightning.strategy.FSDP2FabricStrategy`::

        fabric = Fabric(strategy=FSDP2FabricStrategy(), plugins=[BF16FabricPlugin()])

    Args: see :class:`FSDP2PrecisionPlugin`.
    """


class BF16Plugin(TrainerStep, Precision, BF16FabricPlugin):
    """Trainer twin of :class:`BF16FabricPlugin` (same arguments)."""


def precision_plugin(precision: PrecisionMode = "bf16", *, trainer: bool = True, **kwargs: Any) -> FSDP2PrecisionPlugin:
    """The precision plugin of ``precision`` (the one factory; module docstring).

    Args:
        precision: ``"bf16"``, ``"mxfp8"`` or ``"hif8"``.
        trainer: The Trainer twin (``True``) or the Fabric plugin.
        **kwargs: The plugin's keyword arguments (``skip_nonfinite_steps``, ``backend``,
            ``max_consecutive_skips``; low precision also ``plan_rules``).

    Raises:
        ValueError: ``precision`` is not one of :data:`SUPPORTED_PRECISIONS`, ``plan_rules`` given with
            ``bf16``, or a bad argument.
    """
    if check_precision(precision) == "bf16":
        if kwargs.pop("plan_rules", None) is not None:
            raise ValueError(
                "precision='bf16' replaces no module, so plan_rules does not apply; drop plan_rules (or "
                "plan_overrides), or choose precision 'mxfp8' or 'hif8'."
            )
        return (BF16Plugin if trainer else BF16FabricPlugin)(**kwargs)
    # Imported here: the low-precision plugin imports its whole stack, which a bf16 run never loads.
    from lp_lightning.lightning import low_precision
    cls = low_precision.LowPrecisionPlugin if trainer else low_precision.LowPrecisionFabricPlugin
    return cls(precision, **kwargs)
