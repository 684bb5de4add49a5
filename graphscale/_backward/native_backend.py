"""The native backend: the extension built from ``graphscale/_native/``
seen through :class:`~graphscale._backward.backend.Backend`.  C++ twins:
``_native/walker.cpp`` (the bindings) and ``_native/python_planner.h``.
Its running-state methods are the extension's own functions, taken as they
are (no Python frame between a caller and C++); its walker methods read the
snapshot's native owner table first.  One :class:`NativeBackend` per loaded
module (:func:`of`).  (See NOTE [ One interface, two backends ] in _backward/backend.py.)
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from .._core.snapshot import State
from .._planner.nodes import root_node
from .._planner.request import PlanRequest
from .backend import Plan
from .overrides import own

__all__ = ["NativeBackend", "of", "native_owners", "joined"]


def native_owners(state: State, module: Any) -> Any:
    """The native ``Owners`` lookup (TensorImpl* -> group position) of
    ``state``, built once per snapshot and kept in its tables (see
    NOTE [ Per-snapshot tables ] in _core/snapshot.py): install/remove makes a new
    snapshot and the table goes with it, so it keeps no group, parameter or
    module alive (tests/hardening/test_longrun.py).  Positions follow
    ``state.groups``."""
    tables = state.tables
    made = tables.native_owners
    if made is not None and made[0] is module:
        return made[1]
    impls: list[int] = []
    positions: list[int] = []
    for leaf, k in state.owned_leaves():
        impls.append(leaf._cdata)
        positions.append(k)
    table = module.Owners(impls, positions)
    tables.native_owners = (module, table)
    return table


def joined(binding: Any) -> tuple[Any, Any, bool]:
    """(once, on_failure, reference) of ``binding``, a binding the native
    module did not make (running.py's Python one): what a native binding made
    inside its graph task shares with it (see NOTE [ Once per backward ] in
    _backward/running.py).  Handed to the native module at configure: it reads no
    attribute of graphscale's Python by name."""
    return binding.once, binding.on_failure, bool(binding.reference)


class NativeBackend:
    """The native extension ``module`` as a backend: its functions taken as
    they are where the interface matches them, and a method where a value
    must be handed over (the C++ reads no attribute of ours by name)."""

    name = "native"

    def __init__(self, module: Any) -> None:
        self.module = module
        self.reference_binding = module.reference_binding
        self.bound = module.bound
        self.new_key = module.new_key
        self.task_has = module.task_has
        self.task_keyed = module.task_keyed
        self.running = module.running
        self.enclosing_phi = module.enclosing_phi
        self.nested_plan = module.nested_plan

    def configure(self, by_task: dict[int, Any], original_backward: Callable[..., None],
                  innermost: Callable[[], Any], carries_attr: str) -> None:
        """Keep the running state from now on: the graph task -> binding map
        both kinds of binding write, torch's own ``torch.autograd.backward``, the
        function giving this thread's top-level on_failure list, and the
        attribute a root's carried factor is tagged with; and that backward's
        twin for calls an override sees.
        (See NOTE [ One running state, both routes ] in _native/registry.h, and
        NOTE [ An override sees torch's own backward ] in _backward/overrides.py.)"""
        self.module.configure(by_task, original_backward, torch.nn.Parameter, torch.nn.Module, carries_attr,
                              innermost, own(original_backward, "backward"), joined, GradientEdge)

    def binding(self, reading: Any, potential: float | None, on_failure: Any, governor: Any) -> Any:
        """A native Binding of a backward governed by ``reading`` (its factors handed over)."""
        return self.module.binding(reading, potential, on_failure, governor, reading.factor_list)

    def running_plan(self, plan: Plan, reading: Any) -> Any:
        """Register ``plan`` for nested backwards while its backward runs; a
        Python plan (the Python route's, past 64 factors) with its ``phi_of``,
        which the native lookup calls per node."""
        phi_of = None if isinstance(plan, self.module.NativePlan) else plan.phi_of
        return self.module.running_plan(plan, reading, phi_of)

    def probe(self, roots: Sequence[Any], state: State) -> int:
        return int(self.module.probe(tuple(roots), native_owners(state, self.module), state.policy_index,
                                     torch.nn.Parameter))

    def plan(self, roots: Sequence[Any], request: PlanRequest) -> Plan:
        """``request`` planned in C++.  Where a nested request asks this
        module's running state for the enclosing potentials (its
        ``outer_phi`` is this backend's ``enclosing_phi``), the enclosing plans
        are looked up in C++ (no Python call per node) when they are all this
        module's.  Raises OverflowError past 64 distinct factors."""
        module = self.module
        outer: Any = request.outer_phi
        if outer is not None and outer is self.enclosing_phi:
            running = [plan for plan, _ in module.running()]
            if all(isinstance(p, module.NativePlan) for p in running):
                outer = running
        pins = request.input_pins
        state = request.reading.state
        return module.plan(  # type: ignore[no-any-return]
            [root_node(t) for t in roots], native_owners(state, module), request.factor_list, request.base,
            request.carrier, state.policy_index, torch.nn.Parameter, [node for node, _ in pins],
            [value for _, value in pins], outer, request.hint)


_lock = threading.Lock()
_made: dict[int, tuple[Any, NativeBackend]] = {}  # id(module) -> (the module, its backend)


def of(module: Any) -> NativeBackend:
    """The one backend of the loaded extension ``module``."""
    made = _made.get(id(module))
    if made is not None and made[0] is module:
        return made[1]
    with _lock:
        made = _made.get(id(module))
        if made is None or made[0] is not module:
            made = (module, NativeBackend(module))
            _made[id(module)] = made
        return made[1]
