"""Backwards that share nodes: the one lock that lets a backward change a
node's hooks while no other backward runs over it, and ``torch.autograd.grad``
wrapped to hold it too.  The native route takes the same lock: see
NOTE [ Hooks on shared nodes ] in _native/hooks.h.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import torch

from .overrides import overridable, own

__all__ = ["hold", "use_native", "governed_grad", "wrap_grad", "ORIGINAL_GRAD", "ORIGINAL_BACKWARD"]

ORIGINAL_GRAD: Callable[..., Any] = torch.autograd.grad
ORIGINAL_BACKWARD: Callable[..., None] = torch.autograd.backward  # as torch defined it (call.py runs it)

# Every top-level backward graphscale sees holds the lock while torch runs it:
# shared where it changes no node another backward may run, exclusive where it
# does (edge multipliers on nodes; the Python binding's pre-hook on a root
# node, running.bound without the native module).  While graphscale is
# installed, torch.autograd.grad is wrapped to hold it shared too
# (governed_grad), so an ungoverned autograd.grad over a graph a governed
# backward is hooking waits for it.  The native module keeps the lock once it
# is loaded; until then this module keeps one of its own with the same rules
# (_Lock), and use_native switches only while no one holds it.


class _Lock:
    """The lock until the native module is loaded: many shared holders or
    one exclusive; an exclusive waiter stops new shared holders."""

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.shared = 0
        self.waiting = 0
        self.exclusive = False

    def acquire(self, exclusive: bool) -> None:
        with self.cond:
            if exclusive:
                self.waiting += 1
                self.cond.wait_for(lambda: not self.exclusive and self.shared == 0)
                self.waiting -= 1
                self.exclusive = True
            else:
                self.cond.wait_for(lambda: not self.exclusive and self.waiting == 0)
                self.shared += 1

    def release(self, exclusive: bool) -> None:
        with self.cond:
            if exclusive:
                self.exclusive = False
            else:
                self.shared -= 1
            self.cond.notify_all()


_lock = _Lock()


class _Hold:
    """Hold this module's lock, or the native one where it took over while
    this one waited."""

    __slots__ = ("exclusive", "inner")

    def __init__(self, exclusive: bool) -> None:
        self.exclusive = exclusive
        self.inner: Any = None

    def __enter__(self) -> None:
        _lock.acquire(self.exclusive)
        make = _make_hold
        if make is not _Hold:  # switched to the native lock before this thread got this one
            _lock.release(self.exclusive)
            inner = make(self.exclusive)
            inner.__enter__()
            self.inner = inner

    def __exit__(self, *exc: object) -> None:
        if self.inner is not None:
            self.inner.__exit__(None, None, None)
        else:
            _lock.release(self.exclusive)


class _Nothing:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NOTHING = _Nothing()
_make_hold: Callable[[bool], Any] = _Hold  # the native module's Hold from use_native on


def hold(exclusive: bool) -> Any:
    """A context manager holding the lock, ``exclusive`` or shared; nothing
    inside a running graph task (its backward holds it)."""
    if torch._C._current_graph_task_id() >= 0:
        return _NOTHING
    return _make_hold(exclusive)


def use_native(module: Any, switch: Callable[[], None]) -> bool:
    """Hand the lock to ``module`` (its ``Hold``) and call ``switch()``, if no
    one holds this module's lock now (else False: nothing changed)."""
    global _make_hold
    with _lock.cond:
        if _lock.shared or _lock.exclusive or _lock.waiting:
            return False
        switch()
        _make_hold = module.Hold
        return True


_grad_before: Callable[..., Any] = ORIGINAL_GRAD  # what torch.autograd.grad was when wrap_grad() ran
_grad_own: Callable[..., Any] = own(ORIGINAL_GRAD, "grad")  # its twin: NOTE [ An override sees torch's own backward ]


@functools.wraps(ORIGINAL_GRAD)
def governed_grad(*args: Any, **kwargs: Any) -> Any:  # noqa: D103 - torch's docstring (wraps)
    with hold(False):
        if overridable(*args[:2], kwargs.get("outputs"), kwargs.get("inputs")):
            return _grad_own(*args, **kwargs)
        return _grad_before(*args, **kwargs)


def wrap_grad(on: bool) -> None:
    """Make ``torch.autograd.grad`` :func:`governed_grad` around whatever it
    is now (``on``: another library's wrapper stays inside), or put that back."""
    global _grad_before, _grad_own
    if on and torch.autograd.grad is not governed_grad:
        _grad_before = torch.autograd.grad
        _grad_own = own(_grad_before, "grad")
        torch.autograd.grad = governed_grad
    elif not on and torch.autograd.grad is governed_grad:
        torch.autograd.grad = _grad_before


def _known_to_torchscript() -> None:
    """TorchScript compiles a call of ``torch.autograd.grad`` to ``aten::grad``
    by the function's identity (torch.jit._builtins): the wrapped one must
    be known there too, or a ``torch.jit.script`` function calling it fails
    to compile while graphscale is installed (PyTorch's own
    ``test_fork_join_in_middle`` did).  A scripted call runs the engine from
    C++, outside this lock."""
    try:
        from torch.jit import _builtins
        if getattr(_builtins, "_builtin_table", None) is None:
            _builtins._builtin_ops.append((governed_grad, "aten::grad"))  # read when the table is made
        else:
            _builtins._register_builtin(governed_grad, "aten::grad")
    except (ImportError, AttributeError):  # a torch that moved it: scripted autograd.grad fails loudly there
        pass


_known_to_torchscript()

