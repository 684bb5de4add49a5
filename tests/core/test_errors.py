"""Bad input is refused with a graphscale error that names the fault, and an
exception anywhere in a governed backward leaves nothing behind."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import graphscale
from graphscale._backward import running as _running
from graphscale._core import snapshot as _snapshot
from graphscale._entry import entry as _backward

from helpers.grads import grad_mismatches, leaf_grads

F64 = torch.float64


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 3, dtype=F64)
        self.head = nn.Linear(3, 3, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


# ---------------------------------------------------------------- configuration
@pytest.mark.parametrize("separately", [False, True], ids=["one_install", "two_installs"])
def test_parameter_in_two_groups_with_different_gas_is_a_configuration_error_naming_both(separately: bool) -> None:
    net = Net()
    actor = graphscale.Group(net, gas=2, name="actor")
    critic = graphscale.Group(net.head, gas=4, name="critic")
    if separately:
        with graphscale.install(actor) as first:
            with pytest.raises(graphscale.ConfigurationError) as info:
                graphscale.install(critic)
            assert first.active and _snapshot.current() is not None
            assert {g.name for g in _snapshot.current().groups} == {"actor"}
    else:
        with pytest.raises(graphscale.ConfigurationError) as info:
            graphscale.install(actor, critic)
    msg = str(info.value)
    assert msg.startswith("graphscale:") and "'actor'" in msg and "'critic'" in msg, msg
    assert torch.autograd.backward is _backward.ORIGINAL_BACKWARD


def test_parameter_in_two_groups_with_the_same_gas_is_scaled_once() -> None:
    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 3, dtype=F64)
    net(x).sum().backward()
    plain = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    with graphscale.install(graphscale.Group(net, gas=4, name="a"), graphscale.Group(net.head, gas=4, name="b"),
                            unowned="plain"):
        net(x).sum().backward()
    got = {n: p.grad for n, p in net.named_parameters()}
    bad = grad_mismatches(plain, got, {n: 0.25 for n in plain}, "plain")
    assert not bad, "\n  ".join(bad)


@pytest.mark.parametrize(
    "arg",
    [
        pytest.param(lambda: nn.Linear(2, 2), id="plain_module"),
        pytest.param(lambda: 42, id="int"),
        pytest.param(lambda: "actor", id="str"),
        pytest.param(lambda: list(nn.Linear(2, 2).parameters()), id="list_of_parameters"),
    ],
)
def test_install_of_a_non_group_non_engine_is_a_type_error_saying_what_is_accepted(arg: Callable[[], Any]) -> None:
    with pytest.raises(TypeError) as info:
        graphscale.install(arg())
    msg = str(info.value)
    assert msg.startswith("graphscale:") and "graphscale.Group" in msg, msg
    assert torch.autograd.backward is _backward.ORIGINAL_BACKWARD


@pytest.mark.parametrize("arg", [pytest.param(42, id="int"), pytest.param([1.0, 2.0], id="list_of_floats")])
def test_group_of_a_non_module_non_tensors_is_a_type_error(arg: Any) -> None:
    with pytest.raises(TypeError, match=r"^graphscale: Group"):
        graphscale.Group(arg, gas=2)


@pytest.mark.parametrize(
    "gas", [pytest.param(g, id=repr(g)) for g in (0, -2, 2.5, 2.0, True, "2", None)]
)
def test_non_positive_or_non_integer_gas_is_a_value_error(gas: Any) -> None:
    with pytest.raises(ValueError, match=r"^graphscale: .*positive int"):
        graphscale.Group(nn.Linear(2, 2), gas=gas)


@pytest.mark.parametrize("unowned", ["exact", "", "RAW", None])
def test_unknown_unowned_policy_is_a_value_error(unowned: Any) -> None:
    with pytest.raises(ValueError, match=r"^graphscale: .*unowned") as info:
        graphscale.install(graphscale.Group(nn.Linear(2, 2), gas=2), unowned=unowned)
    assert "'any'" in str(info.value) and "'plain'" in str(info.value)
    assert torch.autograd.backward is _backward.ORIGINAL_BACKWARD


def test_install_without_groups_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"^graphscale:"):
        graphscale.install()


def _gas_raises() -> int:
    raise KeyError("no schedule")


@pytest.mark.parametrize(
    "bad, exc",
    [
        pytest.param(_gas_raises, graphscale.GraphscaleError, id="raises"),
        pytest.param(lambda: 0, ValueError, id="returns_0"),
        pytest.param(lambda: 1.5, ValueError, id="returns_float"),
    ],
)
def test_bad_gas_callable_fails_before_any_gradient_is_touched(bad: Callable[[], Any], exc: type) -> None:
    torch.manual_seed(0)
    a, b, x = Net(), Net(), torch.randn(2, 3, dtype=F64)
    params = [*a.parameters(), *b.parameters()]
    for p in params:
        p.grad = torch.full_like(p, 7.0)
    with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=bad, name="critic")):
        with pytest.raises(exc, match=r"^graphscale: the gas callable of group 'critic'"):
            b(a(x)).sum().backward()
    assert all(bool((p.grad == 7.0).all()) for p in params), "a gradient was touched"
    assert not _running.running()


# ---------------------------------------------------------------- exceptions in backward
class Boom(torch.autograd.Function):
    """Identity whose backward raises while ``armed[0]`` is true."""

    armed = [False]

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if Boom.armed[0]:
            raise RuntimeError("boom in backward")
        return grad


class Segment(nn.Module):
    """A group whose forward passes through Boom (inside a checkpoint in one case)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(Boom.apply(x)))


def _tensor_hook_raises(a: nn.Module, b: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = a(x)
    h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom in hook")) if Boom.armed[0] else None)
    return (b(h) * a(x)).sum()


def _custom_function_raises(a: nn.Module, b: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (b(Boom.apply(a(x))) + a(x)).sum()


def _nested_backward_raises(a: nn.Module, b: nn.Module, x: torch.Tensor) -> torch.Tensor:
    seg = Segment().to(F64)
    b.add_module("seg", seg)  # owned by b's group: the group is made after the graph's modules
    return b(checkpoint(seg, a(x), use_reentrant=True)).sum()


FAILURES = [
    pytest.param(_custom_function_raises, id="custom_function_backward_raises"),
    pytest.param(_tensor_hook_raises, id="tensor_hook_raises"),
    pytest.param(_nested_backward_raises, id="nested_backward_raises"),
]


@pytest.mark.parametrize("gas", [(2, 4), (4, 4)], ids=["walked", "fast_path"])
@pytest.mark.parametrize("unowned", ["any", "plain"])
@pytest.mark.parametrize("make_loss", FAILURES)
def test_exception_in_backward_leaves_no_hook_and_the_next_backward_exact(
    make_loss: Callable[..., torch.Tensor], unowned: str, gas: tuple[int, int]
) -> None:
    torch.manual_seed(0)
    a, b, x = Net(), Net(), torch.randn(2, 3, dtype=F64, requires_grad=True)
    loss = make_loss(a, b, x)  # one graph, retained across every backward below
    leaves = {**{f"a.{n}": p for n, p in a.named_parameters()}, **{f"b.{n}": p for n, p in b.named_parameters()},
              "x": x}

    def grads() -> dict[str, torch.Tensor | None]:
        return leaf_grads(leaves, clear=True)

    loss.backward(retain_graph=True)
    plain = grads()
    factor_of = {k: 1.0 / (gas[0] if k.startswith("a.") else gas[1]) for k in leaves if k != "x"}

    with graphscale.install(graphscale.Group(a, gas=gas[0], name="a"), graphscale.Group(b, gas=gas[1], name="b"),
                            unowned=unowned):
        Boom.armed[0] = True
        try:
            with pytest.raises(RuntimeError, match="boom"):
                loss.backward(retain_graph=True)
        finally:
            Boom.armed[0] = False
        assert not _running.running(), "a plan stayed registered after its backward raised"
        grads()
        loss.backward(retain_graph=True)  # the same graph again: a stale hook would scale twice
        bad = grad_mismatches(plain, grads(), factor_of, unowned)
        assert not bad, "governed backward after the exception:\n  " + "\n  ".join(bad)
    loss.backward()  # and once uninstalled, the same graph is plain PyTorch again
    bad = grad_mismatches(plain, grads(), {}, "plain")
    assert not bad, "plain backward after the exception found graphscale's hooks:\n  " + "\n  ".join(bad)
    assert grad_mismatches(plain, plain, factor_of, unowned), "case cannot tell graphscale from no-op"
