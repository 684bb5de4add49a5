"""A ``torch.autograd.backward`` call read once (:class:`BackwardCall`): its
roots, its seeds, its ``inputs=``; and the original backward run for it,
bound to what governs it.  C++ twin: ``_native/engine.h`` (the run).

torch takes any iterable; a generator can be read once, so everything is
read here, and torch is handed the same items graphscale planned for.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.autograd.graph import GradientEdge

from .._core.observation import Laps
from . import running as _running
from .overrides import ORIGINAL_BACKWARD, overridable, own

__all__ = ["ORIGINAL_BACKWARD", "BackwardCall", "materialize", "normalize"]

_task_id = torch._C._current_graph_task_id
_OWN_BACKWARD = own(ORIGINAL_BACKWARD, "backward")  # NOTE [ An override sees torch's own backward ]


def materialize(arg: Any) -> Any:
    """``arg`` as a tuple when it is an iterable other than a tensor, tuple or list."""
    if arg is None or isinstance(arg, (torch.Tensor, tuple, list)):  # GradientEdge is a tuple
        return arg
    try:
        return tuple(arg)
    except TypeError:  # not iterable: torch's own error message is the right one
        return arg


def normalize(tensors: Any, grad_tensors: Any) -> tuple[tuple[Any, ...], list[Any]] | None:
    """(roots, seeds) of a backward call, or None when torch would reject it."""
    if isinstance(tensors, (torch.Tensor, GradientEdge)):
        roots: tuple[Any, ...] = (tensors,)
    else:
        roots = tuple(tensors)
    if grad_tensors is None:
        grads: list[Any] = [None] * len(roots)
    elif isinstance(grad_tensors, torch.Tensor):
        grads = [grad_tensors]
    else:
        grads = list(grad_tensors)
    if len(grads) != len(roots):
        return None
    for t in roots:
        if isinstance(t, GradientEdge):
            continue
        if not isinstance(t, torch.Tensor) or (t.grad_fn is None and not t.requires_grad):
            return None
    return roots, grads


class BackwardCall(NamedTuple):
    """One call of ``torch.autograd.backward``, as given and as planned for.

    ``roots``/``grads``: one entry per root (a grad None where torch makes the
    seed), or None when the call is malformed (torch's own error is the right
    one) or uses the deprecated ``grad_variables``.  ``inputs``: the
    ``inputs=`` tensors as a tuple.  Iterables are read once here, so torch is
    handed the same items graphscale planned for.
    """

    tensors: Any
    grad_tensors: Any
    retain_graph: bool | None
    create_graph: bool
    grad_variables: Any
    inputs_arg: Any
    roots: tuple[Any, ...] | None
    grads: tuple[Any, ...] | None
    inputs: tuple[Any, ...]

    @classmethod
    def of(cls, tensors: Any, grad_tensors: Any, retain_graph: bool | None, create_graph: bool,
           grad_variables: Any, inputs: Any) -> BackwardCall:
        """The call of ``torch.autograd.backward(tensors, grad_tensors, ...)``
        (its own six parameters), read once."""
        if inputs is None and grad_variables is None and isinstance(tensors, torch.Tensor) and (
                grad_tensors is None or isinstance(grad_tensors, torch.Tensor)):  # the usual call, read directly
            usable = tensors.grad_fn is not None or tensors.requires_grad
            # cls(...) without its Python-level __new__ (a NamedTuple's is; this is what it does)
            return tuple.__new__(cls, (tensors, grad_tensors, retain_graph, create_graph, None, None,
                                       (tensors,) if usable else None, (grad_tensors,) if usable else None, ()))
        tensors, grad_tensors = materialize(tensors), materialize(grad_tensors)
        inputs = materialize(inputs)
        norm = None if grad_variables is not None else normalize(tensors, grad_tensors)
        in_tuple = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
        return cls(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs,
                   None if norm is None else norm[0], None if norm is None else tuple(norm[1]), in_tuple)

    def run(self, binding: Any, seeds: Any = None, laps: Laps | None = None, bound: Any = None) -> None:
        """The original backward, with ``seeds`` in place of the given seeds if
        not None, its graph task bound to ``binding`` if not None
        (:func:`_running.binding_for`), or by ``bound`` if given
        (:func:`_running.bound_with_rows`); a backward nested in a task that
        reads multiplier rows is bound to read them too.
        (See NOTE [ Which snapshot an output hook obeys ] in _backward/running.py,
        NOTE [ Multipliers per graph task ] in _native/hooks.h.)"""
        if self.roots is not None and bound is None and binding is None and _task_id() >= 0:
            bound, _ = _running.bound_with_rows(self.roots, None, False)  # (None: nothing to inherit)
        if (binding is None and bound is None) or self.roots is None:
            if laps:
                laps("bind")  # nothing to bind: the lap closes what came before, as below
            original = _OWN_BACKWARD if overridable(self.tensors, self.inputs_arg) else ORIGINAL_BACKWARD
            original(
                self.tensors, self.grad_tensors if seeds is None else seeds, self.retain_graph, self.create_graph,
                grad_variables=self.grad_variables, inputs=self.inputs_arg,
            )
            if laps:
                laps.skip()  # torch's time (and a nested backward's own laps) is not this backward's
            return
        grads = self.grads if seeds is None else seeds
        assert grads is not None  # normalized with the roots
        with _running.bound(self.roots, binding) if bound is None else bound as roots:
            if laps:
                laps("bind")
            original = _OWN_BACKWARD if overridable(roots, self.inputs_arg) else ORIGINAL_BACKWARD
            original(roots, list(grads), self.retain_graph, self.create_graph, inputs=self.inputs_arg)
            if laps:
                laps.skip()
