"""Q3-10 of design spec §17.2: every row of the §15 limit matrix fails at its agreed stage, naming what is wrong.

:data:`~lp_lightning.st.illegal_cases.ILLEGAL_CASES` holds one case per §15 row and sub-case
(:mod:`lp_lightning.st.illegal_cases`; ``compile / fusion`` is no Q3 promise and has no failure rule). :func:`run_illegal_cases` runs each in
a fresh process on CPU through the production entry point it is handed — ``fit_main(["fit", ...])``
with ``fit_main`` = :func:`lp_lightning.cli.main` (``lp-lightning st`` passes it) — or a short
Trainer/Fabric script for what the CLI cannot express (an optimizer other than AdamW, a PEFT wrapper
or Linear subclass at a target FQN, plan rules given to the plugin), and judges it with
:func:`judge`, a pure function of the case and the child's observation.

Stages, in run order (how this repository realises §15's "stage" column; docs/design.md §15):

=========================  =====================================================================
``parse``                  ``lp-lightning fit`` exits with status 2 before its launch checks
``launch``                 status 2 in the launch checks (``cli.launch.check_launch``: ``ckpt_path``,
                           accelerator, the plan compiled on the config's meta model, the shard
                           rule over the world size), before any Trainer, process or model
``instantiate``            the CLI built its classes (``instantiate_classes``)
``startup_gate``           the strategy's startup gate (``lp_lightning.ops.gate``)
``model_build``            the model was built (the LightningModule's ``configure_model``, spec validation)
``plan_compile``           the plan compiled and applied on the built model (the precision plugin's
                           ``convert_module``), before any ``fully_shard``
``sharding``               the strategy shards the converted model (FP32 upcast, placements, ``fully_shard``)
``optimizer_construction`` the optimizer check (``lp_lightning.fsdp.optimizer.check_optimizer``)
``training``               a training step ran (an illegal config must never get here)
``completed``              the run exited with status 0
=========================  =====================================================================

The stage is evidence, not assumption: the product emits a stage event when it enters each stage
above and when a stage ends with an error (:class:`lp_lightning.observers.StageEvent`: the CLI's
``launch_check`` and ``instantiate_classes``, the FSDP2 strategies' ``startup_gate``, ``model_build``,
``plan_apply``, ``fully_shard``, ``optimizer_check`` and ``training_step``); the child registers a
read-only observer (:func:`lp_lightning.observers.add_stage_observer`) and the observed stage is the
furthest one entered (:func:`observed_stage`). The child prints
one line ``LP_ILLEGAL_OBSERVATION {json}`` (exit status, stage events, error message and type) and exits
with the entry point's status (2 usage error; 1 startup-gate failure or uncaught error). A case
passes when the run fails with the status of its expected stage, at that stage, with a message
containing every ``must_mention`` entry (config key, FQN, shape or API; whitespace folded): no
illegal value is skipped or silently falls back.

The ``npu`` accelerator case applies only where torch_npu is absent (else ``pass: None``); the
checks of a present torch_npu (each op and dtype a format needs) are tested with a recording fake
in ``tests/lightning/test_startup_gate.py``.

The child (:mod:`lp_lightning.st.illegal_child`) is ``python -m lp_lightning.st.illegal <case-id> <workdir>
[<module>:<function>]`` (files under ``<workdir>/<case-id>``; the entry point named for a CLI case). By default :func:`run_illegal_cases` runs the same child code
in processes forked from a ``multiprocessing`` forkserver that imported torch, Lightning and
lp_lightning once: a case then costs about 1 s instead of the ~9 s of the imports (all 32 cases:
20-35 s on 2 busy cores, against ~7 min spawning ``python -m`` per case).
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lp_lightning.st.illegal_cases import ILLEGAL_CASES, MARKER, STAGES, IllegalCase, case_argv
from lp_lightning.st.illegal_child import main, run_child

__all__ = ["judge", "observed_stage", "run_illegal_cases"]

FitMain = Callable[[Sequence[str]], int]
"""The ``lp-lightning`` entry point a CLI case runs (:func:`lp_lightning.cli.main`)."""

_STAGE_OF_EVENT = {
    "launch_check": "launch", "instantiate_classes": "instantiate", "startup_gate": "startup_gate",
    "model_build": "model_build", "plan_apply": "plan_compile", "fully_shard": "sharding",
    "optimizer_check": "optimizer_construction", "training_step": "training",
}  # fmt: skip
"""Stage event -> the stage it proves was reached; other events are evidence only."""

def observed_stage(events: Iterable[Sequence[str]], exit_code: int | None) -> str:
    """The furthest stage the stage ``events`` prove (module docstring); ``"completed"`` for exit status 0.

    Args:
        events: ``[name, outcome]`` pairs in the order the stages were entered.
        exit_code: The child's exit status (``None``: it did not finish).
    """
    if exit_code == 0:
        return "completed"
    reached = [STAGES.index(_STAGE_OF_EVENT[name]) for name, *_ in events if name in _STAGE_OF_EVENT]
    return STAGES[max(reached, default=0)]


def judge(case: IllegalCase, observation: Mapping[str, Any]) -> dict[str, Any]:
    """The verdict on one case from what its child observed.

    Args:
        case: The case.
        observation: ``exit_code`` (int or ``None``), ``events`` (``[name, outcome]`` pairs), ``message``
            (the error message), optional ``error_type`` and ``problem`` (the child could not observe).

    Returns:
        ``observed_stage``, ``message`` (whitespace folded), ``mentions_ok``, ``pass`` and ``problems``
        (why it failed, empty when it passed).
    """
    exit_code = observation.get("exit_code")
    stage = observed_stage(observation.get("events", ()), exit_code) if exit_code is not None else "no exit"
    message = " ".join(str(observation.get("message") or "").split())
    missing = [word for word in case.must_mention if word not in message]
    problems = [observation["problem"]] if observation.get("problem") else []
    if exit_code == 0:
        problems.append("the run did not fail: the illegal value was accepted")
    if stage != case.expected_stage:
        problems.append(f"failed at stage {stage!r}, expected {case.expected_stage!r}")
    expected_status = 2 if case.expected_stage in ("parse", "launch") else 1
    if exit_code not in (0, None, expected_status):
        problems.append(f"exit status {exit_code}, expected {expected_status}")
    if not message:
        problems.append("no error message")
    elif missing:
        problems.append(f"the message does not name {missing}")
    return {"observed_stage": stage, "message": message, "mentions_ok": not missing, "pass": not problems,
            "problems": problems}  # fmt: skip


_PRELOAD = ("lp_lightning.st.illegal_child", "lp_lightning.lightning", "lp_lightning.plan",
            "lp_lightning.models.deepseek_v3", "lp_lightning.ops.gate", "lightning.fabric")  # fmt: skip
"""What the forkserver imports once (and the entry point's module), so each forked child starts with the
imports done (~8 s each otherwise)."""


FORKSERVER_LOST_STATUS = 255
"""What ``multiprocessing``'s forkserver gives as a child's exit code when it could not read the status it
forwards (CPython ``popen_forkserver.Popen.poll``: EOF on the sentinel); no ``fit`` exits with it. Seen once
in a full ``st`` on a loaded 2-core machine, for a child that had printed its observation with status 2."""


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    root = str(Path(__file__).resolve().parents[2])  # this lp_lightning, whatever the working directory
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _spawn(case: IllegalCase, workdir: Path, timeout_s: float, fit_main: FitMain | None) -> int | None:
    """``python -m lp_lightning.st.illegal <id> <workdir> [entry]``; its exit status (``None``: killed at the timeout)."""
    case_dir = workdir / case.id
    with open(case_dir / "stdout.txt", "w") as out, open(case_dir / "stderr.txt", "w") as err:
        try:
            return subprocess.run(_child_command(case, workdir, fit_main), stdout=out, stderr=err,
                                  timeout=timeout_s, env=_child_env()).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            return None


def _fork(case: IllegalCase, workdir: Path, timeout_s: float, context: Any, fit_main: FitMain | None) -> int | None:
    """``illegal_child.run_child`` forked from the preloaded forkserver; its exit status (``None``: timeout)."""
    process = context.Process(target=run_child, args=(case, str(workdir), True, fit_main),
                              name=f"lp-illegal-{case.id}")  # fmt: skip
    process.start()
    process.join(timeout_s)
    if process.is_alive():
        process.kill()
        process.join()
        return None
    return process.exitcode


def _child_command(case: IllegalCase, workdir: Path, fit_main: FitMain | None) -> list[str]:
    """The spawned child's command; a CLI case names the entry point (``lp_lightning.cli:main``) last."""
    entry = [f"{fit_main.__module__}:{fit_main.__qualname__}"] if case.cli_args is not None and fit_main else []
    return [sys.executable, "-m", __name__, case.id, str(workdir), *entry]


def _run_one(case: IllegalCase, workdir: Path, timeout_s: float, context: Any, fit_main: FitMain | None,
             ) -> dict[str, Any]:  # fmt: skip
    case_dir = workdir / case.id
    case_dir.mkdir(parents=True, exist_ok=True)
    cli = ["lp-lightning", *case_argv(case, case_dir)] if case.cli_args is not None else None
    result = {"id": case.id, "section15_row": case.section15_row, "description": case.description,
              "command": shlex.join(cli or _child_command(case, workdir, fit_main)), "spec_stage": case.spec_stage,
              "expected_stage": case.expected_stage, "must_mention": list(case.must_mention)}  # fmt: skip
    if case.needs_absent and importlib.util.find_spec(case.needs_absent) is not None:
        return {**result, "observed_stage": None, "exit_code": None, "message": "", "mentions_ok": None,
                "pass": None, "problems": [], "error_type": None, "events": [], "seconds": 0.0,
                "note": f"not applicable: {case.needs_absent} is installed here"}  # fmt: skip
    start = time.perf_counter()
    if context is None:
        exit_code = _spawn(case, workdir, timeout_s, fit_main)
    else:
        exit_code = _fork(case, workdir, timeout_s, context, fit_main)
        if exit_code == FORKSERVER_LOST_STATUS:  # the forkserver's report was lost, not the child's status: once more
            result["retried"] = f"the forkserver reported {FORKSERVER_LOST_STATUS} (status lost); ran the case again"
            exit_code = _fork(case, workdir, timeout_s, context, fit_main)
    seconds = time.perf_counter() - start
    stdout = (case_dir / "stdout.txt").read_text(errors="replace")
    lines = [line[len(MARKER):] for line in stdout.splitlines() if line.startswith(MARKER)]
    if exit_code is None:
        observation: dict[str, Any] = {"exit_code": None, "problem": f"no exit within {timeout_s:g} s"}
    elif not lines:
        stderr = (case_dir / "stderr.txt").read_text(errors="replace")
        observation = {"exit_code": exit_code, "problem": f"the child printed no observation; stderr: {stderr[-300:]}"}
    else:
        observation = json.loads(lines[-1])
        if observation["exit_code"] != exit_code:
            observation["problem"] = f"the child reported status {observation['exit_code']} but exited {exit_code}"
            observation["exit_code"] = exit_code
    return {**result, **judge(case, observation), "exit_code": exit_code, "error_type": observation.get("error_type"),
            "events": observation.get("events", []), "seconds": round(seconds, 2)}  # fmt: skip


def run_illegal_cases(
    workdir: str | os.PathLike[str],
    *,
    cases: Iterable[IllegalCase | str] | None = None,
    timeout_s: float = 300.0,
    jobs: int = 2,
    preload: bool = True,
    fit_main: FitMain | None = None,
) -> list[dict[str, Any]]:
    """Runs the cases, each in a fresh child process, ``jobs`` at a time, and judges them (module docstring).

    Args:
        workdir: Folder for the cases' files and logs (``<workdir>/<id>/stdout.txt``, ``stderr.txt``).
        cases: Cases or case ids (default: :data:`ILLEGAL_CASES`). A case object may differ from the
            table's (e.g. another ``expected_stage``); a forked child runs it as given, a spawned one
            looks its id up in the table, so without ``preload`` only its expectations may differ.
        timeout_s: Limit per child; a child past it is killed and its case fails.
        jobs: Children running at once.
        preload: Fork each child from a ``multiprocessing`` forkserver that imported lp_lightning,
            Lightning and torch once (the forkserver stays until this process exits); ``False``
            starts ``python -m lp_lightning.st.illegal <id> <workdir>`` per case (each imports
            everything itself, ~8 s). Either way the child runs the same code with its own stage observer.
        fit_main: The ``lp-lightning`` entry point the CLI cases run (:func:`lp_lightning.cli.main`;
            ``lp-lightning st`` hands it over). A spawned child resolves it by its
            ``module:qualname``; a forked one receives it pickled by reference.

    Returns:
        One dict per case, in the given order: ``id``, ``section15_row``, ``description``, ``command``
        (the ``lp-lightning fit`` line, or the child's command for a script case), ``spec_stage``,
        ``expected_stage``, ``observed_stage``, ``exit_code``, ``message``, ``must_mention``,
        ``mentions_ok``, ``pass`` (``None``: not applicable here, see ``note``), ``problems``,
        ``error_type``, ``events`` (the stage events' ``[name, outcome]``) and ``seconds`` (the child's wall
        time; with ``preload`` without the imports).

    Raises:
        KeyError: an unknown case id.
        ValueError: without ``preload``, a case whose ``cli_args``/``files`` differ from the table's; a
            CLI case without ``fit_main``.
    """
    by_id = {case.id: case for case in ILLEGAL_CASES}
    selected = [by_id[c] if isinstance(c, str) else c for c in (ILLEGAL_CASES if cases is None else cases)]
    for case in selected if not preload else ():
        table = by_id.get(case.id)
        if table is None or (table.cli_args, table.files) != (case.cli_args, case.files):
            raise ValueError(f"case {case.id!r} is not the table's; a spawned child runs ILLEGAL_CASES by id. "
                             "Pass preload=True to run a case of your own.")  # fmt: skip
    without_entry = [case.id for case in selected if case.cli_args is not None and fit_main is None]
    if without_entry:
        raise ValueError(f"cases {without_entry} run `lp-lightning fit`: pass the entry point, "
                         "fit_main=lp_lightning.cli.main (lp-lightning st does).")  # fmt: skip
    root = Path(workdir)
    context = None
    if preload:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([*_PRELOAD, *([fit_main.__module__] if fit_main else [])])
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        return list(pool.map(lambda case: _run_one(case, root, timeout_s, context, fit_main), selected))
    except BaseException:  # Ctrl-C or lp-lightning st's SIGTERM: no case starts after it, none is left running
        pool.shutdown(wait=False, cancel_futures=True)
        for child in multiprocessing.active_children():
            child.kill()
        raise
    finally:
        pool.shutdown(wait=True)


if __name__ == "__main__":  # the child of a case (lp_lightning.st.illegal_child)
    main()
