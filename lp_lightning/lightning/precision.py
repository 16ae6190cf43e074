"""Precision plugins of the FSDP2 job: Fabric ``LowPrecisionFabricPlugin``, Trainer ``LowPrecisionPlugin``.

The plugin owns everything precision-specific that the strategy must not hard-code (MISSION
design card; STYLE §5.17):

* :meth:`~LowPrecisionFabricPlugin.convert_module`: module conversion, run by the strategy
  *before* ``fully_shard`` (seed §12.1). For ``bf16`` nothing is replaced (the replacement plan is
  empty and ``torch_npu`` is never imported); issue 4 applies the low-precision replacement plan
  for ``mxfp8`` / ``hif8`` here.
* :meth:`~LowPrecisionFabricPlugin.fsdp_mixed_precision_policy`: the FSDP2
  ``MixedPrecisionPolicy`` (BF16 all-gathered compute weights, FP32 gradient reduce-scatter, FP32
  master shards).
* ``optimizer_step``: runs the optimizer and records whether the step was applied
  (:attr:`~LowPrecisionFabricPlugin.last_step_applied`,
  :attr:`~LowPrecisionFabricPlugin.optimizer_steps_applied`). The low-precision weight refresh
  of seed §10 (issue 5) runs exactly there, after an applied step; in ``bf16`` there are no
  low-precision weights, so nothing is refreshed.

Plugins are passed to Lightning as instances (``plugins=[LowPrecisionPlugin("bf16")]``), which
bypasses the built-in precision strings of Lightning's connector (STYLE §5.18). There is no
autocast: FSDP2's ``MixedPrecisionPolicy`` casts the gathered weights to BF16 and HF modules
keep the activations in the weights' dtype.
"""

from __future__ import annotations

from typing import Any, Literal

from lightning.fabric.plugins import Precision as FabricPrecision
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from typing_extensions import override

from lp_lightning.distributed.fsdp import default_mixed_precision_policy

__all__ = ["SUPPORTED_PRECISIONS", "LowPrecisionFabricPlugin", "LowPrecisionPlugin", "PrecisionMode"]

PrecisionMode = Literal["bf16"]
"""Values of ``--precision`` accepted by this release (``mxfp8`` and ``hif8`` arrive in issue 4)."""

SUPPORTED_PRECISIONS: tuple[str, ...] = ("bf16",)
"""Runtime form of :data:`PrecisionMode`."""

_BACKEND_BY_PRECISION = {"bf16": "none"}


class LowPrecisionFabricPlugin(FabricPrecision):
    """Fabric precision plugin of the FSDP2 job (BF16 compute, FP32 master and reduce).

    Use with :class:`~lp_lightning.lightning.strategy.FSDP2FabricStrategy`::

        fabric = Fabric(strategy=FSDP2FabricStrategy(), plugins=[LowPrecisionFabricPlugin("bf16")])

    Args:
        precision: ``"bf16"``: no low-precision GEMM (the seed's BF16 baseline).

    Raises:
        ValueError: ``precision`` is not one of :data:`SUPPORTED_PRECISIONS`.
    """

    precision = "bf16-mixed"

    def __init__(self, precision: PrecisionMode = "bf16") -> None:
        if precision not in SUPPORTED_PRECISIONS:
            raise ValueError(
                f"precision={precision!r} is not supported; choose one of "
                f"{list(SUPPORTED_PRECISIONS)} (mxfp8 and hif8 arrive with the low-precision "
                f"issues)."
            )
        self.mode: str = precision
        self.optimizer_steps_applied: int = 0
        self.last_step_applied: bool = False

    @property
    def backend(self) -> str:
        """Op backend of the low-precision GEMMs: ``"none"`` for ``bf16`` (no such GEMM runs).

        Issue 4 reports ``"emulated"`` or ``"npu"`` here; ``run_summary.json`` copies it.
        """
        return _BACKEND_BY_PRECISION[self.mode]

    def fsdp_mixed_precision_policy(self) -> MixedPrecisionPolicy:
        """The FSDP2 policy the strategy shards with.

        Returns:
            ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``:
            FP32 master shards, BF16 all-gathered compute weights, FP32 gradient reduce-scatter.
        """
        return default_mixed_precision_policy()

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Applies this precision's module replacement; the strategy calls it before sharding.

        Args:
            module: The plain HF causal LM (identical weights on every rank, not yet sharded).

        Returns:
            ``module`` itself: in ``bf16`` no module is replaced.
        """
        return module

    def _record_step(self, applied: bool) -> None:
        self.last_step_applied = applied
        if applied:
            self.optimizer_steps_applied += 1

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """Runs ``optimizer.step(**kwargs)`` and records that the step was applied.

        In ``bf16`` there is no loss scaler that could skip a step, so every call that returns
        normally is an applied step; an exception propagates and is not counted.

        Returns:
            What ``optimizer.step`` returned.
        """
        out = super().optimizer_step(optimizer, **kwargs)
        self._record_step(applied=True)
        return out

    @override
    def state_dict(self) -> dict[str, Any]:
        """``{"mode": "bf16", "optimizer_steps_applied": n}``, stored in the checkpoint's ``meta.pt``."""
        return {"mode": self.mode, "optimizer_steps_applied": self.optimizer_steps_applied}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the step counter; refuses a checkpoint written under another precision.

        Raises:
            ValueError: The checkpoint's ``mode`` differs from this plugin's.
        """
        mode = state_dict.get("mode", self.mode)
        if mode != self.mode:
            raise ValueError(
                f"the checkpoint was trained with precision={mode!r} but this run uses "
                f"precision={self.mode!r}; resume with --precision {mode}."
            )
        self.optimizer_steps_applied = int(state_dict.get("optimizer_steps_applied", 0))


class LowPrecisionPlugin(Precision, LowPrecisionFabricPlugin):
    """Trainer twin of :class:`LowPrecisionFabricPlugin` (same arguments and hooks).

    Use with :class:`~lp_lightning.lightning.strategy.FSDP2Strategy`::

        Trainer(strategy=FSDP2Strategy(), plugins=[LowPrecisionPlugin("bf16")])

    Only ``optimizer_step`` differs from the Fabric plugin, because the Trainer passes the
    training closure: a step counts as applied when the closure produced a loss (Lightning skips
    backward, and so changes no weight, when ``training_step`` returns ``None``).

    Args:
        precision: ``"bf16"``.
    """

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Any, **kwargs: Any
    ) -> Any:
        """Runs Lightning's closure-driven optimizer step and records whether it was applied.

        Returns:
            The closure's loss (``None`` when ``training_step`` skipped the batch).
        """
        out = Precision.optimizer_step(self, optimizer, model, closure, **kwargs)
        self._record_step(applied=out is not None)
        return out

