"""What autograd is running under graphscale: the bindings of running graph
tasks to what governs them (:func:`binding_for`, :func:`bound`,
:func:`task_binding`), which output hooks and nested backwards read, and the
registry of walked plans whose backward is running (:func:`running_plan`,
:func:`running`, :func:`enclosing_phi`), which nested backwards plan from;
and :data:`state`, the backend the running state is kept in (the Python
one, ``python_backend.py``, until the native one takes over).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch

from .._core.snapshot import Reading, State
from . import frames as _frames
from . import gate as _gate
from . import native_backend as _native_backend
from .backend import Backend, Plan
from .gate import compiled_autograd_active
from .overrides import ORIGINAL_BACKWARD
from .python_backend import PYTHON, Binding, PythonBackend, bindings

__all__ = [
    "PythonBackend", "PYTHON", "state", "use_native", "Binding", "bindings", "binding_for",
    "reference_binding", "bound", "bound_with_rows", "task_binding", "task_reading", "running_plan", "running",
    "enclosing_phi", "find_enclosing",
]

# Once the native module keeps the running state (use_native) the registry,
# the bindings and the binding hook are the native ones, for both routes and
# the tools; the Python ones here serve only before that, and the Python
# binding hook also under compiled autograd (which lifts Python hooks only).
# The graph task -> binding map is one dict, ``bindings``, either way.
# (See NOTE [ One running state, both routes ] in _native/registry.h, and
# NOTE [ One interface, two backends ] in _backward/backend.py.)


# NOTE [ Which snapshot an output hook obeys ]
# DeepSpeed's output hooks fire in the middle of a backward, long after the
# backward read its State snapshot.  If they asked "is the engine installed
# now?", a remove() in between (from a backward hook, or from another thread)
# would make them divide inside a backward whose plan already scales the
# engine's leaves (scaled twice), and a backward begun ungoverned before an
# install would lose DeepSpeed's division.  So a governed backward that
# governs engines binds its autograd graph task to its snapshot (bound()):
# a hook that runs before any other hook of the task's first node records
# torch._C._current_graph_task_id() -> binding; a nested backward binds its
# own task the same way (every task whose graph may hold an engine's output
# hook: a plan that saw no tensor hook anywhere binds nothing).  Natively it
# is a node of the backward's own put in front of the roots (torch is handed
# GradientEdges to it), never a hook on a node other backwards share
# (see NOTE [ Binding without touching a shared node ] in _native/bind.h); the
# Python one (no such node in Python) replaces a root that is itself an
# engine's output by a view of itself, whose node is new, and puts a node
# pre-hook on the other roots.  The graph task id is what every thread running
# the task's nodes reads, the caller's and autograd's device threads
# (CUDA) alike, and it is the only thing the adapter's hook asks
# (task_binding()): no thread-local, which a device thread would not see and
# which would make a torch.autograd.grad nested in a governed backward on the
# same thread look governed.  An unbound task is an ungoverned backward
# (torch.autograd.grad, or one begun before install): DeepSpeed's own
# division applies there, as without graphscale.


# NOTE [ Once per backward ]
# An adapter may have work that must run once per backward for each engine
# the backward reaches, however many of the engine's outputs it meets
# (DeepSpeed's backward prologue; see
# NOTE [ One lifecycle per backward ] in _adapters/deepspeed/engine.py).
# A top-level governed backward and every backward nested in it (reentrant
# checkpointing) are one backward for this: the binding of a
# nested backward's graph task shares the set ``once`` of the binding of the
# task it runs inside, so a key marked anywhere in it reads as marked
# everywhere in it, on any thread.  A binding made for a reference pass
# (graphscale.audit's plain gradient, ``reference=True``) is not the real
# backward: adapters run none of their once-per-backward work inside it, and
# so do the backwards nested in it.


state: Backend = PYTHON  # the backend the running state is kept in: PYTHON, or a native one once (use_native)


def use_native(module: Any) -> bool:
    """Keep the running state in the native ``module`` from now on.  False
    (and nothing changed) while a backward runs on the Python state: a later
    call switches."""
    global state
    if state.module is module:
        return True
    if PYTHON.running() or bindings:
        return False
    backend = _native_backend.of(module)
    backend.configure(bindings, ORIGINAL_BACKWARD, _frames.innermost, _frames.CARRIES_ATTR)
    state = backend
    _gate.running_in(module)  # the native front of this module may open
    return True


def binding_for(reading: Reading | None, hooks: bool = True, potential: float | None = None,
                on_failure: list[Callable[[], None]] | None = None, governor: Any = None) -> Any:
    """The binding a backward governed by ``reading`` needs, or None where it
    needs none: bound when its graph may hold output hooks of objects the
    snapshot governs (``hooks``: a plan saw tensor hooks, or none looked;
    see NOTE [ Which snapshot an output hook obeys ]), or when backwards
    nested in it must be planned from ``potential`` (``governor``: the
    snapshot's native Governor, which plans them natively); ``on_failure``:
    its top-level backward's list.  (See NOTE [ Fast path ] in _entry/entry.py.)"""
    if reading is None or (potential is None and not (hooks and reading.state.hook_owners)):
        return None
    return state.binding(reading, potential, on_failure, governor if potential is not None else None)


def reference_binding(snapshot: State) -> Any:
    """The binding of a reference pass over ``snapshot`` (graphscale.audit's
    plain gradient: NOTE [ Once per backward ])."""
    return state.reference_binding(Reading(snapshot, {}, []))


def bound(roots: Sequence[Any], binding: Any, key: int = 0) -> Any:
    """Bind the graph task of a backward of ``roots`` to ``binding`` while it
    runs (NOTE [ Which snapshot an output hook obeys ]), and to ``key`` with
    the keys of the task it runs inside (NOTE [ Multipliers per graph task ]
    in _native/hooks.h): a context manager whose ``with`` gives the roots to
    hand to torch.  Under compiled autograd the Python one, the hook it lifts."""
    return (PYTHON if compiled_autograd_active() else state).bound(tuple(roots), binding, key)


def bound_with_rows(roots: Sequence[Any], binding: Any, rows: bool) -> tuple[Any, int]:
    """For a backward of ``roots`` that puts multiplier rows on nodes
    (``rows``) or runs inside a task that reads some: (the :func:`bound`
    context manager, or None where nothing needs binding; the key of its
    rows, 0 under compiled autograd, whose hooks apply unchecked: it has no
    graph task to ask).  (See NOTE [ Multipliers per graph task ] in _native/hooks.h.)"""
    compiled = compiled_autograd_active()
    key = state.new_key() if rows and not compiled else 0
    if binding is None and not key and not state.task_keyed():
        return None, 0
    return (PYTHON if compiled else state).bound(tuple(roots), binding, key), key


def task_binding() -> Any:
    """The binding of the graph task this thread is running a node of, or None."""
    return bindings.get(torch._C._current_graph_task_id()) if bindings else None


def task_reading() -> Reading | None:
    """The reading bound to the graph task this thread is running a node of."""
    binding = task_binding()
    return None if binding is None else binding.reading


# ---------------------------------------------------------------- running plans
def running_plan(plan: Plan, reading: Reading) -> Any:
    """Register ``plan`` (walked under ``reading``) for nested backwards while
    its backward runs: a context manager."""
    return state.running_plan(plan, reading)


def running() -> tuple[tuple[Plan, Reading], ...]:
    """The running plans as (plan, reading), innermost last (a snapshot)."""
    return tuple(state.running())


def find_enclosing(node: Any) -> tuple[Reading, float] | None:
    """The reading of the innermost running plan that walked ``node``, and the
    potential it gave it (the Python lookup; natively, nested_plan)."""
    for plan, reading in reversed(running()):
        p = plan.phi_of(node)
        if p is not None:
            return reading, p
    return None


def enclosing_phi(node: Any) -> float | None:
    """The potential a running plan gave ``node``, or None where none saw it."""
    return state.enclosing_phi(node)
