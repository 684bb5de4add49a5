"""graphscale.observe: observation points are context managers that nest,
restore what was there, and change no gradient."""
from __future__ import annotations

import threading

import pytest
import torch

import graphscale
from graphscale import observe
from graphscale._core import observation as _observe


def _pair() -> tuple[tuple[graphscale.Group, graphscale.Group], torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    return (graphscale.Group(a, gas=2, name="a"), graphscale.Group(b, gas=4, name="b")), a, b


def _backward(a: torch.nn.Module, b: torch.nn.Module) -> None:
    x = torch.ones(2, 3)
    (a(x) + b(x)).square().sum().backward()


def test_nested_walk_recorders_both_see_each_backward_and_the_outer_one_outlives_the_inner() -> None:
    groups, a, b = _pair()
    outer: list[tuple[int, int]] = []
    inner: list[tuple[int, int]] = []
    with graphscale.install(*groups):
        with observe.walks(lambda n, s, m: outer.append((n, m))):
            with observe.walks(lambda n, s, m: inner.append((n, m))):
                _backward(a, b)
            _backward(a, b)
        _backward(a, b)
    assert len(inner) == 1 and len(outer) == 2
    assert inner[0] == outer[0] and inner[0][1] == 2  # two factors: the seed and one edge
    assert not _observe.walks_recorded()


def test_phase_recorders_see_graphscale_phases_and_are_gone_after_the_block() -> None:
    groups, a, b = _pair()
    phases: list[str] = []
    with graphscale.install(*groups):
        with observe.phases(lambda phase, seconds: phases.append(phase)):
            _backward(a, b)
        assert _observe.laps() is None
        _backward(a, b)
    assert {"prepare", "walk+plan", "seeds", "hooks on", "hooks off"} <= set(phases)


def test_blocks_closed_out_of_order_remove_exactly_their_own_recorder() -> None:
    seen: list[str] = []
    first = observe.walks(lambda n, s, m: seen.append("first"))
    second = observe.walks(lambda n, s, m: seen.append("second"))
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    _observe.record_walk(1, 0.0, 0)
    second.__exit__(None, None, None)
    _observe.record_walk(1, 0.0, 0)
    assert seen == ["second"]


def test_an_observation_block_cannot_be_entered_twice_and_takes_only_callables() -> None:
    block = observe.walks(lambda n, s, m: None)
    with block:
        with pytest.raises(RuntimeError, match="already active"):
            block.__enter__()
    with pytest.raises(TypeError, match="callable"):
        observe.phases(None)  # type: ignore[arg-type]


def test_recording_changes_no_gradient() -> None:
    groups, a, b = _pair()
    with graphscale.install(*groups):
        _backward(a, b)
        plain = [p.grad.clone() for p in (*a.parameters(), *b.parameters())]
        for p in (*a.parameters(), *b.parameters()):
            p.grad = None
        with observe.walks(lambda *args: None), observe.phases(lambda *args: None):
            _backward(a, b)
    assert all(torch.equal(p.grad, q) for p, q in zip((*a.parameters(), *b.parameters()), plain))


def test_a_recorder_opened_on_another_thread_sees_backwards_on_this_one() -> None:
    groups, a, b = _pair()
    seen: list[int] = []
    opened, done = threading.Event(), threading.Event()

    def other() -> None:
        with observe.walks(lambda n, s, m: seen.append(n)):
            opened.set()
            done.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert opened.wait(10)
    with graphscale.install(*groups):
        _backward(a, b)
    done.set()
    t.join(10)
    assert len(seen) == 1 and not _observe.walks_recorded()


def test_walker_says_which_walker_plans() -> None:
    said = observe.walker(timeout=0)
    assert said == "native" or said.startswith("python (")
