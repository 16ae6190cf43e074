"""FSDP2 strategies: Trainer ``FSDP2Strategy`` and its Fabric twin ``FSDP2FabricStrategy``.

Both subclass Lightning's ``ModelParallelStrategy`` (2.6) and own the parallelisation of the
Hugging Face causal LM instead of leaving ``fully_shard`` to the user's ``configure_model``:

* process group: gloo on CPU, nccl on CUDA, hccl on NPU (one process = a 1-rank group, so 1- and
  N-process runs share the code path); building a strategy registers the ``"npu"`` accelerator
  when torch_npu is importable (:mod:`lp_lightning.lightning.accelerator`);
* a 1-D ``("dp_shard",)`` device mesh of ``fsdp_config.dp_shard_size`` ranks (= world size);
* :func:`~lp_lightning.fsdp.parallelize.parallelize_causal_lm` in the order of design spec §12.1: the
  precision plugin's ``configure_sharding`` and ``convert_module`` (replacement plan compiled on a
  meta twin and applied, low-precision weights finalized with FP32 masters) -> FP32 upcast (master
  shards) -> placements (Shard(0), Shard(1) or ``fsdp_config.fallback_to_unsharded``) -> ``fully_shard``
  (replicated fallback modules, FP32 routers, decoder layers, root) -> one refresh of the
  low-precision shards -> activation checkpointing -> (then Lightning creates the optimizer).
  Lightning's parent ``setup`` would call ``convert_module`` *after* the model is built and
  sharded (Lightning #19989); :meth:`FSDP2Strategy.setup` replaces it so the order is explicit
  (tested in ``tests/lightning/test_strategy.py`` and ``tests/lightning/test_low_precision.py``);
* after a checkpoint load the plugin rebuilds the low-precision weights from the restored FP32
  masters (design spec §11); each applied optimizer step refreshes them once (the plugin's
  ``optimizer_step``);
* DCP checkpoints whose model keys are the HF names and whose optimizer view is keyed by the
  same names (:mod:`lp_lightning.checkpoint.dcp`);
* the optimizer must be ``torch.optim.AdamW`` over the FP32 masters with FP32 moments, checked when
  the Trainer creates it (``configure_optimizers``) and when ``fabric.setup_optimizers`` receives it
  (:func:`~lp_lightning.fsdp.optimizer.check_optimizer`, design spec §15);
* stage events (:func:`lp_lightning.observers.stage`) on entering, or failing in, the startup gate,
  ``configure_model`` (``model_build``), ``convert_module`` (``plan_apply``), the sharding that
  follows (``fully_shard``), the optimizer check and each training step: what ``lp-lightning st``
  reads a design spec §15 stage from.

The LightningModule must hold the HF causal LM at ``.model`` (a model type with a registered
:class:`~lp_lightning.models.adapter.ModelAdapter`, which says where its decoder layers are) and may
declare ``activation_checkpoint`` (``"off"``/``"full"``; absent means
``"off"``). The precision plugin must be a
:func:`~lp_lightning.lightning.precision.precision_plugin` (``trainer=False`` for Fabric) passed as an instance.

Trainer::

    Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(FSDP2Config()),
            plugins=[precision_plugin("mxfp8")], use_distributed_sampler=False)

Fabric (set the model up first, then create the optimizer over the sharded Parameters)::

    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDP2FabricStrategy(),
                    plugins=[precision_plugin("bf16", trainer=False)])
    fabric.launch()
    model = fabric.setup_module(from_hf_config("dsv3-tiny", seed=0))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.fabric.strategies.parallel import ParallelStrategy as FabricParallelStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.fabric.utilities.types import _PATH, _Stateful
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lp_lightning.config import ActivationCheckpointMode, FSDP2Config, check_activation_checkpoint
from lp_lightning.checkpoint.dcp import load_dcp_checkpoint, model_state_dict, optimizer_state_dict, save_dcp_checkpoint
from lp_lightning.checkpoint.integrity import DamagedCheckpointError
from lp_lightning.checkpoint.resume import CLI_FALLBACK, CLI_FRESH, load_with_fallback
from lp_lightning.fsdp.parallelize import (
    ParallelizationRecord,
    build_dp_mesh,
    is_parallelized,
    parallelize_causal_lm,
    process_group_backend_for,
)
from lp_lightning.fsdp.optimizer import check_optimizer
from lp_lightning.lightning.accelerator import NPUFabricAccelerator, register_npu_accelerator
from lp_lightning.lightning.hccl import HcclDeterminism, apply_hccl_determinism
from lp_lightning.lightning.precision import TRAINER_PLUGIN_STATE_KEYS, FSDP2PrecisionPlugin
from lp_lightning.models.adapter import adapter_for
from lp_lightning.observers import notify_collective, stage

__all__ = ["OPTIMIZER_CHECKPOINT_KEY", "FSDP2FabricStrategy", "FSDP2Strategy", "model_summary_line"]

OPTIMIZER_CHECKPOINT_KEY = "optimizer"
"""DCP key prefix of the Trainer's optimizer view (``optimizer.state.<hf fqn>.exp_avg``)."""


def _require_plugin(strategy_name: str, plugin: object) -> FSDP2PrecisionPlugin:
    if not isinstance(plugin, FSDP2PrecisionPlugin):
        raise TypeError(
            f"{strategy_name} needs the lp-lightning precision plugin, got "
            f"{type(plugin).__name__}. Pass plugins=[precision_plugin('bf16')] (Trainer) or "
            f"[precision_plugin('bf16', trainer=False)] (Fabric), without `precision=`."
        )
    return plugin


def _resolve_causal_lm(module: nn.Module) -> nn.Module:
    """The HF causal LM in ``module`` (the model itself or the LightningModule holding it at ``.model``),
    found by the model's adapter (:func:`~lp_lightning.models.adapter.adapter_for`).

    Raises:
        TypeError: No model adapter describes ``module``, or it holds no causal LM.
    """
    return adapter_for(module).causal_lm(module)


def _check_materialized(module: nn.Module) -> None:
    meta = [name for name, p in module.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(
            f"{len(meta)} parameter(s) are still on the meta device (first: {meta[0]!r}); build the "
            f"model materialised (from_hf_config(..., device='cpu')) in configure_model."
        )


def _human_count(count: int) -> str:
    """``3.0 M``, ``15.7 B``: a parameter count as Lightning's model summary writes it."""
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return str(count)


def model_summary_line(causal_lm: nn.Module, plugin: FSDP2PrecisionPlugin, *, ranks: int) -> str:
    """The one-line model summary the strategies print after sharding (``lp-lightning fit`` turns
    Lightning's model-summary table off: it cannot size FP32 masters under this plugin and counts no FLOPs).

    E.g. ``lp-lightning: model 3.0 M parameters, FP32 masters, FSDP2 over 1 rank; mxfp8 GEMMs on 25
    low-precision weights in 23 modules (2.8 M parameters, 91%).``
    """
    total = sum(p.numel() for p in causal_lm.parameters())
    over = f"{ranks} rank{'s' if ranks != 1 else ''}"
    head = f"lp-lightning: model {_human_count(total)} parameters, FP32 masters, FSDP2 over {over}"
    elements = plugin.low_precision_elements
    if not plugin.low_precision_weights:
        return f"{head}; {plugin.mode} GEMMs, no low-precision weight."
    share = f"{_human_count(elements)} parameters, {elements / max(total, 1):.0%}"
    return f"{head}; {plugin.mode} GEMMs on {plugin.weights_summary} ({share})."


_LIGHTNING_RESTORED = ("Restored all states from the checkpoint at ", "Loaded model weights from the checkpoint at ")
"""Lightning's line after a restore (``_CheckpointConnector.resume_end``), which names the ``ckpt_path`` it was given."""


class _DropRestoredFrom(logging.Filter):
    """Drops Lightning's "Restored all states from the checkpoint at <requested>" when the strategy loaded
    an older folder instead (``resume_fallback``): the strategy's own line, printed before it, names the
    folder really loaded and stays the last word."""

    def __init__(self, requested: Path) -> None:
        super().__init__()
        self.requested = requested

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(
            message.startswith(prefix) and Path(message[len(prefix):].strip()) == self.requested
            for prefix in _LIGHTNING_RESTORED
        )


_LIGHTNING_RANK_ZERO_LOGGER = "lightning.pytorch.utilities.rank_zero"
"""The logger of Lightning's ``rank_zero_info`` in a Trainer process."""


class _FSDP2Common:
    """What :class:`FSDP2Strategy` and :class:`FSDP2FabricStrategy` share (listed first in their bases).

    The ``"lp_fsdp2"`` registry alias, the constructor arguments (the same for both), the process-group
    backend by device type, the 1-D ``("dp_shard",)`` mesh with the sampler arguments read from it, and
    the parallelisation and checkpoint load both run.
    """

    strategy_name = "lp_fsdp2"

    fsdp_config: FSDP2Config
    activation_checkpoint: ActivationCheckpointMode | None
    resume_fallback: bool
    parallelization: ParallelizationRecord | None
    """What the last setup did (``None`` before setup)."""
    hccl_determinism: HcclDeterminism | None
    """What ``setup_environment`` did about ``HCCL_DETERMINISTIC`` (``None`` off the npu accelerator)."""

    def _init_fsdp2(
        self, fsdp_config: FSDP2Config | None, activation_checkpoint: ActivationCheckpointMode | None,
        resume_fallback: bool,
    ) -> None:
        if fsdp_config is not None and not isinstance(fsdp_config, FSDP2Config):
            raise TypeError(f"fsdp_config must be an FSDP2Config, got {type(fsdp_config).__name__}.")
        if not isinstance(resume_fallback, bool):
            raise TypeError(f"resume_fallback must be a bool, got {resume_fallback!r}.")
        self.fsdp_config = fsdp_config or FSDP2Config()
        self.activation_checkpoint = (
            None if activation_checkpoint is None else check_activation_checkpoint(activation_checkpoint)
        )
        self.resume_fallback = resume_fallback
        self.loaded_checkpoint: str | None = None
        """The checkpoint folder the last ``load_checkpoint`` restored (after any fallback)."""
        self.parallelization = None
        self.hccl_determinism = None
        register_npu_accelerator()  # before the Trainer/Fabric resolves accelerator="npu" (late torch_npu)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Registers the alias ``"lp_fsdp2"`` (default config) in a Lightning strategy registry."""
        strategy_registry.register(
            cls.strategy_name, cls, description="lp-lightning FSDP2 (1-D dp_shard mesh, HF-keyed DCP)"
        )

    def _build_dp_shard_mesh(self) -> DeviceMesh:
        """The ``("dp_shard",)`` mesh over all ranks (after the process group exists).

        Raises:
            ValueError: ``fsdp_config.dp_shard_size`` differs from the world size.
        """
        dp_shard_size = self.fsdp_config.resolve_dp_shard_size(self.world_size)  # type: ignore[attr-defined]
        self._device_mesh = build_dp_mesh(self.root_device.type, dp_shard_size)  # type: ignore[attr-defined]
        return self._device_mesh

    def _record_parallelization(self, record: ParallelizationRecord, causal_lm: nn.Module) -> None:
        """Keeps what setup did; names the sharded parameters for the non-finite guard; prints (rank 0) the
        one-line model summary and which low-precision weights stay replicated."""
        plugin = self.low_precision_plugin  # type: ignore[attr-defined]
        plugin.guard.name_parameters(causal_lm)
        self.parallelization = record
        rank_zero_info(model_summary_line(causal_lm, plugin, ranks=record.mesh_shape[0]))
        if record.input_dim_sharded:
            rank_zero_info(
                f"{len(record.input_dim_sharded)} low-precision weight(s) break their format's dim-0 shard rule over "
                f"{record.mesh_shape[0]} ranks and are sharded along their input dim (Shard(1); "
                "run_summary.json sharding.input_dim_sharded, docs/architecture.md \"Placements\")."
            )
        replicated = record.replicated_low_precision
        if replicated:
            listed = "\n  ".join(reason for _, reason in replicated[:8])
            more = f"\n  ... and {len(replicated) - 8} more" if len(replicated) > 8 else ""
            rank_zero_warn(
                f"fsdp_config.fallback_to_unsharded: {len(replicated)} low-precision weight(s) cannot be "
                f"sharded along any dim over {record.mesh_shape[0]} ranks and stay replicated (full 8-bit copy "
                f"on every rank, gradients all-reduced; their GEMMs stay low precision):\n  {listed}{more}\n"
                f"The full list is in run_summary.json under sharding.replicated_low_precision."
            )

    def _parallelize_causal_lm(
        self,
        causal_lm: nn.Module,
        mesh: DeviceMesh,
        activation_checkpoint: ActivationCheckpointMode,
        convert_module: Callable[[nn.Module], nn.Module] | None,
    ) -> nn.Module:
        """:func:`~lp_lightning.fsdp.parallelize.parallelize_causal_lm` with this strategy's settings, the
        model's adapter and the plugin's lifecycle; records what it did. Returns the model to use."""
        plugin = self.low_precision_plugin  # type: ignore[attr-defined]
        parallel_lm, record = parallelize_causal_lm(
            causal_lm,
            mesh,
            mp_policy=plugin.fsdp_mixed_precision_policy(),
            reshard_after_forward=self.fsdp_config.reshard_after_forward,
            activation_checkpoint=activation_checkpoint,
            convert_module=convert_module,
            adapter=adapter_for(causal_lm),
            lifecycle=plugin.lifecycle,
            fallback_to_unsharded=self.fsdp_config.fallback_to_unsharded,
            input_dim_sharding=self.fsdp_config.input_dim_sharding,
        )
        self._record_parallelization(record, parallel_lm)
        return parallel_lm

    _resume_hints: tuple[str, str, str]
    """``(what skips, how to ask for the fallback, how to start fresh)`` in this strategy's user's words."""

    def _load_with_fallback(self, path: Path, load: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
        """``load(folder)`` through :func:`~lp_lightning.checkpoint.resume.load_with_fallback` (``resume_fallback``);
        keeps the folder it loaded in ``loaded_checkpoint`` and says so when it is not ``path``."""
        who, fallback, fresh = self._resume_hints

        def warn_skip(folder: Path, err: DamagedCheckpointError) -> None:
            rank_zero_warn(f"{who} skips {str(folder)!r} ({err.problem}); trying the previous one.")

        metadata, loaded = load_with_fallback(
            path, load, fallback=self.resume_fallback, on_skip=warn_skip, hints=(fallback, fresh)
        )
        self.loaded_checkpoint = str(loaded)
        if loaded != path:
            rank_zero_info(f"{who}: loaded {str(loaded)!r} instead of the damaged {str(path)!r}.")
        return metadata

    def _on_npu_accelerator(self) -> bool:
        """The npu accelerator, also when a test maps its devices to CPU memory."""
        return isinstance(self.accelerator, NPUFabricAccelerator)  # type: ignore[attr-defined]

    def _startup_gate(self) -> None:
        """The design spec §15 startup gate (hardware, torch_npu, ops; ``lp_lightning.ops.gate``), once,
        before the process group and the model exist. The npu accelerator counts as ``npu`` also when
        a test maps its devices to CPU memory."""
        plugin = self.low_precision_plugin  # type: ignore[attr-defined]
        with stage("startup_gate"):
            plugin.startup_gate("npu" if self._on_npu_accelerator() else self.root_device.type)  # type: ignore[attr-defined]

    def _start_process_group(self) -> None:
        """``HCCL_DETERMINISTIC`` for a deterministic run on the npu accelerator (``lightning.hccl``), then
        the process group."""
        self.hccl_determinism = apply_hccl_determinism(on_npu=self._on_npu_accelerator())
        self._setup_distributed()  # type: ignore[attr-defined]

    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or process_group_backend_for(self.root_device.type)  # type: ignore[attr-defined]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        mesh = self.device_mesh  # type: ignore[attr-defined]
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}


class FSDP2Strategy(_FSDP2Common, ModelParallelStrategy):
    """Trainer strategy: FSDP2 over a 1-D data-parallel mesh, HF-keyed DCP checkpoints.

    Args:
        fsdp_config: Sharding configuration (design spec §4.3); ``None`` means ``FSDP2Config()``.
        activation_checkpoint: ``"off"`` or ``"full"`` (per decoder layer); ``None``: the LightningModule's
            ``activation_checkpoint`` attribute (``DeepSeekV3LM(activation_checkpoint=...)``), ``"off"`` when
            it has none or it is ``None``. Set on both, they must agree.
        process_group_backend: Override the backend (default: gloo/nccl/hccl by device type).
        timeout: Process-group timeout.
        resume_fallback: When the checkpoint to resume from is damaged (a file that does not match
            its digest, NaN/Inf in what was read), warn naming it and load the newest intact
            ``step-*`` folder written before it instead; ``lp-lightning fit --ckpt_path last`` sets
            it. ``False``: fail, naming the file and the last good checkpoint.
    """

    _resume_hints = ("ckpt_path=last", CLI_FALLBACK, CLI_FRESH)  # the CLI builds this strategy

    def __init__(
        self,
        fsdp_config: FSDP2Config | None = None,
        *,
        activation_checkpoint: ActivationCheckpointMode | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        resume_fallback: bool = False,
    ) -> None:
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._init_fsdp2(fsdp_config, activation_checkpoint, resume_fallback)

    @property
    def low_precision_plugin(self) -> FSDP2PrecisionPlugin:
        """The connected precision plugin (raises ``TypeError`` if it is not lp-lightning's)."""
        return _require_plugin(type(self).__name__, self.precision_plugin)

    @override
    def setup_environment(self) -> None:
        """Checks the plugin, runs the startup gate, starts the process group, builds the ``("dp_shard",)`` mesh.

        Raises:
            TypeError: The precision plugin is not an lp-lightning one (``precision_plugin``).
            lp_lightning.ops.gate.StartupGateError: A startup-gate check failed (design spec §15).
            ValueError: ``fsdp_config.dp_shard_size`` differs from the world size.
        """
        self._startup_gate()  # checks the plugin too: fails before any process group exists
        self._start_process_group()
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._build_dp_shard_mesh()

    def _causal_lm(self) -> nn.Module:
        assert self.lightning_module is not None
        return _resolve_causal_lm(self.lightning_module)

    @override
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Lightning runs ``configure_model`` inside: the ``model_build`` stage event (lp_lightning.observers)."""
        with stage("model_build"), super().model_sharded_context():
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Parallelises the model that ``configure_model`` built, then sets up the optimizer.

        Order (design spec §12.1): ``precision_plugin.configure_sharding`` -> ``convert_module`` (plan
        compiled on a meta twin and applied, low-precision weights finalized) -> FP32 upcast ->
        shard-legality check -> ``fully_shard`` (replicated fallback modules, FP32 router modules,
        decoder layers, root) -> one refresh of the low-precision shards -> activation
        checkpointing -> ``configure_optimizers``. A model that is already sharded (a second
        ``fit``/``validate`` on the same Trainer) is kept as it is.

        Raises:
            TypeError: ``configure_model`` is not overridden, or the LightningModule does not
                hold a HF causal LM at ``.model``.
            ValueError: The model still has meta parameters, or a low-precision weight no dim can
                shard under its format's rule with ``fsdp_config.fallback_to_unsharded=false`` (the
                message names the FQN, shape, world size and rules).
        """
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        lm = self.lightning_module
        assert lm is not None
        if not is_overridden("configure_model", lm):
            raise TypeError(
                f"{type(self).__name__} needs `configure_model()` in the LightningModule to build "
                f"the plain (unsharded) model; the strategy shards it."
            )
        plugin = self.low_precision_plugin
        causal_lm = self._causal_lm()
        if not is_parallelized(causal_lm):
            _check_materialized(causal_lm)
            activation_checkpoint = self._activation_checkpoint_of(lm)
            plugin.configure_sharding(
                reshard_after_forward=self.fsdp_config.reshard_after_forward,
                activation_checkpoint=activation_checkpoint,
            )
            with ExitStack() as sharding:

                def convert_module(module: nn.Module) -> nn.Module:
                    """The ``plan_apply`` stage; once it returns, the ``fully_shard`` stage runs to the end of
                    ``parallelize_causal_lm`` (FP32 upcast, placements, ``fully_shard``)."""
                    with stage("plan_apply"):
                        converted = plugin.convert_module(module)
                    sharding.enter_context(stage("fully_shard"))
                    return converted

                parallel_lm = self._parallelize_causal_lm(
                    causal_lm, self.device_mesh, activation_checkpoint, convert_module
                )
            if parallel_lm is not causal_lm:
                lm.model = parallel_lm
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _activation_checkpoint_of(self, lm: pl.LightningModule) -> ActivationCheckpointMode:
        """This strategy's ``activation_checkpoint``, else the LightningModule's (``"off"`` when it declares none).

        Raises:
            ValueError: Both are set and differ.
        """
        declared = getattr(lm, "activation_checkpoint", None)  # an optional LightningModule attribute
        if self.activation_checkpoint is None:
            return check_activation_checkpoint(declared or "off")
        if declared is not None and declared != self.activation_checkpoint:
            raise ValueError(
                f"{type(self).__name__}(activation_checkpoint={self.activation_checkpoint!r}) but "
                f"{type(lm).__name__}.activation_checkpoint={declared!r}; set it in one place (the other None) or "
                "the same in both."
            )
        return self.activation_checkpoint

    @override
    def teardown(self) -> None:
        """Lightning's teardown, then the stop request's watchdog is disarmed (it bounds a stop up to here:
        the save, the run summary, the exception hooks; :mod:`lp_lightning.lightning.preemption`)."""
        super().teardown()
        self._remove_restored_filter()
        if isinstance(self.precision_plugin, FSDP2PrecisionPlugin):
            self.precision_plugin.stop.disarm()

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Lightning's ``reduce`` (an all-reduce whenever the process group is up, one rank included),
        reported to :func:`~lp_lightning.observers.add_collective_observer` first (the per-step loss mean)."""
        if isinstance(tensor, torch.Tensor) and dist.is_available() and dist.is_initialized():
            notify_collective("all_reduce", tensor, "strategy.reduce")
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Creates the ``configure_optimizers`` result, then checks it (design spec §15).

        Raises:
            TypeError: An optimizer is not ``torch.optim.AdamW``.
            ValueError: It holds a non-FP32 parameter or moment (see ``check_optimizer``).
        """
        super().setup_optimizers(trainer)
        with stage("optimizer_check"):
            for optimizer in self.optimizers:
                check_optimizer(optimizer)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's training step, as the ``training_step`` stage event (lp_lightning.observers)."""
        with stage("training_step"):
            return super().training_step(*args, **kwargs)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Sharded model view keyed by HF names (no LightningModule attribute prefix)."""
        return model_state_dict(self._causal_lm())

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Sharded optimizer view keyed by HF names (FP32 ``exp_avg``/``exp_avg_sq``, ``step``)."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return optimizer_state_dict(self._causal_lm(), optimizer)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """Writes a DCP folder: HF-keyed model view, ``optimizer.*`` view, ``meta.pt`` for the rest.

        Raises:
            TypeError: ``storage_options`` is given (DCP does not use Lightning's CheckpointIO).
            ValueError: The Trainer holds more than one optimizer.
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options.")
        path = Path(self.broadcast(filepath))
        model_state = checkpoint.pop("state_dict")
        optimizer_states = checkpoint.pop("optimizer_states", [])
        if len(optimizer_states) > 1:
            raise ValueError(
                f"{type(self).__name__} checkpoints hold one optimizer; got {len(optimizer_states)}."
            )
        save_dcp_checkpoint(
            path,
            model_state=model_state,
            optimizer_states={OPTIMIZER_CHECKPOINT_KEY: optimizer_states[0]} if optimizer_states else {},
            metadata=checkpoint,
            rank=self.global_rank,
        )

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Restores model then optimizer shards from a DCP folder; returns ``meta.pt`` for Lightning.

        Lightning restores loops, LR schedulers, callbacks, datamodule and plugin state from the
        returned dict (``lightning_restore_optimizer`` is ``False``: the optimizer is restored here).
        Then the low-precision weights are rebuilt once from the restored FP32 masters (design spec §11;
        the checkpoint holds no derived data, so it may come from another precision). A damaged
        checkpoint (:class:`~lp_lightning.checkpoint.dcp.DamagedCheckpointError`) is replaced
        by the newest intact older one with ``resume_fallback``, else fails naming that one; after
        such a fallback Lightning's "Restored all states from the checkpoint at <damaged>" is dropped
        (:class:`_DropRestoredFrom`), so the strategy's "loaded X instead of the damaged Y" is the last word.
        Outside ``fit`` (``validate``: no optimizer exists) only the weights are restored, not the plugin state.

        Raises:
            DamagedCheckpointError: The checkpoint (and, with ``resume_fallback``, every older one)
                is damaged; the message names the file and the last good checkpoint.
        """
        path = Path(self.broadcast(checkpoint_path))
        optimizers = self.optimizers
        if len(optimizers) > 1:
            raise ValueError(f"{type(self).__name__} checkpoints hold one optimizer; got {len(optimizers)}.")
        assert self.lightning_module is not None
        metadata = self._load_with_fallback(path, lambda folder: load_dcp_checkpoint(
            folder,
            model=self._causal_lm(),
            optimizers={OPTIMIZER_CHECKPOINT_KEY: optimizers[0]} if optimizers else {},
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
        ))
        self._remove_restored_filter()
        if self.loaded_checkpoint != str(path):  # Lightning is about to say it restored `path`: it did not
            self._restored_filter = _DropRestoredFrom(path)
            logging.getLogger(_LIGHTNING_RANK_ZERO_LOGGER).addFilter(self._restored_filter)
        self.low_precision_plugin.rebuild_after_load(self._causal_lm())
        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            # validate: the weights only; the plugin's step counters (and its note on resuming the
            # AdamW state in another precision) are training state, which Lightning restores regardless.
            for key in TRAINER_PLUGIN_STATE_KEYS:
                metadata.pop(key, None)
        return metadata

    _restored_filter: _DropRestoredFrom | None = None

    def _remove_restored_filter(self) -> None:
        if self._restored_filter is not None:
            logging.getLogger(_LIGHTNING_RANK_ZERO_LOGGER).removeFilter(self._restored_filter)
            self._restored_filter = None


class FSDP2FabricStrategy(_FSDP2Common, FabricModelParallelStrategy):
    """Fabric twin of :class:`FSDP2Strategy`.

    Fabric runs the plugin's ``convert_module`` itself, before ``setup_module`` (the right order;
    :meth:`setup_environment`, run by ``fabric.launch()``, first tells the plugin the sharding
    settings), so ``setup_module`` upcasts, shards, refreshes the low-precision shards and wraps.
    The restore in :meth:`load_checkpoint` falls back to an older intact folder with ``resume_fallback``
    and rebuilds the low-precision weights from the masters. Checkpoints (``fabric.save(path, state)``) put
    the single module's HF-keyed view at the top level, each optimizer under its state key and
    everything else in ``meta.pt``.

    Args:
        fsdp_config: Sharding configuration; ``None`` means ``FSDP2Config()``.
        activation_checkpoint: ``"off"`` or ``"full"`` (per decoder layer); ``None`` means ``"off"``
            (there is no LightningModule to declare it).
        process_group_backend, timeout, resume_fallback: As for :class:`FSDP2Strategy`.
    """

    _resume_hints = ("resume_fallback", "pass FSDP2FabricStrategy(resume_fallback=True)", "start without loading")

    def __init__(
        self,
        fsdp_config: FSDP2Config | None = None,
        *,
        activation_checkpoint: ActivationCheckpointMode | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        resume_fallback: bool = False,
    ) -> None:
        super().__init__(
            parallelize_fn=self._parallelize,
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._init_fsdp2(fsdp_config, activation_checkpoint, resume_fallback)

    @property
    def low_precision_plugin(self) -> FSDP2PrecisionPlugin:
        """The connected precision plugin (raises ``TypeError`` if it is not lp-lightning's)."""
        return _require_plugin(type(self).__name__, self.precision)

    @override
    def setup_environment(self) -> None:
        """Checks the plugin, runs the startup gate, starts the process group, builds the ``("dp_shard",)`` mesh."""
        plugin = self.low_precision_plugin  # fail before any process group exists
        self._startup_gate()
        # Fabric converts in setup_module, after launch: the plugin learns the sharding now.
        plugin.configure_sharding(
            reshard_after_forward=self.fsdp_config.reshard_after_forward,
            activation_checkpoint=self.activation_checkpoint or "off",
        )
        FabricParallelStrategy.setup_environment(self)
        self._start_process_group()
        self._build_dp_shard_mesh()

    def _parallelize(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        causal_lm = _resolve_causal_lm(module)
        _check_materialized(causal_lm)
        with stage("fully_shard"):  # Fabric already ran precision.convert_module
            parallel_lm = self._parallelize_causal_lm(causal_lm, mesh, self.activation_checkpoint or "off", None)
        assert parallel_lm is causal_lm
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Checks an optimizer ``fabric.setup_optimizers`` hands over (design spec §15), then sets it up.

        Raises:
            TypeError: ``optimizer`` is not ``torch.optim.AdamW``.
            ValueError: It holds a non-FP32 parameter or moment (see ``check_optimizer``).
        """
        with stage("optimizer_check"):
            check_optimizer(optimizer)
        return super().setup_optimizer(optimizer)

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        """Refused: ``fully_shard`` replaces the Parameters an optimizer made earlier would hold.

        Raises:
            ValueError: Always, with the order to use instead.
        """
        raise ValueError(
            f"{type(self).__name__}: `fabric.setup(model, optimizer)` is not supported. Call "
            f"`model = fabric.setup_module(model)`, create the optimizer over `model.parameters()`, then "
            f"`fabric.setup_optimizers(optimizer)`."
        )

    @staticmethod
    def _split_state(state: dict[str, Any]) -> tuple[str, nn.Module, dict[str, Optimizer], dict[str, Any]]:
        modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
        if len(modules) != 1:
            raise ValueError(
                f"a checkpoint state must hold exactly one model (nn.Module); got {sorted(modules)}."
            )
        (module_key, module), = modules.items()
        optimizers = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
        rest = {k: v for k, v in state.items() if k not in modules and k not in optimizers}
        return module_key, module, optimizers, rest

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Writes a DCP folder (see the class docstring).

        Raises:
            TypeError: ``storage_options`` or ``filter`` is given.
            ValueError: ``state`` does not hold exactly one module.
        """
        if storage_options is not None or filter is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes neither storage_options nor filter.")
        path = Path(self.broadcast(path))
        _, module, optimizers, rest = self._split_state(state)
        causal_lm = _resolve_causal_lm(module)
        metadata = {k: (v.state_dict() if isinstance(v, _Stateful) else v) for k, v in rest.items()}
        save_dcp_checkpoint(
            path,
            model_state=model_state_dict(causal_lm),
            optimizer_states={k: optimizer_state_dict(causal_lm, o) for k, o in optimizers.items()},
            metadata=metadata,
            rank=self.global_rank,
        )

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restores the module, the optimizers and the requested metadata entries in place.

        Returns:
            The metadata entries of ``meta.pt`` that ``state`` did not ask for.

        Raises:
            ValueError: ``state`` is not a dict holding exactly one module.
            DamagedCheckpointError: A file does not match its digest, or NaN/Inf was read (with
                ``resume_fallback``: in every older folder too); the message names the file and the
                newest intact checkpoint.
            KeyError: ``strict`` and a requested metadata entry is missing from the checkpoint.
        """
        if not isinstance(state, dict):
            raise ValueError(
                f"{type(self).__name__}.load_checkpoint needs state={{'model': model, ...}}; got "
                f"{type(state).__name__}."
            )
        path = Path(self.broadcast(path))
        _, module, optimizers, rest = self._split_state(state)
        metadata = self._load_with_fallback(path, lambda folder: load_dcp_checkpoint(
            folder, model=_resolve_causal_lm(module), optimizers=optimizers, strict=strict, weights_only=weights_only,
        ))
        self.low_precision_plugin.rebuild_after_load(module)
        missing = [k for k in rest if k not in metadata]
        if strict and missing:
            raise KeyError(f"checkpoint {str(path)!r} has no entries {missing}; pass strict=False to skip them.")
        for key, obj in rest.items():
            if key not in metadata:
                continue
            if isinstance(obj, _Stateful):
                obj.load_state_dict(metadata.pop(key))
            else:
                state[key] = metadata.pop(key)
        return metadata


def _register_aliases() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    if FSDP2Strategy.strategy_name not in StrategyRegistry:
        FSDP2Strategy.register_strategies(StrategyRegistry)
    if FSDP2FabricStrategy.strategy_name not in FABRIC_REGISTRY:
        FSDP2FabricStrategy.register_strategies(FABRIC_REGISTRY)


_register_aliases()
