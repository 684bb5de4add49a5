"""The native route (graphscale/_routes/native.py, NOTE [ One native call per
backward ] in graphscale/_native/registry.h) against the Python route, the
reference: the same gradients, bit for bit, and the same walks on the
property tests' random programs (tests/helpers/programs.py) and on the shapes that
take each branch (left alone, fast path, planned, nested); and nothing left
behind when a native hook or the backward itself fails."""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch import nn
from torch.utils.checkpoint import checkpoint

import graphscale
from graphscale import _native, observe  # noqa: F401
from graphscale._backward import gate as _gate
from graphscale._backward import running as _running

from helpers import seams
from helpers.functions import Boom, Recompute
from helpers.programs import Program, World, programs


@pytest.fixture
def native(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The native module's test build (tests/helpers/seams.py), governing for this test."""
    return seams.swap_in(monkeypatch)


def _both_routes(run: Callable[[], Any], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """``run()`` on the native route, then on the Python route: (native, python)."""
    native_out = run()
    with _gate.route_override(False):
        python_out = run()
    return native_out, python_out


def _assert_same(native_out: Any, python_out: Any) -> None:
    # The same walks; in another order where backwards nest: the native route
    # reports a backward's walk when its one call returns, after the nested ones.
    assert sorted(native_out[1]) == sorted(python_out[1]), "the routes walked differently"
    for n, (a, b) in enumerate(zip(native_out[0], python_out[0], strict=True)):
        assert a.keys() == b.keys()
        for k in a:
            if a[k] is None or b[k] is None:
                assert a[k] is None and b[k] is None, f"backward #{n + 1}, {k}: one route gave no gradient"
            else:
                assert torch.equal(a[k], b[k]), f"backward #{n + 1}, {k}: the routes differ"


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(prog=programs)
def test_random_programs_get_the_same_gradients_and_walks_on_both_routes(
        prog: Program, native: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for unowned in ("any", "plain_params", "plain"):
        def run() -> tuple[list[Any], list[tuple[int, int]]]:
            world = World(prog.gas)
            groups = [graphscale.Group(m, gas=s, name=f"g{i}") for i, (m, s) in enumerate(zip(world.g, world.gas))]
            walks: list[tuple[int, int]] = []
            with warnings.catch_warnings(), graphscale.install(*groups, unowned=unowned):  # noqa: B023
                warnings.simplefilter("ignore")
                with observe.walks(lambda n, s, m: walks.append((n, m))):
                    got = world.run(prog)
            return got, walks

        _assert_same(*_both_routes(run, monkeypatch))


class _Tower(nn.Module):
    """Two Linear blocks, each behind a reentrant checkpoint (a nested backward each)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=True)
        return x


def _shape_case(shape: str) -> Callable[[], tuple[list[Any], list[tuple[int, int]]]]:
    def run() -> tuple[list[Any], list[tuple[int, int]]]:
        torch.manual_seed(0)
        a, b, tower = nn.Linear(4, 4), nn.Linear(4, 4), _Tower()
        gas_b = 2 if shape == "fast path" else 4
        groups = [graphscale.Group(a, gas=2), graphscale.Group(b, gas=gas_b), graphscale.Group(tower, gas=8)]
        x = torch.randn(3, 4, requires_grad=True)
        walks: list[tuple[int, int]] = []
        with graphscale.install(*groups), observe.walks(lambda n, s, m: walks.append((n, m))):
            if shape == "left alone":
                nn.Linear(4, 4)(x).sum().backward()
            elif shape == "fast path":
                (a(x) + b(x)).sum().backward()
            elif shape == "planned, two roots with seeds":
                torch.autograd.backward([a(b(x)).sum(), b(x).pow(2)], [None, torch.full((3, 4), 0.5)])
            elif shape == "retain_graph twice":
                loss = (a(x) * b(x)).sum()
                loss.backward(retain_graph=True)
                loss.backward()
            elif shape == "nested: checkpointed tower":
                (tower(a(x)) + b(x)).pow(2).mean().backward()
            elif shape == "nested: a custom Function's backward":
                Recompute.apply(a(x), b, 2.0, True).sum().backward()
        return [{"a": a.weight.grad, "b": b.weight.grad, "t": tower.blocks[0].weight.grad, "x": x.grad}], walks
    return run


@pytest.mark.parametrize("shape", ["left alone", "fast path", "planned, two roots with seeds", "retain_graph twice",
                                   "nested: checkpointed tower", "nested: a custom Function's backward"])
def test_each_branch_of_the_native_route_matches_the_python_route(
        shape: str, native: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    got, want = _both_routes(_shape_case(shape), monkeypatch)
    _assert_same(got, want)
    if shape.startswith("nested"):
        assert len(got[1]) >= 2, "the nested backward was not planned"


def _leftovers(native: Any, before: tuple[int, ...]) -> dict[str, Any]:
    tally = native.hook_tally()
    return {"multiplier hooks alive": tally[1] - before[1], "binding hooks alive": tally[3] - before[3],
            "running plans": _running.running(), "bound tasks": dict(_running.bindings)}


_CLEAN = {"multiplier hooks alive": 0, "binding hooks alive": 0, "running plans": (), "bound tasks": {}}


@pytest.mark.skipif(not _gate.route_enabled(),
                    reason="breaks the native route's own hooks: with GRAPHSCALE_ROUTE=python "
                    "no backward reaches them (the Python route's failures: tests/hardening/test_hooks.py)")
@pytest.mark.parametrize("where", ["the first native hook", "a node of the backward", "a nested backward's last hook"])
def test_a_failure_inside_the_native_route_leaves_no_hook_plan_or_binding_behind(
        where: str, native: Any) -> None:
    torch.manual_seed(0)
    a, b, tower = nn.Linear(4, 4), nn.Linear(4, 4), _Tower()
    x = torch.randn(3, 4, requires_grad=True)
    groups = (graphscale.Group(a, gas=2), graphscale.Group(b, gas=4), graphscale.Group(tower, gas=8))

    def loss() -> torch.Tensor:
        if where == "a node of the backward":
            return (Boom.apply(a(x)) + b(x)).sum()
        if where == "the first native hook":
            return (a(x) + b(x)).sum()
        return (tower(b(a(x))) + b(x)).sum()  # every block's nested backward multiplies: b's factor enters

    before = tuple(native.hook_tally())
    with graphscale.install(*groups):
        calls = 1
        if where == "a nested backward's last hook":
            n0 = native.hook_tally()[4]
            loss().backward()  # count the hook calls of one whole backward
            calls = native.hook_tally()[4] - n0
            assert calls >= 3, "the nested backwards placed no multiplication: the test would not reach them"
        made = tuple(native.hook_tally())
        if where != "a node of the backward":
            native._inject_hook_failure(calls)
        try:
            with pytest.raises(RuntimeError, match="injected by a test|boom"):
                loss().backward()
        finally:
            native._inject_hook_failure(0)
        assert native.hook_tally()[0] > made[0], "no native hook was made: the test would pass without the route"
        assert _leftovers(native, before) == _CLEAN
        # The next backward is exact (contract item 3).
        for p in (*a.parameters(), *b.parameters()):
            p.grad = None
        (a(x) + b(x)).sum().backward()
    xs = x.detach()
    want_a = torch.autograd.grad(nn.functional.linear(xs, a.weight, a.bias).sum(), a.weight)[0] / 2
    want_b = torch.autograd.grad(nn.functional.linear(xs, b.weight, b.bias).sum(), b.weight)[0] / 4
    torch.testing.assert_close(a.weight.grad, want_a, rtol=0, atol=0)
    torch.testing.assert_close(b.weight.grad, want_b, rtol=0, atol=0)
