"""No backward waits for another (issue 53): graphscale holds no lock around
any backward, governed or not, and a governed backward's edge multipliers are
read by its own graph task only (NOTE [ Multipliers per graph task ] in
graphscale/_native/hooks.h).  Before, every top-level backward took a
process-wide lock, exclusive where the plan hooked nodes: a backward started
from a governed backward's hook waited for it, and it for that one.

Each test makes two backwards meet inside one another or behind a barrier and
counts who got there (bounded waits, never a timing); gradients are checked
against plain PyTorch times each group's factor, on both routes.
"""
from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import graphscale
from graphscale._backward import gate as _gate

from helpers import seams
from helpers.paths import WORKERS
from helpers.ranks import child_env
from helpers.workers.unrelated_backward import WAIT_S

ROUTES = ["native", "python"]


@pytest.fixture(params=ROUTES)
def route(request: pytest.FixtureRequest) -> Iterator[str]:
    with _gate.route_override(request.param == "native"):
        yield request.param


@pytest.mark.parametrize("kind", ["backward", "grad"])
@pytest.mark.parametrize("child_route", ROUTES)
def test_an_unrelated_backward_run_from_a_governed_hook_finishes_while_the_governed_one_waits(
        child_route: str, kind: str) -> None:
    """The probe of the issue: a governed, planned backward's tensor hook
    runs an unrelated model's backward (or autograd.grad) on another thread
    and waits for it.  With the lock the unrelated one waited for the
    governed one, which waited WAIT_S for it (forever without a bound)."""
    child = str(WORKERS / "unrelated_backward.py")
    done = subprocess.run([sys.executable, child, child_route, kind], env=child_env(OMP_NUM_THREADS="1"),
                          cwd=WORKERS, capture_output=True, text=True, timeout=10 * WAIT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "unrelated finished: True" in done.stdout, done.stdout
    assert "governed exact: True" in done.stdout, done.stdout


class _Pair:
    """Two Linears in one loss, groups GAS 2 and 4: a planned backward that
    puts multipliers on nodes (the product's node feeds both groups)."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        for p in (*self.a.parameters(), *self.b.parameters()):
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g))
        self.x = torch.randn(3, 4, generator=g)
        self.groups = (graphscale.Group(self.a, gas=2), graphscale.Group(self.b, gas=4))

    def loss(self, hook: Any = None) -> torch.Tensor:
        h = self.a(self.x)
        if hook is not None:
            h.register_hook(hook)
        return (h * self.b(self.x)).sum()

    def plain(self) -> list[torch.Tensor]:
        """Plain PyTorch's gradients of a.weight and b.weight."""
        return list(torch.autograd.grad(self.loss(), (self.a.weight, self.b.weight)))

    def grads(self) -> list[torch.Tensor | None]:
        return [self.a.weight.grad, self.b.weight.grad]


def _exact(got: list[torch.Tensor | None], plain: list[torch.Tensor], times: float = 1.0) -> bool:
    return all(g is not None and torch.allclose(g, times * w / f, rtol=1e-6, atol=1e-7)
               for g, w, f in zip(got, plain, (2, 4)))


def _meet_in_hooks(backwards: list[Any]) -> tuple[int, list[BaseException]]:
    """Run each of ``backwards`` (called with a hook) on a thread of its own;
    every hook waits at one barrier for the others' hooks.  Returns how many
    passed the barrier together, and what the threads raised."""
    barrier = threading.Barrier(len(backwards), timeout=WAIT_S)
    met: list[int] = []
    errors: list[BaseException] = []

    def hook(g: torch.Tensor) -> torch.Tensor:
        barrier.wait()
        met.append(1)
        return g

    def run(fn: Any) -> None:
        try:
            fn(hook)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in backwards]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10 * WAIT_S)
    return len(met), errors


def test_planned_backwards_on_two_threads_over_their_own_graphs_run_together(route: str) -> None:
    """Two threads, each a planned backward over its own graph: both are
    inside their backwards at once (each hook waits for the other's)."""
    pairs = [_Pair(0), _Pair(1)]
    plain = [p.plain() for p in pairs]
    rounds = 3
    with graphscale.install(*pairs[0].groups, *pairs[1].groups):
        for _ in range(rounds):
            met, errors = _meet_in_hooks([lambda hook, p=p: p.loss(hook).backward() for p in pairs])
            assert not errors, errors
            assert met == 2, f"only {met} of 2 backwards reached their hook together"
    for p, want in zip(pairs, plain):
        assert _exact(p.grads(), want, times=rounds)


def test_a_governed_and_an_ungoverned_backward_run_together(route: str) -> None:
    """A planned backward and an unrelated model's plain backward on another
    thread (no group reaches it) are inside their backwards at once."""
    pair, unrelated = _Pair(0), nn.Linear(4, 1)
    plain = pair.plain()
    ux = torch.randn(2, 4)
    want_u = torch.autograd.grad(unrelated(ux).sum(), unrelated.weight)[0]

    def unrelated_backward(hook: Any) -> None:
        out = unrelated(ux)
        out.register_hook(hook)
        out.sum().backward()

    with graphscale.install(*pair.groups):
        met, errors = _meet_in_hooks([lambda hook: pair.loss(hook).backward(), unrelated_backward])
    assert not errors, errors
    assert met == 2
    assert _exact(pair.grads(), plain)
    assert torch.equal(unrelated.weight.grad, want_u)


def test_two_governed_backwards_over_one_graph_at_once_each_get_their_own_factors(route: str) -> None:
    """Two threads run governed backwards over one retained graph and meet
    inside them: each task reads its own rows of the shared nodes' hooks,
    none twice (the .grad fields add both: twice one backward's)."""
    pair = _Pair(0)
    plain = pair.plain()
    with graphscale.install(*pair.groups):
        relay: list[Any] = []  # the hook _meet_in_hooks hands each thread (one tensor hook serves both)
        loss = pair.loss(lambda g: relay[0](g))

        def one(hook: Any) -> None:
            relay[:] = [hook]
            loss.backward(retain_graph=True)

        met, errors = _meet_in_hooks([one, one])
    assert not errors, errors
    assert met == 2
    assert _exact(pair.grads(), plain, times=2)


def test_an_ungoverned_grad_over_a_node_a_governed_backward_is_running_gets_plain_gradients(route: str) -> None:
    """While a governed backward runs over a retained graph (its multipliers
    on the product's node), torch.autograd.grad over the same graph on
    another thread gets plain PyTorch's gradients: another task's rows are
    not its own."""
    pair = _Pair(0)
    plain = pair.plain()
    inside, grads_done = threading.Event(), threading.Event()
    got: list[Any] = []
    done_inside: list[bool] = []

    governed_thread = threading.get_ident()  # (on the CPU a task's hooks run on the thread that called it)

    def hook(g: torch.Tensor) -> torch.Tensor:
        if threading.get_ident() == governed_thread:
            inside.set()
            done_inside.append(grads_done.wait(WAIT_S))
        return g

    with graphscale.install(*pair.groups):
        loss = pair.loss(hook)

        def ungoverned() -> None:
            inside.wait(WAIT_S)
            got.extend(torch.autograd.grad(loss, (pair.a.weight, pair.b.weight), retain_graph=True))
            grads_done.set()

        other = threading.Thread(target=ungoverned)
        other.start()
        loss.backward(retain_graph=True)
        other.join(10 * WAIT_S)
    assert done_inside == [True], "torch.autograd.grad did not finish while the governed backward ran"
    assert all(torch.allclose(g, w, rtol=1e-6, atol=1e-7) for g, w in zip(got, plain)), "it took another's factors"
    assert _exact(pair.grads(), plain)


def test_a_node_hooked_by_a_governed_backward_multiplies_nothing_after_it(route: str) -> None:
    """A node keeps its multiplier hook (NOTE [ Multipliers per graph task ]):
    after the governed backward it scales nothing, neither a
    torch.autograd.grad while installed nor a backward after remove()."""
    pair = _Pair(0)
    plain = pair.plain()
    with graphscale.install(*pair.groups):
        loss = pair.loss()
        loss.backward(retain_graph=True)
        assert _exact(pair.grads(), plain)
        again = torch.autograd.grad(loss, (pair.a.weight, pair.b.weight), retain_graph=True)
        assert all(torch.allclose(g, w, rtol=1e-6, atol=1e-7) for g, w in zip(again, plain))
    pair.a.weight.grad = pair.b.weight.grad = None
    loss.backward()
    assert all(torch.allclose(g, w, rtol=1e-6, atol=1e-7) for g, w in zip(pair.grads(), plain))  # type: ignore[arg-type]


def test_only_a_nodes_first_governed_backward_changes_its_hook_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exposure that remains (NOTE [ Multipliers per graph task ]): a
    node's hook list grows once, when a plan first hooks it; every later
    backward over it adds and takes out a row of that hook only, and none is
    left behind (the native route's count, from its test build)."""
    native = seams.swap_in(monkeypatch)
    pair = _Pair(0)
    plain = pair.plain()
    with _gate.route_override(True), graphscale.install(*pair.groups):
        loss = pair.loss()
        before = native.hook_tally()  # (rows made, rows alive, bindings made, alive, calls, hooks added)
        loss.backward(retain_graph=True)
        first = native.hook_tally()
        for _ in range(4):
            loss.backward(retain_graph=True)
        after = native.hook_tally()
    hooked = first[5] - before[5]
    assert hooked >= 1, "the plan hooked no node: the test would pass without the rows"
    assert after[5] == first[5], "a later backward added a hook to a node again"
    assert after[0] - first[0] == 4 * (first[0] - before[0]) >= 4 * hooked  # a row per backward per node
    assert after[1] == before[1], "a row was left behind"
    assert _exact(pair.grads(), plain, times=5)
