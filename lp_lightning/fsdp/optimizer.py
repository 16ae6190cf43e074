"""The optimizer a run may use: AdamW over FP32 master weights, with FP32 moments and update (design spec §10, §15).

Design spec §15 ("optimizer: AdamW with FP32 master, moments and update; other state dtypes fail at
optimizer construction"). :func:`check_optimizer` is that check; the FSDP2 strategies run it where
an optimizer enters Lightning: the Trainer's ``configure_optimizers`` result
(``FSDP2Strategy.setup_optimizers``) and Fabric's ``fabric.setup_optimizers``
(``FSDP2FabricStrategy.setup_optimizer``).

``torch.optim.AdamW`` keeps ``exp_avg``/``exp_avg_sq`` in the parameter's dtype and updates in it,
so FP32 parameters (the FP32 masters the strategy creates by upcasting before ``fully_shard``)
give FP32 moments and an FP32 update; the check therefore asks for exactly ``torch.optim.AdamW``
(a subclass may change the update) and FP32 parameters, and for FP32 moments when the optimizer
already holds state (e.g. loaded by hand before setup).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_optimizer"]

_FIX = "create torch.optim.AdamW(model.parameters(), ...) after the strategy has set the model up (FP32 masters)"


def check_optimizer(optimizer: Any) -> None:
    """Refuse any optimizer but ``torch.optim.AdamW`` over FP32 parameters with FP32 state (design spec §15).

    Args:
        optimizer: The optimizer (a Lightning ``LightningOptimizer``/Fabric wrapper is unwrapped).

    Raises:
        TypeError: ``optimizer`` is not exactly ``torch.optim.AdamW`` (e.g. ``torch.optim.SGD``, ``Adam``
            or an AdamW subclass); the message names the class and the fix.
        ValueError: a parameter is not FP32 (``torch.bfloat16`` masters), or a moment (``exp_avg``,
            ``exp_avg_sq``, ``max_exp_avg_sq``) is not FP32; the message names the dtype and the fix.
    """
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer / _FabricOptimizer
    cls = type(optimizer)
    if cls is not torch.optim.AdamW:
        raise TypeError(
            f"optimizer {cls.__module__}.{cls.__qualname__} is not supported: design spec §15 allows only "
            f"torch.optim.AdamW with FP32 master weights, moments and update; {_FIX}."
        )
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if param.dtype != torch.float32:
                raise ValueError(
                    f"torch.optim.AdamW param_groups[{index}] holds a {param.dtype} parameter of shape "
                    f"{tuple(param.shape)}; design spec §15 needs FP32 master weights (and so FP32 moments and "
                    f"update); {_FIX}."
                )
    for state in optimizer.state.values():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor) and value.dtype != torch.float32:
                raise ValueError(
                    f"torch.optim.AdamW state {key!r} is {value.dtype}; design spec §15 needs FP32 moments. "
                    "Restore the optimizer from an lp-lightning DCP checkpoint (FP32 state) or start it fresh."
                )
