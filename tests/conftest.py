import os
import socket

import pytest
import torch
import torch.distributed as dist

from lp_lightning.data import build_token_cache
from lp_lightning.formats import compiled_kernels_enabled, set_compiled_kernels

# Tests share 2 cores; keep intra-op threads bounded so multi-process tests do not oversubscribe.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _hccl_deterministic(monkeypatch):
    """A deterministic fit on the (fake) npu accelerator sets ``HCCL_DETERMINISTIC`` in this process
    (lp_lightning/lightning/hccl.py): each test starts without it and leaves the environment as it was."""
    monkeypatch.delenv("HCCL_DETERMINISTIC", raising=False)


@pytest.fixture(autouse=True)
def _codec_kernels(request):
    """Eager codec kernels unless a test is marked ``compiled``.

    The fused (torch.compile) kernels are bit-identical to eager — the ``compiled`` tests prove it —
    but compiling them costs tens of seconds per graph on a cold 2-core machine; in-process tests
    have no reason to pay that. End-to-end runs in subprocesses use the production default.
    """
    previous = compiled_kernels_enabled()
    set_compiled_kernels(request.node.get_closest_marker("compiled") is not None)
    yield
    set_compiled_kernels(previous)


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


@pytest.fixture
def ieee_gemms():
    """The emulated backend multiplies in IEEE FP32 (``bf16_units=False``) for this test.

    For tests that compare whole autograd functions bit for bit with a reference composed of FP32
    matmuls: the default BF16-unit GEMMs differ from it only in the order of FP32 additions, which
    ``tests/ops/test_emulated_units.py`` bounds GEMM by GEMM.
    """
    from lp_lightning.ops.emulated import BACKEND

    previous = BACKEND.bf16_units
    BACKEND.bf16_units = False
    yield
    BACKEND.bf16_units = previous


@pytest.fixture(scope="session")
def token_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A token cache of the default stdlib corpus (byte tokenizer), built once per session."""
    path = tmp_path_factory.mktemp("tokens")
    build_token_cache(None, "byte", path)
    return str(path)


# A 1-rank gloo process group for the torch-level FSDP2 / DCP tests (same code path as N ranks).
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
