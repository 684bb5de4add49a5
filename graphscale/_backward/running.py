"""What is running: the context of the backwards in flight.

* the thread-local frames of an adapter's ``engine.backward``
  (:func:`engine_backward`, :func:`engine_backward_frame`);
* the bindings of running graph tasks to what governs them (:class:`Binding`,
  :class:`bound`, :func:`task_binding`, :func:`governing_binding`), which
  output hooks and nested backwards read;
* the registry of walked plans whose backward is running (:class:`Running`,
  :class:`running_plan`, :func:`find_enclosing`), which nested backwards
  plan from.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Callable

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .._core import registry as _registry
from .._core.snapshot import Reading, State
from .failing import innermost

__all__ = [
    "engine_backward", "engine_backward_frame",
    "engine_backward_caller", "gas_scaling_enabled", "CARRIES_ATTR", "Binding", "binding_for",
    "bound", "task_binding", "task_reading", "governing_binding", "Running", "running_plan", "running",
    "compiled_autograd_active", "eager",
    "find_enclosing", "enclosing_phi",
]


# ---------------------------------------------------------------- engine.backward frames
class _Local(threading.local):
    def __init__(self) -> None:
        self.engine_calls: list[tuple[bool, float, Any]] = []  # engine.backward frames, innermost last


_local = _Local()


class _Pushed:
    """``value`` on ``stack`` for the duration of a ``with`` block (a class:
    these run on every backward, and a generator context manager costs ~4x)."""

    __slots__ = ("stack", "value")

    def __init__(self, stack: list[Any], value: Any) -> None:
        self.stack, self.value = stack, value

    def __enter__(self) -> None:
        self.stack.append(self.value)

    def __exit__(self, *exc: object) -> None:
        self.stack.pop()


def engine_backward(scaling: bool, carries: float = 1.0, caller: Any = None) -> AbstractContextManager[None]:
    """Within this block (an adapter's ``engine.backward``), top-level governed
    backwards on this thread apply the factors only if ``scaling``
    (``scale_wrt_gas``), and their seeds already carry ``carries`` (the
    calling engine's fp16 loss scale, applied by DeepSpeed before it calls
    backward); ``caller``: (the engine whose backward this is, the loss it was
    given), for tools."""
    return _Pushed(_local.engine_calls, (scaling, carries, caller))


def engine_backward_frame() -> tuple[bool, float]:
    """(scaling, carries) of the innermost :func:`engine_backward` on this thread, or (True, 1.0)."""
    stack = _local.engine_calls
    return stack[-1][:2] if stack else (True, 1.0)


def engine_backward_caller() -> Any:
    """(engine, loss) of the innermost :func:`engine_backward` on this thread, or None."""
    stack = _local.engine_calls
    return stack[-1][2] if stack else None


def gas_scaling_enabled() -> bool:
    return engine_backward_frame()[0]


# A tensor that carries a factor already (an fp16 engine's ``engine.scale(loss)``)
# has it in this attribute; a backward from it strips it (NOTE [ fp16 engines ]
# in _adapters/deepspeed/__init__.py).
CARRIES_ATTR = "_graphscale_carries"


# NOTE [ Which snapshot an output hook obeys ]
# DeepSpeed's output hooks fire in the middle of a backward, long after the
# backward read its State snapshot.  If they asked "is the engine installed
# now?", a remove() in between (from a backward hook, or from another thread)
# would make them divide inside a backward whose plan already scales the
# engine's leaves (scaled twice), and a backward begun ungoverned before an
# install would lose DeepSpeed's division.  So a governed backward that
# governs engines binds its autograd graph task to its snapshot (bound()):
# each root is replaced by a view of itself whose tensor hook, the first hook
# of the task's first node, records torch._C._current_graph_task_id() ->
# snapshot; a nested backward binds its own task the same way (every task
# whose graph may hold an engine's output hook: a plan that saw no tensor
# hook anywhere binds nothing).  The graph task id is what every thread
# running the task's nodes reads, the caller's and autograd's device threads
# (CUDA) alike, and it is the only thing the adapter's hook asks
# (task_binding()): no thread-local, which a device thread would not see
# and which would make a torch.autograd.grad nested in a governed backward on
# the same thread look governed.  An unbound task is an ungoverned backward
# (torch.autograd.grad, or one begun before install): DeepSpeed's own
# division applies there, as without graphscale.


# NOTE [ Once per backward ]
# An adapter may have work that must run once per backward for each engine
# the backward reaches, however many of the engine's outputs it meets
# (DeepSpeed's backward prologue: NOTE [ One lifecycle per backward ] in
# _adapters/deepspeed/engine.py).  A top-level governed backward and every backward nested in
# it (reentrant checkpointing) are one backward for this: the binding of a
# nested backward's graph task shares the set ``once`` of the binding of the
# task it runs inside, so a key marked anywhere in it reads as marked
# everywhere in it, on any thread.  A binding made for a reference pass
# (graphscale.audit's plain gradient, ``reference=True``) is not the real
# backward: adapters run none of their once-per-backward work inside it, and
# so do the backwards nested in it.


class Binding:
    """What a running backward's graph task is bound to: the ``reading``
    (snapshot and factors) that governs it, and (NOTE [ Fast path ] in
    _backward/entry.py) where no plan of it exists, the ``potential`` everything in
    it carries, from which a nested backward is planned (None: nested
    backwards are left alone); ``once``/``reference``: NOTE [ Once per
    backward ]; ``on_failure``: NOTE [ A backward that raised ] in
    _backward/failing.py.  Made on the thread that calls the backward: a nested
    backward's binding joins the one of the task running there."""

    __slots__ = ("reading", "potential", "once", "on_failure", "reference", "native")

    def __init__(self, reading: Reading, potential: float | None = None, reference: bool = False) -> None:
        self.reading, self.potential = reading, potential
        enclosing = task_binding()
        self.once: set[Any] = set() if enclosing is None else enclosing.once
        # NOTE [ A backward that raised ] in _backward/failing.py: shared like ``once``
        self.on_failure: list[Callable[[], None]] = enclosing.on_failure if enclosing is not None else innermost()
        self.reference: bool = reference or (enclosing is not None and enclosing.reference)
        self.native: Any = None  # the native route's reading of it (NOTE [ One native call per backward ])

    @property
    def state(self) -> State:
        return self.reading.state


def binding_for(reading: Reading | None, hooks: bool = True, potential: float | None = None) -> Binding | None:
    """The binding a backward governed by ``reading`` needs, or None where it
    needs none: bound when its graph may hold output hooks of objects the
    snapshot governs (``hooks``: a plan saw tensor hooks, or none looked;
    NOTE [ Which snapshot an output hook obeys ]), or when backwards nested in
    it must be planned from ``potential`` (NOTE [ Fast path ])."""
    if reading is None or (potential is None and not (hooks and reading.state.hook_owners)):
        return None
    return Binding(reading, potential)


_by_task: dict[int, Binding] = {}  # graph task id -> binding, while that backward runs


class bound:
    """Bind the graph task of a backward of ``roots`` to ``state`` while it
    runs (NOTE [ Which snapshot an output hook obeys ]); ``with`` yields the
    roots to hand to torch.  The binding hook must run before any output hook
    that asks for the binding: a node pre-hook on a root's node comes after
    that node's tensor hooks, so a root that is itself an engine's output
    (such as a Hugging Face model's ``loss``) is replaced by a view of itself,
    whose node is new; other roots keep their node and get the pre-hook."""

    __slots__ = ("roots", "binding", "tasks", "handles")

    def __init__(self, roots: Sequence[Any], binding: Binding) -> None:
        self.roots, self.binding = roots, binding
        self.tasks: list[int] = []
        self.handles: list[Any] = []

    def _bind(self, *_: Any) -> None:
        tid = torch._C._current_graph_task_id()
        if tid >= 0 and tid not in _by_task:
            _by_task[tid] = self.binding
            self.tasks.append(tid)

    def __enter__(self) -> tuple[Any, ...]:
        out = []
        grad_was = torch.is_grad_enabled()
        torch._C._set_grad_enabled(True)  # a backward may run under no_grad; a view must join the graph
        try:
            for t in self.roots:
                node = None
                if isinstance(t, GradientEdge):
                    node = t.node
                elif isinstance(t, torch.Tensor):
                    hooked = t._backward_hooks and _registry.output_hooked(t)
                    if hooked and t.layout == torch.strided and not t.is_nested:
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
            _by_task.pop(tid, None)


def task_binding() -> Binding | None:
    """The binding of the graph task this thread is running a node of."""
    return _by_task.get(torch._C._current_graph_task_id()) if _by_task else None


def task_reading() -> Reading | None:
    """The reading bound to the graph task this thread is running a node of."""
    binding = task_binding()
    return None if binding is None else binding.reading


def governing_binding(engine: Any) -> Binding | None:
    """The binding of the running graph task if it governs ``engine`` (a
    reference pass governs every engine: NOTE [ Once per backward ]), else
    None: an ungoverned backward, where the engine's own bookkeeping applies."""
    binding = task_binding()
    if binding is None or not (binding.reference or id(engine) in binding.state.hook_owners):
        return None
    return binding


# ---------------------------------------------------------------- running plans
class Running:
    """A walked plan whose backward is running, with the reading it was
    planned with (compares by identity)."""

    __slots__ = ("plan", "reading")

    def __init__(self, plan: Any, reading: Reading) -> None:
        self.plan = plan  # PyPlan or the native walker's NativePlan: phi_of(node) -> float | None
        self.reading = reading


# Walked plans whose backward is running, any thread, innermost last.  Each
# change is one list operation (append, remove) and each reader takes a
# snapshot with tuple(): each is atomic, so no lock is taken on the hot path.
# Keyed by node, not by thread: CUDA backward runs nodes on autograd worker
# threads (NOTE [ Nested backward ] in _backward/entry.py).
_running: list[Running] = []


class running_plan:
    """Register ``entry`` for nested backwards while its backward runs."""

    __slots__ = ("entry",)

    def __init__(self, entry: Running) -> None:
        self.entry = entry

    def __enter__(self) -> None:
        _running.append(self.entry)

    def __exit__(self, *exc: object) -> None:
        try:
            _running.remove(self.entry)  # by identity (Running compares so)
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


# ---------------------------------------------------------------- compiled autograd
def compiled_autograd_active() -> bool:
    """Whether torch's compiled autograd captures a backward started now (its
    own ``_enable``, ``torch._dynamo.config.compiled_autograd`` under
    ``torch.compile``, or DeepSpeed's ``compile(compiled_autograd_enabled=True)``
    inside ``engine.backward``): NOTE [ Which route governs a backward ] in
    _backward/route.py.  One dict read while dynamo was never imported."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and bool(ca.compiled_autograd_enabled or ca.in_compiled_autograd_region)


def eager(fn: Any) -> Any:
    """``fn`` run with dynamo off for its whole extent (compiled autograd is on,
    so dynamo is imported): NOTE [ Under compiled autograd ] in _adapters/deepspeed/engine.py."""
    return torch._dynamo.disable(fn)
