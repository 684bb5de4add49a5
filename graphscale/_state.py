"""What is installed, and what is running: the snapshot every backward reads.

This module holds graphscale's process-wide state and nothing else:

* :class:`State`: an immutable snapshot of the installed groups, made by
  :meth:`State.of` (the one constructor, used by ``install`` and
  ``explain``), read once by each backward;
* the thread-local context of a backward: ``engine.backward``'s
  ``scale_wrt_gas`` (:func:`gas_scaling`) and the snapshot of the governed
  backward running on this thread (:func:`governing`);
* the registry of walked plans whose backward is running (:func:`running_plan`,
  :func:`find_enclosing`), which nested backwards plan from;
* two observation points for tools: :data:`observer` (``graphscale.audit``)
  and :data:`walk_recorder` (``benchmarks/overhead.py``).

# NOTE [ Per-snapshot tables ]
# A State lives from one install()/remove() to the next, through many
# backwards, so whatever a backward needs that depends only on what is
# installed is made once per State, never per backward: the owner map, the
# set of governed factor keys (the DeepSpeed adapter's O(1) test in its
# per-tensor hook), the native walker's owner table (graphscale/_native
# owners_for; built at install when the extension is loaded already, else at
# the first walked backward) and the checkpoint hints (NOTE [ Checkpoint
# hints ] in _planning.py).  Factors are not among them: a gas callable is
# read at the start of every top-level backward.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

from ._errors import ConfigurationError
from ._group import Group

__all__ = [
    "UNOWNED_POLICIES", "State", "current", "set_current", "gas_scaling", "gas_scaling_enabled",
    "governing", "governing_state", "Running", "running_plan", "running", "find_enclosing",
    "enclosing_phi", "observer", "walk_recorder",
]

UNOWNED_POLICIES = ("any", "raw")


def _owner_map(groups: Iterable[Group]) -> dict[int, Group]:
    """id(leaf) -> owning group; a leaf in two groups of different gas is an error."""
    owner: dict[int, Group] = {}
    for g in groups:
        for p in g.parameters:
            prev = owner.get(id(p))
            if prev is None or prev is g:
                owner[id(p)] = g
            elif prev.factor_key != g.factor_key:
                raise ConfigurationError(
                    f"graphscale: parameter {g.param_name(p)!r} (shape {tuple(p.shape)}) is in group "
                    f"{prev.name!r} and in group {g.name!r}, whose gradient-accumulation steps may "
                    "differ, so no single factor is right for it. Put it in one group only, or give "
                    "both groups the same gas."
                )
    return owner


@dataclass(frozen=True)
class State:
    """A snapshot of what is installed, read once per backward.

    Make one with :meth:`State.of`.  ``owner`` maps ``id(leaf)`` to its group
    (the groups keep the leaves alive); ``raw``: unowned leaves must get
    exactly their plain gradient.
    """

    groups: tuple[Group, ...]
    owner: dict[int, Group]
    raw: bool
    # Derived from the above, once (NOTE [ Per-snapshot tables ]).
    factor_keys: frozenset[object] = field(init=False, repr=False, compare=False)
    cache: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "factor_keys", frozenset(g.factor_key for g in self.groups))
        object.__setattr__(self, "cache", {})

    @classmethod
    def of(cls, groups: Iterable[Group], unowned: str, where: str = "graphscale.install") -> State:
        """The snapshot of ``groups`` (duplicates dropped, order kept) under the
        ``unowned`` policy.

        Raises:
            ValueError: ``unowned`` is not a policy name.
            ConfigurationError: a leaf is in two groups whose gas may differ.
        """
        if unowned not in UNOWNED_POLICIES:
            raise ValueError(f"graphscale: {where}(unowned=...) must be one of {UNOWNED_POLICIES}, got {unowned!r}.")
        unique: list[Group] = []
        for g in groups:
            if g not in unique:
                unique.append(g)
        return cls(groups=tuple(unique), owner=_owner_map(unique), raw=unowned == "raw")

    def read_factors(self) -> dict[Group, float]:
        """Every group's factor, read now (a gas callable may raise: nothing is touched yet)."""
        return {g: g.factor() for g in self.groups}


_current: State | None = None


def set_current(state: State | None) -> None:
    """Publish the snapshot later backwards read (``install``/``remove`` only)."""
    global _current
    _current = state


def current() -> State | None:
    """The snapshot of what is installed now, or None."""
    return _current


# ---------------------------------------------------------------- thread-local context
class _Local(threading.local):
    def __init__(self) -> None:
        self.gas_scaling: list[bool] = []  # engine.backward(scale_wrt_gas=...), innermost last
        self.governing: list[State] = []  # snapshots of governed backwards on this thread


_local = _Local()


@contextmanager
def _pushed(stack: list[Any], value: Any) -> Iterator[None]:
    stack.append(value)
    try:
        yield
    finally:
        stack.pop()


def gas_scaling(enabled: bool) -> AbstractContextManager[None]:
    """Within this block, top-level governed backwards on this thread apply
    the GAS factors only if ``enabled`` (``engine.backward(scale_wrt_gas=...)``)."""
    return _pushed(_local.gas_scaling, enabled)


def gas_scaling_enabled() -> bool:
    stack = _local.gas_scaling
    return stack[-1] if stack else True


# NOTE [ Which snapshot an output hook obeys ]
# DeepSpeed's output hooks fire in the middle of a backward, long after the
# backward read its State snapshot.  If they asked "is the engine installed
# now?", a remove() in between (from a backward hook, or from another thread)
# would make them divide inside a backward whose plan already scales the
# engine's leaves: scaled twice, silently.  So each top-level governed backward
# pushes its snapshot on a thread-local stack while it runs, and the adapter's
# hook asks governing_state() first.  CPU nodes run on the thread that called
# backward, so on CPU this is exact; on autograd device threads (CUDA) the
# stack is empty and the adapter falls back to whether the engine is installed.
# Not covered: a backward that began *ungoverned* (nothing installed yet) on one
# thread while another thread installs an engine whose outputs it reaches: its
# remaining output hooks pass through, as they must under torch.autograd.grad
# (which they cannot tell apart).  Install before other threads start training.
def governing(state: State) -> AbstractContextManager[None]:
    """Mark ``state`` as the snapshot of the top-level backward running on this thread."""
    return _pushed(_local.governing, state)


def governing_state() -> State | None:
    """The snapshot of the governed backward running on this thread, if any."""
    stack = _local.governing
    return stack[-1] if stack else None


# ---------------------------------------------------------------- running plans
@dataclass(eq=False)
class Running:
    """A walked plan whose backward is running, with what it was planned with."""

    plan: Any  # PyPlan or the native walker's NativePlan: phi_of(node) -> float | None
    factors: dict[Group, float]
    state: State


# Walked plans whose backward is running, any thread, innermost last.  Each
# change is one list operation (append, remove) and each reader takes a
# snapshot with tuple(): each is atomic, so no lock is taken on the hot path.
# Keyed by node, not by thread: CUDA backward runs nodes on autograd worker
# threads (NOTE [ Nested backward ] in _backward.py).
_running: list[Running] = []


@contextmanager
def running_plan(entry: Running) -> Iterator[None]:
    """Register ``entry`` for nested backwards while its backward runs."""
    _running.append(entry)
    try:
        yield
    finally:
        try:
            _running.remove(entry)  # by identity (Running compares so)
        except ValueError:
            pass


def running() -> tuple[Running, ...]:
    """The running plans, innermost last (a snapshot)."""
    return tuple(_running)


def find_enclosing(node: Any) -> tuple[Running, float] | None:
    """The innermost running plan that walked ``node``, and the potential it gave it."""
    for entry in reversed(tuple(_running)):
        p = entry.plan.phi_of(node)
        if p is not None:
            return entry, p
    return None


def enclosing_phi(node: Any) -> float | None:
    """The potential a running plan gave ``node``, or None where none saw it."""
    found = find_enclosing(node)
    return None if found is None else found[1]


# ---------------------------------------------------------------- observation points
# An observer wraps every governed backward while set (graphscale.audit sets
# it): observer(run, *backward_args) must call run(*backward_args) once.
observer: Callable[..., None] | None = None

# A walk recorder sees every walked plan while set (benchmarks/overhead.py):
# walk_recorder(nodes, seconds_to_walk_and_plan, multiplications); the fast
# path calls it with (0, 0.0, seeds_scaled).
walk_recorder: Callable[[int, float, int], None] | None = None
