"""Concurrency: backwards on several threads, and install/remove while another
thread is inside a backward.

Each backward reads one immutable State snapshot when it starts, and the
DeepSpeed adapter's output hooks obey the snapshot of the backward running on
their thread (NOTE [ Which snapshot an output hook obeys ]), so a backward is
exact for the installations it started with, whatever other threads do.
Every result is checked against plain PyTorch (``torch.autograd.grad``, which
graphscale leaves alone) on the same graph."""
from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import pytest
import torch

import graphscale
from graphscale._entry import entry as _backward

from helpers.engines import require_deepspeed
from helpers.grads import full_grads, max_rel_err


@contextmanager
def busy_switching() -> Iterator[None]:
    """Make the interpreter switch threads very often, so Python hooks interleave."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _nets(seed: int) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    actor = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    critic = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    with torch.no_grad():
        for p in [*actor.parameters(), *critic.parameters()]:
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return actor, critic, torch.randn(6, 4, generator=g)


def _loss(actor: torch.nn.Module, critic: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = actor(x)  # nested and a side term: a walked plan with two factors
    return critic(h).sum() + h.pow(2).mean()


def _one_step(actor: torch.nn.Module, critic: torch.nn.Module, x: torch.Tensor, fa: float, fc: float) -> str | None:
    """Backward once; None if every leaf got factor x plain, else a description."""
    params = [*actor.parameters(), *critic.parameters()]
    loss = _loss(actor, critic, x)
    plain = torch.autograd.grad(loss, params, retain_graph=True)
    for p in params:
        p.grad = None
    loss.backward()
    n = len(list(actor.parameters()))
    want = [g * fa for g in plain[:n]] + [g * fc for g in plain[n:]]
    err = max_rel_err([p.grad for p in params], want)
    return None if err < 1e-6 else f"relative error {err:.3g} (factors {fa:g}, {fc:g})"


def _run_threads(workers: list[Callable[[], None]]) -> list[str]:
    """Start all workers together; return every failure (exceptions included)."""
    failures: list[str] = []
    start = threading.Barrier(len(workers))

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                start.wait()
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported below, with the thread's name
                failures.append(f"{threading.current_thread().name}: {type(exc).__name__}: {exc}")

        return run

    threads = [threading.Thread(target=wrap(w), name=f"worker-{i}") for i, w in enumerate(workers)]
    with busy_switching():
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    return failures


STEPS = 150


def test_two_threads_training_their_own_groups_concurrently_are_both_exact() -> None:
    nets = [_nets(0), _nets(1)]
    gases = [(2, 4), (3, 5)]
    groups = [graphscale.Group(m, gas=g) for (a, c, _), gs in zip(nets, gases) for m, g in ((a, gs[0]), (c, gs[1]))]
    bad: list[str] = []

    def worker(i: int) -> Callable[[], None]:
        def run() -> None:
            a, c, x = nets[i]
            for step in range(STEPS):
                msg = _one_step(a, c, x, 1 / gases[i][0], 1 / gases[i][1])
                if msg:
                    bad.append(f"thread {i} step {step}: {msg}")

        return run

    with graphscale.install(*groups):
        failures = _run_threads([worker(0), worker(1)])
    assert not failures and not bad, failures + bad[:10]


def test_threads_that_install_and_remove_their_own_groups_each_step_stay_exact() -> None:
    """Every step of every thread installs, backpropagates and removes, while
    the other thread is somewhere in the same cycle: installs and removes land
    in the middle of the other's backwards."""
    nets = [_nets(2), _nets(3)]
    gases = [(2, 4), (3, 5)]
    bad: list[str] = []

    def worker(i: int) -> Callable[[], None]:
        def run() -> None:
            a, c, x = nets[i]
            for step in range(STEPS):
                # raw: the other thread's groups never lend these leaves a factor
                with graphscale.install(graphscale.Group(a, gas=gases[i][0]), graphscale.Group(c, gas=gases[i][1]),
                                        unowned="plain"):
                    msg = _one_step(a, c, x, 1 / gases[i][0], 1 / gases[i][1])
                if msg:
                    bad.append(f"thread {i} step {step} (installed): {msg}")

        return run

    failures = _run_threads([worker(0), worker(1)])
    assert not failures and not bad, failures + bad[:10]


def test_an_unrelated_thread_installing_and_removing_never_changes_another_threads_backwards() -> None:
    a, c, x = _nets(4)
    other_a, other_c, other_x = _nets(5)
    stop = threading.Event()
    bad: list[str] = []

    def trainer() -> None:
        try:
            for step in range(STEPS):
                msg = _one_step(a, c, x, 1 / 2, 1 / 4)
                if msg:
                    bad.append(f"trainer step {step}: {msg}")
        finally:
            stop.set()

    def churner() -> None:
        cycles = 0
        while not stop.is_set() or cycles == 0:
            with graphscale.install(graphscale.Group(other_a, gas=3), graphscale.Group(other_c, gas=7)):
                msg = _one_step(other_a, other_c, other_x, 1 / 3, 1 / 7)
                if msg:
                    bad.append(f"churner cycle {cycles}: {msg}")
            cycles += 1

    with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(c, gas=4), unowned="plain"):
        failures = _run_threads([trainer, churner])
    assert not failures and not bad, failures + bad[:10]


@contextmanager
def paused_in_backward(t: torch.Tensor) -> Iterator[tuple[threading.Event, threading.Event]]:
    """A hook on ``t`` that signals ``reached`` and waits for ``resume``."""
    reached, resume = threading.Event(), threading.Event()

    def pause(grad: torch.Tensor) -> torch.Tensor:
        reached.set()
        assert resume.wait(timeout=60), "the test never resumed the backward"
        return grad

    handle = t.register_hook(pause)
    try:
        yield reached, resume
    finally:
        handle.remove()


def test_removing_from_another_thread_in_the_middle_of_a_backward_keeps_it_exact() -> None:
    a, c, x = _nets(6)
    params = [*a.parameters(), *c.parameters()]
    plain = torch.autograd.grad(_loss(a, c, x), params)
    n = len(list(a.parameters()))
    inst = graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(c, gas=4))
    h = a(x)
    loss = c(h).sum() + h.pow(2).mean()
    errors: list[BaseException] = []
    with paused_in_backward(h) as (reached, resume):
        worker = threading.Thread(target=lambda: _capture(errors, loss.backward))
        worker.start()
        assert reached.wait(timeout=60), "the backward never reached the hook"
        inst.remove()  # the critic's leaves are done, the actor's are not
        # NOTE [ The patch outlives remove() until the backward ends ]: a backward nested in the running
        # one must still be governed, so torch's original comes back when that backward ends
        assert _backward.patched()  # the Python entry, or the native front
        resume.set()
        worker.join(timeout=60)
    assert torch.autograd.backward is _backward.ORIGINAL_BACKWARD
    assert not errors, errors
    want = [g / 2 for g in plain[:n]] + [g / 4 for g in plain[n:]]
    assert max_rel_err([p.grad for p in params], want) < 1e-6
    for p in params:  # and the next backward is plain PyTorch
        p.grad = None
    _loss(a, c, x).backward()
    assert max_rel_err([p.grad for p in params], list(plain)) < 1e-6


def test_installing_from_another_thread_in_the_middle_of_a_governed_backward_changes_only_the_next() -> None:
    a, c, x = _nets(7)
    extra = torch.nn.Linear(4, 4)
    params = [*a.parameters(), *c.parameters()]
    plain = torch.autograd.grad(_loss(a, c, x), params)
    n = len(list(a.parameters()))
    first = graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(c, gas=4))
    second = None
    try:
        h = a(x)
        loss = c(h).sum() + h.pow(2).mean()
        errors: list[BaseException] = []
        with paused_in_backward(h) as (reached, resume):
            worker = threading.Thread(target=lambda: _capture(errors, loss.backward))
            worker.start()
            assert reached.wait(timeout=60)
            # a contradicting installation: the actor in a group of another gas
            with pytest.raises(graphscale.ConfigurationError, match="graphscale: parameter"):
                graphscale.install(graphscale.Group(a, gas=8, name="actor-again"))
            second = graphscale.install(graphscale.Group(extra, gas=8))  # a valid one
            resume.set()
            worker.join(timeout=60)
        assert not errors, errors
        want = [g / 2 for g in plain[:n]] + [g / 4 for g in plain[n:]]
        assert max_rel_err([p.grad for p in params], want) < 1e-6
    finally:
        first.remove()
        if second is not None:
            second.remove()


def _capture(errors: list[BaseException], fn: Callable[[], Any]) -> None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - asserted empty by the caller
        errors.append(exc)


@require_deepspeed
@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [1, 3], ids=["zero1", "zero3"])
@pytest.mark.parametrize("direct", [False, True], ids=["engine.backward", "loss.backward"])
def test_removing_an_engine_from_another_thread_mid_backward_keeps_that_backward_exact(
    make_engine: Any, stage: int, direct: bool
) -> None:
    """The engine's output hook fires after the removal: it must not divide a
    backward whose plan already scales the engine's leaves."""
    torch.manual_seed(8)
    engine = make_engine(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()), gas=4, stage=stage)
    critic = torch.nn.Linear(4, 1)
    x = torch.randn(3, 4)
    plain = torch.autograd.grad(critic(engine.module(x)).sum(), list(engine.module.parameters()))
    inst = graphscale.install(engine, graphscale.Group(critic, gas=2))
    out = engine(x)
    above = out * 1.0  # the pause sits above the engine's output hook
    loss = critic(above).sum()
    errors: list[BaseException] = []
    with paused_in_backward(above) as (reached, resume):
        run = loss.backward if direct else (lambda: engine.backward(loss))
        worker = threading.Thread(target=lambda: _capture(errors, run))
        worker.start()
        assert reached.wait(timeout=60)
        inst.remove()
        resume.set()
        worker.join(timeout=120)
    assert not errors, errors
    assert max_rel_err(full_grads(engine), [g / 4 for g in plain]) < 1e-6
    engine.zero_grad()
