"""LowPrecisionConfig / LowPrecisionPolicy (design spec §4.2, §13.1, §16.1 rows 1-3; requirement R3 (docs/design.md))."""

from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys
import textwrap

import pytest
from jsonargparse import ArgumentParser
from jsonargparse import ArgumentError as JsonargparseArgumentError

from lp_lightning.policy import (
    LEGAL_PAIRS,
    LowPrecisionConfig,
    LowPrecisionFormat,
    LowPrecisionPolicy,
    PrecisionName,
    RecipeName,
    ScalingAlgorithm,
)

LEGAL = [("mxfp8_e4m3", "mx_block", RecipeName.MXFP8_E4M3_MX_BLOCK), ("hif8", "current", RecipeName.HIF8_CURRENT)]
ILLEGAL = [
    ("mxfp8_e4m3", "current"),
    ("hif8", "mx_block"),
    ("hif8", "delayed"),
    ("mxfp8_e4m3", "delayed"),
    ("fp8_e4m3", "mx_block"),
    ("MXFP8_E4M3", "mx_block"),
    ("hif8", "Current"),
    ("", ""),
]


@pytest.mark.parametrize(("fmt", "scaling", "recipe"), LEGAL)
@pytest.mark.parametrize("enabled", [True, False])
def test_legal_pairs_build_read_only_policy(fmt, scaling, recipe, enabled):
    config = LowPrecisionConfig(enabled=enabled, format=fmt, scaling=scaling)
    policy = config.to_policy()
    expected = (enabled, LowPrecisionFormat(fmt), ScalingAlgorithm(scaling))
    assert (policy.enabled, policy.format, policy.scaling) == expected
    assert policy.recipe_name is recipe
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.enabled = not enabled  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.format = "hif8"  # type: ignore[misc]
    # Hashable and picklable (sent to factories, possibly across processes).
    assert hash(policy) == hash(config.to_policy())
    assert pickle.loads(pickle.dumps(policy)) == policy
    assert json.loads(json.dumps(policy.as_dict())) == {
        "enabled": enabled,
        "format": fmt,
        "scaling": scaling,
        "recipe_name": recipe.value,
    }


def test_policy_carries_no_format_constants():
    # Format maxima (15/224/448) and block sizes live in the recipe (design spec §7.1, §13.3); the policy
    # carries the run's choice only: format, scaling and the op backend the recipes are built for.
    assert [f.name for f in dataclasses.fields(LowPrecisionPolicy)] == ["enabled", "format", "scaling", "backend"]
    assert [f.name for f in dataclasses.fields(LowPrecisionConfig)] == ["enabled", "format", "scaling"]
    assert set(LEGAL_PAIRS.values()) == set(RecipeName)


def test_default_config_is_disabled_and_legal():
    config = LowPrecisionConfig()
    assert (config.enabled, config.format, config.scaling) == (False, "mxfp8_e4m3", "mx_block")
    assert LowPrecisionPolicy.disabled() == config.to_policy()
    assert "off" in config.to_policy().describe()


@pytest.mark.parametrize(("fmt", "scaling"), ILLEGAL)
@pytest.mark.parametrize("enabled", [True, False])
def test_illegal_pairs_fail_at_construction_naming_pair_and_legal_ones(fmt, scaling, enabled):
    with pytest.raises(ValueError) as info:
        LowPrecisionConfig(enabled=enabled, format=fmt, scaling=scaling)
    message = str(info.value)
    assert "mxfp8_e4m3+mx_block" in message and "hif8+current" in message
    assert fmt in message and scaling in message
    with pytest.raises(ValueError, match="legal pairs"):
        LowPrecisionPolicy(enabled=enabled, format=fmt, scaling=scaling)


def test_illegal_pair_message_suggests_the_fix():
    with pytest.raises(ValueError, match=r"hif8\+mx_block.*set `scaling: current`"):
        LowPrecisionConfig(enabled=True, format="hif8", scaling="mx_block")
    with pytest.raises(ValueError, match=r"mxfp8_e4m3\+current.*set `scaling: mx_block`"):
        LowPrecisionConfig(enabled=True, format="mxfp8_e4m3", scaling="current")


@pytest.mark.parametrize("enabled", ["true", "false", 1, 0, None])
def test_enabled_must_be_bool(enabled):
    with pytest.raises(TypeError, match="enabled must be a bool"):
        LowPrecisionConfig(enabled=enabled)


def test_enum_members_are_normalised_to_plain_strings():
    config = LowPrecisionConfig(enabled=True, format=LowPrecisionFormat.HIF8, scaling=ScalingAlgorithm.CURRENT)
    assert type(config.format) is str and type(config.scaling) is str
    assert config == LowPrecisionConfig(enabled=True, format="hif8", scaling="current")
    assert repr(config) == "LowPrecisionConfig(enabled=True, format='hif8', scaling='current')"


@pytest.mark.parametrize(
    ("precision", "expected"),
    [
        ("bf16", (False, "mxfp8_e4m3", "mx_block")),
        ("mxfp8", (True, "mxfp8_e4m3", "mx_block")),
        ("hif8", (True, "hif8", "current")),
        (PrecisionName.HIF8, (True, "hif8", "current")),
    ],
)
def test_from_precision_maps_cli_flag(precision, expected):
    config = LowPrecisionConfig.from_precision(precision)
    assert (config.enabled, config.format, config.scaling) == expected
    assert config.precision_name is PrecisionName(precision)


@pytest.mark.parametrize("precision", ["fp8", "bf16-mixed", "MXFP8", "hif8_current", ""])
def test_from_precision_rejects_unknown(precision):
    with pytest.raises(ValueError, match=r"--precision must be one of \['bf16', 'mxfp8', 'hif8'\]"):
        LowPrecisionConfig.from_precision(precision)


def test_from_dict():
    assert LowPrecisionConfig.from_dict({"enabled": True, "format": "hif8", "scaling": "current"}) == (
        LowPrecisionConfig.from_precision("hif8")
    )
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['margin'\]"):
        LowPrecisionConfig.from_dict({"enabled": True, "format": "hif8", "scaling": "current", "margin": 0})
    with pytest.raises(ValueError, match=r"hif8\+delayed|'delayed'"):
        LowPrecisionConfig.from_dict({"enabled": True, "format": "hif8", "scaling": "delayed"})
    with pytest.raises(TypeError, match="must be a mapping"):
        LowPrecisionConfig.from_dict(["hif8"])  # type: ignore[arg-type]


def _parser() -> ArgumentParser:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--config", action="config")
    parser.add_argument("--low_precision", type=LowPrecisionConfig, default=LowPrecisionConfig())
    return parser


@pytest.mark.parametrize(("fmt", "scaling", "recipe"), LEGAL)
def test_jsonargparse_yaml_section(tmp_path, fmt, scaling, recipe):
    path = tmp_path / "run.yaml"
    path.write_text(f"low_precision:\n  enabled: true\n  format: {fmt}\n  scaling: {scaling}\n")
    parser = _parser()
    config = parser.instantiate(parser.parse_args(["--config", str(path)])).low_precision
    assert config == LowPrecisionConfig(enabled=True, format=fmt, scaling=scaling)
    assert config.to_policy().recipe_name is recipe


def test_jsonargparse_rejects_illegal_pairs_before_any_model(tmp_path):
    parser = _parser()
    # A value outside the Literal set is rejected by the parser itself, naming the key.
    path = tmp_path / "delayed.yaml"
    path.write_text("low_precision: {enabled: true, format: hif8, scaling: delayed}\n")
    with pytest.raises(JsonargparseArgumentError, match=r"low_precision\.scaling"):
        parser.parse_args(["--config", str(path)])
    # Two legal values forming an illegal pair fail in __post_init__ when the section is built.
    path = tmp_path / "crossed.yaml"
    path.write_text("low_precision: {enabled: true, format: hif8, scaling: mx_block}\n")
    with pytest.raises(ValueError, match=r"hif8\+mx_block.*legal pairs are mxfp8_e4m3\+mx_block, hif8\+current"):
        parser.instantiate(parser.parse_args(["--config", str(path)]))


def test_jsonargparse_help_lists_choices():
    text = _parser().format_help()
    assert "{mxfp8_e4m3,hif8}" in text and "{mx_block,current}" in text


def test_config_and_policy_never_import_torch_npu():
    code = textwrap.dedent(
        """
        import json, sys
        from lp_lightning.policy import LowPrecisionConfig
        for precision in ("bf16", "mxfp8", "hif8"):
            LowPrecisionConfig.from_precision(precision).to_policy()
        print(json.dumps({"policy_uses_torch": "torch" in vars(sys.modules["lp_lightning.policy"]),
                          "torch_npu": "torch_npu" in sys.modules}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"policy_uses_torch": False, "torch_npu": False}


def test_config_names_agree_with_the_format_registry():
    """The config layer's enums and Literal hints name exactly the registry's product formats."""
    import typing

    from lp_lightning.formats import registry

    product = registry.precision_names()  # --precision value -> entry
    assert {f.value for f in LowPrecisionFormat} == {e.name for e in product.values()}
    assert {p.value for p in PrecisionName} - {"bf16"} == set(product)
    assert {r.value for r in RecipeName} == {e.recipe for e in product.values()}
    assert set(typing.get_args(typing.get_type_hints(LowPrecisionConfig)["format"])) == {e.name for e in product.values()}
    assert {(f.value, s.value) for f, s in LEGAL_PAIRS} == {(e.name, e.scaling) for e in product.values()}
