"""The layers of docs/architecture.md, as allowed import edges (design spec §2, §6: dependencies point down).

Every ``import`` / ``from … import`` of an ``lp_lightning`` module anywhere in the package (module
level, inside functions, under ``TYPE_CHECKING``) is read from the source with ``ast`` and mapped
to its layer; an edge that is not in ``ALLOWED`` fails, naming the file, the line and the fix. A
format package may import only the generic format modules and itself, so adding a format never
touches another one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lp_lightning"

# Longest prefix wins. "format:<name>" layers are the format packages.
LAYERS: dict[str, str] = {
    "lp_lightning.cli": "cli",
    "lp_lightning.st": "st",
    "lp_lightning.planner": "planner",
    "lp_lightning.telemetry": "telemetry",
    "lp_lightning.lightning.accelerator": "accelerator",
    "lp_lightning.lightning": "lightning",
    "lp_lightning.distributed": "distributed",
    "lp_lightning.models.adapter": "model_protocol",
    "lp_lightning.models": "model_adapters",
    "lp_lightning.plan": "plan",
    "lp_lightning.integration": "integration",
    "lp_lightning.modules": "modules",
    "lp_lightning.functional": "functional",
    "lp_lightning.tensor": "tensor",
    "lp_lightning.ops": "ops",
    "lp_lightning.formats.registry": "format_registry",
    "lp_lightning.formats.mxfp8": "format:mxfp8",
    "lp_lightning.formats.hif8": "format:hif8",
    "lp_lightning.formats": "formats",
    "lp_lightning.policy": "config",
    "lp_lightning.config": "config",
    "lp_lightning.names": "config",
    "lp_lightning.data": "data",
    "lp_lightning.evidence": "evidence",
    "lp_lightning.observers": "util",
    "lp_lightning.versions": "versions",
    "lp_lightning": "root",
}

_CONFIG = {"config", "format_registry", "root"}
_GENERIC_LOW_PRECISION = {"formats", "format_registry"} | _CONFIG
ALLOWED: dict[str, set[str]] = {  # "util" (the pure-Python observer lists) is allowed everywhere
    "root": set(),
    "util": set(),
    "versions": {"root"},  # run_summary.json's software versions (package metadata, git)
    # The npu accelerator is Lightning + torch only: a bf16 run imports it and must load nothing low-precision.
    "accelerator": set(),
    "config": {"format_registry", "root"},
    "format_registry": {"root"},
    "formats": {"config", "format_registry", "root"},
    "format:mxfp8": _GENERIC_LOW_PRECISION,
    "format:hif8": _GENERIC_LOW_PRECISION,
    # A backend implements formats: it may read a format package's constants (MX block size).
    "ops": _GENERIC_LOW_PRECISION | {"format:mxfp8", "format:hif8"},
    "tensor": _GENERIC_LOW_PRECISION | {"ops"},
    "functional": _GENERIC_LOW_PRECISION | {"ops", "tensor"},
    "modules": _GENERIC_LOW_PRECISION | {"ops", "tensor", "functional"},
    "integration": _GENERIC_LOW_PRECISION | {"tensor"},
    "plan": _CONFIG,
    "model_protocol": _CONFIG | {"plan"},
    "model_adapters": _GENERIC_LOW_PRECISION | {"ops", "tensor", "functional", "modules", "plan", "model_protocol"},
    "distributed": _CONFIG | {"integration", "model_protocol"},
    "data": {"root"},
    "evidence": _GENERIC_LOW_PRECISION | {"format:mxfp8", "format:hif8"},
    # The glue observes through the public hooks of ops (GEMM events), functional (backward-node names),
    # tensor and integration (refresh and gather events); it never imports a format package.
    "lightning": set(LAYERS.values()) - {"cli", "st", "planner", "telemetry", "format:mxfp8", "format:hif8"},
    # The run summary and the probes read a run through the glue and the public event hooks; nothing
    # below the entry points imports them (telemetry is opt-in, design spec §16.6).
    "telemetry": set(LAYERS.values()) - {"cli", "st", "planner", "format:mxfp8", "format:hif8"},
    # The memory planner reads a run as lp-lightning fit builds it (meta model, plan, shard rules, gather
    # layouts, the precision plugin) through the generic layers; the entry point hands it the fit config.
    "planner": set(LAYERS.values()) - {"cli", "st", "telemetry", "format:mxfp8", "format:hif8"},
    "cli": set(LAYERS.values()) - {"format:mxfp8", "format:hif8"},
    # The acceptance harness drives the CLI as a user would and reads every layer's evidence.
    "st": set(LAYERS.values()) - {"format:mxfp8", "format:hif8"},
}
"""What each layer may import besides itself and ``util`` (docs/architecture.md, "Layers")."""


def layer_of(module: str) -> str:
    best = max((prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")), key=len)
    return LAYERS[best]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, imported module)`` of every lp_lightning import in ``path`` (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # "from lp_lightning.formats import mxfp8" imports the submodule when it is one.
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                is_submodule = (PACKAGE.parent / Path(*candidate.split("."))).with_suffix(".py").exists() or (
                    PACKAGE.parent / Path(*candidate.split("."))
                ).is_dir()
                found.append((node.lineno, candidate if is_submodule else base))
    return [(line, name) for line, name in found if name == "lp_lightning" or name.startswith("lp_lightning.")]


def _edges() -> list[tuple[str, int, str, str, str]]:
    edges = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        for line, imported in _imports(path):
            edges.append((str(path.relative_to(PACKAGE.parent)), line, module, imported, layer_of(imported)))
    return edges


def test_every_module_has_a_layer():
    unknown = [m for m in map(_module_name, PACKAGE.rglob("*.py")) if layer_of(m) == "root" and m != "lp_lightning"]
    assert unknown == [], f"modules without a layer in LAYERS: {unknown}"


def test_imports_point_down_the_layers():
    bad = []
    for where, line, module, imported, target in _edges():
        source = layer_of(module)
        if target != source and target != "util" and target not in ALLOWED[source]:
            bad.append(f"{where}:{line}: {module} ({source}) imports {imported} ({target})")
    assert bad == [], (
        "imports against docs/architecture.md's layers (move the code down, or pass it in as data):\n  "
        + "\n  ".join(bad)
    )


def test_generic_format_modules_import_no_format_package():
    """The registry finds a format's spec by its import location; no generic module imports one."""
    bad = [
        f"{where}:{line}: {module} imports {imported}"
        for where, line, module, imported, target in _edges()
        if layer_of(module) in {"formats", "format_registry"} and target.startswith("format:")
    ]
    assert bad == []


@pytest.mark.parametrize(
    ("module", "layer"),
    [
        ("lp_lightning.formats.mxfp8.codec", "format:mxfp8"),
        ("lp_lightning.formats.operand", "formats"),
        ("lp_lightning.formats.registry", "format_registry"),
        ("lp_lightning.integration.gather", "integration"),
        ("lp_lightning.telemetry.probes", "telemetry"),
        ("lp_lightning", "root"),
    ],
)
def test_layer_of(module, layer):
    assert layer_of(module) == layer


def test_the_checker_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "lp_lightning" / "tensor"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("def f():\n    from lp_lightning.integration import gather\n    from . import y\n")
    (pkg / "y.py").write_text("")
    (tmp_path / "lp_lightning" / "integration").mkdir()
    (tmp_path / "lp_lightning" / "integration" / "gather.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path / "lp_lightning")
    assert _imports(pkg / "x.py") == [(2, "lp_lightning.integration.gather"), (3, "lp_lightning.tensor.y")]
