"""Random programs over 1-4 groups with different GAS: what the property
tests (tests/core/test_property.py: governed against plain PyTorch) and the route
parity tests (tests/native/test_route.py: native route against Python route)
run.

A program is a list of abstract ops over a growing list of values (indices
are taken modulo the list's length), then one ``torch.autograd.backward``
over 1-3 roots, optionally a second one over the retained graph.
:class:`World` runs one and returns each backward's gradients.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

from helpers.functions import BackwardThrough, Cube, Recompute
from helpers.grads import leaf_grads

__all__ = ["D", "F64", "GAS_CHOICES", "OPS", "Program", "programs", "World"]

D = 3
F64 = torch.float64
GAS_CHOICES = (1, 2, 3, 4, 8)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D, dtype=F64)
        self.sub = nn.Linear(D, D, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sub(torch.tanh(self.inp(x)))


class WithShared(nn.Module):
    """``module(x @ w)``: the unowned parameter ``w`` inside a checkpointed segment."""

    def __init__(self, w: nn.Parameter, module: nn.Module) -> None:
        super().__init__()
        self.w, self.module = w, module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x @ self.w)


OPS = ("group", "sub", "unowned", "shared_param", "add", "mul", "detach",
       "ckpt_reentrant", "ckpt_non_reentrant", "cube", "recompute", "through")


@dataclass(frozen=True)
class Program:
    gas: tuple[int, ...]
    ops: tuple[tuple[str, int, int, int], ...]
    roots: tuple[tuple[int, bool], ...]  # (value index, reduce to a scalar with .sum())
    second_pass: bool

    def __repr__(self) -> str:  # hypothesis prints this for a failing example
        lines = [f"gas={self.gas} second_pass={self.second_pass} roots={self.roots}"]
        lines += [f"  {op}({i}, {j}, {k})" for op, i, j, k in self.ops]
        return "\n".join(lines)


# Weighted by repetition: sharing across regions and nested backwards are where bugs hide.
OP_WEIGHTS = (("group", 4), ("sub", 1), ("unowned", 3), ("shared_param", 2), ("add", 3), ("mul", 1),
              ("detach", 1), ("ckpt_reentrant", 3), ("ckpt_non_reentrant", 1), ("cube", 1), ("recompute", 3),
              ("through", 3))
assert {op for op, _ in OP_WEIGHTS} == set(OPS)


def pick(vals: list[torch.Tensor], j: int) -> torch.Tensor:
    """Operand ``j``: mostly one of the three newest values (deep, connected graphs), else any."""
    return vals[-1 - j % min(3, len(vals))] if j < 10 else vals[j % len(vals)]


programs = st.builds(
    Program,
    gas=st.lists(st.sampled_from(GAS_CHOICES), min_size=1, max_size=4).map(tuple),
    ops=st.lists(
        st.tuples(st.sampled_from([op for op, n in OP_WEIGHTS for _ in range(n)]),
                  st.integers(0, 3), st.integers(0, 15), st.integers(0, 15)),
        min_size=3, max_size=12,
    ).map(tuple),
    roots=st.lists(st.tuples(st.integers(0, 15), st.booleans()), min_size=1, max_size=3).map(tuple),
    second_pass=st.booleans(),
)


class World:
    def __init__(self, gas: tuple[int, ...]) -> None:
        torch.manual_seed(0)
        self.gas = gas
        self.g = [Mlp() for _ in gas]
        self.pre = nn.Linear(D, D, dtype=F64)
        self.w = nn.Parameter(torch.randn(D, D, dtype=F64) / 2)
        self.x = torch.randn(2, D, dtype=F64, requires_grad=True)
        self.data = torch.randn(2, D, dtype=F64)

    def leaves(self) -> dict[str, torch.Tensor]:
        out = {f"g{i}.{n}": p for i, m in enumerate(self.g) for n, p in m.named_parameters()}
        out.update({f"pre.{n}": p for n, p in self.pre.named_parameters()})
        out["w"], out["x"] = self.w, self.x
        return out

    def factor_of(self) -> dict[str, float]:
        return {f"g{i}.{n}": 1.0 / s for i, (m, s) in enumerate(zip(self.g, self.gas)) for n, _ in m.named_parameters()}

    def run(self, prog: Program) -> list[dict[str, torch.Tensor | None]]:
        vals: list[torch.Tensor] = [self.x, self.data]
        for op, i, j, k in prog.ops:
            a, b = pick(vals, j), pick(vals, k)
            grp = self.g[i % len(self.g)]
            # what a checkpoint or a nested backward wraps: a group, unowned layers, or both
            seg = (grp, self.pre, nn.Sequential(self.pre, grp), WithShared(self.w, grp))[k % 4]
            if op == "group":  # half the time through the unowned layer first: shared across regions
                v = grp(torch.tanh(self.pre(a))) if k % 2 else grp(a)
            elif op == "sub":
                v = grp.sub(a)
            elif op == "unowned":
                v = torch.tanh(self.pre(a))
            elif op == "shared_param":
                v = a @ self.w
            elif op == "add":
                v = a + b
            elif op == "mul":
                v = torch.tanh(a * b)
            elif op == "detach":
                v = a.detach()
            elif op == "ckpt_reentrant":
                v = checkpoint(seg, a, use_reentrant=True)
            elif op == "ckpt_non_reentrant":
                v = checkpoint(seg, a, use_reentrant=False)
            elif op == "cube":
                v = Cube.apply(a)
            elif op == "recompute":
                v = Recompute.apply(a, seg, 2.0 if j % 2 else 1.0)
            else:  # through
                v = BackwardThrough.apply(a, a)
            vals.append(v)
        live = [v for v in vals if v.requires_grad]
        roots, seeds = [], []
        gen = torch.Generator().manual_seed(1)
        for idx, reduce in prog.roots:
            r = pick(live, idx)
            if reduce and r.grad_fn is not None:
                roots.append(r.sum())
                seeds.append(None)
            else:
                roots.append(r)
                seeds.append(torch.randn(r.shape, dtype=F64, generator=gen))
        torch.autograd.backward(roots, seeds, retain_graph=prog.second_pass)
        passes = [self.take_grads()]
        if prog.second_pass:
            torch.autograd.backward(roots[:1], seeds[:1])
            passes.append(self.take_grads())
        return passes

    def take_grads(self) -> dict[str, torch.Tensor | None]:
        """The gradients of one backward (the contract is per backward), then clear them."""
        return leaf_grads(self.leaves(), clear=True)
