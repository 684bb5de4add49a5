"""The one gate: may the native route govern a backward?  :func:`reason` is
the decision, asked by every place that needs it (a top-level backward, a
nested one the Python entry takes, the native front); its inputs are kept
here, each set through a function of this module, and where one changes the
native front's answer is recomputed and pushed into the extension as a plain
value (``set_front_open``).  Also the one check for torch's compiled autograd
and the native route's self-test verdict.  Imports nothing of graphscale but
the observation points (whose changes it follows)."""
from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from typing import Any, Callable

import torch

from .._core import observation as _observation

__all__ = ["ROUTE_ENV", "reason", "route_enabled", "set_route_enabled", "route_override", "python_only",
           "compiled_autograd_active", "running_in", "adopt_front", "front_open",
           "register_self_test", "trusted", "self_test"]

# NOTE [ Which route governs a backward ]
# The native route governs every backward it can; the Python route takes
# the rest, touching the same leaves with the same factors.  Each backward
# the native route does not take is counted by reason
# (graphscale.observe.declines(), graphscale.observe.routes()), so which
# route governed it is never a guess, and the DEBUG log is written by both
# (it changes no route).  The reasons (reason() below gives the first five;
# the native call itself the last three):
#   "compiled autograd"        torch's compiled autograd is on (its own
#                              _enable, torch.compile's config, or DeepSpeed's
#                              compile(compiled_autograd_enabled=True)): it
#                              lifts node hooks as Python callables
#                              (compiled_args), which a C++ hook (ScaleHook,
#                              BindHook) is not; the Python route's hooks it
#                              lifts, so that route takes these whole;
#   "GRAPHSCALE_ROUTE=python"  the environment (or a test: route_override)
#                              asked for Python, or python_only() is active
#                              on this thread;
#   "native walker not ready"  still building, or failed (_native/__init__.py);
#   "inputs="                  the Python route pins inputs= leaves;
#   "self-test failed"         the native route failed its self-test
#                              (_routes/selftest.py);
#   "call"                     roots or seeds the native call cannot read (an
#                              edge's implicit seed, a root that needs no
#                              grad);
#   "seed"                     a seed it cannot make (torch raises its own
#                              error through the Python route);
#   "factors"                  more than 64 distinct factors (or a backward
#                              nested in a plan the Python route made for
#                              that many).
# Declines cost the native route nothing: a native backward counts nothing.

ROUTE_ENV = "GRAPHSCALE_ROUTE"  # "python": every backward takes the Python route (CI runs tests so)

_lock = threading.RLock()  # every input's change and the push that follows it


class _Here(threading.local):
    python = False  # python_only() is active on this thread


_here = _Here()
_route_on = os.environ.get(ROUTE_ENV, "native").strip().lower() != "python"
_python_only = 0  # python_only() blocks open now, every thread
_captured = False  # compiled autograd on, as the latest top-level backward saw it
_debug = False  # the "graphscale" logger at DEBUG, as the latest top-level backward saw it
_recorders = False  # a phase, walk or route recorder is active
_native: Any = None  # the native module the running state lives in (running.use_native), or None
_passed: Any = None  # the last native module that passed its self-test
_CLOSED = object()  # (no module is it)
_open: Any = _CLOSED  # _passed while the route is on: reason()'s one-comparison answer for the usual backward
_fronts: list[Any] = []  # the native modules whose front was configured (adopt_front), each told set_front_open
_front_open = False  # what was pushed to _native's front


def reason(native: Any, inputs: Any = (), debug: bool | None = None, front: bool = False) -> str | None:
    """Why the native route must not govern a backward now, or None: it may
    (NOTE [ Which route governs a backward ]).  ``native``: the module that
    would govern it; ``inputs``: its ``inputs=``; ``debug``: whether the
    "graphscale" logger is at DEBUG, as a top-level backward sees it (None:
    not a top-level backward).  A top-level backward's view of the logger
    and of compiled autograd is kept for the front.

    ``front``: the native front's question instead, for a nested backward on
    any thread with no Python frame to see it (NOTE [ The native front ] in
    _native/front.h): also no while any thread is in :class:`python_only`,
    a recorder is active, or the latest top-level backward saw compiled
    autograd on or the logger at DEBUG ("observed": the Python entry takes
    the call and asks again); the self-test's verdict only (never runs it)."""
    if front:
        compiled: bool = _captured
    else:
        # compiled_autograd_active(), inline (a copy kept for speed): its call is one more Python call on
        # every backward (benchmarks/cost.py --calls-only, issue 49: mixed-loss 42 -> 43 of the gate's 43,
        # 44 with route.govern_natively's copy of governor() gone too).
        ca = sys.modules.get("torch._dynamo.compiled_autograd")
        compiled = ca is not None and bool(ca.compiled_autograd_enabled or ca.in_compiled_autograd_region)
        if debug is not None and (debug is not _debug or compiled is not _captured):
            _set(_debug=debug, _captured=compiled)
        if native is _open and not compiled and not inputs and not _here.python:
            return None  # the usual backward: one comparison for the route, the self-test and the module
    if compiled:
        return "compiled autograd"
    if not _route_on or (_python_only if front else _here.python):
        return ROUTE_ENV + "=python"
    if native is None:
        return "native walker not ready"
    if inputs:
        return "inputs="
    if not (_verdict(native) if front else trusted(native)):
        return "self-test failed"
    if front and (_recorders or _debug):
        return "observed"
    return None


def _recompute() -> None:
    """Recompute what reason() reads at once and the front's answer, and push
    it (with the lock held)."""
    global _open, _front_open
    _open = _passed if _route_on and _passed is not None else _CLOSED
    _front_open = reason(_native, front=True) is None
    for module in _fronts:
        module.set_front_open(_front_open and module is _native)


def _set(**inputs: Any) -> None:
    """Set these inputs (globals of this module, by name) and push what follows."""
    with _lock:
        globals().update(inputs)
        _recompute()


def _recorders_changed() -> None:
    """_observation.watch's call: ACTIVE read under this module's lock, so
    the last change on any thread is the one that stays."""
    with _lock:
        active = _observation.ACTIVE
        now = bool(active.phases or active.walks or active.routes)
        if now is not _recorders:
            _set(_recorders=now)


_observation.watch(_recorders_changed)


# ---------------------------------------------------------------- the inputs
def route_enabled() -> bool:
    """Whether the native route may govern at all (``GRAPHSCALE_ROUTE``, or :func:`set_route_enabled`)."""
    return _route_on


def set_route_enabled(on: bool) -> bool:
    """Let the native route govern (``on``) or send every backward to the
    Python route, from the next backward on; returns the previous setting."""
    with _lock:
        was = _route_on
        _set(_route_on=bool(on))
        return was


class route_override:
    """Within the block, :func:`set_route_enabled` is ``on``; restored after
    (blocks nest).  The tests' ``python_route`` fixture is one."""

    def __init__(self, on: bool) -> None:
        self.on = on

    def __enter__(self) -> None:
        self.was = set_route_enabled(self.on)

    def __exit__(self, *exc: object) -> None:
        set_route_enabled(self.was)


class python_only:
    """Within the block, this thread's backwards take the Python route, the
    nested ones too (the self-test's Python half); the native front hands
    every nested call to the Python entry meanwhile, whatever the thread."""

    def __enter__(self) -> None:
        self.was = _here.python
        _here.python = True
        with _lock:
            _set(_python_only=_python_only + 1)

    def __exit__(self, *exc: object) -> None:
        _here.python = self.was
        with _lock:
            _set(_python_only=_python_only - 1)


def compiled_autograd_active() -> bool:
    """Whether torch's compiled autograd captures a backward started now (its
    own ``_enable``, ``torch._dynamo.config.compiled_autograd`` under
    ``torch.compile``, or DeepSpeed's ``compile(compiled_autograd_enabled=True)``
    inside ``engine.backward``): NOTE [ Which route governs a backward ].
    One dict read while dynamo was never imported."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and bool(ca.compiled_autograd_enabled or ca.in_compiled_autograd_region)


def running_in(module: Any) -> None:
    """The running state lives in native ``module`` from now on (running.use_native)."""
    _set(_native=module)


def adopt_front(python_entry: Callable[..., None]) -> Any:
    """The native front of the module the running state lives in, configured
    to hand what it does not take to ``python_entry`` and told this gate's
    answer from now on; or None while the native route does not govern (:func:`reason` says why)."""
    native = _native
    if reason(native) is not None:
        return None
    with _lock:
        native.configure_front(python_entry)
        if native not in _fronts:
            _fronts.append(native)
        _recompute()
    return native.front


def front_open() -> bool:
    """What the native front was last told: whether it governs a nested call itself."""
    return _front_open


# ---------------------------------------------------------------- the self-test's verdict
_trust_lock = threading.RLock()
_verdicts: dict[int, tuple[Any, bool]] = {}  # id(native module) -> (the module, whether it passed)
_testing = threading.local()  # .native: the module this thread's self-test runs
_self_test: Callable[[Any], str | None] | None = None  # register_self_test's (selftest.failure)
_ready: Callable[[], bool] = lambda: False  # noqa: E731 - register_self_test's: may the self-test run now?


def register_self_test(failure: Callable[[Any], str | None], ready: Callable[[], bool]) -> None:
    """Make ``failure`` the native route's self-test: ``failure(native)``
    runs the fixed program through both routes and returns what failed, or
    None; it runs where ``ready()`` (torch.autograd.backward is governed).
    ``_entry/entry.py`` registers them at import (``_routes/selftest.py``
    ``failure`` with the entry's ``govern``): it runs whole governed
    backwards, so it sits above this module.  (See
    NOTE [ The native route's self-test ] in _routes/selftest.py.)"""
    global _self_test, _ready
    with _trust_lock:
        _self_test, _ready = failure, ready


def _verdict(native: Any) -> bool:
    """Whether ``native`` passed its self-test (False where it has not run)."""
    verdict = _verdicts.get(id(native))
    return verdict is not None and verdict[0] is native and verdict[1]


def trusted(native: Any) -> bool:
    """Whether ``native`` passed the native route's self-test (run once per
    module, here if it has not run)."""
    verdict = _verdicts.get(id(native))
    if verdict is not None and verdict[0] is native:
        return verdict[1]
    if getattr(_testing, "native", None) is native:
        return True  # the self-test's own native backwards
    return self_test(native)


def self_test(native: Any) -> bool:
    """The native route's self-test: run it for ``native`` (once; later
    calls return the verdict) and return whether the native route may
    govern backwards."""
    global _passed
    with _trust_lock:
        verdict = _verdicts.get(id(native))
        if verdict is not None and verdict[0] is native:
            return verdict[1]
        if compiled_autograd_active() or not _ready():
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
            logging.getLogger("graphscale").warning(
                "graphscale: native route off: self-test failed on torch %s: %s", torch.__version__, failed)
        with _lock:
            _verdicts[id(native)] = (native, failed is None)
            if failed is None:
                _passed = native
            _recompute()
        return failed is None
