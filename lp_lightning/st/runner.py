"""Running the matrix: one ``lp-lightning fit`` subprocess per run, then reading what it left behind.

Every run goes through the production entry point (``python -m lp_lightning.cli fit``, whose
launcher starts the other ranks) with the user's YAML first and a generated ``run.yaml`` second
(precision, step count, variant, probes, output folder), so the run folder holds the exact
configuration (``run.yaml``, ``user_config.yaml``: the text of the user's YAML, and Lightning's
``logs/version_0/config.yaml``), the console output (``console.log``), ``run_summary.json`` and the
probes' per-rank files under ``probes/``.

Each run is its own process group (session): a timeout, Ctrl-C or the SIGTERM that
``lp-lightning st`` turns into an exception ends the run's launcher and every rank it started
(SIGTERM, then SIGKILL after :data:`KILL_GRACE_S`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lp_lightning.st.cases import RunSpec, STSettings
from lp_lightning.lightning.callbacks import checkpoint_dirname

__all__ = ["KILL_GRACE_S", "RunResult", "execute_run", "load_run", "reuse_mismatch", "run_config"]

KILL_GRACE_S = 5.0
"""Seconds a stopped run's processes get between SIGTERM and SIGKILL."""


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
        reused: Read from an earlier ``lp-lightning st`` (``--reuse_runs true``), not run now.
    """

    spec: RunSpec
    folder: Path
    exit_code: int | None = None
    seconds: float = 0.0
    summary: dict[str, Any] | None = None
    probes: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    error: str | None = None
    reused: bool = False

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
        "run_summary": {"wire": True},  # the rows read the wire section (opt-in telemetry)
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


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the run's process group, SIGKILL to what is left after :data:`KILL_GRACE_S`."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        os.killpg(proc.pid, signal.SIGKILL)  # ranks the launcher left behind, or the launcher past the grace
    except ProcessLookupError:  # the whole group has ended
        pass
    proc.wait()


def _user_config_text(user_config: Path | None) -> str:
    return user_config.read_text() if user_config is not None else "# embedded default (no --config)\n{}\n"


def _first_difference(old: Any, new: Any, key: str = "") -> tuple[str, Any, Any] | None:
    """The first dotted key where two YAML values differ (``None``: equal)."""
    if isinstance(old, dict) or isinstance(new, dict):  # a section missing on one side: name the key inside it
        old, new = ({} if old is None else old), ({} if new is None else new)
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new), key=str):
            found = _first_difference(old.get(k), new.get(k), f"{key}.{k}" if key else str(k))
            if found:
                return found
        return None
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new)):
            found = _first_difference(a, b, f"{key}[{i}]")
            if found:
                return found
        return None
    return None if old == new else (key, old, new)


def _without_paths(config: dict[str, Any]) -> dict[str, Any]:
    """``run.yaml`` without the values that only name the run folder (it may have moved)."""
    config = json.loads(json.dumps(config))
    config.get("trainer", {}).pop("default_root_dir", None)
    for callback in config.get("trainer", {}).get("callbacks") or []:
        (callback.get("init_args") or {}).pop("out_dir", None)
    return config


def reuse_mismatch(spec: RunSpec, folder: Path, settings: STSettings, user_config: Path | None) -> str | None:
    """Why an earlier run in ``folder`` cannot stand in for ``spec`` now (``None``: it can).

    Compares its ``run.yaml`` with the one this run would get and its ``user_config.yaml`` with the
    user's YAML now, and names the first differing key.
    """
    try:
        saved_run = yaml.safe_load((folder / "run.yaml").read_text()) or {}
        saved_user = yaml.safe_load((folder / "user_config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        return f"its run.yaml or user_config.yaml is missing or unreadable ({type(err).__name__})"
    for what, old, new in (
        ("run.yaml", _without_paths(saved_run), _without_paths(run_config(spec, folder, settings))),
        ("user config", saved_user, yaml.safe_load(_user_config_text(user_config)) or {}),
    ):
        found = _first_difference(old, new)
        if found:
            key, was, now = found
            return f"its {what} differs at {key}: {was!r} then, {now!r} now"
    return None


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
    """Runs one ``lp-lightning fit`` of the matrix in its own process group and reads its folder.

    Args:
        spec: The run.
        out: The ST output folder (the run goes to ``<out>/runs/<spec.name>``).
        user_config: The user's YAML (``None``: the embedded default).
        settings: Process count and step counts.
        resume_checkpoint: ``--ckpt_path`` of a resumed run.
        timeout_s: The run's processes are stopped after this many seconds (counted as failed).
        env: Environment of the subprocess (default: this process's).

    Raises:
        BaseException: whatever interrupted the wait (``KeyboardInterrupt``, the SIGTERM exception of
            ``lp-lightning st``), after the run's processes were stopped.
    """
    folder = out / "runs" / spec.name
    folder.mkdir(parents=True, exist_ok=True)
    run_yaml = folder / "run.yaml"
    run_yaml.write_text(yaml.safe_dump(run_config(spec, folder, settings), sort_keys=False))
    (folder / "user_config.yaml").write_text(_user_config_text(user_config))
    command = [sys.executable, "-m", "lp_lightning.cli", "fit"]
    if user_config is not None:
        command += ["--config", str(user_config)]
    command += ["--config", str(run_yaml)]
    if resume_checkpoint is not None:
        command += ["--ckpt_path", str(resume_checkpoint)]
    else:  # a rerun of `lp-lightning st` replaces its own earlier run in this folder
        command += ["--overwrite", "true"]
    (folder / "command.txt").write_text(" ".join(command) + "\n")
    start = time.perf_counter()
    with open(folder / "console.log", "w") as console:
        proc = subprocess.Popen(command, stdout=console, stderr=subprocess.STDOUT, env=env or dict(os.environ),
                                start_new_session=True)
        try:
            code: int | None = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            code = None
        except BaseException:
            _stop_group(proc)
            raise
    result = load_run(spec, folder, code, time.perf_counter() - start)
    if not result.ok:
        lines = (folder / "console.log").read_text(errors="replace").splitlines()
        reason = "timed out" if code is None else f"exit status {code}"
        result.error = f"{reason}; last lines of {folder / 'console.log'}:\n" + "\n".join(lines[-15:])
    return result
