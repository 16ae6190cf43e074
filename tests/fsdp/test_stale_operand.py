"""A gathered 8-bit operand kept past FSDP2's reshard raises instead of reading freed memory (issue 13).

FSDP2 frees the all-gather buffers of a resharded layer with ``untyped_storage().resize_(0)``; a
``QuantizedOperand`` taken from the gathered weight, or a tensor of a post-all-gather event, still
views them. Before this guard, using one killed the process with SIGSEGV.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lp_lightning import ops
from lp_lightning.formats import StaleOperandError, recipe_for
from lp_lightning.formats.operand import freed_storage
from lp_lightning.fsdp.gather import add_gather_observer
from lp_lightning.fsdp.refresh import refresh_low_precision_weights
from lp_lightning.fsdp.weights import finalize_low_precision_weights
from lp_lightning.modules import LowPrecisionLinear


def test_freed_storage_detects_a_resized_storage_and_nothing_else():
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    view = t[1:, 2:]
    assert not freed_storage(view) and not freed_storage(torch.empty(0))
    t.untyped_storage().resize_(0)
    assert freed_storage(view) and freed_storage(t)


@pytest.fixture
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield dist.device_mesh.init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("precision", ["mxfp8_e4m3", "hif8"])
def test_operand_kept_past_reshard_raises_on_use(one_rank_group, precision):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    for i in range(2):
        model[i] = LowPrecisionLinear.from_linear(model[i], recipe=recipe_for(precision), fqn=f"{i}")
    finalize_low_precision_weights(model, recipe=precision, build=False)
    fully_shard(model[0], mesh=one_rank_group, reshard_after_forward=True)
    fully_shard(model, mesh=one_rank_group, reshard_after_forward=True)
    refresh_low_precision_weights(model.parameters())

    kept: dict[str, object] = {}
    model[0].register_forward_pre_hook(lambda module, args: kept.update(weight=module.weight, op=module.weight.select("row")))
    events = []
    with add_gather_observer(lambda e: events.append(e) if e.stage == "post_all_gather" else None):
        x = torch.randn(8, 64)
        model(x).sum().backward()  # forward and backward gathers, each resharded after use
    op, weight = kept["op"], kept["weight"]
    assert freed_storage(op.data)  # the layer resharded: the operand's bytes are gone
    x_op = ops.quantize(recipe_for(precision).quantizer("input_fwd"), x, orientation="row")
    with pytest.raises(StaleOperandError, match="views a freed buffer .*FSDP2 resharded the weight"):
        ops.low_precision_matmul(x_op, op, layout="NT", output_dtype=torch.float32)
    carried = weight.orientations[0]  # the backward gather refilled the same object (MXFP8: the col copy)
    with pytest.raises(StaleOperandError, match=rf"select\('{carried}'\) on weight '0.weight'.*freed at reshard"):
        weight.select(carried)
    assert events and all(freed_storage(t) for e in events if e.fqn.startswith("0") for t in e.tensors[:1])
