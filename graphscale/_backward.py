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
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from . import _native
from ._group import Group
from ._plan import Plan, make_plan
from ._walk import walk

__all__ = ["governed_backward", "gas_scaling", "ORIGINAL_BACKWARD", "State", "build_plan", "fast_path_factor"]

_log = logging.getLogger("graphscale")

ORIGINAL_BACKWARD: Callable[..., None] = torch.autograd.backward


# NOTE [ Per-snapshot tables ]
# A State lives from one install()/remove() to the next, through many
# backwards, so whatever a backward needs that depends only on what is
# installed is made once per State, never per backward: the set of governed
# gas keys (the DeepSpeed adapter's O(1) test in its per-tensor hook), the
# native walker's owner table (graphscale/_native owners_for; built at install
# when the extension is loaded already, else at the first walked backward) and
# the checkpoint hints (NOTE [ Checkpoint hints ]).  Factors are not among
# them: a gas callable is read at the start of every top-level backward.
@dataclass(frozen=True)
class State:
    """A snapshot of what is installed, read once per backward."""

    groups: tuple[Group, ...]
    owner: dict[int, Group]  # id(leaf tensor) -> group; the groups keep the leaves alive
    raw: bool  # unowned leaves must get exactly their plain gradient
    # Derived from the above, once (NOTE [ Per-snapshot tables ]).
    gas_keys: frozenset[object] = field(init=False, repr=False, compare=False)
    cache: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "gas_keys", frozenset(g._gas_key for g in self.groups))
        object.__setattr__(self, "cache", {})


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
# Not covered: a backward that began *ungoverned* (nothing installed yet) on one
# thread while another thread installs an engine whose outputs it reaches: its
# remaining output hooks pass through, as they must under torch.autograd.grad
# (which they cannot tell apart).  Install before other threads start training.
def governing_state() -> State | None:
    """The snapshot of the governed backward running on this thread, if any."""
    stack = getattr(_tls, "governing", None)
    return stack[-1] if stack else None


# ---------------------------------------------------------------- active plans
@dataclass(eq=False)
class _Active:
    plan: Any  # _PyApplied or the native walker's NativePlan: phi_of(node) -> float | None
    factors: dict[Group, float]
    state: State


# Walked plans whose backward is running, any thread, innermost last.  Each
# change is one list operation (append, remove) and each reader takes a
# snapshot with tuple(): each is atomic, so no lock is taken on the hot path.
_active: list[_Active] = []


def _find_outer(node: Any) -> tuple[_Active, float] | None:
    for act in reversed(tuple(_active)):
        p = act.plan.phi_of(node)
        if p is not None:
            return act, p
    return None


def _enclosing_phi(node: Any) -> float | None:
    """The potential a running plan gave ``node``, or None where none saw it."""
    for act in reversed(tuple(_active)):
        p = act.plan.phi_of(node)
        if p is not None:
            return p
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


# NOTE [ Checkpoint hints ]
# A reentrant checkpoint (torch's or DeepSpeed's) is one custom-Function node
# in the outer graph; the parameters it uses are leaves only of the nested
# graph recomputed in its backward, which the outer walk cannot see.  Left to
# the outer plan, such a node is "free" and gets its parent's potential, and
# every nested plan then multiplies at its own seed and carriers: a few
# multiplications per checkpointed layer.  Both checkpoints keep the function
# they recompute as ctx.run_function, and the node is the ctx: when that is an
# nn.Module (or a bound method of one) all of whose owned parameters belong to
# one group, the outer plan pins the node to that group's factor, so the
# nested plan, starting from that base, has nothing to multiply.  A hint only
# chooses a potential (any choice is exact, NOTE [ Potentials ]), so a wrong
# or stale hint costs multiplications, never correctness.  Hence a module's
# parameters are read once, at its first hint, and kept (by id, weakly keyed
# by the module) across installations: reading them is most of a hint's cost,
# and a backward right after install() would pay it for every checkpointed
# layer.  Parameters added to or replaced in a module later are not seen.
_BackwardCFunction: type = torch.autograd.function.BackwardCFunction
_module_param_ids: weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, ...]] = weakref.WeakKeyDictionary()


def _module_parameters(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """``module.parameters()`` without its generator machinery (about 7x
    cheaper on a transformer block); may repeat a shared parameter."""
    stack = [module]
    seen = {id(module)}
    while stack:
        m = stack.pop()
        for p in m._parameters.values():
            if p is not None:
                yield p
        for sub in m._modules.values():
            if sub is not None and id(sub) not in seen:
                seen.add(id(sub))
                stack.append(sub)


def _hint_group(state: State, fn: Any) -> Group | None:
    if not isinstance(fn, torch.nn.Module):
        fn = getattr(fn, "__self__", None)
        if not isinstance(fn, torch.nn.Module):
            return None
    cache = state.cache.get("hints")  # NOTE [ Per-snapshot tables ]
    if cache is None:
        cache = state.cache["hints"] = {}
    hit = cache.get(id(fn))
    if hit is not None and hit[0]() is fn:
        return hit[1]
    ids = _module_param_ids.get(fn)
    if ids is None:
        ids = _module_param_ids[fn] = tuple({id(p): None for p in _module_parameters(fn)})
    owner = state.owner
    groups = {owner.get(i) for i in ids}
    groups.discard(None)
    g = groups.pop() if len(groups) == 1 else None
    cache[id(fn)] = (weakref.ref(fn), g)
    return g


def _checkpoint_hint(state: State, factors: dict[Group, float]) -> Callable[[Any], float | None]:
    def hint(node: Any) -> float | None:
        g = _hint_group(state, getattr(node, "run_function", None))
        return None if g is None else factors.get(g)

    return hint


def build_plan(
    roots: Sequence[Any],
    state: State,
    factors: dict[Group, float],
    base: float = 1.0,
    carrier: float | None = None,
    inputs: Sequence[Any] = (),
    outer_phi: Callable[[Any], float | None] | None = None,
    hint: Callable[[Any], float | None] | None = None,
) -> Plan:
    """Walk from ``roots`` and choose potentials (see NOTE [ Potentials ]).

    ``carrier``: in a nested backward, the potential that unowned
    non-Parameter leaves must end at (NOTE [ Nested backward ]).
    ``outer_phi``: in a nested backward, the potential the enclosing plans gave
    a node (None where they have not seen it); unowned leaves keep it, so each
    gets one factor over the whole backward (NOTE [ Unowned leaves in nested
    backward ]).
    ``hint``: a potential for a custom-Function node, or None (NOTE [
    Checkpoint hints ]); asked for each such node, in graph order.
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
    if hint is not None:  # NOTE [ Checkpoint hints ]
        for i, node in enumerate(graph.nodes):
            if isinstance(node, _BackwardCFunction) and i not in graph.leaves:
                h = hint(node)
                if h is not None:
                    pins[i] = h
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


class _PyApplied:
    """A Python :class:`Plan` seen through what applying it needs; the native
    walker's ``NativePlan`` has the same surface (seeds, num_nodes,
    multiplications, hooks(), phi_of(node))."""

    __slots__ = ("plan", "seeds", "num_nodes", "multiplications")

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.seeds = plan.seeds
        self.num_nodes = len(plan.graph)
        self.multiplications = plan.multiplications

    def hooks(self) -> list[tuple[Any, tuple[tuple[int, float], ...]]]:
        nodes = self.plan.graph.nodes
        return [(nodes[i], mults) for i, mults in self.plan.edge_mults.items()]

    def phi_of(self, node: Any) -> float | None:
        i = self.plan.graph.index.get(node)
        return None if i is None else self.plan.phi[i]


def _applied_plan(
    roots: Sequence[Any],
    state: State,
    factors: dict[Group, float],
    base: float,
    carrier: float | None,
    inputs: Sequence[Any],
) -> Any:
    """The plan of :func:`build_plan`, made by the native walker when it is
    available ($GRAPHSCALE_WALKER, see graphscale/_native), else by Python.
    Both give the same plan; the native one keeps no Python object per node."""
    # A nested plan pins unowned leaves to what the enclosing plans gave them
    # (NOTE [ Unowned leaves in nested backward ]); both planners ask
    # outer_phi, once per unowned leaf.
    outer_phi: Any = _enclosing_phi if carrier is not None else None
    hint = _checkpoint_hint(state, factors)
    native = _native.load()
    if native is not None and carrier is not None:
        outer = [act.plan for act in tuple(_active)]
        if all(isinstance(p, native.NativePlan) for p in outer):
            outer_phi = outer  # looked up in C++, no Python call per node
    if native is not None:
        extra_nodes: list[Any] = []
        extra_values: list[float] = []
        if state.raw:
            for t in inputs:  # as in build_plan: non-leaf inputs= tensors receive .grad too
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    extra_nodes.append(t.grad_fn)
                    extra_values.append(carrier if carrier is not None else 1.0)
        try:
            return native.plan(
                [_root_node(t) for t in roots],
                _native.owners_for(state, native),
                [factors[g] for g in state.groups],
                base,
                carrier,
                state.raw,
                torch.nn.Parameter,
                extra_nodes,
                extra_values,
                outer_phi,
                hint,
            )
        except OverflowError:  # more than 64 distinct factors: the Python planner has no limit
            pass
    return _PyApplied(build_plan(roots, state, factors, base=base, carrier=carrier, inputs=inputs,
                                 outer_phi=_enclosing_phi if carrier is not None else None, hint=hint))


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
            else:  # torch's implicit seed, already multiplied: one op instead of two
                out[r] = torch.full_like(t, m, memory_format=torch.preserve_format)
                continue
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


# A walk recorder sees every walked plan while set (benchmarks/overhead.py):
# walk_recorder(nodes, seconds_to_walk_and_plan, multiplications); the fast
# path calls it with (0, 0.0, seeds_scaled).
_walk_recorder: Callable[[int, float, int], None] | None = None

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
    current = torch._C._current_autograd_node()

    def passthrough(seeds: Any = grad_tensors) -> None:
        # NOTE [ Which snapshot an output hook obeys ]: top level only; a nested
        # backward obeys the snapshot of the backward it runs inside.
        governing = None
        if state is not None and current is None:
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
    if current is not None:
        return _nested(current, roots, grads, in_list, passthrough)

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
        if _walk_recorder is not None:
            _walk_recorder(0, 0.0, len(roots))
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug(
                "graphscale: fast path, walked 0 nodes in 0 us, %d multiplication(s) (root seeds x %g), factors %s",
                len(roots),
                f,
                sorted({f"{g.name}={v:g}" for g, v in factors.items()}),
            )
        return passthrough(seeds)
    return _run_planned(roots, grads, state, factors, 1.0, None, in_list, passthrough)


def _nested(
    current: Any,
    roots: tuple[Any, ...],
    grads: list[Any],
    inputs: Sequence[Any],
    passthrough: Callable[..., None],
) -> None:
    """A backward called from inside ``current``'s backward: NOTE [ Nested backward ]."""
    acts = tuple(_active)
    if not acts:  # inside a fast-path or ungoverned backward
        return passthrough()
    native = _native._module
    if native is not None and not inputs:
        # One native call finds the running plan that walked ``current`` and
        # plans this backward as _applied_plan would with that plan's state
        # and factors (every running plan native; else the Python route below).
        t0 = time.perf_counter()
        found = native.nested_plan(current, acts, roots, torch.nn.Parameter)
        if found is None:
            return passthrough()
        if found is not NotImplemented:
            k, plan = found
            outer = acts[k]
            return _apply_plan(plan, t0, roots, grads, outer.state, outer.factors, plan.base, True, passthrough)
    found_py = _find_outer(current)
    if found_py is None:
        return passthrough()
    outer, p = found_py
    return _run_planned(roots, grads, outer.state, outer.factors, p, p, inputs, passthrough)


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
    plan = _applied_plan(roots, state, factors, base, carrier, inputs)
    return _apply_plan(plan, t0, roots, grads, state, factors, base, carrier is not None, passthrough)


def _apply_plan(
    plan: Any,
    t0: float,
    roots: tuple[Any, ...],
    grads: list[Any],
    state: State,
    factors: dict[Group, float],
    base: float,
    nested: bool,
    passthrough: Callable[..., None],
) -> None:
    """Scale the seeds, hook the nodes, run the backward, unhook in ``finally``."""
    recorder = _walk_recorder
    if recorder is not None:
        recorder(plan.num_nodes, time.perf_counter() - t0, plan.multiplications)
    if plan.multiplications:
        seeds = _scaled_seeds(roots, grads, plan.seeds)
        if seeds is None:
            return passthrough()
    else:  # nothing to scale or hook (the usual nested backward, NOTE [ Checkpoint hints ])
        seeds = grads
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug(
            "graphscale: walked %d nodes in %.1f us, %d multiplication(s), factors %s%s, %s walker",
            plan.num_nodes,
            (time.perf_counter() - t0) * 1e6,
            plan.multiplications,
            sorted({f"{g.name}={f:g}" for g, f in factors.items()}),
            f", nested at base {base:g}" if nested else "",
            "python" if isinstance(plan, _PyApplied) else "native",
        )
    handles = []
    entry = _Active(plan, factors, state)
    try:
        if plan.multiplications:
            for node, mults in plan.hooks():
                handles.append(node.register_hook(_post_hook(mults)))
        _active.append(entry)
        passthrough(seeds)
    finally:
        try:
            _active.remove(entry)  # by identity (_Active compares so)
        except ValueError:
            pass
        for h in handles:
            h.remove()
