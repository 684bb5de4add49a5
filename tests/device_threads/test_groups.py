"""Plain groups on the device-thread device (tests/helpers/device_threads.py): every
mixed shape of groups, by every backward style, on both routes.  Each
parameter's gradient is exactly its plain-PyTorch gradient (the same
backward, run first without graphscale) times its group's factor (1 for U,
owned by no group), and every parameter's hook and every root's node ran on
the device thread, as autograd runs them on CUDA."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import graphscale

from helpers import device_threads as dt
from helpers.device_threads_world import World


@dataclass(frozen=True)
class Shape:
    id: str
    roots: Callable[[World], list[torch.Tensor]]  # two roots each: the multi-root styles need them
    groups: str = "AB"


SHAPES = [
    Shape("sum_of_two_groups", lambda w: [(w.A(w.x) + w.B(w.x)).square().sum(), w.A(w.y).tanh().sum()]),
    Shape("nested_A_of_B", lambda w: [w.A(torch.tanh(w.B(w.x))).square().sum(), w.B(w.y).square().sum()]),
    Shape("nested_B_of_A", lambda w: [w.B(torch.tanh(w.A(w.x))).square().sum(), w.A(w.y).sum()]),
    Shape("group_plus_unowned", lambda w: [(w.A(w.x) + w.U(w.x)).square().sum(), w.U(w.y).tanh().sum()], "A"),
    Shape("unowned_feeds_two_groups",
          lambda w: [(w.A(torch.tanh(w.U(w.x))) * w.B(w.U(w.y))).sum(), w.B(w.y).sum()]),
    Shape("one_group_installed_fast_path", lambda w: [w.A(w.x).square().sum(), w.A(w.y).tanh().sum()], "A"),
    Shape("one_of_two_groups_reached_fast_path",
          lambda w: [w.A(torch.tanh(w.A(w.x))).square().sum(), w.A(w.y).sum()]),
]


def _loss(roots: list[torch.Tensor]) -> torch.Tensor:
    return sum(roots[1:], roots[0])


def _seeds(roots: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.tensor(2.0 ** (1 - 2 * k), device=r.device) for k, r in enumerate(roots)]  # 2, 1/2: exact


def _retain_then_again(roots: list[torch.Tensor]) -> None:
    loss = _loss(roots)
    loss.backward(retain_graph=True)
    loss.backward()


def _inputs_given(roots: list[torch.Tensor]) -> None:
    params = {id(p): p for r in roots for p in _leaves(r)}
    torch.autograd.backward(roots, inputs=list(params.values()))


def _leaves(root: torch.Tensor) -> list[torch.Tensor]:
    """The parameters ``root`` reaches (AccumulateGrad variables), for ``inputs=``."""
    seen, stack, out = set(), [root.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            out.append(node.variable)
        stack.extend(n for n, _ in node.next_functions)
    return out


STYLES: dict[str, tuple[Callable[[list[torch.Tensor]], None], int]] = {  # style -> (run, governed backwards)
    "loss.backward": (lambda roots: _loss(roots).backward(), 1),
    "autograd.backward(roots)": (lambda roots: torch.autograd.backward(roots), 1),
    "autograd.backward(roots, grad_tensors)": (lambda roots: torch.autograd.backward(roots, _seeds(roots)), 1),
    "retain_graph=True then again": (_retain_then_again, 2),
    "autograd.backward(roots, inputs=params)": (_inputs_given, 1),  # the native route declines: Python governs
    "root.backward(gradient) non-scalar": (
        lambda roots: roots[0].expand(2).backward(torch.tensor([0.5, 2.0], device=roots[0].device)), 1),
}


@pytest.mark.parametrize("route", dt.ROUTES)
@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.id)
def test_every_parameter_gets_plain_times_its_groups_factor_with_hooks_on_the_device_thread(
        shape: Shape, style: str, route: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    dt.use_route(route, request)
    world = World(shape.groups)
    threads = dt.ThreadLog()
    world.watch(threads)
    call, times = STYLES[style]

    def run() -> None:
        roots = shape.roots(world)
        for k, r in enumerate(roots):
            r.grad_fn.register_hook(threads.node_hook(f"root {k} node"))
        call(roots)

    governs = "python" if "inputs=" in style else route  # the native route declines inputs= (observe.routes)
    problems = world.mismatches(run, governs, times)
    assert not problems, problems
    threads.assert_on_device_thread(*world.reached, "root 0 node")


@pytest.mark.parametrize("route", dt.ROUTES)
def test_gas_read_when_each_backward_starts_on_the_device(route: str, monkeypatch: pytest.MonkeyPatch,
                                                          request: pytest.FixtureRequest) -> None:
    """GAS as a callable, changed between backwards (contract 1: read when
    the backward starts): each backward's parameters get that backward's
    factor, and the device thread runs them."""
    dt.use_route(route, request)
    world = World()
    gas = {"A": 2}
    plain = []
    for _ in range(2):
        (world.A(world.x) + world.B(world.x)).square().sum().backward()
        plain.append(world.take_grads())
    threads = dt.ThreadLog()
    world.watch(threads)
    with graphscale.install(graphscale.Group(world.A, gas=lambda: gas["A"]), graphscale.Group(world.B, gas=4)):
        got = []
        for a_gas in (2, 8):
            gas["A"] = a_gas
            (world.A(world.x) + world.B(world.x)).square().sum().backward()
            got.append(world.take_grads())
    for k, a_gas in enumerate((2, 8)):
        want = {n: g * (1 / a_gas if n.startswith("A") else 0.25) for n, g in plain[k].items()
                if g is not None}
        assert not dt.exact_mismatches(got[k], want), (a_gas, dt.exact_mismatches(got[k], want))
    threads.assert_on_device_thread("A.weight", "B.weight")
