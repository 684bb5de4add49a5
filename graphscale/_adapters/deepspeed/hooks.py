"""DeepSpeed's output hooks under graphscale: two data descriptors on
DeepSpeed's ``OutputBackwardHookManager``, and the table of attached engines
they consult.  Part of the DeepSpeed adapter; reads ``sys.modules``, never
imports deepspeed.
"""
from __future__ import annotations

import sys
import threading
from typing import Any

import torch

from ..._backward.running import bindings
from ..._core.errors import GraphscaleError
from ..._entry.entry import patched, when_unpatched
from .reads import engine_type, found

__all__ = ["attached", "is_output_hooked", "redirect_on", "redirect_off", "PROLOGUE", "SHADOWED"]

lock = threading.Lock()  # attach, detach, observe, and the descriptors' lifetime (redirect_off)
attached: dict[int, Any] = {}  # id(engine) -> its engine.py _EngineAdapter, while installed
observed: set[int] = set()  # id(engine) of the engines graphscale.diagnose watches now (watch.py observe)
# what an adapter puts on its engine instance
SHADOWED = ("backward", "scale", "_backward_epilogue", "_backward_prologue")


# ---------------------------------------------------------------- the output-hook redirect
_FN = "preprocess_per_tensor_fn"
PROLOGUE = "_backward_prologue_per_tensor"


def is_output_hooked(tensor: torch.Tensor) -> bool:
    """Whether one of DeepSpeed's output hooks sits on ``tensor`` itself."""
    hooks = tensor._backward_hooks
    return hooks is not None and any(getattr(h, "__qualname__", "").startswith("OutputBackwardHookManager.")
                                     for h in hooks.values())


_NOW = "_graphscale_now"  # on a manager: what _governing found for the graph task that runs it now
_task_id = torch._C._current_graph_task_id


def _governing(d: dict[str, Any], tid: int) -> tuple[int, Any, Any, bool, Any, bool]:
    """What both descriptors ask, every time an output hook of the manager
    of instance dict ``d`` fires in graph task ``tid``: (the graph task, the
    manager's engine or None, the task's binding if it governs that engine
    or is a reference pass, else None; whether it is a reference pass, the
    binding's ``once`` set, whether the snapshot it obeys governs the
    engine).  Found once per manager and graph task (torch never reuses a
    task's id) and kept on the manager under ``_NOW``, which the descriptors
    read first: an engine's outputs fire its hooks several times a backward,
    each reading two or three attributes; a task binds before any of them
    fires.  The manager's engine: its per-tensor function is the engine's
    bound ``_backward_prologue_per_tensor``.
    (See NOTE [ Which snapshot an output hook obeys ] in _backward/running.py.)"""
    fn = d.get(_FN)
    engine = getattr(fn, "__self__", None)
    if not (getattr(fn, "__name__", None) == PROLOGUE and isinstance(engine, found.engine or engine_type())):
        engine = None
    # the task's binding
    binding = None if engine is None or not bindings else bindings.get(tid)
    reference, once, governed = False, None, False
    if binding is not None:
        reference, governed = binding.reference, id(engine) in binding.reading.state.hook_owners
        if reference or governed:
            once = binding.once
        else:
            binding = None
    now = (tid, engine, binding, reference, once, governed)
    if tid >= 0:
        d[_NOW] = now
    return now


class _PerTensorRedirect:
    """A data descriptor on OutputBackwardHookManager's per-tensor function:
    inside a backward that governs an engine, that engine's managers read it
    as None (DeepSpeed's hook then passes the gradient on without calling it:
    graphscale places the factor at the engine's leaves); anything else reads
    as it was set.  (See NOTE [ DeepSpeed's two generations ] in engine.py.)"""

    def __get__(self, manager: Any, owner: type | None = None) -> Any:
        if manager is None:
            return self
        d = manager.__dict__
        now, tid = d.get(_NOW), _task_id()
        if now is None or now[0] != tid:
            now = _governing(d, tid)
        return None if now[5] else d.get(_FN)

    def __set__(self, manager: Any, value: Any) -> None:
        d = manager.__dict__
        d[_FN] = value
        d.pop(_NOW, None)  # another function: another engine, perhaps


_DONE = "preprocess_done"


class _PrologueOncePerBackward:
    """A data descriptor on OutputBackwardHookManager's ``preprocess_done``
    (see NOTE [ One lifecycle per backward ] in engine.py): inside a backward that
    governs the manager's engine, whether that engine's prologue ran in this
    backward (always, in a reference pass); elsewhere the manager's own flag."""

    def __get__(self, manager: Any, owner: type | None = None) -> Any:
        if manager is None:
            return self
        d = manager.__dict__
        now, tid = d.get(_NOW), _task_id()
        if now is None or now[0] != tid:
            now = _governing(d, tid)
        if now[2] is None:
            return d.get(_DONE, False)
        return now[3] or id(now[1]) in now[4]

    def __set__(self, manager: Any, value: Any) -> None:
        d = manager.__dict__
        d[_DONE] = value
        if not value:
            return
        now, tid = d.get(_NOW), _task_id()
        if now is None or now[0] != tid:
            now = _governing(d, tid)
        _, engine, binding, reference, once, _ = now
        if binding is None or reference or id(engine) in once:
            return
        once.add(id(engine))  # the manager runs the engine's prologue next
        adapter = attached.get(id(engine))
        if adapter is not None:
            adapter.prologue_starts(binding.on_failure)


_REDIRECT = _PerTensorRedirect()
_ONCE = _PrologueOncePerBackward()
_DESCRIPTORS = {_FN: _REDIRECT, _DONE: _ONCE}


def _manager_class() -> Any:
    return getattr(sys.modules.get("deepspeed.runtime.utils"), "OutputBackwardHookManager", None)


def redirect_off() -> None:
    """Under :data:`lock`: take the descriptors off DeepSpeed's hook-manager
    class again once nothing needs them (no engine attached or observed,
    ``torch.autograd.backward`` not patched: no governed backward runs; the
    patch calls this as it comes off).
    Managers then read their own attributes (the descriptors stored every
    value there), as in a process where graphscale never was."""
    cls = _manager_class()
    if cls is None or attached or observed or patched():
        return
    for name, descriptor in _DESCRIPTORS.items():
        if cls.__dict__.get(name) is descriptor:
            delattr(cls, name)


def _unpatched() -> None:
    # Under the patch's lock: never wait for this module's (an attach holding it may run a check's
    # backward, which takes the patch's lock).  Whoever holds it attaches (the descriptors are
    # wanted) or detaches (and takes them off itself unless it saw the patch still on: then they
    # stay until the next removal, handing DeepSpeed's own values through, as before d6e51bd).
    if lock.acquire(blocking=False):
        try:
            redirect_off()
        finally:
            lock.release()


def redirect_on() -> None:
    """Put the redirect and the prologue's once-per-backward flag on
    DeepSpeed's hook-manager class (idempotent).  They stay while an engine
    is attached or observed and while ``torch.autograd.backward`` is patched
    (a backward running when the last engine is removed still needs them;
    for engines no backward governs they hand DeepSpeed's own values
    through), and come off with the patch (:func:`redirect_off`)."""
    cls = _manager_class()
    if cls is None:
        raise GraphscaleError(
            "graphscale: this DeepSpeed has no deepspeed.runtime.utils.OutputBackwardHookManager, through which "
            "graphscale switches the engines' own GAS division off; graphscale knows DeepSpeed 0.19.x. "
            "No engine was installed."
        )
    for name, descriptor in _DESCRIPTORS.items():
        present = cls.__dict__.get(name)
        if present is not None and present is not descriptor:
            raise GraphscaleError(
                f"graphscale: DeepSpeed's {cls.__name__}.{name} is already defined on the class (by another tool, "
                "or a DeepSpeed version graphscale does not know); graphscale cannot govern engines safely here. "
                "No engine was installed."
            )
    for name, descriptor in _DESCRIPTORS.items():
        setattr(cls, name, descriptor)


when_unpatched(_unpatched)  # (at import, not in attach(): the patch's lock is taken before this module's lock)
