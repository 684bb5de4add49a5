"""A DeepSpeed engine under compiled autograd: its prologue run eagerly, and
the refusal of what DeepSpeed alone fails at there, before the engine's part
of a backward runs.  Part of the DeepSpeed adapter; never imports deepspeed.
"""
from __future__ import annotations

from typing import Any, Callable

from ..._backward.dynamo import eager
from ..._backward.gate import compiled_autograd_active
from ..._core.errors import GraphscaleError
from ..._core.observation import record_refusal

__all__ = ["prologue_under_compiled_autograd", "refuse_compiled_autograd"]

# NOTE [ Under compiled autograd ]
# Compiled autograd traces every hook into a graph; traced, DeepSpeed's
# prologue reaches ZeRO's queue_callback, which dynamo refuses outside
# fullgraph=True, so every engine backward failed there.  So, while compiled
# autograd is on, the engine's prologue (shadowed on the instance by
# _EngineAdapter.prologue in _adapters/deepspeed/engine.py) runs DeepSpeed's
# with dynamo disabled (prologue_under_compiled_autograd), and the adapter's
# modules are on dynamo's skip list: the prologue runs once, eagerly, on the
# real graph task, and nothing per backward is baked into a capture.  torch
# runs no queued callback there, so the epilogue of an engine a governed
# direct backward reaches (loss.backward(), or the second engine of a shared
# loss) is run by graphscale as the backward returns
# (NOTE [ Epilogues graphscale runs ] in ending.py).  Where DeepSpeed alone fails under compiled
# autograd even for one engine (ZeRO 3; ZeRO 2 under DeepSpeed's switch),
# graphscale refuses with the reason before the engine's part of the backward
# runs (refuse_compiled_autograd), not at install(); an ungoverned direct
# backward of an installed engine (torch.autograd.grad) is refused too, since
# nothing would run its epilogue.
# Full record: docs/development.md, 'Under compiled autograd'.


def prologue_under_compiled_autograd(engine: Any, deepspeeds_prologue: Callable[[], None], installed: bool) -> None:
    """``engine``'s backward prologue (DeepSpeed's, ``deepspeeds_prologue``)
    in a backward that does not govern it, while compiled autograd is on: run
    eagerly, with dynamo disabled; where the engine is ``installed`` and the
    backward is a direct one (no epilogue would run), refused first."""
    if installed and not getattr(engine, "_running_engine_backward", False):
        refuse_compiled_autograd(engine, "graphscale: a direct loss.backward()", direct=True)
    eager(deepspeeds_prologue)()


def refuse_compiled_autograd(engine: Any, where: str, direct: bool = False) -> None:
    """Refuse, with the reason, what fails under compiled autograd in
    DeepSpeed alone, before the engine's part of the backward runs."""
    switch = getattr(engine, "_is_compiled_autograd_enabled", False)
    if not (direct or switch or compiled_autograd_active()):
        return
    stage = engine.zero_optimization_stage()
    if direct:
        why = ("DeepSpeed's post-backward epilogue, which a direct backward queues with queue_callback, does not run "
               "under compiled autograd, and this backward is not governed by graphscale (torch.autograd.grad?), so "
               "the gradients would never be reduced (DeepSpeed 0.19.8 alone: KeyError: 0 in step(), measured at "
               "ZeRO 1 and 2).  Fix: loss.backward() or engine.backward(loss), which graphscale governs")
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
    record_refusal("compiled autograd, ungoverned direct backward" if direct else
                   "compiled autograd, ZeRO 3" if stage == 3 else "compiled autograd, ZeRO 2 under engine.compile")
    raise GraphscaleError(f"{where} of a ZeRO {stage} engine under compiled autograd "
                f"({'engine.compile(compiled_autograd_enabled=True)' if switch else 'torch'}): {why}.  "
                "Nothing of this engine's backward ran.")
