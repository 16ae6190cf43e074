"""A 1-rank gloo process group for the torch-level FSDP2 / DCP tests (same code path as N ranks)."""

from __future__ import annotations

import os
import socket

import pytest
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def single_rank_group():
    """Initialises ``gloo`` with world size 1 for one test, then destroys it."""
    assert not dist.is_initialized(), "a previous test leaked a process group"
    env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
