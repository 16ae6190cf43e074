"""``lp_lightning.formats._compile.fused``: one compiled graph per kernel across calling contexts."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from lp_lightning.formats.hif8 import codec as hif8


@pytest.mark.compiled
def test_grad_mode_and_autocast_do_not_recompile_a_kernel():
    """Codec kernels run inside forward, backward, AC recompute and no_grad code, under autocast or
    not; each of those states is a torch.compile guard, so without a fixed calling context every
    combination compiled anew until the recompile limit sent the kernel back to eager."""
    torch._dynamo.reset()
    codes = hif8.encode(torch.randn(1 << 15))
    first = hif8.decode(codes)
    frames = counters["frames"]["ok"]
    with torch.no_grad():
        hif8.decode(codes)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = hif8.decode(codes)
    with torch.enable_grad():
        hif8.decode(codes)
    assert counters["frames"]["ok"] == frames  # no new compiled frame
    assert torch.equal(first.view(torch.int32), under_autocast.view(torch.int32))
    assert under_autocast.dtype == torch.float32
