"""The parity suite: N seeds x {bf16, mxfp8, hif8} against BF16's own noise floor (issue 25).

Every run is the real CLI on ``configs/dsv3_tiny.yaml`` at a given width (``suite.training.overrides_for``)
and step count, on a given corpus (default: the works of Shakespeare, ``benchmarks/data/shakespeare.tar.xz``,
unpacked offline into the token-cache folder), one process each, validation every ``--val-every`` steps
on the fixed validation batches, checkpoints off. Per seed ``S`` (``seed_everything``, ``model.seed`` and
``data.seed`` all ``S``) it runs each precision and one **noise-floor** run: bf16 with a perturbation
that should not matter (``--noise eps``: AdamW eps x (1 + 1e-2); ``--noise data_order``: ``data.seed``
S + 1000, the same validation tokens). ``--variant NAME=PRECISION ARGS`` adds a run per seed with extra
fit arguments (e.g. a ``--plan_overrides`` file keeping some modules in BF16).

The figures (``lp_lightning.st.parity``): per seed and variant the gap to bf16 in % of the last-50-step
mean training loss and of the final validation loss, and the same gaps in units of the noise floor
(the RMS over seeds of the noise-floor run's gap), the gap per 50-step window (does it grow?), and
overall the mean and worst gap. Output: one JSON object on stdout and in ``--results``, the plot
``--plot`` (smoothed curves; gap with the noise band and +-2 %), the table between the
``<!-- parity:begin -->`` / ``<!-- parity:end -->`` markers of ``--doc`` (``--markers NAME``: other ones).

Runs go ``--jobs`` at a time (default 2, ``OMP_NUM_THREADS`` = cores / jobs each); losses do not depend
on it (deterministic runs), and each run records its wall time, threads and the load average at its
start and end. A finished run whose ``command.txt`` is the same is reused (``--rerun`` to redo),
so an interrupted suite continues where it stopped::

    python benchmarks/parity.py                                   # hidden 512, 300 steps, seeds 0 1 2 (~1 h on 2 cores)
    python benchmarks/parity.py --width 256 --steps 30 --seeds 0 --results /tmp/p.json --plot /tmp/p.png --doc ''
    python benchmarks/parity.py --analyse-only                    # re-read the runs, re-render
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import sys
import tarfile
import time
import uuid
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # suite/ and this checkout's lp_lightning
from suite.common import load_average, machine  # noqa: E402
from suite.report import insert_between_markers  # noqa: E402
from suite.training import REPO, cli_env, overrides_for, run_cli  # noqa: E402

from lp_lightning.st import parity  # noqa: E402

CORPUS_ARCHIVE = _HERE / "data" / "shakespeare.tar.xz"
NOISE_EPS_FACTOR = 1.0 + 1e-2
DATA_ORDER_OFFSET = 1000


@dataclasses.dataclass(frozen=True)
class Variant:
    """One run per seed: ``name`` (its folder), ``precision`` and extra fit arguments."""

    name: str
    precision: str
    args: tuple[str, ...] = ()


def corpus_folder(archive: Path = CORPUS_ARCHIVE, cache: Path | None = None) -> Path:
    """Unpacks ``archive`` once into ``<cache>/<stem>-<sha12>/`` (atomic rename; default cache
    ``$XDG_CACHE_HOME/lp_lightning/corpora``) and returns that folder."""
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()[:12]
    root = cache or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lp_lightning" / "corpora"
    target = root / f"{archive.name.split('.')[0]}-{digest}"
    if not target.is_dir():
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        tmp.mkdir(parents=True)
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        try:
            tmp.rename(target)
        except OSError:  # another process unpacked it first
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def base_eps() -> float:
    """``model.eps`` of configs/dsv3_tiny.yaml (the noise-floor run multiplies it)."""
    import yaml

    return float(yaml.safe_load((REPO / "configs" / "dsv3_tiny.yaml").read_text())["model"]["eps"])


def variants(precisions: list[str], noise: str, extra: list[str]) -> list[Variant]:
    """The precisions, the noise-floor run (``bf16_noise``) and the ``--variant`` runs, in that order."""
    out = [Variant(p, p) for p in precisions]
    if noise == "eps":
        out.append(Variant(parity.NOISE_VARIANT, "bf16", ("--model.eps", f"{base_eps() * NOISE_EPS_FACTOR:.6g}")))
    elif noise == "data_order":
        out.append(Variant(parity.NOISE_VARIANT, "bf16", ("--data.seed", "+offset")))
    for spec in extra:
        name, _, rest = spec.partition("=")
        words = shlex.split(rest)
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or not words or words[0] not in parity.PRECISIONS:
            raise ValueError(f"--variant {spec!r}: use NAME=PRECISION [fit args...], NAME of letters, digits, '_', "
                             f"'.' or '-', PRECISION one of {', '.join(parity.PRECISIONS)}.")
        if name in {v.name for v in out}:
            raise ValueError(f"--variant {spec!r}: the name {name!r} is taken (bf16, mxfp8, hif8, {parity.NOISE_VARIANT} "
                             "and earlier variants); choose another.")
        out.append(Variant(name, words[0], tuple(words[1:])))
    return out


def check_options(args: argparse.Namespace) -> list[str]:
    """Every problem of the options, one line each (the suite would otherwise fail after starting runs)."""
    problems = []
    if len(set(args.seeds)) != len(args.seeds) or any(not 0 <= s < 2**32 for s in args.seeds):
        problems.append(f"--seeds {' '.join(map(str, args.seeds))}: name different seeds in [0, 2^32).")
    if args.last < 1 or args.steps < args.last:
        problems.append(f"--last {args.last} must be in [1, --steps {args.steps}] (the training-loss mean's steps).")
    if args.window < 1 or args.val_every < 1 or args.steps % args.val_every:
        problems.append(f"--steps {args.steps} must be a multiple of --val-every {args.val_every} (>= 1: the final "
                        f"validation is at the last step), --window {args.window} >= 1.")
    if args.jobs < 1 or (args.threads is not None and args.threads < 1):
        problems.append(f"--jobs {args.jobs} and --threads {args.threads} must be >= 1.")
    try:
        overrides_for(args.width)
    except ValueError as err:
        problems.append(f"--width {err}")
    if args.corpus is not None and not args.corpus.exists():
        problems.append(f"--corpus {args.corpus}: no such file or folder (a data.sources file or folder).")
    if args.doc:
        markers = (f"<!-- {args.markers}:begin -->", f"<!-- {args.markers}:end -->")
        if not Path(args.doc).is_file() or not all(m in Path(args.doc).read_text() for m in markers):
            problems.append(f"--doc {args.doc}: needs the lines {markers[0]} and {markers[1]} (or --doc '' for none).")
    try:
        variants(args.precisions, args.noise, args.variant)
    except ValueError as err:
        problems.append(str(err))
    return problems


def fit_command(run_dir: Path, variant: Variant, seed: int, args: argparse.Namespace, sources: Path) -> list[str]:
    """The ``lp-lightning fit`` command of one (variant, seed)."""
    extra = [str(seed + DATA_ORDER_OFFSET) if a == "+offset" else a for a in variant.args]
    command = [
        sys.executable, "-m", "lp_lightning.cli", "fit", "--config", str(REPO / "configs" / "dsv3_tiny.yaml"),
        "--precision", variant.precision, "--trainer.devices", "1", "--trainer.max_steps", str(args.steps),
        "--trainer.default_root_dir", str(run_dir), "--trainer.enable_progress_bar", "false",
        "--trainer.val_check_interval", str(args.val_every), "--data.val_batches", str(args.val_batches),
        "--checkpoint.every_n_steps", "0", "--checkpoint.save_last", "false", "--overwrite", "true",
        "--seed_everything", str(seed), "--model.seed", str(seed), "--data.seed", str(seed),
        "--data.sources", json.dumps([str(sources)]),
    ]  # fmt: skip
    overrides = overrides_for(args.width)
    if overrides is not None:
        command += ["--model.config_overrides", json.dumps(overrides), "--model.validate_spec", "false"]
    return command + list(args.fit_arg) + extra


def run_one(run_dir: Path, command: list[str], threads: int, rerun: bool) -> dict[str, Any]:
    """Runs (or reuses) one fit; writes and returns its ``parity_run.json`` record."""
    record_path = run_dir / "parity_run.json"
    if not rerun and record_path.is_file() and (run_dir / "command.txt").is_file():
        if (run_dir / "command.txt").read_text() == shlex.join(command):
            return {**json.loads(record_path.read_text()), "reused": True}
    start_load, start = load_average(), time.perf_counter()
    summary = run_cli(command, run_dir, cli_env(threads), timeout_s=6 * 3600.0)
    record = {"wall_s": round(time.perf_counter() - start, 1), "load_average_start": start_load,
              "load_average_end": load_average(), "threads": summary.get("threads"),
              "step_time_s_steady_median": summary.get("step_time_s_steady_median")}
    record_path.write_text(json.dumps(record, indent=1))
    return {**record, "reused": False}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512, help="hidden size (256 x a power of two)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--precisions", nargs="+", default=list(parity.PRECISIONS), choices=parity.PRECISIONS)
    parser.add_argument("--noise", choices=("eps", "data_order", "none"), default="eps",
                        help="the noise-floor run's perturbation of bf16")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=PRECISION ARGS",
                        help="an extra run per seed, e.g. 'mxfp8_attn_bf16=mxfp8 --plan_overrides f.yaml'")
    parser.add_argument("--fit-arg", action="append", default=[], help="an argument added to every fit command")
    parser.add_argument("--corpus", type=Path, default=None,
                        help="a data.sources file or folder (default: the Shakespeare archive, unpacked offline)")
    parser.add_argument("--corpus-cache", type=Path, default=None,
                        help="where the archive is unpacked (default: $XDG_CACHE_HOME or ~/.cache, lp_lightning/corpora)")
    parser.add_argument("--val-every", type=int, default=50, help="trainer.val_check_interval (steps)")
    parser.add_argument("--val-batches", type=int, default=16, help="data.val_batches (fixed validation tokens)")
    parser.add_argument("--last", type=int, default=parity.LAST_STEPS, help="steps of the training-loss mean")
    parser.add_argument("--window", type=int, default=parity.LAST_STEPS, help="steps of each window of the gap-per-window figure")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS per run (default: cores / jobs)")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: runs/parity/w<width>_s<steps>")
    parser.add_argument("--results", type=Path, default=_HERE / "parity.json")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "parity.png")
    parser.add_argument("--doc", type=str, default=str(REPO / "docs" / "numerics.md"),
                        help="markdown file with the markers ('' = none)")
    parser.add_argument("--markers", default="parity",
                        help="the table goes between <!-- NAME:begin --> and <!-- NAME:end --> of --doc")
    parser.add_argument("--rerun", action="store_true", help="run again even where a finished run matches")
    parser.add_argument("--analyse-only", action="store_true", help="read the runs already there, run nothing")
    args = parser.parse_args(argv)
    problems = check_options(args)
    if problems:
        parser.error("\n".join(problems))

    work = args.work_dir or REPO / "runs" / "parity" / f"w{args.width}_s{args.steps}"
    sources = args.corpus.resolve() if args.corpus else corpus_folder(cache=args.corpus_cache)
    plan = [(seed, v) for seed in args.seeds for v in variants(args.precisions, args.noise, args.variant)]
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, args.jobs))
    load_start, start = load_average(), time.perf_counter()
    records: dict[tuple[int, str], dict[str, Any]] = {}
    if not args.analyse_only:
        # longest first within a seed: the 8-bit runs take about twice bf16's time on the CPU emulation
        order = sorted(plan, key=lambda sv: (sv[0], sv[1].precision == "bf16"))
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = {}
            for seed, v in order:
                run_dir = work / f"seed{seed}" / v.name
                futures[pool.submit(run_one, run_dir, fit_command(run_dir, v, seed, args, sources), threads,
                                    args.rerun)] = (seed, v.name)
            failed = []
            for future in concurrent.futures.as_completed(futures):
                seed, name = futures[future]
                try:
                    records[(seed, name)] = future.result()
                except RuntimeError as err:  # the fit failed: say which and where its log is, after the others
                    failed.append(f"parity: seed {seed} {name} failed; {work / f'seed{seed}' / name / 'console.log'} "
                                  f"ends:\n{str(err).split('console.log ends:', 1)[-1].strip()[-1500:]}")
                    continue
                print(f"parity: seed {seed} {name} done ({records[(seed, name)]['wall_s']} s"
                      f"{', reused' if records[(seed, name)]['reused'] else ''})", file=sys.stderr, flush=True)
        if failed:
            print("\n".join(failed), file=sys.stderr)
            return 1
    for seed, v in plan:  # --analyse-only: each run's own record (wall time, threads, load)
        record_path = work / f"seed{seed}" / v.name / "parity_run.json"
        if (seed, v.name) not in records and record_path.is_file():
            records[(seed, v.name)] = {**json.loads(record_path.read_text()), "reused": True}
    runs = {(seed, v.name): parity.load_parity_run(work / f"seed{seed}" / v.name) for seed, v in plan}
    for (seed, name), record in records.items():  # the software each run was made with
        summary = json.loads((work / f"seed{seed}" / name / "run_summary.json").read_text())
        record["git_commit"] = (summary.get("versions") or {}).get("git_commit")
    result = parity.analyse(runs, last=args.last, window=args.window)
    result["settings"] = {
        "width": args.width, "steps": args.steps, "seeds": args.seeds, "precisions": args.precisions,
        "noise": args.noise, "noise_eps_factor": NOISE_EPS_FACTOR if args.noise == "eps" else None,
        "variants": [dataclasses.asdict(v) for _, v in plan[: len(plan) // len(args.seeds)]],
        "corpus": str(args.corpus) if args.corpus else f"{CORPUS_ARCHIVE.relative_to(REPO)} (unpacked to {sources})",
        "val_every": args.val_every, "val_batches": args.val_batches, "analysed_only": args.analyse_only, "jobs": args.jobs, "threads_per_run": threads,
        "fit_args": args.fit_arg, "work_dir": str(work),
    }
    result["runs"] = {f"seed{s}/{n}": rec for (s, n), rec in sorted(records.items())}
    result["machine"] = machine(load_start)
    result["elapsed_s"] = round(time.perf_counter() - start, 1)
    if args.analyse_only and args.results.is_file():  # the runs were measured earlier: keep that machine block
        earlier = json.loads(args.results.read_text())
        result["machine"], result["elapsed_s"] = earlier.get("machine", result["machine"]), earlier.get("elapsed_s")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n")
    parity.plot(runs, result, args.plot)
    if args.doc:
        doc = Path(args.doc)
        insert_between_markers(doc, parity.markdown(result, plot=args.plot, doc=doc),
                               f"<!-- {args.markers}:begin -->", f"<!-- {args.markers}:end -->")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
