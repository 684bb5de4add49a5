"""The native walker (graphscale/_native) makes the same plan and the same
probe as the Python reference (graphscale/_planner/walk.py +
graphscale/_planner/potentials.py), on random graphs and on a large one.  Which walker
runs, its build and its fallback: test_walker_build.py.
"""
from __future__ import annotations

import random
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.autograd.graph import get_gradient_edge

import graphscale
from graphscale._backward import native_backend as _native_backend
from graphscale._core.snapshot import Reading, State
from graphscale._planner import nodes as _nodes
from graphscale._planner import plan as _pyplan
from graphscale._planner import probe as _probe
from graphscale._planner import walk as _walk
from graphscale._planner.request import PlanRequest


class _Twice(torch.autograd.Function):
    """A custom Function (a PyNode in the graph) with two inputs and two outputs."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a * 2, a + b

    @staticmethod
    def backward(ctx: Any, ga: torch.Tensor, gb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ga * 2 + gb, gb


def random_case(seed: int) -> dict[str, Any]:
    """A random autograd graph over grouped, unowned and non-Parameter leaves."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    n_groups = rng.randint(1, 4)
    groups = []
    pool: list[torch.Tensor] = []
    for k in range(n_groups):
        params = [torch.nn.Parameter(torch.randn(3)) for _ in range(rng.randint(1, 3))]
        groups.append(graphscale.Group(params, gas=rng.choice([1, 2, 3, 4, 8]), name=f"g{k}"))
        pool += params
    pool += [torch.nn.Parameter(torch.randn(3)) for _ in range(rng.randint(0, 2))]  # unowned parameters
    pool += [torch.randn(3, requires_grad=True) for _ in range(rng.randint(0, 2))]  # detached-input-like
    rng.shuffle(pool)
    made: list[torch.Tensor] = []
    for _ in range(rng.randint(1, 40)):
        src = pool + made
        a, b = rng.choice(src), rng.choice(src)
        op = rng.randrange(7)
        if op == 0:
            out = a + b
        elif op == 1:
            out = a * b
        elif op == 2:
            out = torch.tanh(a)
        elif op == 3:
            out = torch.stack([a, b, a]).sum(0)
        elif op == 4:
            out = _Twice.apply(a, b)[rng.randrange(2)]
        elif op == 5:
            out = torch.cat([a, b])[:3]
        else:
            x, y = torch.unbind(torch.stack([a, b]))
            out = x - y * 0.5
        made.append(out)
    n_roots = rng.randint(1, 3)
    roots: list[torch.Tensor] = [rng.choice(made).sum() for _ in range(n_roots)]
    if rng.random() < 0.2:
        roots.append(rng.choice(pool).sum())
    if rng.random() < 0.1:
        roots.append(pool[0])  # a leaf root: its AccumulateGrad is the root node
    raw = rng.random() < 0.3
    nested = rng.random() < 0.3
    inputs = [rng.choice(made)] if raw and rng.random() < 0.5 else []
    state = State.of(groups, "plain" if raw else "any")
    factors = {g: g.factor() for g in groups}
    base = rng.choice([0.25, 0.5]) if nested else 1.0
    carrier = base if nested else None
    outer_phi = None
    if nested:  # some unowned leaves were already given a potential by an enclosing plan
        owned = {id(p) for g in groups for p in g.parameters}
        seen = {
            get_gradient_edge(t).node: rng.choice([0.125, 0.5, 1.0])
            for t in pool
            if id(t) not in owned and rng.random() < 0.5
        }
        for t in made:  # nodes an enclosing plan already hooks
            if rng.random() < 0.1:
                seen[t.grad_fn] = rng.choice([0.125, 0.5, 1.0])
        outer_phi = seen.get
    hints = {t.grad_fn: rng.choice([None, 0.25, 0.5, 1.0]) for t in made
             if isinstance(t.grad_fn, torch.autograd.function.BackwardCFunction)}
    return dict(roots=roots, state=state, factors=factors, base=base, carrier=carrier, inputs=inputs,
                outer_phi=outer_phi, hint=hints.get if rng.random() < 0.7 else None)


def assert_same_plan(native: Any, case: dict[str, Any]) -> None:
    request = PlanRequest(
        Reading(case["state"], case["factors"]), base=case["base"], carrier=case["carrier"],
        inputs=tuple(case["inputs"]), outer_phi=case.get("outer_phi"), hint=case.get("hint"),
    )
    ref, _ = _pyplan.build(case["roots"], request)
    got = _native_backend.of(native).plan(case["roots"], request)
    problems = []
    if got.num_nodes != len(ref.graph):
        problems.append(f"nodes {got.num_nodes} != {len(ref.graph)}")
    if tuple(got.seeds) != ref.seeds:
        problems.append(f"seeds {tuple(got.seeds)} != {ref.seeds}")
    if got.multiplications != ref.multiplications:
        problems.append(f"multiplications {got.multiplications} != {ref.multiplications}")
    want_hooks = [(ref.graph.nodes[i], m) for i, m in ref.edge_mults.items()]
    got_hooks = [(node, tuple(tuple(x) for x in m)) for node, m in got.hooks()]
    if len(got_hooks) != len(want_hooks) or any(
        gn is not wn or gm != wm for (gn, gm), (wn, wm) in zip(got_hooks, want_hooks)
    ):
        problems.append(f"hooks {got_hooks} != {want_hooks}")
    bad_phi = [i for i, node in enumerate(ref.graph.nodes) if got.phi_of(node) != ref.phi[i]]
    if bad_phi:
        problems.append(f"phi differs at {len(bad_phi)} node(s), first {ref.graph.nodes[bad_phi[0]]}")
    assert not problems, "native plan differs from the Python plan:\n  " + "\n  ".join(problems)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1))
def test_native_plan_equals_python_plan_on_random_graphs(native: Any, seed: int) -> None:
    assert_same_plan(native, random_case(seed))


def assert_same_probe(native: Any, roots: list[Any], state: State) -> None:
    """The two probes (NOTE [ Fast path ]): the same verdict always; the same
    "a custom-Function node was seen" where both walk the whole graph (no
    owned leaf; or the fast path under a policy that had to look for
    unowned leaves everywhere).  Where they stop early, what they saw before
    stopping depends on the order (depth-first in Python, breadth-first in
    C++): a node seen must then be one the graph has."""
    want = _probe.probe_python(roots, state)
    got = int(native.probe(tuple(roots), _native_backend.native_owners(state, native), state.policy_index,
                           torch.nn.Parameter))
    assert got & 3 == want & 3, f"policy {state.policy}: native verdict {got & 3}, Python {want & 3}"
    verdict = want & 3
    if verdict == _probe.PROBE_NO_OWNED or (verdict == _probe.PROBE_FAST and state.policy != "any"):
        assert got & _probe.PROBE_HIDDEN == want & _probe.PROBE_HIDDEN, f"policy {state.policy}: hidden differs"
    elif (got | want) & _probe.PROBE_HIDDEN:
        graph = _walk.walk([r for r in map(_nodes.root_node, roots) if r is not None])
        assert any(isinstance(n, _nodes.CUSTOM_FUNCTION) for n in graph.nodes), "a hidden node the graph lacks"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1))
def test_native_probe_equals_python_probe_on_random_graphs(native: Any, seed: int) -> None:
    """The plan parity test's graphs, under each policy."""
    case = random_case(seed)
    for policy in ("any", "plain_params", "plain"):
        assert_same_probe(native, case["roots"], State.of(case["state"].groups, policy))


def test_native_plan_equals_python_plan_on_a_large_graph(native: Any) -> None:
    """About 10^5 nodes, one chain 10^4 deep: both walks are iterative.

    (Not deeper: once Python wrappers of a chain's nodes have existed, torch
    2.13 frees a chain ~5*10^4 deep recursively and overflows the C stack on
    its own, with graphscale not involved.)"""
    a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    groups = (graphscale.Group([a], gas=2), graphscale.Group([b], gas=4))
    x = a * 1.0
    for i in range(10_000):
        x = x * 1.0 if i % 2 else x + 0.0
    branches = []
    for k in range(90):
        y = (b if k % 3 else a) * 1.0
        for _ in range(1_000):
            y = y + 0.0
        branches.append(y)
    loss = (x + torch.stack(branches).sum()).sum()
    state = State.of(groups, "any")
    case = dict(roots=[loss], state=state, factors={g: g.factor() for g in groups}, base=1.0, carrier=None, inputs=[])
    assert_same_plan(native, case)


def test_phi_of_unknown_node_is_none(native: Any) -> None:
    p = torch.nn.Parameter(torch.ones(2))
    groups = (graphscale.Group([p], gas=2),)
    state = State.of(groups, "any")
    plan = _native_backend.of(native).plan([(p * 2).sum()], PlanRequest(Reading(state, {groups[0]: 0.5})))
    assert plan.phi_of((p * 3).grad_fn) is None
    assert plan.phi_of(None) is None
