"""A Fabric pretraining script for dsv3-tiny with lp-lightning's strategy, precision plugin and probes.

What ``notebooks/walkthrough.ipynb`` runs (one process per format); run it yourself with::

    python notebooks/fabric_walkthrough.py --precision hif8 --out runs/fabric_hif8

Fabric does what the Trainer does for ``lp-lightning fit`` (docs/usage.md "From Python: Trainer and
Fabric"): ``fabric.launch()`` runs the startup gate and starts the process group (gloo on CPU);
``fabric.setup_module`` converts the planned modules (design spec §5), upcasts to FP32 masters,
applies FSDP2 and builds the low-precision shards; ``fabric.setup_optimizers`` accepts only
``torch.optim.AdamW`` over FP32 masters (design spec §15); ``optimizer.step()`` refreshes every
low-precision weight once (design spec §10). The probe callbacks (read-only, design spec §16.6) are
driven through ``fabric.call`` as documented in ``lp_lightning/telemetry/probe_callbacks.py``.

Writes under ``--out``: ``probes/<kind>_rank0.json`` (refresh, gemm_trace, gather_trace, scales,
steps), ``logs/version_0/metrics.csv`` (the probes' ``probe/...`` scalars) and ``replacement.json``
(the plan's report, the modules left in high precision with the never-replace rule that keeps
them, the plugin's backend and refresh counts; ``report`` is null in bf16).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger

from lp_lightning.data import batch_for, build_token_cache, inputs_and_labels
from lp_lightning.fsdp.parallelize import total_grad_norm
from lp_lightning.formats import set_compiled_kernels
from lp_lightning.lightning import FSDP2FabricStrategy, precision_plugin
from lp_lightning.models.adapter import adapter_for
from lp_lightning.models.deepseek_v3 import from_hf_config
from lp_lightning.telemetry import GatherTraceProbe, GemmTraceProbe, RefreshProbe, ScaleStatsProbe, StepRecordProbe


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=["bf16", "mxfp8", "hif8"], required=True)
    parser.add_argument("--out", type=Path, required=True, help="run folder (probes/, logs/, replacement.json)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=4, help="sequences per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (constant)")
    parser.add_argument("--sample-every", type=int, default=5, help="probes keep full events of these steps")
    parser.add_argument("--check-optimizer", action="store_true",
                        help="first show that fabric.setup_optimizers refuses torch.optim.SGD (design spec §15)")
    parser.add_argument("--compiled-kernels", action=argparse.BooleanOptionalAction, default=True,
                        help="the fused torch.compile codec kernels (default); --no-compiled-kernels runs the eager "
                             "ones, bit-identical and without the compile time that dominates a few-step run")
    return parser.parse_args()


def high_precision_modules(causal_lm: torch.nn.Module, replaced: list[str]) -> list[dict]:
    """Modules holding parameters outside every replaced module, with the never-replace rule naming them."""
    rules = adapter_for(causal_lm).never_replace
    out = []
    for fqn, module in causal_lm.named_modules():
        params = sum(p.numel() for p in module.parameters(recurse=False))
        if not params or any(fqn == r or fqn.startswith(r + ".") for r in replaced):
            continue
        reason = next((rule.reason for rule in rules if any(fnmatch.fnmatchcase(fqn, g) for g in rule.fqn_globs)),
                      "not a replacement target")
        out.append({"fqn": fqn, "type": type(module).__name__, "parameters": params, "reason": reason})
    return out


def main() -> None:
    args = parse_args()
    set_compiled_kernels(args.compiled_kernels)
    plugin = precision_plugin(args.precision, trainer=False)
    probes = [RefreshProbe(sample_every=args.sample_every), GemmTraceProbe(sample_every=args.sample_every),
              GatherTraceProbe(sample_every=args.sample_every), ScaleStatsProbe(sample_every=args.sample_every),
              StepRecordProbe(sample_every=args.sample_every)]
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FSDP2FabricStrategy(), plugins=[plugin],
                    callbacks=probes, loggers=[CSVLogger(args.out, name="logs", version=0)])
    fabric.launch()  # startup gate, gloo process group, ("dp_shard",) mesh
    fabric.seed_everything(0)
    model = fabric.setup_module(from_hf_config("dsv3-tiny", seed=0))  # convert -> FP32 masters -> fully_shard
    if args.check_optimizer:
        try:
            fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=args.lr))
        except TypeError as err:
            fabric.print(f"fabric.setup_optimizers(SGD) refused: {err}")
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                                          weight_decay=0.1))
    causal_lm = model.module
    report = plugin.replacement_report
    if report is not None:
        fabric.print(report.format())
    replaced = [item.fqn for item in report.replaced] if report is not None else []
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replacement.json").write_text(json.dumps({
        "precision": args.precision,
        "backend": plugin.backend,
        "report": None if report is None else report.as_dict(),
        "high_precision": high_precision_modules(causal_lm, replaced),
        "low_precision_weights": list(plugin.low_precision_weights),
        "parameters": sum(p.numel() for p in causal_lm.parameters()),
    }, indent=1))

    cache = build_token_cache(None, "byte")  # the stdlib corpus `lp-lightning fit` trains on by default
    fabric.call("on_probe_start", model=model, fabric=fabric, out_dir=str(args.out / "probes"))
    for i in range(args.steps):
        batch = inputs_and_labels(batch_for(cache, seed=0, step=i, global_batch_size=args.batch,
                                            seq_len=args.seq_len, rank=fabric.global_rank,
                                            world_size=fabric.world_size))
        fabric.call("on_probe_step_start", step=i)
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())
        fabric.backward(loss)
        grad_norm = total_grad_norm(list(model.parameters()))
        optimizer.step()  # the plugin refreshes every low-precision weight from its FP32 master
        optimizer.zero_grad()
        fabric.call("on_probe_step_end", step=i, loss=loss, grad_norm=grad_norm, tokens=args.batch * args.seq_len)
        fabric.print(f"{args.precision} step {i + 1}: loss {loss.item():.4f}, grad norm {grad_norm.item():.3f}")
    fabric.call("on_probe_end")
    fabric.logger.finalize("success")
    fabric.print(f"refreshes: {plugin.refreshes}; probes: {sorted(p.name for p in (args.out / 'probes').iterdir())}")


if __name__ == "__main__":
    main()
