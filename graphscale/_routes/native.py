"""The native route: a governed backward in one call into the native module.

Python keeps what only Python can read (the call's arguments, every group's
factor, what the seeds carry) and the observation points; the rest (decide,
walk, plan, seeds, hooks, bind, register, run, take it all back) is native.
Whether it takes a backward is the gate's decision (``_backward/gate.py``);
the Python route (``_routes/python.py``) stays the exact reference.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

from .. import _native
from .._backward import gate as _gate
from .._backward import running as _running
from .._backward.call import BackwardCall
from .._backward.frames import Frame
from .._backward.hints import checkpoint_hint_positions
from .._backward.native_backend import native_owners
from .._backward.unreached import warn_unreached_groups
from .._core import observation as _observation
from .._core.observation import Laps
from .._core.snapshot import Reading, State

__all__ = ["declined", "governor", "nested_governor", "govern_natively", "govern_nested_natively"]

_log = logging.getLogger("graphscale")

_PHASES = ("walk+plan", "seeds", "hooks on", "bind", "hook calls", "hooks off")

# What the one native call does: see NOTE [ One native call per backward ] in _native/registry.h;
# which route takes a backward: see NOTE [ Which route governs a backward ] in _backward/gate.py;
# where the running state is kept: see NOTE [ One running state, both routes ] in _native/registry.h.
# GRAPHSCALE_ROUTE=python in the environment (or gate.set_route_enabled) runs every backward through
# the Python route, with the native walker's plans; GRAPHSCALE_WALKER=python with the Python walker's too.


def declined(reason: str) -> None:
    """Count one backward the Python route takes for ``reason``."""
    _observation.record_route("python", reason)


def governor(native: Any, state: State) -> Any:
    """The native ``Governor`` of ``state``, made once per snapshot, or None
    while the running state cannot move to ``native`` yet (a backward runs on
    the Python one).  (See NOTE [ Per-snapshot tables ] in _core/snapshot.py.)"""
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


def _native_call(fn: Any, args: tuple[Any, ...], laps: Laps | None, reading: Reading | None, debug: bool) -> bool:
    """``fn(*args, want_stats)``, one native call, and what it measured handed
    to the active recorders and the DEBUG log (``reading``: a top-level
    backward's factors; None: a nested backward; ``debug``: the logger is at
    DEBUG); False when it declined (touched nothing; the decline is
    counted)."""
    debug = debug and not _observation.quiet()
    want = laps is not None or debug or bool(_observation.ACTIVE.walks)
    if laps:
        laps("prepare")
    out = fn(*args, want)
    if out is None and not _observation.ACTIVE.routes:
        return True  # the usual backward: governed, nothing to observe
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
    take it (the gate's reason counted, nothing touched)."""
    state = reading.state
    made = state.tables.native_governor
    if native is None:
        native = made[0] if made is not None else _native.load()
    debug = _log.isEnabledFor(logging.DEBUG)  # (the gate's input too)
    why = _gate.reason(native, call.inputs, debug)
    if why is None and made is not None and made[0] is native and _running.state.module is native:
        # governor()'s first line, inline (a copy kept for speed): a Python call fewer on every backward
        # (benchmarks/cost.py --calls-only, issue 49: mixed-loss 42 -> 43; 44, past the gate's margin, with
        # gate.reason's inline compiled-autograd check gone too).
        gov = made[1]
    else:
        gov = governor(native, state) if why is None else None
    if gov is None:
        declined(why or "native walker not ready")
        return False
    assert call.grads is not None
    return _native_call(native.top, (gov, call.roots, list(call.grads), reading, reading.factor_list,
                                     (call.retain_graph, call.create_graph, call.inputs_arg), frame.carries,
                                     frame), frame.laps, reading, debug)


def govern_nested_natively(call: BackwardCall, current_node: Any) -> bool:
    """Govern ``call``, a backward called from inside ``current_node``'s
    backward (see NOTE [ Nested backward ] in _entry/entry.py) that the native front
    handed on (or made before the front was adopted), in one native call.
    False: not taken (nothing touched; the decline counted); the Python route
    takes it."""
    native = _running.state.module  # the module the running state is in
    why = _gate.reason(native, call.inputs or call.grad_variables is not None)  # (grad_variables: Python's too)
    if why is None and call.roots is None:
        why = "call"  # malformed: torch raises its own error through the Python route
    if why is not None:
        declined(why)
        return False
    assert call.grads is not None
    laps = _observation.laps(nested=True) if _observation.ACTIVE.phases else None
    return _native_call(native.govern_nested,
                        (current_node, call.roots, list(call.grads), (call.retain_graph, call.create_graph, None)),
                        laps, None, _log.isEnabledFor(logging.DEBUG))
