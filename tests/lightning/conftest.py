"""Fixtures of the Lightning-layer tests: a shared token cache and process-group isolation."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from lp_lightning.data import build_token_cache


@pytest.fixture(scope="session")
def token_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A token cache of the default stdlib corpus (byte tokenizer), built once per session."""
    path = tmp_path_factory.mktemp("tokens")
    build_token_cache(None, "byte", path)
    return str(path)


@pytest.fixture
def isolated_dist():
    """Restores ``os.environ`` / thread count and destroys the process group an in-process
    Trainer or Fabric run initialised (Lightning's strategy teardown keeps it alive)."""
    env = dict(os.environ)
    threads = torch.get_num_threads()
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(threads)
