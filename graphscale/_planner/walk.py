"""Walk the ``grad_fn`` DAG of a backward's roots into plain data.

The walk is iterative (graphs have 10^5 nodes; recursion would overflow) and
touches each node once.  It produces a :class:`Graph`: nodes in a topological
order (every node before the nodes its gradient flows to), each node's edges
as indices into that order, and the variable of every ``AccumulateGrad``.
Nothing is registered on the graph; the walk only reads it.  C++ twin:
``_native/planner/walk.h``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .._core.errors import internal_assert
from .nodes import ACCUMULATE_GRAD

__all__ = ["Graph", "walk"]


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
