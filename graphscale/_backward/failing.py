"""What runs when a top-level governed backward raises: the list each such
backward carries (:class:`failing`), which the bindings of its graph tasks
share (:func:`innermost`; ``Binding.on_failure`` in _backward/running.py).  Imports
nothing of graphscale.

# NOTE [ A backward that raised ]
# torch runs no queued callback of a graph task that raised, and leaves in
# .grad what the backward had accumulated before the error (the gradients of
# the leaves it reached).  An adapter whose once-per-backward work began in
# that backward (DeepSpeed's prologue) may hold state that only its end
# completes: ZeRO's reduction bucket holds the gradients reached so far and
# its backward depth is raised; the engine's next backward then meets the
# stale bucket (ZeRO 2: "has already been reduced"; ZeRO 3: a duplicate
# ds_id assertion) or reduces nothing (KeyError in step()).  So each
# top-level governed backward carries a list (``failing``), every binding in
# it shares that list (``Binding.on_failure``, as it shares ``once``), an
# adapter appends what completes its engine's part when that part begins,
# and if the backward raises, everything appended runs, in order, before the
# error goes on to the caller: the engine ends the backward with the
# gradients torch left, as plain PyTorch keeps them.  What runs there should
# not raise; if it does, its error is added to the original's notes and the
# rest still run.  A binding made outside any top-level governed backward
# (a reference pass) gets a list nobody runs.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

__all__ = ["failing", "innermost"]


class _Local(threading.local):
    def __init__(self) -> None:
        self.lists: list[list[Callable[[], None]]] = []  # one per top-level governed backward here, innermost last


_local = _Local()


def innermost() -> list[Callable[[], None]]:
    """The list of the innermost top-level governed backward running on this
    thread, or a new one nobody runs."""
    return _local.lists[-1] if _local.lists else []


class failing:
    """The list of NOTE [ A backward that raised ] for one top-level governed
    backward on this thread: ``with failing():`` around it; on an exception,
    runs what was appended, then lets the exception go on."""

    __slots__ = ("todo",)

    def __init__(self) -> None:
        self.todo: list[Callable[[], None]] = []

    def __enter__(self) -> None:
        _local.lists.append(self.todo)

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        _local.lists.pop()
        if exc is None or not self.todo:
            return
        todo, self.todo = self.todo, []
        for fn in todo:
            try:
                fn()
            except Exception as err:  # the original error is the one to see; this one goes with it
                if isinstance(exc, BaseException):
                    exc.add_note(f"graphscale: after this error, completing an engine's backward raised too: "
                                 f"{type(err).__name__}: {err}")
