"""What a backward does, asked of the walker: :func:`decide` (left alone, the
fast path, or a plan; :func:`graphscale.explain` asks it too), :func:`probe`
(walk only until the answer is known), :func:`walker` (the one place that
chooses the planner: native once the extension is loaded, else the Python
reference, ``_planner/plan.py``), :func:`plan_backward` (a request's plan;
both walkers give the same) and :func:`plan_nested` (a backward nested in a
running one, found through the one running state).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from .. import _native
from .._core.group import Group
from .._core.snapshot import Reading, State
from .._planner.probe import PROBE_FAST, PROBE_HIDDEN, PROBE_NO_OWNED
from .._planner.request import PlanRequest
from . import native_backend as _native_backend
from . import running as _running
from .backend import Backend, Plan
from .hints import checkpoint_hint

__all__ = [
    "walker", "probe", "fast_path_factor", "Decision", "decide", "UNTOUCHED", "FAST_PATH", "PLANNED",
    "plan_backward", "top_level_request", "plan_nested",
]


def walker() -> Backend:
    """The backend that probes and plans: the native one as soon as the
    extension is loaded ($GRAPHSCALE_WALKER), else the Python one.
    (See NOTE [ One interface, two backends ] in _backward/backend.py.)"""
    module = _native.load()
    if module is None:
        return _running.PYTHON
    current = _running.state
    return current if current.module is module else _native_backend.of(module)


def probe(roots: Sequence[Any], state: State) -> tuple[int, bool]:
    """Before the fast path: (verdict, hidden).  PROBE_NO_OWNED when a backward of ``roots`` reaches no owned
    leaf the walk can see, PROBE_FAST when multiplying its seeds by the one
    factor in play is exact under the state's policy, PROBE_PLAN when
    unowned leaves the policy protects are reached too; ``hidden``: a
    custom-Function node was seen, which may run a nested backward over
    leaves no walk can see (reentrant checkpointing).  Walks only until the
    answer is known (under "any" it may stop before a custom-Function node:
    that policy needs no nested plan inside a fast-path backward).
    (See NOTE [ Fast path ] in _entry/entry.py.)"""
    code = walker().probe(roots, state)
    return code & 3, bool(code & PROBE_HIDDEN)


def fast_path_factor(factors: Mapping[Group, float]) -> float | None:
    """The one factor in play (1.0 when none), or None when several are and
    the backward must plan."""
    distinct = set(factors.values())
    if len(distinct) > 1:
        return None
    return distinct.pop() if distinct else 1.0


UNTOUCHED, FAST_PATH, PLANNED = "untouched", "fast path", "planned"


class Decision(NamedTuple):
    """What a top-level backward does: ``kind`` (UNTOUCHED, FAST_PATH or
    PLANNED), the one ``factor`` of the fast path, the ``plan`` when planned,
    and ``nested``: the potential from which a backward nested in an
    unplanned one must be planned (custom-Function nodes may hide leaves), or
    None."""

    kind: str
    factor: float = 1.0
    plan: Plan | None = None
    nested: float | None = None


def decide(roots: Sequence[Any], reading: Reading, inputs: tuple[Any, ...],
           seeds_carry_nothing: bool = True) -> Decision:
    """What a top-level backward of ``roots`` does, under ``reading``;
    ``seeds_carry_nothing``: no seed carries a factor already (an fp16
    engine's loss scale)."""
    state = reading.state
    f = fast_path_factor(reading.factors)
    if f is not None:
        if f == 1.0 and seeds_carry_nothing:
            return Decision(UNTOUCHED)  # every factor 1: nothing to do, nested or not
        verdict, hidden = probe(roots, state)
        if verdict == PROBE_NO_OWNED and not hidden:
            return Decision(UNTOUCHED)  # not graphscale's backward: NOTE [ Unowned leaves ]
        if verdict == PROBE_NO_OWNED and seeds_carry_nothing:
            return Decision(UNTOUCHED, nested=1.0)  # owned leaves may hide behind a custom Function
        if verdict == PROBE_FAST:
            return Decision(FAST_PATH, f, nested=f if hidden and state.policy != "any" else None)
    plan = plan_backward(roots, top_level_request(reading, inputs))
    if not plan.owned_leaves and not plan.custom_nodes:
        return Decision(UNTOUCHED)
    return Decision(PLANNED, plan=plan)


# ---------------------------------------------------------------- the walker
def plan_backward(roots: Sequence[Any], request: PlanRequest) -> Plan:
    """The plan of ``request``, made by the walker (:func:`walker`: native
    when the extension is loaded, $GRAPHSCALE_WALKER, see
    graphscale/_native), else by the Python reference.  Both give the same
    plan; the native one keeps no Python object per node.  Past 64 distinct
    factors the Python planner, which has no limit."""
    try:
        return walker().plan(roots, request)
    except OverflowError:
        return _running.PYTHON.plan(roots, request)


def top_level_request(reading: Reading, inputs: tuple[Any, ...]) -> PlanRequest:
    """The request of a top-level governed backward."""
    return PlanRequest(reading, inputs=inputs, hint=checkpoint_hint(reading))


def _nested_request(reading: Reading, p: float, inputs: tuple[Any, ...]) -> PlanRequest:
    """The request of a backward nested where everything carries ``p``."""
    return PlanRequest(reading, base=p, carrier=p, inputs=inputs, outer_phi=_running.state.enclosing_phi,
                       hint=checkpoint_hint(reading))


def plan_nested(current: Any, roots: Sequence[Any], inputs: tuple[Any, ...]) -> tuple[Reading, Any] | None:
    """Plan a backward called from inside ``current``'s backward: find the
    running plan that walked ``current`` and plan ``roots`` from its
    potential, with its reading; or, where none did, inside a backward that
    left the nested ones to be planned (its task is bound with the potential
    everything in it carries), from that potential.  Returns (the reading,
    the plan), or None inside a backward that left them alone (ungoverned, or
    a fast path under "any").  (See NOTE [ Nested backward ] in _entry/entry.py.)"""
    if not inputs:
        found = _running.state.nested_plan(current, tuple(roots))  # natively: the one lookup, and the plan
        if found is None or found.__class__ is tuple:
            return found  # type: ignore[return-value]
        # NESTED_IN_PYTHON: the Python state, or a plan the Python route made past 64 factors walked it
    enclosing = _running.find_enclosing(current)
    if enclosing is None:
        return _plan_in_task(roots, inputs)
    reading, p = enclosing
    return reading, plan_backward(roots, _nested_request(reading, p, inputs))


def _plan_in_task(roots: Sequence[Any], inputs: tuple[Any, ...]) -> tuple[Reading, Any] | None:
    """A nested backward inside a backward with no plan that bound its task
    with the potential everything in it carries."""
    binding = _running.task_binding()
    if binding is None or binding.potential is None:
        return None
    return binding.reading, plan_backward(roots, _nested_request(binding.reading, binding.potential, inputs))
