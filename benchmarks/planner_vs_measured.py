"""The memory planner's per-rank peak against the measured peak of the same ``lp-lightning fit`` run.

For each model (``tiny``: dsv3-tiny; ``mid``: dsv3-tiny widened by :data:`MODELS` overrides, about
20M parameters, so the training state dominates the fixed costs), each process count and each
precision, it runs::

    python -m lp_lightning.cli fit --config configs/dsv3_tiny.yaml --precision P --trainer.devices D \\
        --trainer.max_steps 3 --trainer.callbacks+=lp_lightning.telemetry.TensorMemoryProbe ...

(``OMP_NUM_THREADS=1``, no validation, no checkpoint), reads
``peak_tensor_bytes_outside_emulation_per_rank`` and ``..._by_category`` from its
``run_summary.json`` (the probe's measurement: peak live tensor storages per rank over steps 2-3,
each storage once, taken outside the emulated quantise/GEMM calls, whose results count and whose
working buffers do not; not RSS — see ``lp_lightning/telemetry/memory_probe.py``) and calls
``lp_lightning.planner.plan_memory`` with the same spec, overrides, precision, world size, sequence
length, micro batch and FSDP settings. One JSON row per configuration is printed::

    {"config", "devices", "precision", "predicted_bytes", "measured_bytes" (max over ranks),
     "ratio" (predicted / measured), "within_15pct", "predicted_phase", "measured_phase",
     "measured_per_rank", "measured_all_ops_bytes" / "measured_all_ops_phase" (the peak with the
     eager emulation's working buffers), "components": {name: {"predicted", "measured"}}, "run_dir"}

``components`` puts the planner's components as its peak phase counts them (0 for one the phase
leaves out) next to the probe's at the measured peak (rank of the maximum): ``master``,
``low_precision_storage``, ``optimizer``, ``gradients``, ``all_gather_buffers``,
``unsharded_gradients`` map one to one; the probe's ``activations`` (saved activations, backward,
loss and refresh temporaries) faces the planner's ``activations + loss_logits``.

Then a markdown table (machine, threads, load, measurement) is written to ``--markdown`` and, with
``--readme docs/planner.md``, put into that page ("Planner vs measured") between
``<!-- planner-vs-measured table -->`` and ``<!-- /planner-vs-measured table -->``. ``--reuse``
reads a finished run's ``run_summary.json`` instead of training again (same command), e.g. after a
planner change.

Example (from the repository root; about 15 minutes on 2 busy cores)::

    python benchmarks/planner_vs_measured.py --readme docs/planner.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import torch

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # suite/ and this checkout's lp_lightning
from suite import training  # noqa: E402

from lp_lightning.planner import plan_memory  # noqa: E402

REPO = _HERE.parent
SPEC = "dsv3-tiny"
MODELS: dict[str, dict[str, Any] | None] = {
    "tiny": None,
    # 3 layers as tiny, twice as wide, 4x the FFN: 20.3M parameters (tiny: 3.0M); every GEMM dim a
    # multiple of 64 rows per rank at 2 ranks (kv_a_proj_with_mqa: 224 + 32 = 256 rows)
    "mid": {"hidden_size": 512, "intermediate_size": 2048, "moe_intermediate_size": 512, "num_attention_heads": 8,
            "num_key_value_heads": 8, "kv_lora_rank": 224},
}
SEQ_LEN, GLOBAL_BATCH, STEPS, WARMUP = 256, 4, 3, 1
TOLERANCE = 0.15
MARK_BEGIN, MARK_END = "<!-- planner-vs-measured table -->", "<!-- /planner-vs-measured table -->"
PHASES = {  # planner components in each phase (lp_lightning/planner/memory.py docstring; checked in compare)
    "loss": ("master", "optimizer", "low_precision_storage", "buffers", "gradients", "activations", "loss_logits"),
    "backward": ("master", "optimizer", "low_precision_storage", "buffers", "activations", "all_gather_buffers",
                 "unsharded_gradients"),
    "optimizer_step": ("master", "optimizer", "low_precision_storage", "buffers", "gradients",
                       "optimizer_step_temporaries"),
}
PAIRS = {  # probe component -> planner components
    "master": ("master",), "low_precision_storage": ("low_precision_storage",), "optimizer": ("optimizer",),
    "gradients": ("gradients",), "all_gather_buffers": ("all_gather_buffers",),
    "unsharded_gradients": ("unsharded_gradients",), "activations": ("activations", "loss_logits"),
}


def fit_command(run_dir: Path, model: str, devices: int, precision: str) -> list[str]:
    """The ``lp-lightning fit`` command of one configuration (module docstring)."""
    return training.fit_command(run_dir, precision, devices, STEPS, seq_len=SEQ_LEN, global_batch_size=GLOBAL_BATCH,
                                config_overrides=MODELS[model], memory_warmup=WARMUP)


def measure(run_dir: Path, model: str, devices: int, precision: str, *, reuse: bool) -> dict[str, Any]:
    """Run (or, with ``reuse``, read) one configuration; returns its ``run_summary.json``."""
    command = fit_command(run_dir, model, devices, precision)
    summary_path, command_path = run_dir / "run_summary.json", run_dir / "command.txt"
    if reuse and summary_path.is_file() and command_path.is_file() and command_path.read_text() == shlex.join(command):
        return json.loads(summary_path.read_text())
    return training.run_cli(command, run_dir, training.cli_env(threads=1))


def compare(summary: dict[str, Any], model: str, devices: int, precision: str, run_dir: Path) -> dict[str, Any]:
    """One JSON row: the planner's prediction against the measured peak (module docstring)."""
    per_rank = summary["peak_tensor_bytes_outside_emulation_per_rank"]
    if per_rank is None:
        raise RuntimeError(f"{run_dir}/run_summary.json has no peak_tensor_bytes (the TensorMemoryProbe measured no step).")
    rank = max(range(len(per_rank)), key=per_rank.__getitem__)
    measured_parts = summary["peak_tensor_bytes_outside_emulation_by_category"][rank]
    probe = json.loads((run_dir / "probes" / f"tensor_memory_rank{rank}.json").read_text())
    plan = plan_memory(
        SPEC, precision, devices, seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH // devices,
        activation_checkpoint="off", reshard_after_forward=True, fallback_to_unsharded=False,
        config_overrides=MODELS[model],
    )  # the settings of configs/dsv3_tiny.yaml and of fit_command
    predicted, measured = plan.per_rank_bytes["total"], max(per_rank)
    ratio = predicted / measured
    in_phase = PHASES[plan.peak_phase]
    if sum(plan.per_rank_bytes[p] for p in in_phase) != predicted:
        raise RuntimeError(f"PHASES[{plan.peak_phase!r}] no longer adds up to the planner's total; update it "
                           "from lp_lightning/planner/memory.py.")
    components = {
        name: {"predicted": sum(plan.per_rank_bytes[p] for p in parts if p in in_phase), "measured": measured_parts[name]}
        for name, parts in PAIRS.items()
    }
    return {
        "config": model, "devices": devices, "precision": precision, "predicted_bytes": predicted,
        "measured_bytes": measured, "ratio": round(ratio, 4), "within_15pct": abs(ratio - 1) <= TOLERANCE,
        "predicted_phase": plan.peak_phase, "measured_phase": probe["outside_emulation"]["phase"],
        "measured_per_rank": per_rank, "measured_all_ops_bytes": summary["peak_tensor_bytes"],
        "measured_all_ops_phase": probe["all_ops"]["phase"], "components": components,
        "load_average": summary["load_average"], "threads": summary["threads"], "run_dir": str(run_dir),
    }  # fmt: skip


def _mib(value: int) -> str:
    return f"{value / 2**20:.2f}"


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}, torch {torch.__version__}"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The docs/planner.md tables with their context (machine, threads, load, measurement)."""
    loads = [v[0] for r in rows for v in r["load_average"].values() if v]
    threads = sorted({(r["threads"]["torch_intra_op"], r["threads"]["OMP_NUM_THREADS"]) for r in rows})
    intro = (
        f"Measured with `benchmarks/planner_vs_measured.py` on {_machine()}; torch intra-op threads / "
        f"`OMP_NUM_THREADS` per rank {', '.join(f'{t} / {o}' for t, o in threads)}; 1-minute load average "
        f"{min(loads):.2f}-{max(loads):.2f} during the runs (other jobs shared the cores; memory does not "
        "depend on it). **Measurement**: "
        "`TensorMemoryProbe` (`lp_lightning/telemetry/memory_probe.py`, torch's `FSDPMemTracker`): the peak, "
        "over optimizer steps 2-3, of the live tensor storages of a rank, each storage counted once (views, "
        "FSDP2 shards, an 8-bit weight's master and storage), taken after every op outside the emulated "
        "quantise/GEMM calls (their results counted, their working buffers not: they belong to the CPU "
        "emulation, whose codec runs eager under the tracker); not RSS, no allocator cache; the max over "
        "ranks. `all ops` is the same peak with those working buffers. Settings: `configs/dsv3_tiny.yaml` "
        f"(seq_len {SEQ_LEN}, global batch {GLOBAL_BATCH}: micro batch {GLOBAL_BATCH} / devices, no "
        "activation checkpointing, `reshard_after_forward: true`); `mid` = dsv3-tiny with "
        f"`{json.dumps(MODELS['mid'])}` (20.3M parameters; tiny 3.0M). Measured phases: `other` is the "
        "loss computed outside the model (the planner's `loss` phase), `forward` inside the model's forward, "
        "`after_optimizer_step` the refresh of the 8-bit weights."
    )
    lines = [
        textwrap.fill(intro, width=100, break_on_hyphens=False),
        "",
        "| model | devices | precision | predicted MiB | measured MiB | predicted / measured | within 15% "
        "| predicted phase | measured phase | all ops MiB (phase) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['devices']} | {r['precision']} | {_mib(r['predicted_bytes'])} | "
            f"{_mib(r['measured_bytes'])} | {r['ratio']:.3f} | {'yes' if r['within_15pct'] else '**no**'} | "
            f"{r['predicted_phase']} | {r['measured_phase']} | {_mib(r['measured_all_ops_bytes'])} "
            f"({r['measured_all_ops_phase']}) |"
        )
    names = list(PAIRS)
    lines += [
        "",
        textwrap.fill(
            "Components, predicted / measured MiB: the planner's as its peak phase counts them (0: not in that "
            "phase), the measured ones at the measured peak; `activations` faces the planner's `activations + "
            "loss_logits`; the tracker labels a layer's BF16 gradients `Temp` (in `activations`) until FSDP2's "
            "post-backward takes them:", width=100, break_on_hyphens=False),
        "",
        "| model | devices | precision | " + " | ".join(names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for r in rows:
        cells = [f"{r['components'][n]['predicted'] / 2**20:.1f} / {r['components'][n]['measured'] / 2**20:.1f}"
                 for n in names]
        lines.append(f"| {r['config']} | {r['devices']} | {r['precision']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def insert_into_readme(readme: Path, table: str) -> None:
    """Put ``table`` after the placeholder (replacing an earlier table).

    Raises:
        ValueError: the page has no ``<!-- planner-vs-measured table -->`` line.
    """
    text = readme.read_text()
    if MARK_BEGIN not in text:
        raise ValueError(f"{readme}: no {MARK_BEGIN!r} line to put the table after; add it where the table belongs.")
    head, rest = text.split(MARK_BEGIN, 1)
    tail = rest.split(MARK_END, 1)[1] if MARK_END in rest else rest
    readme.write_text(f"{head}{MARK_BEGIN}\n{table}{MARK_END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,mid", help="comma-separated keys of MODELS")
    parser.add_argument("--devices", default="1,2", help="comma-separated process counts")
    parser.add_argument("--precisions", default="bf16,mxfp8,hif8")
    parser.add_argument("--out", default=str(REPO / "runs" / "planner_vs_measured"), help="folder of the runs")
    parser.add_argument("--markdown", default=None, help="write the table here (default: <out>/table.md)")
    parser.add_argument("--readme", default=None, help="also put the table into this page's markers (docs/planner.md)")
    parser.add_argument("--reuse", action="store_true", help="read finished runs instead of training again")
    args = parser.parse_args(argv)
    out = Path(args.out)
    rows = []
    for model in args.models.split(","):
        for devices in (int(d) for d in args.devices.split(",")):
            for precision in args.precisions.split(","):
                run_dir = out / f"{model}_{devices}p_{precision}"
                start = time.perf_counter()
                summary = measure(run_dir, model, devices, precision, reuse=args.reuse)
                row = compare(summary, model, devices, precision, run_dir)
                row["wall_s"] = round(time.perf_counter() - start, 1)
                print(json.dumps(row), flush=True)
                rows.append(row)
    table = markdown(rows)
    path = Path(args.markdown) if args.markdown else out / "table.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table)
    (out / "rows.json").write_text(json.dumps(rows, indent=1) + "\n")
    if args.readme:
        insert_into_readme(Path(args.readme), table)
    print(table)
    return 0 if all(r["within_15pct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
