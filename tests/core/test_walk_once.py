"""What a governed backward costs in the graph: groups at factor 1 cost
nothing (no walk, no seed multiplication, no node hook), the walk visits each
node once and multiplies once per group boundary (counted independently of
graphscale's walker), and a group beside its own submodule takes the fast
path.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import graphscale
from graphscale._backward import decide as _planning
from graphscale._core import snapshot as _snapshot
from graphscale._planner import plan as _pyplan
from graphscale._planner.request import PlanRequest
from graphscale._routes import python as _python_route

from helpers.functions import Recompute
from helpers.grads import grad_mismatches, leaf_grads
from helpers.worlds import World


# ---------------------------------------------------------------- factor 1 is free
@pytest.mark.parametrize("unowned", ["any", "plain"])
def test_groups_with_factor_one_cost_nothing(unowned: str, monkeypatch: pytest.MonkeyPatch, python_route: None) -> None:
    """All groups at gas 1: no walk, no seed multiplication, no node hook, and
    nested backwards (checkpoint, custom Function) pass straight through."""
    calls: list[str] = []

    def spy(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*a: Any, **k: Any) -> Any:
            calls.append(name)
            return real(*a, **k)

        return wrapped

    monkeypatch.setattr(_planning, "plan_backward", spy("plan_backward", _planning.plan_backward))
    monkeypatch.setattr(_python_route, "scaled_seeds", spy("scaled_seeds", _python_route.scaled_seeds))
    for name in ("post_hook", "_run_plan"):
        monkeypatch.setattr(_python_route, name, spy(name, getattr(_python_route, name)))

    def program(w: World) -> None:
        h = checkpoint(w.g[1], w.pre(w.x), use_reentrant=True)
        (w.g[0](h) + Recompute.apply(w.g[0](w.y), w.g[1], 2.0, True)).sum().backward()

    plain_world = World((1, 1))
    program(plain_world)
    world = World((1, 1))
    with graphscale.install(*world.groups(), unowned=unowned):
        program(world)
    assert calls == [], f"factor 1 should cost nothing, but graphscale ran: {calls}"
    bad = grad_mismatches(leaf_grads(plain_world.leaves()), leaf_grads(world.leaves()), world.factor_of(), "plain")
    assert not bad, "\n  ".join(bad)
    # The spies do see work once a factor differs from 1 (so the test can fail):
    world = World((1, 2))
    with graphscale.install(*world.groups(), unowned=unowned):
        program(world)
    assert "_run_plan" in calls


# ---------------------------------------------------------------- walk size and multiplications
def _reachable(root: Any) -> int:
    """Nodes reachable from ``root``, counted independently of graphscale's walker."""
    seen, stack = {root}, [root]
    while stack:
        for nxt, _ in stack.pop().next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return len(seen)


def two_groups_sum(w: World, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (w.g[0](x) + w.g[1](x)).sum()


def two_groups_nested(w: World, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return w.g[0](w.g[1](x)).sum()


def group_and_its_submodule(w: World, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (w.g[0](x) + w.g[0].sub(y)).sum()


# Inputs without grad (data): one multiplication per group region entered,
# the seed counting for the region at the root.  An unowned input that
# requires grad and is reached from two regions needs one more (its single
# factor must be restored on one of the two paths); none can be saved there.
@pytest.mark.parametrize(
    "loss_of, gas, unowned, inputs_require_grad, multiplications",
    [
        pytest.param(two_groups_sum, (2, 4), "any", False, 2, id="g1(x)+g2(x)"),
        pytest.param(two_groups_sum, (2, 4), "any", True, 3, id="g1(x)+g2(x)_x_requires_grad"),
        pytest.param(two_groups_nested, (2, 4), "any", False, 2, id="g1(g2(x))"),
        pytest.param(two_groups_nested, (2, 4), "any", True, 2, id="g1(g2(x))_x_requires_grad"),
        pytest.param(two_groups_sum, (1, 2), "any", False, 1, id="g1(x)+g2(x)_g1_at_gas_1"),
        pytest.param(two_groups_nested, (1, 2), "any", False, 1, id="g1(g2(x))_g1_at_gas_1"),
        pytest.param(group_and_its_submodule, (2,), "plain", False, 1, id="g(x)+g.sub(y)_under_plain"),
    ],
)
def test_walk_visits_each_node_once_and_multiplies_once_per_group_boundary(
    loss_of: Callable[..., torch.Tensor], gas: tuple[int, ...], unowned: str, inputs_require_grad: bool,
    multiplications: int,
) -> None:
    world = World(gas)
    x, y = (world.x, world.y) if inputs_require_grad else (world.x.detach(), world.y.detach())
    loss = loss_of(world, x, y)
    with graphscale.install(*world.groups(), unowned=unowned):
        state = _snapshot.current()
        assert state is not None
        factors = {g: g.factor() for g in state.groups}
        one_factor = len(set(factors.values())) == 1  # the probe proves no unowned leaf is reached: fast path
        assert _planning.decide([loss], _snapshot.Reading(state, factors), ())[0] == (_planning.FAST_PATH if one_factor
                                                                 else _planning.PLANNED)
        plan, _ = _pyplan.build([loss], PlanRequest(_snapshot.Reading(state, factors)))
    assert len(plan.graph) == _reachable(loss.grad_fn)
    assert plan.multiplications == multiplications


def test_group_and_its_submodule_take_the_fast_path(monkeypatch: pytest.MonkeyPatch, python_route: None) -> None:
    """``g(x) + g.sub(y)`` with one group: no walk, one multiplication (the seed)."""
    walked: list[Any] = []
    seed_mults: list[float] = []
    real_seeds = _python_route.scaled_seeds
    monkeypatch.setattr(_python_route, "_run_plan", lambda *a, **k: walked.append(a))

    def seeds(roots: Any, grads: Any, mults: Any) -> Any:
        seed_mults.extend(m for m in mults if m != 1.0)
        return real_seeds(roots, grads, mults)

    monkeypatch.setattr(_python_route, "scaled_seeds", seeds)
    world = World((4,))
    with graphscale.install(*world.groups()):
        group_and_its_submodule(world, world.x.detach(), world.y.detach()).backward()
    assert walked == []
    assert seed_mults == [0.25]
