"""One interface, two backends: what the governed backward asks of the code
that walks, plans and keeps the running state (:class:`Backend`), and the
plan both backends give (:class:`Plan`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from .._core.snapshot import Reading, State
from .._planner.request import PlanRequest

__all__ = ["Plan", "Backend", "NESTED_IN_PYTHON"]

# NOTE [ One interface, two backends ]
# The Python backend (PythonBackend in _backward/python_backend.py, planning
# with _planner/plan.py) is the reference; the native one
# (_backward/native_backend.py, over the extension built from
# graphscale/_native/) repeats it in C++, decision for decision
# (docs/native-walker.md maps each Python function to its C++ twin).  Nothing
# on the backward path asks which one it holds: it calls the backend's
# methods.  Two pointers name the backend in use, each moving once, from
# Python to native, never back:
#   * the walker (walker() in _backward/decide.py): the native backend as
#     soon as the extension is loaded, which may be in the middle of a
#     backward; a plan is plain data, so a nested plan may come from the
#     other walker than its enclosing one.
#     (See NOTE [ No backward waits for a compiler ] in _native/__init__.py.)
#   * the running state (state in _backward/running.py): the native backend
#     once no backward runs on the Python one, since a running backward's
#     registrations and bindings must be undone where they were made.
#     (See NOTE [ One running state, both routes ] in _native/registry.h.)
# The native route's one-call backward (_routes/native.py, the native top)
# and the Python route (_routes/python.py) are the two implementations of
# "run a governed backward"; both read and write the running state through
# this interface.

NESTED_IN_PYTHON = "python"  # Backend.nested_plan: look the enclosing plan up in Python (decide.plan_nested)


class Plan(Protocol):
    """A walked plan, as applying it needs it: ``seeds`` (each root's
    potential, relative to ``base``), the nodes walked, the multiplications it
    places (seeds included), ``base`` (the potential everything starts from:
    1 at top level, the enclosing potential when nested), the owned leaves
    and custom-Function nodes it reached, how many unowned Parameters the
    policy looked at, and whether a tensor hook was seen (False: no output
    hook can fire, nothing to bind).  (See NOTE [ Potentials ] in _planner/potentials.py.)"""

    @property
    def seeds(self) -> Sequence[float]: ...
    @property
    def num_nodes(self) -> int: ...
    @property
    def multiplications(self) -> int: ...
    @property
    def base(self) -> float: ...
    @property
    def owned_leaves(self) -> int: ...
    @property
    def custom_nodes(self) -> int: ...
    @property
    def unowned_params(self) -> int: ...
    @property
    def tensor_hooks(self) -> bool: ...

    def hooks(self) -> Sequence[tuple[Any, Any]]:
        """(node, ((edge index, multiplier), ...)) for every node whose edges multiply."""
        ...

    def phi_of(self, node: Any) -> float | None:
        """The potential the plan gave ``node``, or None where it did not walk it."""
        ...

    def groups_reached(self) -> list[int]:
        """Positions (in the state's groups) of the groups whose leaves it reaches."""
        ...

    def unowned_parameters(self) -> list[torch.Tensor]:
        """The unowned Parameters the policy looked at."""
        ...


class Backend(Protocol):
    """What a backend does: probe and plan a backward (the walker), and keep
    the running state: bind a running graph task to what governs it, register
    a running plan for the backwards nested in it, look them up.

    ``module`` is the native extension, or None for the Python backend (the
    native route's one-call backward needs the extension itself)."""

    name: str
    module: Any

    # ---- the walker
    def probe(self, roots: Sequence[Any], state: State) -> int:
        """Before the fast path: a PROBE_* verdict or-ed with PROBE_HIDDEN
        (``_planner/probe.py``).  (See NOTE [ Fast path ] in _entry/entry.py.)"""
        ...

    def plan(self, roots: Sequence[Any], request: PlanRequest) -> Plan:
        """The plan of ``request`` over the graph of ``roots``; raises
        OverflowError where this backend cannot plan it (more than 64
        distinct factors natively)."""
        ...

    # ---- the running state
    def binding(self, reading: Reading, potential: float | None, on_failure: list[Callable[[], None]] | None,
                governor: Any) -> Any:
        """A binding of ``reading``: ``potential`` the one everything in an
        unplanned backward carries, from which nested ones are planned (by
        ``governor``, natively), or None; ``on_failure`` its top-level
        backward's list (None: this thread's).
        (See NOTE [ Which snapshot an output hook obeys ] in _backward/running.py.)"""
        ...

    def reference_binding(self, reading: Reading) -> Any:
        """The binding of a reference pass.  (See NOTE [ Once per backward ] in _backward/running.py.)"""
        ...

    def bound(self, roots: tuple[Any, ...], binding: Any, key: int = 0) -> AbstractContextManager[tuple[Any, ...]]:
        """Bind the graph task of a backward of ``roots`` while it runs to
        ``binding`` (None: none) and to ``key`` (0: none) with the keys of the
        task it runs inside; its ``with`` gives the roots to hand to torch.
        (See NOTE [ Multipliers per graph task ] in _native/hooks.h.)"""
        ...

    def new_key(self) -> int:
        """A key for one backward's multiplier rows."""
        ...

    def task_has(self, key: int) -> bool:
        """Whether the graph task running here reads the rows of ``key``."""
        ...

    def task_keyed(self) -> bool:
        """Whether the graph task running here reads any rows (a backward
        nested in it is bound, to read them too)."""
        ...

    def running_plan(self, plan: Plan, reading: Reading) -> AbstractContextManager[None]:
        """Register ``plan`` for nested backwards while its backward runs."""
        ...

    def running(self) -> Sequence[tuple[Plan, Reading]]:
        """The running plans, innermost last."""
        ...

    def enclosing_phi(self, node: Any) -> float | None:
        """The potential the innermost running plan that walked ``node`` gave it."""
        ...

    def nested_plan(self, current: Any, roots: tuple[Any, ...]) -> tuple[Reading, Plan] | str | None:
        """A backward nested in ``current``'s backward, planned: (reading, plan),
        None where it is left alone, or NESTED_IN_PYTHON: look it up in Python."""
        ...
