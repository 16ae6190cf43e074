"""Per-layer numerics of the 8-bit GEMMs during training: :class:`LayerNumericsProbe` (opt-in).

On every sampled step (the first, then every ``sample_every``-th) the probe watches each
low-precision GEMM of the training step through the op layer's public GEMM-operand and quantize
observers (``lp_lightning.ops.add_gemm_operands_observer`` / ``add_quantize_observer``) and compares
it, on the step's real operands, with a BF16 GEMM of the **same high-precision operands** (the
activation or gradient the operand was quantized from; the FP32 master weight in the GEMM view,
gathered whole with ``DTensor.full_tensor`` when it is sharded). Per weight FQN and GEMM role
(``dense_fprop`` … ``grouped_wgrad``), summed over the step's micro-batches (and, with activation
checkpointing, over the recomputed forward too: ``calls`` counts them):

* ``sqnr_db`` = 10·log10(Σ ref² / Σ (out − ref)²), ``cosine`` = Σ out·ref / (‖out‖·‖ref‖),
  ``rel_bias`` = Σ (out − ref) / Σ |ref| (signed: a systematic shift, not noise);
  ``nonfinite`` = elements of the 8-bit result that are NaN/Inf (left out of the sums);
* for each operand (``activation``, ``weight``, ``grad_output``): ``amax`` of the source,
  ``sqnr_db`` of the cast (source against the operand's exact value), ``flush_frac`` (non-zero
  source elements whose cast is 0), ``saturated_frac`` (elements the cast clamped,
  ``FormatSpec.cast_saturated``; ``None`` where the format cannot tell) and ``scale_log2_min`` /
  ``scale_log2_max`` (the operand's scales as powers of two: the E8M0 range of an MXFP8 operand).

Logged through the run's loggers as ``probe/layer_numerics/<fqn>/<role>/<metric>`` and
``probe/layer_numerics/<fqn>/<role>/<operand>.<metric>`` at the step; written per rank to
``<out_dir>/layer_numerics_rank<r>.json`` (every sampled step); summarised (rank 0) in
``run_summary.json`` ``layer_numerics`` with the worst ten FQN×role series, drawn into
``<out_dir>/layer_numerics.png``. Docs: docs/outputs.md "Per-layer numerics".

**No effect on training.** Everything runs on detached tensors under ``no_grad`` after the GEMM
returned; no RNG is drawn and the codecs run eagerly (the same bits as compiled, by the formats'
contract) so no graph is traced after the first step; the master gather is a read. The trained
values are bitwise those of the run without the probe (tests/telemetry/test_layer_numerics.py).
Its work runs inside ``observers.non_training("probe_sample")`` ranges, so step times leave it out;
its own seconds per sampled step are recorded (``cost_s``). On a sampled step it keeps the quantized
activations' sources alive until backward (memory up to one BF16 copy of the saved activations).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import torch

from lp_lightning.observers import non_training
from lp_lightning.telemetry.probe_base import ProbeCallback, StepInfo

__all__ = ["GEMM_METRICS", "OPERAND_METRICS", "OPERAND_NAMES", "LayerNumericsProbe", "reference_gemm"]

GEMM_METRICS = ("sqnr_db", "cosine", "rel_bias", "nonfinite")
OPERAND_METRICS = ("amax", "sqnr_db", "flush_frac", "saturated_frac", "scale_log2_min", "scale_log2_max")
OPERAND_NAMES: dict[str, tuple[str, str]] = {
    "dense_fprop": ("activation", "weight"),  # y = x · wᵀ (NT)
    "dense_dgrad": ("grad_output", "weight"),  # dx = dy · w (NN)
    "dense_wgrad": ("grad_output", "activation"),  # dw = dyᵀ · x (TN)
    "grouped_fprop": ("activation", "weight"),  # y_g = x_g · W_g (NN)
    "grouped_dgrad": ("grad_output", "weight"),  # dx_g = dy_g · W_gᵀ (NT)
    "grouped_wgrad": ("activation", "grad_output"),  # dW_g = x_gᵀ · dy_g (TN)
}
"""``(left, right)`` tensor of each GEMM role (the GEMM contract of ``lp_lightning.ops``)."""
WORST = 10


def _op(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    return t.transpose(-1, -2) if transposed else t


def reference_gemm(left: torch.Tensor, right: torch.Tensor, layout: str, group_list: torch.Tensor | None,
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``op(left) · op(right)`` of high-precision operands cast to ``dtype`` (a BF16 GEMM: FP32
    accumulation, one rounding to BF16), per group for a grouped GEMM; the result in FP32.

    Shapes as ``low_precision_matmul`` / ``low_precision_grouped_matmul``: dense 2-D; grouped ``left``
    ``[T, K]`` (token-sorted) with ``right`` ``[E, K, N]`` (``NN``/``NT``) or ``[T, N]`` (``TN``, giving
    ``[E, K, N]``).
    """
    a, b = left.to(dtype), right.to(dtype)
    if group_list is None:
        return (_op(a, layout[0] == "T") @ _op(b, layout[1] == "T")).to(torch.float32)
    counts = [int(c) for c in group_list.tolist()]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    if layout == "TN":
        out = torch.zeros(len(counts), a.shape[1], b.shape[1], dtype=torch.float32, device=a.device)
        for g, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
            out[g] = (a[lo:hi].transpose(0, 1) @ b[lo:hi]).to(torch.float32)
        return out
    n = b.shape[-2] if layout[1] == "T" else b.shape[-1]
    out = torch.zeros(a.shape[0], n, dtype=torch.float32, device=a.device)
    for g, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
        if hi > lo:
            out[lo:hi] = (a[lo:hi] @ _op(b[g], layout[1] == "T")).to(torch.float32)
    return out


def _key(t: torch.Tensor) -> tuple[Any, ...]:
    """Identity of an operand's data: storage, offset, shape, stride (a saved-for-backward copy of the
    same tensor has the same key)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _sqnr_db(signal2: float, error2: float) -> float | None:
    """10·log10(Σ signal² / Σ error²): ``inf`` for an exact result, ``None`` without signal."""
    if signal2 <= 0:
        return None
    return math.inf if error2 == 0 else 10 * math.log10(signal2 / error2)


class _GemmSums:
    """Sufficient statistics of one FQN × role over a step."""

    __slots__ = ("calls", "dot", "err", "err2", "nonfinite", "out2", "ref2", "ref_abs")

    def __init__(self) -> None:
        self.calls = self.nonfinite = 0
        self.dot = self.err = self.err2 = self.out2 = self.ref2 = self.ref_abs = 0.0

    def add(self, out: torch.Tensor, ref: torch.Tensor) -> None:
        out = out.to(torch.float32)
        finite = torch.isfinite(out) & torch.isfinite(ref)
        self.calls += 1
        self.nonfinite += int((~torch.isfinite(out)).sum())
        o, r = out[finite].to(torch.float64), ref[finite].to(torch.float64)
        e = o - r
        self.dot += float((o * r).sum())
        self.out2 += float((o * o).sum())
        self.ref2 += float((r * r).sum())
        self.err2 += float((e * e).sum())
        self.err += float(e.sum())
        self.ref_abs += float(r.abs().sum())

    def metrics(self) -> dict[str, float | None]:
        sqnr = _sqnr_db(self.ref2, self.err2)
        norm = math.sqrt(self.out2 * self.ref2)
        return {"sqnr_db": sqnr, "cosine": self.dot / norm if norm > 0 else None,
                "rel_bias": self.err / self.ref_abs if self.ref_abs > 0 else None, "nonfinite": float(self.nonfinite)}


class _OperandSums:
    """Cast statistics of one operand (FQN × role × side) over a step."""

    __slots__ = ("amax", "err2", "flushed", "nonzero", "numel", "saturated", "scale_max", "scale_min", "src2")

    def __init__(self) -> None:
        self.amax = self.err2 = self.src2 = 0.0
        self.flushed = self.nonzero = self.numel = 0
        self.saturated: int | None = 0
        self.scale_min, self.scale_max = math.inf, -math.inf

    def add(self, operand: Any, source: torch.Tensor) -> None:
        spec = operand.format
        src = source.to(torch.float32)
        value = spec.dequantize(operand).to(torch.float32).reshape(src.shape)
        finite = torch.isfinite(src)
        self.numel += src.numel()
        self.amax = max(self.amax, float(src[finite].abs().max()) if bool(finite.any()) else 0.0)
        s, v = src[finite].to(torch.float64), value[finite].to(torch.float64)
        self.src2 += float((s * s).sum())
        self.err2 += float(((s - v) ** 2).sum())
        nonzero = src != 0
        self.nonzero += int(nonzero.sum())
        self.flushed += int((nonzero & (value == 0)).sum())
        clipped = spec.cast_saturated(operand, source)
        self.saturated = None if clipped is None or self.saturated is None else self.saturated + int(clipped.sum())
        scale = operand.scale.to(torch.float32)
        scale = scale[torch.isfinite(scale) & (scale > 0)]
        if scale.numel():
            self.scale_min = min(self.scale_min, float(torch.log2(scale.min())))
            self.scale_max = max(self.scale_max, float(torch.log2(scale.max())))

    def metrics(self) -> dict[str, float | None]:
        sqnr = _sqnr_db(self.src2, self.err2)
        return {"amax": self.amax, "sqnr_db": sqnr,
                "flush_frac": self.flushed / self.nonzero if self.nonzero else 0.0,
                "saturated_frac": None if self.saturated is None else self.saturated / max(1, self.numel),
                "scale_log2_min": self.scale_min if math.isfinite(self.scale_min) else None,
                "scale_log2_max": self.scale_max if math.isfinite(self.scale_max) else None}


def _finite(value: float | None) -> float | None:
    """JSON-safe: ``inf`` (an exact GEMM) becomes ``None`` in files, never in comparisons."""
    return value if value is None or math.isfinite(value) else None


class LayerNumericsProbe(ProbeCallback):
    """Per-layer SQNR / cosine / relative bias of every 8-bit GEMM against BF16, and the casts' amax,
    flush, saturation and scale range, on sampled steps (module docstring; docs/outputs.md).

    Add it with ``--trainer.callbacks+=lp_lightning.telemetry.LayerNumericsProbe
    --trainer.callbacks.sample_every=50``. In a bf16 run there is nothing to compare: the file says so.

    Args:
        out_dir: Folder of ``layer_numerics_rank<r>.json`` and ``layer_numerics.png``;
            ``null`` = ``<trainer.default_root_dir>/probes``.
        sample_every: The first step and every multiple of this are sampled.
        log_operands: Also log the per-operand metrics (6 per operand; the GEMM metrics always are).
        plot: Draw ``layer_numerics.png`` (rank 0) at the end.

    Raises:
        ValueError: ``sample_every`` is not an int >= 1.
    """

    kind: ClassVar[str] = "layer_numerics"

    def __init__(self, out_dir: str | None = None, sample_every: int = 50, log_operands: bool = True,
                 plot: bool = True) -> None:
        super().__init__(out_dir=out_dir, sample_every=sample_every)
        self.log_operands = bool(log_operands)
        self.plot = bool(plot)
        self.steps_recorded: list[dict[str, Any]] = []
        self.plot_path: Path | None = None
        self._reset_step()

    # -- the step's state ------------------------------------------------------------------------
    def _reset_step(self) -> None:
        self._masters: dict[str, torch.Tensor] = {}
        self._sources: dict[tuple[Any, ...], tuple[torch.Tensor, int, torch.Tensor]] = {}
        self._gemms: dict[tuple[str, str], _GemmSums] = {}
        self._operands: dict[tuple[str, str, str], _OperandSums] = {}
        self._unmatched: dict[str, int] = {}
        self._stale = 0
        self._cost = 0.0
        self._step_handles: list[Any] = []

    @contextmanager
    def _costed(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with non_training("probe_sample"), torch.no_grad():
                recorders = self._recorders()
                eager = recorders.compiled_kernels_enabled()
                recorders.set_compiled_kernels(False)  # eager codecs: no graph traced by the probe
                try:
                    yield
                finally:
                    recorders.set_compiled_kernels(eager)
        finally:
            self._cost += time.perf_counter() - start

    def _gather_masters(self) -> None:
        """Every low-precision weight's FP32 master, whole, in its GEMM view, by the weight's FQN."""
        from torch.distributed.tensor import DTensor

        recorders = self._recorders()
        for _, param in self._model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            if not recorders.is_low_precision_weight(local) or getattr(local, "master", None) is None:
                continue
            master = local.master.detach()
            if isinstance(param, DTensor):
                master = DTensor.from_local(master, param.device_mesh, param.placements, run_check=False,
                                            shape=param.shape, stride=param.stride()).full_tensor()
            dense = getattr(local.kind, "value", local.kind) == "dense"
            self._masters[local.fqn] = master if dense else master.transpose(-1, -2)

    # -- observers -------------------------------------------------------------------------------
    def _on_quantize(self, event: Any) -> None:
        if not self.sampled or event.role in (None, "weight"):
            return
        source = event.input.detach()
        for operand in event.operands:
            self._sources[_key(operand.data)] = (source, source._version, operand.data)

    def _source(self, operand: Any, name: str, fqn: str) -> torch.Tensor | None:
        if name == "weight":
            master = self._masters.get(fqn)
            return master if master is not None and tuple(master.shape) == tuple(operand.shape) else None
        entry = self._sources.get(_key(operand.data))
        if entry is None:
            return None
        source, version, _ = entry
        if source._version != version:  # written in place after the cast: not the operand's source any more
            self._stale += 1
            return None
        return source

    def _on_gemm(self, event: Any) -> None:
        if not self.sampled or event.gemm_role is None or event.weight_fqn is None:
            return
        role, fqn = event.gemm_role.value, event.weight_fqn
        with self._costed():
            names = OPERAND_NAMES[role]
            sources = [self._source(op, name, fqn) for op, name in zip((event.left, event.right), names)]
            for operand, name, source in zip((event.left, event.right), names, sources):
                if source is None:
                    self._unmatched[f"{role}.{name}"] = self._unmatched.get(f"{role}.{name}", 0) + 1
                    continue
                self._operands.setdefault((fqn, role, name), _OperandSums()).add(operand, source)
            if all(s is not None for s in sources):
                ref = reference_gemm(sources[0], sources[1], event.layout, event.group_list)
                self._gemms.setdefault((fqn, role), _GemmSums()).add(event.output, ref)

    # -- probe hooks -----------------------------------------------------------------------------
    def _on_start(self) -> None:
        self.steps_recorded = []
        self._reset_step()
        if not self._low_precision and self._rank == 0:
            print("lp-lightning: LayerNumericsProbe: this run has no 8-bit GEMM (bf16); it records nothing.")

    def _on_step_start(self) -> None:
        if not self.sampled or not self._low_precision or self._model is None:
            return
        recorders = self._recorders()
        with self._costed():
            self._gather_masters()
        self._step_handles = [recorders.add_quantize_observer(self._on_quantize),
                              recorders.add_gemm_operands_observer(self._on_gemm)]

    def _close_observers(self) -> None:
        for handle in self._step_handles:
            handle.remove()
        self._step_handles = []

    def _on_step_end(self, info: StepInfo) -> dict[str, float | None]:
        self._close_observers()
        if not self._sampled or not self._low_precision:
            self._reset_step()
            return {}
        record: dict[str, Any] = {"step": info.step, "cost_s": round(self._cost, 4),
                                  "step_time_s": round(info.step_time_s, 4), "unmatched_operands": dict(self._unmatched),
                                  "stale_sources": self._stale, "gemms": {}}
        scalars: dict[str, float | None] = {}
        for (fqn, role), sums in sorted(self._gemms.items()):
            entry: dict[str, Any] = {"calls": sums.calls, **sums.metrics(), "operands": {}}
            for metric in GEMM_METRICS:
                scalars[f"{self.kind}/{fqn}/{role}/{metric}"] = _finite(entry[metric])
            for name in OPERAND_NAMES[role]:
                op = self._operands.get((fqn, role, name))
                if op is None:
                    continue
                entry["operands"][name] = op.metrics()
                if self.log_operands:
                    for metric in OPERAND_METRICS:
                        scalars[f"{self.kind}/{fqn}/{role}/{name}.{metric}"] = _finite(entry["operands"][name][metric])
            record["gemms"][f"{fqn}/{role}"] = entry
        self.steps_recorded.append(_json_safe(record))
        self._reset_step()
        return scalars

    def _on_stop(self) -> None:
        self._close_observers()
        self._reset_step()

    def _payload(self) -> dict[str, Any]:
        if self.plot and self._rank == 0 and self.steps_recorded and self._dir is not None:
            try:
                self.plot_path = write_plot(self.summary(), self._dir / f"{self.kind}.png")
            except Exception as err:  # noqa: BLE001 - matplotlib missing or a full disk: the record stays
                self.plot_path = None
                print(f"lp-lightning: layer numerics plot not written ({type(err).__name__}: {err}).")
        return {"low_precision": self._low_precision, "records": self.steps_recorded,
                "plot": str(self.plot_path) if self.plot_path else None}

    # -- the run summary -------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """The ``run_summary.json`` ``layer_numerics`` section (this rank): the series per FQN×role of the
        GEMM metrics, per operand the worst flush and saturation shares, the ten lowest-SQNR series and
        the cost per sampled step."""
        series: dict[str, dict[str, Any]] = {}
        for record in self.steps_recorded:
            for name, entry in record["gemms"].items():
                s = series.setdefault(name, {"steps": [], **{m: [] for m in GEMM_METRICS}, "operands": {}})
                s["steps"].append(record["step"])
                for m in GEMM_METRICS:
                    s[m].append(entry[m])
                for op_name, op in entry["operands"].items():
                    o = s["operands"].setdefault(op_name, {"flush_frac_max": 0.0, "saturated_frac_max": 0.0,
                                                           "sqnr_db_min": None, "amax_max": 0.0,
                                                           "scale_log2_min": None, "scale_log2_max": None})
                    o["flush_frac_max"] = max(o["flush_frac_max"], op["flush_frac"] or 0.0)
                    o["saturated_frac_max"] = (None if op["saturated_frac"] is None or o["saturated_frac_max"] is None
                                               else max(o["saturated_frac_max"], op["saturated_frac"]))
                    o["sqnr_db_min"] = _min(o["sqnr_db_min"], op["sqnr_db"])
                    o["amax_max"] = max(o["amax_max"], op["amax"] or 0.0)
                    o["scale_log2_min"] = _min(o["scale_log2_min"], op["scale_log2_min"])
                    o["scale_log2_max"] = _max(o["scale_log2_max"], op["scale_log2_max"])

        def mean_sqnr(name: str) -> float:
            values = [v for v in series[name]["sqnr_db"] if v is not None]
            return statistics.fmean(values) if values else math.inf

        worst = sorted(series, key=mean_sqnr)[:WORST]
        costs = [r["cost_s"] for r in self.steps_recorded]
        times = [r["step_time_s"] for r in self.steps_recorded if r["step_time_s"]]
        return {
            "low_precision": self._low_precision,  # False: a bf16 run, nothing to compare
            "sample_every": self.sample_every,
            "sampled_steps": [r["step"] for r in self.steps_recorded],
            "cost_s_per_sampled_step": round(statistics.median(costs), 4) if costs else None,
            "cost_vs_step_time": round(statistics.median(costs) / statistics.median(times), 3) if costs and times else None,
            "unmatched_operands": sum(sum(r["unmatched_operands"].values()) for r in self.steps_recorded),
            "nonfinite_outputs": sum(int(v or 0) for s in series.values() for v in s["nonfinite"]),
            "worst_sqnr": [{"series": name, "sqnr_db_mean": _finite(round(mean_sqnr(name), 3)),
                            "sqnr_db_min": _round3(_min(None, *series[name]["sqnr_db"]))} for name in worst],
            "series": series,
            "plot": str(self.plot_path) if self.plot_path else None,
        }


def _round3(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _min(*values: float | None) -> float | None:
    finite = [v for v in values if v is not None]
    return min(finite) if finite else None


def _max(*values: float | None) -> float | None:
    finite = [v for v in values if v is not None]
    return max(finite) if finite else None


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, float):
        return _finite(round(value, 6))
    return value


def write_plot(summary: dict[str, Any], path: Path) -> Path:
    """The ten lowest-SQNR FQN×role series: GEMM SQNR (dB) and relative bias against BF16 per sampled step."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 8.5), dpi=100)
    top, bottom = fig.subplots(2, 1, sharex=True)
    for item in summary["worst_sqnr"]:
        s = summary["series"][item["series"]]
        top.plot(s["steps"], [math.nan if v is None else v for v in s["sqnr_db"]], marker="o", markersize=3,
                 label=item["series"])
        bottom.plot(s["steps"], [math.nan if v is None else v for v in s["rel_bias"]], marker="o", markersize=3)
    top.set_ylabel("GEMM SQNR vs BF16 (dB)")
    bottom.set_ylabel("relative bias Σ(out−ref)/Σ|ref|")
    bottom.axhline(0, color="black", linewidth=0.5)
    bottom.set_xlabel("optimizer step")
    top.set_title(f"Per-layer numerics: the {len(summary['worst_sqnr'])} lowest-SQNR weight × GEMM role series",
                  fontsize=10)
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.legend(*top.get_legend_handles_labels(), fontsize=7, loc="lower center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0.17, 1, 1))  # the legend below the axes, off the curves
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
