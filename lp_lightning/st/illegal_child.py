"""The child side of :mod:`lp_lightning.st.illegal`: one illegal case run in this process, observed through stage events.

:func:`run_child` registers a read-only stage observer (:func:`lp_lightning.observers.add_stage_observer`;
``lp_lightning.st.illegal``'s module docstring), writes the case's files, runs the entry point it was
handed (``fit_main(["fit", ...])``, :func:`lp_lightning.cli.main`) or the case's Trainer/Fabric script
with stderr kept, prints ``LP_ILLEGAL_OBSERVATION {json}`` and exits with the entry point's status.
Entry: ``python -m lp_lightning.st.illegal <case-id> <workdir> [<module>:<function>]`` (the entry point,
needed by a CLI case; :func:`pkgutil.resolve_name` form, as ``lp_lightning.cli:main``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pkgutil
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from torch import nn

import lp_lightning.models.deepseek_v3 as deepseek_v3
from lp_lightning.lightning import DeepSeekV3LM, FSDP2FabricStrategy, FSDP2Strategy, precision_plugin
from lp_lightning.observers import StageEvent, add_stage_observer
from lp_lightning.plan import rules_from_config
from lp_lightning.st.illegal_cases import ILLEGAL_CASES, MARKER, IllegalCase, case_argv, plan_rule

__all__ = ["LinearSubclass", "PeftStyleWrapper", "main", "run_child"]

_NO_SUCH_LAYER = "model.layers.9.self_attn.q_proj"  # dsv3-tiny has 3 layers


def _record_stages(events: list[list[str]]) -> Callable[[StageEvent], None]:
    """An observer that keeps ``[stage, outcome]`` per stage entered, in entry order; a stage that then
    raised has its entry's outcome replaced by ``"raised <ErrorType>"``."""

    def record(event: StageEvent) -> None:
        if event.outcome == "entered":
            events.append([event.stage, event.outcome])
            return
        for entry in reversed(events):
            if entry[0] == event.stage and entry[1] == "entered":
                entry[1] = event.outcome
                return

    return record


class PeftStyleWrapper(nn.Module):
    """A LoRA-style wrapper (``base_layer`` + adapter) as PEFT puts at a target FQN (case ``peft-lora-wrapper``).

    ``forward`` returns ``base_layer(x)``: ``[..., in_features] -> [..., out_features]``.
    """

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_a = nn.Linear(base.in_features, 2, bias=False, device=base.weight.device, dtype=base.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x)


class LinearSubclass(nn.Linear):
    """A user's ``nn.Linear`` subclass at a target FQN (case ``custom-linear-subclass``)."""


def _trainer_fit(case_dir: Path, module: Any, plugin: Any) -> None:
    """A one-step Trainer run (FSDP2Strategy, one CPU rank) on two synthetic batches."""
    ids = torch.randint(0, 256, (2, 2, 9), generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": row[:, :-1], "labels": row[:, 1:]} for row in ids]
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=FSDP2Strategy(), plugins=[plugin], max_steps=1, limit_val_batches=0,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, default_root_dir=str(case_dir / "run"),
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))


def _fabric_model() -> tuple[Any, Any]:
    """A launched one-rank Fabric (FSDP2FabricStrategy, bf16 plugin) and its set-up dsv3-tiny."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FSDP2FabricStrategy(),
                    plugins=[precision_plugin("bf16", trainer=False)])  # fmt: skip
    fabric.launch()
    return fabric, fabric.setup_module(deepseek_v3.from_hf_config("dsv3-tiny", seed=0))


def _script_case(name: str, case_dir: Path) -> None:
    """Runs the script case ``name`` (the rows the CLI cannot express); it is expected to raise."""
    if name == "targets-zero-hits-trainer":
        rules = rules_from_config([plan_rule("mla", "model.layers.0.self_attn.q_proj", _NO_SUCH_LAYER)])
        _trainer_fit(case_dir, DeepSeekV3LM(), precision_plugin("mxfp8", plan_rules=rules))
    elif name == "optimizer-sgd-trainer":

        class SGDModule(DeepSeekV3LM):
            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.model.parameters(), lr=0.1)

        _trainer_fit(case_dir, SGDModule(), precision_plugin("bf16"))
    elif name == "optimizer-sgd-fabric":
        fabric, model = _fabric_model()
        fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    elif name == "optimizer-bf16-moments-fabric":
        fabric, model = _fabric_model()
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
        adamw.state[next(iter(model.parameters()))] = {"step": torch.tensor(1.0),
                                                       "exp_avg": torch.zeros((), dtype=torch.bfloat16)}  # fmt: skip
        fabric.setup_optimizers(adamw)
    elif name in ("peft-lora-wrapper", "custom-linear-subclass"):
        def customize(base: nn.Linear) -> nn.Module:
            if name == "peft-lora-wrapper":
                return PeftStyleWrapper(base)
            base.__class__ = LinearSubclass
            return base

        class CustomizedLM(DeepSeekV3LM):
            def configure_model(self) -> None:
                super().configure_model()
                mlp = self.model.model.layers[0].mlp
                mlp.gate_proj = customize(mlp.gate_proj)

        _trainer_fit(case_dir, CustomizedLM(), precision_plugin("mxfp8"))
    else:
        raise KeyError(f"no script case {name!r}")


def _write_files(case: IllegalCase, case_dir: Path) -> None:
    # 12.5 kB: one validation batch of the 16B configs' 8 x (32 + 1) tokens fits in its 5 % split.
    (case_dir / "corpus.txt").write_text("Every illegal configuration fails at its stage.\n" * 256)
    for name, content in case.files:
        if isinstance(content, str):
            (case_dir / name).write_text(content)
        else:
            torch.save(content, case_dir / name)


def usage_error(stderr: str) -> str:
    """The message of the CLI's usage error in ``stderr``: after ``<prog>: error: `` up to the ``--help`` pointer
    (``lp_lightning.cli.fit``'s parser), else after jsonargparse's own ``error: `` line; ``""`` without one."""
    lines = stderr.splitlines()
    for index, line in enumerate(lines):
        head, found, rest = line.partition(": error: ") if not line.startswith("error: ") else ("", True, line[7:])
        if found:
            tail = [t for t in lines[index + 1:] if not t.endswith("--help lists every option.")]
            return "\n".join([rest, *tail])
    return ""


def _observe(case: IllegalCase, case_dir: Path, fit_main: Callable[[Sequence[str]], int] | None) -> dict[str, Any]:
    """Runs ``case`` in this process with a stage observer registered.

    Returns:
        ``exit_code`` (what the interpreter would exit with), ``events`` (the stage events'
        ``[stage, outcome]`` in entry order), ``message`` (the usage error, :func:`usage_error`; the
        startup gate's ``lp-lightning: ...`` line, or the uncaught error's text) and ``error_type``
        (its class).

    Raises:
        ValueError: A CLI case without ``fit_main``.
    """
    if case.cli_args is not None and fit_main is None:
        raise ValueError(f"case {case.id!r} runs `lp-lightning fit`: pass the entry point as fit_main "
                         "(lp_lightning.cli.main).")  # fmt: skip
    events: list[list[str]] = []
    add_stage_observer(_record_stages(events))  # this process runs one case and exits
    _write_files(case, case_dir)
    captured = io.StringIO()
    error_type, message = None, ""

    class Tee(io.TextIOBase):  # the CLI's stderr, kept for the message and still shown
        def write(self, text: str) -> int:
            captured.write(text)
            return sys.__stderr__.write(text)

    try:
        with contextlib.redirect_stderr(Tee()):
            if fit_main is not None and case.cli_args is not None:
                exit_code = fit_main(case_argv(case, case_dir))
            else:
                _script_case(case.id, case_dir)
                exit_code = 0
    except SystemExit as err:
        exit_code = 0 if err.code is None else err.code if isinstance(err.code, int) else 1  # as the interpreter
        message = usage_error(captured.getvalue())
    except Exception as err:  # an uncaught error: the interpreter would print it and exit 1
        traceback.print_exc()
        exit_code, error_type, message = 1, f"{type(err).__module__}.{type(err).__qualname__}", str(err)
    else:
        gate_lines = [line for line in captured.getvalue().splitlines() if line.startswith("lp-lightning: ")]
        message = gate_lines[-1] if exit_code and gate_lines else ""
    return {"exit_code": exit_code, "events": events, "message": message, "error_type": error_type}


def run_child(
    case: IllegalCase | str, workdir: str, redirect: bool, fit_main: Callable[[Sequence[str]], int] | None = None
) -> None:
    """Observes one case in this process, prints the observation line, exits with the run's status.

    ``redirect`` points this process's stdout/stderr (file descriptors 1 and 2) at
    ``<workdir>/<id>/stdout.txt``/``stderr.txt`` first (a forked child; a spawned one is redirected
    by its parent). ``fit_main`` is the ``lp-lightning`` entry point a CLI case runs.
    """
    if isinstance(case, str):
        case = {c.id: c for c in ILLEGAL_CASES}[case]
    case_dir = Path(workdir) / case.id
    case_dir.mkdir(parents=True, exist_ok=True)
    if redirect:
        for fd, name in ((1, "stdout.txt"), (2, "stderr.txt")):
            with open(case_dir / name, "w") as file:
                os.dup2(file.fileno(), fd)
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)
    observation = _observe(case, case_dir, fit_main)
    print(MARKER + json.dumps(observation), flush=True)
    sys.stderr.flush()
    os._exit(observation["exit_code"])  # no interpreter teardown: a failed run may leave gloo threads behind


def main(argv: Sequence[str] | None = None) -> None:
    """The child: ``python -m lp_lightning.st.illegal <case-id> <workdir> [<module>:<function>]`` (:func:`run_child`).

    The third argument names the entry point a CLI case runs (``lp_lightning.cli:main``), resolved
    with :func:`pkgutil.resolve_name`.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) not in (2, 3):
        sys.exit("usage: python -m lp_lightning.st.illegal <case-id> <workdir> [<module>:<function>]")
    run_child(args[0], args[1], redirect=False, fit_main=pkgutil.resolve_name(args[2]) if len(args) == 3 else None)
