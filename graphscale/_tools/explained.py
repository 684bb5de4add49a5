"""The value :func:`graphscale.explain` returns, and its renderers.

:class:`ExplainedPlan` is plain data (names, edges, potentials,
multipliers): it keeps no reference to the autograd graph, its tensors or the
groups, so holding a plan keeps no memory alive.  Its renderers (text, a
``torch.fx.Graph``, Graphviz DOT) read it and return a new value.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import torch
import torch.fx

from .._core.errors import GraphscaleError
from .._core.table import format_table

__all__ = ["ExplainedPlan", "GroupInPlay", "Multiplication"]


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
            seeds by one factor (see NOTE [ Fast path ] in _entry/entry.py).
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
    :meth:`to_dot` Graphviz text (renderers below).
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
        return _plan_text(self)

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
        return _plan_fx(self)

    def to_dot(self) -> str:
        """Graphviz DOT text: nodes filled by potential, one colour per factor,
        a legend naming the groups of each factor, multiplications as red
        edge labels.  Render with ``dot -Tsvg``."""
        return _plan_dot(self)


# ---------------------------------------------------------------- text
def _plan_text(plan: ExplainedPlan) -> str:
    """The plan as a summary line, the decision, a table of groups, and a table
    of every multiplication."""

    def carries(value: float) -> str:
        names = ", ".join(g.name for g in plan.groups if g.factor == value)
        return f"{value:g} ({names})" if names else f"{value:g}"

    unowned = {plan.potentials[i] for i, t in enumerate(plan.node_types)
               if t == "AccumulateGrad" and plan.node_groups[i] is None}
    group_rows = [[g.name, f"{g.factor:g}", f"{g.leaves}/{g.parameters}"] for g in plan.groups]
    if plan.unowned_leaves:
        group_rows.append(["(unowned)", ", ".join(f"{v:g}" for v in sorted(unowned, reverse=True)),
                           str(plan.unowned_leaves)])
    lines = [
        f"graphscale plan: {plan.roots} root(s), {plan.nodes} grad_fn nodes, "
        f"{len(plan.multiplications)} multiplication(s), walked and planned in {plan.walk_us:.0f} us",
        plan.note,
        "",
        format_table(["group", "factor", "leaves reached"], group_rows),
    ]
    if plan.multiplications:
        lines += [
            "",
            format_table(
                ["multiply", "at node", "edge", "flowing to", "by", "then carries"],
                [[m.kind, m.node, "-" if m.edge is None else str(m.edge), m.target, f"{m.multiplier:g}",
                  carries(m.carries)] for m in plan.multiplications],
            ),
        ]
    return "\n".join(lines)


# ---------------------------------------------------------------- torch.fx
def _snake(type_name: str) -> str:
    out = []
    for i, ch in enumerate(type_name):
        if ch.isupper() and i and not type_name[i - 1].isupper():
            out.append("_")
        out.append(ch.lower())
    return "".join(out)


_STAND_INS: dict[str, Callable[..., Any]] = {}


def _stand_in(type_name: str) -> Callable[..., Any]:
    """A callable named after a grad_fn type, the target of its fx node."""
    fn = _STAND_INS.get(type_name)
    if fn is None:

        def fn(*grads: Any) -> Any:
            raise GraphscaleError(
                f"graphscale: the explained graph's {type_name} node describes a backward step; "
                "it does not run. Run the backward itself."
            )

        fn.__name__ = fn.__qualname__ = type_name
        fn.__module__ = __name__
        _STAND_INS[type_name] = fn
    return fn


def _plan_fx(plan: ExplainedPlan) -> torch.fx.Graph:
    """See :attr:`ExplainedPlan.graph`."""
    g = torch.fx.Graph()
    n = plan.nodes
    incoming: list[list[torch.fx.Node]] = [[] for _ in range(n)]
    for r, idx in enumerate(plan.root_index):
        val = g.placeholder(f"grad_root{r}")
        val.meta["graphscale"] = {"kind": "seed", "potential": 1.0}
        if idx < 0:
            continue
        m = plan.seed_mults[r]
        if m != 1.0:
            val = g.call_function(operator.mul, (val, m))
            val.meta["graphscale"] = {"kind": "mul", "potential": plan.potentials[idx]}
        incoming[idx].append(val)
    made: list[torch.fx.Node] = []
    for i in range(n):  # parents come before children in node order
        node = g.create_node("call_function", _stand_in(plan.node_types[i]), tuple(incoming[i]),
                             name=_snake(plan.node_types[i]))
        node.meta["graphscale"] = {
            "kind": "grad_fn",
            "label": plan.node_names[i],
            "potential": plan.potentials[i],
            "group": plan.node_groups[i],
        }
        made.append(node)
        for k, c in enumerate(plan.edges[i]):
            if c < 0:
                continue
            val = node
            em = plan.edge_mults.get((i, k))
            if em is not None:
                val = g.call_function(operator.mul, (node, em))
                val.meta["graphscale"] = {"kind": "mul", "potential": plan.potentials[c], "edge": k}
            incoming[c].append(val)
    out = g.output(tuple(made[i] for i in range(n) if all(c < 0 for c in plan.edges[i])))
    out.meta["graphscale"] = {"kind": "output"}
    return g


# ---------------------------------------------------------------- Graphviz
_PALETTE = ("#a6cee3", "#fdbf6f", "#b2df8a", "#fb9a99", "#cab2d6", "#ffff99", "#1f78b4", "#33a02c")
_MUL_EDGE = 'color="red", fontcolor="red", penwidth=2'


def _esc(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _plan_dot(plan: ExplainedPlan) -> str:
    """See :meth:`ExplainedPlan.to_dot`."""
    values = sorted(set(plan.potentials) | {g.factor for g in plan.groups}, reverse=True)
    colour = {v: _PALETTE[i % len(_PALETTE)] for i, v in enumerate(values)}
    out = [
        "digraph graphscale {",
        '  rankdir=TB; node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=9];',
        '  subgraph cluster_legend { label="potential (factor carried)"; fontname="Helvetica"; fontsize=10;',
    ]
    for i, v in enumerate(values):
        names = ", ".join(g.name for g in plan.groups if g.factor == v) or "no group"
        out.append(f'    legend{i} [label="{_esc(f"{v:g}: {names}")}", fillcolor="{colour[v]}"];')
    out.append("  }")
    for r, idx in enumerate(plan.root_index):
        out.append(f'  seed{r} [label="seed[{r}]", shape=oval, fillcolor="white"];')
        if idx >= 0:
            m = plan.seed_mults[r]
            attrs = f' [label="x {m:g}", {_MUL_EDGE}]' if m != 1.0 else ""
            out.append(f"  seed{r} -> n{idx}{attrs};")
    for i in range(plan.nodes):
        periph = ', penwidth=2, color="black"' if plan.node_groups[i] else ""
        out.append(f'  n{i} [label="{_esc(plan.node_names[i])}", fillcolor="{colour[plan.potentials[i]]}"{periph}];')
    for i in range(plan.nodes):
        for k, c in enumerate(plan.edges[i]):
            if c < 0:
                continue
            em = plan.edge_mults.get((i, k))
            attrs = f' [label="x {em:g}", {_MUL_EDGE}]' if em is not None else ""
            out.append(f"  n{i} -> n{c}{attrs};")
    out.append("}")
    return "\n".join(out) + "\n"
