"""The native route: a governed backward in one call into the native module.

NOTE [ One native call per backward ] in ``_native/walker.cpp`` says what
that call does.  Python keeps what only Python can read (the call's
arguments, every group's factor, what the seeds carry) and the observation
points; the rest — decide, walk, plan, scale the seeds, hook, bind, register
for nested backwards, run the original, take it all back — is native.  The
native call declines (returns NotImplemented, touching nothing) what the
Python route handles (``_backward.py``), which stays the exact reference:
``GRAPHSCALE_ROUTE=python`` in the environment (or ``enabled = False`` here)
runs every backward through it, with the native walker's plans;
``GRAPHSCALE_WALKER=python`` with the Python walker's too.
"""
from __future__ import annotations

import logging
import os
import weakref
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from . import _call, _native, _observe, _running
from ._call import BackwardCall
from ._hints import checkpoint_hint_positions
from ._observe import Laps
from ._planning import native_owners
from ._snapshot import Reading, State
from ._unreached import warn_unreached_groups

__all__ = ["ROUTE_ENV", "enabled", "bind", "usable", "governor", "top_level", "nested_call"]

ROUTE_ENV = "GRAPHSCALE_ROUTE"  # "python": every backward takes the Python route (CI runs tests so)
enabled = os.environ.get(ROUTE_ENV, "native").strip().lower() != "python"  # tests switch it too

bind = True  # tests that break the graph task's binding on purpose set it False (tests/test_thread_governance.py)

_log = logging.getLogger("graphscale")
_configured: Any = None  # the native module the process-wide registry was handed to
_PHASES = ("walk+plan", "seeds", "hooks on", "bind", "hook calls", "hooks off")


def usable(call: BackwardCall) -> bool:
    """Whether the native route may take ``call``: switched on, no ``inputs=``
    (the Python route pins them), no debug log to write (the Python route
    writes it)."""
    return enabled and not call.inputs and call.roots is not None and not _log.isEnabledFor(logging.DEBUG)


def governor(native: Any, state: State) -> Any:
    """The native ``Governor`` of ``state``, made once per snapshot (NOTE [
    Per-snapshot tables ] in _snapshot.py)."""
    global _configured
    if _configured is not native:
        native.configure(_running._running, _running.Running, _running.Binding, _running._by_task,
                         _call, torch.nn.Parameter, torch.nn.Module)
        _configured = native
    made = state.tables.native_governor
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


def _native_call(fn: Any, args: tuple[Any, ...], laps: Laps | None) -> bool:
    """``fn(*args, want_stats)``, one native call, and what it measured handed
    to the active recorders; False when it declined (touched nothing)."""
    want = laps is not None or _observe.walks_recorded()
    if laps:
        laps("prepare")
    out = fn(*args, want)
    if out is NotImplemented:
        return False
    if want:
        _observed(out, laps)
    return True


def _observed(stats: Any, laps: Laps | None) -> None:
    """Hand what the native call measured to the active recorders."""
    kind, nodes, mults, *ns = stats
    if kind and _observe.walks_recorded():
        _observe.record_walk(nodes if kind == 2 else 0, ns[0] * 1e-9, mults)
    if laps:
        for name, t in zip(_PHASES, ns):
            laps.record(laps.prefix + name, t * 1e-9)
        laps.skip()


def top_level(native: Any, call: BackwardCall, reading: Reading, carries: list[float], laps: Laps | None) -> bool:
    """Run the top-level backward ``call`` under ``reading`` natively; False
    when the native call declined (nothing was touched)."""
    state = reading.state
    gov = governor(native, state)
    factors = [reading.factors[g] for g in state.groups]
    assert call.grads is not None
    return _native_call(gov.top, (call.roots, list(call.grads), factors, carries, reading,
                                  (call.retain_graph, call.create_graph, call.inputs_arg, bind)), laps)


def nested_call(tensors: Any, grad_tensors: Any, retain_graph: bool | None, create_graph: bool,
                current_node: Any) -> bool:
    """A backward nested in ``current_node``'s backward (NOTE [ Nested
    backward ] in _backward.py), taken natively straight from
    ``torch.autograd.backward``'s arguments (roots: a tensor or edge, or a
    tuple or list of them; seeds None, a tensor, or a tuple or list of them;
    no ``inputs=``): the call a reentrant checkpoint makes once per block,
    read without building a :class:`BackwardCall`.  False: not taken
    (nothing touched); the Python route takes it."""
    if not enabled or _configured is None:
        return False
    native = _native.load()
    if native is not _configured or _log.isEnabledFor(logging.DEBUG):
        return False
    if isinstance(tensors, (torch.Tensor, GradientEdge)):
        roots: Any = (tensors,)
    elif type(tensors) in (tuple, list):
        roots = tuple(tensors)
    else:
        return False  # an iterable torch reads once: the Python route reads it
    if grad_tensors is None:
        grads: Any = [None] * len(roots)
    elif isinstance(grad_tensors, torch.Tensor):
        grads = [grad_tensors]
    elif type(grad_tensors) in (tuple, list):
        grads = list(grad_tensors)
    else:
        return False
    return _native_call(native.govern_nested, (current_node, roots, grads, (retain_graph, create_graph, None, bind)),
                        _observe.laps(nested=True))
