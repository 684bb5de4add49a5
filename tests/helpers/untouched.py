"""What the tests of touching only what is governed (issue 13,
tests/core/test_untouched*.py, test_swapped_parameters.py) share: the
policies, small models and their plain gradients."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from graphscale._entry import entry as _backward

from helpers.engines import require_deepspeed

POLICIES = ("plain_params", "plain", "any")
DS_MARKS = [pytest.mark.deepspeed, require_deepspeed]


# float32.  DeepSpeed divides by GAS 2 and averages over one rank: measured
# bit-equal to plain x 1/2 (0.19.5 and 0.19.8); the bound allows a later
# DeepSpeed another summation order.
DS_RTOL = 1e-6


def linear(seed: int, bias: bool = True) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(4, 4, bias=bias)


class Tower(nn.Module):
    """``l2(tanh(l1(x)))``; ``reentrant``: ``l2`` runs inside a reentrant checkpoint."""

    def __init__(self, seed: int, reentrant: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.l1, self.l2 = nn.Linear(4, 4), nn.Linear(4, 4)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        return checkpoint(self.l2, h, use_reentrant=True) if self.reentrant else self.l2(h)


def data(seed: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))


def plain_grads(module: nn.Module, loss_of: Callable[[nn.Module], torch.Tensor]) -> list[torch.Tensor]:
    """The oracle: ``loss_of(module)``'s gradients in plain PyTorch (run
    before anything is installed; ``module`` is a copy no one else uses)."""
    assert torch.autograd.backward is _backward.ORIGINAL_BACKWARD, "an oracle must run without graphscale"
    module.zero_grad(set_to_none=True)
    loss_of(module).backward()
    out = [grad_of(p) for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return out


def grad_of(t: torch.Tensor) -> torch.Tensor:
    """``t.grad``, which the test expects to be set (a clone)."""
    assert t.grad is not None, "no gradient where one was expected"
    return t.grad.detach().clone()


def unequal(got: list[torch.Tensor | None], want: list[torch.Tensor]) -> list[str]:
    """Every tensor that is not bit-equal to its oracle, readably."""
    bad = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g is None or not torch.equal(g, w):
            ratio = None if g is None else (g.double().norm() / w.double().norm()).item()
            bad.append(f"parameter {i}: got plain x {ratio}")
    return bad
