"""Every graph shape of issue 2, item 4, against a plain-PyTorch oracle.

Each case runs the same program twice from the same seed: once plain, once
with graphscale installed.  Owned leaves must get exactly ``plain / gas`` of
their group; unowned leaves exactly ``plain`` under ``unowned="plain"`` and
``plain`` times one factor in play under ``"any"`` (see ``grad_mismatches``).
Every case also checks that the plain gradients themselves would fail that
comparison, so a graphscale that did nothing could not pass.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils.checkpoint import checkpoint

import graphscale
from graphscale._backward import decide as _planning
from graphscale._backward import pyplan as _pyplan
from graphscale._backward import python_route as _python_route
from graphscale._core import request as _request
from graphscale._core import snapshot as _snapshot

from helpers.functions import BackwardThrough, Cube, Recompute
from helpers.grads import grad_mismatches, leaf_grads

D = 4
F64 = torch.float64


class Mlp(nn.Module):
    """A small group: ``sub(tanh(inp(x)))``; ``sub`` is called directly by some cases."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D, dtype=F64)
        self.sub = nn.Linear(D, D, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sub(torch.tanh(self.inp(x)))


class World:
    """Groups ``g[i]`` with ``gas[i]``; unowned: ``pre`` (a Linear), ``w`` (a
    Parameter), ``x`` and ``y`` (input leaves that require grad)."""

    def __init__(self, gas: tuple[Any, ...], seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.gas = gas
        self.g = [Mlp() for _ in gas]
        self.pre = nn.Linear(D, D, dtype=F64)
        self.w = nn.Parameter(torch.randn(D, D, dtype=F64))
        self.x = torch.randn(3, D, dtype=F64, requires_grad=True)
        self.y = torch.randn(3, D, dtype=F64, requires_grad=True)

    def leaves(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for i, m in enumerate(self.g):
            for n, p in m.named_parameters():
                out[f"g{i}.{n}"] = p
        for n, p in self.pre.named_parameters():
            out[f"pre.{n}"] = p
        out["w"], out["x"], out["y"] = self.w, self.x, self.y
        return out

    def groups(self) -> list[graphscale.Group]:
        return [graphscale.Group(m, gas=s, name=f"g{i}") for i, (m, s) in enumerate(zip(self.g, self.gas))]

    def params(self) -> set[str]:
        """The names of the unowned nn.Parameter leaves."""
        return {n for n, t in self.leaves().items() if isinstance(t, nn.Parameter) and not n.startswith("g")}

    def factor_of(self) -> dict[str, float]:
        out = {}
        for i, m in enumerate(self.g):
            gas = self.gas[i]() if callable(self.gas[i]) else self.gas[i]
            for n, _ in m.named_parameters():
                out[f"g{i}.{n}"] = 1.0 / gas
        return out

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=F64)


Program = Callable[[World], "dict[str, torch.Tensor] | None"]


def run_plain_and_governed(program: Program, gas: tuple[int, ...], unowned: str) -> None:
    """Run ``program`` plain and governed; assert the contract, and that it is not vacuous."""
    plain_world = World(gas)
    plain_extra = program(plain_world) or {}
    plain = {**leaf_grads(plain_world.leaves()), **leaf_grads(plain_extra)}

    world = World(gas)
    with graphscale.install(*world.groups(), unowned=unowned):
        extra = program(world) or {}
    got = {**leaf_grads(world.leaves()), **leaf_grads(extra)}

    factor_of = world.factor_of()
    bad = grad_mismatches(plain, got, factor_of, unowned, params=world.params())
    assert not bad, "gradients differ from the oracle:\n  " + "\n  ".join(bad)
    # A graphscale that did nothing would hand back the plain gradients: they must fail.
    assert grad_mismatches(plain, plain, factor_of, unowned, params=world.params()), \
        "case cannot tell graphscale from no-op"


# ---------------------------------------------------------------- custom Functions
# ---------------------------------------------------------------- the shapes
def sum_of_groups(w: World) -> None:
    (w.g[0](w.x) + w.g[1](w.x)).sum().backward()


def product_of_groups(w: World) -> None:
    (w.g[0](w.x) * w.g[1](w.x)).sum().backward()


def sum_and_product_of_three(w: World) -> None:
    (w.g[0](w.x) * w.g[1](w.x) + w.g[2](w.y)).sum().backward()


def nested(w: World) -> None:
    w.g[0](w.g[1](w.x)).sum().backward()


def nested_three_deep_with_skip(w: World) -> None:
    h = w.g[2](w.x)
    (w.g[0](w.g[1](h) + h)).sum().backward()


def submodule_called_directly(w: World) -> None:
    (w.g[0](w.x) + w.g[0].sub(w.y)).sum().backward()


def submodule_called_directly_next_to_other_group(w: World) -> None:
    (w.g[0](w.x) + w.g[0].sub(w.y) * w.g[1](w.y)).sum().backward()


def shared_upstream_tensor(w: World) -> None:
    h = torch.tanh(w.pre(w.x))
    (w.g[0](h) + w.g[1](h) * w.g[2](h)).sum().backward()


def shared_unowned_parameter(w: World) -> None:
    (w.g[0](w.x @ w.w) + w.g[1](w.y @ w.w.t())).sum().backward()


def detach(w: World) -> None:
    h = w.g[0](w.x)
    (h + w.g[1](h.detach()) + w.g[2](w.g[1](w.y).detach())).sum().backward()


def checkpoint_reentrant(w: World) -> None:
    h = w.pre(w.x)
    out = w.g[0](checkpoint(w.g[1], h, use_reentrant=True))
    (out + checkpoint(w.g[2], w.g[0](w.y), use_reentrant=True)).sum().backward()


def checkpoint_reentrant_with_unowned_inside(w: World) -> None:
    def seg(h: torch.Tensor) -> torch.Tensor:
        return w.g[1](w.pre(h) @ w.w)

    (w.g[0](checkpoint(seg, w.x, use_reentrant=True)) + w.pre(w.y) @ w.w).sum().backward()


def checkpoint_reentrant_unowned_shared_across_regions(w: World) -> None:
    """``pre`` is used inside a checkpoint below g0 and outside it below g1."""

    def seg(h: torch.Tensor) -> torch.Tensor:
        return w.g[1](w.pre(h) @ w.w)

    (w.g[0](checkpoint(seg, w.x, use_reentrant=True)) + w.g[1](w.pre(w.y) @ w.w)).sum().backward()


def checkpoint_reentrant_in_two_regions(w: World) -> None:
    """The same unowned layer checkpointed below g0 and below g1."""
    a = w.g[0](checkpoint(w.pre, w.x, use_reentrant=True))
    b = w.g[1](checkpoint(w.pre, w.y, use_reentrant=True))
    (a + b).sum().backward()


def checkpoint_non_reentrant(w: World) -> None:
    h = w.pre(w.x)
    out = w.g[0](checkpoint(w.g[1], h, use_reentrant=False))
    (out + checkpoint(w.g[2], w.g[0](w.y), use_reentrant=False)).sum().backward()


def custom_function(w: World) -> None:
    (w.g[0](Cube.apply(w.g[1](w.x))) + Cube.apply(w.g[0](w.y))).sum().backward()


def custom_function_nested_backward(w: World) -> None:
    (w.g[0](Recompute.apply(w.g[1](w.x), w.g[2], 1.0, True)) + w.g[1](w.y)).sum().backward()


def custom_function_nested_backward_scaled_seed(w: World) -> None:
    h = Recompute.apply(w.pre(w.x), w.g[1], 2.0, True)
    (w.g[0](h) + Recompute.apply(w.g[0](w.y), w.pre, 2.0, True)).sum().backward()


def custom_function_backward_through_enclosing_graph(w: World) -> None:
    u = w.pre(w.x)
    h = w.g[1](u)
    (w.g[0](BackwardThrough.apply(h, h)) + w.g[2](u)).sum().backward()


def several_roots(w: World) -> None:
    torch.autograd.backward([w.g[0](w.x).sum(), (w.g[1](w.x) * w.g[0](w.y)).sum(), w.g[1](w.y).mean()])


def non_scalar_roots_with_grad_tensors(w: World) -> None:
    a, b = w.g[0](w.x), w.g[1](w.g[0](w.y))
    torch.autograd.backward([a, b], [w.randn(*a.shape), w.randn(*b.shape)])


def roots_seeds_and_inputs_as_generators(w: World) -> None:
    a, b = w.g[0](w.x), w.g[1](w.g[0](w.y))
    seeds = [w.randn(*a.shape), w.randn(*b.shape)]
    inputs = [w.g[0].inp.weight, w.g[1].sub.bias, w.g[1].inp.weight, w.x]
    torch.autograd.backward((r for r in (a, b)), (s for s in seeds), inputs=(t for t in inputs))


def inputs_leaves(w: World) -> None:
    loss = (w.g[0](w.x) + w.g[1](w.x)).sum()
    torch.autograd.backward(loss, inputs=[w.g[0].inp.weight, w.g[1].sub.bias, w.x])


def inputs_non_leaf(w: World) -> dict[str, torch.Tensor]:
    h = w.pre(w.x)
    loss = (w.g[0](h) * w.g[1](h)).sum()
    torch.autograd.backward(loss, inputs=[h, w.g[1].inp.weight])
    return {"h(non-leaf input)": h}


def retained_graph_second_backward(w: World) -> None:
    loss = (w.g[0](w.g[1](w.x)) + w.g[1](w.y)).sum()
    loss.backward(retain_graph=True)
    loss.backward()


def root_is_a_leaf(w: World) -> None:
    loss = (w.g[0](w.x) + w.g[1](w.x)).sum()
    bias = w.g[1].sub.bias
    torch.autograd.backward([loss, bias, w.y], [None, w.randn(*bias.shape), w.randn(*w.y.shape)])


def root_is_only_a_leaf(w: World) -> None:
    torch.autograd.backward([w.g[0].sub.weight, w.g[1].inp.bias], [w.randn(D, D), w.randn(D)])


def gradient_edge_root(w: World) -> None:
    a = w.g[0](w.x) + w.g[1](w.x)
    torch.autograd.backward(get_gradient_edge(a), w.randn(*a.shape))


def gradient_edge_root_implicit_seed(w: World) -> None:
    loss = (w.g[0](w.x) * w.g[1](w.y)).sum()
    torch.autograd.backward(get_gradient_edge(loss))


def _torch_takes(call: Callable[[torch.Tensor], None]) -> bool:
    """Whether this torch's own torch.autograd.backward accepts a call form."""
    try:
        call(torch.ones(2, requires_grad=True).mul(2).sum())
        return True
    except (TypeError, AssertionError, RuntimeError):
        return False


NEEDS_BARE_EDGE = pytest.mark.skipif(
    not _torch_takes(lambda t: torch.autograd.backward(get_gradient_edge(t))),
    reason="this torch's torch.autograd.backward takes no bare GradientEdge root (2.6 does not, 2.13 does)")
NEEDS_GENERATORS = pytest.mark.skipif(
    not _torch_takes(lambda t: torch.autograd.backward((r for r in [t]), inputs=(i for i in [t]))),
    reason="this torch's torch.autograd.backward takes no generators (2.6 does not, 2.13 does)")


CASES = [
    pytest.param(sum_of_groups, (2, 4), id="sum_of_groups"),
    pytest.param(product_of_groups, (2, 4), id="product_of_groups"),
    pytest.param(sum_and_product_of_three, (2, 4, 3), id="sum_and_product_of_three"),
    pytest.param(nested, (2, 4), id="nested"),
    pytest.param(nested, (4, 1), id="nested_inner_gas_1"),
    pytest.param(nested_three_deep_with_skip, (2, 4, 8), id="nested_three_deep_with_skip"),
    pytest.param(submodule_called_directly, (2,), id="submodule_called_directly"),
    pytest.param(submodule_called_directly_next_to_other_group, (2, 4),
                 id="submodule_called_directly_next_to_other_group"),
    pytest.param(shared_upstream_tensor, (2, 4, 8), id="shared_upstream_tensor"),
    pytest.param(shared_unowned_parameter, (2, 4), id="shared_unowned_parameter"),
    pytest.param(detach, (2, 4, 3), id="detach"),
    pytest.param(checkpoint_reentrant, (2, 4, 8), id="checkpoint_reentrant"),
    pytest.param(checkpoint_reentrant_with_unowned_inside, (2, 4),
                 id="checkpoint_reentrant_with_unowned_inside"),
    pytest.param(checkpoint_reentrant_unowned_shared_across_regions, (2, 4),
                 id="checkpoint_reentrant_unowned_shared_across_regions"),
    pytest.param(checkpoint_reentrant_in_two_regions, (2, 4), id="checkpoint_reentrant_in_two_regions"),
    pytest.param(checkpoint_non_reentrant, (2, 4, 8), id="checkpoint_non_reentrant"),
    pytest.param(custom_function, (2, 4), id="custom_function"),
    pytest.param(custom_function_nested_backward, (2, 4, 8), id="custom_function_nested_backward"),
    pytest.param(custom_function_nested_backward_scaled_seed, (2, 4),
                 id="custom_function_nested_backward_seeded_with_2_grad"),
    pytest.param(custom_function_backward_through_enclosing_graph, (2, 4, 8),
                 id="custom_function_nested_backward_through_enclosing_graph"),
    pytest.param(several_roots, (2, 4), id="several_roots"),
    pytest.param(non_scalar_roots_with_grad_tensors, (2, 4), id="non_scalar_roots_with_grad_tensors"),
    pytest.param(inputs_leaves, (2, 4), id="inputs_leaves"),
    pytest.param(roots_seeds_and_inputs_as_generators, (2, 4), id="roots_seeds_and_inputs_as_generators",
                 marks=NEEDS_GENERATORS),
    pytest.param(roots_seeds_and_inputs_as_generators, (4, 4), id="roots_seeds_and_inputs_as_generators_fast_path",
                 marks=NEEDS_GENERATORS),
    pytest.param(inputs_non_leaf, (2, 4), id="inputs_non_leaf"),
    pytest.param(retained_graph_second_backward, (2, 4), id="retained_graph_second_backward"),
    pytest.param(root_is_a_leaf, (2, 4), id="root_is_a_leaf"),
    pytest.param(root_is_only_a_leaf, (2, 4), id="root_is_only_a_leaf"),
    pytest.param(root_is_only_a_leaf, (4, 4), id="root_is_only_a_leaf_fast_path"),
    pytest.param(gradient_edge_root, (2, 4), id="gradient_edge_root", marks=NEEDS_BARE_EDGE),
    pytest.param(gradient_edge_root_implicit_seed, (2, 4), id="gradient_edge_root_implicit_seed",
                 marks=NEEDS_BARE_EDGE),
    pytest.param(gradient_edge_root_implicit_seed, (4, 4), id="gradient_edge_root_implicit_seed_fast_path",
                 marks=NEEDS_BARE_EDGE),
]


@pytest.mark.parametrize("unowned", ["any", "plain_params", "plain"])
@pytest.mark.parametrize("program, gas", CASES)
def test_shape_matches_plain_oracle_scaled_per_group(program: Program, gas: tuple[int, ...], unowned: str) -> None:
    run_plain_and_governed(program, gas, unowned)


# ---------------------------------------------------------------- create_graph
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")
@pytest.mark.parametrize("unowned", ["any", "plain"])
def test_create_graph_scaled_grads_stay_differentiable(unowned: str) -> None:
    gas = (2, 4)

    def first_and_second_order(world: World, governed: bool) -> dict[str, torch.Tensor | None]:
        owned = {k: t for k, t in world.leaves().items() if k in world.factor_of()}
        (world.g[0](world.g[1](world.x)) * world.g[1](world.y)).sum().backward(create_graph=True)
        torch.manual_seed(1)
        probes = {k: torch.randn_like(t) for k, t in owned.items()}
        factor_of = world.factor_of()
        # governed: p.grad already carries 1/gas; plain: apply it by hand (the oracle).
        objective = sum(
            ((t.grad if governed else t.grad * factor_of[k]) * probes[k]).sum() for k, t in owned.items()
        )
        leaves = world.leaves()
        second = torch.autograd.grad(objective, list(leaves.values()), allow_unused=True)
        out = {f"d2/{k}": (None if s is None else s.detach()) for k, s in zip(leaves, second)}
        for k, t in owned.items():
            assert t.grad is not None and t.grad.requires_grad, f"{k}.grad is not differentiable"
            out[f"d1/{k}"] = t.grad.detach().clone()
        for t in leaves.values():
            t.grad = None
        return out

    plain = first_and_second_order(World(gas), governed=False)
    world = World(gas)
    with graphscale.install(*world.groups(), unowned=unowned):
        got = first_and_second_order(world, governed=True)
    # First order: owned leaves get plain/gas. Second order: both sides already hold the factors.
    factor_of = {f"d1/{k}": f for k, f in world.factor_of().items()}
    want = {k: v for k, v in plain.items()}
    for k in list(want):
        if k.startswith("d2/"):
            factor_of[k] = 1.0
    bad = grad_mismatches(want, got, factor_of, "plain")
    assert not bad, "create_graph gradients differ from the oracle:\n  " + "\n  ".join(bad)
    assert grad_mismatches(want, {k: v for k, v in plain.items()}, factor_of, "plain")


# ---------------------------------------------------------------- gas changing
@pytest.mark.parametrize("unowned", ["any", "plain"])
def test_callable_gas_is_read_at_every_backward(unowned: str) -> None:
    steps = [(2, 4), (8, 1), (3, 3)]
    now = {"i": 0}
    gas = (lambda: steps[now["i"]][0], lambda: steps[now["i"]][1])

    def step(world: World) -> None:
        (world.g[0](world.x) + world.g[1](world.g[0](world.y))).sum().backward()

    plain_world = World(gas)
    plain_steps = []
    for _ in range(len(steps)):
        step(plain_world)
        plain_steps.append(leaf_grads(plain_world.leaves()))
        for t in plain_world.leaves().values():
            t.grad = None

    world = World(gas)
    with graphscale.install(*world.groups(), unowned=unowned):
        for i in range(len(steps)):
            now["i"] = i
            step(world)  # grads accumulate over the steps, each with that step's gas
    got = leaf_grads(world.leaves())
    want: dict[str, torch.Tensor | None] = {}
    for k in got:
        owner = k.split(".")[0]
        if owner in ("g0", "g1"):
            want[k] = sum(ps[k] / steps[i][int(owner[1])] for i, ps in enumerate(plain_steps))
        else:
            want[k] = sum(ps[k] for ps in plain_steps) if plain_steps[0][k] is not None else None
    owned = {k: 1.0 for k in got if k.startswith("g")}
    if unowned == "plain":
        bad = grad_mismatches(want, got, owned, "plain")
    else:  # each step may give unowned leaves a different single factor: check owned leaves only
        bad = grad_mismatches({k: want[k] for k in owned}, {k: got[k] for k in owned}, owned, "plain")
    assert not bad, "callable gas not honoured per backward:\n  " + "\n  ".join(bad)
    # The same gas everywhere (the first step's) would be wrong:
    first = {k: (sum(ps[k] for ps in plain_steps) / steps[0][int(k[1])]) for k in owned}
    assert grad_mismatches(first, {k: got[k] for k in owned}, owned, "plain")


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
        plan, _ = _pyplan.build([loss], _request.PlanRequest(_snapshot.Reading(state, factors)))
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
