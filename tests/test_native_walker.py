"""The native walker (graphscale/_native) makes the same plan as the Python
reference (graphscale/_walk.py + graphscale/_plan.py), and graphscale keeps
working, exactly, with the Python walker forced or as the fallback.

Native checks skip cleanly where the extension cannot be compiled."""
from __future__ import annotations

import logging
import random
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.autograd.graph import get_gradient_edge

import graphscale
from graphscale import _native, _planning
from graphscale._state import State
from graphscale._errors import GraphscaleError


@pytest.fixture(scope="module")
def native() -> Any:
    mod = _native.load() if _native.walker_choice() != "python" else None
    if mod is None:
        pytest.skip("the native walker cannot be compiled here (or GRAPHSCALE_WALKER=python)")
    return mod


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
    request = _planning.PlanRequest(
        case["state"], case["factors"], base=case["base"], carrier=case["carrier"],
        inputs=tuple(case["inputs"]), outer_phi=case.get("outer_phi"), hint=case.get("hint"),
    )
    ref = _planning.build_plan(case["roots"], request)
    got = _planning.native_plan(native, case["roots"], request)
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
    plan = _planning.native_plan(native, [(p * 2).sum()], _planning.PlanRequest(state, {groups[0]: 0.5}))
    assert plan.phi_of((p * 3).grad_fn) is None
    assert plan.phi_of(None) is None


def _nested_exact(monkeypatch: pytest.MonkeyPatch, walker: str) -> None:
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setenv(_native.WALKER_ENV, walker)
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)

    def loss_fn() -> torch.Tensor:
        h = checkpoint(a, x, use_reentrant=True).tanh()
        return checkpoint(b, h, use_reentrant=True).sum() + a(x).sum()

    loss_fn().backward()
    want = [p.grad.clone() / 2 for p in a.parameters()] + [p.grad.clone() / 4 for p in b.parameters()]
    for p in [*a.parameters(), *b.parameters()]:
        p.grad = None
    with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4)):
        loss_fn().backward()
    got = [p.grad for p in [*a.parameters(), *b.parameters()]]
    errs = [(g - w).abs().max().item() for g, w in zip(got, want)]
    assert max(errs) < 1e-6, f"{walker} walker: errors {errs}"


@pytest.mark.parametrize("walker", ["python", "auto"])
def test_governed_backward_exact_with_either_walker(monkeypatch: pytest.MonkeyPatch, walker: str) -> None:
    _nested_exact(monkeypatch, walker)


def test_forcing_python_never_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_native.WALKER_ENV, "python")
    monkeypatch.setattr(_native, "_module", None)
    monkeypatch.setattr(_native, "_failed", None)

    def boom(*a: Any, **k: Any) -> None:
        raise AssertionError("compiled although GRAPHSCALE_WALKER=python")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", boom)
    assert _native.load() is None
    _nested_exact(monkeypatch, "python")


def test_bad_walker_value_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_native.WALKER_ENV, "fortran")
    with pytest.raises(GraphscaleError, match="GRAPHSCALE_WALKER"):
        _native.walker_choice()


def test_compile_failure_falls_back_and_logs_once(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(_native, "_module", None)
    monkeypatch.setattr(_native, "_failed", None)
    calls = []

    def fail(*a: Any, **k: Any) -> None:
        calls.append(1)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpp_extension, "load", fail)
    monkeypatch.setenv(_native.WALKER_ENV, "auto")
    with caplog.at_level(logging.INFO, logger="graphscale"):
        assert _native.load() is None
        assert _native.load() is None
        _nested_exact(monkeypatch, "auto")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "Python walker" in r.getMessage()]
    assert len(calls) == 1 and len(warnings) == 1, (calls, [r.getMessage() for r in caplog.records])
    monkeypatch.setenv(_native.WALKER_ENV, "native")
    with pytest.raises(GraphscaleError, match="could not be built"):
        _native.load()
