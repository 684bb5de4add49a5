"""The governed backward: what runs in place of ``torch.autograd.backward``.

``Tensor.backward`` and DeepSpeed's ``engine.backward`` both end in
``torch.autograd.backward``, so while graphscale is installed that function is
replaced by :func:`governed_backward`, which reads the call and the factors
and hands the rest to one native call where the native module is loaded
(``_backward/route.py``; NOTE [ One native call per backward ] in
``_native/walker.cpp``), or else, and wherever that call declines, takes the
Python route here, the reference: makes a plan (or takes the fast path),
applies it with node hooks and seed scaling, runs the original, and removes
every hook in a ``finally``.

From the entry point on, one backward is one value: the call
(:class:`~graphscale._backward.call.BackwardCall`) and, once the factors are read, a
:class:`_Backward` (the call, its reading, what its seeds carry, its clocks),
so no function here takes more than a few parameters.

# NOTE [ Fast path ]
# When every installed group has the same factor f, every owned leaf is right
# with potential f everywhere: multiply the seeds by f, and plan nothing.
# That is exact when the leaves the policy protects (NOTE [ Unowned leaves ]
# in _core/snapshot.py) are not reached, and it must not happen at all when no owned
# leaf is reached (that backward is left alone).  So a probe walks first,
# only until it knows (_decide.probe): under "any" to the first owned leaf,
# a few nodes away in a real model; under "plain_params" the whole graph
# unless an owned leaf and an unowned Parameter turn up (then it plans);
# under "plain" until an owned and an unowned leaf are both seen.  f == 1
# touches nothing at all, without a probe.
# A custom-Function node may run a nested backward over leaves no walk can
# see (reentrant checkpointing; ZeRO-3 makes every Linear one).  Such a
# backward still takes the fast path (or is left alone, when no owned leaf
# is visible), and binds its graph task to the potential everything in it
# carries (f, or 1): a backward nested in it finds no plan and is planned
# from that potential (_decide.plan_nested), so hidden owned leaves get
# their factor and hidden unowned Parameters their plain gradient.  Under
# "any" nested backwards of a fast-path backward need no plan (everything
# carries f, which any leaf may take).
#
# NOTE [ Nested backward ]
# Reentrant activation checkpointing (torch's and DeepSpeed's) calls
# torch.autograd.backward from inside a node's backward, on a graph recomputed
# there, which the outer walk could not see.  torch._C._current_autograd_node()
# names that node; the outer plan gave it a potential p, so the gradients it
# received carry p.  The inner backward is planned with base p (its seeds are
# assumed to be, or be linear in, the gradients the node received, as
# checkpointing does), owned leaves pinned to their group's factor as read by
# the *outer* backward, and unowned leaves that are not nn.Parameters (the
# detached inputs through which checkpointing returns gradients to the outer
# graph) pinned to p, so the node hands back gradients at p as the outer plan
# expects.  The outer plan is found through a process-wide registry keyed by
# node (_running.find_enclosing), not through thread-local state: CUDA backward
# runs nodes on autograd worker threads.  Inside a backward that was not
# planned (the fast path, or left alone), a nested backward is planned from
# the potential its graph task is bound to (NOTE [ Fast path ]), or runs
# untouched where nothing is bound (everything carries the one factor under
# "any"; an ungoverned backward).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from .. import _native
from .._core import observation as _observation
from .._core.observation import Laps
from .._core.snapshot import Reading, State, current
from . import call as _call
from . import decide as _decide
from . import route as _route
from . import running as _running
from .call import ORIGINAL_BACKWARD, BackwardCall
from .failing import failing
from .hooks import post_hook as _post_hook  # (tests spy on it here)
from .pyplan import PyPlan
from .unreached import warn_unreached_groups

__all__ = ["governed_backward", "patch", "run_top_level"]

_log = logging.getLogger("graphscale")


# ---------------------------------------------------------------- the patch
# NOTE [ The patch outlives remove() until the backward ends ]
# remove() of the last installation may run inside a backward (a hook,
# another thread).  That backward keeps its snapshot, and the backwards
# nested in it (reentrant checkpointing recomputes and calls
# torch.autograd.backward) must still reach governed_backward to be planned
# from it; so torch.autograd.backward goes back to the original only once no
# top-level governed backward runs: at remove() if none does, else when the
# last one ends.
_patch_lock = threading.Lock()
_top_level_running = 0


def patch(on: bool) -> None:
    """Make ``torch.autograd.backward`` the governed one (``on``), or the
    original again as soon as no governed backward runs."""
    with _patch_lock:
        if on:
            torch.autograd.backward = governed_backward
        elif _top_level_running == 0 and torch.autograd.backward is governed_backward:
            torch.autograd.backward = ORIGINAL_BACKWARD


def _enter() -> None:
    global _top_level_running
    with _patch_lock:
        _top_level_running += 1


def _leave() -> None:
    global _top_level_running
    with _patch_lock:
        _top_level_running -= 1
        if _top_level_running == 0 and current() is None and torch.autograd.backward is governed_backward:
            torch.autograd.backward = ORIGINAL_BACKWARD


# ---------------------------------------------------------------- the backward
def governed_backward(
    tensors: Any,
    grad_tensors: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    grad_variables: Any = None,
    inputs: Any = None,
) -> None:
    """``torch.autograd.backward`` with every owned leaf scaled by its group's
    factor (torch's own six parameters: the one function here that takes more
    than five)."""
    current_node = torch._C._current_autograd_node()
    if current_node is not None:  # NOTE [ Nested backward ], natively, without reading the call
        if inputs is None and grad_variables is None:
            if _route.nested_call(tensors, grad_tensors, retain_graph, create_graph, current_node):
                return None
        else:
            _route.declined("inputs=")
    call = BackwardCall.of(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)
    observer = _observation.observer()
    if observer is not None:
        return observer(_governed_backward, call)
    return _governed_backward(call)


def _governed_backward(call: BackwardCall) -> None:
    current_node = torch._C._current_autograd_node()
    laps = _observation.laps(nested=current_node is not None)
    if current_node is not None:  # NOTE [ Nested backward ]: obeys the backward it runs inside
        return _run_nested(call, current_node, laps)  # (the native route had its chance in governed_backward)
    state = current()
    if state is None:
        return call.run(None)
    _enter()
    try:
        with failing():  # NOTE [ A backward that raised ] in _backward/failing.py
            return run_top_level(call, state, laps, _native.load())
    finally:
        _leave()


class _Backward:
    """One governed backward once its factors are read: the call, the reading,
    what each seed carries already, the seconds it took to walk and plan, its
    lap clock (or None)."""

    __slots__ = ("call", "reading", "carries", "walk_seconds", "laps")

    def __init__(self, call: BackwardCall, reading: Reading, carries: Sequence[float], laps: Laps | None) -> None:
        self.call, self.reading, self.carries, self.laps = call, reading, carries, laps
        self.walk_seconds = 0.0

    def lap(self, phase: str) -> None:
        if self.laps:
            self.laps(phase)

    def run(self, seeds: Any = None, hooks: bool = True, potential: float | None = None) -> None:
        """The original backward with ``seeds``, bound as :func:`_running.binding_for` says."""
        self.call.run(_running.binding_for(self.reading, hooks, potential), seeds, self.laps)


def run_top_level(call: BackwardCall, state: State, laps: Laps | None, native: Any) -> None:
    """The top-level backward ``call`` governed by ``state``: through the
    native module ``native`` where it takes it (NOTE [ Which route governs a
    backward ] in _backward/route.py), else on the Python route here."""
    if state.pending:  # NOTE [ FSDP2's backward leaves ] in _adapters/fsdp.py
        state = state.ready()
    if call.roots is None:
        return call.run(None)  # malformed: torch raises its own error
    scaling, default_carries = _running.engine_backward_frame()
    reading = state.read(scaling)  # may raise: nothing touched yet
    carries = _call.carries(call.roots, default_carries)
    why = _route.decline_reason(call, native)
    if why is None and _route.top_level(native, call, reading, carries, laps):
        return None  # NOTE [ One native call per backward ] in _native/walker.cpp
    if why is not None:  # (a decline of the native call itself was counted there)
        _route.declined(why)
    b = _Backward(call, reading, carries, laps)
    b.lap("prepare")
    t0 = time.perf_counter()
    decision = _decide.decide(call.roots, reading, call.inputs, all(c == 1.0 for c in b.carries))
    b.walk_seconds = time.perf_counter() - t0
    b.lap("walk+plan")
    if decision.kind == _decide.UNTOUCHED:
        return b.run(potential=decision.nested)
    if decision.kind == _decide.FAST_PATH:
        return _run_fast_path(b, decision.factor, decision.nested)
    plan = decision.plan
    if plan.unowned_params and not plan.custom_nodes:  # (a custom Function may hide a group's leaves)
        warn_unreached_groups(state, plan)
    return _run_plan(b, plan)


def _run_fast_path(b: _Backward, f: float, nested: float | None) -> None:
    """NOTE [ Fast path ]: every seed times ``f``, nothing planned; ``nested``:
    the potential backwards nested in it are planned from, or None."""
    call = b.call
    assert call.roots is not None and call.grads is not None
    mults = [f / c for c in b.carries]
    seeds = _call.scaled_seeds(call.roots, call.grads, mults)
    if seeds is None:
        return b.run()  # a seed torch cannot make: torch raises its own error
    b.lap("seeds")
    scaled = sum(1 for m in mults if m != 1.0)
    if _observation.walks_recorded():  # no plan: the probe's time
        _observation.record_walk(0, b.walk_seconds, scaled)
    if _log.isEnabledFor(logging.DEBUG) and not _observation.quiet():
        _log.debug(
            "graphscale: fast path, walked 0 nodes in %.1f us, %d multiplication(s) (root seeds x %g), "
            "factors %s; the time is the probe's, nothing was planned%s", b.walk_seconds * 1e6, scaled, f,
            sorted({f"{g.name}={v:g}" for g, v in b.reading.factors.items()}),
            "; backwards nested in it will be" if nested is not None else "",
        )
    return b.run(seeds, potential=nested)


def _run_nested(call: BackwardCall, current_node: Any, laps: Laps | None) -> None:
    """A backward called from inside ``current_node``'s backward: NOTE [ Nested backward ]."""
    if call.roots is None:
        return call.run(None)
    if laps:
        laps("prepare")
    t0 = time.perf_counter()
    found = _decide.plan_nested(current_node, call.roots, call.inputs)
    walk_seconds = time.perf_counter() - t0
    if laps:
        laps("walk+plan")
    if found is None:  # inside a fast-path or ungoverned backward: untouched, bound as it is
        return call.run(_running.binding_for(_running.task_reading()), laps=laps)
    reading, plan = found
    b = _Backward(call, reading, [plan.base] * len(call.roots), laps)
    b.walk_seconds = walk_seconds
    return _run_plan(b, plan)


def _run_plan(b: _Backward, plan: Any) -> None:
    """Scale the seeds, hook the nodes, run the backward with its plan
    registered for nested backwards, unhook in ``finally``.  ``b.carries``:
    what each seed carries already (the plan's seeds assume ``plan.base``)."""
    call = b.call
    assert call.roots is not None and call.grads is not None
    plan_seeds, base = plan.seeds, plan.base  # each read of a native plan's field converts it: once
    mults = [s * base / c for s, c in zip(plan_seeds, b.carries)]
    edge_mults = plan.multiplications - sum(1 for s in plan_seeds if s != 1.0)
    multiplications = edge_mults + sum(1 for m in mults if m != 1.0)
    if _observation.walks_recorded():
        _observation.record_walk(plan.num_nodes, b.walk_seconds, multiplications)
    seeds: Any = None
    if multiplications:
        seeds = _call.scaled_seeds(call.roots, call.grads, mults)
        if seeds is None:
            return b.run()
        b.lap("seeds")
    # else nothing to scale or hook (the usual nested backward, NOTE [ Checkpoint hints ])
    if _log.isEnabledFor(logging.DEBUG) and not _observation.quiet():
        _debug_plan(b, plan, multiplications)
    handles = []
    try:
        if edge_mults:
            for node, mults_ in plan.hooks():
                handles.append(node.register_hook(_post_hook(mults_, b.laps)))
        with _running.running_plan(_running.Running(plan, b.reading)):
            b.lap("hooks on")
            b.run(seeds, plan.tensor_hooks)
    finally:
        for h in handles:
            h.remove()
        b.lap("hooks off")


def _debug_plan(b: _Backward, plan: Any, multiplications: int) -> None:
    _log.debug(  # the walker last: tests/test_native_walker.py reads it
        "graphscale: walked %d nodes in %.1f us, %d multiplication(s), factors %s%s, %s walker",
        plan.num_nodes, b.walk_seconds * 1e6, multiplications,
        sorted({f"{g.name}={f:g}" for g, f in b.reading.factors.items()}),
        f", nested at base {plan.base:g}" if plan.base != 1.0 else "",
        "python" if isinstance(plan, PyPlan) else "native",
    )
