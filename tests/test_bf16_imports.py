"""``--precision bf16`` imports nothing low-precision (design spec §13.1, requirement R3 of docs/design.md).

A fresh subprocess (so no other test's imports leak in) runs the bf16 path the way the product does:

1. ``from_hf_config("dsv3-tiny")``, ``BF16FabricPlugin().convert_module``, one
   optimizer step through the plugin;
2. ``lp-lightning fit --precision bf16 --trainer.max_steps 1`` in-process (``runpy``, one process,
   CPU): the LightningModule's ``configure_model``, the FSDP2 strategy (plugin ``convert_module``,
   upcast, ``fully_shard``), forward + backward, the optimizer step, validation and a checkpoint,
   with every probe callback of ``lp_lightning.telemetry.probe_callbacks`` and the tensor-memory
   probe (their files are checked: present, nothing low-precision in them).

Then ``sys.modules`` is compared with the FULL list of low-precision modules, computed by walking
the source tree (files, not imports) of ``lp_lightning/{formats,ops,functional,modules,tensor,
fsdp}`` (the packages that exist), plus ``lp_lightning.models.deepseek_v3.experts`` and
``torch_npu``. The test fails listing every one that was imported.

Allowed exceptions: ``lp_lightning.formats`` (the package ``__init__``, whose attributes load
lazily) and ``lp_lightning.formats.registry``: the pure-Python catalogue of the formats that the
config layer reads, so importing them loads no codec, quantizer or kernel. Every other module
under ``lp_lightning/formats`` is checked. In ``lp_lightning/fsdp`` the package ``__init__``,
``parallelize`` and ``optimizer`` are what every run uses (torch only); every other module there
(gather, sharding, refresh, weights, lifecycle) is checked.

The replacement plan (``lp_lightning/plan``) is not a low-precision type, but a bf16 run never
needs it either and the earlier, five-name guard checked it, so it is checked too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lp_lightning"

LOW_PRECISION_PACKAGES = ("formats", "ops", "functional", "modules", "tensor", "fsdp")
"""Packages under ``lp_lightning/`` whose every module is low-precision (those absent are skipped)."""

LOW_PRECISION_EXTRA = ("lp_lightning.models.deepseek_v3.experts", "torch_npu")
"""Low-precision modules outside those packages (``torch_npu``: also any ``torch_npu.*`` submodule)."""

ALLOWED = frozenset({
    "lp_lightning.formats", "lp_lightning.formats.registry",
    "lp_lightning.fsdp", "lp_lightning.fsdp.parallelize", "lp_lightning.fsdp.optimizer",
})
"""Pure-Python format catalogue the config layer reads, and the half of ``fsdp`` every run uses (module docstring)."""

ALSO_UNUSED_IN_BF16 = ("plan",)
"""Packages under ``lp_lightning/`` a bf16 run does not import although they are not low-precision."""

ALSO_UNUSED_IN_BF16_MODULES: tuple[str, ...] = ()


def _modules_in(package: str) -> list[str]:
    """Module names of every ``.py`` file under ``lp_lightning/<package>`` (``__init__`` = the package)."""
    root = PACKAGE / package
    if not root.is_dir():
        return []
    names = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def low_precision_modules() -> list[str]:
    """The full list of low-precision module names (source tree walk + extras), allowed ones removed."""
    names = [name for package in LOW_PRECISION_PACKAGES for name in _modules_in(package)]
    return sorted(set(names + list(LOW_PRECISION_EXTRA)) - ALLOWED)


def unused_in_bf16_modules() -> list[str]:
    """Modules a bf16 run does not import besides the low-precision ones."""
    return sorted({name for package in ALSO_UNUSED_IN_BF16 for name in _modules_in(package)}
                  | set(ALSO_UNUSED_IN_BF16_MODULES))


_SCRIPT = textwrap.dedent(
    """
    import json, runpy, sys
    from pathlib import Path

    import torch

    root = Path(sys.argv[1])

    # 1. The plugin on its own (Fabric's order: convert_module, then optimizer steps through the plugin).
    from lp_lightning.lightning.precision import BF16FabricPlugin
    from lp_lightning.models.deepseek_v3 import from_hf_config

    plugin = BF16FabricPlugin()
    model = plugin.convert_module(from_hf_config("dsv3-tiny", seed=0))
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    plugin.optimizer_step(torch.optim.AdamW(model.parameters()))
    assert plugin.optimizer_steps_applied == 1

    # 2. The CLI, in this process.
    sys.argv = [
        "lp-lightning", "fit", "--precision", "bf16", "--trainer.max_steps", "1",
        "--trainer.default_root_dir", str(root / "run"), "--data.cache_dir", str(root / "tokens"),
        "--data.max_corpus_bytes", "262144", "--data.seq_len", "32", "--data.global_batch_size", "2",
        "--data.val_batches", "1", "--trainer.val_check_interval", "1", "--checkpoint.every_n_steps", "1",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.logger", "false", "--run_summary.wire", "true",
        *[f"--trainer.callbacks+=lp_lightning.telemetry.{name}" for name in
          ("RefreshProbe", "GemmTraceProbe", "GatherTraceProbe", "ScaleStatsProbe", "StepRecordProbe",
           "LayerNumericsProbe")],
        "--trainer.callbacks+=lp_lightning.telemetry.ProfilerProbe", "--trainer.callbacks.start_step=1",
        "--trainer.callbacks.steps=1",
        "--trainer.callbacks+=lp_lightning.telemetry.TensorMemoryProbe", "--trainer.callbacks.warmup_steps=0",
        "--trainer.callbacks+=lp_lightning.telemetry.resident_probe.ResidentObjectsProbe",
    ]
    try:
        runpy.run_module("lp_lightning.cli", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        assert exc.code in (0, None), exc.code
    after_bf16 = sorted(sys.modules)

    # Positive control: the low-precision experts still load, lazily, when asked for.
    import lp_lightning.models.deepseek_v3 as dsv3
    lazy = dsv3.replace_deepseek_v3_low_precision_experts.__module__
    print(json.dumps({"after_bf16": after_bf16, "lazy": lazy, "after_lazy": sorted(sys.modules)}))
    """
)


def test_bf16_run_imports_no_low_precision_module(tmp_path):
    low_precision = low_precision_modules()
    # The walk found the real thing (an empty walk would pass vacuously).
    assert {"lp_lightning.tensor.weight", "lp_lightning.fsdp.gather", "lp_lightning.ops.api", "lp_lightning.functional.linear",
            "lp_lightning.modules.linear", "lp_lightning.models.deepseek_v3.experts", "torch_npu"} <= set(low_precision)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])

    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    assert summary["precision"] == "bf16" and summary["backend"] == "none" and summary["steps"] == 1
    assert summary["replacement"] is None and summary["low_precision"] is None
    assert summary["kernels"] is None and summary["refresh"] is None
    assert set(summary["wire"]) == {"all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes", "steps",
                                    "bytes_are"}
    assert summary["peak_memory_bytes_per_rank"] == [summary["peak_memory_bytes"]]

    def probe(kind: str) -> dict:
        return json.loads((tmp_path / "run" / "probes" / f"{kind}_rank0.json").read_text())

    assert probe("refresh")["per_step"] == [{"step": 1, "refreshes": 0, "weights": 0, "max_per_weight": 0,
                                             "skipped": False}]
    assert probe("gemm_trace")["counts"] == {} and probe("gather_trace")["events"] == []
    assert probe("scales")["records"] == [] and probe("scales")["histograms"] == {}
    assert probe("steps")["records"][0]["loss"] == summary["losses"][0]
    assert probe("layer_numerics")["low_precision"] is False and probe("layer_numerics")["records"] == []
    assert summary["layer_numerics"]["low_precision"] is False and summary["layer_numerics"]["series"] == {}
    profile = probe("profile")
    assert profile["window"] == [1, 1] and profile["categories_s"]["high_precision_mm"] > 0
    assert profile["categories_s"]["quantize"] == profile["categories_s"]["low_precision_mm"] == 0
    resident = probe("resident")  # what st's §17.4 "low precision off" section reads: the same list, measured in the run
    assert resident["modules"]["low_precision"] == [] and "lp_lightning.st" not in resident["modules"]["lp_lightning"]
    assert resident["parameters"]["low_precision_weights"] == 0 and resident["parameters"]["by_class"] == {"Tensor": 39}
    memory = probe("tensor_memory")  # the same measurement as an 8-bit run, with no 8-bit storage
    assert summary["peak_tensor_bytes"] == memory["all_ops"]["peak_bytes"] > 0
    assert memory["outside_emulation"] == memory["all_ops"]  # no emulated kernel runs in bf16
    assert memory["all_ops"]["by_component"]["low_precision_storage"] == 0
    assert memory["all_ops"]["by_component"]["master"] > 0

    def imported(names: list[str], modules: list[str]) -> list[str]:
        loaded = set(modules)
        hits = [name for name in names if name in loaded]
        hits += [m for m in modules if m.startswith("torch_npu.")]
        return sorted(set(hits))

    leaked = imported(low_precision, result["after_bf16"])
    assert leaked == [], f"the bf16 path imported {len(leaked)} low-precision module(s): {leaked}"
    unused = imported(unused_in_bf16_modules(), result["after_bf16"])
    assert unused == [], f"the bf16 path imported {unused}"
    # Positive control: asking for the experts factory loads it (and the detector sees it).
    assert result["lazy"] == "lp_lightning.models.deepseek_v3.experts"
    assert "lp_lightning.models.deepseek_v3.experts" in imported(low_precision, result["after_lazy"])
    # The probe's list (lp_lightning.telemetry.resident_probe) agrees with this walk, on both module sets.
    from lp_lightning.telemetry.resident_probe import low_precision_modules_loaded
    for modules in (result["after_bf16"], result["after_lazy"]):
        assert low_precision_modules_loaded(modules) == imported(low_precision, modules)
