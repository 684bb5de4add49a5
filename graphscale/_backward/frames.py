"""What a backward on this thread runs inside: the frames of an adapter's
own backward call (:func:`adapter_backward`: whether factors apply, what the
seeds carry already, the caller; DeepSpeed's ``engine.backward`` is one), and
the :class:`Frame` of each top-level governed backward, with the list of what
completes its engines' part if it raises.  Imports nothing of graphscale.

"""
from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import Any, Callable

__all__ = ["CARRIES_ATTR", "Frame", "innermost", "adapter_backward", "adapter_calls",
           "adapter_backward_frame", "adapter_backward_caller", "scaling_enabled"]

# NOTE [ A backward that raised ]
# torch runs no queued callback of a graph task that raised, and leaves in
# .grad what the backward had accumulated before the error (the gradients of
# the leaves it reached).  An adapter whose once-per-backward work began in
# that backward (DeepSpeed's prologue) may hold state that only its end
# completes: ZeRO's reduction bucket holds the gradients reached so far and
# its backward depth is raised; the engine's next backward then meets the
# stale bucket (ZeRO 2: "has already been reduced"; ZeRO 3: a duplicate
# ds_id assertion) or reduces nothing (KeyError in step()).  So each
# top-level governed backward carries a list (its ``Frame``, itself a list), every
# binding in it shares that list (``Binding.on_failure`` in running.py, as it
# shares ``once``), an adapter appends what ends its engine's part when that
# part begins, and if the backward raises, everything appended runs, in
# order, before the error goes on to the caller: the DeepSpeed adapter
# discards the aborted attempt, or makes the engine fail closed where the
# attempt already changed its accumulation window; plain groups keep what
# torch left in .grad, as plain PyTorch does.  What runs there should
# not raise; if it does, its error is added to the original's notes and the
# rest still run.  A binding made outside any top-level governed backward (a
# reference pass) gets a list nobody runs.
# (The DeepSpeed side: see NOTE [ An aborted backward counts for nothing ] in _adapters/deepspeed/failed.py.)
# The same list carries what completes an engine's part when the backward
# returns (``Frame.at_end``, the frame being that list): the epilogue that DeepSpeed would run from a
# callback torch does not run there (ZeRO 0 queues none; compiled autograd
# runs none), run by the governed backward itself as it returns, in order,
# on the caller's thread (see NOTE [ Epilogues graphscale runs ] in
# _adapters/deepspeed/ending.py).

# A tensor that carries a factor already (an fp16 engine's ``engine.scale(loss)``)
# has it in this attribute; a backward from it strips it (NOTE [ fp16 engines ]
# in _adapters/deepspeed/__init__.py).
CARRIES_ATTR = "_graphscale_carries"


class _Local(threading.local):
    def __init__(self) -> None:
        self.adapter_calls: list[tuple[bool, float, Any]] = []  # adapter_backward frames, innermost last
        self.failing: list[Frame] = []  # one per top-level governed backward, innermost last


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


def adapter_backward(scaling: bool, carries: float = 1.0, caller: Any = None) -> AbstractContextManager[None]:
    """Within this block (an adapter's own backward call), top-level governed
    backwards on this thread apply the factors only if ``scaling``, and their
    seeds already carry ``carries``; ``caller``: (the object whose backward
    this is, the loss it was given), for tools.  The DeepSpeed adapter opens
    one in ``engine.backward``: ``scaling`` is its ``scale_wrt_gas``,
    ``carries`` an fp16 engine's loss scale (NOTE [ fp16 engines ] in
    _adapters/deepspeed/__init__.py)."""
    return _Pushed(_local.adapter_calls, (scaling, carries, caller))


def adapter_calls() -> list[tuple[bool, float, Any]]:
    """This thread's :func:`adapter_backward` frames, innermost last: an
    adapter that opens one on every backward may append its (scaling,
    carries, caller) and pop it in its own ``finally`` instead of a ``with``
    (three Python calls fewer; the DeepSpeed adapter's ``engine.backward``)."""
    return _local.adapter_calls


def adapter_backward_frame() -> tuple[bool, float]:
    """(scaling, carries) of the innermost :func:`adapter_backward` on this thread, or (True, 1.0)."""
    stack = _local.adapter_calls
    return stack[-1][:2] if stack else (True, 1.0)


def adapter_backward_caller() -> Any:
    """(caller, loss) of the innermost :func:`adapter_backward` on this thread, or None."""
    stack = _local.adapter_calls
    return stack[-1][2] if stack else None


def scaling_enabled() -> bool:
    """``scaling`` of the innermost :func:`adapter_backward` on this thread (True outside one)."""
    stack = _local.adapter_calls
    return stack[-1][0] if stack else True


class Frame(list):  # type: ignore[type-arg]
    """One top-level governed backward as its caller frames it: ``scaling``
    (False inside an :func:`adapter_backward` that turned the factors off),
    what its seeds carry already by default (``carries``), both read from the
    innermost :func:`adapter_backward`; its lap clock (``laps``, or None).
    The frame is itself the list run if it raises (the bindings'
    ``on_failure``, see NOTE [ A backward that raised ]; one object per
    backward), and
    ``at_end`` what runs when it returns (:meth:`when_returned`).
    (Whether compiled autograd captures it is the gate's question:
    ``gate.py``.)

    Made on the thread that runs the backward, once per backward, and on
    that thread's stack (:func:`innermost`) from then until :meth:`close`,
    which the governed backward calls once it ends (or, where it ended
    without an error, pops ``stack`` itself and runs :meth:`finish` if
    ``at_end`` holds anything); with the error if it raised, and then
    everything appended to the frame runs, in order, before the error goes
    on.  (Not a context manager: a ``with`` costs two more Python calls on
    every backward, and the one caller, entry.govern, has its ``try``
    anyway.)"""

    __slots__ = ("scaling", "carries", "laps", "stack", "at_end")

    def __init__(self, laps: Any = None) -> None:  # (list's own __init__ not called: the list is empty)
        stack = _local.adapter_calls
        self.scaling, self.carries = stack[-1][:2] if stack else (True, 1.0)
        self.laps = laps
        self.at_end: list[Callable[[], None]] | None = None
        self.stack = _local.failing  # this thread's: the backward ends by popping it (close)
        self.stack.append(self)

    def when_returned(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when this backward returns without an error."""
        if self.at_end is None:
            self.at_end = []
        self.at_end.append(fn)

    def close(self, exc: BaseException | None = None) -> None:
        """The backward ended (``exc``: with that error): off this thread's
        stack; then, on an error, what was appended to the frame run, else
        :meth:`finish`."""
        self.stack.pop()
        if exc is None:
            self.finish()
            return
        todo, self.at_end = list(self), None
        self.clear()
        for fn in todo:
            try:
                fn()
            except Exception as err:  # the original error is the one to see; this one goes with it
                exc.add_note(f"graphscale: after this error, completing an engine's backward raised too: "
                             f"{type(err).__name__}: {err}")

    def finish(self) -> None:
        """Run ``at_end`` (the backward returned), in order; each runs even
        if one before it raised, and the first error is raised after."""
        at_end, self.at_end = self.at_end or [], None
        first: BaseException | None = None
        for fn in at_end:
            try:
                fn()
            except BaseException as err:
                first = first or err
        if first is not None:
            raise first


def innermost() -> list[Callable[[], None]]:
    """The ``on_failure`` list (the :class:`Frame`) of the innermost top-level
    governed backward running on this thread, or a new list nobody runs."""
    return _local.failing[-1] if _local.failing else []
