"""What the audit tests (tests/tools/test_audit*.py) share: a nested
program and a planner made wrong on purpose."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

import graphscale
from graphscale._routes import python as _python_route


def nested() -> tuple[list[graphscale.Group], Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    outer, inner = torch.nn.Linear(3, 1), torch.nn.Linear(3, 3)
    x = torch.randn(4, 3)
    groups = [graphscale.Group(outer, gas=2, name="outer"), graphscale.Group(inner, gas=4, name="inner")]
    return groups, lambda: outer(torch.tanh(inner(x))).sum()


def double_every_edge_multiplier(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """A planner bug: every edge multiplication applied twice over (in the
    Python route's hooks, so the route is switched to it: the ``python_route``
    fixture)."""
    request.getfixturevalue("python_route")
    real = _python_route.post_hook
    monkeypatch.setattr(_python_route, "post_hook",
                        lambda mults, *rest: real(tuple((k, 2 * m) for k, m in mults), *rest))
