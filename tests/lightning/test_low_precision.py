"""MXFP8 / HiF8 through the Trainer in one process (1-rank gloo mesh, same code path as N ranks).

- Build order (design spec §12.1): plan applied -> weights finalized -> fully_shard -> refresh -> AC wrap ->
  optimizer, recorded by spies on the functions themselves.
- Refresh accounting (design spec §10, R8, R10): exactly one storage build per weight per successful
  optimizer step, none on the micro-steps of gradient accumulation 4, none during the recompute of
  ``activation_checkpoint="full"``, none on a step forced non-finite (which is skipped and counted).
- The high-precision GEMM probe: zero in replaced modules, a positive control elsewhere, and a
  negative control (a replaced-module stand-in that runs a plain ``mm`` is caught).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from _inprocess import fit_tiny, tiny_datamodule
from lp_lightning.formats import compiled_kernels_enabled
from lp_lightning.lightning import LowPrecisionPlugin
from lp_lightning.telemetry.probes import GEMM_ROLE_KEYS, HighPrecisionGemmProbe

pytestmark = pytest.mark.slow

#: dsv3-tiny with the default plan: 21 replaced Linears (one weight each) + 2 routed-experts
#: modules (gate_up_proj and down_proj each).
LOW_PRECISION_WEIGHTS = 21 + 2 * 2




def test_build_order_plan_finalize_shard_refresh_recompute_optimizer(tmp_path, token_cache_dir, isolated_dist,
                                                                      monkeypatch):
    import lp_lightning.fsdp.parallelize as fsdp
    import lp_lightning.fsdp.lifecycle as lifecycle  # the plugin's and the strategy's lifecycle calls go through it
    from lp_lightning.lightning.module import DeepSeekV3LM
    from lp_lightning.plan import ModuleReplacementPlan

    events: list[str] = []

    def spy(owner, name, label):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            events.append(label)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)

    spy(ModuleReplacementPlan, "apply", "plan_applied")
    spy(lifecycle, "finalize_low_precision_weights", "weights_finalized")
    spy(fsdp, "fully_shard", "fully_shard")
    spy(lifecycle, "refresh_low_precision_weights", "refresh")
    spy(fsdp, "apply_activation_checkpointing", "activation_checkpoint")
    spy(DeepSeekV3LM, "configure_optimizers", "optimizer")
    plugin = LowPrecisionPlugin("mxfp8")
    trainer, module, summary = fit_tiny(tmp_path, datamodule=tiny_datamodule(token_cache_dir), max_steps=1,
                                        activation_checkpoint="full", plugin=plugin)
    collapsed = [e for i, e in enumerate(events) if i == 0 or events[i - 1] != e]
    assert collapsed == ["plan_applied", "weights_finalized", "fully_shard", "refresh", "activation_checkpoint",
                         "optimizer", "refresh"]  # the last refresh: after the one optimizer step
    assert events.count("fully_shard") == 2 + 3 + 1  # 2 FP32 routers, 3 decoder layers, root
    record = trainer.strategy.parallelization
    assert record.steps == ("convert_module", "upcast_fp32", "fully_shard", "refresh_low_precision",
                            "activation_checkpoint")
    assert record.low_precision_weights == LOW_PRECISION_WEIGHTS and record.replicated_low_precision == ()
    assert record.fp32_compute_modules == ("model.layers.1.mlp.gate", "model.layers.2.mlp.gate")

    from lp_lightning.fsdp.refresh import local_low_precision_weight

    low = {n for n, p in module.model.named_parameters() if local_low_precision_weight(p) is not None}
    assert len(low) == LOW_PRECISION_WEIGHTS
    for name, param in module.model.named_parameters():
        assert isinstance(param, DTensor) and param.dtype == torch.float32, name
    optimizer = trainer.optimizers[0]
    for state in optimizer.state.values():  # FP32 AdamW moments, plain (no 8-bit subclass)
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(state[key], DTensor)
            local = state[key].to_local()
            assert local.dtype == torch.float32 and type(local) is torch.Tensor
    assert plugin.refreshes == {"startup": 1, "step": 1, "resume": 0}
    assert summary["refresh"]["startup"] == 1
    keys = trainer.strategy.lightning_module_state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys
    for name, value in keys.items():  # FP32 masters (router bias buffers: plain), no subclass
        assert type(value.to_local() if isinstance(value, DTensor) else value) is torch.Tensor, name


class _ForceNonFinite(pl.Callback):
    """Poisons one gradient of optimizer step ``step`` (before clipping and the finite check)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.step:
            grad = next(p.grad for p in pl_module.model.parameters() if p.grad is not None)
            grad.to_local().view(-1)[0] = float("nan")


class _MicroStepRefreshes(pl.Callback):
    """Storage builds during each micro-batch (forward, backward incl. recompute, optimizer step)."""

    def __init__(self) -> None:
        self.per_micro_batch: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from lp_lightning.fsdp.refresh import total_refresh_count

        self._start = total_refresh_count()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from lp_lightning.fsdp.refresh import total_refresh_count

        self.per_micro_batch.append((batch_idx, total_refresh_count() - self._start))


@pytest.mark.parametrize("mode", ["mxfp8", "hif8"])
def test_one_refresh_per_weight_per_successful_step_with_accumulation_recompute_and_a_nan_step(
    mode, tmp_path, token_cache_dir, isolated_dist
):
    micro = _MicroStepRefreshes()
    plugin = LowPrecisionPlugin(mode)
    _, _, summary = fit_tiny(
        tmp_path, datamodule=tiny_datamodule(token_cache_dir, global_batch_size=4), max_steps=3,
        accumulate_grad_batches=4, activation_checkpoint="full", plugin=plugin,
        callbacks=[_ForceNonFinite(step=1), micro],
    )
    assert summary["refresh"]["per_step"] == [LOW_PRECISION_WEIGHTS, 0, LOW_PRECISION_WEIGHTS]
    assert summary["refresh"]["per_weight_per_step"] == {"min": 1, "max": 1}
    assert summary["refresh"]["skipped_steps"] == 1 and summary["refresh"]["weights"] == LOW_PRECISION_WEIGHTS
    assert plugin.optimizer_steps_skipped == 1 and plugin.optimizer_steps_applied == 2
    # Micro-batches 0-2 of every step (forward + backward with recompute) build nothing; the 4th
    # builds every weight once after an applied step and nothing after the skipped one.
    assert [n for _, n in micro.per_micro_batch] == [0, 0, 0, 25, 0, 0, 0, 0, 0, 0, 0, 25]
    assert summary["grad_norms"][1] != summary["grad_norms"][1]  # NaN recorded for the skipped step
    assert all(summary["kernels"][role] > 0 for role in GEMM_ROLE_KEYS)
    assert summary["kernels"]["backends"] == {"emulated": sum(summary["kernels"][r] for r in GEMM_ROLE_KEYS)}
    assert summary["wire"]["high_precision_gathers_of_replaced"] == 0
    assert summary["wire"]["low_precision_weights_gathered"] == LOW_PRECISION_WEIGHTS


class _FakeReplaced(nn.Module):
    """A module declaring a low-precision weight but computing with a plain high-precision mm."""

    low_precision_weight_names = ("weight",)
    low_precision_weight_kind = "dense"

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return x @ self.weight.t()


def test_high_precision_gemm_probe_catches_a_plain_gemm_and_sees_the_rest():
    model = nn.Sequential(_FakeReplaced(), nn.Linear(8, 8))
    probe = HighPrecisionGemmProbe()
    probe.start(model)
    try:
        model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    finally:
        probe.stop()
    assert probe.watched_modules == 1
    assert probe.in_replaced == 1  # the forward mm; its backward mms run in MmBackward (not ours)
    assert probe.elsewhere >= 3  # nn.Linear forward + the backward GEMMs
    assert "replaced module forward" in probe.examples[0]


@pytest.mark.parametrize("mode", ["mxfp8", "hif8"])
def test_replaced_modules_run_no_high_precision_gemm_in_a_training_step(mode, tmp_path, token_cache_dir,
                                                                       isolated_dist):
    probe = HighPrecisionGemmProbe()
    _, _, summary = fit_tiny(tmp_path, datamodule=tiny_datamodule(token_cache_dir), max_steps=1,
                             activation_checkpoint="full", plugin=LowPrecisionPlugin(mode), callbacks=[probe])
    kernels = summary["kernels"]
    assert probe.watched_modules == 23
    assert kernels["high_precision_gemms_in_replaced_modules"] == 0, kernels["high_precision_gemm_examples"]
    assert kernels["high_precision_gemms_elsewhere"] > 0  # attention core, router, LM head
    assert all(kernels[role] > 0 for role in GEMM_ROLE_KEYS)
    assert kernels["dense.fprop"] == 2 * 21  # forward + recompute of every replaced Linear
    assert kernels["formats"] == {"mxfp8_e4m3" if mode == "mxfp8" else "hif8": sum(kernels[r] for r in GEMM_ROLE_KEYS)}
    assert compiled_kernels_enabled() is False  # restored to the fixture's setting


@pytest.mark.parametrize("mode", ["mxfp8", "hif8"])
def test_fabric_twin_converts_shards_refreshes_and_restores(mode, tmp_path, isolated_dist):
    from lightning.fabric import Fabric

    from lp_lightning.checkpoint.dcp import checkpoint_tensor_keys
    from lp_lightning.fsdp.refresh import RefreshRecorder, local_low_precision_weight
    from lp_lightning.lightning import FSDP2FabricStrategy, LowPrecisionFabricPlugin
    from lp_lightning.models.deepseek_v3 import from_hf_config

    plugin = LowPrecisionFabricPlugin(mode)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FSDP2FabricStrategy(activation_checkpoint="full"),
                    plugins=[plugin])
    fabric.launch()
    model = fabric.setup_module(from_hf_config("dsv3-tiny", seed=0))
    assert plugin.replacement_report.counts == {"mla_projections": 12, "dense_mlp": 3, "shared_experts": 6,
                                                "routed_experts": 2}
    assert fabric.strategy.parallelization.steps == ("upcast_fp32", "fully_shard", "refresh_low_precision",
                                                     "activation_checkpoint")
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids_BT = torch.randint(0, 257, (2, 33), generator=torch.Generator().manual_seed(0))

    def step() -> float:
        logits = model(input_ids=ids_BT[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids_BT[:, 1:].flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return float(loss)

    with RefreshRecorder() as rec:
        step()
    assert rec.total == LOW_PRECISION_WEIGHTS and set(rec.counts.values()) == {1}
    path = tmp_path / "ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    assert not any(k.endswith(("row_data", "col_scale")) for k in checkpoint_tensor_keys(path))

    def storage() -> dict[str, dict[str, torch.Tensor]]:
        return {
            n: {k: v.reshape(-1).view(torch.uint8).clone()
                for k, v in local_low_precision_weight(p).low_precision_storage.items()}
            for n, p in model.named_parameters() if local_low_precision_weight(p) is not None
        }

    built = storage()
    masters = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    continued = step()
    state = {"model": model, "optimizer": optimizer, "step": 0}
    with RefreshRecorder() as rec:
        fabric.load(path, state)
    assert state["step"] == 1 and rec.total == LOW_PRECISION_WEIGHTS and plugin.refreshes["resume"] == 1
    for name, param in model.named_parameters():
        assert torch.equal(param.full_tensor(), masters[name]), name
    rebuilt = storage()
    for name, tensors in built.items():
        for key, value in tensors.items():
            assert torch.equal(rebuilt[name][key], value), (name, key)
    assert step() == continued  # the restored run repeats step 2 bitwise


def test_wire_recorder_counts_a_replaced_module_computing_from_a_plain_weight():
    """Negative control of ``wire.high_precision_gathers_of_replaced``: a declared low-precision
    weight that reaches the module's forward as a plain FP32 tensor is counted."""
    from lp_lightning.telemetry.probes import record_wire

    model = nn.Sequential(_FakeReplaced(), nn.Linear(8, 8))
    with record_wire(model) as wire:
        model(torch.randn(2, 8))
        wire.close_step()
    assert wire.high_precision_gathers_of_replaced == 1
    assert wire.trace[0]["kind"] == "high_precision_weight_in_replaced_module" and wire.trace[0]["dtype"] == "float32"
    summary = wire.summary()
    assert summary["all_gather_bytes"] == {} and summary["steps"] == 1
