"""``lp-lightning st``: the acceptance harness (design spec §16.6, §17).

Runs the cases ``bf16``, ``mxfp8`` and ``hif8_current`` through the production ``lp-lightning fit``
with the same YAML (same seed, data order and effective batch), the Q3-01…Q3-11 matrix on top of it
(:mod:`lp_lightning.st.cases`), the design spec §15 illegal configurations
(:mod:`lp_lightning.st.illegal`) and the layered numerics (:mod:`lp_lightning.st.numerics`), then
writes the report (:mod:`lp_lightning.st.report`)::

    lp-lightning st --config configs/dsv3_tiny.yaml --out runs/st           # 2 CPU processes, emulated
    lp-lightning st --config configs/dsv3_16b_bf16.yaml --out runs/st16b   # the YAML's 8 NPUs (docs/acceptance.md)

Exit status: 0 when no row fails (``pass`` or ``not-applicable``), 1 when a row fails, 2 for a
bad option or config (the message names the option), 130 after Ctrl-C and 143 after a SIGTERM (the
running ``fit`` processes are stopped first; one line on stderr, no traceback).

Usage rules (exit 2 otherwise): ``--rows`` and ``--cases`` not empty; ``--cases`` holds every case
the selected rows read, ``--required_steps`` >= 20 and ``--steady_steps`` >= ``--required_steps``
(design spec §17.2/§17.4), unless ``--reduced true`` marks a smoke run (the report says so);
``--devices`` >= 1 (with 1 process the FSDP rows Q3-05…Q3-08 are ``not-applicable`` unless a check
fails); ``--out`` is a folder; ``--reuse_runs true`` needs runs under ``--out`` made with the same
``run.yaml`` and user YAML (each reused run is logged and marked ``reused`` in ``report.json``);
``--parity_seeds`` distinct and ``--parity_steps`` >= 2 (the opt-in ``parity`` row, :mod:`lp_lightning.st.parity_row`);
``--thresholds`` names a valid thresholds YAML (:mod:`lp_lightning.st.thresholds`; every problem is
listed); an NPU numerics target (the YAML's ``trainer.accelerator npu``) needs an importable torch_npu; a YAML
with ``backend: emulated`` on the npu accelerator needs ``--allow_emulated true``
(:mod:`lp_lightning.st.target`).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from jsonargparse import ArgumentParser

from lp_lightning.usage import usage_error_text
from lp_lightning.models.adapter import adapter_for_config
from lp_lightning.st.conformance_row import conformance_rows
from lp_lightning.st.cases import (
    CASES, OPT_IN_ROWS, ROW_RUNS, ParitySettings, STSettings, build_runs, case_by_name, cases_for_rows, parity_runs,
    runs_for_rows,
)
from lp_lightning.st.illegal import run_illegal_cases
from lp_lightning.st.parity_row import parity_rows
from lp_lightning.st.numerics import one_layer_comparison, operator_numerics, plot_one_layer, plot_operator_numerics
from lp_lightning.st.report import short_run_checks, write_report
from lp_lightning.st.rows import Row, evaluate_rows
from lp_lightning.st.runner import RunResult, execute_run, load_run, reuse_mismatch
from lp_lightning.st.target import check_target_device, emulated_on_npu_error, run_target
from lp_lightning.st.thresholds import BUILTIN_THRESHOLDS, Thresholds, load_thresholds, mark_provisional
from lp_lightning.versions import software_versions

__all__ = ["build_parser", "st_main"]

PARTS = ("runs", "illegal", "numerics")


class _Parser(ArgumentParser):
    """``lp-lightning st``'s parser: a usage error is its message and a pointer to ``--help`` (no usage dump);
    options are never abbreviated."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        sys.stderr.write(usage_error_text(self.prog, message))
        self.exit(2)


def build_parser() -> ArgumentParser:
    """The options of ``lp-lightning st``."""
    parser = _Parser(prog="lp-lightning st", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=str | None, default=None,
                        help="The lp-lightning fit YAML every run starts from (default: the embedded dsv3-tiny).")
    parser.add_argument("--out", type=str, default="runs/st", help="Output folder of the runs and the report.")
    defaults = STSettings()
    parser.add_argument("--devices", type=int | None, default=None,
                        help="Processes (FSDP2 ranks) of every run, >= 1 (default: the YAML's trainer.devices, at "
                             "least 2); with 1 the FSDP rows Q3-05..Q3-08 are not-applicable.")
    for name, help_text in (
        ("warmup_steps", "Steps left out of the performance figures."),
        ("steady_steps", "Steps measured after warm-up (design spec §17.4: at least 20)."),
        ("resume_steps", "Steps after the checkpoint in Q3-09 (the checkpoint is at warmup+steady-resume)."),
        ("variant_steps", "Optimizer steps of the reshard, recompute and accumulation runs."),
        ("accumulation", "accumulate_grad_batches of the accumulation runs (> 1)."),
        ("profile_steps", "Steps profiled at the end of each resumed run (time shares)."),
        ("required_steps", "Steps the main runs and the steady window must reach for Q3-01/02/03/11."),
    ):
        parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name), help=help_text)
    parser.add_argument("--cases", type=list[str], default=[c.name for c in CASES],
                        help="Cases to run; must include every case the selected rows read (unless --reduced).")
    parser.add_argument("--rows", type=list[str], default=[r for r in ROW_RUNS if r not in OPT_IN_ROWS],
                        help="Q3 rows (and conformance: the backend against the emulation; parity, opt-in: loss parity "
                             "against bf16 and its noise floor) to evaluate; only the runs they need are run (default: "
                             "all but parity).")
    parity_defaults = ParitySettings()
    parser.add_argument("--parity_seeds", type=list[int], default=list(parity_defaults.seeds),
                        help="parity row: seeds; per seed a bf16, mxfp8, hif8_current and bf16-noise (AdamW eps x 1.01) run.")
    parser.add_argument("--parity_steps", type=int, default=parity_defaults.steps,
                        help="parity row: optimizer steps of each of its runs.")
    parser.add_argument("--skip", type=list[str], default=[], help=f"Parts to skip, of {list(PARTS)} (the rows that read them fail; "
                        "skipped numerics leave N-1/N-2 out).")
    parser.add_argument("--reuse_runs", type=bool, default=False,
                        help="Read the runs already under --out instead of running them again (re-report).")
    parser.add_argument("--reduced", type=bool, default=False,
                        help="A smoke run: allows --required_steps < 20, --steady_steps < --required_steps and a "
                             "--cases subset; the report is marked reduced (not an acceptance).")
    parser.add_argument("--run_timeout_s", type=float, default=3600.0, help="A run is killed after this long.")
    parser.add_argument("--allow_emulated", type=bool, default=False,
                        help="Run even though the YAML puts backend: emulated on the npu accelerator (stops otherwise: "
                             "the emulation cannot judge the NPU, docs/acceptance.md).")
    parser.add_argument("--thresholds", type=str | None, default=None,
                        help="YAML of the owner's tolerances (configs/st_thresholds.yaml; docs/acceptance.md "
                             "'Thresholds'); without it the built-ins are used and passes are provisional.")
    return parser


def _user_settings(
    config: str | None, parse_config: Callable[[Sequence[str]], Any]
) -> tuple[bool, int, dict[str, list[str]], tuple[Any, ...], dict[str, Any], float]:
    """The user YAML's reshard_after_forward, device count, model targets, never-replace rules, target meta and
    ``(AdamW eps, accumulate_grad_batches)``, after the CLI's checks (exit 2 if bad).

    ``parse_config`` is the fit config parser the entry point hands over (:func:`st_main`).
    """
    parsed = parse_config(["--config", config] if config else [])
    targets = model_targets(parsed.model.config_name_or_path, parsed.model.config_overrides)
    never_replace = model_never_replace(parsed.model.config_name_or_path)
    devices = parsed.trainer.devices  # the default: the matrix needs a sharded FSDP2 group
    devices = max(int(devices), 2) if str(devices).isdigit() else 2
    # the target of N-1/N-2 and conformance; _st checks emulated_on_npu before any run
    meta = {"config": config or "embedded default (dsv3-tiny)",
            **run_target(parsed.trainer.accelerator, parsed.get("backend")).as_meta()}
    meta_eps = (float(parsed.model.eps), int(parsed.trainer.get("accumulate_grad_batches") or 1))
    return bool(parsed.fsdp_config.reshard_after_forward), devices, targets, never_replace, meta, meta_eps


def model_targets(config_name_or_path: str, overrides: dict[str, Any] | None) -> dict[str, list[str]]:
    """The design spec §1.1 targets of the model, found by its adapter from its structure (not from the plan).

    Q3-02/03/04 compare the replacement report with this list, so a plan that leaves a target out
    fails there. Groups (DeepSeek-V3): ``mla``, ``dense_mlp``, ``shared_experts``, ``routed_experts``
    (:meth:`~lp_lightning.models.adapter.ModelAdapter.target_groups`).
    """
    adapter = adapter_for_config(config_name_or_path)
    return adapter.target_groups(adapter.build_meta_model(config_name_or_path, config_overrides=overrides))


def model_never_replace(config_name_or_path: str) -> tuple[Any, ...]:
    """The model adapter's never-replace rules (design spec §1.1), which Q3-04 checks the GEMM trace against."""
    return tuple(adapter_for_config(config_name_or_path).never_replace)


def _log(message: str) -> None:
    print(f"[lp-lightning st] {message}", file=sys.stderr, flush=True)


def _numerics(out: Path, meta: dict[str, Any], thresholds: Thresholds) -> tuple[dict[str, Any], list[Row]]:
    """N-1/N-2 on the run's device and backend (``meta["target"]``, :mod:`lp_lightning.st.target`)."""
    target = {"device": meta["target"]["device"], "backend": meta["target"]["backend"]}
    operators = operator_numerics(**target, thresholds=thresholds)
    one_layer = one_layer_comparison(**target, thresholds=thresholds)
    plot_operator_numerics(operators, out / "operator_numerics.png")
    plot_one_layer(one_layer, out / "one_layer.png")
    n1 = Row("N-1", evidence={"device": target["device"], "backends": sorted({e["backend"] for e in operators})})
    for entry in operators:
        thresholds.get(n1, "operator_sqnr_floor_db", entry["precision"], entry["role"])  # the floor it read
        n1.check(
            f"{entry['operator']} {entry['format']} {entry['tensor']} ({entry['role']})",
            bool(entry["pass"]),
            f"SQNR {float(entry['sqnr_db']):.2f} dB, nonfinite {entry['nonfinite']}",
            f">= {entry['sqnr_floor_db']} dB ({entry['threshold']}), nonfinite 0",
        )
    n2 = Row("N-2", evidence={"device": target["device"], "backends": sorted(
        {b for case in one_layer["cases"].values() for b in case["gemm_backends"]})})
    for precision, comparison in (one_layer.get("comparisons") or {}).items():
        for role in comparison["bands"]["sqnr_floors_db"]:  # the floors its bands derive from
            thresholds.get(n2, "one_layer_sqnr_floor_db", precision, role)
        bands = comparison.get("bands", {})
        n2.check(f"{precision}: one-step loss within the band of bf16", bool(comparison.get("loss_pass")),
                 f"rel {float(comparison.get('loss_rel_diff', 'nan')):.2e}", f"<= {float(bands.get('loss_rel_band', 'nan')):.3g}")
        n2.check(f"{precision}: grad norm within the band of bf16", bool(comparison.get("grad_norm_pass")),
                 f"rel {float(comparison.get('grad_norm_rel_diff', 'nan')):.2e}",
                 f"<= {float(bands.get('grad_norm_rel_band', 'nan')):.3g}")
        n2.check(f"{precision}: key gradients against bf16", bool(comparison.get("gradients_pass")),
                 {fqn: g.get("sqnr_db") for fqn, g in (comparison.get("gradients") or {}).items() if g.get("checked")},
                 f"SQNR >= {float(bands.get('gradient_sqnr_floor_db', 'nan')):.2f} dB, "
                 f"cosine >= {float(bands.get('gradient_cosine_floor', 'nan')):.3f}")
    if not n2.checks:
        n2.check("one-layer comparison ran", False, "no comparisons", "mxfp8 and hif8 against bf16")
    numerics = {
        "operators": operators,
        "one_layer": one_layer,
        "target": target,
        "plots": {"operator_numerics": "operator_numerics.png", "one_layer": "one_layer.png"},
    }
    return numerics, [n1, n2]


class _Terminated(Exception):
    """A SIGTERM reached ``lp-lightning st`` (raised by its handler, so the running ``fit`` is stopped)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated


def st_main(
    argv: Sequence[str] | None = None,
    *,
    parse_config: Callable[[Sequence[str]], Any],
    fit_main: Callable[[Sequence[str]], int],
) -> int:
    """Runs the acceptance and writes the report; returns the exit status (see the module docstring).

    Ctrl-C and SIGTERM stop the running ``fit`` processes (:func:`lp_lightning.st.runner.execute_run`)
    and end with one line on stderr and status 130 / 143.

    Args:
        argv: The ``lp-lightning st`` options; ``None`` reads ``sys.argv[1:]``.
        parse_config: Parses and checks ``lp-lightning fit`` options without building anything
            (the entry point passes :func:`lp_lightning.cli.fit.parse_config`): reads the user YAML.
        fit_main: The ``lp-lightning`` entry point (:func:`lp_lightning.cli.main`): the illegal
            configurations run ``fit_main(["fit", ...])`` (:mod:`lp_lightning.st.illegal`). The
            harness never imports the CLI; the entry point hands both over.
    """
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        return _st(argv, parse_config, fit_main)
    except KeyboardInterrupt:
        print("lp-lightning st: interrupted (Ctrl-C); its runs were stopped, the folders under --out are incomplete.",
              file=sys.stderr)
        return 130
    except _Terminated:
        print("lp-lightning st: stopped by SIGTERM; its runs were stopped, the folders under --out are incomplete.",
              file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _check_options(args: Any) -> tuple[STSettings, tuple[Any, ...], set[str]]:
    """The settings, cases and needed run names of valid options (before the YAML is read: ``devices``
    is 2 when ``--devices`` is not given; the caller puts the YAML's in).

    Raises:
        ValueError: every option breaking a usage rule (module docstring), one line each, naming it.
    """
    problems: list[str] = []  # every broken rule at once, one line each
    for option in ("rows", "cases"):
        if not args[option]:
            choices = list(ROW_RUNS) if option == "rows" else [c.name for c in CASES]
            problems.append(f"--{option} is empty; name at least one of {choices} (or leave it out for all).")
    values = {k: args[k] for k in STSettings.__dataclass_fields__ if k != "devices"}
    settings = cases = needed = None
    try:
        settings = STSettings(devices=2 if args.devices is None else args.devices, **values)
    except ValueError as err:
        problems += str(err).splitlines()
    try:
        cases = tuple(case_by_name(name) for name in args.cases)
    except ValueError as err:
        problems.append(str(err))
    try:
        ParitySettings(seeds=tuple(args.parity_seeds), steps=args.parity_steps)
    except ValueError as err:
        problems += str(err).splitlines()
    unknown = sorted(set(args.skip) - set(PARTS))
    if unknown:
        problems.append(f"--skip {unknown}: unknown part; parts: {list(PARTS)}.")
    try:
        needed = runs_for_rows(args.rows)
        missing = {row: sorted(need - set(args.cases)) for row, need in cases_for_rows(args.rows).items()}
    except ValueError as err:
        problems.append(str(err))
        missing = {}
    missing = {row: left for row, left in missing.items() if left}
    if missing and args.cases and not args.reduced:
        rows = ", ".join(f"{row} ({', '.join(left)})" for row, left in missing.items())
        problems.append(f"--cases {list(args.cases)} leaves out cases these --rows read: {rows}. Add them to "
                        "--cases, drop the rows, or pass --reduced true (smoke run).")
    if problems:
        raise ValueError("\n".join(problems))
    assert settings is not None and cases is not None and needed is not None
    if set(args.rows) >= set(ROW_RUNS) - set(OPT_IN_ROWS):  # the full report: §17.4 also compares the bf16 variants
        needed |= {f"{kind}/bf16" for kind in ("reshard", "recompute")}
    return settings, cases, needed


def _reused_runs(out: Path, specs: list[Any], settings: STSettings, config: Path | None) -> set[str]:
    """Names of the runs ``--reuse_runs`` reads from ``out`` (checked against the current options).

    Raises:
        ValueError: no run under ``out``, or a run made with another ``run.yaml``/user YAML.
    """
    found = {spec.name for spec in specs if (out / "runs" / spec.name / "run_summary.json").is_file()}
    if not found:
        raise ValueError(f"--reuse_runs true: no run of the selected rows under {out / 'runs'} (no run_summary.json); "
                         "check --out, or run without --reuse_runs.")
    for spec in specs:
        if spec.name in found:
            why = reuse_mismatch(spec, out / "runs" / spec.name, settings, config)
            if why:
                raise ValueError(f"--reuse_runs true: runs/{spec.name} was made with other options, {why}. Rerun "
                                 "without --reuse_runs or use another --out.")
    return found


def _st(
    argv: Sequence[str] | None, parse_config: Callable[[Sequence[str]], Any], fit_main: Callable[[Sequence[str]], int]
) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out {str(out)!r} is a file; name a folder (created if missing) for the runs and the report.")
    problems = []  # the options' and the thresholds file's, in one error
    try:
        settings, cases, needed = _check_options(args)
    except ValueError as err:
        problems.append(str(err))
    try:
        thresholds = load_thresholds(args.thresholds) if args.thresholds else BUILTIN_THRESHOLDS
    except ValueError as err:
        problems.append(str(err))
    if problems:
        parser.error("\n".join(problems))
    reshard_after_forward, devices, targets, never_replace, meta, (eps, accumulate) = _user_settings(
        args.config, parse_config)
    if error := emulated_on_npu_error(meta["target"]["emulated_on_npu"], args.allow_emulated):
        parser.error(error)
    if args.devices is None:
        settings = dataclasses.replace(settings, devices=devices)
    config = Path(args.config).resolve() if args.config else None
    specs = [s for s in build_runs(settings, reshard_after_forward=reshard_after_forward, cases=cases)
             if s.name in needed and "runs" not in args.skip]
    parity = ParitySettings(seeds=tuple(args.parity_seeds), steps=args.parity_steps, eps=eps, accumulate=accumulate)
    if "parity" in args.rows and "runs" not in args.skip:
        specs += parity_runs(parity)
    try:
        reused = _reused_runs(out, specs, settings, config) if args.reuse_runs else set()
    except ValueError as err:
        parser.error(str(err))
    try:  # an NPU target without torch_npu stops before any run, numerics or conformance uses the device
        if "numerics" not in args.skip or "conformance" in args.rows or any(s.name not in reused for s in specs):
            check_target_device(meta["target"]["device"])
    except RuntimeError as err:
        parser.error(str(err))
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    runs: dict[str, RunResult] = {}
    for spec in specs:
        folder = out / "runs" / spec.name
        if spec.name in reused:
            runs[spec.name] = load_run(spec, folder, exit_code=0)
            runs[spec.name].reused = True
            _log(f"{spec.name}: reused (--reuse_runs) from {folder}")
            continue
        resume = None
        if spec.resume_from is not None:
            source = runs.get(spec.resume_from)
            if source is None or not source.ok:
                _log(f"{spec.name}: skipped, {spec.resume_from} did not finish")
                continue
            resume = source.checkpoint(settings.save_step)
        _log(f"{spec.name}: running ({spec.max_steps} steps, {settings.devices} processes)")
        result = execute_run(spec, out, user_config=config, settings=settings, resume_checkpoint=resume,
                             timeout_s=args.run_timeout_s)
        runs[spec.name] = result
        _log(f"{spec.name}: {'ok' if result.ok else 'FAILED'} in {result.seconds:.0f} s"
             + ("" if result.ok else f"\n{result.error}"))
    illegal = None
    if "illegal" not in args.skip and "Q3-10" in args.rows:
        _log("illegal configurations (design spec §15): running")
        illegal = run_illegal_cases(out / "illegal", fit_main=fit_main)
        _log(f"illegal configurations: {sum(bool(c.get('pass')) for c in illegal)}/{len(illegal)} as specified")
    numerics: dict[str, Any] = {}
    numerics_rows: list[Row] = []
    if "numerics" not in args.skip:
        _log("layered numerics (design spec §17.3.2): running")
        numerics, numerics_rows = _numerics(out, meta, thresholds)
    if all(f"main/{c.name}" in runs for c in CASES):
        numerics_rows.append(short_run_checks(runs, settings, thresholds=thresholds))
    rows = evaluate_rows(runs, settings, illegal=illegal, reshard_after_forward=reshard_after_forward,
                         targets=targets, never_replace=never_replace, only=args.rows, thresholds=thresholds)
    rows += conformance_rows(out, meta, args.rows)  # docs/acceptance.md "Backend conformance"
    rows += parity_rows(runs, out, args.rows, parity, thresholds)  # docs/acceptance.md "Loss parity"
    mark_provisional([*rows, *numerics_rows], thresholds)
    meta.update(versions=software_versions(), seconds=round(time.perf_counter() - started, 1),
                user_reshard_after_forward=reshard_after_forward, skipped_parts=list(args.skip),
                cases=[c.name for c in cases], selected_rows=list(args.rows))
    report = write_report(out, rows=rows, runs=runs, settings=settings, numerics=numerics,
                          numerics_rows=numerics_rows, meta=meta, thresholds=thresholds)
    width = max(len(r.title) for r in [*rows, *numerics_rows])
    for row in [*rows, *numerics_rows]:
        print(f"{row.id:6} {row.title:{width}}  {row.shown_verdict}")
    print(f"report: {out / 'report.md'} ({json.dumps(report['summary'])})")
    failed = any(r.verdict == "fail" for r in [*rows, *numerics_rows])
    return 1 if failed else 0
