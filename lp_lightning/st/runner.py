"""Running the matrix: one ``lp-lightning fit`` subprocess per run, then reading what it left behind.

Every run goes through the production entry point (``python -m lp_lightning.cli fit``, whose
launcher starts the other ranks) with the user's YAML first and a generated ``run.yaml`` second
(precision, step count, variant, probes, output folder), so the run folder holds the exact
configuration (``run.yaml``, Lightning's ``logs/version_0/config.yaml``), the console output
(``console.log``), ``run_summary.json`` and the probes' per-rank files under ``probes/``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lp_lightning.st.cases import RunSpec, STSettings
from lp_lightning.lightning.callbacks import checkpoint_dirname

__all__ = ["RunResult", "execute_run", "load_run", "run_config"]


@dataclass
class RunResult:
    """What one run left behind.

    Attributes:
        spec: The run.
        folder: Its folder (``<out>/runs/<kind>/<case>``).
        exit_code: The CLI's exit status (``None``: not run).
        seconds: Wall time of the subprocess.
        summary: ``run_summary.json`` (``None`` if missing).
        probes: ``{kind: [per-rank dicts in rank order]}`` from ``probes/<kind>_rank<r>.json``.
        error: The last lines of the console output when the run failed.
    """

    spec: RunSpec
    folder: Path
    exit_code: int | None = None
    seconds: float = 0.0
    summary: dict[str, Any] | None = None
    probes: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        """The run finished with exit status 0 and wrote its summary."""
        return self.exit_code == 0 and self.summary is not None

    def probe(self, kind: str) -> list[dict[str, Any]]:
        """The per-rank files of one probe kind (empty list if it wrote none)."""
        return self.probes.get(kind, [])

    def checkpoint(self, step: int) -> Path:
        """The run's checkpoint folder after ``step`` optimizer steps."""
        return self.folder / "checkpoints" / checkpoint_dirname(step)


def _nested(overrides: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dotted, value in overrides.items():
        node = out
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def run_config(spec: RunSpec, folder: Path, settings: STSettings) -> dict[str, Any]:
    """The ``run.yaml`` of one run: what it sets on top of the user's YAML."""
    probes = folder / "probes"
    callbacks = []
    for callback in spec.callbacks:
        init_args = dict(callback.get("init_args", {}))
        if "out_dir" in init_args and init_args["out_dir"] is None:
            init_args["out_dir"] = str(probes)
        callbacks.append({"class_path": callback["class_path"], "init_args": init_args})
    config = {
        "precision": spec.case.precision,
        "low_precision": None,  # the user's long form would contradict the other cases' --precision
        "trainer": {
            "devices": settings.devices,
            "max_steps": spec.max_steps,
            "default_root_dir": str(folder),
            "enable_progress_bar": False,
            "callbacks": callbacks,
        },
        "checkpoint": {"dirpath": None},  # each run its own <default_root_dir>/checkpoints
    }
    return _merge(config, _nested(spec.overrides))


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def load_run(spec: RunSpec, folder: Path, exit_code: int | None = None, seconds: float = 0.0) -> RunResult:
    """Reads a run folder (also one written by an earlier ``lp-lightning st``)."""
    result = RunResult(spec, folder, exit_code, seconds, summary=_read_json(folder / "run_summary.json"))
    for path in sorted((folder / "probes").glob("*_rank*.json")):
        kind, _, rank = path.stem.rpartition("_rank")
        data = _read_json(path)
        if data is not None and rank.isdigit():
            result.probes.setdefault(kind, []).append({**data, "_rank": int(rank)})
    for ranks in result.probes.values():
        ranks.sort(key=lambda d: d["_rank"])
    return result


def execute_run(
    spec: RunSpec,
    out: Path,
    *,
    user_config: Path | None,
    settings: STSettings,
    resume_checkpoint: Path | None = None,
    timeout_s: float = 3600.0,
    env: dict[str, str] | None = None,
) -> RunResult:
    """Runs one ``lp-lightning fit`` of the matrix and reads its folder.

    Args:
        spec: The run.
        out: The ST output folder (the run goes to ``<out>/runs/<spec.name>``).
        user_config: The user's YAML (``None``: the embedded default).
        settings: Process count and step counts.
        resume_checkpoint: ``--ckpt_path`` of a resumed run.
        timeout_s: The run is killed after this many seconds (counted as failed).
        env: Environment of the subprocess (default: this process's).
    """
    folder = out / "runs" / spec.name
    folder.mkdir(parents=True, exist_ok=True)
    run_yaml = folder / "run.yaml"
    run_yaml.write_text(yaml.safe_dump(run_config(spec, folder, settings), sort_keys=False))
    command = [sys.executable, "-m", "lp_lightning.cli", "fit"]
    if user_config is not None:
        command += ["--config", str(user_config)]
    command += ["--config", str(run_yaml)]
    if resume_checkpoint is not None:
        command += ["--ckpt_path", str(resume_checkpoint)]
    (folder / "command.txt").write_text(" ".join(command) + "\n")
    start = time.perf_counter()
    with open(folder / "console.log", "w") as console:
        try:
            proc = subprocess.run(
                command, stdout=console, stderr=subprocess.STDOUT, timeout=timeout_s, env=env or dict(os.environ)
            )
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    result = load_run(spec, folder, code, time.perf_counter() - start)
    if not result.ok:
        lines = (folder / "console.log").read_text(errors="replace").splitlines()
        reason = "timed out" if code is None else f"exit status {code}"
        result.error = f"{reason}; last lines of {folder / 'console.log'}:\n" + "\n".join(lines[-15:])
    return result
