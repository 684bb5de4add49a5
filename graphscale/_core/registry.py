"""The adapter registry: how the core asks about objects it does not know.

What a training framework changes about a backward (DeepSpeed divides by GAS
at its output hooks; FSDP2's backward reaches unsharded parameters in place
of a module's own) is known to one adapter each, a subclass of
:class:`Adapter` that :func:`register` s at import; the core asks the fan-out
functions below, never an adapter module.  Imports nothing of graphscale.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "Adapter", "register", "registered", "group_type", "attach", "observe", "backward_leaves", "hook_owner",
    "output_hooked", "audit_refusal", "audit_replay", "audit_scale", "audit_window", "environment",
]

# NOTE [ Asking adapters ]
# The registry is a tuple replaced whole at register() (import time) and read
# without a lock.  Questions asked once per install or per snapshot
# (group_type, attach, backward_leaves, hook_owner, audit_*) fan out to every
# adapter; the one asked inside a backward (output_hooked, per root tensor
# that carries hooks) does too, and each adapter answers it from the tensor
# alone.  The first adapter with an answer wins; adapters do not overlap
# (each recognises its own framework's types).

Leaf = Any  # a torch.Tensor; this module imports nothing (not even torch)


class Adapter:
    """What one framework changes about a backward.  Override what applies;
    the defaults say "not mine / nothing to do".  ``group`` arguments are
    ``graphscale.Group`` objects (possibly of the adapter's own subclass)."""

    name = "adapter"

    def group_type(self, obj: Any) -> type | None:
        """The Group subclass ``Group(obj)`` / ``install(obj)`` makes for
        ``obj`` (e.g. a DeepSpeed engine's), or None: not this adapter's."""
        return None

    def attach(self, group: Any) -> Callable[[], None] | None:
        """Govern ``group``'s framework object at install, before anything
        else is touched (may raise to refuse it); return the function that
        undoes this once, or None: nothing to attach."""
        return None

    def observe(self, group: Any) -> Callable[[], None] | None:
        """Watch ``group``'s framework object without governing it
        (``graphscale.diagnose``: the framework's own scaling must apply);
        return the function that undoes this once, or None: nothing to do."""
        return None

    def backward_leaves(self, group: Any, owns: Callable[[Leaf], bool]) -> tuple[
            list[tuple[Leaf, str]], list[Callable[[], bool]]]:
        """Leaves a backward through ``group``'s model reaches in place of the
        group's own parameters (``owns(p)``: the group owns ``p`` in this
        snapshot), with their names; and, for each such leaf not made yet, a
        function telling whether it exists now (the snapshot is rebuilt once
        one does)."""
        return [], []

    def hook_owner(self, group: Any) -> Any:
        """The object whose output hooks run inside a backward through
        ``group`` and must obey the backward's snapshot, or None.
        (See NOTE [ Which snapshot an output hook obeys ] in _backward/running.py.)"""
        return None

    def output_hooked(self, tensor: Leaf) -> bool:
        """Whether one of this framework's output hooks sits on ``tensor`` itself."""
        return False

    def environment(self) -> list[tuple[str, str, bool]]:
        """Rows for ``python -m graphscale env``: (what, value, usable), e.g.
        the framework's version and whether graphscale's checks of it pass."""
        return []

    def audit_refusal(self, group: Any) -> str | None:
        """Why ``graphscale.audit`` cannot check ``group``'s gradients (a
        sentence naming the group and the way out), or None."""
        return None

    def audit_replay(self, group: Any) -> str | None:
        """Why the audit's plain reference for ``group`` cannot be a second
        pass over the backward's own graph, so that it must come from the
        micro-step's forward called once more: a sentence naming the group;
        or None.  (See NOTE [ Audit by replay ] in _tools/replay.py.)"""
        return None

    def audit_scale(self, group: Any) -> float:
        """What the framework's backward multiplies ``group``'s gradients by
        besides the group's factor (an fp16 loss scale), read now."""
        return 1.0

    def audit_window(self, group: Any) -> Any:
        """How the framework accumulates ``group``'s gradients over a window
        of backwards and reduces them across ranks at its end, for the
        audit's reduced-gradient check: an object with ``steps()`` (a count that grows
        at every optimizer step), ``starts()`` (no gradient is accumulated
        now), ``boundary()`` (the next backward ends a window),
        ``after_reduction(fn)`` (run ``fn`` once the framework has reduced;
        False if it cannot), ``reduced(p)`` (the reduced gradient of ``p``)
        and ``average(t)`` (``t`` averaged over the ranks that reduce, in
        place, a collective); or None: nothing is reduced.
        (See NOTE [ Audit at the boundary ] in _tools/audit_windows.py.)"""
        return None


_lock = threading.Lock()
_adapters: tuple[Adapter, ...] = ()


def register(adapter: Adapter) -> Adapter:
    """Add ``adapter`` to the registry (once; registering it again does nothing); returns it.

    A third adapter is one new file in ``graphscale/_adapters/`` with one
    ``register(...)`` call, and one import line in ``graphscale/__init__.py``
    (which imports the adapters)."""
    global _adapters
    with _lock:
        if adapter not in _adapters:
            _adapters = (*_adapters, adapter)
    return adapter


def registered() -> tuple[Adapter, ...]:
    """The registered adapters, in registration order."""
    return _adapters


def _first(ask: Callable[[Adapter], Any]) -> Any:
    """The first adapter's answer to ``ask`` that is not None, in registration order, or None."""
    for a in _adapters:
        answer = ask(a)
        if answer is not None:
            return answer
    return None


def group_type(obj: Any) -> type | None:
    """The Group subclass an adapter makes for ``obj``, or None."""
    return _first(lambda a: a.group_type(obj))


def _each_undoable(ask: Callable[[Adapter], Callable[[], None] | None]) -> list[Callable[[], None]]:
    """``ask(adapter)`` for every adapter; the undo functions it returned, in
    order.  If one raises, the ones already done are undone first."""
    done: list[Callable[[], None]] = []
    try:
        for a in _adapters:
            undo = ask(a)
            if undo is not None:
                done.append(undo)
    except BaseException:
        for undo in reversed(done):
            undo()
        raise
    return done


def attach(group: Any) -> list[Callable[[], None]]:
    """Every adapter's attach of ``group``; the detachers, in order (the ones
    attached are detached first if one raises)."""
    return _each_undoable(lambda a: a.attach(group))


def observe(group: Any) -> list[Callable[[], None]]:
    """Every adapter's observe of ``group``; the undo functions, in order
    (the ones done are undone first if one raises)."""
    return _each_undoable(lambda a: a.observe(group))


def backward_leaves(groups: Iterable[Any], owns: Callable[[Any, Leaf], bool]) -> tuple[
        list[tuple[Any, Leaf, str]], list[Callable[[], bool]]]:
    """(group, leaf, name) for every leaf adapters add, and the checks of the ones pending."""
    leaves: list[tuple[Any, Leaf, str]] = []
    pending: list[Callable[[], bool]] = []
    for a in _adapters:
        for g in groups:
            found, waiting = a.backward_leaves(g, _owned_by(owns, g))
            leaves += [(g, leaf, name) for leaf, name in found]
            pending += waiting
    return leaves, pending


def _owned_by(owns: Callable[[Any, Leaf], bool], group: Any) -> Callable[[Leaf], bool]:
    return lambda p: owns(group, p)


def hook_owner(group: Any) -> Any:
    """The object whose output hooks obey a backward through ``group``, or None."""
    return _first(lambda a: a.hook_owner(group))


def output_hooked(tensor: Leaf) -> bool:
    """Whether any adapter's framework has an output hook on ``tensor`` itself."""
    return any(a.output_hooked(tensor) for a in _adapters)


def audit_refusal(group: Any) -> str | None:
    """The first adapter's reason the audit cannot check ``group``, or None."""
    return _first(lambda a: a.audit_refusal(group))


def audit_replay(group: Any) -> str | None:
    """The first adapter's reason ``group``'s reference must be replayed, or None."""
    return _first(lambda a: a.audit_replay(group))


def audit_window(group: Any) -> Any:
    """The first adapter's window object for ``group`` (see :meth:`Adapter.audit_window`), or None."""
    return _first(lambda a: a.audit_window(group))


def audit_scale(group: Any) -> float:
    """The product of what adapters' backwards multiply ``group``'s gradients by."""
    scale = 1.0
    for a in _adapters:
        scale *= a.audit_scale(group)
    return scale


def environment() -> list[tuple[str, str, bool]]:
    """Every adapter's rows for ``python -m graphscale env``, in registration order."""
    return [row for adapter in _adapters for row in adapter.environment()]
