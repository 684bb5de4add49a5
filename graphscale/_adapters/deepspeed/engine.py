"""What graphscale changes on a DeepSpeed engine while it is installed, and
undoes at remove: the engine's output hooks (two data descriptors on
DeepSpeed's hook-manager class) and its ``backward``/``scale``/prologue/epilogue
(shadowed on the instance).  Part of the DeepSpeed adapter (``_adapters/deepspeed/__init__.py``);
reads ``sys.modules``, never imports deepspeed.  Beside it: the diagnosis'
watch of an engine it does not govern (``watch.py``) and what changes under
compiled autograd (``compiled.py``).
"""
from __future__ import annotations

import sys
from functools import partial
from typing import Any, Callable

import torch

from ..._backward.dynamo import eager
from ..._backward.frames import CARRIES_ATTR, adapter_calls
from ..._core.errors import GraphscaleError
from ..._core.observation import ACTIVE, laps
from .checks import check_engine
from .compiled import prologue_under_compiled_autograd, refuse_compiled_autograd
from .ending import end_when_returned, prologue_as_engine_backward, refuses_direct
from .failed import Attempt, Drains, begin, deepspeed_recovers, discard, fail_closed, reached, refuse_next
from .hooks import PROLOGUE, SHADOWED, redirect_off, redirect_on
from .hooks import attached as _attached
from .hooks import lock as _lock
from .reads import is_zero_optimizer, scale_reader, scale_source

__all__ = ["attach", "after_epilogue"]

# NOTE [ DeepSpeed's two generations ]
# DeepSpeed divides by GAS in one of two places, by version:
#   <= 0.19.5: engine.forward registers, through an OutputBackwardHookManager,
#     a hook on every output tensor that calls
#     engine._backward_prologue_per_tensor(grad) -> grad / GAS (unless the
#     last engine.backward said scale_wrt_gas=False, a flag that sticks).
#   >= 0.19.6 (PR 8245): engine.backward(loss) divides the loss by GAS and
#     registers the running graph task, so that every engine's output hook
#     skips its division; a direct loss.backward() keeps the hook division.
# For each installed engine graphscale switches off both:
#   * the output hooks: every hook manager reads its per-tensor function
#     (the engine's bound _backward_prologue_per_tensor, taken at forward) at
#     hook time from its instance attribute preprocess_per_tensor_fn.  Once an
#     engine is installed, a data descriptor of that name sits on DeepSpeed's
#     OutputBackwardHookManager class (data descriptors come before instance
#     attributes): inside a backward whose snapshot governs the engine, that engine's hook
#     reads it as None (see NOTE [ Which snapshot an output hook obeys ] in _backward/running.py), so
#     DeepSpeed's hook passes the gradient on without calling it; everywhere else it reads
#     DeepSpeed's function.  Managers made before install, while installed and after are all
#     covered, with no search of the heap (install costs the same in a process of any size); an
#     output made while installed and backpropagated after remove(), or in an ungoverned
#     torch.autograd.grad, gets DeepSpeed's own division; a backward that was governed when it
#     started stays governed if remove() runs inside it.  The descriptors come off with
#     graphscale's patch of torch.autograd.backward (hooks.py redirect_off);
#   * the loss division: engine.backward is shadowed by a function that calls
#     DeepSpeed's with scale_wrt_gas=False inside adapter_backward(...) (_backward/frames.py),
#     and returns loss / GAS (or loss) as DeepSpeed does.
# Everything else DeepSpeed does in backward (ZeRO prologue and epilogue,
# reduction hooks, timers) runs untouched, once per backward (the next NOTE).

# NOTE [ One lifecycle per backward ]
# Each engine.forward registers its own output-hook manager, and each manager
# runs the engine's backward prologue (timers, ZeRO's enter_backward, the
# queued post-backward epilogue) the first time one of its hooks fires
# (its preprocess_done flag, reset by the next forward).  So one backward over
# two forwards of one engine ran the prologue twice: ZeRO's backward depth
# ended at 2, and since PR 8245's lifecycle work the direct-backward epilogue
# refuses to run at a depth above 1 (it takes it for an interrupted
# engine.backward): the gradients were never reduced and step() raised
# (KeyError in averaged_gradients).  And a second backward over a retained
# graph ran no prologue at all.  Under graphscale each manager's
# preprocess_done reads, inside a backward that governs its engine, whether
# that engine's prologue ran in this backward (the backwards nested in it
# count as the same one: see NOTE [ Once per backward ] in _backward/running.py), so the
# engine's prologue runs once, before any of its output gradients, and its
# epilogue once at the end: the queued callback of a direct backward (at
# depth 1 now), or engine.backward's own.  Outside governed backwards the
# flag is the manager's own, as DeepSpeed keeps it.  A governed backward that
# raised after an engine's prologue left that prologue's depth behind; the
# engine's next governed prologue takes it back first (the epilogue that
# would have is what the adapter watches), so the next backward reduces, as
# it does after an interrupted engine.backward.  A reference pass (audit)
# runs no prologue at all.


def _refuse_replaced(engine: Any) -> None:
    """Raise where what an adapter shadows on the engine instance is there already."""
    if any(n in engine.__dict__ for n in (PROLOGUE, *SHADOWED)):
        raise GraphscaleError(
            "graphscale: this engine's backward, scale, _backward_prologue, _backward_epilogue or "
            "_backward_prologue_per_tensor is already replaced on the instance (by another tool?); "
            "graphscale cannot govern it safely.")


def _scale(adapter: Any, deepspeeds_scale: Callable[[Any], Any], read_scale: Callable[[], float]) -> Any:
    """The engine's ``scale`` while attached: DeepSpeed's, the loss it
    returns marked with what it carries while the adapter is active.
    (See NOTE [ fp16 engines ] in _adapters/deepspeed/__init__.py.)"""

    def scale(loss: torch.Tensor) -> Any:
        carries = read_scale()
        scaled = deepspeeds_scale(loss)
        if adapter.active and carries != 1.0 and scaled is not loss:
            setattr(scaled, CARRIES_ATTR, carries)
        return scaled

    return scale


class _EngineAdapter:
    """Switches one engine's loss division off while it is installed
    (See NOTE [ DeepSpeed's two generations ].)

    ``open``: a governed prologue of this engine ran and its epilogue has not
    yet; ``attempt``: that backward's start (an aborted backward's, see
    NOTE [ An aborted backward counts for nothing ] in _adapters/deepspeed/failed.py); ``window``: DeepSpeed's
    global step at this engine's last completed epilogue (one in this
    accumulation window while it still equals the engine's); ``dead``: why the
    engine fails closed, else None; ``ended``: graphscale discarded a failed
    backward and no governed prologue ran since."""

    dead: str | None
    attempt: Attempt | None
    drains: Drains | None  # while enabled, on a DeepSpeed without its own recovery

    def __init__(self, engine: Any, name: str) -> None:
        self.refs, self.active, self.engine, self.name = 0, False, engine, name
        cls = type(engine)
        deepspeeds_backward = cls.backward.__get__(engine, cls)
        deepspeeds_scale = cls.scale.__get__(engine, cls) if hasattr(cls, "scale") else None
        self.read_scale = read_scale = scale_reader(engine)
        self.scale_source = scale_source(engine)  # what read_scale reads (None: a scale of 1)
        sticky_flag = "_scale_wrt_gas" in engine.__dict__  # <= 0.19.5
        _refuse_replaced(engine)
        deepspeeds_epilogue = cls._backward_epilogue.__get__(engine, cls)
        self.deepspeeds_prologue = cls._backward_prologue.__get__(engine, cls)
        self.open, self.dead, self.ended, self.attempt, self.window, self.drains = False, None, False, None, -1, None
        self.touched = True  # the last discarded backward reached some of the engine's gradients
        self.refuses_direct = refuses_direct(engine)  # ZeRO 0: NOTE [ Epilogues graphscale runs ] in ending.py
        self.ends: Any = None  # set by prologue_starts for the prologue that runs next: the backward's Frame
        adapter = self

        self.after_epilogue: list[Callable[[], None]] = []  # run once, after DeepSpeed's next epilogue

        def epilogue() -> None:
            adapter.open = False
            deepspeeds_epilogue()
            adapter.window = engine.global_steps
            waiting, adapter.after_epilogue = adapter.after_epilogue, []
            for fn in waiting:
                fn()

        def backward(loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Any:
            if not adapter.active:
                return deepspeeds_backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
            # compiled_autograd_active() (_backward/gate.py), inline: a copy kept for speed, as in prologue()
            ca = sys.modules.get("torch._dynamo.compiled_autograd")
            if (getattr(engine, "_is_compiled_autograd_enabled", False) or ca is not None
                    and (ca.compiled_autograd_enabled or ca.in_compiled_autograd_region)):
                refuse_compiled_autograd(engine, "graphscale: engine.backward")
            timed = laps() if ACTIVE.phases else None
            gas_scaled = loss / engine.gradient_accumulation_steps() if scale_wrt_gas else loss
            running = getattr(engine, "_running_engine_backward", False)
            # adapter_backward(scale_wrt_gas, carries, (engine, loss)) without its with-block: this
            # runs on every engine.backward.
            frames = adapter_calls()
            frames.append((scale_wrt_gas, read_scale(), (engine, loss)))
            try:
                if timed:
                    timed("adapter")
                deepspeeds_backward(loss, retain_graph=retain_graph, scale_wrt_gas=False)
                if timed:
                    timed.skip()
            finally:
                frames.pop()
                if sticky_flag:  # <= 0.19.5 keeps the last call's flag on the engine: keep its meaning
                    engine._scale_wrt_gas = scale_wrt_gas
                    engine._running_engine_backward = running  # (left True when its backward raised)
            if timed:
                timed("adapter")
            return gas_scaled

        backward.__doc__ = deepspeeds_backward.__doc__
        self.backward, self.epilogue = backward, epilogue
        self.scale = None if deepspeeds_scale is None else _scale(self, deepspeeds_scale, read_scale)

    def prologue(self) -> None:
        """The engine's ``_backward_prologue`` while installed: DeepSpeed's,
        eagerly under compiled autograd; in a governed direct backward, as
        ``engine.backward`` would run it, its epilogue due when the backward
        returns where no callback of torch runs it.
        (See NOTE [ Under compiled autograd ] in _adapters/deepspeed/compiled.py
        and NOTE [ Epilogues graphscale runs ] in _adapters/deepspeed/ending.py.)"""
        ends, self.ends = self.ends, None  # (not None: prologue_starts ran for this prologue)
        engine = self.engine
        # compiled_autograd_active() (_backward/gate.py), inline: a copy kept for speed.  Its call is one more
        # Python call per engine and backward (benchmarks/cost.py --calls-only, issue 49: mixed-loss 42 -> 44,
        # mixed-engine 54 -> 57, one-engine 20 -> 21; the first two past the gate's margin of 3 % + 2).
        ca = sys.modules.get("torch._dynamo.compiled_autograd")
        compiled = ca is not None and (ca.compiled_autograd_enabled or ca.in_compiled_autograd_region)
        if ends is None or engine._running_engine_backward:  # ungoverned, or inside its own engine.backward
            if not compiled:
                self.deepspeeds_prologue()
            else:
                prologue_under_compiled_autograd(engine, self.deepspeeds_prologue, ends is None and self.active)
        else:  # a governed direct backward
            if compiled:
                refuse_compiled_autograd(engine, "graphscale: a direct loss.backward()")
            run = self.deepspeeds_prologue
            if self.refuses_direct:
                run = partial(prologue_as_engine_backward, engine, run)
            if compiled:
                eager(run)()
            else:
                run()
            if compiled or self.refuses_direct:
                end_when_returned(engine, ends, lambda: self.open)
        if self.open and self.drains is not None:  # a governed backward of the engine starts
            self.attempt = begin(engine, self.drains, self.window == engine.global_steps)

    def prologue_starts(self, on_failure: list[Callable[[], None]]) -> None:
        """A governed backward runs this engine's prologue now (see
        NOTE [ One lifecycle per backward ]); ``on_failure``: that backward's
        list of what completes it if it raises, which gets
        :meth:`backward_failed`.  Refused where the engine fails closed; first
        take back the ZeRO backward depth of a governed prologue whose
        backward ended without its epilogue (where :meth:`backward_failed`
        could not run it)."""
        engine = self.engine
        if self.dead is not None:
            fail_closed(engine, self.name, self.dead)()
        if self.ended:  # after graphscale discarded a failed backward
            self.ended = False
            refuse_next(engine, self.touched)
        if self.open and self.drains is not None:
            opt: Any = getattr(engine, "optimizer", None)
            if is_zero_optimizer(opt) and opt._backward_active_depth > 0:
                opt.exit_backward()
        self.open, self.attempt = True, None  # (the prologue, next, takes the attempt's snapshot)
        self.ends = on_failure
        on_failure.append(self.backward_failed)
        source = self.scale_source  # (read_scale() without its frame: None is a scale of 1)
        if source is not None and not getattr(engine, "_running_engine_backward", False) and float(source()) != 1.0:
            # A direct backward: graphscale applies the loss scale, which DeepSpeed's epilogue
            # checks was done.
            engine._manual_backward_expected = True

    def backward_failed(self) -> None:
        """The governed backward that ran this engine's prologue raised before
        its epilogue: discard its part, or make the engine fail closed.
        (See NOTE [ A backward that raised ] in _backward/frames.py.)"""
        if not self.open or self.drains is None:  # (the epilogue ran; or DeepSpeed recovers by itself)
            self.open = False
            return
        self.open, self.ended, attempt, self.attempt = False, True, self.attempt, None
        self.touched = reached(getattr(self.engine, "optimizer", None), attempt)
        try:
            why = discard(self.engine, attempt, self.drains)
        except Exception as err:  # becomes a note on the user's error (_backward/frames.py)
            self.die(f"discarding it raised {type(err).__name__}: {err}")
            raise
        if why is not None:
            self.die(why)

    def die(self, why: str) -> None:
        """Fail closed: the engine's forward and step() raise, as its next governed backward does."""
        self.dead = why
        self.engine.forward = self.engine.step = fail_closed(self.engine, self.name, why)

    def enable(self) -> None:
        if self.drains is None and not deepspeed_recovers(getattr(self.engine, "optimizer", None)):
            self.drains = Drains(self.engine.optimizer)
        self.engine.backward = self.backward
        self.engine._backward_epilogue = self.epilogue
        self.engine._backward_prologue = self.prologue
        if self.scale is not None:
            self.engine.scale = self.scale
        self.active = True

    def disable(self) -> None:
        self.active = False
        if self.drains is not None:
            self.drains.undo()
            self.drains = None
        for name in SHADOWED:
            self.engine.__dict__.pop(name, None)


def after_epilogue(engine: Any, fn: Callable[[], None]) -> bool:
    """Run ``fn`` once, right after ``engine``'s next backward epilogue (where
    DeepSpeed reduces at an accumulation boundary); False when the engine is
    not attached (nothing is scheduled)."""
    adapter = _attached.get(id(engine))
    if adapter is None:
        return False
    adapter.after_epilogue.append(fn)
    return True


def attach(engine: Any, name: str) -> Callable[[], None]:
    """Govern ``engine`` (its group's ``name``); return a function that undoes this once."""
    with _lock:
        adapter = _attached.get(id(engine))
        if adapter is None:
            check_engine(engine, scale_reader)  # NOTE [ DeepSpeed drift ]: before anything is touched
            redirect_on()
            adapter = _EngineAdapter(engine, name)
            _attached[id(engine)] = adapter
            adapter.enable()
        adapter.refs += 1
    done = False

    def detach() -> None:
        nonlocal done
        with _lock:
            if done:
                return
            done = True
            adapter.refs -= 1
            if adapter.refs == 0:
                adapter.disable()
                del _attached[id(engine)]
                redirect_off()

    return detach
