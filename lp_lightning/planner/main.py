"""``lp-lightning plan``: will a run fit the device? Per-rank memory on the meta model (docs/planner.md).

Examples::

    lp-lightning plan --spec dsv3-16b --precision mxfp8 --world-size 8
    lp-lightning plan --config configs/dsv3_16b_hif8.yaml --activation-checkpoint full --json
    lp-lightning plan --spec dsv3-tiny --precision mxfp8 --world-size 4 --seq-len 256 --micro-batch-size 2
    lp-lightning plan --config configs/dsv3_tiny.yaml --precision mxfp8 --trainer.devices 2

Without ``--config`` the defaults are the design spec's 16B node (``configs/dsv3_16b_bf16.yaml``):
``dsv3-16b``, bf16, 8 ranks, 4096 tokens × 1 sequence per rank, no recompute,
``reshard_after_forward``, no fallback, 96 GiB. ``--config`` takes the spec, precision, world size
(``trainer.devices × num_nodes`` or ``fsdp_config.dp_shard_size``), ``data.seq_len``, the global batch,
``model.activation_checkpoint``, ``model.config_overrides`` and the ``fsdp_config`` flags from an
``lp-lightning fit`` YAML (parsed and checked as ``fit`` parses it, with ``--trainer.devices`` /
``--trainer.num_nodes`` passed on to it); options given on the command line win. With a YAML the micro
batch is the one ``fit`` would run at the planned world size, ``data.global_batch_size //
(accumulate_grad_batches × world size)``, unless ``--micro-batch-size`` is given. Without one,
``--trainer.devices N`` (× ``--trainer.num_nodes``) is another way to say ``--world-size``.

Exit status: 0 when the run fits the budget and can start, 1 when it does not fit or cannot start
(``fallback_to_unsharded: false`` with a weight no dim can shard), 2 on a bad option.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

from jsonargparse import ActionYesNo, ArgumentParser

from lp_lightning.usage import usage_error_text
from lp_lightning.planner.memory import COMPONENTS, DEFAULT_BUDGET_BYTES, MemoryPlan, plan_memory

__all__ = ["DEFAULTS", "build_parser", "format_plan", "plan_main"]

PROG = "lp-lightning plan"
GIB = 2**30

DEFAULTS: dict[str, Any] = {
    "spec": "dsv3-16b",
    "precision": "bf16",
    "world_size": 8,
    "seq_len": 4096,
    "micro_batch_size": 1,
    "activation_checkpoint": "off",
    "reshard_after_forward": True,
    "fallback_to_unsharded": False,
    "input_dim_sharding": True,
    "config_overrides": None,
}
"""Settings without ``--config``: the design spec's 16B node (module docstring)."""

_DESCRIPTIONS = {
    "master": "FP32 master shards",
    "optimizer": "AdamW exp_avg + exp_avg_sq (FP32)",
    "gradients": "FP32 sharded gradients",
    "low_precision_storage": "8-bit shards + scales",
    "buffers": "model buffers",
    "all_gather_buffers": "gathered units in flight",
    "unsharded_gradients": "gradients before reduce-scatter",
    "activations": "saved for backward",
    "loss_logits": "logits around the loss",
    "optimizer_step_temporaries": "AdamW foreach temporaries",
}

_SPELLINGS = ("world_size", "seq_len", "micro_batch_size", "activation_checkpoint", "budget_gib", "config_overrides")


def build_parser() -> ArgumentParser:
    """The jsonargparse parser of ``lp-lightning plan`` (underscore and hyphen spellings)."""
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], exit_on_error=False)

    def option(name: str, **kwargs: Any) -> None:
        names = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if name in _SPELLINGS else [])
        parser.add_argument(*names, **kwargs)

    option("config", type=Optional[str], default=None,
           help="An lp-lightning fit YAML to take the run's settings from (explicit options win).")
    option("spec", type=Optional[str], default=None, help="Built-in model spec (default dsv3-16b).")
    option("precision", type=Optional[str], default=None, help="bf16, mxfp8 or hif8 (default bf16).")
    option("world_size", type=Optional[int], default=None, help="FSDP2 ranks (default 8).")
    option("seq_len", type=Optional[int], default=None, help="Tokens per sequence (default 4096).")
    option("micro_batch_size", type=Optional[int], default=None, help="Sequences per rank per micro-batch (default 1).")
    option("activation_checkpoint", type=Optional[str], default=None, help="off or full (default off).")
    parser.add_argument("--reshard_after_forward", "--reshard-after-forward", action=ActionYesNo, default=None,
                        help="FSDP2 reshard_after_forward (default true; --no_reshard_after_forward).")
    parser.add_argument("--fallback_to_unsharded", "--fallback-to-unsharded", action=ActionYesNo, default=None,
                        help="Replicate the weights no dim can shard instead of failing at startup (default false).")
    parser.add_argument("--input_dim_sharding", "--input-dim-sharding", action=ActionYesNo, default=None,
                        help="Shard dim-0 rule breakers along their input dim (default true; --no_input_dim_sharding).")
    parser.add_argument("--trainer.devices", type=Optional[Union[int, str]], default=None,
                        help="As for lp-lightning fit: processes per node (the world size is devices x num_nodes).")
    parser.add_argument("--trainer.num_nodes", type=Optional[int], default=None, help="As for lp-lightning fit.")
    option("budget_gib", type=Optional[float], default=None, help="Device memory budget in GiB (default 96).")
    option("config_overrides", type=Optional[dict], default=None,
           help='JSON object of DeepseekV3Config fields applied on top of the spec, e.g. \'{"num_hidden_layers": 4}\'.')
    parser.add_argument("--json", action="store_true", help="Print the MemoryPlan JSON only.")
    return parser


FitConfigReader = Callable[[str, Sequence[str]], dict[str, Any]]
"""``read(path, fit_options)``: the plan settings of an ``lp-lightning fit`` YAML (``cli.fit.plan_settings``)."""


def plan_main(argv: list[str] | None = None, *, read_fit_config: FitConfigReader | None = None) -> int:
    """Run ``lp-lightning plan`` with ``argv`` (the arguments after ``plan``).

    Args:
        argv: Arguments; ``None`` reads ``sys.argv[1:]``.
        read_fit_config: Turns an ``lp-lightning fit`` YAML path and fit options (``--trainer.devices``,
            ``--trainer.num_nodes``) into plan settings, which include ``global_batch_size`` and
            ``accumulate_grad_batches`` (the entry point passes one built on its own parser); ``None``:
            ``--config`` is refused.

    Returns:
        Exit status (module docstring). Errors go to stderr.
    """
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    except argparse.ArgumentError as err:
        return _usage_error(str(err))
    settings = dict(DEFAULTS)
    devices, num_nodes = args.trainer.devices, args.trainer.num_nodes
    fit_options = [f"--trainer.{key}={value}" for key, value in (("devices", devices), ("num_nodes", num_nodes))
                   if value is not None]
    batch: tuple[int, int] | None = None  # (global batch, accumulation) of the fit YAML
    if args.config is not None:
        if read_fit_config is None:
            return _usage_error("--config needs the lp-lightning entry point (run `lp-lightning plan --config ...`).")
        try:
            fit = dict(read_fit_config(args.config, fit_options))
        except (OSError, TypeError, ValueError) as err:
            return _usage_error(f"--config {args.config!r}: {err}")
        except SystemExit as stop:  # the fit parser printed why
            return stop.code if isinstance(stop.code, int) and stop.code else 2
        batch = (fit.pop("global_batch_size"), fit.pop("accumulate_grad_batches"))
        settings.update(fit)
    elif fit_options:
        if not isinstance(devices, int) or devices < 1:
            return _usage_error(f"--trainer.devices {devices!r}: without --config, give a number of processes >= 1.")
        settings["world_size"] = devices * (num_nodes or 1)
    explicit = {key: getattr(args, key) for key in DEFAULTS if getattr(args, key) is not None}
    if fit_options and args.world_size is not None and args.world_size != settings.get("world_size"):
        return _usage_error(f"--world-size {args.world_size} disagrees with --trainer.devices {devices} x "
                            f"--trainer.num_nodes {num_nodes or 1}; give one of them.")
    settings.update(explicit)
    if batch is not None and "micro_batch_size" not in explicit:
        global_batch, accumulation = batch
        divisor = accumulation * settings["world_size"]
        if global_batch % divisor:
            return _usage_error(
                f"data.global_batch_size={global_batch} of {args.config!r} does not split over "
                f"trainer.accumulate_grad_batches ({accumulation}) x world size ({settings['world_size']}) = {divisor}, "
                "so fit would refuse it; plan another world size, or give --micro-batch-size."
            )
        settings["micro_batch_size"] = global_batch // divisor
    budget = DEFAULT_BUDGET_BYTES if args.budget_gib is None else round(args.budget_gib * GIB)
    try:
        plan = plan_memory(
            settings.pop("spec"), settings.pop("precision"), settings.pop("world_size"), budget_bytes=budget, **settings
        )
    except ValueError as err:
        return _usage_error(str(err))
    print(plan.to_json() if args.json else format_plan(plan))
    return 0 if plan.fits and plan.launchable else 1


def _usage_error(message: str) -> int:
    sys.stderr.write(usage_error_text(PROG, message))
    return 2


def _gib(value: float) -> str:
    return f"{value / GIB:9.2f}"


def format_plan(plan: MemoryPlan) -> str:
    """The human report: per-rank table, budget line, bytes per parameter, placements summary."""
    run = plan.run
    fmt = f" ({run['format']})" if run["format"] else ""
    lines = [
        f"{PROG}: {run['spec']}, {run['precision']}{fmt}, {run['world_size']} rank(s), seq_len {run['seq_len']} x "
        f"micro batch {run['micro_batch_size']}, activation_checkpoint {run['activation_checkpoint']}, "
        f"reshard_after_forward {str(run['reshard_after_forward']).lower()}, "
        f"fallback_to_unsharded {str(run['fallback_to_unsharded']).lower()}"
        f"{'' if run.get('input_dim_sharding', True) else ', input_dim_sharding false'} (meta model: nothing allocated)",
        "",
        f"{'per-rank memory (rank 0)':<63}{'GiB':>9}",
    ]
    for key in COMPONENTS:
        lines.append(f"  {key:<27}{_DESCRIPTIONS[key]:<34}{_gib(plan.per_rank_bytes[key])}")
    lines.append(f"  {'total':<27}{'peak phase: ' + plan.peak_phase:<34}{_gib(plan.per_rank_bytes['total'])}")
    lines.append("  phases: " + ", ".join(f"{name} {value / GIB:.2f}" for name, value in plan.phases.items()) + " GiB")
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(
        f"budget {plan.budget_bytes / GIB:.2f} GiB: {verdict}, headroom {plan.headroom_bytes / GIB:.2f} GiB"
    )
    if not plan.launchable:
        first = plan.startup_error.splitlines()[0].rstrip(":")
        lines.append(f"cannot start: {first}; the memory above is that of fallback_to_unsharded: true")
    lines += ["", "training-state bytes per parameter (FP32 master + AdamW moments + FP32 gradient + 8-bit storage):"]
    lines.append(f"  {'recipe':<7}{'format':<12}{'master':>7}{'moments':>8}{'grad':>6}{'8-bit+scales':>14}"
                 f"{'LP weights':>12}{'whole model':>13}")
    for row in plan.bytes_per_parameter:
        lines.append(
            f"  {row['recipe']:<7}{row['format'] or '-':<12}{row['master']:>7}{row['adamw_moments']:>8}{row['gradient']:>6}"
            f"{row['low_precision_storage']:>14.4f}{row['total_low_precision_weights']:>12.4f}{row['total_model']:>13.4f}"
        )
    lines += ["", *_placement_lines(plan)]
    return "\n".join(lines)


def _compress(text: str) -> str:
    """``[392, 392, ..., 392]`` → ``[392 x 8]`` (rows per rank in the shard rule's reason)."""
    return re.sub(r"\[(\d+)((?:, \1)+)\]", lambda m: f"[{m.group(1)} x {m.group(2).count(',') + 1}]", text)


def _placement_lines(plan: MemoryPlan) -> list[str]:
    world = plan.run["world_size"]
    if not plan.placements:
        return [f"placements: no low-precision weight ({plan.run['precision']}); every parameter Shard(0) over {world} rank(s)"]
    counts = Counter(p["placement"] for p in plan.placements)
    order = ("Shard(0)", "Shard(1)", "replicated", "unshardable")
    lines = [
        f"placements of {len(plan.placements)} low-precision weights over {world} rank(s): "
        + ", ".join(f"{name} {counts.get(name, 0)}" for name in order if name in counts or name != "unshardable"),
        f"dim-0 rule (design spec §9.1) breaks for {len(plan.shard_violations)} weight(s); "
        f"fallback_to_unsharded: true would replicate {sum(p['replicated_by_fallback'] for p in plan.placements)}",
    ]
    for p in plan.placements:
        if p["placement"] != "Shard(0)":
            text = p["dim0_violation"] if p["placement"] == "Shard(1)" else p["reason"]
            head, sep, tail = (text or "").partition(f"over world size {world}: ")
            why = tail if sep else head
            lines.append(f"  {p['placement']:<12}{p['fqn']} {p['shape']}: {_compress(why)}")
    return lines
