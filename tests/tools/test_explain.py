"""graphscale.explain: the plan a backward would run, as a table, a torch.fx
graph and DOT; and the one debug line each governed backward logs."""
from __future__ import annotations

import logging
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

import graphscale
from graphscale._planner.walk import walk


class Sub(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sub = torch.nn.Linear(3, 3)
        self.head = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.sub(x)))


@dataclass
class Case:
    """A graph shape, its groups, and what the plan must contain."""

    id: str
    build: Callable[[], tuple[list[graphscale.Group], torch.Tensor]]
    multiplications: int
    fast_path: bool


def _sum_of_two() -> tuple[list[graphscale.Group], torch.Tensor]:
    g1, g2 = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    x = torch.randn(2, 3)
    return [graphscale.Group(g1, gas=2, name="g1"), graphscale.Group(g2, gas=4, name="g2")], (g1(x) + g2(x)).sum()


def _nested() -> tuple[list[graphscale.Group], torch.Tensor]:
    g1, g2 = torch.nn.Linear(3, 1), torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    return [graphscale.Group(g1, gas=2, name="g1"), graphscale.Group(g2, gas=4, name="g2")], g1(g2(x)).sum()


def _engine_and_submodule() -> tuple[list[graphscale.Group], torch.Tensor]:
    g = Sub()
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    return [graphscale.Group(g, gas=4, name="g")], g(x).sum() + g.sub(y).pow(2).sum()


# Expected counts follow from the structure (NOTE [ Potentials ]): one
# multiplication where each group's region begins.  g1(x) + g2(x): the seed
# (one group's factor) and the edge into the other group's branch; g1(g2(x)):
# the seed (g1) and the edge where g2's output enters g1; one group: the seed.
CASES = [
    Case("g1(x)+g2(x)", _sum_of_two, multiplications=2, fast_path=False),
    Case("g1(g2(x))", _nested, multiplications=2, fast_path=False),
    Case("g(x)+g.sub(y)", _engine_and_submodule, multiplications=1, fast_path=True),
]


def _factor_reaching_each_leaf(graph: torch.fx.Graph) -> dict[str, float]:
    """Run the fx graph symbolically: the factor every gradient carries.

    Seeds carry 1; ``operator.mul`` nodes multiply; a grad_fn node requires
    every incoming gradient to carry the same factor (else the plan would mix
    factors in a sum).  Returns leaf label -> factor."""
    value: dict[torch.fx.Node, float] = {}
    leaves: dict[str, float] = {}
    for node in graph.nodes:
        meta = node.meta.get("graphscale", {})
        if node.op == "placeholder":
            value[node] = 1.0
        elif node.op == "call_function" and node.target is operator.mul:
            value[node] = value[node.args[0]] * node.args[1]
        elif node.op == "call_function":
            incoming = {value[a] for a in node.args}
            assert len(incoming) == 1, f"{meta['label']} receives gradients carrying {incoming}"
            value[node] = incoming.pop()
            assert value[node] == pytest.approx(meta["potential"])
            if meta["group"] is not None:
                leaves[meta["label"]] = value[node]
    return leaves


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_plan_places_one_multiplication_where_each_region_begins(case: Case) -> None:
    groups, loss = case.build()
    with graphscale.install(*groups):
        plan = graphscale.explain(loss)
    assert len(plan.multiplications) == case.multiplications, str(plan)
    assert plan.fast_path is case.fast_path
    assert [m.multiplier for m in plan.multiplications if m.kind == "seed"], "a seed multiplication is expected"
    # Every owned leaf is reached with exactly its group's factor.
    factor = {g.name: g.factor() for g in groups}
    reached = _factor_reaching_each_leaf(plan.graph)
    assert reached, "no owned leaf in the graph"
    for label, f in reached.items():
        group = re.search(r"\[(\w+)\.", label).group(1)  # type: ignore[union-attr]
        assert f == pytest.approx(factor[group]), label
    assert {g.name: g.leaves for g in plan.groups} == {g.name: len(g.parameters) for g in groups}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_fx_graph_is_well_formed_and_has_one_node_per_grad_fn(case: Case) -> None:
    groups, loss = case.build()
    plan = graphscale.explain(loss, groups=groups)
    graph = plan.graph
    graph.lint()
    grad_fns = [n for n in graph.nodes if n.meta.get("graphscale", {}).get("kind") == "grad_fn"]
    muls = [n for n in graph.nodes if n.op == "call_function" and n.target is operator.mul]
    assert len(grad_fns) == plan.nodes == len(walk([loss.grad_fn]))
    assert len(muls) == len(plan.multiplications)
    assert [n.op for n in graph.nodes].count("placeholder") == 1
    pytest.importorskip("tabulate")  # print_tabular needs it
    graph.print_tabular()


@pytest.mark.parametrize("case", [c for c in CASES if not c.fast_path], ids=lambda c: c.id)
def test_explain_matches_what_the_backward_logs(case: Case, caplog: pytest.LogCaptureFixture) -> None:
    groups, loss = case.build()
    with graphscale.install(*groups):
        plan = graphscale.explain(loss)
        with caplog.at_level(logging.DEBUG, logger="graphscale"):
            loss.backward()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "graphscale" and "walked" in r.getMessage()]
    nodes, mults = re.search(r"walked (\d+) nodes in [\d.]+ us, (\d+) multiplication", line).groups()  # type: ignore[union-attr]
    assert (int(nodes), int(mults)) == (plan.nodes, len(plan.multiplications))


def test_fast_path_is_said_and_shows_the_seed_only() -> None:
    groups, loss = _engine_and_submodule()
    plan = graphscale.explain(loss, groups=groups)
    (m,) = plan.multiplications
    assert (m.kind, m.edge, m.multiplier) == ("seed", None, 0.25)
    assert plan.note.startswith("fast path: seed x 0.25, no walk")
    assert "fast path: seed x 0.25, no walk" in str(plan)


def test_all_factors_one_means_no_multiplication() -> None:
    g1, g2 = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    loss = (g1(torch.ones(1, 2)) + g2(torch.ones(1, 2))).sum()
    plan = graphscale.explain(loss, groups=[graphscale.Group(g1), graphscale.Group(g2)])
    assert plan.multiplications == () and not plan.fast_path
    assert "no multiplication" in str(plan)


def test_table_names_groups_factors_leaves_and_every_multiplication() -> None:
    groups, loss = _sum_of_two()
    text = str(graphscale.explain(loss, groups=groups))
    assert re.search(r"g1\s+0\.5\s+2/2", text) and re.search(r"g2\s+0\.25\s+2/2", text), text
    assert "SumBackward0#0" in text and "AddmmBackward0" in text
    assert len(re.findall(r"^\s+(seed|edge)\s", text, flags=re.M)) == 2, text


@pytest.mark.parametrize("unowned, factor", [("plain_params", "1"), ("any", "0\\.5")])
def test_unowned_leaves_are_counted_with_the_factor_they_get(unowned: str, factor: str) -> None:
    """The unowned Linear's parameters keep their plain gradient by default;
    under "any" they take the one factor in play (the fast path)."""
    g1, other = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    loss = (g1(torch.ones(1, 2)) + other(torch.ones(1, 2))).sum()
    plan = graphscale.explain(loss, groups=[graphscale.Group(g1, gas=2, name="g1")], unowned=unowned)
    assert plan.unowned_leaves == 2
    assert re.search(rf"\(unowned\)\s+{factor}\s+2", str(plan)), str(plan)


def test_to_dot_colours_each_potential_and_marks_each_multiplication() -> None:
    groups, loss = _nested()
    plan = graphscale.explain(loss, groups=groups)
    dot = plan.to_dot()
    assert dot.startswith("digraph graphscale {") and dot.rstrip().endswith("}")
    assert len(re.findall(r'\[label="x [^"]+", color="red"', dot)) == len(plan.multiplications)
    fills = set(re.findall(r'n\d+ \[label="[^"]*", fillcolor="(#[0-9a-f]+)"', dot))
    assert len(fills) == len(set(plan.potentials)) == 2
    assert "0.5: g1" in dot and "0.25: g2" in dot


def test_explain_touches_no_gradient_and_leaves_no_hook() -> None:
    groups, loss = _nested()
    params = [p for g in groups for p in g.parameters]
    want = torch.autograd.grad(loss, params, retain_graph=True)
    with graphscale.install(*groups):
        graphscale.explain(loss)
    assert all(p.grad is None for p in params)
    loss.backward()  # ungoverned now: the plain gradient, no multiplier left on the graph
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w)


def test_explain_without_installation_says_to_install() -> None:
    loss = torch.nn.Linear(2, 1)(torch.ones(1, 2)).sum()
    with pytest.raises(graphscale.GraphscaleError, match=r"^graphscale.explain: nothing is installed.*install"):
        graphscale.explain(loss)


@pytest.mark.parametrize(
    "roots, grad_tensors, match",
    [
        pytest.param(lambda: [torch.ones(2)], None, "requires grad", id="no-grad-root"),
        pytest.param(lambda: [torch.ones(2, requires_grad=True) * 2], None, "no grad_tensors", id="non-scalar"),
        pytest.param(lambda: [], None, "give the tensor", id="no-root"),
    ],
)
def test_explain_rejects_what_backward_would_reject(roots: Any, grad_tensors: Any, match: str) -> None:
    g = graphscale.Group(torch.nn.Linear(2, 1), gas=2)
    with pytest.raises(graphscale.GraphscaleError, match=match):
        graphscale.explain(*roots(), grad_tensors=grad_tensors, groups=[g])


def test_non_scalar_root_with_grad_tensors_is_explained() -> None:
    lin = torch.nn.Linear(2, 2)
    out = lin(torch.ones(1, 2))
    plan = graphscale.explain(out, grad_tensors=torch.ones_like(out), groups=[graphscale.Group(lin, gas=2)])
    assert plan.fast_path and len(plan.multiplications) == 1


# ---------------------------------------------------------------- logging
def test_each_governed_backward_logs_one_debug_line_with_nodes_mults_factors_and_us(
    caplog: pytest.LogCaptureFixture,
) -> None:
    walked_groups, walked_loss = _sum_of_two()
    fast_groups, fast_loss = _engine_and_submodule()
    with caplog.at_level(logging.DEBUG, logger="graphscale"):
        with graphscale.install(*walked_groups):
            walked_loss.backward()
        with graphscale.install(*fast_groups):
            fast_loss.backward()
    lines = [r for r in caplog.records if r.name == "graphscale" and "walked" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.DEBUG, logging.DEBUG]
    walked, fast = (r.getMessage() for r in lines)
    line = r"walked (\d+) nodes in [\d.]+ us, (\d+) multiplication\(s\).*factors \[(.*)\]"
    assert re.search(line, walked) and re.search(line, fast), (walked, fast)
    assert re.search(line, walked).group(3) == "'g1=0.5', 'g2=0.25'"  # type: ignore[union-attr]
    assert re.search(line, fast).groups() == ("0", "1", "'g=0.25'")  # type: ignore[union-attr]
    assert "fast path" in fast


def test_nothing_is_logged_at_the_default_level(caplog: pytest.LogCaptureFixture) -> None:
    groups, loss = _sum_of_two()
    with caplog.at_level(logging.DEBUG):
        with graphscale.install(*groups):
            graphscale.explain(loss)
            loss.backward()
    ours = [r for r in caplog.records if r.name.startswith("graphscale")]
    assert ours, "the debug line is expected here"
    assert [r.getMessage() for r in ours if r.levelno >= logging.WARNING] == []  # WARNING: logging's default


# ---------------------------------------------------------------- random graphs
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=30, deadline=None)
@given(
    gas=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    steps=st.lists(st.tuples(st.booleans(), st.integers(0, 99), st.integers(0, 99)), min_size=1, max_size=8),
    raw=st.booleans(),
)
def test_fx_graph_of_any_composition_delivers_each_owned_leaf_its_factor(
    gas: list[int], steps: list[tuple[bool, int, int]], raw: bool
) -> None:
    """Random mixes of applying a group's module and adding: the fx graph is
    well formed, has one node per walked grad_fn, and every owned leaf is
    reached with exactly its group's factor (unowned leaves under "plain": 1)."""
    mods = [torch.nn.Linear(3, 3) for _ in gas]
    free = torch.nn.Linear(3, 3)
    groups = [graphscale.Group(m, gas=k, name=f"g{i}") for i, (m, k) in enumerate(zip(mods, gas))]
    values = [torch.ones(1, 3)]
    for apply, a, b in steps:
        if apply:
            values.append(mods[b % len(mods)](values[a % len(values)]))
        else:
            values.append(values[a % len(values)] + free(values[b % len(values)]))
    loss = sum(v.sum() for v in values[1:])
    plan = graphscale.explain(loss, groups=groups, unowned="plain" if raw else "any")
    plan.graph.lint()
    assert sum(1 for n in plan.graph.nodes if n.meta["graphscale"]["kind"] == "grad_fn") == len(walk([loss.grad_fn]))
    factor = {g.name: g.factor() for g in groups}
    for label, f in _factor_reaching_each_leaf(plan.graph).items():
        assert f == pytest.approx(factor[re.search(r"\[(\w+)\.", label).group(1)]), (label, str(plan))  # type: ignore[union-attr]
    if raw:
        for n in plan.graph.nodes:
            meta = n.meta["graphscale"]
            if meta["kind"] == "grad_fn" and "[unowned" in meta["label"]:
                assert meta["potential"] == 1.0, str(plan)
