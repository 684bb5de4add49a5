"""The governed backward: what runs in place of ``torch.autograd.backward``.

``Tensor.backward`` and DeepSpeed's ``engine.backward`` both end in
``torch.autograd.backward``, so while graphscale is installed that function is
replaced by :func:`governed_backward`, which reads the factors, makes a plan
(or takes the fast path), applies it with node hooks and seed scaling, runs
the original, and removes every hook in a ``finally``.

# NOTE [ Fast path ]
# When every installed group has the same factor f and unowned leaves may take
# any single factor (unowned="any"), every leaf is right with potential f
# everywhere: multiply the seeds by f and walk nothing.  f == 1 touches nothing
# at all.
#
# NOTE [ Nested backward ]
# Reentrant activation checkpointing (torch's and DeepSpeed's) calls
# torch.autograd.backward from inside a node's backward, on a graph recomputed
# there, which the outer walk could not see.  torch._C._current_autograd_node()
# names that node; the outer plan gave it a potential p, so the gradients it
# received carry p.  The inner backward is planned with base p (its seeds are
# assumed to be, or be linear in, the gradients the node received, as
# checkpointing does), owned leaves pinned to their group's factor as read by
# the *outer* backward, and unowned leaves that are not nn.Parameters (the
# detached inputs through which checkpointing returns gradients to the outer
# graph) pinned to p, so the node hands back gradients at p as the outer plan
# expects.  The outer plan is found through a process-wide registry keyed by
# node (_state.find_enclosing), not through thread-local state: CUDA backward
# runs nodes on autograd worker threads.  Inside a fast-path backward
# everything already carries the one factor, so a nested backward found in no
# walked plan runs untouched.
#
# NOTE [ Unowned leaves in nested backward ]
# An unowned leaf may be reached by the outer backward and by nested ones
# (an unowned layer used inside and outside a checkpointed segment, or in two
# segments under different groups).  Left free, each plan would give it the
# potential of its own surroundings and its gradient would mix factors, which
# even unowned="any" forbids.  So a nested plan pins each unowned leaf to the
# potential a running (enclosing) plan already gave its AccumulateGrad node;
# an unowned Parameter that none has seen is pinned to 1, the same value in
# every nested backward; an unseen non-Parameter leaf is a carrier (above).
# Known limit: a requires-grad non-Parameter tensor that a checkpointed
# function closes over, and that the outer graph never reaches, looks like a
# carrier and gets the carrier's potential.
#
# NOTE [ Nested backward through the enclosing graph ]
# A custom Function's backward may call torch.autograd.backward on tensors of
# the enclosing graph itself (it kept one from forward).  Those nodes already
# carry the enclosing plan's hooks, which stay registered while it runs.  The
# nested plan pins each such node to the potential the enclosing plan gave it
# and places no multiplication on edges leaving it: the enclosing hooks
# already apply exactly those ratios, and a second hook would scale twice.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.autograd.graph import GradientEdge

from . import _planning, _state
from ._group import Group
from ._state import State

__all__ = ["governed_backward", "ORIGINAL_BACKWARD", "BackwardCall", "fast_path_factor"]

_log = logging.getLogger("graphscale")

ORIGINAL_BACKWARD: Callable[..., None] = torch.autograd.backward


# ---------------------------------------------------------------- the call
def _materialize(arg: Any) -> Any:
    """``arg`` as a tuple when it is an iterable other than a tensor, tuple or list."""
    if arg is None or isinstance(arg, (torch.Tensor, tuple, list)):  # GradientEdge is a tuple
        return arg
    try:
        return tuple(arg)
    except TypeError:  # not iterable: torch's own error message is the right one
        return arg


@dataclass(frozen=True)
class BackwardCall:
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
        tensors, grad_tensors, inputs = _materialize(tensors), _materialize(grad_tensors), _materialize(inputs)
        norm = None if grad_variables is not None else normalize(tensors, grad_tensors)
        in_tuple = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
        return cls(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs,
                   None if norm is None else norm[0], None if norm is None else tuple(norm[1]), in_tuple)

    def run(self, seeds: Any = None) -> None:
        """The original backward, with ``seeds`` in place of the given seeds if not None."""
        ORIGINAL_BACKWARD(
            self.tensors, self.grad_tensors if seeds is None else seeds, self.retain_graph, self.create_graph,
            grad_variables=self.grad_variables, inputs=self.inputs_arg,
        )


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


def _scaled_seeds(roots: Sequence[Any], grads: Sequence[Any], mults: Sequence[float]) -> list[Any] | None:
    """Seeds multiplied by ``mults``; None when a seed cannot be made (let torch raise)."""
    out = list(grads)
    for r, m in enumerate(mults):
        if m == 1.0:
            continue
        g = out[r]
        if g is None:
            t = roots[r]
            if isinstance(t, GradientEdge):  # implicit seed of a scalar edge, as torch makes it
                md = t.node._input_metadata[t.output_nr]
                if md.is_nested_tensor or torch.Size(md.shape).numel() != 1:
                    return None
                g = torch.ones(md.shape, dtype=md.dtype, device=md.device)
            elif not isinstance(t, torch.Tensor) or t.numel() != 1:
                return None
            else:  # torch's implicit seed, already multiplied: one op instead of two
                out[r] = torch.full_like(t, m, memory_format=torch.preserve_format)
                continue
        out[r] = g * m
    return out


def _post_hook(mults: tuple[tuple[int, float], ...]) -> Callable[..., Any]:
    def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
        out = list(grad_inputs)
        for k, m in mults:
            g = out[k]
            if g is not None:
                out[k] = g * m
        return tuple(out)

    return hook


def fast_path_factor(state: State, factors: Mapping[Group, float]) -> float | None:
    """The one factor a top-level backward multiplies every root seed by without
    walking (1.0: it touches nothing), or None when it must walk and plan.
    See NOTE [ Fast path ]; :func:`graphscale.explain` asks the same question."""
    distinct = set(factors.values())
    if state.raw:
        return 1.0 if distinct <= {1.0} else None
    if len(distinct) <= 1:
        return distinct.pop() if distinct else 1.0
    return None


# ---------------------------------------------------------------- the backward
def governed_backward(
    tensors: Any,
    grad_tensors: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    grad_variables: Any = None,
    inputs: Any = None,
) -> None:
    """``torch.autograd.backward`` with every owned leaf scaled by its group's factor."""
    observer = _state.observer
    if observer is not None:
        return observer(_governed_backward, tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)
    return _governed_backward(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)


def _governed_backward(tensors: Any, grad_tensors: Any, retain_graph: bool | None, create_graph: bool,
                       grad_variables: Any, inputs: Any) -> None:
    call = BackwardCall.of(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)
    state = _state.current()
    current = torch._C._current_autograd_node()
    if current is not None:  # NOTE [ Nested backward ]: obeys the backward it runs inside
        return _run_nested(call, current)
    if state is None:
        return call.run()
    # NOTE [ Which snapshot an output hook obeys ]
    with _state.governing(state):
        if call.roots is None or not _state.gas_scaling_enabled():
            return call.run()
        factors = state.read_factors()  # may raise: nothing touched yet
        f = fast_path_factor(state, factors)
        if f is None:
            t0 = time.perf_counter()
            plan = _planning.plan_backward(call.roots, _planning.top_level_request(state, factors, call.inputs))
            return _run_plan(call, plan, _state.Running(plan, factors, state), t0)
        if f == 1.0:
            return call.run()
        return _run_fast_path(call, f, factors)


def _run_fast_path(call: BackwardCall, f: float, factors: Mapping[Group, float]) -> None:
    """NOTE [ Fast path ]: every seed times ``f``, nothing walked."""
    assert call.roots is not None and call.grads is not None
    seeds = _scaled_seeds(call.roots, call.grads, [f] * len(call.roots))
    if seeds is None:
        return call.run()
    recorder = _state.walk_recorder
    if recorder is not None:
        recorder(0, 0.0, len(call.roots))
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug(
            "graphscale: fast path, walked 0 nodes in 0 us, %d multiplication(s) (root seeds x %g), factors %s",
            len(call.roots), f, sorted({f"{g.name}={v:g}" for g, v in factors.items()}),
        )
    return call.run(seeds)


def _run_nested(call: BackwardCall, current: Any) -> None:
    """A backward called from inside ``current``'s backward: NOTE [ Nested backward ]."""
    if call.roots is None:
        return call.run()
    t0 = time.perf_counter()
    found = _planning.plan_nested(current, call.roots, call.inputs)
    if found is None:
        return call.run()
    enclosing, plan = found
    return _run_plan(call, plan, _state.Running(plan, enclosing.factors, enclosing.state), t0)


def _run_plan(call: BackwardCall, plan: Any, entry: _state.Running, t0: float) -> None:
    """Scale the seeds, hook the nodes, run the backward with ``entry``
    registered for nested backwards, unhook in ``finally``."""
    assert call.roots is not None and call.grads is not None
    recorder = _state.walk_recorder
    if recorder is not None:
        recorder(plan.num_nodes, time.perf_counter() - t0, plan.multiplications)
    seeds: Any = None
    if plan.multiplications:
        seeds = _scaled_seeds(call.roots, call.grads, plan.seeds)
        if seeds is None:
            return call.run()
    # else nothing to scale or hook (the usual nested backward, NOTE [ Checkpoint hints ])
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug(
            "graphscale: walked %d nodes in %.1f us, %d multiplication(s), factors %s%s",
            plan.num_nodes, (time.perf_counter() - t0) * 1e6, plan.multiplications,
            sorted({f"{g.name}={f:g}" for g, f in entry.factors.items()}),
            f", nested at base {plan.base:g}" if plan.base != 1.0 else "",
        )
    handles = []
    try:
        if plan.multiplications:
            for node, mults in plan.hooks():
                handles.append(node.register_hook(_post_hook(mults)))
        with _state.running_plan(entry):
            call.run(seeds)
    finally:
        for h in handles:
            h.remove()
