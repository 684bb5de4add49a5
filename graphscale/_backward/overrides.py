"""torch's own ``backward`` (:data:`ORIGINAL_BACKWARD`), and the twin
graphscale hands a call that a ``__torch_function__`` override may see: a
twin whose override hands the override torch's own function, not
graphscale's.  Imports nothing of graphscale.
"""
from __future__ import annotations

import types
from typing import Any, Callable, Iterable

import torch

__all__ = ["ORIGINAL_BACKWARD", "own", "overridable"]

ORIGINAL_BACKWARD: Callable[..., None] = torch.autograd.backward  # as torch defined it (call.py runs it)

# NOTE [ An override sees torch's own backward ]
# torch.autograd.backward and torch.autograd.grad ask __torch_function__
# before they run (a TorchFunctionMode that is on, or a root or input of a
# tensor subclass): handle_torch_function(backward, ...) hands the override
# the function torch.autograd's global ``backward`` names, which is
# graphscale's entry while graphscale is installed.  The override calls it
# (the usual one records, then calls func(*args)), so the call came back into
# graphscale inside the call graphscale was handing to torch and was governed
# a second time (the process hung on the hook lock graphscale held then, a
# TorchFunctionMode around torch.autograd.backward(loss) with two groups,
# tests/native/test_engine_call.py).  So such a call is handed to a twin of
# torch's function (own): the same code, whose global ``backward`` is torch's
# own function and whose other globals are
# torch.autograd's, read live at each lookup.  The override sees, and calls,
# what it would without graphscale, and that call runs as torch's.  Only a
# call an override may see takes the twin (overridable): a twin's global
# reads are Python calls.  A function that is not torch's own (another
# library's wrapper) is its own twin: it is called as it is.


class _TorchAutogradNames(dict):  # type: ignore[type-arg]
    """A twin's globals: the names it holds (torch's own function), else
    torch.autograd's namespace as it is now (then the builtins)."""

    def __missing__(self, name: str) -> Any:
        return vars(torch.autograd)[name]  # (KeyError: Python then looks in the builtins)


def own(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """The twin of torch.autograd's ``fn`` (``name``: "backward" or "grad")
    that hands an override ``fn`` itself; ``fn`` itself where it is not
    torch's own function."""
    code = getattr(fn, "__code__", None)
    if not isinstance(fn, types.FunctionType) or code is None or code.co_name != name or \
            fn.__globals__ is not vars(torch.autograd):
        return fn
    twin = types.FunctionType(code, _TorchAutogradNames({name: fn}), fn.__name__, fn.__defaults__, fn.__closure__)
    twin.__kwdefaults__ = fn.__kwdefaults__
    twin.__qualname__, twin.__module__, twin.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    return twin


def _subclassed(arg: Any) -> bool:
    if isinstance(arg, torch.Tensor):
        return type(arg) is not torch.Tensor and type(arg) is not torch.nn.Parameter
    return False


def overridable(*args: Any) -> bool:
    """Whether torch's backward or grad, called with ``args`` (each a
    tensor, or a tuple or list of them, or anything else) now, asks an
    override: a torch-function mode is on, or one of the tensors is of a
    subclass (nn.Parameter's override is torch's default)."""
    if torch._C._is_torch_function_mode_enabled():
        return True
    for arg in args:
        items: Iterable[Any] = arg if isinstance(arg, (tuple, list)) else (arg,)
        if any(_subclassed(t) for t in items):
            return True
    return False
