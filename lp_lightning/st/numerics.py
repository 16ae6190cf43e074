"""Layered numerics of design spec §17.3.2, layers 1 and 2, with their plots (docs/numerics.md §8.3).

**Layer 1, per operator** (:func:`operator_numerics`). The dense operator
(:func:`~lp_lightning.functional.low_precision_linear`) and the grouped one
(:func:`~lp_lightning.functional.low_precision_grouped_linear`, one projection of the routed
experts on the helpers of the grouped SwiGLU) run forward and backward once per product format
(those a ``--precision`` value selects: ``mxfp8_e4m3``, ``hif8``). Each of their three tensors is
one GEMM: ``output`` (fprop), ``dinput`` (dgrad), ``dweight`` (wgrad). Each is scored with
:func:`lp_lightning.evidence.numerics.compare` against a BF16 golden — the same operator on the
operands rounded to BF16, products and sums in FP32 — and must reach the unit-test floor
``SQNR_FLOORS_DB[(precision, "gaussian", role)]`` of :mod:`lp_lightning.formats.recipe` (the
built-in value of the threshold ``operator_sqnr_floor_db``, :mod:`lp_lightning.st.thresholds`) with no
non-finite value. The inputs are the floors' own (``sqnr_reference_input("gaussian", ...)``,
N(0, 1)) at the floors' GEMM shapes: ``x [256, 512]``, ``W [384, 512]``, ``dy [256, 384]``; the
grouped operator splits the same 256 rows over 4 experts ``[96, 0, 112, 48]`` (one empty) with
``W [4, 384, 512]``. The activations and ``dy`` enter in BF16, as in training; the weight is an
FP32 master wrapped once (``QuantizedWeightTensor.from_master``). The golden is itself scored
against FP64 (``golden_vs_fp64_sqnr_db``, ≥ 45 dB): 15+ dB cleaner than any floor, it moves the
figures by < 0.2 dB, so they agree with the floors measured against FP64
(``tests/ops/test_emulated.py``, ``tests/functional/test_linear.py``).

**Layer 2, a fixed one-layer model** (:func:`one_layer_comparison`). dsv3-tiny cut to one MoE
decoder layer (``num_hidden_layers=1``, ``first_k_dense_replace=0``: MLA, 8 routed + 1 shared
expert, LM head), built by the Trainer's LightningModule (``DeepSeekV3LM.configure_model``, HF
init, seed ``seed``) once per case ``bf16``, ``mxfp8``, ``hif8`` and converted by the Trainer's
precision plugin (``precision_plugin(precision).convert_module``: plan on the meta twin → ``plan.apply`` →
``finalize_low_precision_weights``, which builds every weight once from its FP32 master — the
startup refresh). No FSDP: the plain parameters stay BF16, the dtype FSDP2's
``MixedPrecisionPolicy`` computes with, so their gradients are the BF16 values that a one-rank
FSDP2 run would reduce to FP32. One forward/backward of the module's own ``loss`` on one fixed batch (uniform random token
ids from ``torch.Generator().manual_seed(seed)``, ``[4, 129]``) gives the loss, the gradient norm
(FP64 L2 over every parameter gradient) and the gradients, compared with ``bf16``.

**Bands** (the ε … ε·√k rule of docs/numerics.md §8.3, ``expected_rounding_error``). A format's
per-GEMM relative noise is at most ε = 10^(−S/20), S its unit-test floor, and the step's k
low-precision GEMMs (counted from the GEMM trace of the step) compound to at most ε·√k:

- loss: ``|L − L_bf16| / L_bf16 ≤ ε_fprop·√k_fprop`` (S = the fprop floor; only forward GEMMs
  reach the loss);
- gradient norm: ``|G − G_bf16| / G_bf16 ≤ ε_min·√k_all`` (S = the format's lowest GEMM floor,
  k = every low-precision GEMM of the step);
- each key gradient: SQNR against bf16 ``≥ S_min − 10·log10(k_all)`` and cosine ``≥ 1/√(1 +
  ε_min²·k_all)`` (a relative error r gives cosine 1/√(1 + r²)), no non-finite value.

With one MoE layer (9 replaced weights, 27 GEMMs, 9 of them fprop): mxfp8 loss 14.2 %, gradient
norm 24.6 %, gradients ≥ 12.2 dB / cosine ≥ 0.971; hif8 14.2 %, 39.0 %, ≥ 8.2 dB / ≥ 0.932.
The key gradients (:data:`KEY_GRADIENTS`: the replaced MLA projections, shared expert and
routed experts, and the LM head) are checked; the others (embedding, norms, router) are reported
with ``checked: false``. The bands bound quantisation noise only; discrete top-k routing is
outside them: a near-tie that flips gives a token another expert outright
(``routing_changed_tokens`` counts the tokens whose expert set differs from bf16, ≈ 2–5 % here),
which is why the router's own gradient (cosine ≈ 0.96–0.98 against bf16) is not checked.
Measured (seed 0): loss within 0.02 % of bf16, gradient norm within 0.12 %, key gradients
14.9–22.1 dB / cosine ≥ 0.984 for both formats; seeds 1–3 stay ≥ 12.7 dB / ≥ 0.973.

**JSON.** Every result is JSON-ready: dicts, lists, str, int, bool and finite floats; a
non-finite float is the string ``"inf"``, ``"-inf"`` or ``"nan"`` (``json.dumps(...,
allow_nan=False)`` accepts the result). Both layers are deterministic for a seed and use the eager
codec kernels (bit-identical to the fused ones; no compile warm-up): about 3.5 s (operators) + 7 s
(one layer) on an idle 2-core machine, plus the imports.

**Device and backend.** Both layers take the run's target (``device``, ``backend``; ``lp-lightning st``
passes the user YAML's accelerator and backend, :mod:`lp_lightning.st.target`): the inputs and models
are drawn on the CPU from the seed, so every device sees the same values, then moved to ``device``,
where the low-precision side runs on ``backend`` and the BF16 golden (or the bf16 case) runs too. On
the CPU with ``auto``/``emulated`` that is exactly the emulation's figures.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lp_lightning.evidence.numerics import compare, expected_rounding_error
from lp_lightning.formats import compiled_kernels_enabled, recipe_for, set_compiled_kernels
from lp_lightning.formats.recipe import SQNR_MEASURED_DB, sqnr_reference_input
from lp_lightning.formats.registry import precision_names
from lp_lightning.functional import low_precision_grouped_linear, low_precision_linear
from lp_lightning.lightning.module import DeepSeekV3LM
from lp_lightning.lightning.precision import precision_plugin
from lp_lightning.models.adapter import adapter_for_config
from lp_lightning.ops import GemmTraceEvent, record_gemms
from lp_lightning.st.target import check_target_device
from lp_lightning.st.thresholds import BUILTIN_THRESHOLDS, Thresholds
from lp_lightning.tensor import QuantizedWeightTensor

__all__ = [
    "GOLDEN_MIN_SQNR_DB",
    "GROUP_COUNTS",
    "KEY_GRADIENTS",
    "ONE_LAYER_OVERRIDES",
    "json_float",
    "json_metrics",
    "one_layer_comparison",
    "operator_numerics",
    "plot_one_layer",
    "plot_operator_numerics",
]

M, K, N = 256, 512, 384
"""GEMM shapes of the unit-test floors: ``x [M, K]``, ``W [N, K]``, ``dy [M, N]``."""
GROUP_COUNTS = (96, 0, 112, 48)
"""Rows per expert of the grouped operator (one empty expert; sum ``M``)."""
GOLDEN_MIN_SQNR_DB = 45.0
"""The BF16 golden must be at least this close to FP64 to stand in for it (docs/numerics.md §8.3)."""
TENSORS = (("output", "fprop"), ("dinput", "dgrad"), ("dweight", "wgrad"))
"""``(tensor, role)`` of each operator's three GEMMs."""

ONE_LAYER_OVERRIDES: dict[str, int] = {"num_hidden_layers": 1, "first_k_dense_replace": 0}
"""dsv3-tiny cut to one MoE decoder layer."""
ONE_LAYER_BATCH = (4, 129)
"""``[batch, tokens + 1]`` of the fixed batch (inputs ``[:, :-1]``, labels ``[:, 1:]``)."""
KEY_GRADIENTS: tuple[str, ...] = (
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
    "model.layers.0.self_attn.kv_b_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.shared_experts.gate_proj.weight",
    "model.layers.0.mlp.shared_experts.up_proj.weight",
    "model.layers.0.mlp.shared_experts.down_proj.weight",
    "model.layers.0.mlp.experts.gate_up_proj",
    "model.layers.0.mlp.experts.down_proj",
    "lm_head.weight",
)
"""Gradients checked against the bands (MLA projections, shared expert, routed experts, LM head)."""


# ------------------------------------------------------------------------------------------------
# JSON helpers


def json_float(value: float) -> float | str:
    """``value`` as a float, or ``"inf"`` / ``"-inf"`` / ``"nan"`` when it is not finite."""
    value = float(value)
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def json_metrics(result: torch.Tensor, reference: torch.Tensor) -> dict[str, float | int | str]:
    """``compare(result, reference)`` as a JSON-ready dict (docs/numerics.md §8.3).

    Args:
        result: Floating tensor, any shape/dtype/device.
        reference: Floating tensor of the same shape.

    Returns:
        ``numel``, ``max_abs``, ``mse``, ``nrmse``, ``cosine``, ``sqnr_db``, ``bias``,
        ``bias_over_rms``, ``nonfinite``, ``reference_nonfinite``; non-finite floats as strings.

    Raises:
        TypeError, ValueError: from ``compare`` (non-floating tensors, different shapes).
    """
    return {k: (v if isinstance(v, int) else json_float(v)) for k, v in compare(result, reference).as_dict().items()}


def _number(value: float | str) -> float:
    """Inverse of :func:`json_float`."""
    return float(value)


@contextlib.contextmanager
def _eager_codecs() -> Iterator[None]:
    """Eager codec kernels inside the block (bit-identical to the fused ones, no compile cost)."""
    previous = compiled_kernels_enabled()
    set_compiled_kernels(False)
    try:
        yield
    finally:
        set_compiled_kernels(previous)


def _formats(precisions: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """``(precision, format)`` of the product formats (or of ``precisions``), e.g. ``("mxfp8", "mxfp8_e4m3")``.

    Raises:
        ValueError: for a name that is not a low-precision ``--precision`` value.
    """
    names = precision_names()
    unknown = [p for p in precisions or () if p not in names]
    if unknown:
        raise ValueError(f"precisions={list(precisions or ())} names {unknown}; choose from {sorted(names)}.")
    return [(p, names[p].name) for p in (precisions if precisions is not None else names)]


# ------------------------------------------------------------------------------------------------
# Layer 1: per operator


def _dense_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _grouped_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    rows = torch.split(x, list(GROUP_COUNTS))
    return torch.cat([F.linear(rows_g, w[g]) for g, rows_g in enumerate(rows)])


def _autograd(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``output``, ``dinput``, ``dweight`` of ``fn(x, w)`` with output gradient ``dy`` (plain autograd)."""
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    y = fn(x, w)
    y.backward(dy)
    return {"output": y.detach(), "dinput": x.grad, "dweight": w.grad}


def _low_precision(
    operator: str, fmt: str, x: torch.Tensor, master: torch.Tensor, dy: torch.Tensor, backend: str
) -> tuple[dict[str, torch.Tensor], list[GemmTraceEvent]]:
    """The operator's three tensors in low precision on the tensors' device and the GEMM events it emitted."""
    recipe = recipe_for(fmt, backend)
    weight = QuantizedWeightTensor.from_master(
        master, recipe=recipe, kind="dense" if operator == "dense" else "grouped", requires_grad=True
    )
    x = x.detach().requires_grad_()
    with record_gemms() as events:
        if operator == "dense":
            y = low_precision_linear(x, weight, recipe=recipe)
        else:
            group_list = torch.tensor(GROUP_COUNTS, dtype=torch.int64, device=x.device)
            y = low_precision_grouped_linear(x, group_list, weight, recipe=recipe)
        y.backward(dy)
    return {"output": y.detach(), "dinput": x.grad, "dweight": weight.grad}, list(events)


def _operator_inputs(operator: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` BF16 ``[M, K]``, FP32 master ``W`` (``[N, K]`` or ``[E, N, K]``), ``dy`` BF16 ``[M, N]``."""
    x, _ = sqnr_reference_input("gaussian", (M, K), seed=seed)
    w_shape = (N, K) if operator == "dense" else (len(GROUP_COUNTS), N, K)
    master = torch.randn(w_shape, generator=torch.Generator().manual_seed(seed + 1))
    dy, _ = sqnr_reference_input("gaussian", (M, N), seed=seed + 2)
    return x.to(torch.bfloat16), master, dy.to(torch.bfloat16)


def operator_numerics(
    *,
    seed: int = 0,
    precisions: Sequence[str] | None = None,
    device: torch.device | str = "cpu",
    backend: str = "auto",
    thresholds: Thresholds = BUILTIN_THRESHOLDS,
) -> list[dict[str, Any]]:
    """Layer 1 of design spec §17.3.2: Dense and Grouped output/dinput/dweight vs a BF16 golden.

    See the module docstring for inputs, golden and floors. The inputs are drawn on the CPU (the same
    values on every device) and moved to ``device``, where the low-precision operator runs on
    ``backend`` and the BF16 golden runs too; the FP64 reference that vouches for the golden runs on
    the CPU (an NPU has no FP64 GEMM). Each row records the device and the backend that ran its GEMM.

    Args:
        seed: Seed of the inputs (``x``: ``seed``, ``W``: ``seed + 1``, ``dy``: ``seed + 2``).
        precisions: ``--precision`` values to score (``"mxfp8"``, ``"hif8"``); None = both.
        device: Where the operators and the golden run (``"cpu"``, ``"npu:0"``; the run's target,
            :func:`lp_lightning.st.target.run_target`).
        backend: The op backend of the low-precision GEMMs (``"emulated"``, ``"npu"``; ``"auto"``: the
            one registered for ``device``'s type, else ``emulated``).
        thresholds: The floors (``operator_sqnr_floor_db``, :mod:`lp_lightning.st.thresholds`).

    Returns:
        12 rows (operator × format × tensor; 6 per format), each a JSON-ready dict: ``operator``
        (``"dense"``/``"grouped"``), ``format`` (``"mxfp8_e4m3"``/``"hif8"``), ``precision``,
        ``tensor`` (``"output"``/``"dinput"``/``"dweight"``), ``role`` (``"fprop"``/``"dgrad"``/
        ``"wgrad"``), ``gemm_role``, ``layout``, ``backend``, ``shapes`` (``x``, ``weight``,
        ``dy``, ``result``, and ``group_list`` for grouped), ``golden``, ``golden_vs_fp64_sqnr_db``,
        the :func:`json_metrics` keys, ``sqnr_floor_db`` (from ``thresholds``), ``sqnr_floor_key``
        (its ``SQNR_FLOORS_DB`` key), ``threshold`` (its dotted thresholds key),
        ``sqnr_table_measured_db`` (the floor's measurement), ``device``, ``seed`` and ``pass``
        (``sqnr_db >= sqnr_floor_db`` and ``nonfinite == 0``).

    Raises:
        ValueError: for an unknown name in ``precisions``.
        RuntimeError: ``device`` is unusable (an NPU without torch_npu: ``check_target_device``), or
            the BF16 golden is not within ``GOLDEN_MIN_SQNR_DB`` of FP64 (it could not
            stand in for FP64), or an operator did not emit exactly one GEMM per tensor.
    """
    rows: list[dict[str, Any]] = []
    formats = _formats(precisions)
    target = check_target_device(device)
    with _eager_codecs():
        for operator, reference in (("dense", _dense_reference), ("grouped", _grouped_reference)):
            x_cpu, master_cpu, dy_cpu = _operator_inputs(operator, seed)
            x, master, dy = (t.to(target) for t in (x_cpu, master_cpu, dy_cpu))
            golden = _autograd(reference, x.float(), master.bfloat16().float(), dy.float())
            fp64 = _autograd(reference, x_cpu.double(), master_cpu.double(), dy_cpu.double())
            shapes = {"x": list(x.shape), "weight": list(master.shape), "dy": list(dy.shape)}
            if operator == "grouped":
                shapes["group_list"] = list(GROUP_COUNTS)
            for precision, fmt in formats:
                ours, events = _low_precision(operator, fmt, x, master, dy, backend)
                by_role = {e.gemm_role.value if e.gemm_role is not None else None: e for e in events}
                expected = [f"{operator}_{role}" for _, role in TENSORS]
                if len(events) != len(TENSORS) or sorted(by_role, key=str) != sorted(expected):
                    raise RuntimeError(
                        f"operator_numerics: {operator} {fmt} ran low-precision GEMMs {[e.gemm_role for e in events]}, "
                        f"expected one each of {expected}; a GEMM ran in high precision, twice or unlabelled."
                    )
                for tensor, role in TENSORS:
                    event = by_role[f"{operator}_{role}"]
                    golden_sqnr = compare(golden[tensor], fp64[tensor]).sqnr_db
                    if not golden_sqnr >= GOLDEN_MIN_SQNR_DB:
                        raise RuntimeError(
                            f"operator_numerics: the BF16 golden of {operator} {tensor} is {golden_sqnr:.1f} dB from "
                            f"FP64, below {GOLDEN_MIN_SQNR_DB} dB; it cannot stand in for FP64 (check the inputs)."
                        )
                    metrics = json_metrics(ours[tensor], golden[tensor])
                    floor_key = (precision, "gaussian", role)
                    floor = thresholds.get(None, "operator_sqnr_floor_db", precision, role)
                    rows.append({
                        "operator": operator,
                        "format": fmt,
                        "precision": precision,
                        "tensor": tensor,
                        "role": role,
                        "gemm_role": f"{operator}_{role}",
                        "layout": event.layout,
                        "backend": event.backend,
                        "device": str(target),
                        "shapes": {**shapes, "result": list(ours[tensor].shape)},
                        "golden": "the same operator on BF16-rounded operands, FP32 products and sums",
                        "golden_vs_fp64_sqnr_db": json_float(golden_sqnr),
                        **metrics,
                        "sqnr_floor_db": floor,
                        "sqnr_floor_key": list(floor_key),
                        "threshold": f"operator_sqnr_floor_db.{precision}.{role}",
                        "sqnr_table_measured_db": SQNR_MEASURED_DB[floor_key],
                        "seed": seed,
                        "pass": _number(metrics["sqnr_db"]) >= floor and metrics["nonfinite"] == 0,
                    })
    return rows


# ------------------------------------------------------------------------------------------------
# Layer 2: a fixed one-layer model


def _one_layer_step(precision: str, seed: int, ids: torch.Tensor, backend: str) -> dict[str, Any]:
    """Build (on the CPU), move to ``ids``' device, convert (production plugin, ``backend``) and run one
    forward/backward of the one-layer model."""
    module = DeepSeekV3LM(
        config_name_or_path="dsv3-tiny", config_overrides=dict(ONE_LAYER_OVERRIDES), validate_spec=False, seed=seed
    )
    module.configure_model()
    module.model.to(ids.device)
    plugin = precision_plugin(precision, backend=backend)
    model = plugin.convert_module(module.model)
    routing: list[torch.Tensor] = []
    gate = model.get_submodule("model.layers.0.mlp.gate")
    hook = gate.register_forward_hook(lambda _m, _i, out: routing.append(out[2].detach().sort(dim=-1).values.cpu()))
    try:
        with record_gemms() as events:
            loss = module.loss({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
            loss.backward()
    finally:
        hook.remove()
    grads = {name: p.grad.detach().to(torch.float32).cpu() for name, p in model.named_parameters()
             if p.grad is not None}
    grad_norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
    gemms: dict[str, int] = {}
    for event in events:
        key = event.gemm_role.value if event.gemm_role is not None else "unlabelled"
        gemms[key] = gemms.get(key, 0) + 1
    report = plugin.replacement_report
    return {
        "loss": float(loss.detach()),
        "grad_norm": grad_norm,
        "grads": grads,
        "routing": routing[0],
        "summary": {
            "loss": json_float(float(loss.detach())),
            "grad_norm": json_float(grad_norm),
            "backend": plugin.backend,
            "device": str(ids.device),
            "replaced": dict(report.counts) if report is not None else {},
            "low_precision_weights": len(plugin.low_precision_weights),
            "low_precision_gemms": gemms,
            "gemm_backends": sorted({e.backend for e in events}),
        },
    }


def _bands(precision: str, gemms: dict[str, int], thresholds: Thresholds = BUILTIN_THRESHOLDS) -> dict[str, Any]:
    """The format's loss, gradient-norm and gradient bands (module docstring, "Bands"), from the per-GEMM
    floors ``thresholds`` ``one_layer_sqnr_floor_db``."""
    floors = {role: thresholds.get(None, "one_layer_sqnr_floor_db", precision, role) for _, role in TENSORS}
    s_fprop, s_min = floors["fprop"], min(floors.values())
    k_fprop = sum(n for role, n in gemms.items() if role.endswith("fprop"))
    k_all = sum(gemms.values())
    if k_fprop < 1 or k_all < 1:
        raise RuntimeError(
            f"one_layer_comparison: precision={precision!r} ran {k_all} low-precision GEMMs ({gemms}); the "
            "plugin converted nothing, so there is no low-precision result to compare."
        )
    eps_fprop, eps_min = 10.0 ** (-s_fprop / 20.0), 10.0 ** (-s_min / 20.0)
    sqnr_floor = s_min - 10.0 * math.log10(k_all)
    return {
        "sqnr_floors_db": floors,
        "k_fprop": k_fprop,
        "k_all": k_all,
        "loss_rel_band": expected_rounding_error(eps_fprop, k_fprop).high,
        "grad_norm_rel_band": expected_rounding_error(eps_min, k_all).high,
        "gradient_sqnr_floor_db": sqnr_floor,
        "gradient_cosine_floor": 1.0 / math.sqrt(1.0 + 10.0 ** (-sqnr_floor / 10.0)),
    }


def one_layer_comparison(
    *,
    seed: int = 0,
    precisions: Sequence[str] | None = None,
    device: torch.device | str = "cpu",
    backend: str = "auto",
    thresholds: Thresholds = BUILTIN_THRESHOLDS,
) -> dict[str, Any]:
    """Layer 2 of design spec §17.3.2: one step of a fixed one-layer DeepSeek-V3, bf16 vs mxfp8 vs hif8.

    See the module docstring for the model, the conversion, the batch and the bands. Every case
    (the bf16 golden too) is built on the CPU from the same seed, moved to ``device`` and run there;
    the low-precision cases' GEMMs run on ``backend``. Gradients are compared on the CPU.

    Args:
        seed: Seed of the model initialisation and of the batch.
        precisions: Low-precision cases to run next to ``bf16`` (``"mxfp8"``, ``"hif8"``); None = both.
        device: Where every case runs (``"cpu"``, ``"npu:0"``).
        backend: The low-precision cases' op backend (``"auto"``: by ``device``'s type).
        thresholds: The per-GEMM floors the bands derive from (``one_layer_sqnr_floor_db``).

    Returns:
        A JSON-ready dict: ``model`` (spec, overrides, seed), ``batch`` (shape, tokens, source),
        ``key_gradients``, ``cases`` (``bf16``/``mxfp8``/``hif8`` → ``loss``, ``grad_norm``,
        ``backend``, ``device``, ``replaced``, ``low_precision_weights``, ``low_precision_gemms`` by role,
        ``gemm_backends``), ``comparisons`` (``mxfp8``/``hif8`` → ``bands`` (see
        :func:`_bands`), ``loss_abs_diff``, ``loss_rel_diff``, ``loss_pass``,
        ``grad_norm_rel_diff``, ``grad_norm_pass``, ``routing_changed_tokens``, ``tokens``,
        ``gradients`` (FQN → ``shape``, ``checked``, the :func:`json_metrics` keys against bf16,
        ``pass`` or ``None`` when unchecked), ``gradients_pass``, ``pass``), ``pass`` (every
        comparison passed) and ``seconds``.

    Raises:
        ValueError: for an unknown name in ``precisions``.
        RuntimeError: ``device`` is unusable (an NPU without torch_npu: ``check_target_device``), a
            low-precision case ran no low-precision GEMM, or the bf16 case ran one.
    """
    start = time.perf_counter()
    batch, width = ONE_LAYER_BATCH
    formats = _formats(precisions)
    with _eager_codecs():
        vocab = _one_layer_vocab()
        ids = torch.randint(0, vocab, (batch, width), generator=torch.Generator().manual_seed(seed))
        ids = ids.to(check_target_device(device))
        steps = {"bf16": _one_layer_step("bf16", seed, ids, backend)}
        for precision, _ in formats:
            steps[precision] = _one_layer_step(precision, seed, ids, backend)
    if steps["bf16"]["summary"]["low_precision_gemms"]:
        raise RuntimeError(
            f"one_layer_comparison: the bf16 case ran low-precision GEMMs "
            f"{steps['bf16']['summary']['low_precision_gemms']}; bf16 must convert nothing."
        )
    base = steps["bf16"]
    comparisons = {}
    for precision, _ in formats:
        step = steps[precision]
        bands = _bands(precision, step["summary"]["low_precision_gemms"], thresholds)
        gradients = {}
        for name, grad in base["grads"].items():
            checked = name in KEY_GRADIENTS
            metrics = json_metrics(step["grads"][name], grad)
            ok = (
                _number(metrics["sqnr_db"]) >= bands["gradient_sqnr_floor_db"]
                and _number(metrics["cosine"]) >= bands["gradient_cosine_floor"]
                and metrics["nonfinite"] == 0
            )
            gradients[name] = {"shape": list(grad.shape), "checked": checked, **metrics, "pass": ok if checked else None}
        loss_rel = abs(step["loss"] - base["loss"]) / abs(base["loss"])
        norm_rel = abs(step["grad_norm"] - base["grad_norm"]) / base["grad_norm"]
        loss_ok = math.isfinite(step["loss"]) and loss_rel <= bands["loss_rel_band"]
        norm_ok = math.isfinite(step["grad_norm"]) and norm_rel <= bands["grad_norm_rel_band"]
        grads_ok = all(g["pass"] for g in gradients.values() if g["checked"])
        comparisons[precision] = {
            "bands": bands,
            "loss_abs_diff": json_float(step["loss"] - base["loss"]),
            "loss_rel_diff": json_float(loss_rel),
            "loss_pass": loss_ok,
            "grad_norm_rel_diff": json_float(norm_rel),
            "grad_norm_pass": norm_ok,
            "routing_changed_tokens": int((step["routing"] != base["routing"]).any(dim=-1).sum()),
            "tokens": int(base["routing"].shape[0]),
            "gradients": gradients,
            "gradients_pass": grads_ok,
            "pass": loss_ok and norm_ok and grads_ok,
        }
    missing = [name for name in KEY_GRADIENTS if name not in base["grads"]]
    if missing:
        raise RuntimeError(f"one_layer_comparison: no gradient for key parameters {missing}; the model changed.")
    return {
        "model": {"config": "dsv3-tiny", "config_overrides": dict(ONE_LAYER_OVERRIDES), "seed": seed,
                  "dtype": "bfloat16 (FP32 masters for the low-precision weights, FP32 router)"},
        "batch": {"shape": [batch, width - 1], "tokens": batch * (width - 1),
                  "source": f"uniform random token ids, torch.Generator().manual_seed({seed})"},
        "key_gradients": list(KEY_GRADIENTS),
        "cases": {name: step["summary"] for name, step in steps.items()},
        "comparisons": comparisons,
        "pass": all(c["pass"] for c in comparisons.values()),
        "seconds": time.perf_counter() - start,
    }


def _one_layer_vocab() -> int:
    return int(adapter_for_config("dsv3-tiny").specs["dsv3-tiny"]["vocab_size"])


# ------------------------------------------------------------------------------------------------
# Plots (matplotlib, Agg)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the layered-numerics plots need matplotlib; install it with `pip install matplotlib` "
            "(or lp-lightning[test])."
        ) from err
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_operator_numerics(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """PNG of :func:`operator_numerics`: SQNR per row against its floor, and 1 − cosine.

    Args:
        rows: The rows of :func:`operator_numerics` (or read back from JSON).
        path: Where to write the PNG (parent folders are created).

    Returns:
        ``path`` as a ``Path``.
    """
    plt = _pyplot()
    labels = [f"{r['operator']}\n{r['tensor']}\n{r['precision']}" for r in rows]
    sqnr = [min(_number(r["sqnr_db"]), 99.0) for r in rows]
    one_minus_cos = [max(1.0 - _number(r["cosine"]), 1e-12) for r in rows]
    colors = ["tab:blue" if r["pass"] else "tab:red" for r in rows]
    xs = list(range(len(rows)))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8.0, 1.1 * len(rows)), 8.0), sharex=True)
    top.bar(xs, sqnr, color=colors, label="SQNR vs BF16 golden (red: below floor or non-finite)")
    for x, value in zip(xs, sqnr):
        top.annotate(f"{value:.1f}", (x, value), ha="center", va="bottom", fontsize=8)
    top.scatter(xs, [r["sqnr_floor_db"] for r in rows], marker="_", s=900, color="black", zorder=3,
                label="SQNR floor (thresholds operator_sqnr_floor_db)")
    top.set_ylabel("SQNR (dB)")
    top.set_ylim(0.0, max([35.0, *sqnr]) * 1.1)
    top.legend(loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=2, fontsize=8)
    bottom.bar(xs, one_minus_cos, color=colors)
    bottom.set_yscale("log")
    bottom.set_ylabel("1 − cosine")
    bottom.set_xticks(xs, labels, fontsize=8)
    where = ", ".join(sorted({f"{r.get('device', 'cpu')}, {r['backend']} backend" for r in rows}))
    fig.suptitle(f"design spec §17.3.2 layer 1: per-operator output/dinput/dweight against a BF16 golden ({where})")
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_one_layer(result: dict[str, Any], path: str | Path) -> Path:
    """PNG of :func:`one_layer_comparison`: loss and grad-norm deviation with bands, gradient SQNR.

    Args:
        result: The dict of :func:`one_layer_comparison` (or read back from JSON).
        path: Where to write the PNG (parent folders are created).

    Returns:
        ``path`` as a ``Path``.
    """
    plt = _pyplot()
    comparisons = result["comparisons"]
    cases = result["cases"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(16.0, 7.0), gridspec_kw={"width_ratios": [1, 2]})
    width = 0.8 / max(1, len(comparisons))
    for i, (precision, comparison) in enumerate(comparisons.items()):
        xs = [j + i * width for j in range(2)]
        values = [max(_number(comparison[key]), 1e-12) for key in ("loss_rel_diff", "grad_norm_rel_diff")]
        bands = [comparison["bands"]["loss_rel_band"], comparison["bands"]["grad_norm_rel_band"]]
        left.bar(xs, values, width=width, color=f"C{i}", label=f"{precision}: |Δ| / bf16")
        left.scatter(xs, bands, marker="_", s=700, color="black", zorder=3)
    left.set_yscale("log")
    left.set_xticks([j + 0.4 - width / 2 for j in range(2)], ["loss", "grad norm"])
    left.set_ylabel("relative difference from bf16 (black tick: the format's band)")
    text = "\n".join(
        f"{name}: loss {_number(case['loss']):.5f}, grad norm {_number(case['grad_norm']):.5f}"
        for name, case in cases.items()
    )
    left.set_title(text, fontsize=9)
    left.legend(loc="upper left", fontsize=8)
    names = list(next(iter(comparisons.values()))["gradients"])
    height = 0.8 / max(1, len(comparisons))
    for i, (precision, comparison) in enumerate(comparisons.items()):
        ys = [j + i * height for j in range(len(names))]
        values = [min(_number(comparison["gradients"][n]["sqnr_db"]), 99.0) for n in names]
        floor = comparison["bands"]["gradient_sqnr_floor_db"]
        right.barh(ys, values, height=height, color=f"C{i}", label=f"{precision} (floor {floor:.1f} dB, dashed)")
        right.axvline(floor, linestyle="--", color=f"C{i}")
    right.set_yticks([j + 0.4 - height / 2 for j in range(len(names))],
                     [n + ("" if n in result["key_gradients"] else " (reported only)") for n in names], fontsize=7)
    right.invert_yaxis()
    right.set_xlabel("gradient SQNR against bf16 (dB)")
    right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2, fontsize=8)
    fig.suptitle("design spec §17.3.2 layer 2: one-layer DeepSeek-V3 (dsv3-tiny, 1 MoE layer), one step vs bf16")
    fig.tight_layout()
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
