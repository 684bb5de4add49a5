"""The governed backward: what runs in place of ``torch.autograd.backward``.

``Tensor.backward`` and DeepSpeed's ``engine.backward`` both end in
``torch.autograd.backward``, so while graphscale is installed that function is
replaced by :func:`governed_backward`, which reads the factors, makes a plan
(or takes the fast path), applies it with node hooks and seed scaling, runs
the original, and removes every hook in a ``finally``.

# NOTE [ Fast path ]
# When every installed group has the same factor f and unowned leaves may take
# any single factor (unowned="any"), every leaf is right with potential f
# everywhere: multiply the seeds by f and walk nothing.  f == 1 touches nothing
# at all.
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
# node, not through thread-local state: CUDA backward runs nodes on autograd
# worker threads.  Inside a fast-path backward everything already carries the
# one factor, so a nested backward found in no walked plan runs untouched.
#
# NOTE [ Unowned leaves in nested backward ]
# An unowned leaf may be reached by the outer backward and by nested ones
# (an unowned layer used inside and outside a checkpointed segment, or in two
# segments under different groups).  Left free, each plan would give it the
# potential of its own surroundings and its gradient would mix factors, which
# even unowned="any" forbids.  So a nested plan pins each unowned leaf to the
# potential a running (enclosing) plan already gave its AccumulateGrad node;
# an unowned Parameter that none has seen is pinned to 1, the same value in
# every nested backward; an unseen non-Parameter leaf is a carrier (above).
# Known limit: a requires-grad non-Parameter tensor that a checkpointed
# function closes over, and that the outer graph never reaches, looks like a
# carrier and gets the carrier's potential.
#
# NOTE [ Nested backward through the enclosing graph ]
# A custom Function's backward may call torch.autograd.backward on tensors of
# the enclosing graph itself (it kept one from forward).  Those nodes already
# carry the enclosing plan's hooks, which stay registered while it runs.  The
# nested plan pins each such node to the potential the enclosing plan gave it
# and places no multiplication on edges leaving it: the enclosing hooks
# already apply exactly those ratios, and a second hook would scale twice.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from ._group import Group
from ._plan import Plan, make_plan
from ._walk import walk

__all__ = ["governed_backward", "gas_scaling", "ORIGINAL_BACKWARD", "State", "build_plan", "fast_path_factor"]

_log = logging.getLogger("graphscale")

ORIGINAL_BACKWARD: Callable[..., None] = torch.autograd.backward


@dataclass(frozen=True)
class State:
    """A snapshot of what is installed, read once per backward."""

    groups: tuple[Group, ...]
    owner: dict[int, Group]  # id(leaf tensor) -> group; the groups keep the leaves alive
    raw: bool  # unowned leaves must get exactly their plain gradient


_state: State | None = None


def set_state(state: State | None) -> None:
    global _state
    _state = state


def current_state() -> State | None:
    return _state


# ---------------------------------------------------------------- scale_wrt_gas
_tls = threading.local()


@contextmanager
def gas_scaling(enabled: bool) -> Iterator[None]:
    """Within this block, top-level governed backwards on this thread apply
    the GAS factors only if ``enabled`` (``engine.backward(scale_wrt_gas=...)``)."""
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    stack.append(enabled)
    try:
        yield
    finally:
        stack.pop()


def _gas_scaling_enabled() -> bool:
    stack = getattr(_tls, "stack", None)
    return stack[-1] if stack else True


# NOTE [ Which snapshot an output hook obeys ]
# DeepSpeed's output hooks fire in the middle of a backward, long after the
# backward read its State snapshot.  If they asked "is the engine installed
# now?", a remove() in between (from a backward hook, or from another thread)
# would make them divide inside a backward whose plan already scales the
# engine's leaves: scaled twice, silently.  So each top-level governed backward
# pushes its snapshot on a thread-local stack while it runs, and the adapter's
# hook asks governing_state() first.  CPU nodes run on the thread that called
# backward, so on CPU this is exact; on autograd device threads (CUDA) the
# stack is empty and the adapter falls back to whether the engine is installed.
def governing_state() -> State | None:
    """The snapshot of the governed backward running on this thread, if any."""
    stack = getattr(_tls, "governing", None)
    return stack[-1] if stack else None


# ---------------------------------------------------------------- active plans
@dataclass(eq=False)
class _Active:
    plan: Plan
    factors: dict[Group, float]
    state: State


_active: list[_Active] = []  # walked plans whose backward is running, any thread
_active_lock = threading.Lock()


def _find_outer(node: Any) -> tuple[_Active, float] | None:
    with _active_lock:
        candidates = list(_active)
    for act in reversed(candidates):
        i = act.plan.graph.index.get(node)
        if i is not None:
            return act, act.plan.phi[i]
    return None


def _enclosing_phi(node: Any) -> float | None:
    """The potential a running plan gave ``node``, or None where none saw it."""
    with _active_lock:
        candidates = list(_active)
    for act in reversed(candidates):
        i = act.plan.graph.index.get(node)
        if i is not None:
            return act.plan.phi[i]
    return None


# ---------------------------------------------------------------- planning
def _root_node(t: Any) -> Any:
    if isinstance(t, GradientEdge):
        return t.node
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        return get_gradient_edge(t).node
    return None


def build_plan(
    roots: Sequence[Any],
    state: State,
    factors: dict[Group, float],
    base: float = 1.0,
    carrier: float | None = None,
    inputs: Sequence[Any] = (),
    outer_phi: Callable[[Any], float | None] | None = None,
) -> Plan:
    """Walk from ``roots`` and choose potentials (see NOTE [ Potentials ]).

    ``carrier``: in a nested backward, the potential that unowned
    non-Parameter leaves must end at (NOTE [ Nested backward ]).
    ``outer_phi``: in a nested backward, the potential the enclosing plans gave
    a node (None where they have not seen it); unowned leaves keep it, so each
    gets one factor over the whole backward (NOTE [ Unowned leaves in nested
    backward ]).
    """
    root_nodes = [_root_node(t) for t in roots]
    graph = walk(root_nodes)
    owner = state.owner
    raw = state.raw
    pins: dict[int, float] = {}
    for i, var in graph.leaves.items():
        g = owner.get(id(var))
        if g is not None:
            pins[i] = factors[g]
            continue
        seen = outer_phi(graph.nodes[i]) if outer_phi is not None else None
        if seen is not None:
            pins[i] = seen
        elif carrier is not None and not isinstance(var, torch.nn.Parameter):
            pins[i] = carrier
        elif raw or carrier is not None:
            pins[i] = 1.0
    if raw:
        for t in inputs:  # non-leaf inputs= tensors receive .grad too
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                j = graph.index.get(t.grad_fn)
                if j is not None:
                    pins[j] = carrier if carrier is not None else 1.0
    enclosed: set[int] = set()  # NOTE [ Nested backward through the enclosing graph ]
    if outer_phi is not None:
        for i, node in enumerate(graph.nodes):
            if i not in graph.leaves:
                seen = outer_phi(node)
                if seen is not None:
                    pins[i] = seen
                    enclosed.add(i)
    index = graph.index
    root_idx = [index[n] if n is not None else -1 for n in root_nodes]
    plan = make_plan(graph, pins, root_idx, base=base)
    if enclosed:  # their hooks are in place already: placing them again would scale twice
        plan = replace(plan, edge_mults={u: m for u, m in plan.edge_mults.items() if u not in enclosed})
    return plan


def _post_hook(mults: tuple[tuple[int, float], ...]) -> Callable[..., Any]:
    def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
        out = list(grad_inputs)
        for k, m in mults:
            g = out[k]
            if g is not None:
                out[k] = g * m
        return tuple(out)

    return hook


def _scaled_seeds(roots: tuple[Any, ...], grads: list[Any], mults: Sequence[float]) -> list[Any] | None:
    """Seeds multiplied by ``mults``; None when a seed cannot be made (let torch raise)."""
    out = list(grads)
    for r, m in enumerate(mults):
        if m == 1.0:
            continue
        g = out[r]
        if g is None:
            t = roots[r]
            if isinstance(t, GradientEdge):  # implicit seed of a scalar edge, as torch makes it
                md = t.node._input_metadata[t.output_nr]
                if md.is_nested_tensor or torch.Size(md.shape).numel() != 1:
                    return None
                g = torch.ones(md.shape, dtype=md.dtype, device=md.device)
            elif not isinstance(t, torch.Tensor) or t.numel() != 1:
                return None
            else:
                g = torch.ones_like(t, memory_format=torch.preserve_format)
        out[r] = g * m
    return out


def _materialize(arg: Any) -> Any:
    """``arg`` as a tuple when it is an iterable other than a tensor, tuple or list."""
    if arg is None or isinstance(arg, (torch.Tensor, tuple, list)):  # GradientEdge is a tuple
        return arg
    try:
        return tuple(arg)
    except TypeError:  # not iterable: torch's own error message is the right one
        return arg


def _normalize(tensors: Any, grad_tensors: Any) -> tuple[tuple[Any, ...], list[Any]] | None:
    if isinstance(tensors, (torch.Tensor, GradientEdge)):
        roots: tuple[Any, ...] = (tensors,)
    else:
        roots = tuple(tensors)
    if grad_tensors is None:
        grads: list[Any] = [None] * len(roots)
    elif isinstance(grad_tensors, torch.Tensor):
        grads = [grad_tensors]
    else:
        grads = list(grad_tensors)
    if len(grads) != len(roots):
        return None
    for t in roots:
        if isinstance(t, GradientEdge):
            continue
        if not isinstance(t, torch.Tensor) or (t.grad_fn is None and not t.requires_grad):
            return None
    return roots, grads


def fast_path_factor(state: State, factors: dict[Group, float]) -> float | None:
    """The one factor a top-level backward multiplies every root seed by without
    walking (1.0: it touches nothing), or None when it must walk and plan.
    See NOTE [ Fast path ]; :func:`graphscale.explain` asks the same question."""
    distinct = set(factors.values())
    if state.raw:
        return 1.0 if distinct <= {1.0} else None
    if len(distinct) <= 1:
        return distinct.pop() if distinct else 1.0
    return None


# An observer wraps every governed backward while set (graphscale.audit sets
# it): observer(run, *backward_args) must call run(*backward_args) once.
_observer: Callable[..., None] | None = None


def governed_backward(
    tensors: Any,
    grad_tensors: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    grad_variables: Any = None,
    inputs: Any = None,
) -> None:
    """``torch.autograd.backward`` with every owned leaf scaled by its group's factor."""
    observer = _observer
    if observer is not None:
        return observer(_governed_backward, tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)
    return _governed_backward(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)


def _governed_backward(
    tensors: Any,
    grad_tensors: Any,
    retain_graph: bool | None,
    create_graph: bool,
    grad_variables: Any,
    inputs: Any,
) -> None:
    # torch takes any iterable; a generator can be read once, so read it here
    # and hand torch the same items graphscale planned for.
    tensors, grad_tensors, inputs = _materialize(tensors), _materialize(grad_tensors), _materialize(inputs)
    state = _state

    def passthrough(seeds: Any = grad_tensors) -> None:
        # NOTE [ Which snapshot an output hook obeys ]: top level only; a nested
        # backward obeys the snapshot of the backward it runs inside.
        governing = None
        if state is not None and torch._C._current_autograd_node() is None:
            governing = getattr(_tls, "governing", None)
            if governing is None:
                governing = _tls.governing = []
            governing.append(state)
        try:
            ORIGINAL_BACKWARD(
                tensors, seeds, retain_graph, create_graph, grad_variables=grad_variables, inputs=inputs
            )
        finally:
            if governing is not None:
                governing.pop()

    if state is None or grad_variables is not None:
        return passthrough()
    norm = _normalize(tensors, grad_tensors)
    if norm is None:  # malformed call: torch's own error message is the right one
        return passthrough()
    roots, grads = norm
    in_list = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else inputs)

    current = torch._C._current_autograd_node()
    if current is not None:
        found = _find_outer(current)
        if found is None:  # inside a fast-path or ungoverned backward: see NOTE [ Nested backward ]
            return passthrough()
        outer, p = found
        return _run_planned(roots, grads, outer.state, outer.factors, p, p, in_list, passthrough)

    if not _gas_scaling_enabled():
        return passthrough()
    factors = {g: g.factor() for g in state.groups}  # may raise: nothing touched yet
    f = fast_path_factor(state, factors)
    if f is not None:  # NOTE [ Fast path ]
        if f == 1.0:
            return passthrough()
        seeds = _scaled_seeds(roots, grads, [f] * len(roots))
        if seeds is None:
            return passthrough()
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug(
                "graphscale: fast path, walked 0 nodes in 0 us, %d multiplication(s) (root seeds x %g), factors %s",
                len(roots),
                f,
                sorted({f"{g.name}={v:g}" for g, v in factors.items()}),
            )
        return passthrough(seeds)
    return _run_planned(roots, grads, state, factors, 1.0, None, in_list, passthrough)


def _run_planned(
    roots: tuple[Any, ...],
    grads: list[Any],
    state: State,
    factors: dict[Group, float],
    base: float,
    carrier: float | None,
    inputs: Sequence[Any],
    passthrough: Callable[..., None],
) -> None:
    t0 = time.perf_counter()
    outer_phi = _enclosing_phi if carrier is not None else None
    plan = build_plan(roots, state, factors, base=base, carrier=carrier, inputs=inputs, outer_phi=outer_phi)
    seeds = _scaled_seeds(roots, grads, plan.seeds)
    if seeds is None:
        return passthrough()
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug(
            "graphscale: walked %d nodes in %.1f us, %d multiplication(s), factors %s%s",
            len(plan.graph),
            (time.perf_counter() - t0) * 1e6,
            plan.multiplications,
            sorted({f"{g.name}={f:g}" for g, f in factors.items()}),
            f", nested at base {base:g}" if carrier is not None else "",
        )
    nodes = plan.graph.nodes
    handles = []
    entry = _Active(plan, factors, state)
    try:
        for i, mults in plan.edge_mults.items():
            handles.append(nodes[i].register_hook(_post_hook(mults)))
        with _active_lock:
            _active.append(entry)
        passthrough(seeds)
    finally:
        with _active_lock:
            if entry in _active:
                _active.remove(entry)
        for h in handles:
            h.remove()
