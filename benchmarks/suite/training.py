"""``lp-lightning fit`` runs of the suite and the figures read from their ``run_summary.json``.

Every run is the real CLI on the default config (``configs/dsv3_tiny.yaml``: deterministic, FSDP2
with ``reshard_after_forward: true``, seq_len 256, global batch 4) with validation, checkpoints,
logger and progress bar off::

    python -m lp_lightning.cli fit --config configs/dsv3_tiny.yaml --precision P --trainer.devices D \\
        --trainer.max_steps S --trainer.limit_val_batches 0 --checkpoint.every_n_steps 0 ...

Widths other than 256 (dsv3-tiny's) scale every width of the tiny spec with the hidden size
(:func:`overrides_for`); layers, experts, vocabulary and head dims stay. Thread settings: the
product's default (``OMP_NUM_THREADS`` removed from the runs' environment) unless the suite is
given ``--threads``; each run's ``threads`` section is kept in results.json. See
``benchmarks/README.md`` for how each figure is computed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from suite.common import figure, missing, quantiles, spread_of

REPO = Path(__file__).resolve().parents[2]
PRECISIONS = ("bf16", "mxfp8", "hif8")
LOW_PRECISIONS = ("mxfp8", "hif8")
BASE_WIDTH = 256
TARGETS = {"step_time": 1.5, "recompiles": 0, "first_step": 3.0, "thread_thrash": 1.5,
           "wire": {"mxfp8": 0.53, "hif8": 0.51}, "reduce_scatter": 1.0, "memory": 1.0}
THRASH_SPLIT = 20
"""``thread_thrash`` compares steps 1..20 with steps 21.. (issue 14 target 3)."""


def overrides_for(width: int) -> dict[str, int] | None:
    """``--model.config_overrides`` of a width: dsv3-tiny's widths times ``width / 256``.

    Tiny (hidden 256): intermediate 512, moe_intermediate 128, 4 heads, kv_lora_rank 96
    (kv_a_proj_with_mqa out = kv_lora_rank + rope dim 32 = 128). The factor scales the first four and
    keeps ``kv_lora_rank + 32`` a multiple of 128 (224 at 512, 480 at 1024), so every 2-rank row
    shard stays whole MX blocks. ``None`` at 256 (the spec itself, validated).

    Raises:
        ValueError: ``width`` is not 256 times a power of two.
    """
    factor = width // BASE_WIDTH
    if width < BASE_WIDTH or width % BASE_WIDTH or factor & (factor - 1):
        raise ValueError(f"width={width}: use 256 times a power of two (256, 512, 1024, ...).")
    if factor == 1:
        return None
    return {"hidden_size": width, "intermediate_size": 512 * factor, "moe_intermediate_size": 128 * factor,
            "num_attention_heads": 4 * factor, "num_key_value_heads": 4 * factor,
            "kv_lora_rank": 128 * factor - 32}


@dataclasses.dataclass
class Run:
    """One finished ``lp-lightning fit`` run of the suite."""

    kind: str  # "step" (timed) or "memory" (TensorMemoryProbe)
    precision: str
    width: int
    processes: int
    round: int
    steps: int
    run_dir: Path
    wall_s: float
    summary: dict[str, Any]

    def record(self) -> dict[str, Any]:
        """The run's row in results.json ``runs``."""
        s = self.summary
        return {"kind": self.kind, "precision": self.precision, "width": self.width, "processes": self.processes,
                "round": self.round, "steps": self.steps, "wall_s": round(self.wall_s, 1),
                "step_time_s_steady_median": s.get("step_time_s_steady_median"),
                "first_step_s": (s.get("step_times_s") or [None])[0], "threads": s.get("threads"),
                "load_average": s.get("load_average"), "run_dir": str(self.run_dir)}  # fmt: skip

    def steady(self) -> list[float]:
        """The steady step times (``run_summary`` leaves out ``warmup_steps_excluded``)."""
        return self.summary["step_times_s"][self.summary["warmup_steps_excluded"]:]


def fit_command(run_dir: Path, precision: str, processes: int, steps: int, *, seq_len: int | None = None,
                global_batch_size: int | None = None, config_overrides: dict[str, Any] | None = None,
                memory_warmup: int | None = None) -> list[str]:
    """An ``lp-lightning fit`` command on ``configs/dsv3_tiny.yaml`` with validation, checkpoints,
    logger and progress bar off (``None`` keeps the config's value; ``memory_warmup``: add the
    TensorMemoryProbe with that many unmeasured steps and the opt-in wire section; ``config_overrides`` turn spec validation off)."""
    command = [
        sys.executable, "-m", "lp_lightning.cli", "fit", "--config", str(REPO / "configs" / "dsv3_tiny.yaml"),
        "--precision", precision, "--trainer.devices", str(processes), "--trainer.max_steps", str(steps),
        "--trainer.default_root_dir", str(run_dir), "--trainer.limit_val_batches", "0",
        "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--checkpoint.every_n_steps", "0", "--checkpoint.save_last", "false",
    ]  # fmt: skip
    if seq_len is not None:
        command += ["--data.seq_len", str(seq_len)]
    if global_batch_size is not None:
        command += ["--data.global_batch_size", str(global_batch_size)]
    if memory_warmup is not None:
        command += ["--trainer.callbacks+=lp_lightning.telemetry.TensorMemoryProbe",
                    f"--trainer.callbacks.warmup_steps={memory_warmup}",
                    "--run_summary.wire", "true"]  # the memory runs give the wire/* figures too
    if config_overrides is not None:
        command += ["--model.config_overrides", json.dumps(config_overrides), "--model.validate_spec", "false"]
    return command


def cli_env(threads: int | None) -> dict[str, str]:
    """The runs' environment: ``OMP_NUM_THREADS`` removed (``threads`` ``None``: the product's default)
    or set to ``threads``, this checkout first on ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env


def run_cli(command: list[str], run_dir: Path, env: dict[str, str], timeout_s: float = 1800.0) -> dict[str, Any]:
    """Runs ``command`` (writing ``command.txt`` and ``console.log`` into ``run_dir``) and returns the
    ``run_summary.json`` it wrote there.

    Raises:
        RuntimeError: the CLI failed or wrote no summary (the end of its console log is quoted).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    summary_path = run_dir / "run_summary.json"
    summary_path.unlink(missing_ok=True)
    (run_dir / "command.txt").write_text(shlex.join(command))
    with open(run_dir / "console.log", "w") as log:
        proc = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0 or not summary_path.is_file():
        tail = (run_dir / "console.log").read_text()[-2000:]
        raise RuntimeError(f"{shlex.join(command)} exited with {proc.returncode}; console.log ends:\n{tail}")
    return json.loads(summary_path.read_text())


@dataclasses.dataclass
class Runner:
    """Starts the suite's CLI runs under ``work_dir`` with its thread and data settings."""

    work_dir: Path
    threads: int | None = None  # OMP_NUM_THREADS of the runs; None: unset (the product's default)
    seq_len: int | None = None  # None: the config's (256)

    def run(self, kind: str, precision: str, width: int, processes: int, steps: int, round_: int,
            memory_warmup: int | None = None) -> Run:
        """Runs one configuration (:func:`fit_command`, :func:`overrides_for`) and reads its summary."""
        run_dir = self.work_dir / f"{kind}_{precision}_w{width}_p{processes}_r{round_}"
        command = fit_command(run_dir, precision, processes, steps, seq_len=self.seq_len,
                              config_overrides=overrides_for(width), memory_warmup=memory_warmup)
        start = time.perf_counter()
        summary = run_cli(command, run_dir, cli_env(self.threads))
        return Run(kind, precision, width, processes, round_, steps, run_dir, time.perf_counter() - start, summary)


def _by(runs: list[Run], **match: Any) -> list[Run]:
    return [r for r in runs if all(getattr(r, k) == v for k, v in match.items())]


def step_time_figures(runs: list[Run], widths: list[int], processes: list[int]) -> dict[str, Any]:
    """``step_time/<p>/w<width>/p<n>`` and ``step_time_growth/<p>/p<n>`` (benchmarks/README.md "The figures")."""
    figures: dict[str, Any] = {}
    for p in LOW_PRECISIONS:
        for n in processes:
            fitted: list[tuple[int, float]] = []
            for w in widths:
                name = f"step_time/{p}/w{w}/p{n}"
                pairs = [(lp, bf) for lp in _by(runs, kind="step", precision=p, width=w, processes=n)
                         for bf in _by(runs, kind="step", precision="bf16", width=w, processes=n, round=lp.round)]
                if not pairs:
                    figures[name] = missing("not run", target=TARGETS["step_time"], criterion="ratio <= target",
                                            unit="s")
                    continue
                value = statistics.median(lp.summary["step_time_s_steady_median"] for lp, _ in pairs)
                baseline = statistics.median(bf.summary["step_time_s_steady_median"] for _, bf in pairs)
                per_round = [lp.summary["step_time_s_steady_median"] / bf.summary["step_time_s_steady_median"]
                             for lp, bf in pairs]
                lp_steps = [t for lp, _ in pairs for t in lp.steady()]
                bf_steps = [t for _, bf in pairs for t in bf.steady()]
                if len(pairs) > 1:
                    spread = spread_of(per_round, "per-round ratio of steady medians")
                else:  # one round: the widest ratio the two runs' interquartile ranges allow
                    lq, bq = quantiles(lp_steps), quantiles(bf_steps)
                    spread = {"of": "one round: value q1 / baseline q3 .. value q3 / baseline q1", "n": 1,
                              "min": round(lq["q1"] / bq["q3"], 6), "max": round(lq["q3"] / bq["q1"], 6)}
                figures[name] = figure(
                    value, baseline, target=TARGETS["step_time"], criterion="ratio <= target", unit="s", spread=spread,
                    detail={"rounds": len(pairs), "ratio_per_round": [round(x, 4) for x in per_round],
                            "value_steady_s": quantiles(lp_steps), "baseline_steady_s": quantiles(bf_steps),
                            "steps": pairs[0][0].steps,
                            "threads": [lp.summary["threads"]["torch_intra_op"] for lp, _ in pairs]},
                )
                fitted.append((w, figures[name]["ratio"]))
            growth = f"step_time_growth/{p}/p{n}"
            if len(fitted) < 2:
                figures[growth] = missing("fewer than two widths measured: no fit", target=None, criterion=None,
                                          unit="ratio per doubling of width")
                continue
            xs, ys = [math.log2(w) for w, _ in fitted], [r for _, r in fitted]
            mx, my = statistics.fmean(xs), statistics.fmean(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            figures[growth] = figure(
                slope, None, target=None, criterion=None, unit="ratio per doubling of width",
                detail={"fit": "least squares of step_time ratio on log2(width)", "widths": [w for w, _ in fitted],
                        "ratios": [round(y, 4) for y in ys], "intercept_at_log2_width_0": round(my - slope * mx, 4)},
            )
    return figures


def compile_figures(runs: list[Run], anchor: tuple[int, int]) -> dict[str, Any]:
    """``recompiles/<p>`` (every timed run of ``p``), ``first_step/<p>`` (the first anchor run of ``p``
    that is not ``p``'s first run in the suite: its kernels were compiled and cached before)."""
    figures: dict[str, Any] = {}
    for p in PRECISIONS:
        mine = _by(runs, kind="step", precision=p)
        name = f"recompiles/{p}"
        if not mine or any(r.summary.get("compile") is None for r in mine):
            figures[name] = missing("run_summary has no compile section", target=TARGETS["recompiles"],
                                    criterion="value <= target", unit="count")
        else:
            counts = [r.summary["compile"]["recompiles_after_first_step"] for r in mine]
            figures[name] = figure(max(counts), None, target=TARGETS["recompiles"], criterion="value <= target",
                                   unit="count", detail={"max_over_runs": len(mine), "per_run": [
                                       {"width": r.width, "processes": r.processes, "round": r.round,
                                        **r.summary["compile"]} for r in mine]})
        name = f"first_step/{p}"
        timed = _by(runs, kind="step", precision=p)
        second = [r for r in timed if r.width == anchor[0] and r.processes == anchor[1] and r is not timed[0]]
        if not second:
            figures[name] = missing("no second run of the same kernels", target=TARGETS["first_step"],
                                    criterion="ratio <= target", unit="s")
            continue
        r = second[0]
        figures[name] = figure(
            r.summary["step_times_s"][0], r.summary["step_time_s_steady_median"], target=TARGETS["first_step"],
            criterion="ratio <= target", unit="s",
            detail={"run": str(r.run_dir), "width": anchor[0], "processes": anchor[1],
                    "earlier_runs_of_precision": timed.index(r),
                    "first_run_of_precision": {"width": timed[0].width, "processes": timed[0].processes,
                                               "first_step_s": timed[0].summary["step_times_s"][0]}},
        )
    return figures


def thread_figures(runs: list[Run], anchor: tuple[int, int], threads_set: int | None) -> dict[str, Any]:
    """``thread_thrash/<p>``: median of steps 1..20 over median of steps 21.., the worst anchor run."""
    figures: dict[str, Any] = {}
    for p in PRECISIONS:
        name = f"thread_thrash/{p}"
        mine = [r for r in _by(runs, kind="step", precision=p, width=anchor[0], processes=anchor[1])
                if len(r.summary["step_times_s"]) > THRASH_SPLIT]
        if not mine:
            figures[name] = missing(f"no run of more than {THRASH_SPLIT} steps", target=TARGETS["thread_thrash"],
                                    criterion="ratio <= target", unit="s")
            continue
        rows = []
        for r in mine:
            st = r.summary["step_times_s"]
            rows.append((statistics.median(st[:THRASH_SPLIT]) / statistics.median(st[THRASH_SPLIT:]), r))
        ratio, r = max(rows, key=lambda row: row[0])
        st = r.summary["step_times_s"]
        figures[name] = figure(
            statistics.median(st[:THRASH_SPLIT]), statistics.median(st[THRASH_SPLIT:]), target=TARGETS["thread_thrash"],
            criterion="ratio <= target", unit="s", spread=spread_of([x for x, _ in rows], "ratio per run"),
            detail={"worst_of_runs": len(rows), "steps": len(st), "threads": r.summary["threads"],
                    "omp_num_threads_set_by_suite": threads_set, "load_average": r.summary["load_average"]},
        )
    return figures


def _replaced_bf16_bytes_from_numel(summary: dict[str, Any], width: int, processes: int) -> float | None:
    """BF16 bytes of the replaced weights' shards per step: numel × 2 / ranks × gathers per weight."""
    from lp_lightning.models.deepseek_v3.spec import build_meta_model

    modules = dict(build_meta_model("dsv3-tiny", config_overrides=overrides_for(width)).named_modules())
    numel = sum(p.numel() for row in summary["replacement"]["replaced"]
                for p in modules[row["fqn"]].parameters(recurse=False))
    wire = summary["wire"]
    weights = wire["low_precision_weights_gathered"]
    if not weights:
        return None
    gathers = sum(wire["gathers_per_step"].values()) / weights
    return numel * 2 / processes * gathers


def wire_memory_figures(runs: list[Run]) -> dict[str, Any]:
    """``wire/<p>``, ``wire/<p>/reduce_scatter`` and ``memory/<p>`` from the memory runs (2 processes)."""
    figures: dict[str, Any] = {}
    bf16 = _by(runs, kind="memory", precision="bf16")
    for p in LOW_PRECISIONS:
        lp = _by(runs, kind="memory", precision=p)
        names = (f"wire/{p}", f"wire/{p}/reduce_scatter", f"memory/{p}")
        if not lp or not bf16:
            for name, target in zip(names, (TARGETS["wire"][p], TARGETS["reduce_scatter"], TARGETS["memory"])):
                crit = "ratio == target" if name.endswith("scatter") else "ratio <= target"
                figures[name] = missing("memory runs not run", target=target, criterion=crit, unit="bytes")
            continue
        a, b = lp[0].summary, bf16[0].summary
        ag_lp, ag_bf = a["wire"]["all_gather_bytes"], b["wire"]["all_gather_bytes"]
        replaced_bf16 = ag_bf.get("bfloat16", 0.0) - ag_lp.get("bfloat16", 0.0)
        others_equal = {k: v for k, v in ag_lp.items() if k not in ("uint8", "bfloat16")} == \
            {k: v for k, v in ag_bf.items() if k != "bfloat16"}
        figures[names[0]] = figure(
            ag_lp.get("uint8"), replaced_bf16 or None, target=TARGETS["wire"][p], criterion="ratio <= target",
            unit="bytes", detail={
                "per": "rank and optimizer step", "processes": lp[0].processes,
                "reshard_after_forward": (a.get("sharding") or {}).get("reshard_after_forward"),
                "baseline_is": "bf16 run's BF16 all-gather bytes minus this run's BF16 all-gather bytes "
                               "(the weights left in BF16 are gathered alike)",
                "baseline_from_numel": _replaced_bf16_bytes_from_numel(a, lp[0].width, lp[0].processes),
                "other_dtypes_equal": others_equal, "all_gather_bytes": ag_lp, "bf16_all_gather_bytes": ag_bf,
                "gathers_per_step": a["wire"]["gathers_per_step"],
                "high_precision_gathers_of_replaced": a["wire"]["high_precision_gathers_of_replaced"]})
        figures[names[1]] = figure(
            sum(a["wire"]["reduce_scatter_bytes"].values()), sum(b["wire"]["reduce_scatter_bytes"].values()),
            target=TARGETS["reduce_scatter"], criterion="ratio == target", unit="bytes",
            detail={"per": "rank and optimizer step", "reduce_scatter_bytes": a["wire"]["reduce_scatter_bytes"],
                    "bf16_reduce_scatter_bytes": b["wire"]["reduce_scatter_bytes"]})
        key = "peak_tensor_bytes_outside_emulation_per_rank"
        peaks, bf_peaks = a[key], b[key]
        if peaks is None or bf_peaks is None:
            figures[names[2]] = missing("the TensorMemoryProbe measured no step", target=TARGETS["memory"],
                                        criterion="ratio <= target", unit="bytes")
            continue
        storage = [c["low_precision_storage"] for c in a["peak_tensor_bytes_outside_emulation_by_category"]]
        rank = max(range(len(peaks)), key=lambda i: peaks[i] / (bf_peaks[i] + storage[i]))
        figures[names[2]] = figure(
            peaks[rank], bf_peaks[rank] + storage[rank], target=TARGETS["memory"], criterion="ratio <= target",
            unit="bytes", detail={
                "rank": rank, "processes": lp[0].processes, "peak": "outside_emulation (TensorMemoryProbe)",
                "bf16_peak_bytes": bf_peaks[rank], "low_precision_storage_bytes": storage[rank],
                "all_ops_peak_bytes": a["peak_tensor_bytes_per_rank"][rank],
                "bf16_all_ops_peak_bytes": b["peak_tensor_bytes_per_rank"][rank],
                "all_ops_ratio": a["peak_tensor_bytes_per_rank"][rank]
                / (b["peak_tensor_bytes_per_rank"][rank] + storage[rank])})
    return figures
