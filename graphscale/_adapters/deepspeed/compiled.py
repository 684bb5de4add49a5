"""The refusal of what DeepSpeed alone fails at under compiled autograd
(NOTE [ Under compiled autograd ] in _adapters/deepspeed/engine.py), before
the engine's part of a backward runs.  Part of the DeepSpeed adapter; never
imports deepspeed."""
from __future__ import annotations

from typing import Any

from ..._backward.frames import compiled_autograd_active
from ..._core.errors import GraphscaleError

__all__ = ["refuse_compiled_autograd"]


def refuse_compiled_autograd(engine: Any, where: str, direct: bool = False) -> None:
    """NOTE [ Under compiled autograd ]: what fails there in DeepSpeed alone is
    refused before the engine's part of the backward runs, with the reason."""
    switch = getattr(engine, "_is_compiled_autograd_enabled", False)
    if not (direct or switch or compiled_autograd_active()):
        return
    stage = engine.zero_optimization_stage()
    if direct:
        why = ("DeepSpeed's post-backward epilogue, which a direct backward queues with queue_callback, does not run "
               "under compiled autograd, so the gradients are never reduced (DeepSpeed 0.19.8 alone: KeyError: 0 in "
               "step(), measured at ZeRO 1 and 2).  Fix: call engine.backward(loss), which runs the epilogue itself")
    elif stage == 3:
        why = ("DeepSpeed 0.19.8 alone fails there mid-backward (compiled autograd's dynamic sizes do not match ZeRO "
               "3's partitioned parameters: 'AssertionError: 1 != 2', measured).  Fix: leave compiled autograd off "
               "for this engine (engine.compile() without compiled_autograd_enabled still compiles its forward), "
               "or use ZeRO 1 or 2")
    elif stage == 2 and switch:
        why = ("DeepSpeed 0.19.8 alone fails there mid-backward (dynamo: 'sources must not be empty for symbol', "
               "measured).  Fix: engine.compile() without compiled_autograd_enabled, torch's own compiled autograd "
               "around engine.backward (exact at ZeRO 1 and 2), or ZeRO 1")
    else:
        return
    raise GraphscaleError(f"{where} of a ZeRO {stage} engine under compiled autograd "
                f"({'engine.compile(compiled_autograd_enabled=True)' if switch else 'torch'}): {why}.  "
                "Nothing of this engine's backward ran.")
