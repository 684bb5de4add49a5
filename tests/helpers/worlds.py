"""The plain world of the shape tests (tests/core/test_shapes*.py,
test_walk_once.py): groups of small MLPs and unowned leaves built from one
seed, and a program run twice from it, plain and governed, checked against
the plain-PyTorch oracle."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import graphscale

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
