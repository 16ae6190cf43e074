"""``run_summary.json`` ``versions`` (lp_lightning/versions.py, design spec §17.1)."""

from __future__ import annotations

import sys
import types

import torch

from lp_lightning.versions import software_versions


def test_versions_on_cpu_name_torch_and_no_ascend_software():
    versions = software_versions()
    assert versions["torch"] == torch.__version__ and versions["lightning"] and versions["transformers"]
    assert versions["torch_npu"] is None and versions["cann"] is None  # not installed here


def test_cann_version_is_read_where_torch_npu_exports_it(monkeypatch):
    """torch_npu 2.13.0 defines get_cann_version in torch_npu/npu/utils.py and re-exports it from
    torch_npu.utils (torch_npu.npu does not import it); both places are read, nothing is imported."""
    for owner in ("utils", "npu.utils"):
        fake = types.ModuleType("torch_npu")
        target = fake
        for part in owner.split("."):
            setattr(target, part, types.SimpleNamespace())
            target = getattr(target, part)
        target.get_cann_version = lambda module="CANN": "9.0.0"
        monkeypatch.setitem(sys.modules, "torch_npu", fake)
        assert software_versions()["cann"] == "9.0.0", owner
