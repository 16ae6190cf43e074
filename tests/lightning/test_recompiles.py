"""No torch.compile graph is built after the first optimizer step, in any mode (issue 14).

The codec kernels are compiled once per input dtype (``lp_lightning.formats._compile.fused``); a
new graph later in a run would mean a guard on something that varies (a view's base, a size that
happened to equal another, ``requires_grad``), and after torch.compile's recompile limit the
kernel silently runs eagerly at a fraction of the speed. This is a count, not a timing: dynamo's
``unique_graphs`` counter after the first optimizer step against the end of the run, through
forward, activation recompute, backward, gradient accumulation, a no-grad evaluation forward and a
batch of another shape, in MXFP8 (the format with four kernels whose guards once varied). Every
``lp-lightning fit`` reports the same count as ``compile.recompiles_after_first_step`` in
``run_summary.json``; ``tests/test_benchmarks.py`` asserts it is 0 for both formats' CLI runs.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.compiled, pytest.mark.slow]


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def test_no_graph_is_compiled_after_the_first_optimizer_step(isolated_dist):
    from lightning.fabric import Fabric

    from lp_lightning.lightning import FSDP2FabricStrategy, LowPrecisionFabricPlugin
    from lp_lightning.models.deepseek_v3 import from_hf_config

    fabric = Fabric(
        accelerator="cpu", devices=1, strategy=FSDP2FabricStrategy(activation_checkpoint="full"),
        plugins=[LowPrecisionFabricPlugin("mxfp8")],
    )  # fmt: skip
    fabric.launch()
    model = fabric.setup_module(from_hf_config("dsv3-tiny", seed=0))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    generator = torch.Generator().manual_seed(0)

    def loss_of(batch: int, tokens: int) -> torch.Tensor:
        # Large enough (>= 128 tokens x 256 features) that the fused kernels take the compiled path.
        ids_BT = torch.randint(0, 257, (batch, tokens + 1), generator=generator)
        logits = model(input_ids=ids_BT[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids_BT[:, 1:].flatten())

    def step(batch: int = 2, tokens: int = 128, micro_batches: int = 1) -> None:
        for _ in range(micro_batches):
            fabric.backward(loss_of(batch, tokens) / micro_batches)
        optimizer.step()
        optimizer.zero_grad()

    start = _graphs()
    step()
    after_first_step = _graphs()
    assert after_first_step > start  # the compiled kernels really ran (else this test proves nothing)
    step()
    step(micro_batches=2)  # gradient accumulation
    with torch.no_grad():
        loss_of(2, 128)  # evaluation forward
    step(batch=3, tokens=96)  # another batch shape
    assert _graphs() == after_first_step
