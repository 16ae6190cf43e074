"""Read-only probes of a training run: GEMM roles, high-precision GEMMs, refreshes, wire bytes (R12, design spec §16.6).

Each recorder observes and counts; none changes a tensor, a kernel choice or the order of any
operation. :class:`~lp_lightning.telemetry.summary.RunSummaryCallback` runs the GEMM-role and
refresh counters for every low-precision fit and the wire recorder when asked (``--run_summary.wire
true``), and writes their totals into ``run_summary.json``; :class:`HighPrecisionGemmProbe` is an
opt-in Callback (off by default in the CLI, on in the tests) because it puts a Python dispatch mode
under every aten op. The counters and the probe's low-precision hooks live in
:mod:`lp_lightning.telemetry.low_precision_recorders` (:func:`low_precision_recorders`), which
imports the low-precision stack; this module imports none of it.

**GEMM roles** (``GemmRoleCounter``): an observer of ``lp_lightning.ops`` trace events
(``add_gemm_observer``). Every low-precision GEMM emits one event naming its backend
(``"emulated"``/``"npu"``), format and role; the counter keys them ``"dense.fprop"`` …
``"grouped.wgrad"``.

**High-precision GEMMs in replaced modules** (:class:`HighPrecisionGemmProbe`): a
``TorchDispatchMode`` sees every aten op of the process. An aten GEMM (``mm``, ``addmm``,
``bmm``, ``baddbmm``, ``_grouped_mm``, ``_scaled_mm`` …) counts as *high precision inside a
replaced module* when it is not issued by a low-precision GEMM entry point
(``lp_lightning.ops.current_gemm_role()`` is ``None``: the autograd layer declares a role exactly
around its ``low_precision_matmul`` calls, and the emulated backend's FP32 matmul of exactly
decoded operands runs inside it) and either

- a replaced module's ``forward`` is running (forward pre/post hooks; also the recompute of
  ``activation_checkpoint="full"``), or
- no module forward is running and the autograd engine is executing the backward node of a
  low-precision autograd function (``torch._C._current_autograd_node()``; names
  ``_LowPrecisionLinearFunctionBackward``, ``_GroupedSwiGLUFunctionBackward``). The "no forward"
  condition keeps an activation recompute triggered from such a node (which re-runs attention
  core and the router, legitimately high precision) out of the count.

Every other aten GEMM is counted as ``high_precision_gemms_elsewhere`` (attention core, router,
LM head): a positive control that the probe sees GEMMs at all. Codec kernels run eagerly while the
probe is active (``set_compiled_kernels(False)``; bit-identical by contract), because
``torch.compile`` does not trace under a Python dispatch mode.

**Refreshes** (``RefreshCounter``): ``lp_lightning.fsdp.refresh.RefreshRecorder``
counts every storage build of every low-precision weight; the counter splits them per optimizer
step (and reports the largest number of builds of one weight in one step, which must be 1).

**Wire** (:class:`WireRecorder`), while active (training steps only, not validation):

- per low-precision weight gather: FSDP2 calls the weight's pre-all-gather hook on the local
  shard right before it copies the all-gather inputs in; the lifecycle layer reports each call to
  its public gather observers (``lp_lightning.fsdp.gather.add_gather_observer``), and the
  recorder records the parameter FQN, phase (forward/backward), orientations and the physical
  tensors (dtype, shape, bytes). It never touches their contents.
- per collective: the recorder observes :func:`lp_lightning.observers.add_collective_observer`
  and records dtype and bytes of this rank's input. FSDP2's all-gathers and reduce-scatters are
  reported by the comms :func:`observe_fsdp_collectives` installs with FSDP2's public
  ``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` (:class:`ObservedAllGather`,
  :class:`ObservedReduceScatter`: FSDP2's default comms — a ``torch.empty`` buffer,
  ``all_gather_single`` / ``reduce_scatter_single`` — plus the report). FSDP2 packs one unit's
  inputs into one buffer and views it as ``uint8`` when their dtypes differ, so the bytes of a
  ``uint8`` buffer are split into the low-precision slots announced by the pre-all-gather hooks
  since the previous collective, and the rest, which are the unit's plain parameters cast to
  ``plain_dtype`` (the unit's ``MixedPrecisionPolicy.param_dtype``, BF16) before the copy-in.
- high-precision gathers of replaced weights: a forward pre-hook on every replaced module checks,
  after FSDP2's unshard, that each declared low-precision parameter is a low-precision tensor
  (``GatheredWeightTensor`` after a gather); a plain BF16/FP32 tensor there, or a pre-all-gather
  output wider than one byte, is counted.

- every all-reduce of a training step is counted apart under ``all_reduce_bytes``: FSDP2's HSDP
  gradient all-reduce over the replicate dim of replicated fallback weights (reported by the
  all-reduce hook :func:`observe_fsdp_collectives` sets with ``FSDPModule.set_all_reduce_hook`` on
  the units with a 2-D mesh; the hook sees the all-reduced buffer itself), and the product's own
  all-reduces, each reported where it is issued: the HiF8 amax MAX-reduce
  (``fsdp.refresh``), the non-finite flags (``checkpoint.finite.first_nonfinite``) and the
  strategy's ``reduce`` (the per-step loss mean). The gradient-norm reduction of
  ``fsdp.parallelize.total_grad_norm`` is a DTensor ``full_tensor()`` (a functional collective)
  and is not counted (it never was).

Bytes are *this rank's collective inputs* (an all-gather moves ``W`` times that into every rank).
A one-rank FSDP2 shard group issues no collective at all (FSDP2 copies the gather inputs
locally): a single-process run, and the replicated fallback weights of a multi-process run (shard
group of one rank on the ``(W, 1)`` mesh). Their gathers are recorded as ``weight_gather_local``
events and counted in ``low_precision_weights_gathered_locally``, never attributed to a
collective, so a single-process run reports empty byte maps.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from typing_extensions import override

from lp_lightning.observers import CollectiveEvent, add_collective_observer, notify_collective

__all__ = [
    "ATEN_GEMM_OPS",
    "GEMM_ROLE_KEYS",
    "HighPrecisionGemmProbe",
    "ObservedAllGather",
    "ObservedReduceScatter",
    "WireRecorder",
    "low_precision_recorders",
    "observe_fsdp_collectives",
    "replaced_modules",
]

GEMM_ROLE_KEYS: tuple[str, ...] = (
    "dense.fprop",
    "dense.dgrad",
    "dense.wgrad",
    "grouped.fprop",
    "grouped.dgrad",
    "grouped.wgrad",
)
"""The six training GEMM roles (dense|grouped × fprop|dgrad|wgrad, design spec §8) as summary keys."""


def low_precision_recorders() -> ModuleType:
    """:mod:`lp_lightning.telemetry.low_precision_recorders`: the GEMM-role and refresh counters and the
    low-precision hooks of :class:`HighPrecisionGemmProbe`."""
    # Imported here: it imports ops, functional, formats and fsdp.refresh, which a bf16 run never loads.
    from lp_lightning.telemetry import low_precision_recorders

    return low_precision_recorders


def replaced_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(fqn, module)`` of the modules holding low-precision weights (class attribute
    ``low_precision_weight_names``: ``LowPrecisionLinear``, ``DeepseekV3LowPrecisionExperts``).

    Activation-checkpoint wrappers are looked through: FQNs are the HF names.
    """
    out = []
    for fqn, module in model.named_modules():
        if getattr(type(module), "low_precision_weight_names", None) is not None:
            out.append((fqn.replace("_checkpoint_wrapped_module.", ""), module))
    return out


# ------------------------------------------------------------------------------------------------
# High-precision GEMMs


ATEN_GEMM_OPS: tuple[str, ...] = (
    "mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot", "vdot", "_grouped_mm", "_scaled_mm",
    "_scaled_grouped_mm", "_int_mm",
)
"""The aten GEMM ops (overload packet names) the high-precision probes look for."""


def _gemm_packets() -> frozenset[Any]:
    return frozenset(getattr(torch.ops.aten, n) for n in ATEN_GEMM_OPS if hasattr(torch.ops.aten, n))


class _HighPrecisionGemmMode(TorchDispatchMode):
    """The dispatch mode of :class:`HighPrecisionGemmProbe` (see the module docstring)."""

    def __init__(self, probe: HighPrecisionGemmProbe) -> None:
        super().__init__()
        self.probe = probe
        self.gemms = _gemm_packets()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.overloadpacket in self.gemms:
            self.probe._classify(func)
        return func(*args, **(kwargs or {}))


class HighPrecisionGemmProbe(Callback):
    """Counts aten GEMMs inside replaced modules that are not low-precision GEMMs (must be 0).

    Active from ``on_train_start`` to ``on_train_end`` (validation included). Add it to a run
    with ``--trainer.callbacks+=lp_lightning.telemetry.probes.HighPrecisionGemmProbe``; the
    :class:`~lp_lightning.telemetry.summary.RunSummaryCallback` copies its counts into
    ``run_summary.json`` ``kernels``.

    Attributes:
        in_replaced: High-precision GEMMs attributed to replaced modules (the acceptance count).
        elsewhere: Aten GEMMs outside replaced modules (positive control, > 0 in a DeepSeek run).
        examples: Up to 20 ``"op (where)"`` strings of the ``in_replaced`` calls, for the report.
        watched_modules: Number of replaced modules hooked.
    """

    def __init__(self) -> None:
        self.in_replaced = 0
        self.elsewhere = 0
        self.examples: list[str] = []
        self.watched_modules = 0
        self._replaced_depth = 0
        self._forward_depth = 0
        self._backward_nodes: frozenset[str] = frozenset()
        self._handles: list[Any] = []
        self._mode: _HighPrecisionGemmMode | None = None
        self._compiled_before: bool | None = None

    def summary(self) -> dict[str, Any]:
        """JSON-ready counts."""
        return {
            "high_precision_gemms_in_replaced_modules": self.in_replaced,
            "high_precision_gemms_elsewhere": self.elsewhere,
            "high_precision_gemm_examples": list(self.examples),
            "watched_replaced_modules": self.watched_modules,
        }

    def _classify(self, func: Any) -> None:
        if low_precision_recorders().current_gemm_role() is not None:
            return  # a low-precision GEMM entry point (emulated: FP32 matmul of decoded operands)
        where = None
        if self._replaced_depth > 0:
            where = "replaced module forward"
        elif self._forward_depth == 0:
            node = torch._C._current_autograd_node()
            if node is not None and node.name() in self._backward_nodes:
                where = node.name()
        if where is None:
            self.elsewhere += 1
            return
        self.in_replaced += 1
        if len(self.examples) < 20:
            self.examples.append(f"{func} ({where})")

    def _enter(self, attr: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            setattr(self, attr, getattr(self, attr) + 1)

        return hook

    def _exit(self, attr: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            setattr(self, attr, getattr(self, attr) - 1)

        return hook

    def start(self, model: nn.Module) -> None:
        """Hook ``model`` and push the dispatch mode (also usable without a Trainer).

        Raises:
            RuntimeError: The probe is already active.
        """
        if self._mode is not None:
            raise RuntimeError("HighPrecisionGemmProbe is already active.")
        stack = low_precision_recorders()
        replaced = replaced_modules(model)
        self.watched_modules = len(replaced)
        if replaced:
            self._backward_nodes = stack.LOW_PRECISION_BACKWARD_NODES
        for module in model.modules():
            self._handles.append(module.register_forward_pre_hook(self._enter("_forward_depth")))
            self._handles.append(module.register_forward_hook(self._exit("_forward_depth"), always_call=True))
        for _, module in replaced:
            self._handles.append(module.register_forward_pre_hook(self._enter("_replaced_depth")))
            self._handles.append(module.register_forward_hook(self._exit("_replaced_depth"), always_call=True))
        self._compiled_before = stack.compiled_kernels_enabled()
        stack.set_compiled_kernels(False)
        self._mode = _HighPrecisionGemmMode(self)
        self._mode.__enter__()

    def stop(self) -> None:
        """Pop the mode and remove the hooks (idempotent)."""
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._compiled_before is not None:
            low_precision_recorders().set_compiled_kernels(self._compiled_before)
            self._compiled_before = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start(pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stop()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.stop()


# ------------------------------------------------------------------------------------------------
# Wire


class ObservedAllGather(AllGather):
    """FSDP2's default all-gather, reporting each call to the collective observers.

    The same buffer (``torch.empty``) and the same call (``dist.all_gather_single``) as FSDP2's
    ``DefaultAllGather``, so numerics and bytes are those of a run without it.
    """

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> Any:
        notify_collective("all_gather", input_tensor, "fsdp2")
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class ObservedReduceScatter(ReduceScatter):
    """FSDP2's default reduce-scatter (``torch.empty`` buffers, ``dist.reduce_scatter_single``), reporting each call."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        notify_collective("reduce_scatter", input_tensor, "fsdp2")
        return dist.reduce_scatter_single(output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op)


def _report_hsdp_all_reduce(reduce_output: torch.Tensor) -> None:
    notify_collective("all_reduce", reduce_output, "fsdp2.hsdp")


def _is_hsdp(module: nn.Module) -> bool:
    """Whether the parameters ``module``'s own FSDP2 unit manages live on a 2-D (replicate, shard) mesh."""
    inner = {id(p) for m in module.modules() if m is not module and isinstance(m, FSDPModule) for p in m.parameters()}
    own = [p for p in module.parameters() if id(p) not in inner]
    return any(isinstance(p, DTensor) and p.device_mesh.ndim == 2 for p in own)


def observe_fsdp_collectives(model: nn.Module) -> int:
    """Make every FSDP2 unit in ``model`` report its collectives (FSDP2's public comm hooks).

    Installs :class:`ObservedAllGather` / :class:`ObservedReduceScatter` with
    ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` on every ``FSDPModule``, and on the
    HSDP units (2-D mesh: the replicated fallback weights) an all-reduce hook
    (``set_all_reduce_hook``) that reports the replicate-dim gradient all-reduce. The comms stay
    installed after a run; with no collective observer they do exactly what FSDP2's defaults do.

    Returns:
        The number of FSDP2 units observed.
    """
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_custom_all_gather(ObservedAllGather())
        unit.set_custom_reduce_scatter(ObservedReduceScatter())
        if _is_hsdp(unit):
            unit.set_all_reduce_hook(_report_hsdp_all_reduce)
    return len(units)


@dataclass(frozen=True)
class WeightGather:
    """One low-precision weight's all-gather inputs on this rank (from ``fsdp_pre_all_gather``).

    Attributes:
        fqn: Parameter FQN (HF name).
        phase: ``"forward"`` or ``"backward"``.
        orientations: MXFP8 orientations carried (HiF8: both, from one ``data``).
        tensors: ``((dtype name, shape), ...)`` of the physical tensors, in slot order.
        bytes: Their total size in bytes.
    """

    fqn: str
    phase: str
    orientations: tuple[str, ...]
    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    bytes: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "fqn": self.fqn,
            "phase": self.phase,
            "orientations": list(self.orientations),
            "tensors": [[dtype, list(shape)] for dtype, shape in self.tensors],
            "bytes": self.bytes,
        }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class WireRecorder:
    """Records what FSDP2 all-gathers and reduce-scatters on this rank (see the module docstring).

    Args:
        plain_dtype: dtype FSDP2 casts plain parameters to before the all-gather (the
            ``MixedPrecisionPolicy.param_dtype`` of the units that hold low-precision weights).
        trace_steps: Number of optimizer steps whose individual events are kept in
            :attr:`trace` (totals are kept for every step).

    Attributes:
        all_gather_bytes: ``{dtype name: bytes}`` over all closed steps.
        reduce_scatter_bytes: ``{dtype name: bytes}`` over all closed steps.
        all_reduce_bytes: ``{dtype name: bytes}`` of every ``all_reduce`` over all closed steps
            (HSDP gradients of replicated fallback weights, HiF8 amax MAX-reduces, norms).
        locally_gathered: FQNs of low-precision weights whose shard group has one rank (replicated
            fallback weights, or a one-process run): FSDP2 unshards them with a local copy.
        steps: Closed optimizer steps.
        high_precision_gathers_of_replaced: See the module docstring (must be 0).
        gathers_per_weight: ``{fqn: {"forward": n, "backward": n}}`` over all closed steps.
        trace: Events of the first ``trace_steps`` steps: ``{"step", "kind", ...}`` dicts.
    """

    def __init__(self, *, plain_dtype: torch.dtype = torch.bfloat16, trace_steps: int = 1) -> None:
        self.plain_dtype = plain_dtype
        self.trace_steps = trace_steps
        self.all_gather_bytes: Counter[str] = Counter()
        self.reduce_scatter_bytes: Counter[str] = Counter()
        self.all_reduce_bytes: Counter[str] = Counter()
        self.locally_gathered: set[str] = set()
        self.steps = 0
        self.high_precision_gathers_of_replaced = 0
        self.gathers_per_weight: dict[str, Counter[str]] = defaultdict(Counter)
        self.trace: list[dict[str, Any]] = []
        self._pending: list[WeightGather] = []
        self._step_ag: Counter[str] = Counter()
        self._step_rs: Counter[str] = Counter()
        self._step_ar: Counter[str] = Counter()
        self._step_local: set[str] = set()
        self._step_hp = 0
        self._step_weights: dict[str, Counter[str]] = defaultdict(Counter)
        self._step_trace: list[dict[str, Any]] = []
        self._paused = False
        self._stack = contextlib.ExitStack()
        self._hooks: list[Any] = []

    # -- observation -------------------------------------------------------------------------------
    def _on_weight_gather(self, gather: Any) -> None:
        if gather.stage != "pre_all_gather":
            return  # the wire carries what the pre hook packed; post events show the rebuilt storage
        outputs, local = gather.tensors, gather.local
        tensors = tuple((_dtype_name(t.dtype), tuple(t.shape)) for t in outputs)
        event = WeightGather(
            fqn=gather.fqn,
            phase=str(gather.phase),
            orientations=tuple(gather.orientations),
            tensors=tensors,
            bytes=sum(t.numel() * t.element_size() for t in outputs),
        )
        if self._paused:
            return
        if local:  # one-rank shard group (replicated fallback, one process): FSDP2 copies, no collective
            self._step_local.add(event.fqn)
        else:
            self._pending.append(event)
        self._step_weights[event.fqn][event.phase] += 1
        if any(t.element_size() > 1 for t in outputs):
            self._step_hp += 1
        if self.steps < self.trace_steps:
            kind = "weight_gather_local" if local else "weight_gather"
            self._step_trace.append({"kind": kind, **event.as_dict()})

    def _on_collective(self, collective: CollectiveEvent) -> None:
        if self._paused:
            self._pending.clear()
            return
        kind, total, dtype = collective.kind, collective.bytes, collective.dtype
        if kind == "reduce_scatter":
            self._step_rs[dtype] += total
            split = {dtype: total}
        elif kind == "all_reduce":
            self._step_ar[dtype] += total
            if self.steps < self.trace_steps:
                self._step_trace.append({"kind": kind, "buffer_dtype": dtype, "bytes": total})
            return
        else:
            low = sum(e.bytes for e in self._pending)
            if dtype == "uint8" and self._pending:
                split = {"uint8": low}
                if total > low:
                    split[_dtype_name(self.plain_dtype)] = total - low
            else:
                split = {dtype: total}
            for key, value in split.items():
                self._step_ag[key] += value
        if self.steps < self.trace_steps:
            self._step_trace.append(
                {
                    "kind": kind,
                    "buffer_dtype": dtype,
                    "bytes": total,
                    "bytes_by_dtype": dict(split),
                    "low_precision_fqns": [e.fqn for e in self._pending],
                }
            )
        self._pending.clear()

    def _check_module_weights(self, module: nn.Module) -> None:
        if self._paused:
            return
        weight_module = sys.modules.get("lp_lightning.tensor.weight")
        names = getattr(type(module), "low_precision_weight_names", ())
        for name in names:
            param = getattr(module, name, None)
            low = weight_module is not None and weight_module.is_low_precision_weight(param)
            if not low:
                self._step_hp += 1
                if self.steps < self.trace_steps:
                    self._step_trace.append(
                        {
                            "kind": "high_precision_weight_in_replaced_module",
                            "module_type": type(module).__name__,
                            "param": name,
                            "dtype": None if param is None else _dtype_name(param.dtype),
                        }
                    )

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self, model: nn.Module | None = None) -> None:
        """Observe the collectives and the low-precision pre-all-gathers (if loaded); hook ``model``.

        ``model``'s FSDP2 units get the reporting comms of :func:`observe_fsdp_collectives`.
        """
        recorder = self
        handle = add_collective_observer(self._on_collective)
        self._stack.callback(handle.remove)
        if model is not None:
            observe_fsdp_collectives(model)

        gather = sys.modules.get("lp_lightning.fsdp.gather")
        if gather is not None:  # the public gather observers (loaded whenever a weight can be gathered)
            handle = gather.add_gather_observer(self._on_weight_gather)
            self._stack.callback(handle.remove)
        if model is not None:
            for _, module in replaced_modules(model):
                self._hooks.append(module.register_forward_pre_hook(lambda m, args: recorder._check_module_weights(m)))

    def stop(self) -> None:
        """Stop observing and remove the hooks (idempotent)."""
        self._stack.close()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def pause(self) -> None:
        """Stop attributing events (validation); they are dropped, not counted."""
        self._paused = True

    def resume(self) -> None:
        """Attribute events again."""
        self._paused = False

    def close_step(self) -> None:
        """Fold the events since the previous call into the totals of one optimizer step."""
        self.all_gather_bytes.update(self._step_ag)
        self.reduce_scatter_bytes.update(self._step_rs)
        self.all_reduce_bytes.update(self._step_ar)
        self.locally_gathered |= self._step_local
        self.high_precision_gathers_of_replaced += self._step_hp
        for fqn, counts in self._step_weights.items():
            self.gathers_per_weight[fqn].update(counts)
        if self.steps < self.trace_steps:
            self.trace.extend({"step": self.steps, **event} for event in self._step_trace)
        self.steps += 1
        self._pending.clear()  # a one-rank group gathers without a collective (FSDP2 copies locally)
        self._step_ag, self._step_rs, self._step_ar = Counter(), Counter(), Counter()
        self._step_local = set()
        self._step_hp = 0
        self._step_weights = defaultdict(Counter)
        self._step_trace = []

    def summary(self) -> dict[str, Any]:
        """``run_summary.json`` ``wire`` section: totals per optimizer step (bytes are averages)."""
        steps = max(self.steps, 1)
        return {
            "all_gather_bytes": {k: v / steps for k, v in sorted(self.all_gather_bytes.items())},
            "reduce_scatter_bytes": {k: v / steps for k, v in sorted(self.reduce_scatter_bytes.items())},
            "all_reduce_bytes": {k: v / steps for k, v in sorted(self.all_reduce_bytes.items())},
            "high_precision_gathers_of_replaced": self.high_precision_gathers_of_replaced,
            "low_precision_weights_gathered": len(self.gathers_per_weight),
            "low_precision_weights_gathered_locally": len(self.locally_gathered),
            "gathers_per_step": {
                phase: sum(c[phase] for c in self.gathers_per_weight.values()) / steps
                for phase in ("forward", "backward")
            },
            "steps": self.steps,
            "bytes_are": "this rank's collective inputs per optimizer step (training steps only)",
        }


@contextlib.contextmanager
def record_wire(model: nn.Module | None = None, **kwargs: Any) -> Iterator[WireRecorder]:
    """``with record_wire(model) as wire: ...; wire.close_step()`` — :class:`WireRecorder` as a context."""
    recorder = WireRecorder(**kwargs)
    recorder.start(model)
    try:
        yield recorder
    finally:
        recorder.stop()
