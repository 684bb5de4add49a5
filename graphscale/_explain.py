"""``graphscale.explain``: the plan a backward would run, without running it.

The explanation is made by the same code the governed backward runs: the
decision (:func:`~graphscale._backward.decide`) and the
planner (:func:`~graphscale._planning.build_plan`).  What it shows is what
the backward would do with the groups installed now and the factors read now.

The result is plain data (names, edges, potentials, multipliers): it keeps no
reference to the autograd graph, its tensors or the groups, so holding a plan
keeps no memory alive.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.fx

from . import _state
from ._call import normalize
from ._errors import GraphscaleError
from ._group import Group
from ._plan import Plan
from ._planning import FAST_PATH, PLANNED, build_plan, decide, root_node, top_level_request
from ._render import plan_dot, plan_fx, plan_text
from ._state import State

__all__ = ["explain", "ExplainedPlan", "GroupInPlay", "Multiplication"]


@dataclass(frozen=True)
class GroupInPlay:
    """An installed group as the explained backward sees it.

    ``leaves``: how many of its parameters this backward reaches (0: the group
    is installed but not in this graph); ``parameters``: how many it owns.
    """

    name: str
    factor: float
    leaves: int
    parameters: int


@dataclass(frozen=True)
class Multiplication:
    """One multiplication the backward would run.

    ``kind == "seed"``: the seed gradient of root ``node`` (``"seed[r]"``) is
    multiplied before it enters ``target``; ``edge`` is None.
    ``kind == "edge"``: the gradient node ``node`` sends along its edge
    ``edge`` (``grad_inputs[edge]``, flowing along ``next_functions[edge]``)
    is multiplied before it reaches ``target``.  ``carries``: the factor the
    gradient carries from there on (``target``'s potential).
    """

    kind: str
    node: str
    edge: int | None
    target: str
    multiplier: float
    carries: float = 1.0  # the potential from here on: the factor the gradient now carries


@dataclass(frozen=True)
class ExplainedPlan:
    """What one governed backward would do; returned by :func:`explain`.

    Plain data: names, edges, potentials and multipliers, no reference to the
    autograd graph, its tensors or the groups.

    Attributes:
        roots: the number of roots.
        nodes: the number of ``grad_fn`` nodes reachable from the roots.
        walk_us: microseconds :func:`explain` spent walking and planning
            (on the fast path the backward itself walks nothing).
        fast_path: True when the backward would walk nothing and scale the
            seeds by one factor (NOTE [ Fast path ] in ``_backward.py``).
        note: the decision, in words.
        groups: the installed groups, as :class:`GroupInPlay`.
        unowned_leaves: leaves reached that no group owns.
        multiplications: every multiplication, as :class:`Multiplication`.
        node_names: a name per node, parents before children.
        node_types: each node's ``grad_fn`` type name.
        node_groups: the group owning each leaf node (None elsewhere).
        potentials: the factor every gradient arriving at each node carries.
        edges: ``edges[i][k]``: the node index ``next_functions[k]`` of node
            ``i`` leads to, or -1.
        root_index: each root's node index (-1: none).
        seed_mults: each root's seed multiplier.
        edge_mults: ``(node, edge) -> multiplier``.

    ``str(plan)`` is a table; :attr:`graph` a ``torch.fx.Graph``;
    :meth:`to_dot` Graphviz text (renderers in ``_render.py``).
    """

    roots: int
    walk_us: float
    fast_path: bool
    note: str
    groups: tuple[GroupInPlay, ...]
    unowned_leaves: int
    multiplications: tuple[Multiplication, ...]
    node_names: tuple[str, ...]
    node_types: tuple[str, ...]
    node_groups: tuple[str | None, ...]
    potentials: tuple[float, ...]
    edges: tuple[tuple[int, ...], ...]
    root_index: tuple[int, ...]
    seed_mults: tuple[float, ...]
    edge_mults: dict[tuple[int, int], float]

    @property
    def nodes(self) -> int:
        return len(self.node_names)

    def __repr__(self) -> str:
        return (
            f"<graphscale.ExplainedPlan {self.nodes} nodes, {len(self.multiplications)} multiplication(s), "
            f"fast_path={self.fast_path}>"
        )

    def __str__(self) -> str:
        return plan_text(self)

    @cached_property
    def graph(self) -> torch.fx.Graph:
        """The backward as a ``torch.fx.Graph``, data flowing root -> leaves.

        One placeholder per root (its seed gradient), one ``call_function``
        node per ``grad_fn`` (its target a stand-in named after the grad_fn
        type, which raises if called: the graph describes, it does not run),
        and one ``operator.mul`` node per multiplication, between the node
        that sends the gradient and the node that receives it.  The output is
        the tuple of nodes that send nothing further (the leaves).
        ``node.meta["graphscale"]`` holds ``kind`` ("grad_fn", "seed",
        "mul", "output"), ``potential`` (not on the output), and
        ``label``/``group`` for grad_fn nodes.
        """
        return plan_fx(self)

    def to_dot(self) -> str:
        """Graphviz DOT text: nodes filled by potential, one colour per factor,
        a legend naming the groups of each factor, multiplications as red
        edge labels.  Render with ``dot -Tsvg``."""
        return plan_dot(self)


# ---------------------------------------------------------------- explain
def _state_for(groups: Iterable[Group] | None, unowned: str) -> State:
    """The installed snapshot, or one made for ``groups`` (nothing installed)."""
    if groups is None:
        state = _state.current()
        if state is None:
            raise GraphscaleError(
                "graphscale.explain: nothing is installed, so there is no plan to explain. Call it inside "
                "`with graphscale.install(...):`, or pass the groups: "
                "graphscale.explain(loss, groups=[graphscale.Group(model, gas=N)])."
            )
        return state
    groups = list(groups)
    for obj in groups:
        if not isinstance(obj, Group):
            raise TypeError(
                f"graphscale.explain: groups= takes graphscale.Group objects, got {type(obj).__name__}. "
                "For DeepSpeed engines, install them and call explain inside the installation."
            )
    return State.of(groups, unowned, where="explain")


def _checked_roots(roots: tuple[Any, ...], grad_tensors: Any) -> tuple[Any, ...]:
    """The roots as a backward would take them; the errors backward would give, said up front."""
    if len(roots) == 1 and isinstance(roots[0], (list, tuple)):
        roots = tuple(roots[0])
    if not roots:
        raise GraphscaleError("graphscale.explain: give the tensor(s) you would call backward on: explain(loss).")
    norm = normalize(roots, grad_tensors)
    if norm is None:
        raise GraphscaleError(
            "graphscale.explain: every root must be a tensor that requires grad (or a GradientEdge), "
            "and grad_tensors, if given, must have one entry per root."
        )
    for r, (t, gr) in enumerate(zip(*norm)):
        if gr is None and isinstance(t, torch.Tensor) and t.numel() != 1:
            raise GraphscaleError(
                f"graphscale.explain: root {r} has shape {tuple(t.shape)} and no grad_tensors entry; "
                "backward would fail the same way (its seed can only be made for a scalar). "
                "Pass grad_tensors=..., as you would to backward."
            )
    return norm[0]


def _labels(graph: Any, state: State) -> tuple[list[str], list[str | None], dict[Group, int], int]:
    """Node labels (type#index, with the owning group and parameter on leaves),
    each node's group, the leaves reached per group, and the unowned leaves."""
    labels = [f"{type(node).__name__}#{i}" for i, node in enumerate(graph.nodes)]
    node_groups: list[str | None] = [None] * len(labels)
    reached: dict[Group, int] = {}
    unowned = 0
    for i, var in graph.leaves.items():
        g = state.owner.get(id(var))
        if g is None:
            unowned += 1
            labels[i] += f" [unowned {tuple(var.shape)}]"
        else:
            reached[g] = reached.get(g, 0) + 1
            node_groups[i] = g.name
            labels[i] += f" [{g.name}.{state.leaf_name(var)}]"
    return labels, node_groups, reached, unowned


def _decision(plan: Plan, kind: str, fast: float, scaling: bool, factors: dict[Group, float]) -> tuple[
        tuple[float, ...], tuple[float, ...], dict[tuple[int, int], float], str]:
    """Potentials, seed and edge multipliers, and the note, of what the backward would do."""
    n = len(plan.graph)
    if kind == PLANNED:
        edge_mults = {(u, k): m for u, row in plan.edge_mults.items() for k, m in row}
        return (tuple(plan.phi), tuple(plan.seeds), edge_mults,
                f"walked: the backward walks these {n} nodes and multiplies where a group's region begins")
    if kind == FAST_PATH:
        note = (f"fast path: seed x {fast:g}, no walk (the {n} nodes here were walked for this explanation only; "
                "the backward walks only until it knows no unowned leaf needs protecting)")
        return (fast,) * n, (fast,) * len(plan.seeds), {}, note
    if not scaling:
        note = "no multiplication: scale_wrt_gas=False, every factor is 1"
    elif set(factors.values()) <= {1.0}:
        note = "no multiplication: every factor in play is 1"
    else:
        note = "no multiplication: this backward reaches no owned leaf, so it is left as plain PyTorch runs it"
    return (1.0,) * n, (1.0,) * len(plan.seeds), {}, note


def _multiplications(labels: Sequence[str], edges: Sequence[tuple[int, ...]], root_index: Sequence[int],
                     potentials: Sequence[float], seed_mults: Sequence[float],
                     edge_mults: dict[tuple[int, int], float]) -> tuple[Multiplication, ...]:
    out: list[Multiplication] = []
    for r, (idx, m) in enumerate(zip(root_index, seed_mults)):
        if idx >= 0 and m != 1.0:
            out.append(Multiplication("seed", f"seed[{r}]", None, labels[idx], m, potentials[idx]))
    for (u, k), m in sorted(edge_mults.items()):
        c = edges[u][k]
        out.append(Multiplication("edge", labels[u], k, labels[c], m, potentials[c]))
    return tuple(out)


def explain(
    *roots: Any,
    grad_tensors: Any = None,
    groups: Iterable[Group] | None = None,
    unowned: str = "plain_params",
    scale_wrt_gas: bool = True,
) -> ExplainedPlan:
    """Return the plan a governed backward of ``roots`` would run; run nothing.

    Args:
        *roots: the tensors you would call backward on (one, several, or one
            list of them).
        grad_tensors: as for ``torch.autograd.backward``; needed only for
            non-scalar roots, as there.
        groups: None (default): the groups installed now, with their factors
            read now, and the installation's ``unowned`` policy.  Or an
            iterable of :class:`Group` to explain a backward under those
            instead (then ``unowned`` applies); nothing is installed.
        unowned: with ``groups=``: the policy, as in ``install``.
        scale_wrt_gas: False explains ``engine.backward(loss,
            scale_wrt_gas=False)``: every factor is 1, nothing is multiplied.

    The decision and the plan are made by the functions the governed backward
    uses, so the explanation is what the backward would do, including the
    fast path (one factor in play: the seeds are multiplied, nothing is
    walked; :attr:`ExplainedPlan.fast_path` is True and the nodes are walked
    for the explanation only).  It explains a top-level backward (not one
    nested inside another, as reentrant checkpointing runs).  No gradient, hook or
    ``.grad`` is touched; the graph is left as it was.

    Raises:
        GraphscaleError: nothing installed and no ``groups``; a root that
            does not require grad; a non-scalar root without ``grad_tensors``.

    Example::

        >>> import torch, graphscale
        >>> a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
        >>> loss = (a(torch.ones(1, 2)) + b(torch.ones(1, 2))).sum()
        >>> with graphscale.install(graphscale.Group(a, gas=2, name="a"), graphscale.Group(b, gas=4, name="b")):
        ...     plan = graphscale.explain(loss)
        >>> [(m.kind, m.node, m.edge, m.target, m.multiplier) for m in plan.multiplications]
        [('seed', 'seed[0]', None, 'SumBackward0#0', 0.5), ('edge', 'AddBackward0#1', 1, 'AddmmBackward0#3', 0.5)]
        >>> plan.graph.lint()
        >>> print(graphscale.explain(loss, groups=[graphscale.Group(a, gas=2, name="a")], unowned="any").note)
        fast path: seed x 0.5, no walk (the 10 nodes here were walked for this explanation only; the backward walks only until it knows no unowned leaf needs protecting)
        >>> print(graphscale.explain(loss, groups=[graphscale.Group(a, gas=2, name="a")]).note)  # b's Linear is protected
        walked: the backward walks these 10 nodes and multiplies where a group's region begins
    """
    state = _state_for(groups, unowned)
    root_list = _checked_roots(roots, grad_tensors)
    scaling = scale_wrt_gas and _state.gas_scaling_enabled()
    factors = {g: (g.factor() if scaling else 1.0) for g in state.groups}
    kind, fast, _, _ = decide(root_list, state, factors, ())
    t0 = time.perf_counter()
    plan = build_plan(root_list, top_level_request(state, factors, ()))
    walk_us = (time.perf_counter() - t0) * 1e6

    graph = plan.graph
    labels, node_groups, reached, unowned_count = _labels(graph, state)
    root_index = tuple(graph.index[n] if n is not None else -1 for n in map(root_node, root_list))
    potentials, seed_mults, edge_mults, note = _decision(plan, kind, fast, scaling, factors)
    seed_mults = tuple(m if i >= 0 else 1.0 for i, m in zip(root_index, seed_mults))
    edges = tuple(tuple(row) for row in graph.edges)
    return ExplainedPlan(
        roots=len(root_list),
        walk_us=walk_us,
        fast_path=kind == FAST_PATH,
        note=note,
        groups=tuple(GroupInPlay(g.name, factors[g], reached.get(g, 0), len(g.parameters)) for g in state.groups),
        unowned_leaves=unowned_count,
        multiplications=_multiplications(labels, edges, root_index, potentials, seed_mults, edge_mults),
        node_names=tuple(labels),
        node_types=tuple(type(node).__name__ for node in graph.nodes),
        node_groups=tuple(node_groups),
        potentials=potentials,
        edges=edges,
        root_index=root_index,
        seed_mults=seed_mults,
        edge_mults=edge_mults,
    )
