"""Which route governs a backward is said, never a guess (NOTE [ Which route
governs a backward ] in graphscale/_backward/gate.py), the DEBUG log changes no route,
and a native route that would be wrong on this torch is caught by its
self-test before it governs anything (NOTE [ The native route's self-test ])."""
from __future__ import annotations

import logging
import re
import warnings
from typing import Any

import pytest
import torch

import graphscale
from graphscale import _native, observe
from graphscale._backward import gate as _gate

from helpers.grads import max_rel_err
from helpers.routes import native_route_or_skip


def _pair() -> tuple[tuple[graphscale.Group, graphscale.Group], torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
    return (graphscale.Group(a, gas=2, name="a"), graphscale.Group(b, gas=4, name="b")), a, b


def test_every_governed_backward_says_its_route_and_a_decline_its_reason() -> None:
    groups, a, b = _pair()
    seen: list[tuple[str, Any]] = []
    before = observe.declines()
    x = torch.randn(4, 3)
    with graphscale.install(*groups):
        with observe.routes(lambda route, reason: seen.append((route, reason))):
            b(a(x)).sum().backward()
            b(a(x)).sum().backward(inputs=[a.weight, b.weight])  # the Python route pins inputs=
    native = _native.loaded() is not None and _gate.route_enabled()
    first = ("native", None) if native else ("python", "GRAPHSCALE_ROUTE=python" if not _gate.route_enabled()
                                             else "native walker not ready")
    second = ("python", "inputs=") if native else first
    assert seen == [first, second]
    after = observe.declines()
    declined = [reason for route, reason in seen if route == "python"]
    for reason in set(declined):
        assert after.get(reason, 0) - before.get(reason, 0) == declined.count(reason), (before, after)


def test_the_debug_log_changes_no_route_and_both_routes_write_it(caplog: pytest.LogCaptureFixture) -> None:
    native_route_or_skip()
    groups, a, b = _pair()
    seen: list[Any] = []
    x = torch.randn(4, 3)
    params = [*a.parameters(), *b.parameters()]
    plain = torch.autograd.grad(b(a(x).tanh()).sum() + a(x).sum(), params)
    with graphscale.install(*groups):
        with observe.routes(lambda route, reason: seen.append(route)):
            with caplog.at_level(logging.DEBUG, logger="graphscale"):
                (b(a(x).tanh()).sum() + a(x).sum()).backward()
    assert seen == ["native"]
    (line,) = [r.getMessage() for r in caplog.records if "walked" in r.getMessage()]
    assert "native route" in line and "factors ['a=0.5', 'b=0.25']" in line, line
    assert max_rel_err([p.grad for p in params], [g / 2 for g in plain[:2]] + [g / 4 for g in plain[2:]]) == 0


class _Skewed:
    """The native module, but its top-level call doubles every factor: a
    native route a torch release broke, as the self-test must catch it."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def top(self, gov: Any, roots: Any, grads: Any, reading: Any, factors: Any, *rest: Any) -> Any:
        return self._real.top(gov, roots, grads, reading, [2 * f for f in factors], *rest)


def test_the_self_test_passes_on_this_torch_and_needs_the_patch_for_its_nested_backward() -> None:
    native = native_route_or_skip()
    groups, _, _ = _pair()
    with graphscale.install(*groups):  # (install runs it; here it reads the verdict)
        assert _gate.self_test(native) and _gate.trusted(native)
    assert _gate.self_test(native)  # the verdict stays


def test_a_native_route_giving_a_wrong_factor_fails_its_self_test_with_one_warning_and_every_backward_goes_python(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    native = native_route_or_skip()
    skewed = _Skewed(native)
    monkeypatch.setattr(_gate, "_verdicts", dict(_gate._verdicts))  # this test's verdicts go with it
    said = rf"self-test on torch {re.escape(torch.__version__)} \(a planned backward, native route: a.weight"
    groups, a, b = _pair()
    with graphscale.install(*groups):  # the self-test's nested backward is governed through the patch
        with pytest.warns(RuntimeWarning, match=said):
            assert not _gate.self_test(skewed)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # one warning: the verdict is kept
            assert not _gate.trusted(skewed)
    monkeypatch.setattr(_native, "load", lambda: skewed)
    seen: list[Any] = []
    x = torch.randn(4, 3)
    params = [*a.parameters(), *b.parameters()]
    plain = torch.autograd.grad(b(a(x)).sum(), params)
    with graphscale.install(*groups):
        with observe.routes(lambda route, reason: seen.append((route, reason))):
            b(a(x)).sum().backward()
    assert seen == [("python", "self-test failed")]
    assert max_rel_err([p.grad for p in params], [g / 2 for g in plain[:2]] + [g / 4 for g in plain[2:]]) == 0
