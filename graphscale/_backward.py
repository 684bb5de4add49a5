"""The governed backward: what runs in place of ``torch.autograd.backward``.

``Tensor.backward`` and DeepSpeed's ``engine.backward`` both end in
``torch.autograd.backward``, so while graphscale is installed that function is
replaced by :func:`governed_backward`, which reads the factors, makes a plan
(or takes the fast path), applies it with node hooks and seed scaling, runs
the original, and removes every hook in a ``finally``.

# NOTE [ Fast path ]
# When every installed group has the same factor f, every owned leaf is right
# with potential f everywhere: multiply the seeds by f, and plan nothing.
# That is exact when the leaves the policy protects (NOTE [ Unowned leaves ]
# in _state.py) are not reached, and it must not happen at all when no owned
# leaf is reached (that backward is left alone).  So a probe walks first,
# only until it knows (_planning.probe): under "any" to the first owned leaf,
# a few nodes away in a real model; under "plain_params" the whole graph
# unless an owned leaf and an unowned Parameter turn up (then it plans);
# under "plain" until an owned and an unowned leaf are both seen.  f == 1
# touches nothing at all, without a probe.
# A custom-Function node may run a nested backward over leaves no walk can
# see (reentrant checkpointing; ZeRO-3 makes every Linear one).  Such a
# backward still takes the fast path (or is left alone, when no owned leaf
# is visible), and binds its graph task to the potential everything in it
# carries (f, or 1): a backward nested in it finds no plan and is planned
# from that potential (_planning.plan_nested), so hidden owned leaves get
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
# node (_state.find_enclosing), not through thread-local state: CUDA backward
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
from collections.abc import Mapping, Sequence
from typing import Any, Callable, NamedTuple

import torch

from . import _call, _observe, _planning, _state
from ._group import Group
from ._state import State

__all__ = ["governed_backward", "ORIGINAL_BACKWARD", "patch", "BackwardCall"]

_log = logging.getLogger("graphscale")

ORIGINAL_BACKWARD: Callable[..., None] = torch.autograd.backward


# ---------------------------------------------------------------- the call
class BackwardCall(NamedTuple):
    """One call of ``torch.autograd.backward``, as given and as planned for.

    ``roots``/``grads``: one entry per root (a grad None where torch makes the
    seed), or None when the call is malformed (torch's own error is the right
    one) or uses the deprecated ``grad_variables``.  ``inputs``: the
    ``inputs=`` tensors as a tuple.  Iterables are read once here, so torch is
    handed the same items graphscale planned for.
    """

    tensors: Any
    grad_tensors: Any
    retain_graph: bool | None
    create_graph: bool
    grad_variables: Any
    inputs_arg: Any
    roots: tuple[Any, ...] | None
    grads: tuple[Any, ...] | None
    inputs: tuple[Any, ...]

    @classmethod
    def of(cls, tensors: Any, grad_tensors: Any, retain_graph: bool | None, create_graph: bool,
           grad_variables: Any, inputs: Any) -> BackwardCall:
        tensors, grad_tensors = _call.materialize(tensors), _call.materialize(grad_tensors)
        inputs = _call.materialize(inputs)
        norm = None if grad_variables is not None else _call.normalize(tensors, grad_tensors)
        in_tuple = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
        return cls(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs,
                   None if norm is None else norm[0], None if norm is None else tuple(norm[1]), in_tuple)

    def run(self, state: State | None, seeds: Any = None, hooks: bool = True, laps: _observe.Laps | None = None,
            nested: tuple[Mapping[Group, float], float] | None = None) -> None:
        """The original backward, with ``seeds`` in place of the given seeds if
        not None, its graph task bound to ``state`` when that governs engines
        and the graph may hold their output hooks (``hooks``: a plan found
        tensor hooks in it, or none looked; NOTE [ Which snapshot an output
        hook obeys ] in _state.py), or when ``nested`` (factors, potential)
        says how to plan a backward nested in it (NOTE [ Fast path ])."""
        bind = nested is not None or (state is not None and state.engines and hooks)
        if state is None or not bind or self.roots is None:
            if laps:
                laps.skip()
            return ORIGINAL_BACKWARD(
                self.tensors, self.grad_tensors if seeds is None else seeds, self.retain_graph, self.create_graph,
                grad_variables=self.grad_variables, inputs=self.inputs_arg,
            )
        grads = self.grads if seeds is None else seeds
        assert grads is not None  # normalized with the roots
        factors, potential = nested if nested is not None else (None, None)
        with _state.bound(self.roots, _state.Binding(state, factors, potential)) as roots:
            if laps:
                laps("bind")
            ORIGINAL_BACKWARD(roots, list(grads), self.retain_graph, self.create_graph, inputs=self.inputs_arg)
            if laps:
                laps.skip()


def _post_hook(mults: tuple[tuple[int, float], ...], laps: _observe.Laps | None) -> Callable[..., Any]:
    def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
        out = list(grad_inputs)
        for k, m in mults:
            g = out[k]
            if g is not None:
                out[k] = g * m
        return tuple(out)

    if laps is None:
        return hook
    record, name = laps.record, laps.prefix + "hook calls"

    def timed(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
        t0 = time.perf_counter()
        out = hook(grad_inputs, grad_outputs)
        record(name, time.perf_counter() - t0)
        return out

    return timed


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
        if _top_level_running == 0 and _state.current() is None and torch.autograd.backward is governed_backward:
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
    """``torch.autograd.backward`` with every owned leaf scaled by its group's factor."""
    observer = _observe.observer()
    if observer is not None:
        return observer(_governed_backward, tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)
    return _governed_backward(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)


def _governed_backward(tensors: Any, grad_tensors: Any, retain_graph: bool | None, create_graph: bool,
                       grad_variables: Any, inputs: Any) -> None:
    current = torch._C._current_autograd_node()
    laps = _observe.laps(nested=current is not None)
    call = BackwardCall.of(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)
    if current is not None:  # NOTE [ Nested backward ]: obeys the backward it runs inside
        return _run_nested(call, current, laps)
    state = _state.current()
    if state is None:
        return call.run(None)
    _enter()
    try:
        return _run_top_level(call, state, laps)
    finally:
        _leave()


def _run_top_level(call: BackwardCall, state: State, laps: _observe.Laps | None) -> None:
    if state.pending:  # NOTE [ FSDP2's backward leaves ]
        state = state.ready()
    # NOTE [ Which snapshot an output hook obeys ]: call.run binds the graph task
    if call.roots is None:
        return call.run(state)
    scaling, default_carries = _state.engine_backward_frame()
    factors = state.read_factors(scaling)  # may raise: nothing touched yet
    carries = _call.carries(call.roots, default_carries)
    if laps:
        laps("prepare")
    t0 = time.perf_counter()
    decision = _planning.decide(call.roots, state, factors, call.inputs, all(c == 1.0 for c in carries))
    walked = time.perf_counter() - t0
    if laps:
        laps("walk+plan")
    nested = None if decision.nested is None else (factors, decision.nested)
    if decision.kind == _planning.UNTOUCHED:
        return call.run(state, laps=laps, nested=nested)
    if decision.kind == _planning.FAST_PATH:
        return _run_fast_path(call, state, decision.factor, carries, factors, walked, laps, nested)
    plan = decision.plan
    if plan.unowned_params and not plan.custom_nodes:  # (a custom Function may hide a group's leaves)
        _planning.warn_unreached_groups(state, plan)
    return _run_plan(call, plan, _state.Running(plan, factors, state), walked, carries, laps)


def _run_fast_path(call: BackwardCall, state: State, f: float, carries: Sequence[float],
                   factors: Mapping[Group, float], walked: float, laps: _observe.Laps | None,
                   nested: tuple[Mapping[Group, float], float] | None) -> None:
    """NOTE [ Fast path ]: every seed times ``f``, nothing planned."""
    assert call.roots is not None and call.grads is not None
    mults = [f / c for c in carries]
    seeds = _call.scaled_seeds(call.roots, call.grads, mults)
    if seeds is None:
        return call.run(state)
    if laps:
        laps("seeds")
    if _observe.walks_recorded():  # no plan: the probe's time
        _observe.record_walk(0, walked, sum(1 for m in mults if m != 1.0))
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug(
            "graphscale: fast path, walked 0 nodes in %.1f us, %d multiplication(s) (root seeds x %g), "
            "factors %s; the time is the probe's, nothing was planned%s",
            walked * 1e6, sum(1 for m in mults if m != 1.0), f, sorted({f"{g.name}={v:g}" for g, v in factors.items()}),
            "; backwards nested in it will be" if nested is not None else "",
        )
    return call.run(state, seeds, laps=laps, nested=nested)


def _run_nested(call: BackwardCall, current: Any, laps: _observe.Laps | None) -> None:
    """A backward called from inside ``current``'s backward: NOTE [ Nested backward ]."""
    if call.roots is None:
        return call.run(_state.task_state())
    if laps:
        laps("prepare")
    t0 = time.perf_counter()
    found = _planning.plan_nested(current, call.roots, call.inputs)
    walked = time.perf_counter() - t0
    if laps:
        laps("walk+plan")
    if found is None:  # inside a fast-path or ungoverned backward: untouched, bound as it is
        return call.run(_state.task_state(), laps=laps)
    enclosing, plan = found
    entry = _state.Running(plan, enclosing.factors, enclosing.state)
    return _run_plan(call, plan, entry, walked, [plan.base] * len(call.roots), laps)


def _run_plan(call: BackwardCall, plan: Any, entry: _state.Running, walked: float, carries: Sequence[float],
              laps: _observe.Laps | None) -> None:
    """Scale the seeds, hook the nodes, run the backward with ``entry``
    registered for nested backwards, unhook in ``finally``.  ``carries``:
    what each seed carries already (the plan's seeds assume ``plan.base``);
    ``walked``: the seconds it took to walk and plan."""
    assert call.roots is not None and call.grads is not None
    plan_seeds, base = plan.seeds, plan.base  # each read of a native plan's field converts it: once
    mults = [s * base / c for s, c in zip(plan_seeds, carries)]
    edge_mults = plan.multiplications - sum(1 for s in plan_seeds if s != 1.0)
    multiplications = edge_mults + sum(1 for m in mults if m != 1.0)
    if _observe.walks_recorded():
        _observe.record_walk(plan.num_nodes, walked, multiplications)
    seeds: Any = None
    if multiplications:
        seeds = _call.scaled_seeds(call.roots, call.grads, mults)
        if seeds is None:
            return call.run(entry.state)
        if laps:
            laps("seeds")
    # else nothing to scale or hook (the usual nested backward, NOTE [ Checkpoint hints ])
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug(  # the walker last: tests/test_native_walker.py reads it
            "graphscale: walked %d nodes in %.1f us, %d multiplication(s), factors %s%s, %s walker",
            plan.num_nodes, walked * 1e6, multiplications,
            sorted({f"{g.name}={f:g}" for g, f in entry.factors.items()}),
            f", nested at base {plan.base:g}" if plan.base != 1.0 else "",
            "python" if isinstance(plan, _planning.PyPlan) else "native",
        )
    handles = []
    try:
        if edge_mults:
            for node, mults_ in plan.hooks():
                handles.append(node.register_hook(_post_hook(mults_, laps)))
        with _state.running_plan(entry):
            if laps:
                laps("hooks on")
            call.run(entry.state, seeds, plan.tensor_hooks, laps)
    finally:
        for h in handles:
            h.remove()
        if laps:
            laps("hooks off")
