"""Make a plan: which multiplications, where, so every leaf gets its factor.

Input is a walked :class:`~graphscale._planner.walk.Graph` and the *pins*: the
potential each constrained node must end at (an owned leaf: its group's
factor).  Output is plain data, no hooks: a potential per node, a multiplier
per root seed, and the edge multipliers of each node.  C++ twin:
``_native/planner/potentials.h``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .walk import Graph

__all__ = ["Plan", "make_plan"]

# NOTE [ Potentials ]
# Give every node v a potential phi(v).  Multiply the seed gradient of root r
# by phi(r) / base (base: the potential the seed already carries, 1 at top
# level) and the gradient along each edge u -> v by phi(v) / phi(u).  Along
# any path root -> leaf the multipliers telescope to phi(leaf) / base, and a
# node where several paths meet receives only terms carrying phi(v), so the
# sum is phi(v) times the plain gradient there.  Because every backward
# function is linear in its incoming gradient, each leaf ends with exactly
# phi(leaf) times its plain gradient, for any DAG.  Correctness needs only
# phi(pinned node) = pin; every other choice decides how many multiplications
# run.  The choice below makes phi change where a group's region begins:
#
#   * F(v): the set of pin values reachable from v (bitmask).
#   * one value reachable: phi(v) is that value (the whole region below v
#     agrees; put the multiplication once, at its entry);
#   * none reachable: inherit the first parent's potential (free node);
#   * several reachable ("mixed"): each child votes for the value it would
#     take; keep the first parent's value if it is among the most voted, else
#     take the most voted.  For nested g1(g2(x)) this keeps g1's factor on
#     g1's chain (its weights vote for it) and multiplies once where g2's
#     output enters.
#
# Counts: g1(x) + g2(x) -> 2 multiplications, g1(g2(x)) -> 2,
# g(x) + g.sub(y) -> 1 (the seed; and no walk at all on the fast path).


@dataclass(frozen=True)
class Plan:
    """Where the multiplications go, as plain data.

    ``phi[i]``: potential of ``graph.nodes[i]``.  ``seeds[r]``: multiplier of
    the seed of root ``r`` (1.0 means leave it alone).  ``edge_mults``: for
    each node index with at least one multiplied edge, ``((edge_pos, m), ...)``
    where ``grad_inputs[edge_pos]`` is multiplied by ``m``.
    """

    graph: Graph
    phi: tuple[float, ...]
    seeds: tuple[float, ...]
    edge_mults: dict[int, tuple[tuple[int, float], ...]]
    base: float

    @property
    def multiplications(self) -> int:
        """Seed plus edge multiplications this plan places."""
        return sum(1 for m in self.seeds if m != 1.0) + sum(len(v) for v in self.edge_mults.values())


def make_plan(
    graph: Graph,
    pins: dict[int, float],
    roots: Sequence[int],
    base: float = 1.0,
) -> Plan:
    """Choose potentials for ``graph`` that meet ``pins`` (node index -> value).

    ``roots[r]`` is the node index of backward root ``r`` (its ``grad_fn``, or
    its ``AccumulateGrad`` for a leaf root), or -1 for a root with no node.
    ``base`` is the potential the incoming seeds already carry.  Three
    passes (the native walker's Planner has the same phases): bottom-up
    preferences, top-down potentials, and the multipliers where they change.
    """
    edges = graph.edges
    phi = _top_down(edges, _bottom_up(edges, pins), base)
    edge_mults: dict[int, tuple[tuple[int, float], ...]] = {}
    for u, pu in enumerate(phi):
        row = tuple((k, phi[c] / pu) for k, c in enumerate(edges[u]) if c >= 0 and phi[c] != pu)
        if row:
            edge_mults[u] = row
    seeds = tuple(phi[r] / base if r >= 0 else 1.0 for r in roots)
    return Plan(graph=graph, phi=tuple(phi), seeds=seeds, edge_mults=edge_mults, base=base)


class _Preferences:
    """What the bottom-up pass found: the distinct pin ``values`` (a value's
    bit is its index), each pinned node's bit, each node's preferred bit
    (``choice``, -1: free) and, at mixed nodes, its children's votes per bit."""

    __slots__ = ("values", "bit_of", "pin_bit", "choice", "votes")

    def __init__(self, n: int, pins: dict[int, float]) -> None:
        self.values: list[float] = []
        self.bit_of: dict[float, int] = {}
        for v in pins.values():
            if v not in self.bit_of:
                self.bit_of[v] = len(self.values)
                self.values.append(v)
        self.pin_bit = {i: self.bit_of[v] for i, v in pins.items()}
        self.choice = [-1] * n
        self.votes: dict[int, list[int]] = {}

    def potential_of(self, v: int, parent: float) -> float:
        """Node ``v``'s potential under a parent at ``parent``: its preference,
        or the parent's value where that is free or ties with it."""
        b = self.choice[v]
        if b < 0:
            return parent
        tally = self.votes.get(v)
        if tally is not None and v not in self.pin_bit:
            pb = self.bit_of.get(parent)
            if pb is not None and tally[pb] == tally[b]:
                return parent
        return self.values[b]


def _bottom_up(edges: Sequence[Sequence[int]], pins: dict[int, float]) -> _Preferences:
    """Reachable pin values below each node, and each node's preferred value."""
    n = len(edges)
    prefs = _Preferences(n, pins)
    choice, pin_bit = prefs.choice, prefs.pin_bit
    reach = [0] * n
    for v in range(n - 1, -1, -1):
        m = 0
        for c in edges[v]:
            if c >= 0:
                m |= reach[c]
        pb = pin_bit.get(v)
        if pb is not None:
            m |= 1 << pb
            choice[v] = pb
        elif m & (m - 1) == 0:  # zero or one value below
            choice[v] = m.bit_length() - 1 if m else -1
        else:
            tally = [0] * len(prefs.values)
            for c in edges[v]:
                if c >= 0 and choice[c] >= 0:
                    tally[choice[c]] += 1
            prefs.votes[v] = tally
            choice[v] = max(range(len(tally)), key=tally.__getitem__)
        reach[v] = m
    return prefs


def _top_down(edges: Sequence[Sequence[int]], prefs: _Preferences, base: float) -> list[float]:
    """Potentials: parents come first in graph order, so the first parent decides."""
    n = len(edges)
    phi: list[float | None] = [None] * n
    for u in range(n):
        pu = phi[u]
        if pu is None:
            pu = phi[u] = prefs.potential_of(u, base)
        for c in edges[u]:
            if c >= 0 and phi[c] is None:
                phi[c] = prefs.potential_of(c, pu)
    return phi  # type: ignore[return-value]  # every entry is set above
