"""Observation points: what tools see of each governed backward.

Phase, walk and route recorders and the backward observer, each a stack of
context managers that nest and restore (like ``torch.autograd.profiler``),
never a global a tool assigns; which are active is :data:`ACTIVE`, read by the
governed backward with attribute reads only.  Imports nothing of graphscale.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

__all__ = ["ACTIVE", "recording_phases", "recording_walks", "recording_routes", "observing", "observer", "laps",
           "record_walk", "record_route", "routes_recorded", "walks_recorded", "declines", "unrecorded", "quiet",
           "Laps", "watch", "record_refusal", "refusals"]

# The kinds of observation point:
# * phase recorders, ``record(phase, seconds)``: graphscale's own time per
#   backward, by phase (laps; public as ``graphscale.observe.phases``);
# * walk recorders, ``record(nodes, seconds, multiplications)``: every walked
#   plan, or the fast path's probe (record_walk; public as
#   ``graphscale.observe.walks``);
# * route recorders, ``record(route, reason)``: which route governed each
#   backward, ``"native"`` or ``"python"`` with the reason the native route
#   did not take it (record_route; public as ``graphscale.observe.routes``);
#   the Python route's backwards are also counted by reason for the whole
#   process (declines);
# * the backward observer (``graphscale.audit``): wraps every top-level
#   governed backward, ``observer(run, *backward_args)`` calls
#   ``run(*backward_args)`` once; the innermost one applies.
# Every recorder active when an event happens sees it.  Which are active is
# ACTIVE: one tuple per kind, replaced whole under a lock, so the governed
# backward reads it with attribute reads only (no call into this module unless
# something is recording); watch() tells a subscriber when it changes.

PhaseRecorder = Callable[[str, float], None]
WalkRecorder = Callable[[int, float, int], None]
RouteRecorder = Callable[[str, "str | None"], None]

_lock = threading.Lock()


class _Active:
    """The active observation points of each kind, oldest first: a tuple per
    kind replaced whole under the lock and read without it (one atomic
    attribute read)."""

    __slots__ = ("phases", "walks", "routes", "observers")

    def __init__(self) -> None:
        self.phases: tuple[Any, ...] = ()
        self.walks: tuple[Any, ...] = ()
        self.routes: tuple[Any, ...] = ()
        self.observers: tuple[Any, ...] = ()


ACTIVE = _Active()
_watchers: list[Callable[[], None]] = []  # watch(): told after every change of ACTIVE
_declined: dict[str, int] = {}  # reason -> backwards the Python route took for it, in this process
_refused: dict[str, int] = {}  # kind -> setups graphscale refused, in this process (record_refusal)
_quiet = threading.local()  # .on: this thread's backwards are graphscale's own (the route self-test)


class _Pushed:
    """``fn`` on ``stack`` for a ``with`` block; leaving takes out exactly
    the entry it added (a fresh wrapper, compared by identity), so blocks
    opened on several threads or closed out of order restore correctly."""

    __slots__ = ("kind", "fn", "entry")

    def __init__(self, kind: str, fn: Any) -> None:
        if not callable(fn):
            raise TypeError(f"graphscale: an observation point takes a callable, got {type(fn).__name__}.")
        self.kind, self.fn = kind, fn
        self.entry: Callable[..., Any] | None = None

    def __enter__(self) -> None:
        if self.entry is not None:
            raise RuntimeError("graphscale: this observation point is already active; make a new one.")
        fn = self.fn
        self.entry = entry = (lambda *args: fn(*args))
        with _lock:
            setattr(ACTIVE, self.kind, (*getattr(ACTIVE, self.kind), entry))
        for told in _watchers:
            told()

    def __exit__(self, *exc: object) -> None:
        entry, self.entry = self.entry, None
        with _lock:
            setattr(ACTIVE, self.kind, tuple(e for e in getattr(ACTIVE, self.kind) if e is not entry))
        for told in _watchers:
            told()


def watch(fn: Callable[[], None]) -> None:
    """Call ``fn()`` after every change of :data:`ACTIVE` (a recorder or
    observer entered or left), on the thread that changed it, with no lock
    of this module held: what decides on the recorders (the native route's
    gate) reads ACTIVE again there."""
    with _lock:
        _watchers.append(fn)


def recording_phases(record: PhaseRecorder) -> _Pushed:
    """Within the block, ``record(phase, seconds)`` sees graphscale's own time
    in each governed backward: "prepare" (the call read, factors, decision
    inputs), "walk+plan" (probe or plan), "seeds" (seed scaling), "hooks on",
    "bind" (the graph task's binding), "hooks off" (removal and unbinding),
    "hook calls" (inside the backward) and "adapter" (an adapter's wrapper
    around an engine's own backward); a nested backward's phases start with
    "nested ".  Torch's and DeepSpeed's own work is in none of them."""
    return _Pushed("phases", record)


def recording_walks(record: WalkRecorder) -> _Pushed:
    """Within the block, ``record(nodes, seconds, multiplications)`` sees every
    walked plan (nodes walked, seconds to walk and plan, multiplications it
    places); the fast path reports ``(0, seconds_to_probe, seeds_scaled)``."""
    return _Pushed("walks", record)


def recording_routes(record: RouteRecorder) -> _Pushed:
    """Within the block, ``record(route, reason)`` sees every governed
    backward: ``("native", None)``, or ``("python", reason)``.
    (See NOTE [ Which route governs a backward ] in _backward/gate.py.)"""
    return _Pushed("routes", record)


def record_route(route: str, reason: str | None) -> None:
    """One governed backward took ``route`` (for ``reason``, on the Python
    route): counted there, and told to every active route recorder."""
    if getattr(_quiet, "on", False):
        return
    if reason is not None:
        with _lock:
            _declined[reason] = _declined.get(reason, 0) + 1
    for record in ACTIVE.routes:
        record(route, reason)


def routes_recorded() -> bool:
    """Whether any route recorder is active."""
    return bool(ACTIVE.routes)


def quiet() -> bool:
    """Whether this thread's backwards are graphscale's own (recorded and logged nowhere)."""
    return getattr(_quiet, "on", False)


def declines() -> dict[str, int]:
    """How many governed backwards the Python route took in this process, by reason."""
    with _lock:
        return dict(_declined)


def record_refusal(kind: str) -> None:
    """graphscale refused one call of a setup DeepSpeed alone cannot run
    exactly either (``kind``: which; docs/contract.md, "What graphscale
    refuses"): counted for the process."""
    with _lock:
        _refused[kind] = _refused.get(kind, 0) + 1


def refusals() -> dict[str, int]:
    """How many calls graphscale refused in this process, by kind."""
    with _lock:
        return dict(_refused)


class unrecorded:
    """Within the block, this thread's backwards are recorded and logged
    nowhere (the native route's self-test runs graphscale's own)."""

    def __enter__(self) -> None:
        self.was = getattr(_quiet, "on", False)
        _quiet.on = True

    def __exit__(self, *exc: object) -> None:
        _quiet.on = self.was


def observing(observer_fn: Callable[..., None]) -> _Pushed:
    """Within the block, every top-level governed backward runs as
    ``observer_fn(run, *backward_args)``, which must call ``run(*backward_args)`` once."""
    return _Pushed("observers", observer_fn)


def observer() -> Callable[..., None] | None:
    """The innermost active backward observer, or None."""
    stack = ACTIVE.observers
    return stack[-1] if stack else None


def record_walk(nodes: int, seconds: float, multiplications: int) -> None:
    """Tell every active walk recorder about one walk (cheap when none is)."""
    for record in ACTIVE.walks:
        record(nodes, seconds, multiplications)


def walks_recorded() -> bool:
    """Whether any walk recorder is active."""
    return bool(ACTIVE.walks)


def _fan_out(recorders: tuple[PhaseRecorder, ...]) -> PhaseRecorder:
    if len(recorders) == 1:
        return recorders[0]

    def record(phase: str, seconds: float) -> None:
        for r in recorders:
            r(phase, seconds)

    return record


class Laps:
    """Reports the time since the last lap to the phase recorders under a
    phase's name; made only while one is active (:func:`laps`)."""

    __slots__ = ("record", "prefix", "t")

    def __init__(self, record: PhaseRecorder, prefix: str = "") -> None:
        self.record, self.prefix, self.t = record, prefix, time.perf_counter()

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.record(self.prefix + phase, now - self.t)
        self.t = now

    def skip(self) -> None:
        """Start the next lap now (what ran since is not graphscale's)."""
        self.t = time.perf_counter()


def laps(nested: bool = False) -> Laps | None:
    """A lap clock for one backward (``nested``: its phases are prefixed
    "nested "), or None while no phase recorder is active."""
    recorders = ACTIVE.phases
    return None if not recorders else Laps(_fan_out(recorders), "nested " if nested else "")
