"""One mechanism for the public, read-only event hooks: GEMM, gather, refresh and stage events.

Each event kind owns one :class:`Observers` list in the layer that emits it —
``lp_lightning.ops.add_gemm_observer`` (every low-precision GEMM),
``lp_lightning.ops.add_range_observer`` (begin and end of every quantise/GEMM backend call),
``lp_lightning.fsdp.gather.add_gather_observer`` (every low-precision pre-all-gather) and
``lp_lightning.tensor.add_refresh_observer`` (every storage build). Collectives are issued by
several layers (the FSDP2 comms of the wire probe, the non-finite check, the HiF8 amax MAX-reduce,
the strategy's ``reduce``), so their list, :func:`add_collective_observer`, lives here, below all of
them. Probes observe through these hooks only; they never wrap a method or read private state. Observers run synchronously in the
emitting thread, must not mutate what they are shown, and are called in registration order.

The stage events (:func:`add_stage_observer`) live here because two layers emit them: the CLI
(``launch_check``, ``meta_model_build``, ``instantiate_classes``) and the FSDP2 strategies (``startup_gate``,
``model_build``, ``plan_apply``, ``fully_shard``, ``optimizer_check``, ``training_step``), and the plan builder
(``plan_compile``, ``lp_lightning.models.replacement``); the
acceptance harness judges the design spec §15 stage of an illegal run from them.

The non-training ranges (:func:`non_training`, :func:`add_non_training_observer`) live here because
several layers open them: the checkpoint save (``lp_lightning.checkpoint.dcp`` and the Trainer's
``PeriodicCheckpoint``), the acceptance harness's state digests and the probes' sampled-step work. The
step timers of the run summary and the probes subtract them from a step's wall time
(``lp_lightning.telemetry.step_clock``), whatever order the callbacks run in.

Pure Python (no torch), so every layer may use it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = [
    "CollectiveEvent",
    "NonTrainingEvent",
    "ObserverHandle",
    "Observers",
    "StageEvent",
    "add_collective_observer",
    "add_non_training_observer",
    "add_stage_observer",
    "non_training",
    "notify_collective",
    "stage",
]

E = TypeVar("E")


class ObserverHandle:
    """Returned by :meth:`Observers.add`; ``remove()`` (idempotent) unregisters. Also a context manager."""

    def __init__(self, owner: Observers, key: int) -> None:
        self._owner = owner
        self._key = key

    def remove(self) -> None:
        """Stop delivering events to this observer."""
        self._owner._remove(self._key)

    def __enter__(self) -> ObserverHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


class Observers(Generic[E]):
    """A thread-safe list of callbacks for one kind of event (copy-on-write: notify takes no lock).

    Args:
        name: The registering function's name, for messages (``"add_gemm_observer"``).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._entries: tuple[tuple[int, Callable[[E], None]], ...] = ()
        self._next = 0

    def add(self, observer: Callable[[E], None]) -> ObserverHandle:
        """Register ``observer(event)``.

        Raises:
            TypeError: ``observer`` is not callable.
        """
        if not callable(observer):
            raise TypeError(f"{self._name}: observer must be callable, got {type(observer).__name__}.")
        with self._lock:
            self._next += 1
            self._entries = self._entries + ((self._next, observer),)
            return ObserverHandle(self, self._next)

    def _remove(self, key: int) -> None:
        with self._lock:
            self._entries = tuple(entry for entry in self._entries if entry[0] != key)

    def notify(self, event: E) -> None:
        """Deliver ``event`` to every observer registered now."""
        for _, observer in self._entries:
            observer(event)

    def __bool__(self) -> bool:
        return bool(self._entries)


# ------------------------------------------------------------------------------------------------
# Launch stages


@dataclass(frozen=True)
class StageEvent:
    """A launch stage of a run was entered, or ended with an error (:func:`stage`).

    Attributes:
        stage: The stage's name, in run order: ``launch_check`` (the CLI's launch checks; inside
            it ``meta_model_build``, the meta model the plan is checked on), ``instantiate_classes``
            (the CLI builds model, data module and Trainer), ``startup_gate``, ``model_build``
            (``configure_model``), ``plan_apply`` (the precision plugin converts the built model),
            ``fully_shard`` (the strategy shards it), ``optimizer_check``, ``training_step`` (every step).
        outcome: ``"entered"``, or ``"raised <ErrorType>"`` when the stage ended with that error.
    """

    stage: str
    outcome: str = "entered"


_STAGE_OBSERVERS: Observers[StageEvent] = Observers("add_stage_observer")


def add_stage_observer(observer: Callable[[StageEvent], None]) -> ObserverHandle:
    """Register ``observer(event)`` for every :class:`StageEvent` of this process.

    Raises:
        TypeError: ``observer`` is not callable.
    """
    return _STAGE_OBSERVERS.add(observer)


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Emits ``StageEvent(name)`` on entry and ``StageEvent(name, "raised <ErrorType>")`` if the body raises.

    The error propagates unchanged; a body that returns emits nothing more.
    """
    _STAGE_OBSERVERS.notify(StageEvent(name))
    try:
        yield
    except BaseException as err:
        _STAGE_OBSERVERS.notify(StageEvent(name, f"raised {type(err).__name__}"))
        raise


# ------------------------------------------------------------------------------------------------
# Collectives


@dataclass(frozen=True)
class CollectiveEvent:
    """One collective this rank issues, reported right before (all-gather, reduce-scatter, all-reduce
    call sites) or right after (FSDP2's HSDP all-reduce, seen through its all-reduce hook) the call.

    Attributes:
        kind: ``"all_gather"``, ``"reduce_scatter"`` or ``"all_reduce"``.
        dtype: dtype name of this rank's input buffer (``"uint8"``, ``"float32"``; no ``torch.``).
        bytes: Size of this rank's input buffer in bytes (an all-gather moves world-size times that).
        site: Who issued it (``"fsdp2"``, ``"first_nonfinite"``, ``"refresh.amax"``, ``"strategy.reduce"``).
    """

    kind: str
    dtype: str
    bytes: int
    site: str


_COLLECTIVES: Observers[CollectiveEvent] = Observers("add_collective_observer")


def add_collective_observer(observer: Callable[[CollectiveEvent], None]) -> ObserverHandle:
    """Register ``observer(CollectiveEvent)`` for every collective reported by :func:`notify_collective`."""
    return _COLLECTIVES.add(observer)


def notify_collective(kind: str, tensor: Any, site: str) -> None:
    """Report one collective on ``tensor`` (this rank's input; a ``torch.Tensor``, read for dtype and size only).

    Costs one truth test when nobody observes. Call it exactly where the collective is issued, on
    the same condition, so that the reported collectives are the issued ones.
    """
    if _COLLECTIVES:
        _COLLECTIVES.notify(
            CollectiveEvent(kind, str(tensor.dtype).removeprefix("torch."), tensor.numel() * tensor.element_size(), site)
        )


# ------------------------------------------------------------------------------------------------
# Non-training work


@dataclass(frozen=True)
class NonTrainingEvent:
    """Work that is not training began or ended on this thread (:func:`non_training`).

    Attributes:
        kind: What the work is: ``"checkpoint_save"`` (a DCP save, its state gathering and barrier),
            ``"state_digest"`` (the acceptance harness's SHA-1 snapshot of the state),
            ``"probe_sample"`` (a probe's hashing or reading of tensors on a sampled step).
        phase: ``"begin"`` or ``"end"`` (an ``"end"`` follows every ``"begin"``, also when the work raises).
    """

    kind: str
    phase: str


_NON_TRAINING: Observers[NonTrainingEvent] = Observers("add_non_training_observer")


def add_non_training_observer(observer: Callable[[NonTrainingEvent], None]) -> ObserverHandle:
    """Register ``observer(NonTrainingEvent)`` for the begin and end of every :func:`non_training` range.

    Raises:
        TypeError: ``observer`` is not callable.
    """
    return _NON_TRAINING.add(observer)


@contextmanager
def non_training(kind: str) -> Iterator[None]:
    """Marks the body as work that is not training (a save, a digest, a probe's sampling).

    Emits ``NonTrainingEvent(kind, "begin")`` before the body and ``NonTrainingEvent(kind, "end")``
    after it, also when it raises (the error propagates). Ranges may nest; the step timers count the
    outermost one. Costs one truth test per edge when nobody observes.
    """
    if _NON_TRAINING:
        _NON_TRAINING.notify(NonTrainingEvent(kind, "begin"))
    try:
        yield
    finally:
        if _NON_TRAINING:
            _NON_TRAINING.notify(NonTrainingEvent(kind, "end"))
