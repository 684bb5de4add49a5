"""The pins of a plan: which nodes must end at which potential (the owned
leaves at their group's factor, unowned leaves by policy, checkpoint hints,
``inputs=``, and the nodes an enclosing plan already governs), and what the
backward reached on the way.  C++ twin: ``_native/planner/pins.h``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .._core.group import Group
from .nodes import CUSTOM_FUNCTION
from .request import PlanRequest

__all__ = ["Reached", "pins"]

# NOTE [ Unowned leaves in nested backward ]
# An unowned leaf may be reached by the outer backward and by nested ones
# (an unowned layer used inside and outside a checkpointed segment, or in two
# segments under different groups).  Left free, each plan would give it the
# potential of its own surroundings and its gradient would mix factors, which
# even unowned="any" forbids.  So a nested plan pins each unowned leaf to the
# potential a running (enclosing) plan already gave its AccumulateGrad node;
# an unowned Parameter that none has seen is pinned to 1, the same value in
# every nested backward; an unseen non-Parameter leaf is a carrier (PlanRequest.carrier).
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


@dataclass
class Reached:
    """What a backward's graph reached: owned leaves, the groups they belong
    to, and the unowned nn.Parameters the policy looked at."""

    owned_leaves: int = 0
    custom_nodes: int = 0  # custom-Function nodes: may run a nested backward over hidden leaves
    groups: set[Group] = field(default_factory=set)
    unowned_params: list[torch.Tensor] = field(default_factory=list)


def _unowned_pin(var: torch.Tensor, node: Any, request: PlanRequest, reached: Reached) -> float | None:
    """The pin of an unowned leaf, or None.  (See NOTE [ Unowned leaves ] in _core/snapshot.py.)"""
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


def pins(graph: Any, request: PlanRequest, reached: Reached) -> tuple[dict[int, float], set[int]]:
    """Node index -> the potential it must have; and the enclosed nodes (of
    the enclosing graph), whose edges an enclosing plan multiplies already.
    Later pins overwrite earlier ones; the native walker keeps this order
    (leaves, hints, inputs=, enclosed)."""
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
