"""``DeepSeekV3LM``: the LightningModule of the pretraining job (design spec §4.1, §10, §12).

It builds the plain HF ``DeepseekV3ForCausalLM`` in ``configure_model`` (random init, seeded,
identical on every rank) and leaves sharding, FP32 upcast and activation checkpointing to
:class:`~lp_lightning.lightning.strategy.FSDP2Strategy`. The HF model lives at ``self.model``,
so its state-dict names (``model.layers.0.mlp.gate_proj.weight``, ``lm_head.weight``) are the
checkpoint keys.

Shape legend:
    b  rows of this rank's micro-batch
    T  sequence length
    V  vocabulary size

Loss: causal-LM cross entropy in FP32 on BF16 logits, ``labels`` already shifted by the data
pipeline (``labels[:, t]`` is the token after ``input_ids[:, t]``, ``lp_lightning.data.batches``).
Each micro-batch loss is a mean over its ``b*T`` tokens; Lightning divides it by
``accumulate_grad_batches`` before backward and FSDP2 averages gradients over ranks, so with equal
token counts per micro-batch (always true: no padding) the update is the gradient of the mean
loss over the whole global batch.

Logged (``self.log``, all already reduced over ranks): ``train/loss`` (mean over the step's
micro-batches and ranks; shown in the progress bar), ``val/loss``, ``grad_norm`` (total L2 norm of
the sharded FP32 gradients before clipping), ``lr``. ``tokens_per_s`` is logged by
:class:`~lp_lightning.telemetry.summary.RunSummaryCallback`.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from lp_lightning.config import ActivationCheckpointMode, check_activation_checkpoint
from lp_lightning.fsdp.parallelize import clip_gradients_, total_grad_norm
from lp_lightning.models import deepseek_v3

__all__ = ["DeepSeekV3LM", "warmup_cosine_factor"]


def warmup_cosine_factor(step: int, *, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier of optimizer step ``step`` (0-based): linear warmup, then cosine to a floor.

    ``(step + 1) / warmup_steps`` for ``step < warmup_steps``; afterwards
    ``min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2`` with
    ``p = min(1, (step - warmup_steps) / max(1, decay_steps - warmup_steps))``.

    Args:
        step: Optimizer steps taken so far.
        warmup_steps: Length of the linear warmup (0 = none).
        decay_steps: Step at which the cosine reaches ``min_lr_ratio`` (held afterwards).
        min_lr_ratio: Final LR as a fraction of the peak LR, in ``[0, 1]``.

    Returns:
        The multiplier in ``[min_lr_ratio, 1]``.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class DeepSeekV3LM(pl.LightningModule):
    """DeepSeek-V3 causal LM pretraining with AdamW (FP32 states) and warmup + cosine LR.

    Args:
        config_name_or_path: Built-in spec (``"dsv3-tiny"``, ``"dsv3-16b"``) or a local
            ``config.json`` file/folder (``lp_lightning.models.deepseek_v3.from_hf_config``).
        config_overrides: DeepseekV3Config fields applied on top of the spec/file.
        validate_spec: Validate the built structure against the named spec (design spec §4.1). Set
            ``false`` to train a deliberately modified variant of a named spec.
        seed: Seed of the model initialisation (every rank builds identical weights).
        attn_implementation: HF attention backend (``"sdpa"`` per §4.1, or ``"eager"``).
        lr: Peak learning rate of AdamW.
        betas: AdamW ``(beta1, beta2)``.
        eps: AdamW epsilon.
        weight_decay: Decoupled weight decay for matrices and embeddings (parameters with
            ``ndim >= 2``); norms and other 1-D parameters get none.
        warmup_steps: Optimizer steps of linear warmup.
        lr_decay_steps: Step where the cosine reaches ``min_lr_ratio * lr``; ``None`` = the
            Trainer's ``max_steps``. Set it explicitly when a run is stopped early and resumed
            later, so both parts follow one schedule.
        min_lr_ratio: Final LR as a fraction of ``lr``.
        activation_checkpoint: ``"off"`` or ``"full"`` (recompute every decoder layer in
            backward); applied by the strategy after sharding. ``None``: the strategy's
            ``activation_checkpoint`` decides (``"off"`` when it is ``None`` too; ``lp-lightning fit``
            defaults to ``"off"``).

    Attributes:
        model: The HF ``DeepseekV3ForCausalLM`` (``None`` until ``configure_model``).
        last_step_loss: Loss of the last completed optimizer step, averaged over its
            micro-batches and all ranks (``float``; ``None`` before the first step).
        last_grad_norm: Total gradient norm of the last optimizer step, before clipping.
    """

    def __init__(
        self,
        config_name_or_path: str = "dsv3-tiny",
        config_overrides: dict[str, Any] | None = None,
        validate_spec: bool = True,
        seed: int = 0,
        attn_implementation: Literal["sdpa", "eager"] = "sdpa",
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        warmup_steps: int = 5,
        lr_decay_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        activation_checkpoint: ActivationCheckpointMode | None = None,
    ) -> None:
        super().__init__()
        if activation_checkpoint is not None:
            check_activation_checkpoint(activation_checkpoint, "model.activation_checkpoint")
        for name, value in (("lr", lr), ("eps", eps)):
            if not value > 0:
                raise ValueError(f"model.{name} must be > 0, got {value}.")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"model.betas must lie in [0, 1), got {betas}.")
        if weight_decay < 0:
            raise ValueError(f"model.weight_decay must be >= 0, got {weight_decay}.")
        if warmup_steps < 0:
            raise ValueError(f"model.warmup_steps must be >= 0, got {warmup_steps}.")
        if lr_decay_steps is not None and lr_decay_steps < 1:
            raise ValueError(f"model.lr_decay_steps must be >= 1 or null, got {lr_decay_steps}.")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"model.min_lr_ratio must lie in [0, 1], got {min_lr_ratio}.")
        self.save_hyperparameters()
        self.config_name_or_path = config_name_or_path
        self.config_overrides = dict(config_overrides) if config_overrides else None
        self.validate_spec = validate_spec
        self.seed = seed
        self.attn_implementation = attn_implementation
        self.lr = lr
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = eps
        self.weight_decay = weight_decay
        self.warmup_steps = warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.min_lr_ratio = min_lr_ratio
        self.activation_checkpoint = activation_checkpoint
        self.model: nn.Module | None = None
        self.last_step_loss: float | None = None
        self.last_grad_norm: float | None = None
        self._micro_losses: list[torch.Tensor] = []

    @override
    def configure_model(self) -> None:
        """Builds the plain HF model once (idempotent), seeded, on this rank's device.

        Every rank gets bitwise-identical weights (same seed, same device type), in BF16 as
        built by ``from_hf_config`` (design spec §4.1 ``torch_dtype: bfloat16``); the strategy upcasts
        them to the FP32 master and shards them.
        """
        if self.model is not None:
            return
        device = self.trainer.strategy.root_device if self._trainer is not None else torch.device("cpu")
        self.model = deepseek_v3.from_hf_config(
            self.config_name_or_path,
            config_overrides=self.config_overrides,
            device=device,
            seed=self.seed,
            validate=self.validate_spec,
            attn_implementation=self.attn_implementation,
        )

    def _require_model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("DeepSeekV3LM.model is not built yet; call configure_model() first.")
        return self.model

    @override
    def on_fit_start(self) -> None:
        """Checks that the tokenizer's ids fit the model's vocabulary.

        Raises:
            ValueError: The datamodule's ``vocab_size`` exceeds ``model.config.vocab_size``.
        """
        datamodule = getattr(self.trainer, "datamodule", None)
        data_vocab = getattr(datamodule, "vocab_size", None)
        model_vocab = self._require_model().config.vocab_size
        if data_vocab is not None and data_vocab > model_vocab:
            raise ValueError(
                f"the tokenizer produces ids up to {data_vocab - 1} but the model's vocab_size is "
                f"{model_vocab}; raise model.config_overrides.vocab_size or use a smaller tokenizer."
            )

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean next-token cross entropy of one micro-batch, computed in FP32.

        Args:
            batch: ``{"input_ids": int64 [b, T], "labels": int64 [b, T]}`` (labels pre-shifted).

        Returns:
            0-d FP32 loss in nats per token.
        """
        model = self._require_model()
        logits_bTV = model(input_ids=batch["input_ids"], use_cache=False).logits
        return F.cross_entropy(logits_bTV.float().flatten(0, 1), batch["labels"].flatten())

    def _is_last_micro_batch(self, batch_idx: int) -> bool:
        return (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self._micro_losses.append(loss.detach())
        if self._is_last_micro_batch(batch_idx):
            step_loss = torch.stack(self._micro_losses).mean()
            self._micro_losses.clear()
            step_loss = self.trainer.strategy.reduce(step_loss, reduce_op="mean")
            self.last_step_loss = float(step_loss)
            self.log("train/loss", step_loss, prog_bar=True, on_step=True, on_epoch=False)
            self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=True, on_epoch=False)
        return loss

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("val/loss", loss, prog_bar=True, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    @override
    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Logs the total gradient norm over all ranks, then clips (``trainer.gradient_clip_val``).

        The norm of FSDP2's sharded DTensor gradients is reduced across ranks
        (:func:`~lp_lightning.fsdp.parallelize.total_grad_norm`); clipping by norm scales every
        local shard by the same global factor, clipping by value is element-wise
        (:func:`~lp_lightning.fsdp.parallelize.clip_gradients_`, per device mesh).
        """
        params = [p for p in self._require_model().parameters() if p.grad is not None]
        total = total_grad_norm(params)
        self.last_grad_norm = float(total)
        self.log("grad_norm", total, on_step=True, on_epoch=False)
        if not gradient_clip_val:
            return
        algorithm = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm) or "norm")
        clip_gradients_(params, max_value=gradient_clip_val, algorithm=algorithm, total_norm=total)

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW over the sharded FP32 Parameters, stepped LambdaLR warmup + cosine.

        Raises:
            ValueError: A trainable Parameter is not FP32 (design spec §15: FP32 master, moments and
                update; the strategy upcasts before sharding), or no decay horizon is known.
        """
        model = self._require_model()
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        not_fp32 = [n for n, p in params if p.dtype != torch.float32]
        if not_fp32:
            raise ValueError(
                f"AdamW needs FP32 master parameters (design spec §15), but {len(not_fp32)} are not FP32 "
                f"(first: {not_fp32[0]!r}). Train with FSDP2Strategy, which upcasts before sharding."
            )
        decay = [p for _, p in params if p.ndim >= 2]
        no_decay = [p for _, p in params if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.lr,
            betas=self.betas,
            eps=self.eps,
        )
        decay_steps = self.lr_decay_steps if self.lr_decay_steps is not None else self.trainer.max_steps
        if decay_steps is None or decay_steps < 1:
            raise ValueError(
                "the cosine schedule needs a horizon: set trainer.max_steps > 0 or model.lr_decay_steps."
            )
        factor = partial(
            warmup_cosine_factor,
            warmup_steps=self.warmup_steps,
            decay_steps=decay_steps,
            min_lr_ratio=self.min_lr_ratio,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
