"""``lp_lightning.formats._compile.fused``: one compiled graph per kernel across calling contexts."""

from __future__ import annotations

import json
import platform

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


@pytest.fixture
def isa_check(monkeypatch, tmp_path):
    """``_prepare_cpu_compiler`` against an empty Inductor cache dir, with the config restored."""
    from torch._inductor import config as inductor_config

    from lp_lightning.formats import _compile

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    saved = inductor_config.cpp.vec_isa_ok  # a config proxy: restored by hand, not by monkeypatch
    inductor_config.cpp.vec_isa_ok = None
    monkeypatch.setattr(_compile, "_cpu_compiler_ready", False)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")

    def run() -> dict:
        monkeypatch.setattr(_compile, "_cpu_compiler_ready", False)
        _compile._prepare_cpu_compiler()
        records = list((tmp_path / "lp_lightning").glob("vec_isa_*.json"))
        return json.loads(records[0].read_text()) if records else {}

    yield run, inductor_config.cpp
    inductor_config.cpp.vec_isa_ok = saved


def test_vector_isa_check_runs_once_per_machine(isa_check, monkeypatch):
    from torch._inductor import cpu_vec_isa

    run, cpp = isa_check
    isas = [i for i in cpu_vec_isa.supported_vec_isa_list[-2:]]  # AVX-512, AVX2
    flags = sorted({flag for isa in isas for flag in str(isa).split()})
    monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker", lambda: flags)
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: isas)  # Inductor's check: all pass
    record = run()
    assert record == {"all_candidates_pass": True, "candidates": [str(i) for i in isas],
                      "passed": [str(i) for i in isas]}  # fmt: skip
    assert cpp.vec_isa_ok is True  # this process already compiles under the outcome

    def no_check():
        raise AssertionError("a later process must not check again")

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", no_check)
    cpp.vec_isa_ok = None
    run()
    assert cpp.vec_isa_ok is True


def test_vector_isa_check_stays_per_process_when_a_candidate_fails(isa_check, monkeypatch):
    from torch._inductor import cpu_vec_isa

    run, cpp = isa_check
    isas = [i for i in cpu_vec_isa.supported_vec_isa_list[-2:]]
    flags = sorted({flag for isa in isas for flag in str(isa).split()})
    monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker", lambda: flags)
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: isas[1:])  # AVX-512 fails to load
    assert run()["all_candidates_pass"] is False
    assert cpp.vec_isa_ok is None
    run()
    assert cpp.vec_isa_ok is None  # the record says check again: Inductor does, per process


def test_a_users_vector_isa_setting_is_left_alone(isa_check, tmp_path):
    run, cpp = isa_check
    cpp.vec_isa_ok = False
    assert run() == {}
    assert cpp.vec_isa_ok is False and not (tmp_path / "lp_lightning").exists()


def test_an_unreadable_vector_isa_record_is_checked_and_written_again(isa_check, monkeypatch, tmp_path):
    from torch._inductor import cpu_vec_isa

    run, cpp = isa_check
    isas = [i for i in cpu_vec_isa.supported_vec_isa_list[-2:]]
    flags = sorted({flag for isa in isas for flag in str(isa).split()})
    monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker", lambda: flags)
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: isas)
    run()
    (record,) = (tmp_path / "lp_lightning").glob("vec_isa_*.json")
    record.write_text("{not json")
    cpp.vec_isa_ok = None
    assert run()["all_candidates_pass"] is True and cpp.vec_isa_ok is True

