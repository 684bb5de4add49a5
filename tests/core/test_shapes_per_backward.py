"""What each backward reads and leaves, against the same plain-PyTorch
oracle as tests/core/test_shapes.py: gradients made with ``create_graph=True`` stay
differentiable (second order exact), and a callable GAS is read at every
backward.
"""
from __future__ import annotations

import pytest
import torch

import graphscale

from helpers.grads import grad_mismatches, leaf_grads
from helpers.worlds import World


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
