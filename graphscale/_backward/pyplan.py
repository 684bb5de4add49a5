"""The Python reference planner: walk (``_core/walk.py``), choose the pins, choose
potentials (``_core/plan.py``).

:func:`build` is the reference computation: the pins are the owned leaves,
the unowned leaves by policy, checkpoint hints, and the nodes an enclosing
plan already governs.  The native walker (``_native/planner/planner.h`` and the headers it includes) repeats
exactly this computation in C++ (tests/test_native_walker.py compares the two
on random graphs); :class:`PyPlan` gives a Python plan the surface of the
native ``NativePlan``, and :func:`probe_python` is the twin of the native probe.

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

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .._core.group import Group
from .._core.plan import Plan, make_plan
from .._core.request import PlanRequest
from .._core.snapshot import State
from .._core.walk import CUSTOM_FUNCTION, root_node, walk

__all__ = ["Reached", "build", "PyPlan", "probe_python", "PROBE_NO_OWNED", "PROBE_FAST", "PROBE_PLAN", "PROBE_HIDDEN"]

@dataclass
class Reached:
    """What a backward's graph reached: owned leaves, the groups they belong
    to, and the unowned nn.Parameters the policy looked at."""

    owned_leaves: int = 0
    custom_nodes: int = 0  # custom-Function nodes: may run a nested backward over hidden leaves
    groups: set[Group] = field(default_factory=set)
    unowned_params: list[torch.Tensor] = field(default_factory=list)


def _unowned_pin(var: torch.Tensor, node: Any, request: PlanRequest, reached: Reached) -> float | None:
    """The pin of an unowned leaf (NOTE [ Unowned leaves ] in _core/snapshot.py; NOTE [
    Unowned leaves in nested backward ]), or None."""
    seen = request.outer_phi(node) if request.outer_phi is not None else None
    if seen is not None:
        return seen
    policy, nested = request.reading.state.policy, request.carrier is not None
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
    state, factors, outer_phi = request.reading.state, request.reading.factors, request.outer_phi
    owner = state.owner
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
        if isinstance(node, CUSTOM_FUNCTION) and i not in graph.leaves:
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


def build(roots: Sequence[Any], request: PlanRequest) -> tuple[Plan, Reached]:
    """Walk from ``roots`` and choose potentials (NOTE [ Potentials ] in _core/plan.py); what it reached."""
    root_nodes = [root_node(t) for t in roots]
    graph = walk(root_nodes)
    reached = Reached()
    pins, enclosed = _pins(graph, request, reached)
    root_idx = [graph.index[n] if n is not None else -1 for n in root_nodes]
    plan = make_plan(graph, pins, root_idx, base=request.base)
    if enclosed:  # their hooks are in place already: placing them again would scale twice
        plan = replace(plan, edge_mults={u: m for u, m in plan.edge_mults.items() if u not in enclosed})
    return plan, reached


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


# ---------------------------------------------------------------- the probe's twin
# The probe's verdicts (what the native probe returns too), and a flag or-ed in.
PROBE_NO_OWNED, PROBE_FAST, PROBE_PLAN = 0, 1, 2
PROBE_HIDDEN = 4  # a custom-Function node was seen


def probe_python(roots: Sequence[Any], state: State) -> int:
    """The Python twin of the native ``probe`` (see ``_backward/decide.py`` probe): PROBE_NO_OWNED, PROBE_FAST or
    PROBE_PLAN, or-ed with PROBE_HIDDEN when a custom-Function node was seen."""
    policy, owner = state.policy, state.owner
    stack = [n for n in map(root_node, roots) if n is not None]
    seen = set(stack)
    owned = unowned = hidden = False
    while stack:
        node = stack.pop()
        if isinstance(node, CUSTOM_FUNCTION):
            hidden = True
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor):
            if id(var) in owner:
                owned = True
                if policy == "any":
                    return PROBE_FAST | (PROBE_HIDDEN if hidden else 0)
            elif policy == "plain" or (policy == "plain_params" and isinstance(var, torch.nn.Parameter)):
                unowned = True
            if owned and unowned:
                return PROBE_PLAN | (PROBE_HIDDEN if hidden else 0)
            continue
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return (PROBE_FAST if owned else PROBE_NO_OWNED) | (PROBE_HIDDEN if hidden else 0)
