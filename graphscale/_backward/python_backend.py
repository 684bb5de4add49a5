"""The Python backend, the reference: bindings of running graph tasks
(:class:`Binding`, the binding hook), the registry of running plans, and
:class:`PythonBackend`, which plans with ``_planner/``.  C++ twin: ``_native/registry.h``,
``bind.h`` and ``for_python.h``.  The graph task -> binding map,
:data:`bindings`, is the one both backends write."""
from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .._core import registry as _registry
from .._core.snapshot import Reading, State
from .._planner import plan as _plan
from .._planner import probe as _probe
from .._planner.request import PlanRequest
from . import frames as _frames
from .backend import NESTED_IN_PYTHON, Backend, Plan

__all__ = ["bindings", "Binding", "PythonBackend", "PYTHON"]

# See NOTE [ One interface, two backends ] in _backward/backend.py.
# A binding's potential: see NOTE [ Fast path ] in _entry/entry.py; its once and reference:
# see NOTE [ Once per backward ] in _backward/running.py; its on_failure: see
# NOTE [ A backward that raised ] in _backward/frames.py.


# graph task id -> binding, while that backward runs (both kinds of hook write it; the
# DeepSpeed adapter's output hooks read it: task_binding() without its frame)
bindings: dict[int, Any] = {}
_py_running: list[tuple[Any, Reading]] = []  # the Python registry: (plan, reading), innermost last
# Backwards on several threads register and unregister at once (a plan with no edge
# multiplier holds the shared-nodes lock shared): the list changes only under this lock.
_py_running_lock = threading.Lock()
# graph task id -> the keys whose multiplier rows its hooks apply: its backward's own,
# then those of the tasks it runs inside (NOTE [ Multipliers per graph task ] in _native/hooks.h)
_task_keys: dict[int, tuple[int, ...]] = {}
_next_key = itertools.count(1).__next__


class Binding:
    """What a running backward's graph task is bound to, in the Python
    backend (the native one's ``Binding`` has the same fields): the
    ``reading`` (snapshot and factors) that governs it, and (the fast path)
    where no plan of it exists, the ``potential`` everything in it carries,
    from which a nested backward is planned (None: nested backwards are left
    alone); ``once``/``reference``: what runs once per backward, shared with
    the backwards nested in it; ``on_failure``: what completes it if it
    raises.  Made on the thread that calls the backward: a
    nested backward's binding joins the one of the task running there."""

    __slots__ = ("reading", "potential", "once", "on_failure", "reference")

    def __init__(self, reading: Reading, potential: float | None = None, reference: bool = False,
                 on_failure: list[Callable[[], None]] | None = None) -> None:
        self.reading, self.potential = reading, potential
        enclosing = bindings.get(torch._C._current_graph_task_id()) if bindings else None
        self.once: set[Any] = set() if enclosing is None else enclosing.once
        self.on_failure: list[Callable[[], None]] = (
            enclosing.on_failure if enclosing is not None else _frames.innermost() if on_failure is None
            else on_failure)
        self.reference: bool = reference or (enclosing is not None and enclosing.reference)



class _PyBound:
    """The Python binding hook (NOTE [ Which snapshot an output hook obeys ])."""

    __slots__ = ("roots", "binding", "keys", "tasks", "keyed", "handles")

    def __init__(self, roots: Sequence[Any], binding: Any, key: int = 0) -> None:
        self.roots, self.binding = roots, binding
        inherited = _task_keys.get(torch._C._current_graph_task_id(), ())
        self.keys = (key, *inherited) if key else inherited
        self.tasks: list[int] = []
        self.keyed: list[int] = []
        self.handles: list[Any] = []

    def _bind(self, *_: Any) -> None:
        tid = torch._C._current_graph_task_id()
        if tid >= 0 and self.binding is not None and tid not in bindings:
            bindings[tid] = self.binding
            self.tasks.append(tid)
        if tid >= 0 and self.keys and tid not in _task_keys:
            _task_keys[tid] = self.keys
            self.keyed.append(tid)

    def __enter__(self) -> tuple[Any, ...]:
        out = []
        grad_was = torch.is_grad_enabled()
        torch._C._set_grad_enabled(True)  # a backward may run under no_grad; a view must join the graph
        try:
            for t in self.roots:
                node = None
                if isinstance(t, GradientEdge):
                    node = t.node
                elif isinstance(t, torch.Tensor) and t.requires_grad:
                    # A view of the root is a node of this backward's own, before the root's own
                    # hooks: nothing another backward runs is touched.  A subclass, a sparse or
                    # nested root: its own node.  (See NOTE [ Multipliers per graph task ] in _native/hooks.h.)
                    hooked = t._backward_hooks and _registry.output_hooked(t)
                    if (hooked or type(t) is torch.Tensor) and t.layout == torch.strided and not t.is_nested:
                        t = t.view_as(t)  # its node dies with the graph: no handle to keep
                        t.grad_fn.register_prehook(self._bind)  # type: ignore[union-attr]
                    else:
                        node = t.grad_fn if t.grad_fn is not None else get_gradient_edge(t).node
                if node is not None:
                    self.handles.append(node.register_prehook(self._bind))
                out.append(t)
        finally:
            torch._C._set_grad_enabled(grad_was)
        return tuple(out)

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        for tid in self.tasks:
            bindings.pop(tid, None)
        for tid in self.keyed:
            _task_keys.pop(tid, None)




class _PyRunningPlan:
    """Register (plan, reading) in the Python registry while its backward runs."""

    __slots__ = ("entry",)

    def __init__(self, plan: Any, reading: Reading) -> None:
        self.entry = (plan, reading)

    def __enter__(self) -> None:
        with _py_running_lock:
            _py_running.append(self.entry)

    def __exit__(self, *exc: object) -> None:
        with _py_running_lock:
            for i in range(len(_py_running) - 1, -1, -1):
                if _py_running[i] is self.entry:
                    del _py_running[i]
                    return




class PythonBackend:
    """The Python backend, the reference: plans with ``_planner/plan.py``, keeps the
    running state in this module."""

    name = "python"
    module = None

    def probe(self, roots: Sequence[Any], state: State) -> int:
        return _probe.probe_python(roots, state)

    def plan(self, roots: Sequence[Any], request: PlanRequest) -> Plan:
        return _plan.PyPlan(*_plan.build(roots, request), request.reading.state.groups)

    def binding(self, reading: Reading, potential: float | None, on_failure: list[Callable[[], None]] | None,
                governor: Any) -> Binding:
        return Binding(reading, potential, False, on_failure)  # (no governor: nested plans are made in Python)

    def reference_binding(self, reading: Reading) -> Binding:
        return Binding(reading, reference=True, on_failure=[])

    def bound(self, roots: tuple[Any, ...], binding: Any, key: int = 0) -> _PyBound:
        return _PyBound(roots, binding, key)

    new_key = staticmethod(_next_key)

    @staticmethod
    def task_has(key: int) -> bool:
        return key in _task_keys.get(torch._C._current_graph_task_id(), ())

    @staticmethod
    def task_keyed() -> bool:
        return bool(_task_keys) and torch._C._current_graph_task_id() in _task_keys

    def running_plan(self, plan: Plan, reading: Reading) -> _PyRunningPlan:
        return _PyRunningPlan(plan, reading)

    def running(self) -> tuple[tuple[Plan, Reading], ...]:
        with _py_running_lock:
            return tuple(_py_running)

    def enclosing_phi(self, node: Any) -> float | None:
        for plan, _ in reversed(self.running()):
            p = plan.phi_of(node)
            if p is not None:
                return p  # type: ignore[no-any-return]
        return None

    def nested_plan(self, current: Any, roots: tuple[Any, ...]) -> str:
        return NESTED_IN_PYTHON  # decide.plan_nested's lookup over running()


PYTHON: Backend = PythonBackend()
