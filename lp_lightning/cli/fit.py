"""``lp-lightning fit``: the LightningCLI of the pretraining job, its options and their parse-time checks.

:func:`parse_config` parses and checks a fit config without building anything; :func:`plan_settings`
is what ``lp-lightning plan --config`` (:mod:`lp_lightning.planner.main`) reads from a fit YAML. The
launch checks are :mod:`lp_lightning.cli.launch`; the dispatcher :func:`lp_lightning.cli.main`.

``lp-lightning fit`` is a LightningCLI over :class:`~lp_lightning.lightning.module.DeepSeekV3LM`
and :class:`~lp_lightning.lightning.datamodule.PretrainDataModule`. Without ``--config`` it
trains the embedded default - the values of ``configs/dsv3_tiny.yaml`` (a test keeps the two
equal): ``dsv3-tiny`` on the running Python's standard-library sources with the byte tokenizer.

Options added on top of LightningCLI's ``--trainer.* / --model.* / --data.*``:

* ``--precision {bf16,mxfp8,hif8}``: the precision plugin
  (:func:`~lp_lightning.lightning.precision.precision_plugin`); it maps onto
  ``LowPrecisionConfig.from_precision`` (``mxfp8`` = ``mxfp8_e4m3+mx_block``, ``hif8`` =
  ``hif8+current``). An unknown value fails while parsing, naming the choices.
* ``--backend {auto,emulated,npu}``: the op backend of the low-precision GEMMs, chosen and
  checked by the startup gate before the model is built (:mod:`lp_lightning.ops.gate`; ``auto`` =
  ``npu`` on the npu accelerator, ``emulated`` elsewhere). A failing check stops the run with the
  checks printed and exit status 1.
* ``--low_precision.*`` (optional; the design spec §4.2 ``low_precision:`` YAML section):
  :class:`~lp_lightning.policy.LowPrecisionConfig`. It states the same choice long-hand; an illegal
  ``format``/``scaling`` pair (``scaling: delayed``: "HiF8 delayed scaling is not supported"), a
  section that disagrees with ``--precision``, or one that names a low-precision pair with
  ``enabled: false`` in a bf16 run fails while parsing (exit status 2), before any model is built.
* ``--plan_overrides`` (optional; design spec §4.3): replacement rules instead of the model adapter's
  default (:func:`~lp_lightning.plan.rules_from_config`; full FQNs, no wildcards). Their form is
  checked while parsing; in mxfp8/hif8 the plan is compiled once at launch on the meta model (zero
  hits, wrong module types, unimportable paths fail then, exit status 2) and handed to the plugin.
* ``--fsdp_config.*``: :class:`~lp_lightning.config.FSDP2Config` (design spec §4.3); unsupported values
  (``comm_fusion: true``, TP/CP/EP/PP > 1) fail before any model is built. A weight whose dim-0
  split breaks its format's shard rule is sharded along its input dim (``input_dim_sharding``); with
  ``fallback_to_unsharded: false``, weights no dim can shard over the run's world size are listed
  in one error at launch (FQN, shape, rules, the fix).
* ``--checkpoint.*``: :class:`~lp_lightning.lightning.callbacks.PeriodicCheckpoint`
  (``every_n_steps``; DCP folders ``<default_root_dir>/checkpoints/step-000050``).
* ``--run_summary.*``: :class:`~lp_lightning.telemetry.summary.RunSummaryCallback`
  (``<default_root_dir>/run_summary.json``).
* ``--preemption.timeout_s`` (default 300): :class:`~lp_lightning.lightning.callbacks.Preemption`.
  SIGTERM, SIGUSR1 or SIGINT to any rank stops every rank after the same optimizer step, which is
  saved; ``run_summary.json`` is written, rank 0 prints the resume command, the exit status is 143
  (130 for SIGINT). A rank still running ``timeout_s`` after the signal, or one that gets a second
  signal, exits at once with one line.
* ``--nonfinite.max_consecutive_skips`` (default 3, ``0`` = no limit): the non-finite guard of the
  precision plugin stops the run after that many optimizer steps skipped in a row for a NaN/Inf
  gradient norm, and at once when a master weight holds NaN/Inf; it prints one line (step, skip
  count, reason, first offending FQN, last good checkpoint) and exits with status 1, and nothing
  is saved from the non-finite state (docs/architecture.md "The non-finite guard").
* ``--overwrite`` (default false): a fresh ``fit`` (no ``ckpt_path``) whose checkpoint folder holds
  ``step-*`` folders stops before training (exit status 2) unless it is true; the default
  ``trainer.default_root_dir`` ``runs/dsv3_tiny/{precision}`` gives each precision its own folder.

The Trainer's ``strategy`` and ``plugins`` are built from ``--fsdp_config`` and ``--precision``
as instances (``FSDP2Strategy``, ``precision_plugin(...)``); setting ``--trainer.strategy``,
``--trainer.plugins`` (except Lightning ``ClusterEnvironment`` plugins such as ``SLURMEnvironment``,
which are passed through) or ``--trainer.precision`` fails while parsing (exit status 2), and ``--help``
marks them REFUSED. ``trainer.logger: true`` (the default) means a ``CSVLogger`` under
``<default_root_dir>/logs``.

Processes: ``--trainer.devices N`` on CPU starts N processes (Lightning re-launches this command
for ranks 1..N-1). Under ``torchrun`` Lightning uses the launcher's processes instead::

    torchrun --nproc_per_node 2 -m lp_lightning.cli fit --trainer.devices 2
    python -m lp_lightning.cli fit --config configs/dsv3_tiny.yaml

Resume: ``lp-lightning fit --ckpt_path runs/dsv3_tiny/bf16/checkpoints/step-000020`` (a DCP folder), or
``--ckpt_path last`` for the newest complete one under the checkpoint folder (none yet: the run
starts from step 0, so a job script may pass ``last`` on every start; at ``trainer.max_steps``:
nothing to do, exit status 0). ``lp-lightning validate --ckpt_path last`` validates the newest
complete checkpoint whatever its step (none: exit status 2), restoring the weights only. At
launch, ``last`` skips folders that fail the quick check (sizes, ``.metadata``/``meta.pt``
digests, saved non-finite), naming each; at load, every file's SHA-256 is checked and a damaged folder is skipped, naming it,
for the newest intact older one (``FSDP2Strategy(resume_fallback=True)``). An explicit path to a
damaged folder fails, naming the file and the last good checkpoint: at launch (exit status 2) or,
for bytes changed in place, when it is loaded before training (exit status 1). The path, the batch
geometry (``data.global_batch_size`` divisible by accumulation x world size) and a ``torchrun``
world size that disagrees with ``trainer.devices`` are checked while parsing (exit status 2),
before any process is launched; ``ckpt_path`` must be a DCP folder (a ``.ckpt`` file fails).
``--print_config`` prints only a config that passes all these checks.
A run stopped by SIGTERM or SIGUSR1 (preemption) exits with status 143, by Ctrl-C with 130; both
resume that way.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Optional

from jsonargparse import Namespace
from jsonargparse.typing import NonNegativeInt

from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.trainer import Trainer
from typing_extensions import override

from lp_lightning.cli.launch import check_launch, is_rank_zero, launch_world_size
from lp_lightning.usage import usage_error_text
from lp_lightning.config import FSDP2Config
from lp_lightning.lightning.callbacks import PeriodicCheckpoint, Preemption
from lp_lightning.lightning.datamodule import PretrainDataModule, check_batch_geometry
from lp_lightning.lightning.module import DeepSeekV3LM
from lp_lightning.lightning.nonfinite import DEFAULT_MAX_CONSECUTIVE_SKIPS
from lp_lightning.lightning.precision import BackendChoice, PrecisionMode, precision_plugin
from lp_lightning.lightning.progress import default_progress_bar
from lp_lightning.lightning.strategy import FSDP2Strategy
from lp_lightning.observers import stage
from lp_lightning.policy import LowPrecisionConfig, refused_scaling_message
from lp_lightning.telemetry.summary import RunSummaryCallback

__all__ = ["PRECISION_FIELD", "TRAINER_DEFAULTS", "LPLightningCLI", "parse_config", "plan_settings"]

TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 1,
    "max_steps": 40,
    "default_root_dir": "runs/dsv3_tiny/{precision}",
    "val_check_interval": 20,
    "check_val_every_n_epoch": None,
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 1,
    "enable_model_summary": False,
    "gradient_clip_val": 1.0,
    "deterministic": True,
    "use_distributed_sampler": False,
}
"""Trainer defaults of ``lp-lightning fit`` (= the ``trainer:`` block of ``configs/dsv3_tiny.yaml``).

``default_root_dir``'s ``{precision}`` becomes the run's ``--precision`` while parsing (:data:`PRECISION_FIELD`).
``use_distributed_sampler`` must stay false: the datamodule already gives each rank its rows.
``enable_model_summary: false``: the strategy prints a one-line model summary instead of Lightning's
table (which cannot size FP32 masters under this precision plugin and counts no FLOPs).
``val_check_interval`` counts training micro-batches (Lightning's unit); with
``accumulate_grad_batches: 1`` that is optimizer steps.
"""

PRECISION_FIELD = "{precision}"
"""Replaced by ``--precision`` in ``trainer.default_root_dir`` while parsing, so runs of each precision keep
their own folder (``runs/dsv3_tiny/bf16``, ``runs/dsv3_tiny/mxfp8``)."""


def _resolve_root_dir(section: Namespace) -> None:
    """``trainer.default_root_dir`` with :data:`PRECISION_FIELD` replaced by the run's precision (in place)."""
    root = section["trainer"].get("default_root_dir")
    if root is not None and PRECISION_FIELD in str(root):
        section["trainer"]["default_root_dir"] = str(root).replace(PRECISION_FIELD, str(section["precision"]))


_SET_BY_LP_LIGHTNING = {"strategy": "auto", "plugins": None, "precision": None}
"""Trainer options lp-lightning builds itself (from ``--fsdp_config`` and ``--precision``), with their
defaults: any other value is refused while parsing (design spec §15)."""

_REFUSED_HELP = "REFUSED by lp-lightning: it builds the {what} from {source}; setting this exits with status 2. "


def _is_cluster_environment(plugin: object) -> bool:
    """Whether a ``trainer.plugins`` entry (an instance, or a class path before instantiation) is a
    Lightning ``ClusterEnvironment`` (SLURM, LSF, ...), the one plugin kind lp-lightning passes through."""
    path = getattr(plugin, "class_path", None)
    if path is None:
        return isinstance(plugin, ClusterEnvironment)
    module, _, name = str(path).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(cls, type) and issubclass(cls, ClusterEnvironment)


def _cluster_environments(plugins: object) -> list[Any]:
    """The ``ClusterEnvironment`` entries of ``trainer.plugins`` (``None``, one plugin or a list)."""
    entries = plugins if isinstance(plugins, list) else [] if plugins is None else [plugins]
    return [plugin for plugin in entries if _is_cluster_environment(plugin)]


def _refused(trainer: Namespace | dict) -> str | None:
    """The error for a refused Trainer option that was set, or ``None``."""
    for key, default in _SET_BY_LP_LIGHTNING.items():
        value = trainer.get(key, default)
        if key == "plugins" and value is not None:
            entries = value if isinstance(value, list) else [value]
            value = [plugin for plugin in entries if not _is_cluster_environment(plugin)] or default
        if value != default:
            source = "--precision" if key in ("precision", "plugins") else "--fsdp_config"
            shown = [getattr(v, "class_path", v) for v in value] if isinstance(value, list) else value
            shown = getattr(shown, "class_path", shown)  # a class given by path: show the path
            return f"trainer.{key}={shown!r} cannot be set: lp-lightning builds it from {source}. Remove trainer.{key}."
    return None


_REJECTED_SCALING = re.compile(r'Parser key "(?:low_precision\.)?scaling":\s*Expected a [^\n]*\. Got value: (\S+)')
"""jsonargparse's error for a ``low_precision.scaling`` value outside its choices (``Literal``)."""


def _refused_init_args(err: BaseException) -> str | None:
    """The message of the class ``__init__`` error jsonargparse wrapped in ``err``, or ``None`` when ``err`` is
    not such a wrapper (it has no cause: the error of a class built after parsing stays as it is)."""
    inner, seen = err, 0
    while inner.__cause__ is not None and seen < 16:
        inner, seen = inner.__cause__, seen + 1
    if inner is err or not isinstance(inner, (TypeError, ValueError)):
        return None
    return str(inner)  # it names the class, the value and the fix


class _LPArgumentParser(LightningArgumentParser):
    """The CLI's parser: a usage error is one line and a pointer to ``--help``; options are never abbreviated.

    jsonargparse prints the whole usage (~90 lines) before the error; this parser prints
    ``<prog>: error: <message>`` and ``<prog> --help lists every option.`` (rank 0 only: under torchrun
    every process parses the same arguments) and exits with status 2.
    ``allow_abbrev=False``: ``--trainer.max_step 5`` is an unknown option, not ``max_steps``.
    ``scaling: delayed`` is not one of the field's choices, so jsonargparse rejects it with a
    generic dump of the ``Optional[LowPrecisionConfig]`` union; that dump becomes
    :func:`~lp_lightning.policy.refused_scaling_message` ("HiF8 delayed scaling is not supported").
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        match = _REJECTED_SCALING.search(message) if self.exit_on_error and "low_precision" in message else None
        message = refused_scaling_message(match.group(1)) if match else message
        if not self.exit_on_error:
            super().error(message, ex)  # raises ArgumentError (parse_config, the tests, st's checks)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        # The top-level parser knows fit/validate only; the dispatcher (lp_lightning.cli) serves the rest.
        pointer = "every option" if " " in prog else "every subcommand: fit, validate, validate-model, plan, st"
        if is_rank_zero():  # under torchrun every process parses the same arguments: one of them says why
            sys.stderr.write(usage_error_text(prog, message, pointer))
        self.exit(2)



def _requests_print_config(arg: str) -> bool:
    return arg == "--print_config" or arg.startswith("--print_config=")


def _check_low_precision(section: Namespace) -> None:
    """The ``low_precision`` section against ``precision`` (design spec §4.2; the pair itself: ``__post_init__``).

    Raises:
        ValueError: The section selects another precision, or it names a low-precision pair with
            ``enabled: false`` while ``precision`` is bf16 (the run would silently train in bf16).
    """
    low_precision = section.get("low_precision")
    if low_precision is None:
        return
    values = low_precision.as_dict() if isinstance(low_precision, Namespace) else dict(vars(low_precision))
    config = LowPrecisionConfig.from_dict(values)
    pair = f"{config.format}+{config.scaling}"
    if config.precision_name.value != section["precision"]:
        fix = f"set `precision: {config.precision_name.value}` or remove the low_precision section"
        if not config.enabled:  # the section names the run's pair but forgot to switch it on
            fix = "set `low_precision.enabled: true`, or remove the low_precision section"
        raise ValueError(
            f"low_precision ({pair}, enabled={config.enabled}) selects --precision {config.precision_name.value}, "
            f"but precision={section['precision']!r}; {fix}."
        )
    default = LowPrecisionConfig()
    if not config.enabled and (config.format, config.scaling) != (default.format, default.scaling):
        named = LowPrecisionConfig(enabled=True, format=config.format, scaling=config.scaling).precision_name.value
        raise ValueError(
            f"low_precision names {pair} but enabled=False, so this run would train in bf16; set "
            f"`low_precision.enabled: true` and `precision: {named}`, or remove the low_precision section."
        )


def _plan_rules(specs: list[dict[str, Any]] | None) -> tuple[Any, ...] | None:
    """``plan_overrides`` as replacement rules (``None``: the model adapter's default rules).

    Raises:
        TypeError, ValueError: from :func:`~lp_lightning.plan.rules_from_config`, naming the rule and
            key: an unknown key, a wildcard in ``match``/``exclude``, a malformed dotted path,
            duplicated rule names.
    """
    if specs is None:
        return None
    # Imported here: only with plan_overrides; a bf16 run without them loads no plan module.
    from lp_lightning.plan import rules_from_config

    return rules_from_config([dict(spec) for spec in specs])


def _check_section(section: Namespace, *, subcommand: str | None) -> None:
    """Everything :meth:`LPLightningCLI.parse_arguments` checks, in order (design spec §15); the launch
    checks only with a subcommand (``fit``/``validate``).

    Raises:
        TypeError, ValueError, ImportError: the first failing check, naming the key and the fix.
    """
    FSDP2Config(**section["fsdp_config"].as_dict())
    _check_low_precision(section)
    refused = _refused(section["trainer"])
    if refused is not None:
        raise ValueError(refused)
    rules = _plan_rules(section.get("plan_overrides"))
    if subcommand is not None:
        with stage("launch_check"):
            check_launch(section, plan_rules=rules, subcommand=subcommand)


class LPLightningCLI(LightningCLI):
    """LightningCLI of the pretraining job (see the module docstring).

    Args:
        args: Command-line arguments (without the program name); ``None`` reads ``sys.argv``.
        run: Whether to run the subcommand (``False``: only parse and instantiate).
        cpu_threads_default: Called once before a Trainer on the cpu accelerator is built: the
            entry point's thread default (:func:`lp_lightning.cli.default_cpu_threads`); ``None``
            leaves the process's threads as they are.
    """

    def __init__(
        self,
        args: Sequence[str] | None = None,
        run: bool = True,
        cpu_threads_default: Callable[[], None] | None = None,
    ) -> None:
        self._cpu_threads_default = cpu_threads_default
        super().__init__(
            model_class=DeepSeekV3LM,
            datamodule_class=PretrainDataModule,
            trainer_defaults=dict(TRAINER_DEFAULTS),
            seed_everything_default=0,
            auto_configure_optimizers=False,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={
                "prog": "lp-lightning",
                "description": "Pretrain DeepSeek-V3 with FSDP2 in bf16, mxfp8 or hif8 GEMMs. Also: "
                "`lp-lightning validate-model --help` (structure report of a spec on the meta device), "
                "`lp-lightning plan --help` (per-rank memory of a run, on the meta device), "
                "`lp-lightning st --help` (the design spec §17 acceptance runs and report).",
            },
            parser_class=_LPArgumentParser,
            args=None if args is None else list(args),
            run=run,
        )

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        """``fit`` and ``validate`` (the datamodule has no test or predict data)."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name in ("fit", "validate")}

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--precision",
            type=PrecisionMode,
            default="bf16",
            help=(
                "GEMM precision: bf16 (BF16 compute, FP32 master weights and gradient reduction), mxfp8 "
                "(mxfp8_e4m3 + mx_block) or hif8 (hif8 + current) for the planned DeepSeek-V3 GEMMs."
            ),
        )
        parser.add_argument(
            "--backend",
            type=BackendChoice,
            default="auto",
            help=(
                "Op backend of the low-precision GEMMs, chosen and checked by the startup gate (design spec §15): "
                "auto (npu on the npu accelerator, else emulated), emulated (exact software emulation) or npu."
            ),
        )
        parser.add_argument(
            "--low_precision",
            type=Optional[LowPrecisionConfig],
            default=None,
            help="The design spec §4.2 low_precision section (enabled/format/scaling); must agree with --precision.",
        )
        parser.add_argument(
            "--plan_overrides",
            type=Optional[list[dict[str, Any]]],
            default=None,
            help=(
                "Replacement rules (design spec §4.3) instead of the model adapter's default: a list of "
                "{name, match: [full FQNs], exclude, when, module_type, exact_type, replace_module: {_target_}}; "
                "no wildcards (§1.1). E.g. --config configs/plan_deepseek_v3.yaml. Checked while parsing and "
                "compiled once at launch."
            ),
        )
        parser.add_argument(
            "--nonfinite.max_consecutive_skips",
            type=NonNegativeInt,
            default=DEFAULT_MAX_CONSECUTIVE_SKIPS,
            help=(
                "Stop the run after this many optimizer steps in a row were skipped for a NaN/Inf gradient norm "
                "(0 = no limit); a NaN/Inf master weight stops it at once. Exit status 1, nothing saved from the "
                "non-finite state."
            ),
        )
        parser.add_argument(
            "--overwrite",
            type=bool,
            default=False,
            help=(
                "fit: start a new run (no --ckpt_path) in a folder that holds another run's checkpoints, "
                "overwriting those of the same steps and its run_summary.json; without it such a run stops before "
                "training (exit status 2). validate writes no checkpoints and ignores it."
            ),
        )
        parser.add_class_arguments(FSDP2Config, "fsdp_config", fail_untyped=True)
        parser.add_lightning_class_args(PeriodicCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.every_n_steps": 20, "model.activation_checkpoint": "off"})
        parser.add_lightning_class_args(RunSummaryCallback, "run_summary")
        parser.link_arguments("precision", "run_summary.precision")
        parser.add_lightning_class_args(Preemption, "preemption")  # after run_summary: it records the last step first
        refused = {"trainer.strategy": ("strategy", "--fsdp_config"),
                   "trainer.plugins": ("precision plugin (cluster environments are accepted)", "--precision"),
                   "trainer.precision": ("precision plugin", "--precision")}
        for action in parser._actions:  # mark the Trainer options lp-lightning refuses (see _SET_BY_LP_LIGHTNING)
            if action.dest in refused:
                what, source = refused[action.dest]
                action.help = _REFUSED_HELP.format(what=what, source=source) + (action.help or "")

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parses, then runs the design spec §15 checks so a bad config fails as a usage error (exit status 2).

        The checks (:func:`_check_section`) run before any class is instantiated: ``fsdp_config``
        and ``low_precision`` (their ``__post_init__``), the refused Trainer options, the
        ``plan_overrides`` rules and, with a subcommand, the launch checks
        (:func:`~lp_lightning.cli.launch.check_launch`). ``--print_config`` prints only a config that
        passes them: jsonargparse prints (and exits) inside ``parse_args`` before anything is checked,
        so with that flag the arguments are first parsed and checked without it.

        The parser is called directly, as ``LightningCLI.parse_arguments`` does, without its warning
        for ``args`` given while ``sys.argv`` holds arguments: ``args`` are this command's own
        (:func:`parse_config` and ``lp-lightning st``/``plan`` parse a fit config from inside a
        process whose ``sys.argv`` holds other arguments).
        """
        argv = sys.argv[1:] if args is None else args
        self._resume_fallback = False
        if not isinstance(argv, (dict, Namespace)) and any(map(_requests_print_config, argv)):
            self.config = parser.parse_args([arg for arg in argv if not _requests_print_config(arg)])
            self._check_config(parser)
        self.config = parser.parse_object(args) if isinstance(args, (dict, Namespace)) else parser.parse_args(args)
        self._check_config(parser)

    def _check_config(self, parser: LightningArgumentParser) -> None:
        subcommand = self.config.get("subcommand")
        section = self.config[subcommand] if subcommand else self.config
        target = self._subcommand_parsers[subcommand] if subcommand else parser
        self._resume_fallback = section.get("ckpt_path") == "last"  # before the launch checks resolve it
        _resolve_root_dir(section)
        try:
            _check_section(section, subcommand=subcommand)
        except (TypeError, ValueError, ImportError) as err:
            target.error(str(err))

    @override
    def instantiate_classes(self) -> None:
        """Builds the model, data module and Trainer (the ``instantiate_classes`` stage event).

        A class of the config that refuses its ``init_args`` (a callback's ``ValueError``, which
        jsonargparse wraps in a dump of the union it tried) is a usage error: its own message, exit 2.
        """
        with stage("instantiate_classes"):
            try:
                super().instantiate_classes()
            except (TypeError, ValueError) as err:
                refused = _refused_init_args(err)
                if refused is None:
                    raise
                subcommand = self.config.get("subcommand")
                (self._subcommand_parsers[subcommand] if subcommand else self.parser).error(refused)

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Builds the Trainer with ``FSDP2Strategy`` and ``precision_plugin(...)`` instances.

        Raises:
            ValueError: ``trainer.strategy``, ``trainer.plugins`` or ``trainer.precision`` is set.
        """
        trainer_config = self._get(self.config_init, "trainer", default={})
        refused = _refused(trainer_config)  # parse_arguments refused these already; kept for direct use
        if refused is not None:
            raise ValueError(refused)
        fsdp_config = self._get(self.config_init, "fsdp_config")
        precision = self._get(self.config, "precision")
        kwargs["strategy"] = FSDP2Strategy(
            fsdp_config=fsdp_config, resume_fallback=getattr(self, "_resume_fallback", False)
        )
        plan_rules = _plan_rules(self._get(self.config, "plan_overrides"))
        backend = self._get(self.config, "backend")
        max_skips = self._get(self.config, "nonfinite", default={}).get(
            "max_consecutive_skips", DEFAULT_MAX_CONSECUTIVE_SKIPS
        )
        low_precision = {} if precision == "bf16" else {"plan_rules": plan_rules}
        kwargs["plugins"] = [
            precision_plugin(precision, backend=backend, max_consecutive_skips=max_skips, **low_precision),
            *_cluster_environments(trainer_config.get("plugins")),  # SLURM, LSF, ...: passed through
        ]
        if trainer_config.get("logger") in (None, True):
            kwargs["logger"] = CSVLogger(save_dir=trainer_config.get("default_root_dir") or ".", name="logs")
        # The step bar replaces Lightning's epoch bar (which reads "Epoch 0/-2" with max_steps), unless
        # the bar is disabled or the user passed a progress bar of their own.
        callbacks = trainer_config.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        if trainer_config.get("enable_progress_bar") is not False and not any(
            isinstance(c, ProgressBar) for c in callbacks
        ):
            kwargs["callbacks"] = [*kwargs.get("callbacks", []), *callbacks, default_progress_bar()]
        if str(trainer_config.get("accelerator", "cpu")) == "cpu" and self._cpu_threads_default is not None:
            self._cpu_threads_default()
        trainer = super().instantiate_trainer(**kwargs)
        # ``deterministic: true`` turns on torch's deterministic algorithms, which by default also
        # fill every new tensor with NaN so that a read of uninitialised memory shows up; nothing
        # here reads uninitialised memory (bitwise resume is tested), and the fill cost 5-20 % of a
        # CPU step, more for the emulation's temporaries (docs/performance.md). Recorded in
        # run_summary.json ``determinism``.
        import torch

        torch.utils.deterministic.fill_uninitialized_memory = False
        return trainer


class _ParseOnlyCLI(LPLightningCLI):
    @override
    def _set_seed(self) -> None:
        """Parsing only: the global RNGs are left alone (and no "Seed set to" line is printed)."""

    @override
    def instantiate_classes(self) -> None:
        """Parsing and validation only: no model, datamodule or Trainer is created."""


def parse_config(args: Sequence[str] = ()) -> Namespace:
    """Parses and validates ``lp-lightning fit`` options without instantiating anything or seeding.

    Useful to check a YAML before launching a job (``parse_config(["--config", path])``). Argument
    errors exit like the CLI (``SystemExit(2)`` with the message on stderr).

    Args:
        args: Options as on the command line, without the ``fit`` subcommand.

    Returns:
        The parsed configuration namespace (``config.model.lr``, ``config.fsdp_config`` ...).
    """
    return _ParseOnlyCLI(args=list(args), run=False).config


def plan_settings(path: str, options: Sequence[str] = ()) -> dict[str, Any]:
    """What ``lp-lightning plan --config`` takes from an ``lp-lightning fit`` YAML (docs/planner.md).

    The YAML and ``options`` (fit options such as ``--trainer.devices 2``) are parsed as
    :func:`parse_config` does (a bad file exits with status 2); the world size and batch geometry are
    checked as ``fit`` checks them at launch; nothing is built.

    Returns:
        ``spec``, ``precision``, ``world_size`` (``trainer.devices x num_nodes``, else
        ``fsdp_config.dp_shard_size``), ``seq_len``, ``global_batch_size``, ``accumulate_grad_batches``,
        ``micro_batch_size`` (``global_batch_size // (accumulate_grad_batches x world_size)``, the
        micro batch ``fit`` runs), ``activation_checkpoint``, ``reshard_after_forward``,
        ``fallback_to_unsharded``, ``input_dim_sharding``, ``config_overrides``; a world size the
        YAML leaves open (``devices: auto``, no ``dp_shard_size``) is left out, and so is the micro batch.

    Raises:
        ValueError: ``fsdp_config.dp_shard_size`` differs from the world size, or the global batch does
            not split over accumulation x world size (the messages of ``fit``).
    """
    config = parse_config(["--config", path, *options])
    fsdp, trainer, data = config.fsdp_config, config.trainer, config.data
    launched = launch_world_size(trainer)
    if launched is not None:
        FSDP2Config(**fsdp.as_dict()).resolve_dp_shard_size(launched)  # as the launch check of fit
    world_size = launched or fsdp.dp_shard_size
    accumulation = trainer.get("accumulate_grad_batches") or 1
    settings = {
        "spec": config.model.config_name_or_path,
        "precision": config.precision,
        "seq_len": data.seq_len,
        "global_batch_size": data.global_batch_size,
        "accumulate_grad_batches": accumulation,
        "activation_checkpoint": config.model.activation_checkpoint,
        "reshard_after_forward": fsdp.reshard_after_forward,
        "fallback_to_unsharded": fsdp.fallback_to_unsharded,
        "input_dim_sharding": fsdp.input_dim_sharding,
        "config_overrides": config.model.config_overrides,
    }
    if world_size is not None:
        check_batch_geometry(data.global_batch_size, accumulation, world_size)
        settings["world_size"] = world_size
        settings["micro_batch_size"] = data.global_batch_size // (accumulation * world_size)
    return settings
