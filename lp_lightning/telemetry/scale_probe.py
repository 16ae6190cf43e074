"""amax, scales and scale histograms of every quantisation on sampled steps: ``scales_rank<r>.json``.

:class:`ScaleStatsProbe` is one of the probe callbacks of
:mod:`lp_lightning.telemetry.probe_callbacks` (file format there). It registers a quantize
observer (``lp_lightning.ops.add_quantize_observer``) only while a sampled step is open, so the
other steps build no quantize event at all.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from lp_lightning.observers import non_training
from lp_lightning.telemetry.probe_base import ProbeCallback, StepInfo
from lp_lightning.telemetry.probes import _dtype_name

__all__ = ["ScaleStatsProbe"]


def _values(t: torch.Tensor) -> float | list[float]:
    t = t.detach().to(torch.float32).cpu()
    return t.item() if t.dim() == 0 else t.tolist()


class ScaleStatsProbe(ProbeCallback):
    """amax and scale of every quantisation on sampled steps (``scales_rank<r>.json``).

    The quantize observer is registered only while a sampled step is open: other steps pay nothing.
    """

    kind = "scales"

    def _on_start(self) -> None:
        self._records: list[dict[str, Any]] = []
        self._hist: dict[str, torch.Tensor] = {}
        self._hist_dtype: str | None = None
        self._step_scalars: dict[str, float] = {}
        self._hooks = self._recorders()

    def _on_step_start(self) -> None:
        if self._sampled and self._hooks is not None:
            self._keep(self._hooks.add_quantize_observer(self._observe))

    def _observe(self, event: Any) -> None:
        if not self.in_step:
            return
        with non_training("probe_sample"):  # reads amax and scales back: no step time (observers)
            self._observe_sampled(event)

    def _observe_sampled(self, event: Any) -> None:
        role = event.role or "unknown"
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for operand in event.operands:
            scale = operand.scale
            key = (scale.data_ptr(), tuple(scale.shape))
            if key in seen:
                continue  # HiF8 dual operands share one scale
            seen.add(key)
            if scale.dtype == torch.float32:
                self._record(event, role, scale)
            elif scale.element_size() == 1:
                self._histogram(role, scale)

    def _record(self, event: Any, role: str, scale: torch.Tensor) -> None:
        source, amax = "event", event.amax
        if amax is None:
            source, x = "input", event.input.detach().to(torch.float32).abs()
            if scale.dim() == 0:
                amax = x.amax() if x.numel() else torch.zeros((), device=x.device)
            elif x.dim() == 3 and tuple(scale.shape) == (x.shape[0],):
                amax = x.amax(dim=(1, 2)) if x.numel() else torch.zeros(x.shape[0], device=x.device)
        fmax = event.format_max
        expected = ruled = None
        if amax is not None and fmax:
            expected = amax.to(torch.float32) / fmax
            valid = torch.isfinite(expected) & (expected > 0)
            ruled = torch.where(valid, expected, torch.ones_like(expected))
        scale32 = scale.detach()
        record = {
            "step": self._step, "role": role, "weight_fqn": event.weight_fqn, "op": event.op, "format": event.format,
            "gemm_role": None if event.gemm_role is None else event.gemm_role.value,
            "input_shape": list(event.input.shape), "format_max": fmax,
            "amax": None if amax is None else _values(amax), "amax_source": source, "scale": _values(scale32),
            "expected_scale": None if expected is None else _values(expected), "scale_dtype": _dtype_name(scale.dtype),
            "finite": bool(torch.isfinite(scale32).all()), "positive": bool((scale32 > 0).all()),
            "matches": None if ruled is None else bool(torch.equal(scale32, ruled.to(scale32.device))),
        }  # fmt: skip
        self._records.append(record)
        if amax is not None:
            key = f"scale/{role}/amax_max"
            self._step_scalars[key] = max(self._step_scalars.get(key, 0.0), float(amax.max()))
        key = f"scale/{role}/scale_max"
        self._step_scalars[key] = max(self._step_scalars.get(key, 0.0), float(scale32.max()))

    def _histogram(self, role: str, scale: torch.Tensor) -> None:
        counts = torch.bincount(scale.detach().reshape(-1).view(torch.uint8).to(torch.int64), minlength=256).cpu()
        self._hist[role] = self._hist[role] + counts if role in self._hist else counts
        self._hist_dtype = _dtype_name(scale.dtype)
        used = counts.nonzero().flatten()
        if used.numel():
            lo, hi = f"scale/{role}/byte_min", f"scale/{role}/byte_max"
            self._step_scalars[lo] = min(self._step_scalars.get(lo, 255.0), float(used.min()))
            self._step_scalars[hi] = max(self._step_scalars.get(hi, 0.0), float(used.max()))

    def _on_step_end(self, info: StepInfo) -> dict[str, float | None]:
        self._release()  # the quantize observer lives for sampled steps only
        scalars, self._step_scalars = self._step_scalars, {}
        return scalars  # type: ignore[return-value]

    def _summary(self) -> dict[str, Any]:
        by_role: defaultdict[str, list[dict[str, Any]]] = defaultdict(list)
        for record in self._records:
            by_role[record["role"]].append(record)

        def flat(values: list[Any]) -> list[float]:
            return [v for value in values if value is not None for v in (value if isinstance(value, list) else [value])]

        summary = {}
        for role, records in sorted(by_role.items()):
            amaxes, scales = flat([r["amax"] for r in records]), flat([r["scale"] for r in records])
            summary[role] = {
                "events": len(records),
                "format_max": sorted({r["format_max"] for r in records if r["format_max"] is not None}),
                "all_match": all(r["matches"] is True for r in records),
                "all_finite_positive": all(r["finite"] and r["positive"] for r in records),
                "amax_max": max(amaxes, default=None),
                "scale_min": min(scales, default=None),
                "scale_max": max(scales, default=None),
            }
        return summary

    def _payload(self) -> dict[str, Any]:
        histograms = {
            role: {str(byte): int(counts[byte]) for byte in counts.nonzero().flatten().tolist()}
            for role, counts in sorted(self._hist.items())
        }
        return {"records": self._records, "histograms": histograms, "scale_dtype": self._hist_dtype,
                "hif8": self._summary()}


