"""One backward, one path (NOTE [ Follow one backward ] in
graphscale/_entry/entry.py): the graphscale modules a governed backward
enters, in order, from the patched ``torch.autograd.backward`` to torch's own.

A module is *entered* when one of its functions is called from another
module's (a call within a module is not an entry), traced with
``sys.setprofile`` from the first call of the patched entry until torch's
original backward starts; a visit is the module and the function it was
entered by, the names the NOTE lists.  Several calls in a row from one
caller into one module (a constructor, then ``__enter__``; one pin per
group) are one visit;
a module *re-entered* is one the path enters again after it went on into
another module.  The native route (every backward by default) enters at most
seven modules (the sixth, the gate, decides: NOTE [ Which route governs a
backward ] in graphscale/_backward/gate.py) and re-enters none; the Python route, the reference, enters the
planner's modules too and re-enters none more than once.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import pytest
import torch

import graphscale
from graphscale._backward import call as _call
from graphscale._entry import entry as _entry

from helpers.routes import native_route_or_skip

# torch reached: its torch.autograd.backward, or (NOTE [ Straight to the engine ] in
# graphscale/_native/engine.h) its engine call, which a plain governed backward calls itself
TORCH = (_call.ORIGINAL_BACKWARD.__code__, torch.autograd.graph._engine_run_backward.__code__)
ENTRY = _entry.governed_backward.__code__
NATIVE_TOP_LEVEL = [("_entry/entry.py", "governed_backward"), ("_backward/call.py", "BackwardCall.of"),
                    ("_backward/frames.py", "Frame.__init__"), ("_core/snapshot.py", "State.read"),
                    ("_core/group.py", "read_pins"), ("_routes/native.py", "govern_natively"),
                    ("_backward/gate.py", "reason")]
# NOTE [ The native front ] (graphscale/_native/front.h): once the native route governs, a nested
# backward goes from torch.autograd.backward (the native front) to torch's own without one Python frame
# of graphscale's; where the front hands a nested call on, the Python entry takes it through these:
PYTHON_ENTRY_NESTED = [("_entry/entry.py", "governed_backward"), ("_backward/call.py", "BackwardCall.of"),
                       ("_routes/native.py", "govern_nested_natively"), ("_backward/gate.py", "reason")]


def _module_of(filename: str) -> str | None:
    return filename.split("/graphscale/", 1)[1] if "/graphscale/" in filename else None


def path_of(run: Callable[[], None], from_start: bool = False) -> list[tuple[str, str]]:
    """The modules one backward started by ``run()`` visits, in order, each
    with the function it was entered by (traced from the Python entry, or
    with ``from_start`` from ``run()`` itself: the native front is no Python
    frame)."""
    visits: list[tuple[str, str]] = []
    state = {"on": from_start, "done": False}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if state["done"] or event != "call":
            return
        code = frame.f_code
        if code is ENTRY:
            state["on"] = True
        if not state["on"]:
            return
        if code in TORCH:
            state["done"] = True
            return
        module = _module_of(code.co_filename)
        caller = frame.f_back
        if module is None or (caller is not None and _module_of(caller.f_code.co_filename) == module):
            return
        if not visits or visits[-1][0] != module:
            visits.append((module, code.co_qualname))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    assert state["done"], "torch's backward never ran (neither torch.autograd.backward nor its engine call)"
    return visits


def reentered(visits: list[tuple[str, str]]) -> dict[str, int]:
    """Per module, how often the path entered it again after leaving it."""
    modules = [m for m, _ in visits]
    return {m: modules.count(m) - 1 for m in dict.fromkeys(modules) if modules.count(m) > 1}


class _Recompute(torch.autograd.Function):
    """A reentrant checkpoint in miniature whose backward traces its nested backward."""

    traced: list[tuple[str, str]] = []

    @staticmethod
    def forward(ctx: Any, block: Any, h: torch.Tensor) -> torch.Tensor:
        ctx.block = block
        ctx.save_for_backward(h)
        with torch.no_grad():
            return block(h)  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor | None]:
        (h,) = ctx.saved_tensors
        h = h.detach().requires_grad_()
        with torch.enable_grad():
            root = (ctx.block(h) * grad).sum()
        _Recompute.traced[:] = path_of(lambda: torch.autograd.backward(root), from_start=True)
        return None, h.grad


def _groups() -> tuple[tuple[graphscale.Group, ...], torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    a, b, c = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1), torch.nn.Linear(3, 3)
    return (graphscale.Group(a, gas=2), graphscale.Group(b, gas=4), graphscale.Group(c, gas=8)), a, b, c


@pytest.fixture
def native_route() -> None:
    native_route_or_skip()


@pytest.mark.parametrize("shape", ["mixed", "fast path", "nested engine boundary"])
def test_a_top_level_backward_on_the_native_route_enters_seven_modules_each_once(native_route: None,
                                                                               shape: str) -> None:
    groups, a, b, c = _groups()
    x = torch.randn(4, 3)

    def loss() -> torch.Tensor:
        if shape == "fast path":
            return a(x).sum()
        if shape == "nested engine boundary":
            return b(c(a(x))).sum()
        return b(a(x)).sum() + a(x).sum()

    with graphscale.install(*groups):
        loss().backward()  # the first backward of a snapshot may make its tables
        visits = path_of(lambda: loss().backward())
    assert visits == NATIVE_TOP_LEVEL, visits


def test_a_nested_backward_on_the_native_route_runs_no_python_of_graphscale(native_route: None) -> None:
    groups, a, b, c = _groups()
    x = torch.randn(4, 3, requires_grad=True)
    with graphscale.install(*groups):
        a(x).sum().backward()  # the native route governs: the front is adopted
        assert torch.autograd.backward is not _entry.governed_backward, "the native front was not adopted"
        b(_Recompute.apply(c, a(x))).sum().backward()
    assert _Recompute.traced == [], _Recompute.traced


def test_a_nested_call_the_front_hands_on_enters_the_python_entry_then_the_native_route(
        native_route: None) -> None:
    groups, a, b, c = _groups()
    x = torch.randn(4, 3, requires_grad=True)
    with graphscale.install(*groups):
        a(x).sum().backward()
        with graphscale.observe.routes(lambda route, why: None):  # a route recorder: the front hands it on
            b(_Recompute.apply(c, a(x))).sum().backward()
    assert _Recompute.traced == PYTHON_ENTRY_NESTED, _Recompute.traced


def test_the_python_route_re_enters_no_module_more_than_once(python_route: None) -> None:
    groups, a, b, c = _groups()
    x = torch.randn(4, 3, requires_grad=True)
    with graphscale.install(*groups):
        top = path_of(lambda: (b(a(x)).sum() + a(x).sum()).backward())
        b(_Recompute.apply(c, a(x))).sum().backward()
    nested = _Recompute.traced
    for visits in (top, nested):
        assert all(n <= 1 for n in reentered(visits).values()), visits
    assert top[:len(NATIVE_TOP_LEVEL)] == NATIVE_TOP_LEVEL, top  # the same reading, then route.py hands back
    assert ("_routes/python.py", "govern_in_python") in top, top
    assert ("_routes/python.py", "govern_nested_in_python") in nested, nested
