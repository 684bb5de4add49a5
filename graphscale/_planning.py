"""The planning front end: from a backward's roots and the installed state to a plan.

:func:`build_plan` is the reference: walk (``_walk.py``), choose the pins
(owned leaves, unowned leaves by policy, checkpoint hints, nodes an enclosing
plan already governs), then choose potentials (``_plan.py``).  The native
walker (``_native/walker.cpp``) repeats exactly this computation in C++;
:func:`plan_backward` uses it when it is loaded and this module otherwise.
Both return an object with the same surface (:class:`PyPlan`): ``seeds``,
``num_nodes``, ``multiplications``, ``hooks()``, ``phi_of(node)``.

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

import os
import sys
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Callable, NamedTuple

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from . import _native, _state
from ._group import Group
from ._plan import Plan, make_plan
from ._state import State
from ._walk import walk

__all__ = [
    "root_node", "PlanRequest", "Reached", "build_plan", "PyPlan", "native_plan", "plan_backward", "plan_nested",
    "top_level_request", "checkpoint_hint", "probe", "NO_OWNED", "FAST", "PLAN", "fast_path_factor", "Decision",
    "decide", "UNTOUCHED", "FAST_PATH", "PLANNED", "warn_unreached_groups",
]


def root_node(t: Any) -> Any:
    """The node a backward root starts at: an edge's node, a tensor's
    ``grad_fn``, a leaf's ``AccumulateGrad``; None for a tensor without grad."""
    if isinstance(t, GradientEdge):
        return t.node
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        return get_gradient_edge(t).node
    return None


class PlanRequest(NamedTuple):
    """What one backward asks the planner.

    ``state``/``factors``: the snapshot and the factors read for this backward.
    ``base``: the potential the seeds already carry (1 at top level; a nested
    backward's enclosing potential, NOTE [ Nested backward ] in _backward.py).
    ``carrier``: in a nested backward, the potential unowned non-Parameter
    leaves must end at; None at top level.
    ``inputs``: the backward's ``inputs=`` (non-leaf ones receive ``.grad``
    and are pinned under ``unowned="raw"``).
    ``outer_phi``: the potential an enclosing plan gave a node, or None where
    none saw it (NOTE [ Unowned leaves in nested backward ]); None at top level.
    ``hint``: a potential for a custom-Function node, or None (NOTE [
    Checkpoint hints ]).
    """

    state: State
    factors: Mapping[Group, float]
    base: float = 1.0
    carrier: float | None = None
    inputs: tuple[Any, ...] = ()
    outer_phi: Callable[[Any], float | None] | None = None
    hint: Callable[[Any], float | None] | None = None

    @property
    def input_pins(self) -> tuple[tuple[Any, float], ...]:
        """(node, potential) for each non-leaf ``inputs=`` tensor under "plain"."""
        if not self.state.raw:
            return ()
        value = self.carrier if self.carrier is not None else 1.0
        return tuple((t.grad_fn, value) for t in self.inputs
                     if isinstance(t, torch.Tensor) and t.grad_fn is not None)

    @property
    def factor_list(self) -> list[float]:
        """The factors in ``state.groups`` order (what the native walker indexes)."""
        return [self.factors[g] for g in self.state.groups]


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


def checkpoint_hint(state: State, factors: Mapping[Group, float]) -> Callable[[Any], float | None]:
    """The hint of NOTE [ Checkpoint hints ] for one backward's factors."""

    def hint(node: Any) -> float | None:
        g = _hint_group(state, getattr(node, "run_function", None))
        return None if g is None else factors.get(g)

    return hint


# ---------------------------------------------------------------- the Python reference
@dataclass
class Reached:
    """What a backward's graph reached: owned leaves, the groups they belong
    to, and the unowned nn.Parameters the policy looked at."""

    owned_leaves: int = 0
    custom_nodes: int = 0  # custom-Function nodes: may run a nested backward over hidden leaves
    groups: set[Group] = field(default_factory=set)
    unowned_params: list[torch.Tensor] = field(default_factory=list)


def _unowned_pin(var: torch.Tensor, node: Any, request: PlanRequest, reached: Reached) -> float | None:
    """The pin of an unowned leaf (NOTE [ Unowned leaves ] in _state.py; NOTE [
    Unowned leaves in nested backward ] in _backward.py), or None."""
    seen = request.outer_phi(node) if request.outer_phi is not None else None
    if seen is not None:
        return seen
    policy, nested = request.state.policy, request.carrier is not None
    if policy == "any" and not nested:
        return None
    param = isinstance(var, torch.nn.Parameter)
    if param:
        reached.unowned_params.append(var)
    if nested:
        return 1.0 if param else request.carrier
    return 1.0 if policy == "plain" or param else None


def _pins(graph: Any, request: PlanRequest, reached: Reached) -> tuple[dict[int, float], set[int]]:
    """Node index -> the potential it must have; and the enclosed nodes (NOTE [
    Nested backward through the enclosing graph ]), whose edges an enclosing
    plan multiplies already.  Later pins overwrite earlier ones; the native
    walker keeps this order (leaves, hints, inputs=, enclosed)."""
    owner, factors, outer_phi = request.state.owner, request.factors, request.outer_phi
    pins: dict[int, float] = {}
    for i, var in graph.leaves.items():
        g = owner.get(id(var))
        if g is not None:
            pins[i] = factors[g]
            reached.owned_leaves += 1
            reached.groups.add(g)
            continue
        pin = _unowned_pin(var, graph.nodes[i], request, reached)
        if pin is not None:
            pins[i] = pin
    for i, node in enumerate(graph.nodes):
        if isinstance(node, _BackwardCFunction) and i not in graph.leaves:
            reached.custom_nodes += 1
            h = request.hint(node) if request.hint is not None else None  # NOTE [ Checkpoint hints ]
            if h is not None:
                pins[i] = h
    for node, value in request.input_pins:
        j = graph.index.get(node)
        if j is not None:
            pins[j] = value
    enclosed: set[int] = set()
    if outer_phi is not None:
        for i, node in enumerate(graph.nodes):
            if i not in graph.leaves:
                seen = outer_phi(node)
                if seen is not None:
                    pins[i] = seen
                    enclosed.add(i)
    return pins, enclosed


def _build(roots: Sequence[Any], request: PlanRequest) -> tuple[Plan, Reached]:
    root_nodes = [root_node(t) for t in roots]
    graph = walk(root_nodes)
    reached = Reached()
    pins, enclosed = _pins(graph, request, reached)
    root_idx = [graph.index[n] if n is not None else -1 for n in root_nodes]
    plan = make_plan(graph, pins, root_idx, base=request.base)
    if enclosed:  # their hooks are in place already: placing them again would scale twice
        plan = replace(plan, edge_mults={u: m for u, m in plan.edge_mults.items() if u not in enclosed})
    return plan, reached


def build_plan(roots: Sequence[Any], request: PlanRequest) -> Plan:
    """Walk from ``roots`` and choose potentials (NOTE [ Potentials ] in _plan.py)."""
    return _build(roots, request)[0]


class PyPlan:
    """A Python :class:`Plan` seen through what applying it needs; the native
    walker's ``NativePlan`` has the same surface (seeds, num_nodes,
    multiplications, base, owned_leaves, custom_nodes, unowned_params,
    tensor_hooks, hooks(), phi_of(node), groups_reached(),
    unowned_parameters())."""

    __slots__ = ("plan", "seeds", "num_nodes", "multiplications", "base", "owned_leaves", "custom_nodes",
                 "unowned_params", "tensor_hooks", "_reached", "_groups")

    def __init__(self, plan: Plan, reached: Reached, groups: Sequence[Group]) -> None:
        self.plan = plan
        self.seeds = plan.seeds
        self.num_nodes = len(plan.graph)
        self.multiplications = plan.multiplications
        self.base = plan.base
        self.owned_leaves = reached.owned_leaves
        self.custom_nodes = reached.custom_nodes
        self.tensor_hooks = True  # not visible from Python: assume some (the backward binds its task)
        self.unowned_params = len(reached.unowned_params)
        self._reached = reached
        self._groups = groups

    def hooks(self) -> list[tuple[Any, tuple[tuple[int, float], ...]]]:
        nodes = self.plan.graph.nodes
        return [(nodes[i], mults) for i, mults in self.plan.edge_mults.items()]

    def phi_of(self, node: Any) -> float | None:
        i = self.plan.graph.index.get(node)
        return None if i is None else self.plan.phi[i]

    def groups_reached(self) -> list[int]:
        """Positions (in the state's groups) of the groups whose leaves this backward reaches."""
        return [k for k, g in enumerate(self._groups) if g in self._reached.groups]

    def unowned_parameters(self) -> list[torch.Tensor]:
        return list(self._reached.unowned_params)


# ---------------------------------------------------------------- before the fast path
NO_OWNED, FAST, PLAN = 0, 1, 2
HIDDEN = 4  # or-ed in: a custom-Function node was seen


def _probe_python(roots: Sequence[Any], state: State) -> int:
    """The Python twin of the native ``probe`` (see there)."""
    policy, owner = state.policy, state.owner
    stack = [n for n in map(root_node, roots) if n is not None]
    seen = set(stack)
    owned = unowned = hidden = False
    while stack:
        node = stack.pop()
        if isinstance(node, _BackwardCFunction):
            hidden = True
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor):
            if id(var) in owner:
                owned = True
                if policy == "any":
                    return FAST | (HIDDEN if hidden else 0)
            elif policy == "plain" or (policy == "plain_params" and isinstance(var, torch.nn.Parameter)):
                unowned = True
            if owned and unowned:
                return PLAN | (HIDDEN if hidden else 0)
            continue
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return (FAST if owned else NO_OWNED) | (HIDDEN if hidden else 0)


def probe(roots: Sequence[Any], state: State) -> tuple[int, bool]:
    """Before the fast path (NOTE [ Fast path ] in _backward.py): (verdict,
    hidden).  NO_OWNED when a backward of ``roots`` reaches no owned leaf the
    walk can see, FAST when multiplying its seeds by the one factor in play is
    exact under the state's policy, PLAN when unowned leaves the policy
    protects are reached too; ``hidden``: a custom-Function node was seen,
    which may run a nested backward over leaves no walk can see (reentrant
    checkpointing).  Walks only until the answer is known (under "any" it may
    stop before a custom-Function node: that policy needs no nested plan
    inside a fast-path backward)."""
    native = _native.load()
    if native is not None:
        code = int(native.probe(tuple(roots), _native.owners_for(state, native), state.policy_index,
                                torch.nn.Parameter))
    else:
        code = _probe_python(roots, state)
    return code & 3, bool(code & HIDDEN)


# ---------------------------------------------------------------- what a backward does
def fast_path_factor(factors: Mapping[Group, float]) -> float | None:
    """The one factor in play (1.0 when none), or None when several are and
    the backward must plan.  See NOTE [ Fast path ]; :func:`graphscale.explain`
    asks the same question."""
    distinct = set(factors.values())
    if len(distinct) > 1:
        return None
    return distinct.pop() if distinct else 1.0


UNTOUCHED, FAST_PATH, PLANNED = "untouched", "fast path", "planned"


class Decision(NamedTuple):
    """What a top-level backward does: ``kind`` (UNTOUCHED, FAST_PATH or
    PLANNED), the one ``factor`` of the fast path, the ``plan`` when planned,
    and ``nested``: the potential from which a backward nested in an
    unplanned one must be planned (custom-Function nodes may hide leaves;
    NOTE [ Fast path ]), or None."""

    kind: str
    factor: float = 1.0
    plan: Any = None
    nested: float | None = None


def decide(roots: Sequence[Any], state: State, factors: Mapping[Group, float], inputs: tuple[Any, ...],
           seeds_carry_nothing: bool = True) -> Decision:
    """What a top-level backward of ``roots`` does; :func:`graphscale.explain`
    asks the same question."""
    f = fast_path_factor(factors)
    if f is not None:
        if f == 1.0 and seeds_carry_nothing:
            return Decision(UNTOUCHED)  # every factor 1: nothing to do, nested or not
        verdict, hidden = probe(roots, state)
        if verdict == NO_OWNED and not hidden:
            return Decision(UNTOUCHED)  # NOTE [ Unowned leaves ]: not graphscale's backward
        if verdict == NO_OWNED and seeds_carry_nothing:
            return Decision(UNTOUCHED, nested=1.0)  # owned leaves may hide behind a custom Function
        if verdict == FAST:
            return Decision(FAST_PATH, f, nested=f if hidden and state.policy != "any" else None)
    plan = plan_backward(roots, top_level_request(state, factors, inputs))
    if not plan.owned_leaves and not plan.custom_nodes:
        return Decision(UNTOUCHED)
    return Decision(PLANNED, plan=plan)



_warned: weakref.WeakSet[Group] = weakref.WeakSet()


def warn_unreached_groups(state: State, plan: Any) -> None:
    """Issue 10: a governed backward that reaches unowned nn.Parameters but
    none of some group's is almost always a wrapper (FSDP, a PEFT or
    compile wrapper) that swapped the group's parameters; say so, once per group."""
    reached = set(plan.groups_reached())
    missing = [g for k, g in enumerate(state.groups) if k not in reached and g not in _warned and g.parameters]
    if not missing:
        return
    _warned.update(missing)
    params = plan.unowned_parameters()
    shapes = ", ".join(str(tuple(p.shape)) for p in params[:6]) + (", ..." if len(params) > 6 else "")
    names = ", ".join(repr(g.name) for g in missing)
    warnings.warn(
        f"graphscale: this backward reached none of the parameters of group(s) {names} but reached "
        f"{len(params)} nn.Parameter(s) that no group owns (shapes {shapes}). A wrapper (FSDP, a PEFT or "
        "compile wrapper) may have replaced the group's parameters after the Group was made: make the "
        "Group from the wrapped model, after wrapping. Those parameters got their plain gradient "
        f"(unowned={state.policy!r}).",
        stacklevel=_user_stacklevel(),
    )


_SKIP_DIRS = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__)))


def _user_stacklevel() -> int:
    """The ``stacklevel`` naming the first caller outside graphscale and torch
    (the user's ``loss.backward()``, ``engine.backward(...)`` or
    ``torch.autograd.backward(...)`` line), for a warning raised here."""
    frame = sys._getframe(1)
    level = 2  # warnings.warn's caller is level 1; this function's caller is that frame
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_SKIP_DIRS):
        frame = frame.f_back
        level += 1
    return level - 1


# ---------------------------------------------------------------- native or Python
def native_plan(native: Any, roots: Sequence[Any], request: PlanRequest, outer: Any = None) -> Any:
    """``request`` planned by the native walker ``native``; ``outer``: the
    enclosing NativePlans (innermost last), looked up in C++, in place of
    ``request.outer_phi``.  Raises OverflowError past 64 distinct factors."""
    pins = request.input_pins
    return native.plan(
        [root_node(t) for t in roots],
        _native.owners_for(request.state, native),
        request.factor_list,
        request.base,
        request.carrier,
        request.state.policy_index,
        torch.nn.Parameter,
        [node for node, _ in pins],
        [value for _, value in pins],
        request.outer_phi if outer is None else outer,
        request.hint,
    )


def plan_backward(roots: Sequence[Any], request: PlanRequest) -> Any:
    """The plan of :func:`build_plan`, made by the native walker when it is
    available ($GRAPHSCALE_WALKER, see graphscale/_native), else by Python.
    Both give the same plan; the native one keeps no Python object per node."""
    native = _native.load()
    if native is not None:
        outer = None
        if request.carrier is not None:
            running = [entry.plan for entry in _state.running()]
            if all(isinstance(p, native.NativePlan) for p in running):
                outer = running  # looked up in C++, no Python call per node
        try:
            return native_plan(native, roots, request, outer)
        except OverflowError:  # more than 64 distinct factors: the Python planner has no limit
            pass
    return PyPlan(*_build(roots, request), request.state.groups)


def top_level_request(state: State, factors: Mapping[Group, float], inputs: tuple[Any, ...]) -> PlanRequest:
    """The request of a top-level governed backward."""
    return PlanRequest(state, factors, inputs=inputs, hint=checkpoint_hint(state, factors))


def plan_nested(current: Any, roots: Sequence[Any], inputs: tuple[Any, ...]) -> tuple[_state.Running, Any] | None:
    """Plan a backward called from inside ``current``'s backward (NOTE [
    Nested backward ] in _backward.py): find the running plan that walked
    ``current`` and plan ``roots`` from its potential, with its state and
    factors; or, where none did, inside a backward that left the nested
    ones to be planned (NOTE [ Fast path ]: its task is bound with the
    potential everything in it carries), from that potential.  None inside a
    backward that left them alone (ungoverned, or a fast path under "any")."""
    entries = _state.running()
    if not entries:
        return _plan_in_task(roots, inputs)
    native = _native.load()
    if native is not None and not inputs:
        # One native call finds the running plan and plans (every running
        # plan native; else the Python route below).
        found = native.nested_plan(current, entries, tuple(roots), torch.nn.Parameter)
        if found is None:
            return _plan_in_task(roots, inputs)
        if found is not NotImplemented:
            k, plan = found
            return entries[k], plan
    enclosing = _state.find_enclosing(current)
    if enclosing is None:
        return _plan_in_task(roots, inputs)
    entry, p = enclosing
    request = PlanRequest(entry.state, entry.factors, base=p, carrier=p, inputs=inputs,
                          outer_phi=_state.enclosing_phi, hint=checkpoint_hint(entry.state, entry.factors))
    return entry, plan_backward(roots, request)


def _plan_in_task(roots: Sequence[Any], inputs: tuple[Any, ...]) -> tuple[_state.Running, Any] | None:
    """A nested backward inside a backward with no plan that bound its task
    with the potential everything in it carries (NOTE [ Fast path ])."""
    binding = _state.task_binding()
    if binding is None or binding.potential is None or binding.factors is None:
        return None
    p = binding.potential
    request = PlanRequest(binding.state, binding.factors, base=p, carrier=p, inputs=inputs,
                          outer_phi=_state.enclosing_phi, hint=checkpoint_hint(binding.state, binding.factors))
    return _state.Running(None, binding.factors, binding.state), plan_backward(roots, request)
