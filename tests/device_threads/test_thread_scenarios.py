"""The thread scenarios of tests/stacks/test_cuda.py (tests/hardening/test_thread_governance.py
on CUDA) with plain groups, on the device-thread device
(tests/helpers/device_threads.py): a backward's nodes run on the device thread
while other threads install and remove, and ungoverned backwards
(``torch.autograd.grad``, a backward begun before install) stay plain.

A backward keeps the snapshot of installations it started with
(docs/hooks.md): ``remove()`` from another thread, or from a hook on the
device thread, while a governed backward is paused there leaves that
backward exact (plain x factor), and the next one plain; ``install()`` while
an ungoverned backward is paused there leaves it plain.  The pauses are hooks
on the roots, which run on the device thread; the backward's caller is a
thread of its own, and the test's thread installs and removes.  Every wait
is bounded (a deadlock fails the test, it does not hang it); no hook raises
(an exception in a device node aborts the process: tests/helpers/device_threads.py).

What of tests/stacks/test_cuda.py runs on this device, and what still needs a GPU:

* runs here, with plain groups: its device-thread premise (hooks off the
  caller's thread: test_device.py) and its thread scenarios
  (governed on a device thread: test_groups.py and
  test_nested.py; remove() and install() mid-backward,
  torch.autograd.grad, remove() before a recompute: here);
* needs a real GPU: everything with DeepSpeed engines on CUDA (DeepSpeed's
  CUDA accelerator, the one-rank NCCL group, ZeRO's reduction and
  partitioning on device; DeepSpeed's output hooks finding the task binding
  on a device thread, which plain groups never make), fp16/bf16 kernels and
  loss scaling (tests/deepspeed_engines/test_fp16.py), CUDA's float32 kernels against the CPU
  oracle (CUDA_FP32_TOL), streams (the device has one implicit stream:
  nothing crosses streams here), a backward that raises on a device thread
  (it aborts this device), several GPUs, and ``scripts/gpu_check.sh``'s
  benchmark.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint

from helpers import device_threads as dt
from helpers.device_threads_world import World

WAIT_S = 60  # a bound on a deadlock, not a timing assertion: each step takes milliseconds

GRAPHS: dict[str, Callable[[World], list[torch.Tensor]]] = {
    "nested_B_of_A": lambda w: [w.B(torch.tanh(w.A(w.x))).square().sum()],
    "group_called_twice": lambda w: [(w.A(w.x) + w.A(w.y)).square().sum()],  # (an engine and its own module)
    "two_groups_two_roots": lambda w: [(w.A(w.x) * w.B(w.y)).sum(), w.B(w.y).square().sum()],
    "ckpt_around_two_groups": lambda w: [torch.utils.checkpoint.checkpoint(
        lambda t: w.A(t) * w.B(t), w.U(w.x), use_reentrant=True).sum()],
}
CALLS: dict[str, Callable[[list[torch.Tensor]], None]] = {
    "loss": lambda roots: sum(roots[1:], roots[0]).backward(),
    "roots": lambda roots: torch.autograd.backward(roots),
}


class Pause:
    """Hooks on the roots: the first to run (on the device thread) marks,
    signals ``reached`` and waits for ``resume`` (bounded; it never raises)."""

    def __init__(self, threads: dt.ThreadLog) -> None:
        self.threads, self.reached, self.resume = threads, threading.Event(), threading.Event()
        self.timed_out = False

    def on(self, roots: list[torch.Tensor]) -> None:
        for r in roots:
            r.register_hook(self._hook)

    def _hook(self, grad: torch.Tensor) -> None:
        self.threads.mark("pause")
        if not self.reached.is_set():
            self.reached.set()
            self.timed_out = not self.resume.wait(timeout=WAIT_S)


def _bounded(fn: Callable[[], Any], what: str) -> None:
    """Run ``fn`` on a thread of its own and wait at most WAIT_S (a remove() or
    install() that waited for the paused backward would deadlock)."""
    errors: list[BaseException] = []

    def body() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=body, name=what)
    t.start()
    t.join(timeout=WAIT_S)
    assert not t.is_alive(), f"{what} blocked while a backward was paused on the device thread (a deadlock)"
    assert not errors, f"{what} raised {errors[0]!r}"


def _paused_backward(world: World, graph: str, call: str, pause: Pause, middle: Callable[[], None]) -> None:
    """Start ``graph``'s backward on a caller thread, run ``middle`` on this
    one once the device thread is paused at the roots, then let it finish."""
    roots = GRAPHS[graph](world)
    pause.on(roots)
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            CALLS[call](roots)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=caller, name="backward caller")
    t.start()
    try:
        assert pause.reached.wait(timeout=WAIT_S), "the backward never reached its roots"
        _bounded(middle, "the other thread's call")
    finally:
        pause.resume.set()
        t.join(timeout=WAIT_S)
    assert not t.is_alive(), "the backward did not finish (a deadlock)"
    assert not pause.timed_out and not errors, (pause.timed_out, errors)


def _plain(world: World, graph: str, call: str) -> dict[str, torch.Tensor]:
    CALLS[call](GRAPHS[graph](world))
    return {n: g for n, g in world.take_grads().items() if g is not None}


CASES = [pytest.param(g, c, id=f"{g}-{c}") for g, c in [
    ("nested_B_of_A", "loss"), ("nested_B_of_A", "roots"), ("group_called_twice", "loss"),
    ("two_groups_two_roots", "roots"), ("ckpt_around_two_groups", "loss")]]


@pytest.mark.parametrize("route", dt.ROUTES)
@pytest.mark.parametrize("graph, call", CASES)
def test_remove_from_another_thread_while_the_device_thread_runs_a_governed_backward_keeps_it_exact(
        graph: str, call: str, route: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    dt.use_route(route, request)
    world = World()
    plain = _plain(world, graph, call)
    threads = dt.ThreadLog()
    pause = Pause(threads)
    inst = world.install()
    with dt.RouteLog() as routes:
        try:
            _paused_backward(world, graph, call, pause, inst.remove)
        finally:
            inst.remove()
    routes.assert_took(route)
    got = world.take_grads()
    assert not dt.exact_mismatches(got, {n: g * world.factor(n) for n, g in plain.items()}), \
        dt.exact_mismatches(got, {n: g * world.factor(n) for n, g in plain.items()})
    CALLS[call](GRAPHS[graph](world))  # the next backward: nothing installed, plain
    assert not dt.exact_mismatches(world.take_grads(), plain)
    threads.assert_on_device_thread("pause")


@pytest.mark.parametrize("route", dt.ROUTES)
@pytest.mark.parametrize("graph, call", CASES)
def test_install_from_another_thread_while_the_device_thread_runs_an_ungoverned_backward_leaves_it_plain(
        graph: str, call: str, route: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """A checkpoint's nested backward that starts after the install, inside
    the ungoverned backward, stays plain with it."""
    dt.use_route(route, request)
    world = World()
    plain = _plain(world, graph, call)
    threads = dt.ThreadLog()
    pause = Pause(threads)
    made: list[Any] = []
    try:
        _paused_backward(world, graph, call, pause, lambda: made.append(world.install()))
    finally:
        for inst in made:
            inst.remove()
    assert made, "the install never ran"
    assert not dt.exact_mismatches(world.take_grads(), plain), dt.exact_mismatches(world.take_grads(), plain)
    threads.assert_on_device_thread("pause")


@pytest.mark.parametrize("route", dt.ROUTES)
@pytest.mark.parametrize("graph", [g for g in GRAPHS if "ckpt" not in g])  # (reentrant checkpointing refuses grad())
def test_autograd_grad_while_installed_is_plain_on_the_device_thread(
        graph: str, route: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """torch.autograd.grad is not governed (it accumulates nothing): exactly
    plain PyTorch's, installed or not."""
    dt.use_route(route, request)
    world = World()
    params = list(world.params().values())
    threads = dt.ThreadLog()

    def grads() -> list[torch.Tensor | None]:
        roots = GRAPHS[graph](world)
        roots[0].grad_fn.register_hook(threads.node_hook("root"))
        found = torch.autograd.grad(sum(roots[1:], roots[0]), params, allow_unused=True)
        return [dt.on_cpu(g) for g in found]

    want = grads()
    with world.install():
        got = grads()
    assert all((g is None and w is None) or torch.equal(g, w) for g, w in zip(got, want)), "grad() was scaled"
    threads.assert_on_device_thread("root")


class GradInBackward(torch.autograd.Function):
    """Identity whose backward runs ``torch.autograd.grad`` over a module's
    output (a gradient penalty computed in backward): an ungoverned backward
    nested in a governed one, started on the device thread."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, run: Callable[[], None]) -> torch.Tensor:  # type: ignore[override]
        ctx.run = run
        return t.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        ctx.run()
        return g, None


@pytest.mark.parametrize("route", dt.ROUTES)
def test_autograd_grad_nested_in_a_governed_backward_on_the_device_thread_is_plain(
        route: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    dt.use_route(route, request)
    world = World()
    threads = dt.ThreadLog()
    seen: list[torch.Tensor] = []

    def penalty() -> None:
        threads.mark("nested grad")
        with torch.enable_grad():
            xi = world.y.detach().requires_grad_()
            seen.append(dt.on_cpu(torch.autograd.grad(world.A(xi).square().sum(), xi)[0]))

    def run() -> None:
        world.B(GradInBackward.apply(world.A(world.x), penalty)).square().sum().backward()

    problems = world.mismatches(run, route)  # the outer backward: exact
    assert not problems, problems
    assert len(seen) == 2 and torch.equal(seen[1], seen[0]), "the nested torch.autograd.grad was scaled"
    threads.assert_on_device_thread("nested grad")


@pytest.mark.parametrize("route", dt.ROUTES)
def test_remove_from_a_device_thread_hook_before_a_reentrant_checkpoint_recomputes_keeps_that_backward_exact(
        route: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """tests/hardening/test_thread_governance.py's last test, with the hook (and so the
    remove() and the checkpoint's nested backward) on the device thread."""
    dt.use_route(route, request)
    world = World()
    threads = dt.ThreadLog()

    def loss() -> torch.Tensor:
        return GRAPHS["ckpt_around_two_groups"](world)[0]

    loss().backward()
    plain = {n: g for n, g in world.take_grads().items() if g is not None}
    inst = world.install()
    with dt.RouteLog() as routes:
        try:
            out = loss()
            out.register_hook(lambda g: (threads.mark("remove"), inst.remove(), None)[-1])
            out.backward()
        finally:
            inst.remove()
    routes.assert_took(route, at_least=2)  # the outer backward and the checkpoint's, both governed
    want = {n: g * world.factor(n) for n, g in plain.items()}
    assert not dt.exact_mismatches(world.take_grads(), want)
    threads.assert_on_device_thread("remove")
