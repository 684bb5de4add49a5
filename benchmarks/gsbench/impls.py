"""The three implementations a row times, one class each.

As a training loop runs them: ``with Impl(workload) as impl:`` switches one
on for a whole row (before any forward, not timed), then every round's
``with impl.round():`` wraps one forward and the timed
``impl.backward(loss)``.  graphscale is installed once per row, on engines
of its own (an identical copy, ``Workload.twin``), so every timed backward is
a warm one of the same snapshot, as in a user's loop, while DeepSpeed alone
and the per-leaf hooks run on the row's engines between its rounds.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import graphscale
from graphscale import observe

from .spec import IMPLS
from .workloads import Workload

WalkRecorder = Callable[[int, float, int], None]
PhaseRecorder = Callable[[str, float], None]


class Impl:
    """One implementation, switched on for a row (``with``) and off again;
    :meth:`round` wraps each round.  The base switches nothing and calls
    ``engine.backward(loss)``."""

    name = ""
    observed = False  # True: graphscale's observation points see its backward

    def __init__(self, wl: Workload) -> None:
        self.wl = wl

    def __enter__(self) -> Impl:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def install(self) -> None:
        pass

    def remove(self) -> None:
        pass

    def round(self) -> ContextManager[None]:
        """What one round (a forward and its backward) runs inside."""
        return contextlib.nullcontext()

    def backward(self, loss: Any) -> None:
        self.wl.caller.backward(loss)

    def observing(self, walk: WalkRecorder, phase: PhaseRecorder | None = None) -> ContextManager[None]:
        """graphscale's walk (and phase) recorder for the duration, where it has any."""
        return contextlib.nullcontext()


class DeepSpeedAlone(Impl):
    """DeepSpeed alone: ``engine.backward(loss)`` divides the loss by the
    calling engine's GAS (fast, and wrong wherever two engines meet)."""

    name = "deepspeed"


class LeafHooks(Impl):
    """The obvious hand fix: a tensor hook on every parameter that multiplies
    its gradient by its engine's 1/GAS, with DeepSpeed's own division switched
    off (``engine.backward(loss, scale_wrt_gas=False)``).  The hooks are on
    the row's engines during its own rounds only (registered before the
    forward, not timed)."""

    name = "leaf-hooks"

    @contextlib.contextmanager
    def round(self) -> Any:
        handles = []
        for e in self.wl.engines:
            inv = 1.0 / e.gradient_accumulation_steps()
            for p in e.module.parameters():
                handles.append(p.register_hook(lambda g, inv=inv: g * inv))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def backward(self, loss: Any) -> None:
        self.wl.caller.backward(loss, scale_wrt_gas=False)


class Graphscale(Impl):
    """``graphscale.install(*engines)`` once, on the workload's twin (engines
    of its own), for every round; DeepSpeed's ``engine.backward(loss)`` as is."""

    name = "graphscale"
    observed = True

    def __init__(self, wl: Workload) -> None:
        super().__init__(wl.twin if wl.twin is not None else wl)

    def install(self) -> None:
        self._installation = graphscale.install(*self.wl.engines)

    def remove(self) -> None:
        self._installation.remove()

    @contextlib.contextmanager
    def observing(self, walk: WalkRecorder, phase: PhaseRecorder | None = None) -> Any:
        with contextlib.ExitStack() as stack:
            stack.enter_context(observe.walks(walk))
            if phase is not None:
                stack.enter_context(observe.phases(phase))
            yield


ALL: tuple[type[Impl], ...] = (DeepSpeedAlone, LeafHooks, Graphscale)
assert tuple(i.name for i in ALL) == IMPLS
