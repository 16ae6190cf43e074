"""The layers of docs/architecture.md, as allowed import edges (design spec §2, §6: dependencies point down).

Every ``import`` / ``from … import`` of an ``lp_lightning`` module anywhere in the package (module
level, inside functions, under ``TYPE_CHECKING``) is read from the source with ``ast`` and mapped
to its layer; an edge that is not in ``ALLOWED`` fails, naming the file, the line and the fix. A
format package may import only the generic format modules and itself, so adding a format never
touches another one. The CLI's dispatcher (``lp_lightning/cli/__init__.py``, ``__main__.py``) is its
own layer, ``cli_entry``: the only one that imports ``st`` and ``planner``; ``st`` never imports
the CLI (the dispatcher hands it the fit parser and entry point).

Apart from the layers, the module-level imports between package files must form no cycle
(:func:`test_no_module_level_import_cycle`; imports inside functions and under ``if TYPE_CHECKING:``
do not count).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lp_lightning"

CLI_ENTRY = {"lp_lightning.cli", "lp_lightning.cli.__main__"}
"""The dispatcher modules: layer ``cli_entry``; every other ``lp_lightning.cli.*`` module is ``cli``."""

# Longest prefix wins (after CLI_ENTRY). "format:<name>" layers are the format packages.
LAYERS: dict[str, str] = {
    "lp_lightning.cli": "cli",
    "lp_lightning.st": "st",
    "lp_lightning.planner": "planner",
    "lp_lightning.telemetry": "telemetry",
    "lp_lightning.lightning.accelerator": "accelerator",
    "lp_lightning.lightning": "lightning",
    "lp_lightning.fsdp": "fsdp",
    "lp_lightning.checkpoint": "checkpoint",
    "lp_lightning.models.adapter": "model_protocol",
    "lp_lightning.models.replacement": "model_protocol",  # the one plan builder: adapter + plan + policy
    "lp_lightning.models": "model_adapters",
    "lp_lightning.plan": "plan",
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
    "lp_lightning.usage": "util",
    "lp_lightning.versions": "versions",
    "lp_lightning": "root",
}

_CONFIG = {"config", "format_registry", "root"}
_GENERIC_LOW_PRECISION = {"formats", "format_registry"} | _CONFIG
ALLOWED: dict[str, set[str]] = {  # "util" (the pure-Python observer lists, usage errors) is allowed everywhere
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
    # The FSDP2 lifecycle knows the generic weight protocol, never a model (the layout comes in as an argument).
    "fsdp": _GENERIC_LOW_PRECISION | {"tensor"},
    "plan": _CONFIG,
    "model_protocol": _CONFIG | {"plan"},
    "model_adapters": _GENERIC_LOW_PRECISION | {"ops", "tensor", "functional", "modules", "plan", "model_protocol"},
    # DCP, digests, finiteness and resume resolution: torch only, no model, no low-precision type.
    "checkpoint": _CONFIG,
    "data": {"root"},
    "evidence": _GENERIC_LOW_PRECISION | {"format:mxfp8", "format:hif8"},
    # The glue observes through the public hooks of ops (GEMM events), functional (backward-node names),
    # tensor and fsdp (refresh and gather events); it never imports a format package.
    "lightning": set(LAYERS.values()) - {"cli", "st", "planner", "telemetry", "format:mxfp8", "format:hif8"},
    # The run summary and the probes read a run through the glue and the public event hooks; nothing
    # below the entry points imports them (telemetry is opt-in, design spec §16.6).
    "telemetry": set(LAYERS.values()) - {"cli", "st", "planner", "format:mxfp8", "format:hif8"},
    # The memory planner reads a run as lp-lightning fit builds it (meta model, plan, shard rules, gather
    # layouts, the precision plugin) through the generic layers; the entry point hands it the fit config.
    # Model knowledge (specs, meta model, activation terms) comes from the adapter registry only.
    "planner": set(LAYERS.values()) - {"cli", "st", "telemetry", "format:mxfp8", "format:hif8", "model_adapters"},
    # fit (LightningCLI, config parsing) and the launch checks: the product's layers, not st or planner.
    "cli": set(LAYERS.values()) - {"cli", "st", "planner", "format:mxfp8", "format:hif8"},
    # The dispatcher: the one module that imports st and planner, handing them what they need from the CLI.
    "cli_entry": set(LAYERS.values()) - {"format:mxfp8", "format:hif8"},
    # The acceptance harness runs the CLI it is handed as a user would and reads every layer's evidence; it
    # learns the model (targets, never-replace rules, specs) from the adapter registry only.
    "st": set(LAYERS.values()) - {"cli", "format:mxfp8", "format:hif8", "model_adapters"},
}
"""What each layer may import besides itself and ``util`` (docs/architecture.md, "Layers")."""

EXEMPT: dict[tuple[str, str], str] = {
    ("lp_lightning.st.illegal_child", "model_adapters"): (
        "the §15 Fabric cases are user scripts: they build the model as a user does (deepseek_v3.from_hf_config)"
    ),
}
"""``(module, layer)`` edges allowed against ``ALLOWED`` for the reason given (each one to be removed)."""


def layer_of(module: str) -> str:
    if module in CLI_ENTRY:
        return "cli_entry"
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


def _is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` / ``if typing.TYPE_CHECKING:``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _is_main_guard(test: ast.expr) -> bool:
    """``if __name__ == "__main__":`` (runs only when the file is the program, never on import)."""
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators))


def _module_level_imports(path: Path) -> list[tuple[int, str]]:
    """The lp_lightning imports of ``path`` that run when it is imported (:func:`_imports` of the
    statements outside functions, classes' methods, ``if TYPE_CHECKING:`` and ``if __name__ == "__main__":``
    blocks)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    kept: list[ast.stmt] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                kept.append(node)
            elif isinstance(node, ast.If):
                if not (_is_type_checking(node.test) or _is_main_guard(node.test)):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                    visit(block)
            elif isinstance(node, (ast.With, ast.ClassDef)):
                visit(node.body)  # a class body runs at import; its methods' bodies do not

    visit(tree.body)
    lines = {node.lineno for node in kept}
    return [(line, name) for line, name in _imports(path) if line in lines]


def _import_cycles() -> list[list[str]]:
    """The cycles of the module-level import graph between package files, each as its module names.

    One cycle per strongly connected component of more than one module (Tarjan), listed from its
    smallest module name along import edges back to it.
    """
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        graph.setdefault(module, set()).update(
            name for _, name in _module_level_imports(path) if name != module
        )
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def connect(node: str) -> None:  # recursive Tarjan; the package graph is shallow
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in graph:
                continue  # a name that is not a package file
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    cycles = []
    for component in sorted(components):  # the shortest cycle through the component's first module (BFS)
        members, start = set(component), component[0]
        came_from: dict[str, str] = {}
        frontier = [start]
        while start not in came_from:
            following = []
            for node in frontier:
                for target in sorted(graph[node] & members):
                    if target not in came_from:
                        came_from[target] = node
                        following.append(target)
            frontier = following
        backwards, node = [start], came_from[start]
        while node != start:
            backwards.append(node)
            node = came_from[node]
        cycles.append([start, *reversed(backwards[1:]), start])
    return cycles


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
        if target != source and target != "util" and target not in ALLOWED[source] and (module, target) not in EXEMPT:
            bad.append(f"{where}:{line}: {module} ({source}) imports {imported} ({target})")
    assert bad == [], (
        "imports against docs/architecture.md's layers (move the code down, or pass it in as data):\n  "
        + "\n  ".join(bad)
    )


def test_exemptions_are_still_needed():
    """An exemption the code no longer uses is removed, so the rule it suspends applies again."""
    used = {(module, target) for _, _, module, _, target in _edges()}
    assert sorted(set(EXEMPT) - used) == []


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
        ("lp_lightning.fsdp.gather", "fsdp"),
        ("lp_lightning.checkpoint.dcp", "checkpoint"),
        ("lp_lightning.telemetry.probes", "telemetry"),
        ("lp_lightning", "root"),
    ],
)
def test_layer_of(module, layer):
    assert layer_of(module) == layer


def test_the_checker_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "lp_lightning" / "tensor"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("def f():\n    from lp_lightning.fsdp import gather\n    from . import y\n")
    (pkg / "y.py").write_text("")
    (tmp_path / "lp_lightning" / "fsdp").mkdir()
    (tmp_path / "lp_lightning" / "fsdp" / "gather.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path / "lp_lightning")
    assert _imports(pkg / "x.py") == [(2, "lp_lightning.fsdp.gather"), (3, "lp_lightning.tensor.y")]


KNOWN_CYCLES: dict[tuple[str, ...], str] = {}
"""Module-level import cycles accepted for now (the sorted modules of each, and why); empty: none."""


def test_no_module_level_import_cycle():
    """A new cycle of module-level imports between package files fails, listing it; imports inside functions
    and under ``if TYPE_CHECKING:`` (type-only) do not count."""
    found = {tuple(sorted(set(cycle))): cycle for cycle in _import_cycles()}
    new = [" -> ".join(cycle) for members, cycle in found.items() if members not in KNOWN_CYCLES]
    assert new == [], "module-level import cycles (break one edge: import inside the function that needs it, " \
                      "under TYPE_CHECKING for a type, or move the shared code down):\n  " + "\n  ".join(new)
    gone = sorted(set(KNOWN_CYCLES) - set(found))
    assert gone == [], f"KNOWN_CYCLES lists cycles that no longer exist; remove them: {gone}"


def test_the_cycle_check_sees_a_cycle_and_skips_type_only_and_function_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "lp_lightning"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from lp_lightning import b\n")
    (pkg / "b.py").write_text("import lp_lightning.c\n")
    (pkg / "c.py").write_text("from lp_lightning.a import x\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lp_lightning import e\n")
    (pkg / "e.py").write_text("def f():\n    from lp_lightning import d\n")
    (pkg / "f.py").write_text("if __name__ == '__main__':\n    from lp_lightning import g\n")
    (pkg / "g.py").write_text("from lp_lightning import f\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    assert _import_cycles() == [["lp_lightning.a", "lp_lightning.b", "lp_lightning.c", "lp_lightning.a"]]


def test_the_cli_dispatcher_is_its_own_layer():
    assert layer_of("lp_lightning.cli") == layer_of("lp_lightning.cli.__main__") == "cli_entry"
    assert layer_of("lp_lightning.cli.fit") == layer_of("lp_lightning.cli.launch") == "cli"
    assert "cli" not in ALLOWED["st"] and "cli_entry" not in ALLOWED["st"]
    assert not {"st", "planner", "cli_entry"} & ALLOWED["cli"]


def test_the_lifecycle_packages_know_no_model():
    """``fsdp`` and ``checkpoint`` never import ``models`` (the layout comes in as ``adapter=``, design spec §6)."""
    assert layer_of("lp_lightning.fsdp.parallelize") == layer_of("lp_lightning.fsdp.gather") == "fsdp"
    assert layer_of("lp_lightning.checkpoint.resume") == "checkpoint"
    for lifecycle in ("fsdp", "checkpoint"):
        assert not {"model_protocol", "model_adapters"} & ALLOWED[lifecycle], lifecycle
    assert not any(module.startswith(("lp_lightning.fsdp", "lp_lightning.checkpoint")) for module, _ in EXEMPT)
