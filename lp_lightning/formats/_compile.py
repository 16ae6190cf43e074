"""One switch for the fused (``torch.compile``) versions of the element-wise codec kernels.

Every codec kernel is written once as plain vectorised torch code (the *eager* reference). Where
``torch.compile`` works on the tensor's device, the same function is compiled once (dynamic
shapes) and used instead: it must be bit-identical to eager, and the tests check both. The switch
is an explicit call, never an environment variable::

    from lp_lightning.formats import set_compiled_kernels
    set_compiled_kernels(False)   # eager everywhere (e.g. to debug)

A device where compilation fails falls back to the eager kernel with a single warning; this
changes speed only, never a bit of the result.
"""

from __future__ import annotations

import functools
import threading
import warnings
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., object])

_lock = threading.Lock()
_enabled: bool = True
_broken_devices: set[str] = set()

#: Below this many elements the eager kernel is used: compiling (and re-specialising for tiny
#: shapes) costs seconds, while eager code on a few thousand elements costs microseconds.
MIN_FUSED_NUMEL = 1 << 14


def set_compiled_kernels(enabled: bool) -> None:
    """Turn the fused codec kernels on or off for this process (default: on)."""
    global _enabled
    _enabled = bool(enabled)


def compiled_kernels_enabled() -> bool:
    """Whether codec kernels try their ``torch.compile`` version first."""
    return _enabled


_cpu_compiler_ready = False


def _isa_record_key() -> str:
    """What the vector-ISA check depends on: torch, the interpreter, the CPU's flags, the compiler."""
    import hashlib
    import platform
    import sys

    from torch._inductor import cpp_builder

    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    parts = [torch.__version__, torch.__file__, sys.executable, platform.machine(), flags,
             str(cpp_builder.get_cpp_compiler())]  # fmt: skip
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _prepare_cpu_compiler() -> None:
    """Check Inductor's CPU vector ISAs once per machine instead of once per process.

    Before its first CPU compile, each process builds a test library per candidate ISA (AMX,
    AVX-512 VNNI, AVX-512, AVX2) and ``dlopen``s it in a child Python: about 0.3 s a child, 3 s a
    process (every ``fit`` rank). When every candidate the CPU's flags allow has passed once on
    this machine (same torch, interpreter, CPU flags and compiler; recorded under Inductor's cache
    dir), later processes set ``torch._inductor.config.cpp.vec_isa_ok = True``: the outcome of the
    check, without the children. The first process checks as usual and sets it too (also when the
    record cannot be written), so every process compiles under one config (one entry in
    Inductor's cache); an unreadable record is checked and written again. A user's own
    ``TORCHINDUCTOR_VEC_ISA_OK`` (or config value) is left alone, as is any machine where a
    candidate fails or that is not x86. Errors here change nothing: Inductor checks as usual.
    """
    global _cpu_compiler_ready
    if _cpu_compiler_ready:
        return
    _cpu_compiler_ready = True
    import json
    import os
    import platform

    from torch._inductor import config as inductor_config

    if inductor_config.cpp.vec_isa_ok is not None or platform.machine() not in ("x86_64", "AMD64"):
        return
    try:
        from torch._inductor import cpu_vec_isa
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        record = os.path.join(cache_dir(), "lp_lightning", f"vec_isa_{_isa_record_key()}.json")
        try:
            with open(record) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            saved = None  # none yet, or unreadable: check and (re)write it
        if isinstance(saved, dict) and isinstance(saved.get("all_candidates_pass"), bool):
            if saved["all_candidates_pass"]:
                inductor_config.cpp.vec_isa_ok = True
            return
        cpu_flags = cpu_vec_isa.x86_isa_checker()
        candidates = [str(isa) for isa in cpu_vec_isa.supported_vec_isa_list
                      if all(flag in cpu_flags for flag in str(isa).split())]  # fmt: skip
        passed = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]  # the per-process check
        all_pass = bool(candidates) and passed == candidates
        if all_pass:
            inductor_config.cpp.vec_isa_ok = True
        os.makedirs(os.path.dirname(record), exist_ok=True)
        tmp = f"{record}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"all_candidates_pass": all_pass, "candidates": candidates, "passed": passed}, f)
        os.replace(tmp, record)
    except Exception:  # noqa: BLE001 - an optimisation only; Inductor's own check still runs
        return


def _call_form(arg: object) -> object:
    """A tensor argument as the compiled kernel sees it: detached, so not a view of anything.

    torch.compile guards on ``requires_grad`` and on the size and stride of the tensor a view was
    taken from (``x._base``): ``x.view(-1, 32)`` of activations, weights and gradients of every
    shape would each add a guard and soon exhaust the recompile limit. ``detach()`` shares the
    storage and has neither (no copy).
    """
    return arg.detach() if isinstance(arg, torch.Tensor) else arg


def fused(fn: F | None = None, *, static_dims: dict[int, tuple[int, ...]] | None = None) -> F:
    """Wrap an eager, element-wise torch kernel so that calls use a compiled twin when possible.

    The wrapper dispatches on the device type of the first tensor argument; inputs whose first
    tensor has fewer than ``MIN_FUSED_NUMEL`` elements always run eagerly. The compiled twin is
    built lazily (``torch.compile(fn, dynamic=True)``) the first time it is needed; if it raises
    while compiling, that device type is marked broken and the eager ``fn`` is used from then on.
    ``wrapper.eager`` is the untouched reference implementation.

    One compiled graph serves every shape: sizes are symbolic, tensor arguments are passed
    detached (``_call_form``), and grad mode and autocast are fixed. What remains in the guards is
    the dtype of each tensor and any non-tensor argument, so a kernel compiles once per input
    dtype (docs/architecture.md "Compiled kernels"; ``tests/lightning/test_recompiles.py`` counts
    recompiles). Two unrelated sizes that happen to be equal in the first call share a symbol
    ("duck" sizing) and cost one more compile when they first differ; a storage offset of 0 vs
    not 0 (a group of a grouped weight) is another such one-off.

    Args:
        fn: The eager kernel (used as ``@fused`` or ``@fused(static_dims=...)``).
        static_dims: ``{positional argument index: dims}`` whose sizes are constants of the graph
            (e.g. a block of 32 elements): a fixed inner trip count vectorises better, and a
            different size recompiles (by design: these sizes never vary).
    """
    if fn is None:
        return functools.partial(fused, static_dims=static_dims)  # type: ignore[return-value]
    compiled: dict[str, Callable] = {}
    static = dict(static_dims or {})

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _enabled or torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is None or first.numel() < MIN_FUSED_NUMEL:
            return fn(*args, **kwargs)
        device = first.device.type
        if device in _broken_devices:
            return fn(*args, **kwargs)
        kernel = compiled.get(device)
        if kernel is None:
            with _lock:
                if device == "cpu":
                    _prepare_cpu_compiler()
                kernel = compiled.setdefault(device, torch.compile(fn, dynamic=True))
        call_args = [_call_form(a) for a in args]
        for index, dims in static.items():
            for dim in dims:
                torch._dynamo.mark_static(call_args[index], dim)
        try:
            # One context for every call: grad mode and autocast state are compile guards, and
            # the kernels (integer and element-wise work on detached values) depend on neither, so
            # calls from forward, backward, recompute and no_grad code share one compiled graph.
            # (Entering the two contexts costs more than the call itself: skip when already so.)
            if not torch.is_grad_enabled() and not torch.is_autocast_enabled(device):
                return kernel(*call_args, **kwargs)
            with torch.no_grad(), torch.autocast(device, enabled=False):
                return kernel(*call_args, **kwargs)
        except Exception as exc:  # compilation problems only: eager is bit-identical
            _broken_devices.add(device)
            warnings.warn(
                f"torch.compile of {fn.__qualname__} failed on device type {device!r} "
                f"({type(exc).__name__}: {exc}); using the eager kernel (same bits, slower).",
                RuntimeWarning,
                stacklevel=2,
            )
            return fn(*args, **kwargs)

    wrapper.eager = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]
