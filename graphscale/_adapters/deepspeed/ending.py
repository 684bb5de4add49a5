"""What graphscale runs of ``engine.backward`` for an engine that a governed
direct backward reaches where DeepSpeed alone would not finish it: ZeRO 0's
prologue (DeepSpeed refuses it outside ``engine.backward``) and the epilogue
that no callback of torch runs (ZeRO 0 queues none; compiled autograd runs
none).  Part of the DeepSpeed adapter; never imports deepspeed.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ... import _native

__all__ = ["refuses_direct", "prologue_as_engine_backward", "end_when_returned"]

# NOTE [ Epilogues graphscale runs ]
# engine.backward(loss) runs the engine's prologue (from its output hooks),
# loss.backward(), then its epilogue: the data-parallel reduction at the
# accumulation boundary, the optimizer's backward epilogue.  A direct
# backward (loss.backward(), or another engine's engine.backward over a
# shared loss) gets the epilogue from a callback ZeRO queues on the graph
# task; at ZeRO 0 DeepSpeed queues none and refuses the direct backward
# outright, and under compiled autograd torch runs no queued callback, so the
# engine was never reduced (step(): KeyError: 0).  graphscale governs the
# whole backward, so for every engine it governs there it does what
# engine.backward would: at ZeRO 0 it runs DeepSpeed's prologue as inside
# engine.backward (the engine's running-backward mark held around it,
# prologue_as_engine_backward), and it runs the engine's post-backward hook
# (its scaler check, then the epilogue) when the governed backward returns,
# on the caller's thread, after torch's own callbacks (end_when_returned,
# through Frame.at_end in _backward/frames.py): once, unless DeepSpeed's
# own callback ran it first.  That is where engine.backward runs it too:
# after loss.backward() returns, so a reentrant checkpoint's nested backward
# cannot end it early.  A backward that raises runs on_failure instead (NOTE
# [ An aborted backward counts for nothing ] in failed.py).  An engine that
# no backward governs keeps DeepSpeed's own refusal.


def refuses_direct(engine: Any) -> bool:
    """Whether DeepSpeed refuses a direct backward of ``engine`` (ZeRO 0, or a
    torch without the internal APIs ZeRO counts hooks with)."""
    return not getattr(engine, "_support_torch_style_backward", True)


def prologue_as_engine_backward(engine: Any, deepspeeds_prologue: Callable[[], None]) -> None:
    """DeepSpeed's prologue of ``engine`` as ``engine.backward`` runs it: with
    the engine's running-backward mark (and count, where DeepSpeed keeps one)
    held around it, put back as it was after."""
    lock = getattr(engine, "_running_engine_backward_lock", None)
    if lock is None:  # <= 0.19.5: a plain flag
        was = engine._running_engine_backward
        engine._running_engine_backward = True
        try:
            deepspeeds_prologue()
        finally:
            engine._running_engine_backward = was
        return
    with lock:
        engine._running_engine_backward_count += 1
        engine._running_engine_backward = True
    try:
        deepspeeds_prologue()
    finally:
        with lock:
            engine._running_engine_backward_count -= 1
            engine._running_engine_backward = engine._running_engine_backward_count > 0


def leaving_no_functorch_state(run: Callable[[], None]) -> None:
    """``run()``, a DeepSpeed call that asks functorch whether a transform
    runs, on the caller's thread outside any backward; functorch's
    thread-local state, where that asking created it, dropped again after
    (NOTE [ No functorch state left behind ] in checks.py).  Where the
    native module is not loaded, the state stays (the Python route cannot
    drop it)."""
    native = _native.loaded()
    had = native is None or native.functorch_state()
    try:
        run()
    finally:
        if not had:
            native.drop_functorch_state()


def end_when_returned(engine: Any, ends: Any, due: Callable[[], bool]) -> None:
    """Run ``engine``'s post-backward hook (its epilogue) when the governed
    backward whose ``Frame`` (its on_failure list) is ``ends`` returns, if ``due()`` still says
    its epilogue has not run; outside a top-level governed backward (``ends``
    a plain list), when the running graph task ends, as ZeRO's callback."""

    def end() -> None:
        if due():
            leaving_no_functorch_state(engine._backward_post_hook)

    if hasattr(ends, "when_returned"):
        ends.when_returned(end)
    else:
        torch.autograd.Variable._execution_engine.queue_callback(end)
