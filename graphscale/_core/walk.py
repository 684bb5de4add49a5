"""Walk the ``grad_fn`` DAG of a backward's roots into plain data.

The walk is iterative (graphs have 10^5 nodes; recursion would overflow) and
touches each node once.  It produces a :class:`Graph`: nodes in a topological
order (every node before the nodes its gradient flows to), each node's edges
as indices into that order, and the variable of every ``AccumulateGrad``.
Nothing is registered on the graph; the walk only reads it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .errors import InternalError, internal_assert

__all__ = ["Graph", "walk", "root_node", "ACCUMULATE_GRAD", "CUSTOM_FUNCTION"]


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


@dataclass
class Graph:
    """The reachable part of an autograd graph, as plain data.

    ``nodes[i]`` is a ``torch.autograd.graph.Node``; ``nodes`` is topologically
    sorted (parents first).  ``edges[i][k]`` is the index of
    ``nodes[i].next_functions[k][0]``, or -1 where that edge is None.
    ``leaves`` maps the index of each ``AccumulateGrad`` node to its variable.
    ``index`` maps each node object back to its position.
    """

    nodes: list[Any]
    edges: list[tuple[int, ...]]
    leaves: dict[int, torch.Tensor]
    index: dict[Any, int] = field(repr=False)

    def __len__(self) -> int:
        return len(self.nodes)


def walk(roots: list[Any]) -> Graph:
    """Return the :class:`Graph` reachable from ``roots`` (Nodes; None is skipped)."""
    acc_type: Any = ACCUMULATE_GRAD
    index: dict[Any, int] = {}
    found: list[Any] = []
    kids: list[list[int]] = []
    for r in roots:
        if r is not None and r not in index:
            index[r] = len(found)
            found.append(r)
    # Breadth-first discovery; every node is expanded exactly once.
    i = 0
    while i < len(found):
        node = found[i]
        i += 1
        if type(node) is acc_type:
            kids.append([])
            continue
        row = []
        for nxt, _ in node.next_functions:
            if nxt is None:
                row.append(-1)
                continue
            j = index.get(nxt)
            if j is None:
                j = len(found)
                index[nxt] = j
                found.append(nxt)
            row.append(j)
        kids.append(row)
    n = len(found)
    # Kahn's algorithm: a topological order, parents before children.
    indeg = [0] * n
    for row in kids:
        for j in row:
            if j >= 0:
                indeg[j] += 1
    order = [v for v in range(n) if indeg[v] == 0]
    k = 0
    while k < len(order):
        for j in kids[order[k]]:
            if j >= 0:
                indeg[j] -= 1
                if indeg[j] == 0:
                    order.append(j)
        k += 1
    # autograd graphs are acyclic; a cycle means torch changed under us
    internal_assert(len(order) == n, "the grad_fn graph has a cycle")
    pos = [0] * n
    for new, old in enumerate(order):
        pos[old] = new
    nodes: list[Any] = [found[old] for old in order]
    edges = [tuple(pos[j] if j >= 0 else -1 for j in kids[old]) for old in order]
    new_index = {node: p for p, node in enumerate(nodes)}
    leaves = {p: node.variable for p, node in enumerate(nodes) if type(node) is acc_type}
    return Graph(nodes=nodes, edges=edges, leaves=leaves, index=new_index)
