"""The ST cases and the runs of the Q3 matrix (design spec §16.6, §17.2).

A *case* is a precision (the spec's ``STCase``: ``bf16``, ``mxfp8``, ``hif8_current``); a *run* is one
``lp-lightning fit`` of a case with one configuration variant and the probes that collect its
evidence. Every run starts from the same user YAML (same seed, data order, global batch and sequence
length), so only the named dimension differs between runs:

==================  =========================================  ======================================
run                 variant (on top of the user's YAML)        evidence for
==================  =========================================  ======================================
``main/<case>``     ``steps`` optimizer steps (warm-up +       Q3-01/02/03 (loss, grad norm, kernels,
                    steady), a checkpoint after ``save_step``  scales), Q3-09 (the continuous run),
                                                               Q3-11 (step records, no heavy probe),
                                                               Q3-08 (the off run), §17.4 resident
                                                               objects and imported modules
``probe/<case>``    3 steps with the high-precision GEMM       Q3-02/03/04 (no fallback, the model
                    probe and every event sampled; a non-      boundary), low-precision cases only;
                    finite gradient injected at step 2         the skipped step (no refresh there)
``reshard/<case>``  ``reshard_after_forward`` flipped          Q3-05/06, §17.4 reshard delta
``recompute/<c>``   ``activation_checkpoint: full``            Q3-08 (against ``main/<case>``), §17.4
                                                               recompute delta
``accum/<case>``    ``accumulate_grad_batches: 2`` (same       Q3-07 (low-precision cases)
                    global batch)
``resume/<case>``   a fresh process resuming ``main/<case>``   Q3-01, Q3-09; profiler time shares
                    at ``save_step``, to ``steps``             (§17.4) on its last steps
==================  =========================================  ======================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CASES", "FSDP_ROWS", "INJECTED_STEP", "MIN_REQUIRED_STEPS", "OPT_IN_ROWS", "ROW_RUNS", "ParitySettings", "RunSpec",
    "STCase", "STSettings", "build_runs", "case_by_name", "cases_for_rows", "parity_runs", "runs_for_rows",
]

PROBES = "lp_lightning.telemetry.probe_callbacks"
MIN_REQUIRED_STEPS = 20
"""Steps a main run and its steady window must reach in an acceptance (design spec §17.2, §17.4)."""
INJECTED_STEP = 2
"""The step of each ``probe/<case>`` run whose gradient :class:`~lp_lightning.telemetry.InjectNonFiniteGradient`
makes non-finite: the guard skips it, so the run shows zero refreshes there and one per weight at steps 1 and 3."""
FSDP_ROWS = ("Q3-05", "Q3-06", "Q3-07", "Q3-08")
"""Rows about sharded weights: ``not-applicable`` (unless a check fails) with one process, which shards nothing."""


@dataclass(frozen=True)
class STCase:
    """One precision of the acceptance (design spec §16.6 ``STCase``).

    Attributes:
        name: ``"bf16"``, ``"mxfp8"`` or ``"hif8_current"``.
        precision: The ``--precision`` value of the run.
        low_precision: The long form of the choice (design spec §4.2), ``None`` for the BF16 baseline.
    """

    name: str
    precision: str
    low_precision: dict[str, Any] | None

    @property
    def is_low_precision(self) -> bool:
        return self.low_precision is not None


CASES: tuple[STCase, ...] = (
    STCase("bf16", "bf16", None),
    STCase("mxfp8", "mxfp8", {"enabled": True, "format": "mxfp8_e4m3", "scaling": "mx_block"}),
    STCase("hif8_current", "hif8", {"enabled": True, "format": "hif8", "scaling": "current"}),
)


def case_by_name(name: str) -> STCase:
    """The case called ``name``.

    Raises:
        ValueError: an unknown name, listing the cases.
    """
    for case in CASES:
        if case.name == name:
            return case
    raise ValueError(f"unknown ST case {name!r}; cases: {', '.join(c.name for c in CASES)}.")


@dataclass(frozen=True)
class STSettings:
    """Sizes of the acceptance runs (the CLI's ``--steps`` … options).

    Attributes:
        devices: Processes (FSDP2 ranks) of every run.
        warmup_steps: Steps left out of the performance figures (allocator, threads, compilation).
        steady_steps: Steps measured after warm-up (design spec §17.4: at least 20).
        resume_steps: Steps after the checkpoint (Q3-09: 5); the checkpoint is saved at
            ``warmup_steps + steady_steps - resume_steps``.
        variant_steps: Optimizer steps of the reshard / recompute / accumulation runs (Q3-05…08: 5).
        accumulation: ``accumulate_grad_batches`` of the accumulation runs (> 1).
        profile_steps: Steps the profiler records at the end of each resumed run.
        required_steps: Optimizer steps a main run and the steady window must reach (design spec
            §17.2/§17.4: at least :data:`MIN_REQUIRED_STEPS`); fewer measured steps make
            Q3-01/02/03/11 fail, not pass.
        reduced: A smoke run (``--reduced true``): allows ``required_steps`` below
            :data:`MIN_REQUIRED_STEPS` and ``steady_steps`` below ``required_steps`` (and, in
            ``lp-lightning st``, a ``--cases`` subset that leaves selected rows without some of their
            runs). The report says "reduced" in its header and ``settings``: it is not an acceptance.

    Raises:
        ValueError: counts out of range, one line each (all of them at once), naming the option
            (``--steady_steps`` ...) and the fix.
    """

    devices: int = 2
    warmup_steps: int = 5
    steady_steps: int = 20
    resume_steps: int = 5
    variant_steps: int = 5
    accumulation: int = 2
    profile_steps: int = 3
    required_steps: int = 20
    reduced: bool = False

    def __post_init__(self) -> None:
        problems: list[str] = []  # every bad count at once, one line each
        if not self.reduced and self.required_steps < MIN_REQUIRED_STEPS:
            problems.append(f"--required_steps {self.required_steps} is below the design spec §17.2/§17.4 minimum "
                             f"{MIN_REQUIRED_STEPS}; raise it, or pass --reduced true for a smoke run (report marked reduced).")
        if not self.reduced and self.steady_steps < self.required_steps:
            problems.append(f"--steady_steps {self.steady_steps} is below --required_steps {self.required_steps}: Q3-11 "
                             "could not pass; raise it, or pass --reduced true for a smoke run (report marked reduced).")
        if self.steady_steps < 1 or self.warmup_steps < 0:
            problems.append(f"steady_steps={self.steady_steps} must be >= 1 and warmup_steps={self.warmup_steps} >= 0.")
        if not 0 < self.resume_steps < self.steps:
            problems.append(f"resume_steps={self.resume_steps} must be in [1, {self.steps - 1}] (warmup + steady - 1).")
        if self.accumulation < 2:
            problems.append(f"accumulation={self.accumulation}: Q3-07 needs accumulate_grad_batches > 1.")
        if self.variant_steps < 1:
            problems.append(f"--variant_steps {self.variant_steps} must be >= 1.")
        if self.devices < 1:
            problems.append(f"--devices {self.devices} must be >= 1 (processes per run; the FSDP rows Q3-05..Q3-08 "
                             "need >= 2 and are not-applicable at 1).")
        if not 0 < self.profile_steps <= self.resume_steps:
            problems.append(f"profile_steps={self.profile_steps} must be in [1, resume_steps={self.resume_steps}].")
        if problems:
            raise ValueError("\n".join(problems))

    @property
    def steps(self) -> int:
        """Optimizer steps of a main run."""
        return self.warmup_steps + self.steady_steps

    @property
    def save_step(self) -> int:
        """The step whose checkpoint the resumed run starts from (``N`` of Q3-09)."""
        return self.steps - self.resume_steps


@dataclass(frozen=True)
class RunSpec:
    """One ``lp-lightning fit`` of the matrix.

    Attributes:
        name: ``"<kind>/<case>"``, also its folder under the ST output folder.
        kind: ``main``, ``probe``, ``reshard``, ``recompute``, ``accum`` or ``resume``.
        case: The precision case.
        max_steps: ``trainer.max_steps``.
        overrides: Config values set on top of the user's YAML (dotted keys).
        callbacks: ``trainer.callbacks`` entries (``{"class_path", "init_args"}``); ``out_dir``
            is filled in by the runner.
        resume_from: Name of the run whose checkpoint at ``save_step`` this run resumes.
    """

    name: str
    kind: str
    case: STCase
    max_steps: int
    overrides: dict[str, Any] = field(default_factory=dict)
    callbacks: tuple[dict[str, Any], ...] = ()
    resume_from: str | None = None


def _probe(name: str, **init_args: Any) -> dict[str, Any]:
    """A probe callback entry; its ``out_dir`` (the run's ``probes/`` folder) is filled in by the runner."""
    return {"class_path": f"{PROBES}.{name}", "init_args": {"out_dir": None, **init_args}}


def _fingerprints(steps: int) -> dict[str, Any]:
    """The gradient fingerprints of the first ``steps`` steps (Q3-08: recompute against the off run)."""
    return {"class_path": "lp_lightning.telemetry.resident_probe.GradientFingerprintProbe",
            "init_args": {"out_dir": None, "steps": steps}}


def _every_event_probes(case: STCase) -> list[dict[str, Any]]:
    probes = [_probe("StepRecordProbe"), _probe("RefreshProbe")]
    if case.is_low_precision:
        probes += [
            _probe("GemmTraceProbe", sample_every=1),
            _probe("GatherTraceProbe", sample_every=1),
            _probe("ScaleStatsProbe", sample_every=1),
        ]
    return probes


def build_runs(settings: STSettings, *, reshard_after_forward: bool, cases: tuple[STCase, ...] = CASES) -> list[RunSpec]:
    """The runs of the matrix, in execution order (a resumed run after its continuous run).

    Args:
        settings: Step counts and process count.
        reshard_after_forward: The user YAML's value; the reshard runs use the other one.
        cases: The precisions to run (default: all three).
    """
    runs: list[RunSpec] = []
    digest = {"class_path": "lp_lightning.st.digest.StateDigestProbe",
              "init_args": {"out_dir": None, "steps": [settings.save_step]}}
    for case in cases:
        # The performance evidence: step records and cheap counters only, events kept for the first step.
        main_probes = [_probe("StepRecordProbe"), _probe("RefreshProbe"),
                       {"class_path": "lp_lightning.telemetry.resident_probe.ResidentObjectsProbe",
                        "init_args": {"out_dir": None}}]  # §17.4 dependencies and resident objects, at the end
        if case.is_low_precision:
            main_probes += [_probe(kind, sample_every=10**9) for kind in ("GemmTraceProbe", "GatherTraceProbe")]
            compared = min(settings.variant_steps, settings.warmup_steps)  # Q3-08's gradients, outside the timed steps
            if compared:
                main_probes.append(_fingerprints(compared))
        runs.append(
            RunSpec(
                f"main/{case.name}", "main", case, settings.steps,
                overrides={"checkpoint.every_n_steps": settings.save_step, "checkpoint.save_last": False},
                callbacks=(*main_probes, digest),
            )
        )
        runs.append(
            RunSpec(
                f"resume/{case.name}", "resume", case, settings.steps,
                overrides={"checkpoint.every_n_steps": 0, "checkpoint.save_last": False},
                callbacks=(
                    _probe("StepRecordProbe"), _probe("RefreshProbe"), digest,
                    _probe("ProfilerProbe", start_step=settings.resume_steps - settings.profile_steps + 1,
                           steps=settings.profile_steps),  # counted within the resumed fit call
                ),
                resume_from=f"main/{case.name}",
            )
        )
        variant = {"checkpoint.every_n_steps": 0, "checkpoint.save_last": False}
        if case.is_low_precision:
            runs.append(
                RunSpec(
                    f"probe/{case.name}", "probe", case, 3, overrides=dict(variant),
                    callbacks=(*_every_event_probes(case), {"class_path": "lp_lightning.telemetry.probes.HighPrecisionGemmProbe"},
                               {"class_path": "lp_lightning.telemetry.fault_injection.InjectNonFiniteGradient",
                                "init_args": {"out_dir": None, "step": INJECTED_STEP}}),
                )
            )
        runs.append(
            RunSpec(
                f"reshard/{case.name}", "reshard", case, settings.variant_steps,
                overrides={**variant, "fsdp_config.reshard_after_forward": not reshard_after_forward},
                callbacks=tuple(_every_event_probes(case)),
            )
        )
        runs.append(
            RunSpec(
                f"recompute/{case.name}", "recompute", case, settings.variant_steps,
                overrides={**variant, "model.activation_checkpoint": "full"},
                callbacks=(*_every_event_probes(case), {"class_path": "lp_lightning.telemetry.resident_probe."
                                                        "ResidentObjectsProbe", "init_args": {"out_dir": None}},
                           *([_fingerprints(settings.variant_steps)] if case.is_low_precision else [])),
            )
        )
        if case.is_low_precision:
            runs.append(
                RunSpec(
                    f"accum/{case.name}", "accum", case, settings.variant_steps,
                    overrides={**variant, "trainer.accumulate_grad_batches": settings.accumulation},
                    callbacks=tuple(_every_event_probes(case)),
                )
            )
    return runs


_LP = ("mxfp8", "hif8_current")
_ALL = ("bf16", *_LP)
ROW_RUNS: dict[str, tuple[str, ...]] = {
    "Q3-01": ("main/bf16", "resume/bf16"),
    "Q3-02": ("main/mxfp8", "probe/mxfp8"),
    "Q3-03": ("main/hif8_current", "probe/hif8_current"),
    "Q3-04": tuple(f"probe/{c}" for c in _LP),
    "Q3-05": ("probe/mxfp8", "reshard/mxfp8"),
    "Q3-06": ("probe/hif8_current", "reshard/hif8_current"),
    "Q3-07": tuple(f"accum/{c}" for c in _LP),
    "Q3-08": tuple(f"{k}/{c}" for k in ("recompute", "main") for c in _LP),
    "Q3-09": tuple(f"{k}/{c}" for k in ("main", "resume") for c in _ALL),
    "Q3-10": (),
    "Q3-11": tuple(f"main/{c}" for c in _ALL),
    "conformance": (),  # no run: the backend against the emulation in st itself (st/conformance_row.py)
    "parity": (),  # its runs depend on --parity_seeds: parity_runs()
}
"""The runs whose evidence each Q3 row reads (the report's §17.4 section also reads the bf16 variant runs)."""


OPT_IN_ROWS = ("parity",)
"""Rows run only when ``--rows`` names them (long: N seeds x 4 runs of ``--parity_steps`` steps)."""
NOISE_EPS_FACTOR = 1.0 + 1e-2
"""The noise-floor run's AdamW eps, relative to the YAML's (a perturbation that should not matter)."""


@dataclass(frozen=True)
class ParitySettings:
    """The ``parity`` row's runs (``--parity_seeds``, ``--parity_steps``).

    Attributes:
        seeds: One bf16, mxfp8, hif8 and bf16-noise run per seed (``seed_everything``, ``model.seed``
            and ``data.seed`` all set to it).
        steps: Optimizer steps of each run.
        eps: The user YAML's ``model.eps``; the noise-floor run uses it x :data:`NOISE_EPS_FACTOR`.
        accumulate: The user YAML's ``trainer.accumulate_grad_batches`` (validation runs every
            :attr:`val_every` optimizer steps: ``val_check_interval`` counts micro-batches).

    Raises:
        ValueError: no seed, a repeated seed, or fewer than 2 steps (naming the option).
    """

    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 300
    eps: float = 1e-8
    accumulate: int = 1

    def __post_init__(self) -> None:
        problems = []
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or any(not 0 <= s < 2**32 for s in self.seeds):
            problems.append(f"--parity_seeds {list(self.seeds)}: name one or more different seeds in [0, 2^32).")
        if self.steps < 2:
            problems.append(f"--parity_steps {self.steps} must be >= 2.")
        if problems:
            raise ValueError("\n".join(problems))

    @property
    def last_steps(self) -> int:
        """Steps of the training-loss mean (50, or half the run when shorter)."""
        return min(50, max(1, self.steps // 2))

    @property
    def val_every(self) -> int:
        """Optimizer steps between validations: the largest divisor of ``steps`` up to 50, so that the last
        step validates (300 -> 50, 120 -> 40, 4 -> 4); a run longer than 50 steps without a divisor in
        [10, 50] validates at its end only."""
        divisor = max(d for d in range(1, min(50, self.steps) + 1) if self.steps % d == 0)
        return divisor if divisor >= 10 or self.steps <= 50 else self.steps

    @property
    def window(self) -> int:
        """Steps of each window of the gap-per-window figure (50, or the whole run when shorter)."""
        return min(50, self.steps)


def parity_runs(parity: ParitySettings) -> list[RunSpec]:
    """The ``parity`` row's runs: per seed ``parity/seed<S>/<case>`` for every case and ``parity/seed<S>/bf16_noise``."""
    runs = []
    for seed in parity.seeds:
        base = {"seed_everything": seed, "model.seed": seed, "data.seed": seed,
                "trainer.val_check_interval": parity.val_every * parity.accumulate,
                "checkpoint.every_n_steps": 0, "checkpoint.save_last": False}
        for case in CASES:
            runs.append(RunSpec(f"parity/seed{seed}/{case.name}", "parity", case, parity.steps, overrides=dict(base),
                                callbacks=(_probe("StepRecordProbe"),)))
        runs.append(RunSpec(f"parity/seed{seed}/bf16_noise", "parity", CASES[0], parity.steps,
                            overrides={**base, "model.eps": float(f"{parity.eps * NOISE_EPS_FACTOR:.6g}")},
                            callbacks=(_probe("StepRecordProbe"),)))
    return runs


def runs_for_rows(rows: list[str]) -> set[str]:
    """Names of the runs the given rows need (a resumed run brings its continuous run).

    Raises:
        ValueError: an unknown row id, listing the ids.
    """
    unknown = sorted(set(rows) - set(ROW_RUNS))
    if unknown:
        raise ValueError(f"unknown row(s) {unknown}; rows: {', '.join(ROW_RUNS)}.")
    names = {name for row in rows for name in ROW_RUNS[row]}
    return names | {name.replace("resume/", "main/") for name in names if name.startswith("resume/")}


def cases_for_rows(rows: list[str]) -> dict[str, set[str]]:
    """``{row: names of the cases whose runs it reads}`` (Q3-10 reads none).

    Raises:
        ValueError: an unknown row id, listing the ids.
    """
    runs_for_rows(rows)  # checks the ids
    return {row: {name.split("/", 1)[1] for name in ROW_RUNS[row]} for row in rows}
