"""What the Q3 rows must exercise (docs/acceptance.md): a skipped step, and recompute off vs full in 8 bits.

In-process 1-rank Trainer runs of dsv3-tiny (``_inprocess.fit_tiny``, 32-token rows, 4 per step):

* :class:`~lp_lightning.telemetry.InjectNonFiniteGradient` spoils one gradient at step 2 through
  Lightning's public ``on_before_optimizer_step``: the non-finite guard skips that step, which then
  refreshes no weight while the others refresh each weight once (design spec §16.5, §16.6).
* ``activation_checkpoint`` off vs full, for mxfp8 and hif8 (design spec §16.5): recompute replays
  the same 8-bit kernels on the same inputs, so on CPU losses and gradients are bitwise equal;
  dgrad and wgrad run as often, fprop once more per GEMM (the recompute), and every weight is
  refreshed once per step in both.
"""

from __future__ import annotations

import json
import math

import lightning.pytorch as pl
import pytest
import torch

from _inprocess import fit_tiny, tiny_datamodule
from lp_lightning.lightning import LowPrecisionPlugin
from lp_lightning.telemetry import GemmTraceProbe, InjectNonFiniteGradient, RefreshProbe
from lp_lightning.telemetry.resident_probe import GradientFingerprintProbe

LOW_PRECISION_WEIGHTS = 25


class _Gradients(pl.Callback):
    """A copy of every gradient, per step, as the optimizer will read it."""

    def __init__(self) -> None:
        self.per_step: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.per_step.append({
            name.replace("._checkpoint_wrapped_module", ""): (p.grad.to_local() if hasattr(p.grad, "to_local")
                                                              else p.grad).detach().clone()
            for name, p in pl_module.model.named_parameters() if p.grad is not None
        })


def _fit(tmp_path, token_cache_dir, mode: str, recompute: str, steps: int, *extra: pl.Callback):
    refresh, gemms, grads = RefreshProbe(out_dir=str(tmp_path / "probes")), GemmTraceProbe(
        out_dir=str(tmp_path / "probes"), sample_every=10**9), _Gradients()
    prints = GradientFingerprintProbe(out_dir=str(tmp_path / "probes"))
    trainer, _, summary = fit_tiny(tmp_path, datamodule=tiny_datamodule(token_cache_dir), max_steps=steps,
                                   activation_checkpoint=recompute, plugin=LowPrecisionPlugin(mode),
                                   callbacks=[*extra, refresh, gemms, grads, prints])
    summary["_fingerprints"] = prints.result["per_step"]
    return trainer, summary, refresh.result, gemms.result, grads.per_step


def test_an_injected_nonfinite_gradient_skips_its_step_and_its_refresh(tmp_path, token_cache_dir, isolated_dist):
    with pytest.raises(ValueError, match=r"step=0 must be an int >= 1.*value='big' must be one of"):
        InjectNonFiniteGradient(step=0, value="big")
    with pytest.raises(ValueError, match=r"parameter='nomatch\*' matches no parameter FQN of the model \(e.g. 'model"):
        fit_tiny(tmp_path / "glob", datamodule=tiny_datamodule(token_cache_dir), max_steps=1,
                 callbacks=[InjectNonFiniteGradient(step=1, parameter="nomatch*")])  # at the start, not the step
    if torch.distributed.is_initialized():  # the failed fit's group; the run below starts its own
        torch.distributed.destroy_process_group()
    inject = InjectNonFiniteGradient(step=2, parameter="model.layers.0.mlp.*", out_dir=str(tmp_path / "probes"))
    trainer, summary, refresh, _, grads = _fit(tmp_path, token_cache_dir, "mxfp8", "off", 3, inject)
    assert inject.result["injected"] == [{"step": 2, "fqn": "model.layers.0.mlp.gate_proj.weight", "rank": 0,
                                          "value": "inf", "index": 0}]
    assert json.loads((tmp_path / "probes" / "inject_rank0.json").read_text())["at_step"] == 2
    assert math.isinf(grads[1]["model.layers.0.mlp.gate_proj.weight"].reshape(-1)[0])  # what the guard saw
    plugin = trainer.precision_plugin
    assert (plugin.optimizer_steps_applied, plugin.optimizer_steps_skipped) == (2, 1)
    assert summary["nonfinite"]["skipped_steps"] == 1  # the guard names the step and the gradient
    assert summary["nonfinite"]["skips"] == [{"step": 2, "reason": "non-finite gradient",
                                              "fqn": "model.layers.0.mlp.gate_proj.weight"}]
    assert [(s["step"], s["skipped"], s["refreshes"], s["weights"], s["max_per_weight"]) for s in refresh["per_step"]] == [
        (1, False, LOW_PRECISION_WEIGHTS, LOW_PRECISION_WEIGHTS, 1), (2, True, 0, 0, 0),
        (3, False, LOW_PRECISION_WEIGHTS, LOW_PRECISION_WEIGHTS, 1)]
    assert math.isfinite(summary["losses"][2])  # the run goes on from the unchanged masters


@pytest.mark.parametrize("mode", ["mxfp8", "hif8"])
def test_recompute_full_matches_off_bitwise_with_the_same_kernels(mode, tmp_path, token_cache_dir, isolated_dist):
    _, off, off_refresh, off_gemms, off_grads = _fit(tmp_path / "off", token_cache_dir, mode, "off", 2)
    torch.distributed.destroy_process_group()
    _, full, full_refresh, full_gemms, full_grads = _fit(tmp_path / "full", token_cache_dir, mode, "full", 2)
    assert full["losses"] == off["losses"] and full["grad_norms"] == off["grad_norms"]
    # st's Q3-08 compares these fingerprints (lp_lightning.st.sections): equal here, and they do see a change
    assert full["_fingerprints"] == off["_fingerprints"] and len(off["_fingerprints"][0]["grads"]) > LOW_PRECISION_WEIGHTS
    assert off["_fingerprints"][0]["grads"] != off["_fingerprints"][1]["grads"]
    for step, (a, b) in enumerate(zip(off_grads, full_grads), start=1):
        assert a.keys() == b.keys() and len(a) > LOW_PRECISION_WEIGHTS
        different = [name for name in a if not torch.equal(a[name], b[name])]
        assert different == [], f"step {step}: {different[:5]}"
    per_role = lambda counts: {key.split("|")[0]: n for key, n in counts.items()}  # noqa: E731
    off_roles, full_roles = per_role(off_gemms["counts"]), per_role(full_gemms["counts"])
    assert set(off_roles) == set(full_roles) and len(off_roles) == 6
    for role, n in off_roles.items():  # every replaced GEMM lives in a checkpointed decoder layer
        assert full_roles[role] == (2 * n if role.endswith("fprop") else n), (role, n, full_roles[role])
    for refresh in (off_refresh, full_refresh):
        assert [(s["refreshes"], s["max_per_weight"]) for s in refresh["per_step"]] == [(LOW_PRECISION_WEIGHTS, 1)] * 2
        assert refresh["forward_backward_refreshes"] == 0
