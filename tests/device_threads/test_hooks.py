"""The user's hooks on the device-thread device (tests/helpers/device_threads.py):
what each sees, by docs/hooks.md ("Hooks and what they see"), while autograd
runs it on the device thread as on CUDA, on both routes.

Decided from the contract, which pins leaves only: a parameter's tensor hook
and post-accumulate hook see exactly ``factor x g`` (what the leaf receives;
1 for a parameter no group owns).  Below that, the potentials are the plan's
choice (NOTE [ Potentials ]): a hook on an intermediate tensor, and a Node
hook's grad_outputs, see ``phi x g`` for one number phi, which is the group's
factor where every leaf below needs that one factor, else 1 or one of the
factors in play.  A Node post-hook's grad_inputs: each slot one such number
(graphscale's edge multipliers are post-hooks too; which runs first is not
pinned).  Hooks that scale linearly keep the leaves exact.  The oracle: the
same graph with the same hooks, backpropagated plainly first."""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from helpers import device_threads as dt
from helpers.device_threads_world import World


class Seen:
    """What each hook saw (CPU copies), by name; each hook optionally scales by ``times``."""

    def __init__(self, threads: dt.ThreadLog, times: float = 1.0) -> None:
        self.threads, self.times = threads, times
        self.got: dict[str, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def _keep(self, name: str, t: torch.Tensor | None) -> None:
        if t is not None:
            with self._lock:
                self.got.setdefault(name, []).append(dt.on_cpu(t))

    def tensor_hook(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(g: torch.Tensor) -> torch.Tensor:
            self.threads.mark(name)
            self._keep(name, g)
            return g * self.times
        return hook

    def node_hooks(self, name: str, node: Any) -> None:
        def pre(grad_outputs: tuple[torch.Tensor, ...]) -> None:
            self.threads.mark(f"{name} pre")
            for k, g in enumerate(grad_outputs):
                self._keep(f"{name} pre grad_outputs[{k}]", g)

        def post(grad_inputs: tuple[torch.Tensor, ...], grad_outputs: tuple[torch.Tensor, ...]) -> None:
            self.threads.mark(f"{name} post")
            for k, g in enumerate(grad_inputs):
                self._keep(f"{name} post grad_inputs[{k}]", g)
            for k, g in enumerate(grad_outputs):
                self._keep(f"{name} post grad_outputs[{k}]", g)

        node.register_prehook(pre)
        node.register_hook(post)


def _forward(w: World, seen: Seen) -> torch.Tensor:
    """B(A(x)) + a side term on A only, hooks on intermediates and nodes."""
    a_hidden = torch.tanh(w.A(w.x))  # below: A's leaves only
    b_out = w.B(a_hidden)  # below: B's and A's (mixed)
    loss = b_out.square().sum() + a_hidden.pow(2).mean()
    for name, t in {"a_hidden": a_hidden, "b_out": b_out, "loss": loss}.items():
        t.register_hook(seen.tensor_hook(name))
    seen.node_hooks("A's TanhBackward", a_hidden.grad_fn)
    seen.node_hooks("B's AddmmBackward", b_out.grad_fn)
    return loss


def _ratio(name: str, got: torch.Tensor, plain: torch.Tensor) -> float:
    """The one number c with got == c x plain, bit for bit (asserted)."""
    k = int(plain.abs().argmax())
    c = float(got.flatten()[k] / plain.flatten()[k])
    assert torch.equal(got, plain * c), f"{name}: not one number times the plain gradient (a mixture?)"
    return c


CASES = [pytest.param("AB", {"A": 2, "B": 4}, id="walked-gas2-gas4"),
         pytest.param("AB", {"A": 2, "B": 2}, id="fast-path-gas2-gas2"),
         pytest.param("A", {"A": 2}, id="one-group-beside-unowned-B")]


@pytest.mark.parametrize("route", dt.ROUTES)
@pytest.mark.parametrize("times", [1.0, 4.0], ids=["observing-hooks", "scaling-hooks"])
@pytest.mark.parametrize("groups, gas", CASES)
def test_tensor_and_node_hooks_see_one_factor_times_their_plain_gradient_on_the_device_thread(
        groups: str, gas: dict[str, int], times: float, route: str, monkeypatch: pytest.MonkeyPatch,
        request: pytest.FixtureRequest) -> None:
    dt.use_route(route, request)
    world = World(groups, gas=gas)
    threads = dt.ThreadLog()
    plain_seen, seen = Seen(threads, times), Seen(threads, times)
    order = [plain_seen, seen]  # world.mismatches runs the backward plainly, then governed
    problems = world.mismatches(lambda: _forward(world, order.pop(0)).backward(), route)
    assert not problems, problems  # the leaves exact, linear hooks included
    assert set(seen.got) == set(plain_seen.got) and all(len(v) == 1 for v in seen.got.values()), (
        sorted(seen.got), sorted(plain_seen.got))
    ratio = {n: _ratio(n, seen.got[n][0], plain_seen.got[n][0]) for n in seen.got}
    fa, fb = world.factor("A.weight"), world.factor("B.weight")
    in_play = {1.0, fa, fb}
    assert all(c in in_play for c in ratio.values()), ratio
    only_a = [n for n in ratio if n.startswith(("a_hidden", "A's TanhBackward pre", "A's TanhBackward post grad_o"))]
    assert {ratio[n] for n in only_a} == {fa}, f"below A's output only A's leaves: {fa} expected, {ratio}"
    if fa == fb:  # one factor in play (the fast path): every hook sees it
        assert set(ratio.values()) == {fa}, ratio
    threads.assert_on_device_thread("a_hidden", "b_out", "loss", "A's TanhBackward pre", "B's AddmmBackward post")


@pytest.mark.parametrize("route", dt.ROUTES)
def test_parameter_hooks_and_post_accumulate_hooks_see_exactly_factor_times_g_on_the_device_thread(
        route: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    dt.use_route(route, request)
    world = World("AB")
    threads = dt.ThreadLog()
    leaf: dict[str, list[torch.Tensor]] = {}
    accumulated: dict[str, list[torch.Tensor]] = {}
    def watch(name: str, p: torch.nn.Parameter) -> None:  # (a hook that raises aborts the process here)
        def leaf_hook(g: torch.Tensor) -> None:
            threads.mark(name)
            leaf.setdefault(name, []).append(dt.on_cpu(g))

        def accumulated_hook(q: torch.Tensor) -> None:
            threads.mark(f"{name} accumulated")
            accumulated.setdefault(name, []).append(dt.on_cpu(q.grad))

        p.register_hook(leaf_hook)
        p.register_post_accumulate_grad_hook(accumulated_hook)

    for name, p in world.params().items():
        watch(name, p)

    def run() -> None:
        (world.B(torch.tanh(world.A(world.x))).square().sum() + world.U(world.y).sum()).backward()

    problems = world.mismatches(run, route)
    assert not problems, problems
    for name in world.reached:
        (plain_leaf, got_leaf), (plain_acc, got_acc) = leaf[name], accumulated[name]
        f = world.factor(name)
        assert torch.equal(got_leaf, plain_leaf * f), f"{name}'s tensor hook: {got_leaf} vs {f} x {plain_leaf}"
        assert torch.equal(got_acc, plain_acc * f), f"{name}'s post-accumulate hook: not {f} x plain"
    threads.assert_on_device_thread(*world.reached, *(f"{n} accumulated" for n in world.reached))
