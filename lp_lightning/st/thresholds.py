"""The owner's thresholds of ``lp-lightning st`` (design spec §17.2, §17.3.2; docs/acceptance.md "Thresholds").

Every tolerance a verdict of the acceptance reads lives here, keyed by name:

- ``resume_first_loss_rel`` (Q3-09, first resumed loss against the continuous run, relative): ``u``
  of the case's GEMM input format, bf16 2^-8, mxfp8 / hif8 2^-4 (docs/numerics.md §8.3);
- ``short_run_loss_rel`` (N-3, smoothed and last-10-mean loss against bf16's, relative): ``u`` of
  mxfp8 / hif8, 2^-4;
- ``short_run_explosion_factor`` (N-3 "no explosion"): the last grad norms within 10x of the median;
- ``operator_sqnr_floor_db`` (N-1): the unit-test floors ``SQNR_FLOORS_DB[(precision, "gaussian",
  role)]`` of :mod:`lp_lightning.formats.recipe` (docs/numerics.md §8.3);
- ``one_layer_sqnr_floor_db`` (N-2): the per-GEMM SQNR its bands derive from by the ε·√k rule
  (:mod:`lp_lightning.st.numerics`), the same floors;
- ``min_throughput_ratio`` / ``max_step_time_ratio`` (Q3-11): 1.0 each (design spec §17.2: no
  performance regression against bf16).

Per-precision keys are maps over the ``--precision`` values (``bf16``, ``mxfp8``, ``hif8``; the
case ``hif8_current`` reads ``hif8``); the SQNR keys map precision → GEMM role (``fprop``,
``dgrad``, ``wgrad``). A leaf is one number, named by its dotted path
(``resume_first_loss_rel.mxfp8``, ``operator_sqnr_floor_db.hif8.dgrad``).

``lp-lightning st --thresholds FILE`` reads a YAML holding any subset of these keys
(``configs/st_thresholds.yaml`` holds them all with the built-in values); leaves it leaves out keep
their built-in value. The design spec §17.2 freezes the thresholds with the algorithm owner after the
first A5 collection: until then a row that passes on a built-in value passes *provisionally*
(:func:`mark_provisional`; the report says ``pass (provisional thresholds)``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lp_lightning.formats.recipe import SQNR_FLOORS_DB
from lp_lightning.st.cases import CASES, case_by_name
from lp_lightning.st.parity import TOLERANCE_PCT
from lp_lightning.st.verdict import Row, unit_roundoff

__all__ = [
    "BUILTIN_THRESHOLDS",
    "THRESHOLD_KEYS",
    "Thresholds",
    "load_thresholds",
    "mark_provisional",
    "precision_of_case",
    "thresholds_markdown",
]

_LOW_PRECISIONS = ("mxfp8", "hif8")
_ROLES = ("fprop", "dgrad", "wgrad")
def precision_of_case(case: str) -> str:
    """The ``--precision`` value of an ST case (``"hif8_current"`` → ``"hif8"``), which keys the thresholds."""
    return case_by_name(case).precision


@dataclass(frozen=True)
class _Key:
    """One top-level key: what it bounds, the legal range of its leaves (``low < v <= high`` or ``low <= v``)."""

    doc: str
    low: float
    high: float
    low_inclusive: bool = False


THRESHOLD_KEYS: dict[str, _Key] = {
    "resume_first_loss_rel": _Key("Q3-09: |first resumed loss - continuous| / continuous, per precision", 0.0, 1.0),
    "short_run_loss_rel": _Key("N-3: |smoothed loss - bf16's| / bf16's at each steady step and for the last-10 "
                               "mean, per low precision", 0.0, 1.0),
    "short_run_explosion_factor": _Key("N-3: the last grad norms stay within this factor of the run's median",
                                       1.0, math.inf, low_inclusive=True),
    "operator_sqnr_floor_db": _Key("N-1: SQNR floor (dB) of each operator tensor against the BF16 golden, per low "
                                   "precision and GEMM role", 0.0, 200.0),
    "one_layer_sqnr_floor_db": _Key("N-2: per-GEMM SQNR (dB) the one-layer bands derive from (ε = 10^(-S/20), "
                                    "loss ε·√k_fprop, grad norm ε_min·√k), per low precision and role", 0.0, 200.0),
    "min_throughput_ratio": _Key("Q3-11: steady throughput of mxfp8/hif8 over bf16 must be at least this",
                                 0.0, math.inf),
    "max_step_time_ratio": _Key("Q3-11: steady mean step time of mxfp8/hif8 over bf16 must be at most this",
                                0.0, math.inf),
    "parity_max_gap_pct": _Key("parity: |last-50 training loss mean and last validation loss - bf16's| in % of "
                               "bf16's, on every seed, per low precision", 0.0, 100.0),
}
"""The keys of a thresholds file, with what each bounds and its legal range."""


def _builtin_values() -> dict[str, Any]:
    floors = {p: {r: float(SQNR_FLOORS_DB[(p, "gaussian", r)]) for r in _ROLES} for p in _LOW_PRECISIONS}
    u = {c.precision: unit_roundoff(c.name) for c in CASES}
    return {
        "resume_first_loss_rel": dict(u),
        "short_run_loss_rel": {p: u[p] for p in _LOW_PRECISIONS},
        "short_run_explosion_factor": 10.0,
        "operator_sqnr_floor_db": floors,
        "one_layer_sqnr_floor_db": {p: dict(v) for p, v in floors.items()},
        "min_throughput_ratio": 1.0,
        "max_step_time_ratio": 1.0,
        "parity_max_gap_pct": {p: TOLERANCE_PCT for p in _LOW_PRECISIONS},
    }


def _leaves(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_leaves(value, path + "."))
        else:
            out[path] = value
    return out


@dataclass(frozen=True)
class Thresholds:
    """The tolerances the verdicts read, and where each came from.

    Attributes:
        values: Key → value, as in a thresholds file: floats, or nested maps of floats
            (precision → float, or precision → role → float).
        path: The file they were read from, ``None`` for the built-ins.
        text: That file's text, verbatim (``None`` for the built-ins).
        from_file: Dotted leaf keys the file set; every other leaf is built-in (provisional).
    """

    values: Mapping[str, Any]
    path: str | None = None
    text: str | None = None
    from_file: frozenset[str] = field(default_factory=frozenset)

    def get(self, row: Row | None, key: str, *sub: str) -> float:
        """The value at ``key.sub...``, recorded in ``row.thresholds`` (the row's verdict depends on it).

        Raises:
            KeyError: an unknown key or sub-key (a caller's bug: the keys are :data:`THRESHOLD_KEYS`).
        """
        value: Any = self.values[key]
        for part in sub:
            value = value[part]
        leaf = ".".join((key, *sub))
        if row is not None and leaf not in row.thresholds:
            row.thresholds.append(leaf)
        return float(value)

    def is_builtin(self, leaf: str) -> bool:
        """Whether the dotted leaf key holds its built-in value (no file set it)."""
        return leaf not in self.from_file

    def as_report(self) -> dict[str, Any]:
        """``report.json`` ``thresholds``: ``path``, ``text`` (verbatim), ``values``, ``from_file``,
        ``built_in`` (dotted leaf keys) and ``provisional`` (some leaf is built-in)."""
        leaves = sorted(_leaves(self.values))
        built_in = [k for k in leaves if self.is_builtin(k)]
        return {"path": self.path, "text": self.text, "values": _plain(self.values),
                "from_file": sorted(self.from_file), "built_in": built_in, "provisional": bool(built_in)}


def _plain(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _plain(v) if isinstance(v, Mapping) else v for k, v in values.items()}


BUILTIN_THRESHOLDS = Thresholds(_builtin_values())
"""The built-in thresholds: every leaf provisional (module docstring)."""


def _check(data: Any, builtin: Any, path: str, key: _Key, problems: list[str], leaves: dict[str, float]) -> None:
    """Checks ``data`` against the shape of ``builtin`` at ``path``; collects problems and the leaves set."""
    if isinstance(builtin, Mapping):
        if not isinstance(data, Mapping):
            problems.append(f"{path}: a map of {sorted(builtin)} is expected, got {type(data).__name__} {data!r}; "
                            f"write e.g. {path}: {{{next(iter(builtin))}: ...}}.")
            return
        for sub, value in data.items():
            if sub not in builtin:
                problems.append(f"{path}.{sub}: unknown key; {path} takes {sorted(builtin)}.")
            else:
                _check(value, builtin[sub], f"{path}.{sub}", key, problems, leaves)
        return
    if isinstance(data, bool) or not isinstance(data, (int, float)):
        problems.append(f"{path}: a number is expected, got {type(data).__name__} {data!r}; "
                        f"write e.g. {path}: {builtin!r} (the built-in value).")
        return
    value = float(data)
    above = value >= key.low if key.low_inclusive else value > key.low
    if not (math.isfinite(value) and above and value <= key.high):
        bound = f"{'>=' if key.low_inclusive else '>'} {key.low:g}" + (f" and <= {key.high:g}" if math.isfinite(
            key.high) else "")
        problems.append(f"{path}: {data!r} is out of range; it must be finite, {bound} (built-in {builtin!r}).")
        return
    leaves[path] = value


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that reads ``1e-3`` as a number (YAML 1.2, as the fit YAMLs read it; YAML 1.1 wants
    ``1.0e-3``) and refuses a key given twice (PyYAML keeps the last one silently)."""


def _mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} given twice (line {key_node.start_mark.line + 1}); keep one", None)
        seen.add(key)
    return loader.construct_mapping(node)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                              list("-+0123456789"))


def load_thresholds(path: str | Path) -> Thresholds:
    """Reads a thresholds YAML (module docstring) over the built-ins.

    Args:
        path: A YAML file mapping keys of :data:`THRESHOLD_KEYS` to numbers or maps of numbers.

    Returns:
        The :class:`Thresholds`: the file's leaves, the built-ins elsewhere, the file's path and text.

    Raises:
        ValueError: the file is missing, unreadable or not UTF-8, not YAML, empty, not a map, or has a
            key twice, unknown keys, non-numbers or values out of range; every problem on its own line,
            naming the key and the fix.
    """
    file = Path(path)
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ValueError(f"--thresholds {str(file)!r}: cannot read it ({why}); name a UTF-8 YAML file "
                         "like configs/st_thresholds.yaml.") from None
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as err:
        raise ValueError(f"--thresholds {str(file)!r}: not valid YAML ({str(err).splitlines()[0]}); fix the syntax "
                         "(configs/st_thresholds.yaml is an example).") from None
    if data is None:
        raise ValueError(f"--thresholds {str(file)!r}: the file sets no threshold; set at least one key of "
                         "configs/st_thresholds.yaml, or leave --thresholds out for the built-ins (provisional).")
    if not isinstance(data, Mapping):  # a bad file is a ValueError whatever is wrong in it (the CLI exits 2)
        raise ValueError(  # noqa: TRY004
            f"--thresholds {str(file)!r}: a map of keys {sorted(THRESHOLD_KEYS)} is expected, got "
            f"{type(data).__name__}; see configs/st_thresholds.yaml.")
    builtin = BUILTIN_THRESHOLDS.values
    problems: list[str] = []
    leaves: dict[str, float] = {}
    for key, value in data.items():
        if key not in THRESHOLD_KEYS:
            problems.append(f"{key}: unknown key; thresholds are {sorted(THRESHOLD_KEYS)} (configs/st_thresholds.yaml).")
        else:
            _check(value, builtin[key], str(key), THRESHOLD_KEYS[key], problems, leaves)
    if problems:
        raise ValueError(f"--thresholds {str(file)!r}: {len(problems)} problem(s):\n" + "\n".join(problems))
    values = _plain(builtin)
    for leaf, value in leaves.items():
        *parents, last = leaf.split(".")
        target = values
        for part in parents:
            target = target[part]
        target[last] = value
    return Thresholds(values, path=str(file), text=text, from_file=frozenset(leaves))


def mark_provisional(rows: Iterable[Row], thresholds: Thresholds) -> None:
    """Marks every row that passes on a built-in threshold ``provisional`` (design spec §17.2).

    A row's thresholds are the leaves it read (:meth:`Thresholds.get`); a fail or not-applicable
    verdict is never provisional. A provisional row gets a note naming its built-in leaves.
    """
    for row in rows:
        built_in = [k for k in row.thresholds if thresholds.is_builtin(k)]
        row.provisional = row.verdict == "pass" and bool(built_in)
        if row.provisional:
            row.notes.append(f"Provisional: passes on built-in thresholds ({', '.join(built_in)}); the owner's "
                             "--thresholds file makes it final (docs/acceptance.md, Thresholds).")


def thresholds_markdown(thresholds: Thresholds) -> list[str]:
    """The report.md section: the file (or the built-ins), every leaf with its value and source."""
    lines = ["## Thresholds", ""]
    if thresholds.path is None:
        lines += [("No `--thresholds` file: every tolerance is the built-in value, and each row that passes on one "
                   "reads **pass (provisional thresholds)** (design spec §17.2: the algorithm owner freezes the "
                   "thresholds after the first A5 collection)."), ""]
    else:
        built = [k for k in _leaves(thresholds.values) if thresholds.is_builtin(k)]
        lines += [f"From `--thresholds {thresholds.path}`" + (f"; {len(built)} leaves it leaves out are built-in "
                                                               "(provisional)." if built else "."), ""]
    lines += ["| threshold | value | source | bounds |", "|---|---|---|---|"]
    for leaf, value in _leaves(thresholds.values).items():
        source = "built-in (provisional)" if thresholds.is_builtin(leaf) else "file"
        bounds = THRESHOLD_KEYS[leaf.split(".")[0]].doc.replace("|", "\\|")
        lines.append(f"| `{leaf}` | {value:g} | {source} | {bounds} |")
    if thresholds.text is not None:
        lines += ["", "The file, verbatim:", "", "```yaml", thresholds.text.rstrip("\n"), "```"]
    return lines

