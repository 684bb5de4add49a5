"""Autograd nodes as the planner sees them: the kind of a node (a leaf's
``AccumulateGrad``, a custom Function's node) and the node a backward root
starts at.  C++ twin: ``_native/planner/nodes.h``."""
from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .._core.errors import InternalError

__all__ = ["ACCUMULATE_GRAD", "CUSTOM_FUNCTION", "root_node"]


def _accumulate_grad_type() -> type:
    leaf = torch.zeros(1, requires_grad=True)
    node = leaf.mul(1).grad_fn
    if node is None:
        raise InternalError("graphscale: internal invariant broken: a product of a leaf has no grad_fn. "
                            "This is a bug in graphscale.")
    return type(node.next_functions[0][0])


ACCUMULATE_GRAD: type = _accumulate_grad_type()
CUSTOM_FUNCTION: type = torch.autograd.function.BackwardCFunction  # a custom autograd.Function's node


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
