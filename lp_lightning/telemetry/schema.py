"""The schema of ``run_summary.json``: one typed field per key, with its meaning and unit.

:class:`RunSummary` is what :class:`~lp_lightning.telemetry.summary.RunSummaryCallback` builds at
the end of ``fit``; :meth:`RunSummary.as_dict` is the JSON object, keys in field order. The keys
are a public contract: later issues add keys, never remove them. docs/run_summary.md is generated
from this module (``python -m lp_lightning.telemetry > docs/run_summary.md``; a test keeps the
committed page equal to :func:`schema_markdown`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunSummary", "schema_markdown"]


def _key(doc: str, unit: str = "") -> Any:
    """A required field with its meaning (``doc``) and ``unit`` (empty: none) in the metadata."""
    return field(metadata={"doc": " ".join(doc.split()), "unit": unit})


@dataclass(frozen=True)
class RunSummary:
    """``run_summary.json`` of one ``fit`` call, written by rank 0 (per-rank values are gathered first)."""

    precision: str = _key('`--precision` of the run: `"bf16"`, `"mxfp8"` or `"hif8"`.')
    backend: str = _key(
        'Op backend of the low-precision GEMMs: `"none"` for bf16 (no such GEMM runs), `"emulated"` (CPU and any '
        'device without a hardware kernel) or `"npu"` (torch_npu quant MM/GMM).'
    )
    startup_gate: dict[str, Any] | None = _key(
        "The design spec §15 startup gate: `requested` / `backend` / `device_type` / `format` / `ok` and `checks` "
        '(`[{"name", "seen", "ok", "message"}]`); `null` in bf16 off the npu accelerator (nothing to check).'
    )
    world_size: int = _key("Number of processes (= FSDP2 `dp_shard` mesh size).", "processes")
    steps: int = _key("Optimizer steps run by this `fit` call.", "optimizer steps")
    tokens: int = _key("Tokens trained by this `fit` call, summed over ranks.", "tokens")
    loss_first: float | None = _key(
        "Training loss of the first step of this call (mean over the step's micro-batches and ranks).", "nats/token"
    )
    loss_last: float | None = _key("Training loss of the last step of this call.", "nats/token")
    loss_last_mean: float | None = _key(
        "Mean training loss of the last `loss_last_mean_steps` steps: compare runs on it, not on `loss_last` "
        "(one batch).",
        "nats/token",
    )
    loss_last_mean_steps: int = _key("Steps in `loss_last_mean` (`LOSS_MEAN_STEPS` = 10, or fewer).", "optimizer steps")
    val_loss_last: float | None = _key("Last logged `val/loss` (`null` if validation never ran).", "nats/token")
    tokens_per_s: float | None = _key(
        "Tokens per step / `step_time_s_steady_median`: the steady rate, the first `warmup_steps_excluded` steps "
        "(warm-up, compilation) left out.",
        "tokens/s",
    )
    step_time_s_median: float | None = _key(
        "Median training time of one optimizer step (`step_times_s`): the wall time from the first micro-batch's "
        "`on_train_batch_start` to the last micro-batch's `on_train_batch_end` (forward, backward, reduce-scatter, "
        "optimizer, refresh) less the non-training work inside it (checkpoint saves, state digests, probe sampling: "
        "`non_training_s`), whatever the callback order; never validation.",
        "s",
    )
    step_time_s_steady_median: float | None = _key(
        "The same median without the first `warmup_steps_excluded` steps.", "s"
    )
    warmup_steps_excluded: int = _key(
        "Steps left out of the steady figures (`WARMUP_STEPS` = 5, at most all but one: warm-up and compilation).",
        "optimizer steps",
    )
    threads: dict[str, Any] = _key(
        "`torch_intra_op` / `torch_inter_op` thread counts, `OMP_NUM_THREADS` (`null` when unset), `set_by` "
        '(`"lp-lightning default"`: `fit` on CPU set 1 thread per process because `OMP_NUM_THREADS` was unset, '
        "docs/performance.md) and `cpu_count`."
    )
    determinism: dict[str, Any] = _key(
        "`algorithms` (`torch.use_deterministic_algorithms`), `fill_uninitialized_memory` (`lp-lightning fit` "
        "turns the NaN fill off: docs/performance.md) and `hccl` (`null` off the npu accelerator; else "
        '`requested`, `variable` `"HCCL_DETERMINISTIC"`, `value` the process group started with, `set_by` '
        '`"lp-lightning"` / `"user"` / `"unset"`, `deterministic`: docs/hccl.md).'
    )
    compile: dict[str, int | None] = _key(
        "Rank 0's `compiled_graphs` (torch.compile graphs built during the run: the codec kernels, once per input "
        "dtype) and `recompiles_after_first_step` (graphs built after the first optimizer step; 0 expected).",
        "graphs",
    )
    load_average: dict[str, list[float] | None] = _key(
        "`start` / `end`: the machine's 1/5/15-minute load averages when training started and ended (other jobs on "
        "the cores slow every step)."
    )
    peak_memory_bytes: int = _key(
        "Max over ranks: CPU -> the process's peak RSS (`ru_maxrss`, includes Python and libraries, so it says "
        "nothing about 8-bit savings); CUDA/NPU -> `max_memory_allocated` of the device.",
        "bytes",
    )
    peak_memory_bytes_per_rank: list[int] = _key("The same value of every rank, in rank order.", "bytes")
    peak_memory_source: str = _key('`"ru_maxrss"` or `"max_memory_allocated"`.')
    peak_tensor_bytes: int | None = _key(
        "Max over ranks of the peak live tensor bytes of the measured steps (`TensorMemoryProbe`: live untyped "
        "storages, each once; no allocator cache, no Python objects; the same measurement for bf16 and 8-bit runs), "
        "after every op; `null` (as every `peak_tensor_bytes*` key) unless that probe ran and measured a step.",
        "bytes",
    )
    peak_tensor_bytes_per_rank: list[int] | None = _key("The same value of every rank, in rank order.", "bytes")
    peak_tensor_bytes_by_category: list[dict[str, int]] | None = _key(
        "Per rank (rank order), `{component: bytes}` at that rank's peak: `master`, `low_precision_storage`, "
        "`optimizer`, `gradients`, `all_gather_buffers`, `unsharded_gradients`, `activations`, `buffers` (the "
        "memory planner's components).",
        "bytes",
    )
    peak_tensor_bytes_outside_emulation: int | None = _key(
        "The same peak taken only after ops outside the emulated quantise/GEMM backend calls (their working buffers "
        "left out, their results counted; equal in bf16): the figure to compare with `lp-lightning plan`.",
        "bytes",
    )
    peak_tensor_bytes_outside_emulation_per_rank: list[int] | None = _key(
        "The same value of every rank, in rank order.", "bytes"
    )
    peak_tensor_bytes_outside_emulation_by_category: list[dict[str, int]] | None = _key(
        "Per rank, `{component: bytes}` at that rank's outside-emulation peak.", "bytes"
    )
    tensor_memory_source: str | None = _key(
        "The tracker (`torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`); `null` without a measurement."
    )
    checkpoints: list[str] = _key("Checkpoint folders written by this call, in order.")
    loss_plot: str | None = _key(
        "The PNG of this call's per-step training loss written beside the summary (`loss.png`; "
        "`<summary stem>_loss.png` for another summary name); `null` with `--run_summary.plot false`, on ranks "
        "other than 0, or when it could not be drawn (one warning says why)."
    )
    versions: dict[str, str | None] = _key(
        "`lp_lightning`, `git_commit` (`-dirty` with local changes), `python`, `torch`, `torch_npu`, `cann`, "
        "`lightning`, `transformers` (design spec §17.1; `null` when absent)."
    )
    global_step: int = _key("Optimizer steps of the model after this call (includes resumed ones).", "optimizer steps")
    first_step: int = _key("Global step index of the first step of this call (0 unless resumed).", "optimizer steps")
    losses: list[float] = _key("Per-step training loss of this call.", "nats/token")
    grad_norms: list[float | None] = _key("Per-step pre-clip gradient norm of this call (L2 over all ranks).")
    step_times_s: list[float] = _key(
        "Per-step training times: `step_wall_times_s` less `non_training_s` (the figure every steady statistic and "
        "the acceptance's Q3-11 use; `lp_lightning.telemetry.step_clock`).",
        "s",
    )
    step_wall_times_s: list[float] = _key(
        "Per-step wall times of the same windows, non-training work included (on CUDA/NPU the device is "
        "synchronised at the window's edges).",
        "s",
    )
    non_training_s: list[float] = _key(
        "Per-step seconds of non-training work inside the window (`lp_lightning.observers.non_training` ranges: "
        "`checkpoint_save`, `state_digest`, `probe_sample`; the device synchronised at each range's edges), "
        "subtracted from `step_times_s`.",
        "s",
    )
    non_training: dict[str, Any] = _key(
        '`timing` (`"subtracted"`: non-training work inside a step is measured and subtracted, work between steps '
        "is outside every window), `inside_steps_s` / `outside_steps_s` (`{kind: seconds}` of this rank's "
        "non-training ranges inside / outside the step windows) and `steps_with_non_training` (the step numbers "
        "whose window held some).",
        "s",
    )
    nonfinite: dict[str, Any] | None = _key(
        'The non-finite guard (docs/architecture.md "The non-finite guard"): `max_consecutive_skips` (the limit; '
        "0 = none), `skipped_steps` (steps of this call skipped for a non-finite gradient norm, every precision), "
        '`consecutive_skips` (skipped in a row at the end), `skips` (`[{"step", "reason", "fqn"}]` per skipped step: '
        'the reason — `"non-finite gradient"`, `"non-finite master weight"`, `"gradient norm overflow"` — and the '
        'first offending FQN) and `stopped`: `null`, or why the guard stopped the run (`{"step", "reason", "fqn", '
        '"consecutive_skips", "message", "resume_checkpoint"}`; the summary is then written at the stop).'
    )
    stop_signal: dict[str, Any] | None = _key(
        "`null`, or the stop signal that ended training early, every rank after the same step (docs/outputs.md, "
        '"What holds after each fault"): `{"signal", "step", "checkpoint", "saved", "exit_status"}` — the signal '
        '(`"SIGTERM"`, `"SIGUSR1"`, `"SIGINT"`), the step stopped after, the newest checkpoint on disk (the resume '
        "point; `null`: none), whether it was written at the stop, the exit status (143, or 130 for SIGINT). The "
        "summary is then written at the stop."
    )
    time_shares: dict[str, Any] | None = _key(
        "Rank 0's profiled time shares when a `ProfilerProbe` ran (`null` otherwise): `window` (`[first, last]` "
        'step), `source` (`"device"`: kernel time from the profiler\'s device activity; `"host"`: host ranges — '
        "the compute on the CPU, kernel launches on an asynchronous device), `source_reason`, `shares` and "
        "`categories_s` (`quantize`, `low_precision_mm`, `high_precision_mm`, `all_gather`, `reduce_scatter`, "
        "`other`), `device_s` (kernel seconds of the window; `null` for a host source) and `host_shares` "
        "(`lp_lightning.telemetry.profile_probe`).",
        "s",
    )
    low_precision: dict[str, Any] | None = _key(
        'The policy: `{"enabled", "format", "scaling", "recipe_name"}`; `null` in bf16 (as are `replacement`, '
        "`kernels` and `refresh`: no low-precision weight, GEMM or refresh exists there)."
    )
    replacement: dict[str, Any] | None = _key(
        "The replacement plan's report (`ReplacementReport.as_dict()`: `counts` per rule, `num_replaced` modules, "
        "`low_precision_weights` they hold (an experts module holds two), `replaced` FQNs, `skipped` with reasons); "
        "`null` in bf16 (no plan runs)."
    )
    sharding: dict[str, Any] | None = _key(
        "What the strategy's setup did (`ParallelizationRecord`): `steps`, `mesh_shape`, `reshard_after_forward`, "
        "`param_dtype` / `reduce_dtype`, `fp32_compute_modules`, `low_precision_weights` and "
        '`replicated_low_precision` (`[{"fqn", "reason"}]`: weights kept replicated by '
        "`fsdp_config.fallback_to_unsharded`)."
    )
    kernels: dict[str, Any] | None = _key(
        'Low-precision GEMM events of this call per role (`"dense.fprop"` ... `"grouped.wgrad"`), `backends` / '
        "`formats` (event counts), `unlabelled`, `high_precision_gemms_in_replaced_modules` (must be 0) and "
        "`high_precision_gemms_elsewhere` — those two `null` unless a `HighPrecisionGemmProbe` ran; `null` in bf16.",
        "GEMM calls",
    )
    refresh: dict[str, Any] | None = _key(
        "`per_step` (weight storage builds during each optimizer step of this call; a skipped step has 0), "
        '`per_weight_per_step` (`{"min", "max"}` builds of one weight in one step: 1 and 1), `weights` '
        "(low-precision weights), `skipped_steps` (steps of this call skipped for a non-finite gradient norm), "
        "`startup` / `resume` (full rebuilds after `fully_shard` / a checkpoint load); `null` in bf16.",
        "storage builds",
    )
    wire: dict[str, Any] | None = _key(
        "Opt-in (`--run_summary.wire true`; `null` otherwise): `all_gather_bytes` / `reduce_scatter_bytes` / "
        "`all_reduce_bytes` (dtype name -> bytes of this rank's collective inputs per optimizer step, training "
        "steps only), `high_precision_gathers_of_replaced` (must be 0), `low_precision_weights_gathered` (of which "
        "`..._gathered_locally`: one-rank shard groups, no collective), `gathers_per_step` (forward / backward "
        "weight gathers), `steps`, `bytes_are`; the individual events of the first step are in "
        "`wire_trace_rank<r>.json` next to the summary. In bf16 only the byte maps, `steps` and `bytes_are`. "
        "Counted through FSDP2's public comm hooks and the product's own all-reduce sites, never by replacing "
        "`torch.distributed` functions (`lp_lightning.telemetry.probes`).",
        "bytes per optimizer step",
    )
    layer_numerics: dict[str, Any] | None = _key(
        "Opt-in (a `LayerNumericsProbe` among the callbacks; `null` otherwise), rank 0: `low_precision` (`false` in "
        "bf16: nothing compared), `sample_every`, "
        "`sampled_steps`, `cost_s_per_sampled_step` (the probe's own seconds on a sampled step, left out of "
        "`step_times_s`) and `cost_vs_step_time`, `unmatched_operands` (GEMM operands whose source was not seen: 0 "
        "expected), `nonfinite_outputs`, `worst_sqnr` (the ten FQN/role series of lowest mean GEMM SQNR against BF16) "
        "and `series` (`\"<fqn>/<role>\"`: `steps`, `sqnr_db`, `cosine`, `rel_bias`, `nonfinite` per sampled step; "
        "per operand the worst `flush_frac`, `saturated_frac`, cast `sqnr_db`, `amax` and the scale range in log2), "
        "`plot` (`layer_numerics.png`). Docs: docs/outputs.md \"Per-layer numerics\".",
        "dB, ratios, s",
    )

    def as_dict(self) -> dict[str, Any]:
        """The JSON object: every key, in field order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The summary's keys, in order."""
        return tuple(f.name for f in dataclasses.fields(cls))


_PAGE_HEAD = """\
# run_summary.json

<!-- Generated from lp_lightning/telemetry/schema.py by
     `python -m lp_lightning.telemetry > docs/run_summary.md`; edit the schema, not this page. -->

`lp-lightning fit` writes `<trainer.default_root_dir>/run_summary.json` at the end of every run
(rank 0; `--run_summary.path` moves it). The keys are a public contract: later versions add keys,
never remove them. The summary is one Lightning callback,
`lp_lightning.telemetry.RunSummaryCallback`, that a Python Trainer user adds as any other:

```python
import lightning.pytorch as L

from lp_lightning.lightning import DeepSeekV3LM, FSDP2Strategy, PretrainDataModule, precision_plugin
from lp_lightning.telemetry import RunSummaryCallback

trainer = L.Trainer(
    accelerator="cpu", devices=2, max_steps=20, strategy=FSDP2Strategy(), plugins=[precision_plugin("mxfp8")],
    use_distributed_sampler=False,  # the datamodule slices the global batch per rank
    callbacks=[RunSummaryCallback(path="runs/x/run_summary.json", wire=True)],
)
trainer.fit(DeepSeekV3LM(), datamodule=PretrainDataModule())
```

It reads the step loss and gradient norm from the LightningModule's `last_step_loss` /
`last_grad_norm` (`DeepSeekV3LM`) and the precision and backend from the precision plugin.

**Always on**: steps, losses, gradient norms, step times, tokens/s, memory, versions, format and
backend, the GEMM counts per role and the refresh counts. **Opt-in**: `wire` (`--run_summary.wire
true`, or `run_summary: {wire: true}` in the YAML; `lp-lightning st` turns it on), and the
probe callbacks of `lp_lightning.telemetry` (GEMM and gather traces, scale statistics, step
records, profiles, tensor memory), each added with `--trainer.callbacks+=lp_lightning.telemetry.<Probe>`.
With Fabric, which has no Trainer hooks, the same probes are driven by `fabric.call(...)`
(`lp_lightning.telemetry.probe_callbacks`); `StepRecordProbe` records the per-step loss, gradient
norm, step time, tokens/s and memory there.

| key | type | unit | meaning |
|---|---|---|---|
"""


def _type_name(annotation: Any) -> str:
    return str(annotation).replace("typing.", "").replace("|", "\\|")


def schema_markdown() -> str:
    """docs/run_summary.md: the page head and one table row per :class:`RunSummary` field."""
    rows = []
    for f in dataclasses.fields(RunSummary):
        doc = f.metadata["doc"].replace("|", "\\|")
        rows.append(f"| `{f.name}` | `{_type_name(f.type)}` | {f.metadata['unit'] or '—'} | {doc} |")
    return _PAGE_HEAD + "\n".join(rows) + "\n"
