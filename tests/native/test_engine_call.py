"""NOTE [ Straight to the engine ] (graphscale/_native/engine.h): a natively
governed backward in the plain case makes its seeds as torch would and calls
torch's ``_engine_run_backward`` itself, without the Python of
``torch.autograd.backward``; every other call goes through that function,
which judges it as it would without graphscale (its errors, its
``__torch_function__``, a wrapper someone put around it).  Either way each
leaf's gradient is plain PyTorch's times its own factor."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any, Callable

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

import graphscale

from helpers.grads import leaf_grads
from helpers.routes import native_route_or_skip

GAS = (2, 4)


class _Spy:
    """Counts the calls of torch.autograd's ``_engine_run_backward`` (the
    engine, by either path) and ``_make_grads`` (only the Python
    ``torch.autograd.backward`` calls it) while it is on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.engine = self.make_grads = 0
        real_run, real_make = torch.autograd._engine_run_backward, torch.autograd._make_grads

        def run(*args: Any, **kwargs: Any) -> Any:
            self.engine += 1
            return real_run(*args, **kwargs)

        def make(*args: Any, **kwargs: Any) -> Any:
            self.make_grads += 1
            return real_make(*args, **kwargs)

        monkeypatch.setattr(torch.autograd, "_engine_run_backward", run)
        monkeypatch.setattr(torch.autograd, "_make_grads", make)


def _modules() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)


def _run_plain_and_governed(backward: Callable[[torch.nn.Module, torch.nn.Module], None]) -> None:
    """``backward(a, b)`` once in plain PyTorch, once under two groups (GAS 2
    and 4): every leaf's gradient is plain times its group's 1/GAS."""
    a, b = _modules()
    backward(a, b)
    plain = leaf_grads({"a": a, "b": b}, clear=True)
    with graphscale.install(graphscale.Group(a, gas=GAS[0]), graphscale.Group(b, gas=GAS[1])):
        backward(a, b)
    got = leaf_grads({"a": a, "b": b}, clear=True)
    for name, want in plain.items():
        assert want is not None and got[name] is not None, name
        gas = GAS[0] if name.startswith("a.") else GAS[1]
        torch.testing.assert_close(got[name], want / gas, rtol=0, atol=0)


X = torch.randn(3, 4)


def _implicit(a: torch.nn.Module, b: torch.nn.Module) -> None:
    b(a(X)).sum().backward()


def _given_seed(a: torch.nn.Module, b: torch.nn.Module) -> None:
    out = b(a(X))
    out.backward(torch.full_like(out, 0.5))


def _two_roots(a: torch.nn.Module, b: torch.nn.Module) -> None:
    h = a(X)
    torch.autograd.backward([b(h).sum(), h.pow(2).mean()], [None, torch.tensor(3.0)])


def _retained(a: torch.nn.Module, b: torch.nn.Module) -> None:
    loss = b(a(X)).sum()
    loss.backward(retain_graph=True)
    loss.backward()


def _create_graph(a: torch.nn.Module, b: torch.nn.Module) -> None:
    loss = b(a(X)).pow(2).sum()
    loss.backward(create_graph=True)
    for m in (a, b):
        for p in m.parameters():
            assert p.grad is not None and p.grad.requires_grad
            p.grad = p.grad.detach()


def _checkpointed(a: torch.nn.Module, b: torch.nn.Module) -> None:
    x = X.clone().requires_grad_()
    b(checkpoint(a, x, use_reentrant=True)).sum().backward()


STRAIGHT = {  # style -> (the backward, engine runs per call of it: the reentrant checkpoint's nested one too)
    "implicit scalar seed": (_implicit, 1),
    "given seed": (_given_seed, 1),
    "two roots, one seed given": (_two_roots, 1),
    "retain_graph, twice": (_retained, 2),
    "create_graph": (_create_graph, 1),
    "reentrant checkpoint": (_checkpointed, 2),
}


@pytest.mark.parametrize("style", list(STRAIGHT))
def test_a_plain_backward_goes_straight_to_torchs_engine_and_is_exact(
        style: str, monkeypatch: pytest.MonkeyPatch) -> None:
    native_route_or_skip()
    backward, runs = STRAIGHT[style]
    _run_plain_and_governed(backward)  # (adopts the front; the plain arm calls torch's own backward)
    spy = _Spy(monkeypatch)
    _run_plain_and_governed(backward)
    assert spy.engine == 2 * runs  # plain and governed each ran the engine
    assert spy.make_grads == runs  # but only the plain arm ran torch.autograd.backward's Python


def _shape_mismatch() -> tuple[torch.Tensor, Any]:
    a, b = _modules()
    return b(a(X)), torch.ones(2, 3)


def _non_scalar_implicit() -> tuple[torch.Tensor, Any]:
    a, b = _modules()
    return b(a(X)), None


def _complex_seed() -> tuple[torch.Tensor, Any]:
    a, b = _modules()
    return b(a(X)), torch.ones(3, 2, dtype=torch.complex64)


def _not_a_tensor_seed() -> tuple[torch.Tensor, Any]:
    a, b = _modules()
    return b(a(X)).sum(), 2.0


REFUSED = {"shape mismatch": _shape_mismatch, "non-scalar root, no seed": _non_scalar_implicit,
           "complex seed, real root": _complex_seed, "a float as seed": _not_a_tensor_seed}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_call_torch_refuses_raises_torchs_own_error(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    native_route_or_skip()
    root, seed = REFUSED[case]()
    with pytest.raises(Exception) as plain:
        torch.autograd.backward(root, seed)
    a, b = _modules()
    with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4)):
        _implicit(a, b)  # (the front adopted)
        spy = _Spy(monkeypatch)
        root = b(a(X)) if case != "a float as seed" else b(a(X)).sum()
        with pytest.raises(type(plain.value)) as governed:
            torch.autograd.backward(root, seed)
    assert str(governed.value) == str(plain.value)
    # torch.autograd.backward judged it (a float seed: graphscale's reading of the call raised first, with
    # the error torch would have raised)
    assert spy.make_grads == (0 if case == "a float as seed" else 1)
    assert spy.engine == 0


class _Sub(torch.Tensor):
    """A tensor subclass: its root may carry a __torch_function__."""


class _Record(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_a_subclass_root_goes_through_torchs_backward_and_is_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    native_route_or_skip()

    def backward(a: torch.nn.Module, b: torch.nn.Module) -> None:
        b(a(X)).sum().as_subclass(_Sub).backward()

    _run_plain_and_governed(backward)
    spy = _Spy(monkeypatch)
    _run_plain_and_governed(backward)
    assert spy.make_grads == 2  # both arms: torch.autograd.backward judged the subclass


def _backwards(seen: list[Any]) -> list[Any]:
    return [f for f in seen if getattr(f, "__name__", "") in ("backward", "grad")]


@pytest.mark.parametrize("route", ["native", "python"])
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain graph", "reentrant checkpoint"])
def test_a_torch_function_mode_sees_torchs_own_backward_once_and_the_gradients_are_exact(
        checkpointed: bool, route: str, request: pytest.FixtureRequest) -> None:
    """NOTE [ An override sees torch's own backward ]: the mode is handed
    torch's function, as without graphscale, and calling it does not come
    back into graphscale (that hung the process: the hook lock its own outer
    call held), on either route."""
    if route == "native":
        native_route_or_skip()
    else:
        request.getfixturevalue("python_route")
    records = []

    def backward(a: torch.nn.Module, b: torch.nn.Module) -> None:
        x = X.clone().requires_grad_()
        loss = b(checkpoint(a, x, use_reentrant=True) if checkpointed else a(x)).sum()
        with _Record() as rec:
            torch.autograd.backward(loss)
        records.append(_backwards(rec.seen))

    _run_plain_and_governed(backward)
    plain, governed = records
    assert plain, "torch.autograd.backward no longer asks a torch-function mode: rethink this test"
    assert governed == plain


def test_autograd_grad_under_a_torch_function_mode_is_torchs_own() -> None:
    native_route_or_skip()
    a, b = _modules()
    x = X.clone().requires_grad_()
    with _Record() as plain_rec:
        plain = torch.autograd.grad(b(a(x)).sum(), [x, *a.parameters()])
    with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4)):
        with _Record() as governed_rec:
            governed = torch.autograd.grad(b(a(x)).sum(), [x, *a.parameters()])
    for p, g in zip(plain, governed):
        torch.testing.assert_close(g, p, rtol=0, atol=0)  # (autograd.grad is never scaled)
    assert _backwards(governed_rec.seen) == _backwards(plain_rec.seen)
    assert _backwards(plain_rec.seen)


def test_a_wrapped_torch_autograd_backward_is_called_every_backward(tmp_path: Any) -> None:
    """Something wrapped torch.autograd.backward before graphscale came: the
    wrapper runs at every governed backward (no straight call past it)."""
    native_route_or_skip()
    script = tmp_path / "wrapped.py"
    script.write_text(textwrap.dedent("""
        import torch
        calls = []
        real = torch.autograd.backward
        def wrapper(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)
        torch.autograd.backward = wrapper
        import graphscale
        from graphscale import _native
        assert _native.wait() is not None
        torch.manual_seed(0)
        a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
        x = torch.randn(3, 4)
        b(a(x)).sum().backward()
        plain = [p.grad.clone() for p in (*a.parameters(), *b.parameters())]
        for p in (*a.parameters(), *b.parameters()):
            p.grad = None
        with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4)):
            b(a(x)).sum().backward()  # (the self-tests run once: their backwards call the wrapper too)
        for p in (*a.parameters(), *b.parameters()):
            p.grad = None
        calls.clear()
        with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4)):
            for _ in range(3):
                b(a(x)).sum().backward()
        assert len(calls) == 3, calls
        got = [p.grad for p in (*a.parameters(), *b.parameters())]
        factors = [0.5] * 2 + [0.25] * 2
        for g, p, f in zip(got, plain, factors):
            assert torch.equal(g, p * f * 3), (g, p * f * 3)
        print("ok")
    """))
    env = {k: v for k, v in os.environ.items() if k != "GRAPHSCALE_ROUTE"}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr


def test_a_backward_inside_a_functorch_transform_raises_torchs_own_error() -> None:
    native_route_or_skip()

    def error() -> str:
        def f(x: torch.Tensor) -> torch.Tensor:
            y = b(a(x)).sum()
            y.backward()
            return y

        with pytest.raises(RuntimeError) as raised:
            torch.func.grad(f)(X.clone())
        return str(raised.value)

    a, b = _modules()
    plain = error()
    with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4)):
        _implicit(a, b)  # (the front adopted)
        governed = error()
    assert governed == plain and "functorch transform" in plain
