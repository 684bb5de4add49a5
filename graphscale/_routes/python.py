"""The Python route: the governed backward in Python, the reference the
native route must match, and the route of every backward the native one
declines.  C++ twins: ``_native/govern.h`` (the backward), ``_native/hooks.h``
(the hooks).  From the reading on it decides (left alone, the fast path, or a
plan), scales the seeds, hooks each edge multiplier as a Python post-hook,
registers and binds (``running.py``), runs the original and removes every hook
in a ``finally``.  One backward is one value here, a :class:`_Backward`.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from .._backward import decide as _decide
from .._backward import running as _running
from .._backward.backend import Plan
from .._backward.call import BackwardCall
from .._backward.frames import CARRIES_ATTR, Frame
from .._backward.unreached import warn_unreached_groups
from .._core import observation as _observation
from .._core.observation import Laps
from .._core.snapshot import Reading
from .._planner.plan import PyPlan
from . import native as _route
from .hooks import post_hook

__all__ = ["govern_in_python", "govern_nested_in_python", "scaled_seeds", "carries"]

_log = logging.getLogger("graphscale")

# Which backwards come here: see NOTE [ Which route governs a backward ] in _backward/gate.py.


def scaled_seeds(roots: Sequence[Any], grads: Sequence[Any], mults: Sequence[float]) -> list[Any] | None:
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


def carries(roots: Sequence[Any], default: float) -> list[float]:
    """What each root's seed carries already: ``default`` (an fp16
    ``engine.backward``'s loss scale), or a tag left by ``engine.scale``."""
    return [t.__dict__.get(CARRIES_ATTR, default) if isinstance(t, torch.Tensor) else default for t in roots]


class _Backward:
    """One governed backward once its factors are read: the call, the reading,
    what each seed carries already, what completes it if it raises, the
    seconds it took to walk and plan, its lap clock (or None)."""

    __slots__ = ("call", "reading", "carries", "on_failure", "walk_seconds", "laps")

    def __init__(self, call: BackwardCall, reading: Reading, carries: Sequence[float], frame: Frame | None) -> None:
        self.call, self.reading, self.carries = call, reading, carries
        self.on_failure = None if frame is None else frame
        self.laps: Laps | None = None if frame is None else frame.laps
        self.walk_seconds = 0.0

    def lap(self, phase: str) -> None:
        if self.laps:
            self.laps(phase)

    def run(self, seeds: Any = None, potential: float | None = None, plan: Plan | None = None,
            edge_hooks: Sequence[tuple[Any, Any]] = ()) -> None:
        """The original backward with ``seeds``, bound as :func:`running.binding_for`
        says; with ``plan`` registered for nested backwards and ``edge_hooks``
        ((node, multipliers) pairs) on their nodes while it runs, read in its
        own graph task only, taken off in ``finally``.
        (See NOTE [ Multipliers per graph task ] in _native/hooks.h.)"""
        # a fast path's nested backwards are planned with the snapshot's Governor where there is one
        governor = None if potential is None else _route.nested_governor(self.reading.state)
        hooks = True if plan is None else plan.tensor_hooks
        binding = _running.binding_for(self.reading, hooks, potential, self.on_failure, governor)
        if plan is None:
            return self.call.run(binding, seeds, self.laps)
        assert self.call.roots is not None
        bound, key = _running.bound_with_rows(self.call.roots, binding, bool(edge_hooks))
        has = _running.state.task_has
        handles = []
        try:
            for node, mults in edge_hooks:
                handles.append(node.register_hook(post_hook(mults, self.laps, key, has)))
            with _running.running_plan(plan, self.reading):
                self.lap("hooks on")
                self.call.run(binding, seeds, self.laps, bound)
        finally:
            for h in handles:
                h.remove()
            self.lap("hooks off")
        return None


def govern_in_python(call: BackwardCall, reading: Reading, frame: Frame) -> None:
    """The top-level backward ``call``, its factors read (``reading``), in
    the caller's ``frame``."""
    assert call.roots is not None
    b = _Backward(call, reading, carries(call.roots, frame.carries), frame)
    b.lap("prepare")
    t0 = time.perf_counter()
    decision = _decide.decide(call.roots, reading, call.inputs, all(c == 1.0 for c in b.carries))
    b.walk_seconds = time.perf_counter() - t0
    b.lap("walk+plan")
    if decision.kind == _decide.UNTOUCHED:
        return b.run(potential=decision.nested)
    if decision.kind == _decide.FAST_PATH:
        return _run_fast_path(b, decision.factor, decision.nested)
    plan = decision.plan
    assert plan is not None  # PLANNED
    if plan.unowned_params and not plan.custom_nodes:  # (a custom Function may hide a group's leaves)
        warn_unreached_groups(reading.state, plan)
    return _run_plan(b, plan)


def _run_fast_path(b: _Backward, f: float, nested: float | None) -> None:
    """The fast path: every seed times ``f``, nothing planned; ``nested``: the
    potential backwards nested in it are planned from, or None.
    (See NOTE [ Fast path ] in _entry/entry.py.)"""
    call = b.call
    assert call.roots is not None and call.grads is not None
    mults = [f / c for c in b.carries]
    seeds = scaled_seeds(call.roots, call.grads, mults)
    if seeds is None:
        return b.run()  # a seed torch cannot make: torch raises its own error
    b.lap("seeds")
    scaled = sum(1 for m in mults if m != 1.0)
    if _observation.ACTIVE.walks:  # no plan: the probe's time
        _observation.record_walk(0, b.walk_seconds, scaled)
    if _log.isEnabledFor(logging.DEBUG) and not _observation.quiet():
        _log.debug(
            "graphscale: fast path, walked 0 nodes in %.1f us, %d multiplication(s) (root seeds x %g), "
            "factors %s; the time is the probe's, nothing was planned%s", b.walk_seconds * 1e6, scaled, f,
            sorted({f"{g.name}={v:g}" for g, v in b.reading.factors.items()}),
            "; backwards nested in it will be" if nested is not None else "",
        )
    return b.run(seeds, potential=nested)


def govern_nested_in_python(call: BackwardCall, current_node: Any) -> None:
    """A backward called from inside ``current_node``'s backward that the
    native route did not take.  (See NOTE [ Nested backward ] in _entry/entry.py.)"""
    if call.roots is None:
        return call.run(None)
    laps = _observation.laps(nested=True) if _observation.ACTIVE.phases else None
    if laps:
        laps("prepare")
    t0 = time.perf_counter()
    found = _decide.plan_nested(current_node, call.roots, call.inputs)
    walk_seconds = time.perf_counter() - t0
    if laps:
        laps("walk+plan")
    if found is None:  # inside a fast-path or ungoverned backward: untouched, bound as it is
        return call.run(_running.binding_for(_running.task_reading()), laps=laps)
    reading, plan = found
    b = _Backward(call, reading, [plan.base] * len(call.roots), None)
    b.laps, b.walk_seconds = laps, walk_seconds
    return _run_plan(b, plan)


def _run_plan(b: _Backward, plan: Plan) -> None:
    """Scale the seeds, hook the nodes, run the backward with its plan
    registered for nested backwards, unhook in ``finally``.  ``b.carries``:
    what each seed carries already (the plan's seeds assume ``plan.base``)."""
    call = b.call
    assert call.roots is not None and call.grads is not None
    plan_seeds, base = plan.seeds, plan.base  # each read of a native plan's field converts it: once
    mults = [s * base / c for s, c in zip(plan_seeds, b.carries)]
    edge_mults = plan.multiplications - sum(1 for s in plan_seeds if s != 1.0)
    multiplications = edge_mults + sum(1 for m in mults if m != 1.0)
    if _observation.ACTIVE.walks:
        _observation.record_walk(plan.num_nodes, b.walk_seconds, multiplications)
    seeds: Any = None
    if multiplications:
        seeds = scaled_seeds(call.roots, call.grads, mults)
        if seeds is None:
            return b.run()
        b.lap("seeds")
    # else nothing to scale or hook (the usual nested backward, NOTE [ Checkpoint hints ] in hints.py)
    if _log.isEnabledFor(logging.DEBUG) and not _observation.quiet():
        _debug_plan(b, plan, multiplications)
    b.run(seeds, plan=plan, edge_hooks=plan.hooks() if edge_mults else ())


def _debug_plan(b: _Backward, plan: Plan, multiplications: int) -> None:
    _log.debug(  # the walker last: tests/native/test_walker_build.py reads it
        "graphscale: walked %d nodes in %.1f us, %d multiplication(s), factors %s%s, python route, %s walker",
        plan.num_nodes, b.walk_seconds * 1e6, multiplications,
        sorted({f"{g.name}={f:g}" for g, f in b.reading.factors.items()}),
        f", nested at base {plan.base:g}" if plan.base != 1.0 else "",
        "python" if isinstance(plan, PyPlan) else "native",
    )
