"""The native route's self-test: a tiny fixed program through both routes
and plain PyTorch, before the native route governs anything.  It runs whole
governed backwards, so the entry hands it the function that governs one
(``govern``); the entry registers it with the native route
(``gate.register_self_test``)."""
# NOTE [ The native route's self-test ]
# The native route is a second implementation of the governed backward, built
# against whichever torch the user runs.  Before it governs anything (at
# install when the build is cached, else at the first backward after the
# background build lands) it runs a tiny fixed program through both routes
# and plain PyTorch: two groups (GAS 2 and 4) in a mixed graph, the fast
# path, each with a reentrant checkpoint (a nested backward) and an unowned
# Parameter.  Power-of-two factors make the governed gradients exact
# multiples of the plain ones, so both routes must match plain x factor bit
# for bit.  A mismatch, or an exception from the native route, switches the
# native route off for the process with ONE warning naming torch's version
# and the failing piece; every backward then takes the Python route
# (reason "self-test failed").  About 5 ms, once per process (measured),
# plus what the process's first governed backward pays anyway: torch's check
# of a given seed imports sympy on first use (~0.6 s, torch's own).  The
# Python route's half also runs alone at the first install() of every
# process, native walker or not; where it fails, install() is refused
# (_selftest.require_python_route; see NOTE [ Newer releases ] in _core/releases.py).
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from .._backward import call as _call
from .._backward import gate as _gate
from .._backward.call import BackwardCall
from .._backward.gate import compiled_autograd_active
from .._core import observation as _observation
from .._core.errors import GraphscaleError
from .._core.group import Group
from .._core.releases import NEWEST_TESTED
from .._core.snapshot import State

__all__ = ["failure", "require_python_route"]

Governs = Callable[[BackwardCall, State, Any], None]  # _entry/entry.py govern

_lock = threading.Lock()
_python_verdict: list[str | None] = []  # [] until run; then [None] (passed) or [what failed]


class _Reentrant(torch.autograd.Function):
    """A reentrant checkpoint in miniature: the forward keeps no graph, the
    backward recomputes ``block`` and calls ``torch.autograd.backward`` (a
    nested backward, as torch's and DeepSpeed's reentrant checkpoints do).
    Not torch.utils.checkpoint: its first call imports dynamo (2.6 s)."""

    @staticmethod
    def forward(ctx: Any, block: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.block = block
        ctx.save_for_backward(x)
        with torch.no_grad():
            return block(x)  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor | None]:
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            root = (ctx.block(x) * grad).sum()  # linear in the node's gradient, as a checkpoint's seeds are
        torch.autograd.backward(root)
        return None, x.grad


def failure(native: Any, govern: Governs) -> str | None:
    """What failed in the self-test, or None: both routes (the Python route
    alone where ``native`` is None) gave plain x factor bit for bit in every
    case.  ``govern(call, state, native)`` runs one governed backward
    (``_entry/entry.py`` ``govern``)."""
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        torch.manual_seed(0)
        a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
        extra = torch.nn.Parameter(torch.randn(3))  # unowned: plain gradient under "plain_params"
        x = torch.randn(4, 3, requires_grad=True)  # (a reentrant checkpoint's input requires grad)

        def block(h: torch.Tensor) -> torch.Tensor:
            return torch.tanh(a(h))

        def loss() -> torch.Tensor:
            h = _Reentrant.apply(block, x)  # a nested backward
            return b(h * extra).sum() + h.pow(2).mean()

        params = [a.weight, a.bias, b.weight, b.bias, extra]
        _call.ORIGINAL_BACKWARD(loss())  # plain PyTorch (a reentrant checkpoint refuses autograd.grad)
        plain = [p.grad.clone() for p in params]  # type: ignore[union-attr]
        cases = (("a planned backward", 2, 4), ("the fast path", 4, 4))
        for case, gas_a, gas_b in cases:
            state = State.of((Group(a, gas=gas_a, name="a"), Group(b, gas=gas_b, name="b")), "plain_params",
                             "the native route's self-test")
            want = [g / f for g, f in zip(plain, (gas_a, gas_a, gas_b, gas_b, 1))]
            got: dict[str, list[torch.Tensor]] = {}
            for route in ("native", "python") if native is not None else ("python",):
                for p in params:
                    p.grad = None
                call = BackwardCall.of(loss(), None, None, False, None, None)
                try:
                    if route == "native":
                        govern(call, state, native)
                    else:
                        with _gate.python_only():
                            govern(call, state, None)
                except Exception as exc:  # noqa: BLE001 - the warning names it
                    return f"{case}, {route} route: {type(exc).__name__}: {exc}"
                got[route] = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
            for route, grads in got.items():
                for name, g, w in zip(("a.weight", "a.bias", "b.weight", "b.bias", "an unowned Parameter"),
                                      grads, want):
                    if not torch.equal(g, w):
                        return f"{case}, {route} route: {name} got {g.flatten()[:3].tolist()}, " \
                               f"want plain x factor {w.flatten()[:3].tolist()}"
        return None


def require_python_route(govern: Governs) -> None:
    """Raise GraphscaleError if the Python route fails the self-test on this
    torch (run once per process, from install() while torch is patched: its
    nested backward must be governed).  The Python route is the reference
    every backward can fall back to; where it is wrong, nothing is governed."""
    with _lock:
        if not _python_verdict:
            if compiled_autograd_active():
                return  # not now: its backwards would be captured (the next install() runs it)
            with _observation.unrecorded():  # the self-test's backwards are no user's
                try:
                    _python_verdict.append(failure(None, govern))
                except Exception as exc:  # noqa: BLE001 - whatever broke, the message names it
                    _python_verdict.append(f"{type(exc).__name__}: {exc}")
        failed = _python_verdict[0]
    if failed is not None:
        raise GraphscaleError(
            f"graphscale: torch {torch.__version__}: graphscale's Python route failed its self-test ({failed}), so "
            "it cannot govern a backward exactly on this torch (NOTE [ Newer releases ]). Install a torch graphscale "
            f"was tested with (e.g. pip install 'torch=={NEWEST_TESTED['torch']}') or a graphscale that knows this "
            "release, and report it with `python -m graphscale env`. Nothing was installed.")

