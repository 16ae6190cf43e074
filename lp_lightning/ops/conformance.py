"""Backend conformance: a backend's quantisations and GEMMs on its device against the emulation (docs/acceptance.md).

:func:`run_conformance` runs every operation a backend implements — ``quantize`` and
``quantize_dual`` (MXFP8 row / col / grouped col, HiF8 per-tensor / per-group),
``low_precision_matmul`` (NN / NT / TN, each output dtype) and ``low_precision_grouped_matmul``
(split M: NN / NT, split K: TN; with empty and uneven groups) — through the public entry points of
:mod:`lp_lightning.ops.api`, once with ``backend=<the backend>`` on its device and once with
``backend="emulated"`` on the CPU, on the same inputs (the emulation's codecs are the tested
bit-exact model on the CPU; on another device its own torch kernels — a vector division, a float8
cast — would be under test too), and compares:

- **quantize**: data codes and scales bit for bit (MXFP8 E4M3 / E8M0 bytes, HiF8 codes and the
  FP32 scale's bits), the worst element named with its input value;
- **GEMMs**: both backends multiply the *same* operands (quantized once by the emulation), so only
  the accumulation order may differ. FP32 accumulation of ``k`` products in any order is within
  ``γ_k · Σ|a_i b_i|`` of the exact sum (``γ_k = k·u / (1 − k·u)``, ``u = 2^-24``; docs/numerics.md
  §4.2, §8.3: the worst case behind the ε·O(1)…ε·√k band), each result is rounded once to the output
  dtype, so per element::

      |out − ref| ≤ 2·γ_{k+2}·S + u_out·(2·|ref| + 2·γ_{k+2}·S)·(1 + 2·u_out) + η

  with ``S = Σ|a_i b_i|`` over the decoded operands (scales included; the two extra roundings are
  the product scales), ``u_out`` the output dtype's unit roundoff and ``η`` its smallest subnormal
  plus ``(k + 2)·2^-126`` (an accumulator that flushes FP32 subnormals). A correct kernel can never
  exceed it; a BF16 rounding of an FP32 result (2^-9 relative), a lost scale or a wrong group is
  orders of magnitude above it. The worst element is named (index, value seen, reference, bound).

The inputs are deterministic (a seeded CPU generator, then moved to the device) and hold the edge
values the formats' open points are about (docs/formats.md "Open questions"): exact ties, values
next to a rounding boundary under a non-power-of-two scale, ±Inf, NaN, ±0, FP32 subnormals and the
smallest E8M0 scales, blocks near the FP32 maximum, HiF8 inputs in [2^-23, 2^-22) and at the
overflow threshold (:mod:`lp_lightning.ops.conformance_inputs`). From what the backend returned
at those elements each open question gets a verdict line (:attr:`ConformanceResult.verdicts`); on
the emulated backend every line says the run cannot settle it (the emulation would only be compared
with its own decisions).

Tensor-name legend: ``x_*`` high-precision inputs, ``M``/``K``/``N`` GEMM dims, ``T`` tokens,
``E`` groups.
"""

from __future__ import annotations

import dataclasses
import math
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lp_lightning.formats.operand import QuantizationRole, QuantizedOperand
from lp_lightning.formats.recipe import recipe_for
from lp_lightning.formats.spec import as_spec
from lp_lightning.ops import api
from lp_lightning.ops.backend import (
    LowPrecisionUnsupportedError,
    get_backend_impl,
    parse_backend_name,
)
from lp_lightning.ops.conformance_inputs import (
    EdgeInput,
    edge_generator,
    hif8_inputs,
    mx_input,
    wide_random,
)
from lp_lightning.ops.trace import record_gemms, record_quantizes

__all__ = [
    "CONFORMANCE_FORMATS",
    "REFERENCE_BACKEND",
    "ConformanceCase",
    "ConformanceResult",
    "OpenQuestionVerdict",
    "gemm_error_bound",
    "run_conformance",
]

REFERENCE_BACKEND = "emulated"
"""The backend every other one is compared with (the bit-exact model of the formats)."""

_REFERENCE_DEVICE = torch.device("cpu")
"""Where the reference runs: the emulation's codecs are the tested bit-exact model on the CPU; on
another device its own torch kernels (a vector division, a float8 cast) would be under test too."""

CONFORMANCE_FORMATS: tuple[str, ...] = ("mxfp8_e4m3", "hif8")
"""The formats whose operations :func:`run_conformance` knows how to exercise."""

_U32 = 2.0**-24
_OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_LAYOUTS = ("NN", "NT", "TN")
_GROUP_LIST = (0, 37, 5, 0, 38)
"""Token counts per group of the grouped cases: empty groups first and inside, uneven sizes, T = 80."""


# ------------------------------------------------------------------------------------------------
# Records.


@dataclass
class ConformanceCase:
    """One operation on one input, run by the backend and by the emulation.

    Attributes:
        name: What ran, e.g. ``"quantize mxfp8_e4m3 col bfloat16 [80, 96]"``.
        op: The entry point: ``"quantize"``, ``"quantize_dual"``, ``"low_precision_matmul"`` or
            ``"low_precision_grouped_matmul"``.
        format: Registry name of the format.
        params: The call's parameters (orientation, input dtype, layout, output dtype, group list, shape).
        ok: Codes and scales bit-identical (quantize), or every element within the bound (GEMMs).
        compared: Elements (bytes, or output elements) compared.
        mismatches: Elements that differ (quantize) or exceed the bound (GEMMs).
        worst: The worst element: ``tensor``, ``index``, ``seen``, ``reference`` and, for
            GEMMs, ``bound`` and ``ratio`` (|out − ref| / bound); quantize adds the ``input`` value.
        ran_on: The backends the product's own trace events name for the call (the backend and
            ``emulated``); a case whose backend call did not run on the backend fails.
        error: The exception the backend raised, if any (the case then fails).
        observations: Per edge label (``"tie"``, ``"+inf"``, ``"sub_2^-22"``, ``"nan_block"`` …):
            ``count``, ``differ`` and the codes seen / expected there (quantize cases only).
    """

    name: str
    op: str
    format: str
    params: dict[str, Any]
    ok: bool = False
    compared: int = 0
    mismatches: int = 0
    worst: dict[str, Any] | None = None
    ran_on: list[str] = field(default_factory=list)
    error: str | None = None
    observations: dict[str, dict[str, Any]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "op": self.op, "format": self.format, "params": self.params, "ok": self.ok,
            "compared": self.compared, "mismatches": self.mismatches, "worst": self.worst, "ran_on": self.ran_on,
            "error": self.error, "observations": self.observations,
        }


@dataclass(frozen=True)
class OpenQuestionVerdict:
    """What the run says about one docs/formats.md open question.

    Attributes:
        question: ``"Q1"`` … ``"Q7"`` (the list's numbers).
        status: ``"as emulated"`` (the backend behaved as the emulation decided), ``"deviates"``
            (it did not; the cases name where) or ``"not settled"`` (this run cannot say, ``text`` says why).
        text: The observation, one line.
    """

    question: str
    status: str
    text: str

    @property
    def line(self) -> str:
        word = {"as emulated": "observed", "deviates": "observed, deviates from the emulation",
                "not settled": "not settled by this run"}[self.status]
        return f"{self.question}: {self.text}: {word}"

    def as_dict(self) -> dict[str, str]:
        return {"question": self.question, "status": self.status, "text": self.text, "line": self.line}


@dataclass
class ConformanceResult:
    """The cases and verdict lines of one :func:`run_conformance` call.

    Attributes:
        backend: The backend checked.
        device: The device it ran on (``str(torch.device)``).
        formats: The formats run.
        cases: One record per operation and input.
        verdicts: One line per docs/formats.md open question (1–7).
        bound: How the GEMM bound is computed (the formula, for the report).
    """

    backend: str
    device: str
    formats: tuple[str, ...]
    cases: list[ConformanceCase]
    verdicts: list[OpenQuestionVerdict]
    bound: str = ("|out - ref| <= 2*gamma_(k+2)*S + u_out*(2*|ref| + 2*gamma_(k+2)*S)*(1 + 2*u_out) + eta, "
                  "S = sum_i |a_i*b_i|, gamma_n = n*2^-24/(1 - n*2^-24)")

    @property
    def ok(self) -> bool:
        """Every case passed (and there was at least one)."""
        return bool(self.cases) and all(c.ok for c in self.cases)

    def failures(self) -> list[ConformanceCase]:
        """The cases that failed, in run order."""
        return [c for c in self.cases if not c.ok]

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "device": self.device, "formats": list(self.formats), "ok": self.ok,
            "reference": REFERENCE_BACKEND, "bound": self.bound,
            "summary": {"cases": len(self.cases), "failed": len(self.failures())},
            "verdicts": [v.as_dict() for v in self.verdicts],
            "cases": [c.as_dict() for c in self.cases],
        }


# ------------------------------------------------------------------------------------------------
# The GEMM bound.


def _unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _smallest_subnormal(dtype: torch.dtype) -> float:
    info = torch.finfo(dtype)
    return info.tiny * info.eps


def gemm_error_bound(abs_sum: torch.Tensor, reference: torch.Tensor, k: int, output_dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound on |out − ref| for two FP32-accumulating GEMMs of the same operands (module docstring).

    Args:
        abs_sum: ``S = Σ|a_i·b_i|`` per output element (float64, scales included).
        reference: The reference output (any float dtype; read as float64).
        k: The contraction length.
        output_dtype: The GEMMs' output dtype (its unit roundoff and smallest subnormal enter the bound).

    Returns:
        float64 tensor of ``abs_sum``'s shape.
    """
    n = k + 2  # k products summed, two product-scale multiplications (HiF8; exact powers of two for MXFP8)
    gamma = n * _U32 / (1 - n * _U32)
    u_out = _unit_roundoff(output_dtype)
    accumulation = 2 * gamma * abs_sum
    rounding = u_out * (2 * reference.abs().to(torch.float64) + accumulation) * (1 + 2 * u_out)
    floor = _smallest_subnormal(output_dtype) + n * 2.0**-126
    return accumulation + rounding + floor


# ------------------------------------------------------------------------------------------------
# Running one case.


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of their bit pattern (CPU, contiguous)."""
    t = tensor.detach().cpu().contiguous()
    if t.dtype in (torch.float32, torch.int32):
        return t.view(torch.int32).to(torch.int64)
    if t.element_size() == 1:
        return t.view(torch.uint8).to(torch.int64)
    raise TypeError(f"conformance: no bit comparison for {t.dtype}")


def _hex(value: int, dtype: torch.dtype) -> str:
    return f"0x{value & 0xFFFFFFFF:08X}" if dtype == torch.float32 else f"0x{value:02X}"


def _compare_bits(case: ConformanceCase, tensor_name: str, seen: torch.Tensor, reference: torch.Tensor,
                  x: torch.Tensor | None) -> None:
    """Adds ``seen`` vs ``reference`` to the case; the first differing element becomes ``worst`` if none yet."""
    if tuple(seen.shape) != tuple(reference.shape) or seen.dtype != reference.dtype:
        case.mismatches += 1
        case.worst = case.worst or {"tensor": tensor_name, "index": None, "seen": f"{seen.dtype} {tuple(seen.shape)}",
                                    "reference": f"{reference.dtype} {tuple(reference.shape)}"}
        return
    a, b = _bytes(seen), _bytes(reference)
    case.compared += a.numel()
    differ = a != b
    count = int(differ.sum())
    case.mismatches += count
    if count and case.worst is None:
        flat = int(differ.reshape(-1).nonzero()[0])
        index = list(torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else []
        worst = {"tensor": tensor_name, "index": [int(i) for i in index],
                 "seen": _hex(int(a.reshape(-1)[flat]), seen.dtype), "reference": _hex(int(b.reshape(-1)[flat]), seen.dtype)}
        if x is not None and x.shape == a.shape:
            worst["input"] = float(x.detach().cpu().reshape(-1)[flat].to(torch.float32))
        case.worst = worst


def _block_mask(mask: torch.Tensor, orientation: str) -> torch.Tensor:
    """The 32-blocks (in the MX scale's layout) that hold a labelled element of ``mask`` (2-D)."""
    m = mask if orientation == "row" else mask.T
    blocks = -(-m.shape[-1] // 32)
    padded = torch.zeros((m.shape[0], blocks * 32), dtype=torch.bool)
    padded[:, : m.shape[-1]] = m
    out = padded.reshape(m.shape[0], blocks, 32).any(-1)
    return out if orientation == "row" else out.T


def _note(case: ConformanceCase, label: str, mask: torch.Tensor, seen: torch.Tensor, reference: torch.Tensor,
          x: torch.Tensor | None) -> None:
    """Adds the codes at ``mask`` to the case's observation ``label`` (count, differ, codes, first example)."""
    seen_codes, ref_codes = seen[mask], reference[mask]
    entry = case.observations.setdefault(label, {"count": 0, "differ": 0, "seen": [], "expected": []})
    entry["count"] += int(mask.sum())
    entry["differ"] += int((seen_codes != ref_codes).sum())
    for key, codes in (("seen", seen_codes), ("expected", ref_codes)):
        entry[key] = sorted(set(entry[key]) | {f"0x{int(c):02X}" for c in codes.unique()[:16]})
    bad = (seen_codes != ref_codes).nonzero()
    if bad.numel() and "example" not in entry:
        i = int(bad[0])
        entry["example"] = {"input": None if x is None else float(x[mask].to(torch.float32)[i]),
                            "seen": f"0x{int(seen_codes[i]):02X}", "expected": f"0x{int(ref_codes[i]):02X}"}


def _observe(case: ConformanceCase, item: EdgeInput, seen: QuantizedOperand, reference: QuantizedOperand) -> None:
    """Per edge label: how many element codes differ and which codes the backend / the emulation gave
    there; for MX block scales also the scale codes of the blocks holding such elements (``"<label> scale"``)."""
    if seen.data.shape != reference.data.shape:
        return
    if reference.scale.dtype == torch.float8_e8m0fnu and reference.group_list is not None:
        return  # grouped MX blocks stop at group ends, not at the input's 32x32 edge tiles
    a, b = _bytes(seen.data), _bytes(reference.data)
    block_scales = (reference.scale.dtype == torch.float8_e8m0fnu and reference.group_list is None
                    and reference.data.dim() == 2 and seen.scale.shape == reference.scale.shape)
    for label, mask in item.labels.items():
        if mask.shape != a.shape or not bool(mask.any()):
            continue
        _note(case, label, mask, a, b, item.x)
        if block_scales:
            _note(case, f"{label} scale", _block_mask(mask, reference.orientation), _bytes(seen.scale),
                  _bytes(reference.scale), None)


def _ran(events: Iterable[Any], case: ConformanceCase, backend: str) -> None:
    case.ran_on = sorted({e.backend for e in events})
    if backend not in case.ran_on:
        case.ok = False
        case.error = case.error or f"the product's trace events name {case.ran_on}, not the {backend!r} backend"


def _run(case: ConformanceCase, body: Callable[[], None], backend: str, events_of: Callable[[], Any]) -> ConformanceCase:
    """Runs ``body`` (which fills the case) inside a trace recorder; an exception fails the case."""
    with events_of() as events:
        try:
            body()
        except Exception as err:  # noqa: BLE001 - any failure of the backend is a conformance failure
            case.error = f"{type(err).__name__}: {err}".splitlines()[0][:400]
            case.ok = False
            case.worst = case.worst or {"tensor": None, "index": None, "seen": case.error, "reference": "no error"}
            frames = traceback.extract_tb(err.__traceback__)
            case.params["raised_in"] = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else None
            return case
    case.ok = case.mismatches == 0 and case.compared > 0
    _ran(events, case, backend)
    return case


def _quantize_case(backend: str, device: torch.device, fmt: str, op: str, role: QuantizationRole, item: EdgeInput,
                   orientation: str | None, tag: str, group_list: Sequence[int] | None = None) -> ConformanceCase:
    quantizer = recipe_for(fmt).quantizer(role)
    params: dict[str, Any] = {"input": tag, "dtype": str(item.x.dtype).removeprefix("torch."),
                              "shape": list(item.x.shape), "role": role.value}
    if orientation is not None:
        params["orientation"] = orientation
    if group_list is not None:
        params["group_list"] = list(group_list)
    what = f"{orientation or 'row+col'}{' grouped' if group_list is not None else ''}"
    case = ConformanceCase(f"{op} {fmt} {what} {params['dtype']} {list(item.x.shape)} ({tag})", op, fmt, params)
    groups = None if group_list is None else torch.tensor(group_list, dtype=torch.int64)

    def run(name: str, on: torch.device) -> tuple[QuantizedOperand, ...]:
        x_on = item.x.to(on)
        if op == "quantize":
            return (api.quantize(quantizer, x_on, orientation=orientation,
                                 group_list=None if groups is None else groups.to(on), backend=name),)
        return tuple(api.quantize_dual(quantizer, x_on, backend=name))

    def body() -> None:
        seen, reference = run(backend, device), run(REFERENCE_BACKEND, _REFERENCE_DEVICE)
        for s, r in zip(seen, reference):
            label = r.orientation
            _compare_bits(case, f"{label} data", s.data, r.data, item.x)
            _compare_bits(case, f"{label} scale", s.scale, r.scale, None)
            if s.orientation != r.orientation or (s.group_list is None) != (r.group_list is None):
                case.mismatches += 1
                case.worst = case.worst or {"tensor": f"{label} metadata", "index": None,
                                            "seen": f"{s.orientation}, group_list {s.group_list is not None}",
                                            "reference": f"{r.orientation}, group_list {r.group_list is not None}"}
            _observe(case, item, s, r)

    return _run(case, body, backend, record_quantizes)


def _decoded64(operand: QuantizedOperand) -> torch.Tensor:
    """The operand's exact values (scales applied) in float64; ``operand`` is a CPU reference operand."""
    return operand.format.dequantize(operand).to(torch.float64)


def _on(operand: QuantizedOperand, device: torch.device) -> QuantizedOperand:
    """A copy of a (CPU) operand on ``device``: the same bytes, no cached decoded values."""
    return dataclasses.replace(
        operand, data=operand.data.to(device), scale=operand.scale.to(device), values=None,
        group_list=None if operand.group_list is None else operand.group_list.to(device),
    )


def _op(matrix: torch.Tensor, transpose: bool) -> torch.Tensor:
    return matrix.transpose(-2, -1) if transpose else matrix


def _compare_gemm(case: ConformanceCase, out: torch.Tensor, ref: torch.Tensor, abs_sum: torch.Tensor, k: int,
                  output_dtype: torch.dtype) -> None:
    if tuple(out.shape) != tuple(ref.shape) or out.dtype != ref.dtype:
        case.mismatches += 1
        case.worst = {"tensor": "out", "index": None, "seen": f"{out.dtype} {tuple(out.shape)}",
                      "reference": f"{ref.dtype} {tuple(ref.shape)}"}
        return
    seen, reference = out.detach().cpu().to(torch.float64), ref.detach().cpu().to(torch.float64)
    bound = gemm_error_bound(abs_sum, reference, k, output_dtype)
    both_finite = torch.isfinite(seen) & torch.isfinite(reference)
    same_special = (torch.isnan(seen) & torch.isnan(reference)) | (~both_finite & (seen == reference))
    diff = torch.where(both_finite, (seen - reference).abs(), torch.zeros_like(seen))
    ratio = torch.where(both_finite, diff / bound, torch.where(same_special, 0.0, math.inf))
    case.compared += ratio.numel()
    case.mismatches += int((ratio > 1).sum())
    if ratio.numel():
        flat = int(ratio.reshape(-1).argmax())
        index = [int(i) for i in torch.unravel_index(torch.tensor(flat), ratio.shape)]
        case.worst = {"tensor": "out", "index": index, "seen": float(seen.reshape(-1)[flat]),
                      "reference": float(reference.reshape(-1)[flat]), "bound": float(bound.reshape(-1)[flat]),
                      "ratio": float(ratio.reshape(-1)[flat])}


def _gemm_operands(fmt: str, layout: str, gen: torch.Generator,
                   m: int = 40, k: int = 96, n: int = 24) -> tuple[QuantizedOperand, QuantizedOperand]:
    """Emulation-quantized CPU operands of ``op(left) [m, k] @ op(right) [k, n]``, with a zero block in each."""
    recipe = recipe_for(fmt)
    left_shape = (m, k) if layout[0] == "N" else (k, m)
    right_shape = (k, n) if layout[1] == "N" else (n, k)
    left_orientation = "row" if layout[0] == "N" else "col"
    right_orientation = "col" if layout[1] == "N" else "row"
    x_left = wide_random(gen, left_shape, -3, 3)
    x_right = wide_random(gen, right_shape, -3, 3)
    x_left[:8, :32] = 0.0
    x_right[-32:, -8:] = 0.0
    left = api.quantize(recipe.quantizer(QuantizationRole.INPUT_FWD), x_left.to(torch.bfloat16),
                        orientation=left_orientation, backend=REFERENCE_BACKEND)
    right = api.quantize(recipe.quantizer(QuantizationRole.WEIGHT_FWD), x_right.to(torch.bfloat16),
                         orientation=right_orientation, backend=REFERENCE_BACKEND)
    return left, right


def _matmul_case(backend: str, device: torch.device, fmt: str, layout: str, output_dtype: torch.dtype) -> ConformanceCase:
    dtype_name = str(output_dtype).removeprefix("torch.")
    case = ConformanceCase(f"low_precision_matmul {fmt} {layout} -> {dtype_name}", "low_precision_matmul", fmt,
                           {"layout": layout, "output_dtype": dtype_name, "m": 40, "k": 96, "n": 24})

    def body() -> None:
        left, right = _gemm_operands(fmt, layout, edge_generator())
        out = api.low_precision_matmul(_on(left, device), _on(right, device), layout=layout,
                                       output_dtype=output_dtype, backend=backend)
        ref = api.low_precision_matmul(left, right, layout=layout, output_dtype=output_dtype, backend=REFERENCE_BACKEND)
        a, b = _op(_decoded64(left), layout[0] == "T"), _op(_decoded64(right), layout[1] == "T")
        _compare_gemm(case, out, ref, a.abs() @ b.abs(), a.shape[1], output_dtype)

    return _run(case, body, backend, record_gemms)


def _grouped_case(backend: str, device: torch.device, fmt: str, layout: str, output_dtype: torch.dtype) -> ConformanceCase:
    dtype_name = str(output_dtype).removeprefix("torch.")
    split = "split K" if layout == "TN" else "split M"
    case = ConformanceCase(f"low_precision_grouped_matmul {fmt} {layout} ({split}) -> {dtype_name}",
                           "low_precision_grouped_matmul", fmt,
                           {"layout": layout, "group_type": split, "output_dtype": dtype_name,
                            "group_list": list(_GROUP_LIST), "k": 64, "n": 40})
    recipe = recipe_for(fmt)
    tokens, k, n = sum(_GROUP_LIST), 64, 40

    def body() -> None:
        gen = edge_generator()
        groups = torch.tensor(_GROUP_LIST, dtype=torch.int64)
        counts = list(_GROUP_LIST)
        if layout == "TN":  # wgrad: out[g] = x_gᵀ · dy_g, both col operands quantized per group
            x_TK = wide_random(gen, (tokens, k), -3, 3).to(torch.bfloat16)
            dy_TN = wide_random(gen, (tokens, n), -3, 3).to(torch.bfloat16)
            left = api.quantize(recipe.quantizer(QuantizationRole.INPUT_BWD), x_TK, orientation="col",
                                group_list=groups, backend=REFERENCE_BACKEND)
            right = api.quantize(recipe.quantizer(QuantizationRole.GRAD_OUTPUT), dy_TN, orientation="col",
                                 group_list=groups, backend=REFERENCE_BACKEND)
        else:  # fprop NN: x [T, K] · W[g] [K, N]; dgrad NT: dy [T, N] · W[g]ᵀ, W in the GMM view [E, K, N]
            width = k if layout == "NN" else n
            x_TC = wide_random(gen, (tokens, width), -3, 3).to(torch.bfloat16)
            w_EKN = wide_random(gen, (len(counts), k, n), -3, 3)
            w_EKN[2] = 0.0
            left = api.quantize(recipe.quantizer(QuantizationRole.INPUT_FWD), x_TC, orientation="row",
                                backend=REFERENCE_BACKEND)
            right = api.quantize(recipe.quantizer(QuantizationRole.WEIGHT_FWD), w_EKN.to(torch.bfloat16),
                                 orientation="col" if layout == "NN" else "row", backend=REFERENCE_BACKEND)
        out = api.low_precision_grouped_matmul(_on(left, device), _on(right, device), groups.to(device),
                                               layout=layout, output_dtype=output_dtype, backend=backend)
        ref = api.low_precision_grouped_matmul(left, right, groups, layout=layout, output_dtype=output_dtype,
                                               backend=REFERENCE_BACKEND)
        a_TC, b = _decoded64(left), _decoded64(right)
        if layout == "TN":
            pieces, start = [], 0
            for count in counts:
                rows = slice(start, start + count)
                pieces.append(a_TC[rows].abs().T @ b[rows].abs())
                start += count
            abs_sum, contraction = torch.stack(pieces), max(counts)
        else:
            abs_sum = torch.zeros((tokens, b.shape[2] if layout == "NN" else b.shape[1]), dtype=torch.float64)
            start = 0
            for g, count in enumerate(counts):
                rows = slice(start, start + count)
                abs_sum[rows] = a_TC[rows].abs() @ _op(b[g], layout == "NT").abs()
                start += count
            contraction = a_TC.shape[1]
        _compare_gemm(case, out, ref, abs_sum, contraction, output_dtype)

    return _run(case, body, backend, record_gemms)


# ------------------------------------------------------------------------------------------------
# The cases of each format.


def _mxfp8_cases(backend: str, device: torch.device) -> list[ConformanceCase]:
    fmt, cases = "mxfp8_e4m3", []
    role = QuantizationRole.INPUT_FWD
    for dtype in (torch.bfloat16, torch.float32):
        item = mx_input(dtype)
        for orientation in ("row", "col"):
            cases.append(_quantize_case(backend, device, fmt, "quantize", role, item, orientation, "edge tiles"))
        cases.append(_quantize_case(backend, device, fmt, "quantize_dual", QuantizationRole.WEIGHT_FWD, item, None,
                                    "edge tiles"))
        grouped = mx_input(dtype, cols=64)
        cases.append(_quantize_case(backend, device, fmt, "quantize", QuantizationRole.INPUT_BWD, grouped, "col",
                                    "edge tiles", group_list=_GROUP_LIST))
        weight = EdgeInput(wide_random(edge_generator(), (3, 64, 40)).to(dtype), {})
        cases.append(_quantize_case(backend, device, fmt, "quantize_dual", QuantizationRole.WEIGHT_FWD, weight, None,
                                    "3-D weight"))
    return cases


def _hif8_cases(backend: str, device: torch.device) -> list[ConformanceCase]:
    fmt, cases = "hif8", []
    inputs = {dtype: hif8_inputs(dtype) for dtype in (torch.float32, torch.bfloat16)}
    fwd, grad = QuantizationRole.INPUT_FWD, QuantizationRole.GRAD_OUTPUT
    for name in ("specials", "ties", "near_ties"):
        for orientation in ("row", "col"):
            cases.append(_quantize_case(backend, device, fmt, "quantize", fwd, inputs[torch.float32][name],
                                        orientation, name))
    cases.append(_quantize_case(backend, device, fmt, "quantize", fwd, inputs[torch.bfloat16]["ties"], "row", "ties"))
    cases.append(_quantize_case(backend, device, fmt, "quantize", grad, inputs[torch.bfloat16]["specials"], "row",
                                "specials"))
    cases.append(_quantize_case(backend, device, fmt, "quantize", fwd, inputs[torch.float32]["ties"], "row", "ties",
                                group_list=(0, 12, 4, 0, 16)))
    cases.append(_quantize_case(backend, device, fmt, "quantize", fwd, inputs[torch.float32]["grouped"], "col",
                                "per-group 3-D"))
    for name in ("ties", "grouped"):
        cases.append(_quantize_case(backend, device, fmt, "quantize_dual", QuantizationRole.WEIGHT_FWD,
                                    inputs[torch.float32][name], None, name if name != "grouped" else "per-group 3-D"))
    return cases


_CASES: dict[str, Callable[[str, torch.device], list[ConformanceCase]]] = {"mxfp8_e4m3": _mxfp8_cases, "hif8": _hif8_cases}


def _gemm_cases(backend: str, device: torch.device, fmt: str) -> list[ConformanceCase]:
    cases = [_matmul_case(backend, device, fmt, layout, dtype) for layout in _LAYOUTS for dtype in _OUTPUT_DTYPES]
    cases += [_grouped_case(backend, device, fmt, layout, dtype) for layout in _LAYOUTS
              for dtype in (torch.bfloat16, torch.float32)]  # what a run's grouped GEMMs write: BF16, FP32 (wgrad)
    return cases


# ------------------------------------------------------------------------------------------------
# Verdicts on docs/formats.md "Open questions".


def _observed(cases: list[ConformanceCase], fmt: str, label: str, ops: tuple[str, ...] = ("quantize", "quantize_dual")
              ) -> dict[str, Any]:
    total = {"count": 0, "differ": 0, "seen": set(), "expected": set(), "example": None}
    for case in cases:
        if case.format == fmt and case.op in ops and label in case.observations:
            entry = case.observations[label]
            total["count"] += entry["count"]
            total["differ"] += entry["differ"]
            total["seen"] |= set(entry["seen"])
            total["expected"] |= set(entry["expected"])
            total["example"] = total["example"] or entry.get("example")
    return total


def _status(observed: Sequence[bool | None]) -> str:
    """``deviates`` if any observation differs, ``not settled`` if one saw nothing, else ``as emulated``."""
    if any(o is False for o in observed):
        return "deviates"
    return "not settled" if any(o is None for o in observed) else "as emulated"


def _codes_line(name: str, obs: dict[str, Any]) -> tuple[str, bool | None]:
    """``"<name> -> <codes> as the emulation"`` (codes listed when at most three), or where they differ;
    ``None`` when no such element was observed (its cases raised)."""
    if not obs["count"]:
        return f"{name}: nothing observed (its cases raised)", None

    def codes(key: str) -> str:
        found = sorted(obs[key])
        return "/".join(found) if len(found) <= 3 else f"{len(found)} codes"

    if obs["differ"]:
        text = f"{name} -> {codes('seen')} at {obs['differ']} of {obs['count']} (the emulation: {codes('expected')})"
        if obs.get("example"):
            example = obs["example"]
            text += f", e.g. x {example['input']!r} -> {example['seen']} (the emulation {example['expected']})"
        return text, False
    if len(obs["seen"]) <= 3:
        return f"{name} -> {codes('seen')} as the emulation", True
    return f"{name}: {obs['count']} elements as the emulation", True


def _group_ok(cases: list[ConformanceCase], fmt: str, op: str, layouts: tuple[str, ...]) -> tuple[int, int]:
    chosen = [c for c in cases if c.format == fmt and c.op == op and c.params.get("layout") in layouts]
    return sum(c.ok for c in chosen), len(chosen)


def _verdicts(backend: str, formats: Sequence[str], cases: list[ConformanceCase]) -> list[OpenQuestionVerdict]:
    questions = ("Q1", "Q2", "Q3", "Q4", "Q5", "Q6", "Q7")
    if backend == REFERENCE_BACKEND:
        why = ("the emulated backend is the reference itself, so every answer would be the emulation's own decision "
               "(docs/formats.md \"Decisions\"); run it on the hardware backend")
        return [OpenQuestionVerdict(q, "not settled", why) for q in questions]
    verdicts = [
        OpenQuestionVerdict("Q1", "not settled", f"the {backend} backend makes no HR (CAST_HYBRID) cast: recipe v1 "
                            "rounds HiF8 with TA only"),
        OpenQuestionVerdict("Q2", "not settled", f"the {backend} backend calls neither aclnnCast nor "
                            "npu_dynamic_quant (its HiF8 cast is npu_quantize's, question 7)"),
    ]
    if "hif8" in formats:
        sub = _observed(cases, "hif8", "sub_2^-22")
        text, same = _codes_line("HiF8 quantize maps x / scale in [2^-23, 2^-22)", sub)
        verdicts.append(OpenQuestionVerdict("Q3", _status([same]),
                                            text + (" (2^-22, as hicann/ge)" if same else "")))
    else:
        verdicts.append(OpenQuestionVerdict("Q3", "not settled", "hif8 was not run"))
    verdicts.append(OpenQuestionVerdict("Q4", "not settled", f"the {backend} backend does not call "
                                        "npu_dynamic_quant, so its default DTYPE_MAX is never used"))
    if "mxfp8_e4m3" in formats:
        parts, seen = [], []
        for label, name in (("nan_block", "block with NaN"), ("+inf_block", "block with +Inf"),
                            ("-inf_block", "block with -Inf"), ("tie", "E4M3 ties (half to even)"),
                            ("zero_block", "all-zero block"), ("tiny_block", "smallest scales / FP32 subnormals"),
                            ("fp32_max_block", "blocks near the FP32 maximum")):
            texts = []
            for suffix, what in (("", "codes"), (" scale", "scale")):
                text, ok = _codes_line(what, _observed(cases, "mxfp8_e4m3", label + suffix))
                texts.append(text)
                seen.append(ok)
            parts.append(f"{name}: {', '.join(texts)}")
        scales_ok = all(c.ok for c in cases if c.format == "mxfp8_e4m3" and c.op.startswith("quantize"))
        verdicts.append(OpenQuestionVerdict("Q5", _status([*seen, scales_ok]),
                                            "MX quantize: " + "; ".join(parts)
                                            + ("; scales bit-identical" if scales_ok else "; scales or codes differ")))
        quant_ok = sum(c.ok for c in cases if c.format == "mxfp8_e4m3" and c.op.startswith("quantize"))
        quant_n = sum(1 for c in cases if c.format == "mxfp8_e4m3" and c.op.startswith("quantize"))
        transposed = _group_ok(cases, "mxfp8_e4m3", "low_precision_matmul", ("NT", "TN"))
        split_m = _group_ok(cases, "mxfp8_e4m3", "low_precision_grouped_matmul", ("NN", "NT"))
        split_k = _group_ok(cases, "mxfp8_e4m3", "low_precision_grouped_matmul", ("TN",))
        all_ok = quant_ok == quant_n and all(a == b for a, b in (transposed, split_m, split_k))
        verdicts.append(OpenQuestionVerdict(
            "Q6", "as emulated" if all_ok else "deviates",
            f"A5 arguments: MX scale-pair layout read back bit-exact in {quant_ok}/{quant_n} quantize cases; "
            f"transposed scale views (NT/TN) within the bound in {transposed[0]}/{transposed[1]}; group_type split M "
            f"{split_m[0]}/{split_m[1]}, split K {split_k[0]}/{split_k[1]} (groups {list(_GROUP_LIST)})"))
    else:
        verdicts += [OpenQuestionVerdict(q, "not settled", "mxfp8_e4m3 was not run") for q in ("Q5", "Q6")]
    if "hif8" in formats:
        parts, seen = [], []
        finite = [c for c in cases if c.format == "hif8" and c.op.startswith("quantize")]
        for label, name in (("tie", "exact ties (away from zero)"), ("near_tie", "x next to a boundary (IEEE division)"),
                            ("+inf", "+Inf"), ("-inf", "-Inf"), ("nan", "NaN"), ("overflow", "|x| >= 40960")):
            obs = _observed(cases, "hif8", label)
            text, ok = _codes_line(name, obs)
            parts.append(text)
            seen.append(ok)
        codes_ok = all(c.ok for c in finite)
        verdicts.append(OpenQuestionVerdict(
            "Q7", _status([*seen, codes_ok]),
            "npu_quantize codes vs encode(x / scale): " + "; ".join(parts)
            + (f"; all {sum(c.compared for c in finite)} bytes of {len(finite)} cases equal" if codes_ok
               else f"; {sum(c.mismatches for c in finite)} bytes differ")))
    else:
        verdicts.append(OpenQuestionVerdict("Q7", "not settled", "hif8 was not run"))
    order = {q: i for i, q in enumerate(questions)}
    return sorted(verdicts, key=lambda v: order[v.question])


# ------------------------------------------------------------------------------------------------
# Entry point.


def run_conformance(
    backend: str,
    device: torch.device | str,
    formats: Sequence[str] = CONFORMANCE_FORMATS,
) -> ConformanceResult:
    """Every operation of ``backend`` on ``device`` against the emulation (on the CPU) on the same inputs (module docstring).

    Args:
        backend: A registered backend name (``"npu"``; ``"emulated"`` compares the emulation with itself
            and settles no open question).
        device: Where ``backend`` runs (``"npu:0"``, ``"cpu"``); inputs and the reference stay on the CPU.
        formats: Registry names, a subset of :data:`CONFORMANCE_FORMATS`.

    Returns:
        The result: ``ok`` when every case passed, the failing cases (``failures()``) naming their
        operation and worst element, and one verdict line per docs/formats.md open question.

    Raises:
        ValueError: an unknown backend, ``"auto"``, or a format without conformance cases.
        LowPrecisionUnsupportedError: the backend cannot run a format here (its capability check's
            message, e.g. torch_npu missing); raised before any input is built.
    """
    name = parse_backend_name(backend, "run_conformance")
    if name == "auto":
        raise ValueError("run_conformance: backend='auto'; name the backend to check, e.g. 'npu' (the reference is "
                         f"{REFERENCE_BACKEND!r}).")
    unknown = [f for f in formats if f not in _CASES]
    if unknown or not formats:
        raise ValueError(f"run_conformance: formats={list(formats)}; conformance cases exist for "
                         f"{list(CONFORMANCE_FORMATS)}. Pass a non-empty subset.")
    impl = get_backend_impl(name)
    for fmt in formats:
        message = impl.capability_error(as_spec(fmt))  # imports torch_npu for "npu" (so "npu:0" is a device)
        if message is not None:
            raise LowPrecisionUnsupportedError(f"run_conformance: the {name!r} backend cannot run {fmt}: {message}")
    target = torch.device(device)
    cases: list[ConformanceCase] = []
    for fmt in formats:
        cases += _CASES[fmt](name, target)
        cases += _gemm_cases(name, target, fmt)
    return ConformanceResult(name, str(target), tuple(formats), cases, _verdicts(name, formats, cases))

