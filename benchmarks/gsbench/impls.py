"""The three implementations a row times, one class each.

``with Impl(workload) as impl:`` switches one on for one run (before the
forward, not timed), ``impl.backward(loss)`` is the timed backward, and the
block's end switches it off again.
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
    """One implementation, switched on for one run and off again; the base
    switches nothing and calls ``engine.backward(loss)``."""

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
    off (``engine.backward(loss, scale_wrt_gas=False)``)."""

    name = "leaf-hooks"

    def install(self) -> None:
        self._handles = []
        for e in self.wl.engines:
            inv = 1.0 / e.gradient_accumulation_steps()
            for p in e.module.parameters():
                self._handles.append(p.register_hook(lambda g, inv=inv: g * inv))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def backward(self, loss: Any) -> None:
        self.wl.caller.backward(loss, scale_wrt_gas=False)


class Graphscale(Impl):
    """``graphscale.install(*engines)``; DeepSpeed's ``engine.backward(loss)`` as is."""

    name = "graphscale"
    observed = True

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
