"""The three implementations a row times, one class each.

``with impl.round():`` switches one on for one round (not timed): a warm-up
forward and backward, then the timed ``impl.backward(loss)`` of a fresh
forward (gsbench/timing.py), so the timed backward is never the first of
graphscale's installation, as in a user's loop that installs once and then
steps.  Switched off between rounds: an installed graphscale patches
``torch.autograd.backward`` for every backward of the process, DeepSpeed
alone's rounds included.
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
    """One implementation; :meth:`round` switches it on for one round.  The
    base switches nothing and calls ``engine.backward(loss)``."""

    name = ""
    observed = False  # True: graphscale's observation points see its backward

    def __init__(self, wl: Workload) -> None:
        self.wl = wl

    def round(self) -> ContextManager[None]:
        """What one round (its forwards and backwards) runs inside."""
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
        handles, params = [], []
        for e in self.wl.engines:
            inv = 1.0 / e.gradient_accumulation_steps()
            for p in e.module.parameters():
                handles.append(p.register_hook(lambda g, inv=inv: g * inv))
                params.append(p)
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            # A removed handle empties the parameter's hook dict, but torch keeps the
            # C++ pre-hook that calls it on the parameter's gradient accumulator: every
            # later backward, of every implementation, would take the GIL at each
            # parameter to call an empty dict (counted: ~1,000 instructions a
            # parameter).  Setting the emptied dict to None takes that hook off.
            for p in params:
                if p._backward_hooks is not None and not p._backward_hooks:
                    p._backward_hooks = None

    def backward(self, loss: Any) -> None:
        self.wl.caller.backward(loss, scale_wrt_gas=False)


class Graphscale(Impl):
    """``graphscale.install(*engines)`` for the round; DeepSpeed's
    ``engine.backward(loss)`` as is."""

    name = "graphscale"
    observed = True

    def round(self) -> ContextManager[Any]:
        return graphscale.install(*self.wl.engines)

    @contextlib.contextmanager
    def observing(self, walk: WalkRecorder, phase: PhaseRecorder | None = None) -> Any:
        with contextlib.ExitStack() as stack:
            stack.enter_context(observe.walks(walk))
            if phase is not None:
                stack.enter_context(observe.phases(phase))
            yield


ALL: tuple[type[Impl], ...] = (DeepSpeedAlone, LeafHooks, Graphscale)
assert tuple(i.name for i in ALL) == IMPLS
