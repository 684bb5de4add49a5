"""NOTE [ The native front ] (graphscale/_native/front.h): once the native
route governs, ``torch.autograd.backward`` is the native module's front.  A
nested backward called in any plain style is governed by it, with no Python
entry, and exactly; a call it does not read (``inputs=``) or one an observer
must see (the DEBUG log, a recorder) goes on to the Python entry, exactly
too.  The front's gate is one flag the gate (graphscale/_backward/gate.py)
pushes: each of its inputs is obeyed at once, or (what a top-level backward
reads: the logger, compiled autograd) from the next top-level backward; and
the C++ reads no attribute of graphscale's Python by name."""
from __future__ import annotations

import copy
import logging
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import graphscale
from graphscale import observe
from graphscale._backward import gate as _gate
from graphscale._entry import entry as _entry

from helpers.grads import full_grads
from helpers.routes import native_route_or_skip

ENTRY = _entry.governed_backward.__code__


def _nested_call(style: str, out: torch.Tensor, grad: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    if style == "tuple":
        torch.autograd.backward((out,), (grad,))
    elif style == "list":
        torch.autograd.backward([out], [grad])
    elif style == "tensor":
        torch.autograd.backward(out, grad)
    elif style == "keywords":
        torch.autograd.backward(tensors=out, grad_tensors=grad, retain_graph=False, create_graph=False)
    elif style == "scalar root":
        with torch.enable_grad():  # (a Function's backward runs without grad)
            root = (out * grad).sum()
        torch.autograd.backward(root)
    elif style == "inputs=":
        torch.autograd.backward(out, grad, inputs=inputs)
    else:
        raise AssertionError(style)


class _Styled(torch.autograd.Function):
    """A reentrant checkpoint in miniature whose nested call takes ``style``;
    ``entered`` says whether that call ran graphscale's Python entry."""

    entered: list[bool] = []

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, block: torch.nn.Module, style: str) -> torch.Tensor:
        ctx.save_for_backward(h)
        ctx.block, ctx.style = block, style
        with torch.no_grad():
            return block(h)  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (h,) = ctx.saved_tensors
        hd = h.detach().requires_grad_()
        with torch.enable_grad():
            out = ctx.block(hd)
        seen = []

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and frame.f_code is ENTRY:
                seen.append(True)

        sys.setprofile(profile)
        try:
            _nested_call(ctx.style, out, grad, [hd, *ctx.block.parameters()])
        finally:
            sys.setprofile(None)
        _Styled.entered.append(bool(seen))
        return hd.grad, None, None


def _modules() -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)


def _grads(modules: tuple[torch.nn.Module, ...]) -> list[torch.Tensor]:
    out = []
    for m in modules:
        for p in m.parameters():
            assert p.grad is not None
            out.append(p.grad.clone())
            p.grad = None
    return out


def _run(style: str, modules: tuple[torch.nn.Module, ...], x: torch.Tensor) -> None:
    a, c, b = modules
    b(_Styled.apply(a(x), c, style)).sum().backward()


STYLES = ["tuple", "list", "tensor", "keywords", "scalar root", "inputs="]


@pytest.mark.parametrize("style", STYLES)
def test_a_nested_backward_in_any_style_gets_each_leaf_its_own_factor(style: str) -> None:
    native_route_or_skip()
    modules = _modules()
    x = torch.randn(4, 3)
    _run(style, modules, x)
    plain = _grads(modules)
    factors = [1 / 2] * 2 + [1 / 8] * 2 + [1 / 4] * 2  # a (gas 2), c (gas 8, the nested block), b (gas 4)
    a, c, b = modules
    with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(c, gas=8), graphscale.Group(b, gas=4)):
        a(x).sum().backward()  # the native route governs: the front is adopted
        _grads((a,))
        assert torch.autograd.backward is not _entry.governed_backward, "the native front was not adopted"
        declined = observe.declines().get("inputs=", 0)
        _Styled.entered.clear()
        _run(style, modules, x)
        governed = _grads(modules)
    bad = [i for i, (g, p, f) in enumerate(zip(governed, plain, factors)) if not torch.equal(g, p * f)]
    assert not bad, f"{style}: parameters {bad} differ from plain x factor"
    if style == "inputs=":  # the Python route pins inputs=: the front hands it on, and it is counted
        assert _Styled.entered == [True] and observe.declines().get("inputs=", 0) == declined + 1
    else:
        assert _Styled.entered == [False], f"{style}: the nested call went through the Python entry"


def test_a_debug_log_sees_each_nested_backward_the_front_would_take(caplog: pytest.LogCaptureFixture) -> None:
    native_route_or_skip()
    modules = _modules()
    a, c, b = modules
    x = torch.randn(4, 3)
    with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(c, gas=8), graphscale.Group(b, gas=4)):
        a(x).sum().backward()
        assert torch.autograd.backward is not _entry.governed_backward, "the native front was not adopted"
        with caplog.at_level(logging.DEBUG, logger="graphscale"):
            _Styled.entered.clear()
            _run("tuple", modules, x)
    assert _Styled.entered == [True], "the front governed a nested backward the DEBUG log must see"
    assert any(", nested" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


class _CheckpointedLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.lin, x, use_reentrant=True)  # type: ignore[no-any-return]


@pytest.mark.deepspeed
def test_a_deepspeed_engines_checkpointed_block_is_governed_by_the_front_exactly(make_engine: Any) -> None:
    native_route_or_skip()
    adopt = torch.nn.Linear(2, 2)
    with graphscale.install(graphscale.Group(adopt, gas=2)):
        adopt(torch.randn(1, 2)).sum().backward()  # the native route governs: the front is adopted
    torch.manual_seed(0)
    blocks, head = _CheckpointedLinear(), torch.nn.Linear(4, 1)
    critic, actor = make_engine(copy.deepcopy(blocks), gas=2, stage=1), make_engine(copy.deepcopy(head), gas=4, stage=1)
    x = torch.randn(8, 4, requires_grad=True)
    head(torch.tanh(blocks(x))).mean().backward()
    plain = [p.grad.clone() for m in (blocks, head) for p in m.parameters()]  # type: ignore[union-attr]
    calls = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is ENTRY:
            calls.append(frame.f_code.co_name)

    with graphscale.install(critic, actor):
        assert torch.autograd.backward is not _entry.governed_backward, "the native front was not adopted"
        for engine in (critic, actor):
            engine.set_gradient_accumulation_boundary(True)  # (the gradients readable after one backward)
        loss = actor(torch.tanh(critic(x))).mean()
        sys.setprofile(profile)
        try:
            critic.backward(loss)
        finally:
            sys.setprofile(None)
        got = full_grads(critic) + full_grads(actor)
    factors = [1 / 2] * 2 + [1 / 4] * 2
    bad = [i for i, (g, p, f) in enumerate(zip(got, plain, factors)) if not torch.equal(g, p * f)]
    assert not bad, f"parameters {bad} differ from plain x factor"
    assert len(calls) == 1, f"the Python entry ran {len(calls)} times: the checkpoint's nested call went through it"


@contextmanager
def _route_switched_off() -> Iterator[None]:
    with _gate.route_override(False):
        yield


@contextmanager
def _a_route_recorder() -> Iterator[None]:
    with observe.routes(lambda route, why: None):
        yield


@contextmanager
def _python_only_on_another_thread() -> Iterator[None]:
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with _gate.python_only():
            inside.set()
            leave.wait()

    t = threading.Thread(target=hold)
    t.start()
    inside.wait()
    try:
        yield
    finally:
        leave.set()
        t.join()


@contextmanager
def _compiled_autograd_on() -> Iterator[None]:
    """What the gate reads of compiled autograd, switched on (the backwards
    run eagerly: tests/test_compiled_autograd.py captures for real)."""
    ca = pytest.importorskip("torch._dynamo.compiled_autograd")
    was = ca.in_compiled_autograd_region
    ca.in_compiled_autograd_region = True
    try:
        yield
    finally:
        ca.in_compiled_autograd_region = was


@contextmanager
def _debug_log() -> Iterator[None]:
    log = logging.getLogger("graphscale")
    was = log.level
    log.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        log.setLevel(was)


# (the input switched on, when the front obeys it: "at once", or from "the next top-level backward")
GATE_INPUTS: dict[str, tuple[Callable[[], Any], str]] = {
    "the route switched off": (_route_switched_off, "at once"),
    "a route recorder": (_a_route_recorder, "at once"),
    "python_only on another thread": (_python_only_on_another_thread, "at once"),
    "compiled autograd": (_compiled_autograd_on, "the next top-level backward"),
    "the logger at DEBUG": (_debug_log, "the next top-level backward"),
}


@pytest.mark.parametrize("name", list(GATE_INPUTS))
def test_the_front_obeys_each_gate_input_and_governs_again_once_it_is_undone(name: str) -> None:
    native_route_or_skip()
    switch, when = GATE_INPUTS[name]
    modules = _modules()
    a, c, b = modules
    x = torch.randn(4, 3)
    _run("tuple", modules, x)
    plain = _grads(modules)
    factors = [1 / 2] * 2 + [1 / 8] * 2 + [1 / 4] * 2
    with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(c, gas=8), graphscale.Group(b, gas=4)):
        a(x).sum().backward()  # the native route governs: the front is adopted
        _grads((a,))
        assert torch.autograd.backward is not _entry.governed_backward, "the native front was not adopted"
        assert _gate.front_open(), "the front is closed with nothing switched on"
        _Styled.entered.clear()
        with switch():
            open_before = _gate.front_open()
            _run("tuple", modules, x)
            open_during = _gate.front_open()
        governed = [_grads(modules)]
        _run("tuple", modules, x)  # undone: "at once", or seen by this top-level backward
        governed.append(_grads(modules))
        assert _gate.front_open()
    assert not open_during and open_before is (when != "at once"), (open_before, open_during)
    assert _Styled.entered == [True, False], f"{name}: the front governed the nested call it had to hand on"
    for got in governed:
        bad = [i for i, (g, p, f) in enumerate(zip(got, plain, factors)) if not torch.equal(g, p * f)]
        assert not bad, f"{name}: parameters {bad} differ from plain x factor"


NATIVE = Path(graphscale.__file__).parent / "_native"
# Every by-name read the C++ makes, each of an object that is not graphscale's
# Python: the extension module's own attributes, torch's, a checkpoint's ctx.
READS_ALLOWED = {
    "m.attr(": "the extension module's own attributes: its name, its entries and flag (set)",
    'py::getattr(autograd, "__file__"': "torch.autograd's file (engine.h: is the original torch's own?)",
    'py::getattr(c, "_are_functorch_transforms_active"': "torch._C's function (engine.h)",
    "PyObject_GetAttr(ctx.ptr(), name)": "a torch checkpoint ctx's run_function (the checkpoint hint)",
}
BY_NAME = re.compile(r"\.attr\(|getattr\(|GetAttr\b|GetAttrString|(?<!\w)_cache\b|module_::import\(\"graphscale")


def test_the_native_code_reads_no_attribute_of_graphscales_python_by_name() -> None:
    """What the C++ needs of graphscale's Python is handed over as values
    (configure, top's arguments, the gate's flag): a rename in Python
    breaks a call, never a silent read (style convention 16)."""
    sources = sorted(p for p in NATIVE.rglob("*") if p.suffix in (".h", ".cpp"))
    assert any(p.name == "walker.cpp" for p in sources), sources
    found = []
    for path in sources:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("//", 1)[0]
            if BY_NAME.search(code) and not any(allowed in code for allowed in READS_ALLOWED):
                found.append(f"{path.name}:{number}: {line.strip()}")
    assert not found, "the C++ reads by name:\n" + "\n".join(found)


@pytest.mark.parametrize("line, caught", [
    ('  bool on = route.attr("enabled").cast<bool>();', True),
    ("  PyObject* v = PyObject_GetAttr(F.running.ptr(), state);", True),
    ("  PyObject* c = PyDict_GetItem(log_cache, debug);  // Logger._cache", False),
    ("  auto cache = logger_cache;  PyObject* x = F._cache;", True),
    ('  py::object m = py::module_::import("graphscale._routes.native");', True),
    ('  m.attr("seams") = true;', False),
])
def test_the_by_name_check_catches_reads_and_nothing_else(line: str, caught: bool) -> None:
    code = line.split("//", 1)[0]
    assert bool(BY_NAME.search(code) and not any(a in code for a in READS_ALLOWED)) is caught
