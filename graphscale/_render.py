"""Renderers: the one text-table formatter, and an explained plan as text,
a ``torch.fx.Graph`` and Graphviz DOT.

Each renderer reads an :class:`~graphscale._explain.ExplainedPlan` (plain
data) and returns a new value; none keeps a reference to the plan.
"""
from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx

from ._errors import GraphscaleError

if TYPE_CHECKING:
    from ._explain import ExplainedPlan

__all__ = ["format_table", "plan_text", "plan_fx", "plan_dot"]


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], rule: bool = True) -> str:
    """Left-aligned columns two spaces apart, each line indented by two; a
    dashed rule under the header when ``rule``.  Every table graphscale
    prints (explain, audit, the demo) is made here."""
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return ("  " + "  ".join(v.ljust(w) for v, w in zip(cells, widths))).rstrip()

    lines = [line(header)]
    if rule:
        lines.append(line(["-" * w for w in widths]))
    lines += [line(r) for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------- text
def plan_text(plan: ExplainedPlan) -> str:
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


def plan_fx(plan: ExplainedPlan) -> torch.fx.Graph:
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


def plan_dot(plan: ExplainedPlan) -> str:
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
