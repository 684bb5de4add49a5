"""One plan of one backward, the Python reference: what is asked
(:class:`~graphscale._planner.request.PlanRequest`), the computation
(:func:`build`: walk, pins, potentials) and what comes out (:class:`PyPlan`,
the surface of the native ``NativePlan``).  C++ twins:
``_native/planner/planner.h`` (the entry), ``phases.h`` (the phases, which
are build's locals here) and ``plan.h`` (the plan); the two planners give
identical plans (tests compare them on random graphs).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from .._core.group import Group
from .nodes import root_node
from .pins import Reached, pins
from .potentials import Plan, make_plan
from .request import PlanRequest
from .walk import walk

__all__ = ["build", "PyPlan"]


def build(roots: Sequence[Any], request: PlanRequest) -> tuple[Plan, Reached]:
    """Walk from ``roots`` and choose potentials; what it reached.
    (See NOTE [ Potentials ] in _planner/potentials.py.)"""
    root_nodes = [root_node(t) for t in roots]
    graph = walk(root_nodes)
    reached = Reached()
    pinned, enclosed = pins(graph, request, reached)
    root_idx = [graph.index[n] if n is not None else -1 for n in root_nodes]
    plan = make_plan(graph, pinned, root_idx, base=request.base)
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
