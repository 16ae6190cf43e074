"""FSDP2Strategy / FSDP2FabricStrategy in one process (1-rank gloo mesh, same code as N ranks).

Tolerances: the BF16 unit roundoff u = 2**-8. Runs that differ only in how the same tokens are
grouped into GEMMs (accumulation vs one big micro-batch) see different BF16 roundings of the
weight gradients (each wgrad GEMM output is rounded to BF16 before the FP32 reduce), so after one
update their losses agree to O(u), not bitwise; the first loss (before any update) only differs by
the FP32 order of the mean and is compared at 1e-6.
"""

from __future__ import annotations

import inspect
import logging
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch.distributed.tensor import DTensor, Shard
from torch.utils.data import DataLoader

from _inprocess import fit_tiny, tiny_datamodule
from lp_lightning.config import FSDP2Config
from lp_lightning.checkpoint.dcp import checkpoint_tensor_keys
from lp_lightning.checkpoint.integrity import DamagedCheckpointError
from lp_lightning.fsdp.parallelize import is_parallelized
from lp_lightning.lightning import (
    BF16FabricPlugin,
    BF16Plugin,
    DeepSeekV3LM,
    FSDP2FabricStrategy,
    FSDP2Strategy,
)
from lp_lightning.models.deepseek_v3 import from_hf_config

BF16_UNIT_ROUNDOFF = 2.0**-8


class _SpyPlugin(BF16Plugin):
    """Records what the model looked like when ``convert_module`` ran."""

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        self.seen_sharded = is_parallelized(module) or any(isinstance(p, DTensor) for p in module.parameters())
        self.seen_dtypes = {p.dtype for p in module.parameters()}
        return super().convert_module(module)


def test_convert_runs_before_upcast_and_sharding(tmp_path, token_cache_dir, isolated_dist):
    plugin = _SpyPlugin()
    trainer, module, _ = fit_tiny(tmp_path, datamodule=tiny_datamodule(token_cache_dir), max_steps=1,
                                  activation_checkpoint="full", plugin=plugin)
    # convert_module saw the plain model as built (BF16 weights, router kept FP32), not yet sharded.
    assert plugin.seen_sharded is False
    assert torch.bfloat16 in plugin.seen_dtypes
    record = trainer.strategy.parallelization
    assert record.steps == ("convert_module", "upcast_fp32", "fully_shard", "activation_checkpoint")
    assert record.mesh_shape == (1,) and record.checkpointed_layers == 3
    assert record.fp32_compute_modules == ("model.layers.1.mlp.gate", "model.layers.2.mlp.gate")
    assert (record.param_dtype, record.reduce_dtype) == ("torch.bfloat16", "torch.float32")
    for name, param in module.model.named_parameters():
        assert isinstance(param, DTensor), name
        assert param.dtype == torch.float32, name
        assert param.placements == (Shard(0),), name
        assert param.device_mesh.mesh_dim_names == ("dp_shard",)
    # The recompute wrapper changes named_parameters() FQNs but not the checkpoint keys.
    keys = trainer.strategy.lightning_module_state_dict()
    assert "model.layers.0.mlp.gate_proj.weight" in keys and "lm_head.weight" in keys
    assert not any("_checkpoint_wrapped_module" in k for k in keys)
    assert plugin.optimizer_steps_applied == 1


def test_activation_checkpointing_and_accumulation_match_off(tmp_path, token_cache_dir, isolated_dist):
    dm_args = {"global_batch_size": 4}
    _, _, off = fit_tiny(tmp_path / "off", datamodule=tiny_datamodule(token_cache_dir, **dm_args),
                         max_steps=3, accumulate_grad_batches=2)
    torch.distributed.destroy_process_group()
    _, _, full = fit_tiny(tmp_path / "full", datamodule=tiny_datamodule(token_cache_dir, **dm_args),
                          max_steps=3, accumulate_grad_batches=2, activation_checkpoint="full")
    # Recompute replays the same BF16 kernels on the same inputs: bitwise equal on CPU.
    assert full["losses"] == off["losses"]
    assert full["grad_norms"] == off["grad_norms"]
    assert off["tokens"] == 3 * 4 * 32


class _FixedBatches(pl.LightningDataModule):
    """Serves the same rows either as one micro-batch or split into ``split`` micro-batches."""

    def __init__(self, rows_BT: torch.Tensor, split: int, steps: int) -> None:
        super().__init__()
        self.rows_BT = rows_BT
        self.split = split
        self.steps = steps

    def train_dataloader(self) -> DataLoader:
        batches = []
        for _ in range(self.steps):
            for chunk in self.rows_BT.chunk(self.split):
                batches.append({"input_ids": chunk[:, :-1].contiguous(), "labels": chunk[:, 1:].contiguous()})
        return DataLoader(batches, batch_size=None)


def test_gradient_accumulation_equals_one_big_batch(tmp_path, isolated_dist):
    rows_BT = torch.randint(0, 257, (4, 33), generator=torch.Generator().manual_seed(1))
    _, _, big = fit_tiny(tmp_path / "big", datamodule=_FixedBatches(rows_BT, 1, 2), max_steps=2)
    torch.distributed.destroy_process_group()
    _, _, acc = fit_tiny(tmp_path / "acc", datamodule=_FixedBatches(rows_BT, 2, 2), max_steps=2,
                         accumulate_grad_batches=2)
    assert acc["losses"][0] == pytest.approx(big["losses"][0], rel=1e-6, abs=0)
    assert acc["grad_norms"][0] == pytest.approx(big["grad_norms"][0], rel=8 * BF16_UNIT_ROUNDOFF)
    assert acc["losses"][1] == pytest.approx(big["losses"][1], rel=2 * BF16_UNIT_ROUNDOFF)


def test_non_lp_precision_plugin_is_refused(tmp_path, isolated_dist):
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=FSDP2Strategy(), max_steps=1, logger=False,
                         enable_checkpointing=False, default_root_dir=str(tmp_path))
    with pytest.raises(TypeError, match=r"precision_plugin\('bf16'\)"):
        trainer.fit(DeepSeekV3LM())
    assert not torch.distributed.is_initialized()  # failed before the process group


def test_dp_shard_size_must_match_world_size(tmp_path, token_cache_dir, isolated_dist):
    with pytest.raises(ValueError, match=r"fsdp_config.dp_shard_size=2 does not match the world size 1"):
        fit_tiny(tmp_path, datamodule=tiny_datamodule(token_cache_dir), fsdp_config=FSDP2Config(dp_shard_size=2))


def test_fabric_twin_shards_steps_and_checkpoints_hf_keys(tmp_path, isolated_dist):
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FSDP2FabricStrategy(activation_checkpoint="full"),
                    plugins=[BF16FabricPlugin()])
    fabric.launch()
    model = from_hf_config("dsv3-tiny", seed=0)
    with pytest.raises(ValueError, match="setup_module"):
        fabric.setup(model, torch.optim.AdamW(model.parameters()))
    model = fabric.setup_module(model)
    assert fabric.strategy.parallelization.steps == ("upcast_fp32", "fully_shard", "activation_checkpoint")
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids_BT = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(0))
    logits = model(input_ids=ids_BT[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids_BT[:, 1:].flatten())
    fabric.backward(loss)
    optimizer.step()
    assert fabric.strategy.precision.optimizer_steps_applied == 1

    path = tmp_path / "ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    keys = checkpoint_tensor_keys(path)
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys and "lm_head.weight" in keys
    assert keys["optimizer.state.lm_head.weight.exp_avg"].properties.dtype == torch.float32

    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(path, state)
    assert state["step"] == 1
    for name, param in model.named_parameters():
        assert torch.equal(param.full_tensor(), before[name]), name

    # A damaged folder: the error names the last good one; with resume_fallback the older one loads (as the Trainer's).
    good, bad = tmp_path / "checkpoints" / "step-000001", tmp_path / "checkpoints" / "step-000002"
    fabric.save(good, {"model": model, "optimizer": optimizer, "step": 1})
    fabric.save(bad, {"model": model, "optimizer": optimizer, "step": 2})
    shard = bad / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes: only the digest sees it
    shard.write_bytes(bytes(data))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    with pytest.raises(DamagedCheckpointError, match=f"the last good checkpoint is '{good}'"):
        fabric.load(bad, state)
    fabric.strategy.resume_fallback = True
    with pytest.warns(UserWarning, match=f"skips '{bad}'"):
        fabric.load(bad, state)
    assert state["step"] == 1 and fabric.strategy.loaded_checkpoint == str(good)


def test_both_strategies_take_the_same_arguments():
    def arguments(cls):
        return [(p.name, p.kind, p.default) for p in inspect.signature(cls.__init__).parameters.values()]

    assert arguments(FSDP2Strategy) == arguments(FSDP2FabricStrategy)
    assert [a[0] for a in arguments(FSDP2Strategy)] == [
        "self", "fsdp_config", "activation_checkpoint", "process_group_backend", "timeout", "resume_fallback"]


def test_trainer_activation_checkpoint_from_the_strategy_or_the_module():
    module_off, module_full, bare = SimpleNamespace(activation_checkpoint="off"), SimpleNamespace(
        activation_checkpoint="full"), SimpleNamespace()
    assert FSDP2Strategy()._activation_checkpoint_of(module_full) == "full"
    assert FSDP2Strategy()._activation_checkpoint_of(bare) == "off"
    assert FSDP2Strategy(activation_checkpoint="full")._activation_checkpoint_of(bare) == "full"
    assert FSDP2Strategy(activation_checkpoint="full")._activation_checkpoint_of(module_full) == "full"
    with pytest.raises(ValueError, match=r"activation_checkpoint='full'.*activation_checkpoint='off'"):
        FSDP2Strategy(activation_checkpoint="full")._activation_checkpoint_of(module_off)
    with pytest.raises(ValueError, match="selective"):
        FSDP2FabricStrategy(activation_checkpoint="selective")
    with pytest.raises(TypeError, match="resume_fallback must be a bool"):
        FSDP2Strategy(resume_fallback="yes")


def test_lightnings_restored_from_line_is_dropped_only_for_the_damaged_folder_it_names(tmp_path):
    """After a fallback load Lightning would say "Restored all states from the checkpoint at <damaged>": the
    strategy's filter drops exactly that record (its own "loaded X instead of the damaged Y" is the last word)."""
    from lp_lightning.lightning.strategy import _DropRestoredFrom

    damaged = tmp_path / "checkpoints" / "step-000100"
    drop = _DropRestoredFrom(damaged)

    def passes(message: str) -> bool:
        return drop.filter(logging.LogRecord("lightning.pytorch.utilities.rank_zero", logging.INFO, __file__, 1,
                                             message, None, None))

    assert not passes(f"Restored all states from the checkpoint at {damaged}")
    assert not passes(f"Loaded model weights from the checkpoint at {damaged}/")
    assert passes(f"Restored all states from the checkpoint at {damaged.parent / 'step-000090'}")
    assert passes("`Trainer.fit` stopped: `max_steps=2` reached.")


def test_the_one_line_model_summary_counts_parameters_and_low_precision_weights():
    from lp_lightning.lightning.strategy import model_summary_line

    model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 10))  # 1,011,010 parameters
    assert model_summary_line(model, BF16Plugin(), ranks=2) == (
        "lp-lightning: model 1.0 M parameters, FP32 masters, FSDP2 over 2 ranks; bf16 GEMMs, no low-precision weight.")
    plugin = SimpleNamespace(mode="mxfp8", low_precision_weights=("0.weight",), low_precision_elements=1_000_000,
                             weights_summary="1 low-precision weight in 1 module")
    assert model_summary_line(model, plugin, ranks=1) == (  # type: ignore[arg-type]
        "lp-lightning: model 1.0 M parameters, FP32 masters, FSDP2 over 1 rank; mxfp8 GEMMs on 1 low-precision "
        "weight in 1 module (1.0 M parameters, 99%).")
