"""The native route: a governed backward in one call into the native module.

NOTE [ One native call per backward ] in ``_native/registry.h`` says what
that call does.  Python keeps what only Python can read (the call's
arguments, every group's factor, what the seeds carry) and the observation
points; the rest — decide, walk, plan, scale the seeds, hook, bind, register
for nested backwards, run the original, take it all back — is native.  The
Python route (``_routes/python.py``) stays the exact reference:
``GRAPHSCALE_ROUTE=python`` in the environment (or ``enabled = False`` here)
runs every backward through it, with the native walker's plans;
``GRAPHSCALE_WALKER=python`` with the Python walker's too.

# NOTE [ Which route governs a backward ]
# The native route governs every backward it can; the Python route takes
# the rest, touching the same leaves with the same factors.  Each backward
# the native route does not take is counted by reason
# (graphscale.observe.declines(), graphscale.observe.routes()), so which
# route governed it is never a guess, and the DEBUG log is written by both
# (it changes no route).  The reasons:
#   "GRAPHSCALE_ROUTE=python"  the environment (or a test) asked for Python;
#   "native walker not ready"  still building, or failed (NOTE [ No backward
#                              waits for a compiler ] in _native/__init__.py);
#   "self-test failed"         NOTE [ The native route's self-test ] in
#                              _routes/selftest.py;
#   "compiled autograd"        torch's compiled autograd is on (its own
#                              _enable, torch._dynamo.config.compiled_autograd
#                              under torch.compile, or DeepSpeed's
#                              compile(compiled_autograd_enabled=True)).
#                              Compiled autograd asks every node hook for
#                              compiled_args and lifts it into its graph as a
#                              Python callable; a C++ hook (ScaleHook,
#                              BindHook) has neither, and one that had them
#                              would be a Python hook again, through a C++
#                              interface torch changes between releases.  The
#                              Python route's hooks are what compiled
#                              autograd lifts (one capture, then replayed), so
#                              it takes these backwards whole;
#   "inputs="                  the Python route pins inputs= leaves;
#   "call"                     roots or seeds the native call cannot read (an
#                              iterable torch reads once, an edge's implicit
#                              seed, a root that needs no grad);
#   "seed"                     a seed it cannot make (torch raises its own
#                              error through the Python route);
#   "factors"                  more than 64 distinct factors (or a backward
#                              nested in a plan the Python route made for
#                              that many).
# Declines cost the native route nothing: a native backward counts nothing.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
import weakref
from typing import Any, Callable

import torch
from torch.autograd.graph import GradientEdge

from .. import _native
from .._backward import call as _call
from .._backward import running as _running
from .._backward.call import BackwardCall
from .._backward.frames import Frame, compiled_autograd_active
from .._backward.hints import checkpoint_hint_positions
from .._backward.native_backend import native_owners
from .._backward.unreached import warn_unreached_groups
from .._core import observation as _observation
from .._core.observation import Laps
from .._core.snapshot import Reading, State

__all__ = ["ROUTE_ENV", "enabled", "python_only", "decline_reason", "declined", "governor", "nested_governor",
           "govern_natively", "govern_nested_natively", "native_front", "trusted", "self_test", "register_self_test"]

ROUTE_ENV = "GRAPHSCALE_ROUTE"  # "python": every backward takes the Python route (CI runs tests so)
enabled = os.environ.get(ROUTE_ENV, "native").strip().lower() != "python"  # tests switch it too

_log = logging.getLogger("graphscale")


class _Here(threading.local):
    python = False  # python_only() is active on this thread


_here = _Here()


class python_only:
    """Within the block, this thread's backwards take the Python route, the
    nested ones too (the self-test's Python half)."""

    def __enter__(self) -> None:
        self.was = _here.python
        _here.python = True

    def __exit__(self, *exc: object) -> None:
        _here.python = self.was

_PHASES = ("walk+plan", "seeds", "hooks on", "bind", "hook calls", "hooks off")


def decline_reason(call: BackwardCall, native: Any, frame: Frame) -> str | None:
    """Why the native route must not take the top-level backward ``call`` in
    ``frame`` (NOTE [ Which route governs a backward ]), or None: it may."""
    if frame.compiled:
        return "compiled autograd"
    if native is _passed and native is not None and enabled and not call.inputs and not _here.python:
        return None  # the usual case: one identity check for the self-test's verdict
    if not enabled or _here.python:
        return ROUTE_ENV + "=python"
    if native is None:
        return "native walker not ready"
    if call.inputs:
        return "inputs="
    if not trusted(native):
        return "self-test failed"
    return None


def declined(reason: str) -> None:
    """Count one backward the Python route takes for ``reason``."""
    _observation.record_route("python", reason)


def governor(native: Any, state: State) -> Any:
    """The native ``Governor`` of ``state``, made once per snapshot (NOTE [
    Per-snapshot tables ] in _core/snapshot.py), or None while the running
    state cannot move to ``native`` yet (NOTE [ One running state, both
    routes ] in _native/registry.h: a backward runs on the Python one)."""
    made = state.tables.native_governor
    if made is not None and made[0] is native and _running.state.module is native:
        return made[1]
    if not _running.use_native(native):
        return None
    if made is not None and made[0] is native:
        return made[1]
    ref = weakref.ref(state)  # the governor lives in the snapshot's tables: no cycle through it

    def warn(plan: Any) -> None:
        s = ref()
        if s is not None:
            warn_unreached_groups(s, plan)

    gov = native.Governor(native_owners(state, native), state.policy_index, checkpoint_hint_positions(state),
                          bool(state.hook_owners), warn)
    state.tables.native_governor = (native, gov)
    return gov


def nested_governor(state: State) -> Any:
    """The Governor that plans the backwards nested in a fast-path backward
    under ``state`` natively: the one of the module the running state is
    kept in, or None where it is kept in Python (they are planned there)."""
    module = _running.state.module
    return None if module is None else governor(module, state)


def _native_call(fn: Any, args: tuple[Any, ...], laps: Laps | None, reading: Reading | None) -> bool:
    """``fn(*args, want_stats)``, one native call, and what it measured handed
    to the active recorders and the DEBUG log (``reading``: a top-level
    backward's factors; None: a nested backward); False when it declined
    (touched nothing; the decline is counted)."""
    debug = _log.isEnabledFor(logging.DEBUG) and not _observation.quiet()
    want = laps is not None or debug or bool(_observation.ACTIVE.walks)
    if laps:
        laps("prepare")
    return _outcome(fn(*args, want), want, laps, debug, reading)


def _outcome(out: Any, want: bool, laps: Laps | None, debug: bool, reading: Reading | None) -> bool:
    """What one native call returned (``out``: None, its stats if ``want``,
    or the reason it declined), counted and observed: :func:`_native_call`."""
    if out.__class__ is str:  # declined, with its reason
        declined(out)
        return False
    if want:
        _observed(out, laps, debug, reading)
    if _observation.ACTIVE.routes:
        _observation.record_route("native", None)
    return True


def _observed(stats: Any, laps: Laps | None, debug: bool, reading: Reading | None) -> None:
    """Hand what the native call measured to the active recorders and, with
    ``debug``, the DEBUG log."""
    kind, nodes, mults, *ns = stats
    if kind and _observation.ACTIVE.walks:
        _observation.record_walk(nodes if kind == 2 else 0, ns[0] * 1e-9, mults)
    if laps:
        for name, t in zip(_PHASES, ns):
            laps.record(laps.prefix + name, t * 1e-9)
        laps.skip()
    if debug and kind:
        what = ", nested" if reading is None else ", factors " + str(
            sorted({f"{g.name}={f:g}" for g, f in reading.factors.items()}))
        _log.debug("graphscale: %swalked %d nodes in %.1f us, %d multiplication(s)%s, native route, native walker",
                   "fast path, " if kind == 1 else "", nodes if kind == 2 else 0, ns[0] * 1e-3, mults, what)


def govern_natively(call: BackwardCall, reading: Reading, frame: Frame, native: Any = None) -> bool:
    """Govern the top-level backward ``call`` in one native call (the loaded
    native module, or ``native``); False where the native route does not
    take it (NOTE [ Which route governs a backward ]: the reason counted,
    nothing touched)."""
    state = reading.state
    made = state.tables.native_governor
    if native is None:
        native = made[0] if made is not None else _native.load()
    if (made is not None and made[0] is native is _passed is _running.state.module and enabled and not call.inputs
            and not frame.compiled and not _here.python):
        gov = made[1]  # the usual backward: every check of decline_reason and governor in one expression
    else:
        why = decline_reason(call, native, frame)
        gov = governor(native, state) if why is None else None
        if gov is None:
            declined(why or "native walker not ready")
            return False
    assert call.grads is not None
    # _native_call(native.top, ...), inline: one Python call fewer on every backward.
    laps = frame.laps
    debug = _log.isEnabledFor(logging.DEBUG) and not _observation.quiet()
    want = laps is not None or debug or bool(_observation.ACTIVE.walks)
    if laps:
        laps("prepare")
    out = native.top(gov, call.roots, list(call.grads), reading,
                     (call.retain_graph, call.create_graph, call.inputs_arg), frame, want)
    if out is None and not _observation.ACTIVE.routes:
        return True  # the usual backward: governed, nothing to observe
    return _outcome(out, want, laps, debug, reading)


def govern_nested_natively(tensors: Any, grad_tensors: Any, retain_graph: bool | None, create_graph: bool,
                           current_node: Any) -> bool:
    """Govern a plain nested backward (NOTE [ Nested backward ] in entry.py;
    roots a tensor, an edge, or a tuple or list of them; seeds None, a
    tensor, or a tuple or list of them; no ``inputs=``): the call a reentrant
    checkpoint makes once per block, read without building a
    :class:`BackwardCall`.  False: not taken (nothing touched; the decline
    counted); the Python route takes it."""
    native = _running.state.module  # the module the running state is in (NOTE [ One running state, both routes ])
    if not enabled or _here.python:
        declined(ROUTE_ENV + "=python")
        return False
    if native is None:
        declined("native walker not ready")
        return False
    if compiled_autograd_active():
        declined("compiled autograd")
        return False
    if native is not _passed and not trusted(native):
        declined("self-test failed")
        return False
    if isinstance(tensors, (torch.Tensor, GradientEdge)):
        roots: Any = (tensors,)
    elif type(tensors) in (tuple, list):
        roots = tuple(tensors)
    else:
        declined("call")  # an iterable torch reads once: the Python route reads it
        return False
    if grad_tensors is None:
        grads: Any = [None] * len(roots)
    elif isinstance(grad_tensors, torch.Tensor):
        grads = [grad_tensors]
    elif type(grad_tensors) in (tuple, list):
        grads = list(grad_tensors)
    else:
        declined("call")
        return False
    laps = _observation.laps(nested=True) if _observation.ACTIVE.phases else None
    return _native_call(native.govern_nested, (current_node, roots, grads, (retain_graph, create_graph, None)), laps,
                        None)


def native_front(python_entry: Callable[..., None]) -> Any:
    """The native module's ``front`` (NOTE [ The native front ] in
    _native/front.h), configured to hand what it does not take to
    ``python_entry``; or None while the native route does not govern (the
    running state is not in a module that passed its self-test, or the
    route is off)."""
    native = _running.state.module
    if native is None or native is not _passed or not enabled or _here.python:
        return None
    # What the front's gate reads on every call: this module's `enabled`, where the running state is,
    # python_only's flag, the active recorders, and the logger's level cache (cleared in place on setLevel).
    native.configure_front(python_entry, sys.modules[__name__], _running, _here, _observation.ACTIVE,
                           getattr(_log, "_cache", None))
    return native.front


# ---------------------------------------------------------------- the self-test's verdict
_trust_lock = threading.RLock()
_verdicts: dict[int, tuple[Any, bool]] = {}  # id(native module) -> (the module, whether it passed)
_testing = threading.local()  # .native: the module this thread's self-test runs
_self_test: Callable[[Any], str | None] | None = None  # register_self_test's (selftest.failure)
_passed: Any = None  # the last native module that passed (decline_reason's fast check)


def register_self_test(failure: Callable[[Any], str | None]) -> None:
    """Make ``failure`` NOTE [ The native route's self-test ]: ``failure(native)``
    runs the fixed program through both routes and returns what failed, or
    None.  ``_entry/entry.py`` registers it at import (``_routes/selftest.py``
    ``failure`` with the entry's ``govern``): it runs whole governed
    backwards, so the entry, above both routes, hands it over."""
    global _self_test
    with _trust_lock:
        _self_test = failure


def trusted(native: Any) -> bool:
    """Whether ``native`` passed NOTE [ The native route's self-test ] (run
    once per module, here if it has not run)."""
    verdict = _verdicts.get(id(native))
    if verdict is not None and verdict[0] is native:
        return verdict[1]
    if getattr(_testing, "native", None) is native:
        return True  # the self-test's own native backwards
    return self_test(native)


def self_test(native: Any) -> bool:
    """NOTE [ The native route's self-test ]: run it for ``native`` (once;
    later calls return the verdict) and return whether the native route may
    govern backwards."""
    global _passed
    with _trust_lock:
        verdict = _verdicts.get(id(native))
        if verdict is not None and verdict[0] is native:
            return verdict[1]
        if compiled_autograd_active() or torch.autograd.backward is _call.ORIGINAL_BACKWARD:
            return False  # not now: its backwards would be captured, or its nested one not governed
        _testing.native = native
        try:
            with _observation.unrecorded():  # the self-test's backwards are no user's
                failed = _self_test(native) if _self_test is not None else "the self-test is not loaded"
        except Exception as exc:  # noqa: BLE001 - whatever broke, the Python route is the safe one
            failed = f"{type(exc).__name__}: {exc}"
        finally:
            _testing.native = None
        if failed is not None:
            warnings.warn(
                f"graphscale: the native route failed its self-test on torch {torch.__version__} ({failed}); "
                "every backward takes the Python route (exact, slower).  Please report this with "
                "`python -m graphscale env`.", RuntimeWarning, stacklevel=2)
            _log.warning("graphscale: native route off: self-test failed on torch %s: %s", torch.__version__, failed)
        _verdicts[id(native)] = (native, failed is None)
        if failed is None:
            _passed = native
        return failed is None
