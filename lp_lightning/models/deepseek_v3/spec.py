"""Build HF transformers' DeepSeek-V3 from a config, randomly initialised, and validate it (§4.1, R4).

Build order follows design spec §12.1 steps 1, 2 and 4:

1. :func:`build_config` reads a DeepseekV3Config (a built-in spec name or a local ``config.json``;
   never a hub download) and applies ``config_overrides``;
2. :func:`build_meta_model` builds ``DeepseekV3ForCausalLM`` on the meta device (structure only;
   the replacement plan of §5 is compiled from this);
3. :func:`from_hf_config` materialises it on ``device`` (``to_empty``) and runs HF's own
   initialisation (``PreTrainedModel.initialize_weights`` -> ``DeepseekV3PreTrainedModel._init_weights``),
   seeded for bitwise reproducibility, then validates it against its spec (:func:`validate_spec`).

Named specs (:data:`SPECS`) are read-only mappings of DeepseekV3Config fields. Every field *not*
named in a spec keeps the transformers 5.x DeepseekV3Config default; the ones that matter are
``hidden_act="silu"``, ``rms_norm_eps=1e-6``, ``initializer_range=0.02``, ``attention_bias=False``,
``tie_word_embeddings=False``, ``rope_parameters={"rope_type": "default", "rope_theta": 10000.0}``,
``rope_interleave=True``, ``attention_dropout=0.0``, ``bos_token_id=0``, ``eos_token_id=1``,
``pad_token_id=None`` and ``num_mtp_layers=1`` (stored only; transformers' modeling code builds no MTP
module, so it adds no parameter).

Experts implementation: ``DeepseekV3Experts`` is decorated with ``@use_experts_implementation``,
which replaces its ``forward`` with a dispatcher on ``config._experts_implementation``
(``ALL_EXPERTS_FUNCTIONS``: ``"grouped_mm"``, ``"batched_mm"``, ``"deepgemm"``, ``"sonicmoe"``; ``"eager"``
is the class's own per-expert loop). When unset, transformers 5.24 resolves it to ``"grouped_mm"``
(``PreTrainedModel.get_correct_experts_implementation``); this module pins ``"eager"`` by default,
the reference loop over ``F.linear`` that runs everywhere (CPU included) and that the low-precision
experts replacement is compared against.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import fields as dataclass_fields
from enum import Enum
from types import MappingProxyType
from typing import Any, Literal

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from lp_lightning.models.deepseek_v3.report import (
    STRUCTURE_FIELDS,
    StructureReport,
    expected_structure,
    format_layers,
    structure_report,
)

__all__ = [
    "SPECS",
    "SpecName",
    "SpecValidationError",
    "build_config",
    "build_meta_model",
    "from_hf_config",
    "inherited_fields",
    "resolve_spec",
    "validate_spec",
]


class SpecName(str, Enum):
    """Built-in model specs (keys of :data:`SPECS`)."""

    DSV3_16B = "dsv3-16b"
    """Frozen 16B spec of design spec §4.1 (the ``config_overrides`` block there, verbatim)."""
    DSV3_TINY = "dsv3-tiny"
    """CPU-sized spec of the same family (3 layers, 8 experts), every GEMM dim a multiple of 32."""


_DSV3_16B: Mapping[str, Any] = MappingProxyType(
    {
        "vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 28,
        "first_k_dense_replace": 1,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "q_lora_rank": None,
        "kv_lora_rank": 3072,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "num_experts_per_tok": 6,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 4096,
        "use_cache": False,
    }
)

# GEMM weights ([out, in]); all dims multiples of 32 and all out-features multiples of 128, so a
# 2-rank row shard of every weight stays a whole number of 32-element MX blocks (docs/formats.md):
#   q_proj 256->256 (N(Dn+Dr) = 4*64), kv_a_proj_with_mqa 256->128 (C+Dr = 96+32),
#   kv_b_proj 96->384 (N(Dn+Dv) = 4*96), o_proj 256->256 (N*Dv = 4*64),
#   dense mlp 256<->512, shared experts 256<->128 (S*F), experts gate_up [8,256,256], down [8,256,128].
_DSV3_TINY: Mapping[str, Any] = MappingProxyType(
    {
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "q_lora_rank": None,
        "kv_lora_rank": 96,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 1024,
        "use_cache": False,
        "tie_word_embeddings": False,
        # Plain RoPE, no YaRN: the tiny model must not inherit a long-context scaling.
        "rope_parameters": MappingProxyType({"rope_type": "default", "rope_theta": 10000.0}),
    }
)

#: Read-only named specs: ``SPECS[name]`` maps DeepseekV3Config field -> required value.
SPECS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {SpecName.DSV3_16B.value: _DSV3_16B, SpecName.DSV3_TINY.value: _DSV3_TINY}
)

_CONFIG_FIELDS: frozenset[str] = frozenset(f.name for f in dataclass_fields(DeepseekV3Config))
# Model fields DeepseekV3Config itself declares (not PreTrainedConfig bookkeeping like id2label).
_MODEL_FIELDS: tuple[str, ...] = tuple(DeepseekV3Config.__annotations__)
_TORCH_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
)
AttnImplementation = Literal["sdpa", "eager"]
ExpertsImplementation = Literal["eager", "grouped_mm", "batched_mm"]


class SpecValidationError(ValueError):
    """A built model or its config differs from the spec it must satisfy (design spec §4.1).

    Attributes:
        spec_name: The spec's name, or ``"<mapping>"`` for an anonymous spec.
        mismatches: ``(field, expected, actual)`` triples, one per differing field.
    """

    def __init__(self, spec_name: str, mismatches: list[tuple[str, Any, Any]]) -> None:
        self.spec_name = spec_name
        self.mismatches = tuple(mismatches)
        lines = [f"model does not match spec {spec_name!r} ({len(mismatches)} mismatch(es)):"]
        for field, expected, actual in mismatches:
            hint = "" if "." in field or "[" in field else f"  -> set {field}={expected!r}"
            lines.append(f"  {field}: expected {expected!r}, got {actual!r}{hint}")
        lines.append(
            "Fix: remove the config_overrides (or source config.json values) that change these fields, "
            "pick the spec that matches the model, or build an unvalidated variant (CLI: "
            "`--model.validate_spec false`; Python: from_hf_config(..., validate=False))."
        )
        super().__init__("\n".join(lines))


def resolve_spec(spec: str | SpecName | Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """Returns ``(name, fields)`` for a spec name or an explicit field mapping.

    Args:
        spec: A key of :data:`SPECS` (``"dsv3-16b"``, ``"dsv3-tiny"``), a :class:`SpecName`, or a
            mapping of DeepseekV3Config field -> value (named ``"<mapping>"``).

    Returns:
        The spec's name and its read-only field mapping.

    Raises:
        ValueError: If ``spec`` is an unknown name or a mapping with a non-config key.
        TypeError: If ``spec`` is neither a string nor a mapping.
    """
    if isinstance(spec, SpecName):
        spec = spec.value
    if isinstance(spec, str):
        if spec not in SPECS:
            raise ValueError(f"spec={spec!r} is not a built-in spec; allowed: {sorted(SPECS)}.")
        return spec, SPECS[spec]
    if isinstance(spec, Mapping):
        _check_field_names(spec, "spec")
        return "<mapping>", MappingProxyType(dict(spec))
    raise TypeError(f"spec must be a spec name {sorted(SPECS)} or a mapping of config fields, got {type(spec).__name__}.")


def _check_field_names(mapping: Mapping[str, Any], argument: str) -> None:
    unknown = sorted(set(mapping) - _CONFIG_FIELDS)
    if unknown:
        raise ValueError(
            f"{argument}: {unknown} are not DeepseekV3Config fields (transformers would silently keep "
            f"them as unused attributes); allowed: {sorted(_CONFIG_FIELDS)}."
        )


def _caller_stacklevel() -> int:
    """``warnings.warn`` stacklevel of the first frame outside this file (the user's call site)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    return level


def _plain(value: Any) -> Any:
    """Turns read-only mappings (spec values) into the plain dicts DeepseekV3Config expects."""
    return dict(value) if isinstance(value, Mapping) else value


def _load_local_config_dict(path: str) -> dict[str, Any]:
    """Reads a local ``config.json`` (file, or folder holding one) without touching the hub."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(
            f"config_name_or_path={path!r}: folder has no config.json. Put the DeepSeek-V3 "
            "config.json there (downloaded beforehand; lp_lightning never downloads from the hub)."
        )
    config_dict, _ = DeepseekV3Config.get_config_dict(file, local_files_only=True)
    model_type = config_dict.get("model_type", DeepseekV3Config.model_type)
    if model_type != DeepseekV3Config.model_type:
        raise ValueError(
            f"config_name_or_path={path!r}: model_type={model_type!r}, expected "
            f"{DeepseekV3Config.model_type!r}; point it at a DeepSeek-V3 config.json."
        )
    if "quantization_config" in config_dict:
        # The released DeepSeek-V3 config.json describes its FP8 *checkpoint*; we random-initialise
        # high-precision weights and quantise online, so that block must not reach the model.
        warnings.warn(
            f"config_name_or_path={path!r}: dropping 'quantization_config' "
            f"({config_dict['quantization_config'].get('quant_method', '?')}); from_hf_config random-"
            "initialises high-precision weights and never loads the quantised checkpoint.",
            stacklevel=_caller_stacklevel(),
        )
        config_dict = {k: v for k, v in config_dict.items() if k != "quantization_config"}
    return config_dict


def build_config(
    config_name_or_path: str | SpecName | os.PathLike[str],
    *,
    config_overrides: Mapping[str, Any] | None = None,
) -> DeepseekV3Config:
    """Reads a DeepseekV3Config and applies overrides (design spec §12.1 step 1).

    Args:
        config_name_or_path: A built-in spec name (key of :data:`SPECS`), or a local folder holding
            ``config.json``, or a path to a ``.json`` config file. Hub ids are never downloaded.
        config_overrides: DeepseekV3Config fields to set on top (e.g. the §4.1 block). ``None``
            values are real values (``q_lora_rank: null`` selects the plain ``q_proj``).

    Returns:
        A new DeepseekV3Config; derived fields (``qk_head_dim``, ``head_dim``) are recomputed
        from the final values.

    Raises:
        ValueError: If the name/path is neither a spec nor an existing local config, the config is
            not ``deepseek_v3``, an override key is not a config field, or a value has the wrong type.
    """
    overrides = dict(config_overrides or {})
    _check_field_names(overrides, "config_overrides")
    name = config_name_or_path.value if isinstance(config_name_or_path, SpecName) else os.fspath(config_name_or_path)
    if name in SPECS:
        base: dict[str, Any] = {key: _plain(value) for key, value in SPECS[name].items()}
    elif os.path.exists(name):
        base = _load_local_config_dict(name)
    else:
        raise ValueError(
            f"config_name_or_path={name!r} is neither a built-in spec {sorted(SPECS)} nor an existing "
            "local config.json/folder. lp_lightning builds offline: download the HF config.json "
            "yourself and pass its path."
        )
    merged = {**base, **{key: _plain(value) for key, value in overrides.items()}}
    try:
        return DeepseekV3Config.from_dict(merged)
    except (StrictDataclassError, TypeError, ValueError) as err:  # StrictDataclassError is no ValueError
        raise ValueError(
            f"config_overrides/config {name!r}: DeepseekV3Config rejected the values ({err}). "
            "Fix the field's type or value."
        ) from err


def _to_dtype(torch_dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(torch_dtype, str):
        key = torch_dtype.removeprefix("torch.")
        if key not in _TORCH_DTYPES:
            raise ValueError(f"torch_dtype={torch_dtype!r}; allowed: {sorted(_TORCH_DTYPES)}.")
        return _TORCH_DTYPES[key]
    if torch_dtype not in _TORCH_DTYPES.values():
        raise ValueError(f"torch_dtype={torch_dtype}; allowed: {sorted(_TORCH_DTYPES)}.")
    return torch_dtype


def build_meta_model(
    config: DeepseekV3Config | str | SpecName | os.PathLike[str],
    *,
    config_overrides: Mapping[str, Any] | None = None,
    torch_dtype: torch.dtype | str = torch.bfloat16,
    attn_implementation: AttnImplementation = "sdpa",
    experts_implementation: ExpertsImplementation = "eager",
) -> DeepseekV3ForCausalLM:
    """Builds ``DeepseekV3ForCausalLM`` on the meta device: structure only, nothing allocated.

    Args:
        config: A DeepseekV3Config, or anything :func:`build_config` accepts.
        config_overrides: Passed to :func:`build_config` (only when ``config`` is not a config).
        torch_dtype: Dtype of the high-precision parameters (``bfloat16`` per §4.1). The router
            ``mlp.gate.weight`` and buffer ``e_score_correction_bias`` stay float32, as HF creates
            them with an explicit ``dtype=torch.float32``.
        attn_implementation: HF attention backend (``"sdpa"`` per §4.1).
        experts_implementation: HF experts backend; ``"eager"`` (the per-expert loop) by default.

    Returns:
        The model, with every parameter and buffer on the meta device, in training mode.

    Raises:
        ValueError: See :func:`build_config`; also for an unsupported ``torch_dtype``.
    """
    if isinstance(config, DeepseekV3Config):
        if config_overrides:
            raise ValueError(
                "config_overrides: not applied to a ready DeepseekV3Config; pass the spec name/path "
                "with config_overrides, or edit the config before calling build_meta_model."
            )
        config = DeepseekV3Config.from_dict(config.to_dict())  # HF mutates the config it is given
    else:
        config = build_config(config, config_overrides=config_overrides)
    dtype = _to_dtype(torch_dtype)
    with torch.device("meta"):
        # Under a meta default device PreTrainedModel.init_weights skips initialisation.
        model = DeepseekV3ForCausalLM._from_config(
            config,
            dtype=dtype,
            attn_implementation=attn_implementation,
            experts_implementation=experts_implementation,
        )
    model.train()
    return model


@contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Seeds the RNG that initialises on ``device`` inside a fork, leaving the caller's RNG as it was.

    With ``seed=None`` nothing is forked or seeded: initialisation consumes the current streams.
    """
    if seed is None:
        yield
        return
    if device.type == "cpu":
        devices: list[int] = []
    else:
        backend = getattr(torch, device.type)  # torch.cuda, torch.npu (after import torch_npu), ...
        devices = [device.index if device.index is not None else backend.current_device()]
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.manual_seed(seed)  # seeds the CPU generator and every registered accelerator's
        yield


def from_hf_config(
    config_name_or_path: str | SpecName | os.PathLike[str],
    *,
    config_overrides: Mapping[str, Any] | None = None,
    torch_dtype: torch.dtype | str = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int | None = None,
    spec: str | SpecName | Mapping[str, Any] | None = None,
    validate: bool = True,
    attn_implementation: AttnImplementation = "sdpa",
    experts_implementation: ExpertsImplementation = "eager",
) -> DeepseekV3ForCausalLM:
    """Builds a randomly initialised HF ``DeepseekV3ForCausalLM`` from a config (design spec §4.1, §12.1).

    No checkpoint is loaded and nothing is downloaded. The model is built on meta, materialised on
    ``device`` with ``to_empty`` and initialised by HF's own ``_init_weights`` (through
    ``PreTrainedModel.initialize_weights``): Linear/Embedding weights and the router weight
    ``~ N(0, initializer_range)``, expert stacks ``gate_up_proj``/``down_proj`` ``~ N(0,
    initializer_range)``, RMSNorm weights = 1, ``e_score_correction_bias`` = 0, RoPE ``inv_freq``
    recomputed.

    Validation: when ``validate`` is true and a spec is known - ``spec``, or else
    ``config_name_or_path`` itself when it is a spec name - :func:`validate_spec` runs on the meta
    model *before* anything is allocated, so a drifted 16B config fails in milliseconds. Thus
    ``from_hf_config("dsv3-16b", config_overrides={"num_hidden_layers": 27})`` raises
    :class:`SpecValidationError` naming ``num_hidden_layers``. A local ``config.json`` is validated
    only when ``spec`` is given (e.g. the §4.1 usage: the DeepSeek-V3 config.json,
    ``config_overrides=SPECS["dsv3-16b"]``, ``spec="dsv3-16b"``).

    Args:
        config_name_or_path: Spec name (``"dsv3-16b"``, ``"dsv3-tiny"``) or local ``config.json``
            file/folder (read with ``local_files_only=True``).
        config_overrides: DeepseekV3Config fields applied on top of the named spec/file.
        torch_dtype: Parameter dtype (``bfloat16`` default; router stays float32, see
            :func:`build_meta_model`).
        device: Where to materialise (``"cpu"``, ``"cuda"``, ``"npu:0"``); ``"meta"`` returns the
            unmaterialised model (same as :func:`build_meta_model` plus validation).
        seed: If given, initialisation runs under ``torch.manual_seed(seed)`` in a forked RNG
            (the caller's RNG state is left untouched), so equal seeds give bitwise-equal weights on
            one device type. If ``None``, the current global RNG stream is consumed.
        spec: Spec to validate against; defaults to ``config_name_or_path`` when that is a name.
        validate: Set ``False`` to build an unvalidated variant of a named spec.
        attn_implementation: HF attention backend (``"sdpa"`` per §4.1).
        experts_implementation: HF experts backend (``"eager"`` default; see module docstring).

    Returns:
        The model on ``device`` with plain ``torch.nn.Parameter`` weights (no DTensor), in
        training mode. HF marks every initialised module ``_is_hf_initialized``, so a later
        ``model.initialize_weights()`` is a no-op; build a new model to re-initialise.

    Raises:
        SpecValidationError: If the config or the built structure differs from the spec.
        ValueError: For an unknown name/path, a bad override, or an unsupported ``torch_dtype``.
    """
    name = config_name_or_path.value if isinstance(config_name_or_path, SpecName) else os.fspath(config_name_or_path)
    if spec is None and name in SPECS:
        spec = name
    model = build_meta_model(
        name,
        config_overrides=config_overrides,
        torch_dtype=torch_dtype,
        attn_implementation=attn_implementation,
        experts_implementation=experts_implementation,
    )
    if validate and spec is not None:
        validate_spec(model, spec)
        inherited = {
            field: values
            for field, values in inherited_fields(model.config, spec).items()
            if field not in (config_overrides or {})
        }
        if inherited:
            listed = ", ".join(f"{field}={actual!r} (default {default!r})" for field, (default, actual) in inherited.items())
            warnings.warn(
                f"{name!r} matches spec {resolve_spec(spec)[0]!r}, but fields outside the spec come from "
                f"the source config and differ from DeepseekV3Config defaults: {listed}. They do not "
                "change the structure; set them in config_overrides if they are not intended.",
                stacklevel=_caller_stacklevel(),
            )
    target = torch.device(device)
    if target.type == "meta":
        return model
    model.to_empty(device=target)
    with _seeded(seed, target):
        model.initialize_weights()
    return model


def _spec_fields_with_defaults(spec_fields: Mapping[str, Any]) -> dict[str, Any]:
    """The spec's fields on top of DeepseekV3Config defaults (what a spec-built config holds)."""
    defaults = DeepseekV3Config()
    merged = {name: getattr(defaults, name) for name in STRUCTURE_FIELDS}
    merged.update({key: _plain(value) for key, value in spec_fields.items()})
    return merged


def validate_spec(model: torch.nn.Module, spec: str | SpecName | Mapping[str, Any]) -> StructureReport:
    """Checks a built model (meta or real) against a spec: config fields and structure (§4.1).

    Two checks, all differences reported together:

    1. *Config drift*: every field named by the spec must equal ``model.config``'s value (e.g.
       ``num_hidden_layers`` 28 vs 27), including non-structural ones such as
       ``routed_scaling_factor``, ``use_cache`` or ``rope_parameters`` (compared on the spec's keys).
    2. *Structure*: :func:`~lp_lightning.models.deepseek_v3.report.expected_structure` computed
       from the spec alone (spec fields on top of DeepseekV3Config defaults) must equal
       :func:`~lp_lightning.models.deepseek_v3.report.structure_report` of the model: layer
       count, dense/MoE layout, expert counts, top-k, every parameter shape and the parameter
       counts. This catches structural changes the spec does not name (e.g. a source config.json
       with ``attention_bias=true`` or ``tie_word_embeddings=true``).

    Args:
        model: A built ``DeepseekV3ForCausalLM`` (meta device is enough).
        spec: Spec name or field mapping, see :func:`resolve_spec`.

    Returns:
        The model's :class:`StructureReport` (equal to the expected one).

    Raises:
        SpecValidationError: Listing each mismatching field with expected and actual values.
        ValueError: If ``spec`` is unknown (see :func:`resolve_spec`).
    """
    spec_name, spec_fields = resolve_spec(spec)
    config = getattr(model, "config", None)
    mismatches: list[tuple[str, Any, Any]] = []
    if config is None:
        mismatches.append(("config", "a DeepseekV3Config on model.config", None))
    else:
        for field, expected in spec_fields.items():
            expected = _plain(expected)
            actual = _plain(getattr(config, field, None))
            if not _values_equal(expected, actual):
                mismatches.append((field, expected, actual))
    expected_report = expected_structure(_spec_fields_with_defaults(spec_fields))
    actual_report = structure_report(model)
    mismatches += _compare_reports(expected_report, actual_report)
    if mismatches:
        raise SpecValidationError(spec_name, mismatches)
    return actual_report


def inherited_fields(
    config: DeepseekV3Config, spec: str | SpecName | Mapping[str, Any]
) -> dict[str, tuple[Any, Any]]:
    """Model fields the spec does not name whose value differs from the DeepseekV3Config default.

    Such values can only come from a source ``config.json`` or an override. They pass
    :func:`validate_spec` when they do not change the structure, yet may change the numerics: the
    released DeepSeek-V3 config.json carries YaRN ``rope_scaling`` (factor 40), which the §4.1 block
    does not reset and which raises the attention softmax scale by ``mscale**2`` (about 2.3x).

    Args:
        config: The built model's config.
        spec: Spec name or field mapping, see :func:`resolve_spec`.

    Returns:
        ``field -> (default, actual)`` in DeepseekV3Config declaration order; empty if none differ.
    """
    _, spec_fields = resolve_spec(spec)
    defaults = DeepseekV3Config()
    out: dict[str, tuple[Any, Any]] = {}
    for field in _MODEL_FIELDS:
        if field in spec_fields:
            continue
        default, actual = _plain(getattr(defaults, field, None)), _plain(getattr(config, field, None))
        if not (_values_equal(default, actual) and _values_equal(actual, default)):
            out[field] = (default, actual)
    return out


def _values_equal(expected: Any, actual: Any) -> bool:
    """Spec-value equality: dicts compare on the spec's keys; bools never equal ints (1 != True)."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(actual.get(key) == value for key, value in expected.items())
    if isinstance(expected, bool) or isinstance(actual, bool):
        return type(expected) is type(actual) and expected == actual
    return expected == actual


def _compare_reports(expected: StructureReport, actual: StructureReport) -> list[tuple[str, Any, Any]]:
    out: list[tuple[str, Any, Any]] = []
    exp, act = expected.as_dict(), actual.as_dict()
    for field in exp:
        if field in ("parameter_shapes", "projection_shapes"):
            continue
        if exp[field] != act[field]:
            if field in ("dense_layers", "moe_layers"):  # compact "[1-27]" instead of 27 numbers
                exp_layers, act_layers = getattr(expected, field), getattr(actual, field)
                out.append((f"structure.{field}", format_layers(exp_layers), format_layers(act_layers)))
            else:
                out.append((f"structure.{field}", exp[field], act[field]))
    exp_shapes, act_shapes = exp["parameter_shapes"], act["parameter_shapes"]
    for glob in sorted(set(exp_shapes) | set(act_shapes)):
        if exp_shapes.get(glob) != act_shapes.get(glob):
            out.append((f"shape[{glob}]", exp_shapes.get(glob), act_shapes.get(glob)))
    return out

