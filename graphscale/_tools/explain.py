"""``graphscale.explain``: the plan a backward would run, without running it.

Made by the same code the governed backward runs: the decision
(:func:`~graphscale._backward.decide.decide`) and the Python reference planner
(:func:`~graphscale._planner.plan.build`, whose plans the native walker
repeats), with the groups installed now and the factors read now, fp16 loss
scales included (:meth:`~graphscale._core.snapshot.State.read`).  The value
it returns, and its renderers, are in ``_tools/explained.py``.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .._backward import frames as _frames
from .._backward.call import normalize
from .._backward.decide import FAST_PATH, PLANNED, decide, top_level_request
from .._core.errors import GraphscaleError
from .._core.group import Group
from .._core.snapshot import State, current
from .._planner.nodes import root_node
from .._planner.plan import build
from .._planner.potentials import Plan
from .explained import ExplainedPlan, GroupInPlay, Multiplication

__all__ = ["explain", "ExplainedPlan"]


# ---------------------------------------------------------------- explain
def _state_for(groups: Iterable[Group] | None, unowned: str) -> State:
    """The installed snapshot, or one made for ``groups`` (nothing installed)."""
    if groups is None:
        state = current()
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
                     decided: tuple[Sequence[float], Sequence[float], dict[tuple[int, int], float]],
                     ) -> tuple[Multiplication, ...]:
    """Every multiplication of the decision ``decided`` (potentials, seed and edge multipliers)."""
    potentials, seed_mults, edge_mults = decided
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
    scaling = scale_wrt_gas and _frames.scaling_enabled()
    reading = state.read(scaling)
    factors = dict(reading.factors)
    kind, fast, _, _ = decide(root_list, reading, ())
    t0 = time.perf_counter()
    plan, _ = build(root_list, top_level_request(reading, ()))
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
        multiplications=_multiplications(labels, edges, root_index, (potentials, seed_mults, edge_mults)),
        node_names=tuple(labels),
        node_types=tuple(type(node).__name__ for node in graph.nodes),
        node_groups=tuple(node_groups),
        potentials=potentials,
        edges=edges,
        root_index=root_index,
        seed_mults=seed_mults,
        edge_mults=edge_mults,
    )
