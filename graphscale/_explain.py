"""``graphscale.explain``: the plan a backward would run, without running it.

The explanation is made by the same code the governed backward runs: the
fast-path decision (:func:`~graphscale._backward.fast_path_factor`) and the
planner (:func:`~graphscale._backward.build_plan`).  What it shows is what
the backward would do with the groups installed now and the factors read now.

The result is plain data (names, edges, potentials, multipliers): it keeps no
reference to the autograd graph, its tensors or the groups, so holding a plan
keeps no memory alive.
"""
from __future__ import annotations

import operator
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx

from . import _backward
from ._errors import GraphscaleError
from ._group import Group

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


class ExplainedPlan:
    """What one governed backward would do; returned by :func:`explain`.

    Attributes:
        roots: the number of roots.
        nodes: the number of ``grad_fn`` nodes reachable from the roots.
        walk_us: microseconds :func:`explain` spent walking and planning
            (on the fast path the backward itself walks nothing).
        fast_path: True when the backward would walk nothing and scale the
            seeds by one factor (NOTE [ Fast path ] in ``_backward.py``).
        groups: the installed groups, as :class:`GroupInPlay`.
        unowned_leaves: leaves reached that no group owns.
        multiplications: every multiplication, as :class:`Multiplication`.
        node_names: a name per node, parents before children.
        potentials: the factor every gradient arriving at each node carries.

    ``str(plan)`` is a table; :attr:`graph` a ``torch.fx.Graph``;
    :meth:`to_dot` Graphviz text.
    """

    def __init__(
        self,
        *,
        roots: int,
        walk_us: float,
        fast_path: bool,
        note: str,
        groups: tuple[GroupInPlay, ...],
        unowned_leaves: int,
        multiplications: tuple[Multiplication, ...],
        node_names: tuple[str, ...],
        node_types: tuple[str, ...],
        node_groups: tuple[str | None, ...],
        potentials: tuple[float, ...],
        edges: tuple[tuple[int, ...], ...],
        root_index: tuple[int, ...],
        seed_mults: tuple[float, ...],
        edge_mults: dict[tuple[int, int], float],
    ) -> None:
        self.roots = roots
        self.nodes = len(node_names)
        self.walk_us = walk_us
        self.fast_path = fast_path
        self.note = note
        self.groups = groups
        self.unowned_leaves = unowned_leaves
        self.multiplications = multiplications
        self.node_names = node_names
        self.potentials = potentials
        self._types = node_types
        self._node_groups = node_groups
        self._edges = edges
        self._root_index = root_index
        self._seed_mults = seed_mults
        self._edge_mults = edge_mults
        self._fx: torch.fx.Graph | None = None

    # ------------------------------------------------------------ text
    def __repr__(self) -> str:
        return (
            f"<graphscale.ExplainedPlan {self.nodes} nodes, {len(self.multiplications)} multiplication(s), "
            f"fast_path={self.fast_path}>"
        )

    def __str__(self) -> str:
        lines = [
            f"graphscale plan: {self.roots} root(s), {self.nodes} grad_fn nodes, "
            f"{len(self.multiplications)} multiplication(s), walked and planned in {self.walk_us:.0f} us",
            self.note,
            "",
            _table(
                ["group", "factor", "leaves reached"],
                [[g.name, f"{g.factor:g}", f"{g.leaves}/{g.parameters}"] for g in self.groups]
                + ([["(unowned)", self._unowned_factors(), str(self.unowned_leaves)]] if self.unowned_leaves else []),
            ),
        ]
        if self.multiplications:
            lines += [
                "",
                _table(
                    ["multiply", "at node", "edge", "flowing to", "by", "then carries"],
                    [
                        [m.kind, m.node, "-" if m.edge is None else str(m.edge), m.target, f"{m.multiplier:g}",
                         self._carries(m.carries)]
                        for m in self.multiplications
                    ],
                ),
            ]
        return "\n".join(lines)

    def _carries(self, value: float) -> str:
        names = ", ".join(g.name for g in self.groups if g.factor == value)
        return f"{value:g} ({names})" if names else f"{value:g}"

    def _unowned_factors(self) -> str:
        got = {self.potentials[i] for i, t in enumerate(self._types) if t == "AccumulateGrad" and self._node_groups[i] is None}
        return ", ".join(f"{v:g}" for v in sorted(got, reverse=True))

    # ------------------------------------------------------------ torch.fx
    @property
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
        if self._fx is None:
            self._fx = self._build_fx()
        return self._fx

    def _build_fx(self) -> torch.fx.Graph:
        g = torch.fx.Graph()
        n = self.nodes
        incoming: list[list[torch.fx.Node]] = [[] for _ in range(n)]
        for r, idx in enumerate(self._root_index):
            val = g.placeholder(f"grad_root{r}")
            val.meta["graphscale"] = {"kind": "seed", "potential": 1.0}
            if idx < 0:
                continue
            m = self._seed_mults[r]
            if m != 1.0:
                val = g.call_function(operator.mul, (val, m))
                val.meta["graphscale"] = {"kind": "mul", "potential": self.potentials[idx]}
            incoming[idx].append(val)
        made: list[torch.fx.Node] = []
        for i in range(n):  # parents come before children in node order
            node = g.call_function(_stand_in(self._types[i]), tuple(incoming[i]), name=_snake(self._types[i]))
            node.meta["graphscale"] = {
                "kind": "grad_fn",
                "label": self.node_names[i],
                "potential": self.potentials[i],
                "group": self._node_groups[i],
            }
            made.append(node)
            for k, c in enumerate(self._edges[i]):
                if c < 0:
                    continue
                val = node
                em = self._edge_mults.get((i, k))
                if em is not None:
                    val = g.call_function(operator.mul, (node, em))
                    val.meta["graphscale"] = {"kind": "mul", "potential": self.potentials[c], "edge": k}
                incoming[c].append(val)
        out = g.output(tuple(made[i] for i in range(n) if all(c < 0 for c in self._edges[i])))
        out.meta["graphscale"] = {"kind": "output"}
        return g

    # ------------------------------------------------------------ Graphviz
    def to_dot(self) -> str:
        """Graphviz DOT text: nodes filled by potential, one colour per factor,
        a legend naming the groups of each factor, multiplications as red
        edge labels.  Render with ``dot -Tsvg``."""
        values = sorted(set(self.potentials) | {g.factor for g in self.groups}, reverse=True)
        colour = {v: _PALETTE[i % len(_PALETTE)] for i, v in enumerate(values)}
        out = [
            "digraph graphscale {",
            '  rankdir=TB; node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
            '  edge [fontname="Helvetica", fontsize=9];',
            '  subgraph cluster_legend { label="potential (factor carried)"; fontname="Helvetica"; fontsize=10;',
        ]
        for i, v in enumerate(values):
            names = ", ".join(g.name for g in self.groups if g.factor == v) or "no group"
            out.append(f'    legend{i} [label="{_esc(f"{v:g}: {names}")}", fillcolor="{colour[v]}"];')
        out.append("  }")
        for r, idx in enumerate(self._root_index):
            out.append(f'  seed{r} [label="seed[{r}]", shape=oval, fillcolor="white"];')
            if idx >= 0:
                m = self._seed_mults[r]
                attrs = f' [label="x {m:g}", color="red", fontcolor="red", penwidth=2]' if m != 1.0 else ""
                out.append(f"  seed{r} -> n{idx}{attrs};")
        for i in range(self.nodes):
            label = self.node_names[i]
            periph = ', penwidth=2, color="black"' if self._node_groups[i] else ""
            out.append(f'  n{i} [label="{_esc(label)}", fillcolor="{colour[self.potentials[i]]}"{periph}];')
        for i in range(self.nodes):
            for k, c in enumerate(self._edges[i]):
                if c < 0:
                    continue
                em = self._edge_mults.get((i, k))
                attrs = f' [label="x {em:g}", color="red", fontcolor="red", penwidth=2]' if em is not None else ""
                out.append(f"  n{i} -> n{c}{attrs};")
        out.append("}")
        return "\n".join(out) + "\n"


_PALETTE = ("#a6cee3", "#fdbf6f", "#b2df8a", "#fb9a99", "#cab2d6", "#ffff99", "#1f78b4", "#33a02c")


def _esc(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


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


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header).rstrip(), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r).rstrip() for r in rows]
    return "\n".join("  " + line for line in lines)


# ---------------------------------------------------------------- explain
def _state_for(groups: Iterable[Group] | None, unowned: str) -> _backward.State:
    if groups is None:
        state = _backward.current_state()
        if state is None:
            raise GraphscaleError(
                "graphscale.explain: nothing is installed, so there is no plan to explain. Call it inside "
                "`with graphscale.install(...):`, or pass the groups: "
                "graphscale.explain(loss, groups=[graphscale.Group(model, gas=N)])."
            )
        return state
    from ._install import UNOWNED_POLICIES, _owner_map

    if unowned not in UNOWNED_POLICIES:
        raise ValueError(f"graphscale.explain: unowned must be one of {UNOWNED_POLICIES}, got {unowned!r}.")
    resolved: list[Group] = []
    for obj in groups:
        if not isinstance(obj, Group):
            raise TypeError(
                f"graphscale.explain: groups= takes graphscale.Group objects, got {type(obj).__name__}. "
                "For DeepSpeed engines, install them and call explain inside the installation."
            )
        if obj not in resolved:
            resolved.append(obj)
    return _backward.State(groups=tuple(resolved), owner=_owner_map(resolved), raw=unowned == "raw")


def explain(
    *roots: Any,
    grad_tensors: Any = None,
    groups: Iterable[Group] | None = None,
    unowned: str = "any",
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
        unowned: with ``groups=``: ``"any"`` or ``"raw"``, as in ``install``.
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
        >>> print(graphscale.explain(loss, groups=[graphscale.Group(a, gas=2, name="a")]).note)
        fast path: seed x 0.5, no walk (the 10 nodes here were walked for this explanation only)
    """
    if len(roots) == 1 and isinstance(roots[0], (list, tuple)):
        roots = tuple(roots[0])
    if not roots:
        raise GraphscaleError("graphscale.explain: give the tensor(s) you would call backward on: explain(loss).")
    state = _state_for(groups, unowned)
    norm = _backward._normalize(roots, grad_tensors)
    if norm is None:
        raise GraphscaleError(
            "graphscale.explain: every root must be a tensor that requires grad (or a GradientEdge), "
            "and grad_tensors, if given, must have one entry per root."
        )
    root_list, grads = norm
    for r, (t, gr) in enumerate(zip(root_list, grads)):
        if gr is None and isinstance(t, torch.Tensor) and t.numel() != 1:
            raise GraphscaleError(
                f"graphscale.explain: root {r} has shape {tuple(t.shape)} and no grad_tensors entry; "
                "backward would fail the same way (its seed can only be made for a scalar). "
                "Pass grad_tensors=..., as you would to backward."
            )

    scaling = scale_wrt_gas and _backward._gas_scaling_enabled()
    factors = {g: (g.factor() if scaling else 1.0) for g in state.groups}
    fast = _backward.fast_path_factor(state, factors)
    t0 = time.perf_counter()
    plan = _backward.build_plan(root_list, state, factors)
    walk_us = (time.perf_counter() - t0) * 1e6

    graph = plan.graph
    n = len(graph.nodes)
    types = tuple(type(node).__name__ for node in graph.nodes)
    owner = state.owner
    node_groups: list[str | None] = [None] * n
    labels = [f"{types[i]}#{i}" for i in range(n)]
    reached: dict[Group, int] = {}
    unowned_count = 0
    for i, var in graph.leaves.items():
        g = owner.get(id(var))
        if g is None:
            unowned_count += 1
            labels[i] += f" [unowned {tuple(var.shape)}]"
        else:
            reached[g] = reached.get(g, 0) + 1
            node_groups[i] = g.name
            labels[i] += f" [{g.name}.{g._param_name(var)}]"
    root_index = tuple(graph.index[_backward._root_node(t)] if _backward._root_node(t) is not None else -1
                       for t in root_list)

    if fast is not None:
        phi = (fast,) * n
        seed_mults = tuple(fast if i >= 0 else 1.0 for i in root_index)
        edge_mults: dict[tuple[int, int], float] = {}
        if not scaling:
            note = "no multiplication: scale_wrt_gas=False, every factor is 1"
        elif fast == 1.0:
            note = "no multiplication: every factor in play is 1"
        else:
            note = f"fast path: seed x {fast:g}, no walk (the {n} nodes here were walked for this explanation only)"
    else:
        phi = tuple(plan.phi)
        seed_mults = tuple(plan.seeds)
        edge_mults = {(u, k): m for u, row in plan.edge_mults.items() for k, m in row}
        note = f"walked: the backward walks these {n} nodes and multiplies where a group's region begins"
    mults: list[Multiplication] = []
    for r, (idx, m) in enumerate(zip(root_index, seed_mults)):
        if idx >= 0 and m != 1.0:
            mults.append(Multiplication("seed", f"seed[{r}]", None, labels[idx], m, phi[idx]))
    for (u, k), m in sorted(edge_mults.items()):
        c = graph.edges[u][k]
        mults.append(Multiplication("edge", labels[u], k, labels[c], m, phi[c]))
    return ExplainedPlan(
        roots=len(root_list),
        walk_us=walk_us,
        fast_path=fast is not None and fast != 1.0,
        note=note,
        groups=tuple(GroupInPlay(g.name, factors[g], reached.get(g, 0), len(g.parameters)) for g in state.groups),
        unowned_leaves=unowned_count,
        multiplications=tuple(mults),
        node_names=tuple(labels),
        node_types=types,
        node_groups=tuple(node_groups),
        potentials=phi,
        edges=tuple(tuple(row) for row in graph.edges),
        root_index=root_index,
        seed_mults=seed_mults,
        edge_mults=edge_mults,
    )
