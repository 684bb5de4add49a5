"""A DeepSpeed engine under compiled autograd: its prologue run eagerly, and
the refusal of what DeepSpeed alone fails at there, before the engine's part
of a backward runs.  Part of the DeepSpeed adapter; never imports deepspeed.

# NOTE [ Under compiled autograd ]
# Compiled autograd lifts every hook into a graph that dynamo traces; it
# traced DeepSpeed's output hook into the engine's prologue and on into
# ZeRO's queue_callback, which dynamo refuses outside fullgraph=True
# ("queue_callback() is only supported when Compiled Autograd is enabled
# with fullgraph=True"): every engine backward failed there under
# graphscale.  DeepSpeed alone fails the same way where its output is not
# the loss (critic(engine(x)), measured); where it is (engine(x).sum()) it
# got through only because dynamo dropped its prologue (ZeRO's backward
# depth stayed 0, measured), so no epilogue was queued.  Under graphscale the
# prologue is shadowed on the instance (_EngineAdapter.prologue in
# _adapters/deepspeed/engine.py) by a function that, while compiled autograd
# is on, runs DeepSpeed's prologue with dynamo disabled
# (prologue_under_compiled_autograd here, torch._dynamo.disable: once per
# backward, so its microsecond does not matter); and the adapter's modules,
# the hook descriptors (_adapters/deepspeed/hooks.py) and the task bindings
# (_backward/running.py), like every graphscale module but _backward/hooks.py,
# are on dynamo's skip list (NOTE [ graphscale is not traced by dynamo ] in
# _backward/dynamo.py): dynamo breaks its graph at them and they run eagerly,
# on the real graph task, every step.  So the prologue runs once,
# queues ZeRO's epilogue as in an uncompiled backward, and nothing per
# backward is baked into a capture.  Measured (0.19.8, fp32 and bf16, four
# micro-steps with step(), tests/test_compiled_autograd.py): exact against
# plain PyTorch with torch's switch around engine.backward at ZeRO 1 and 2,
# and with DeepSpeed's switch (compiled autograd inside engine.backward) at
# ZeRO 1; the same captures as DeepSpeed alone.  Where DeepSpeed alone fails under
# compiled autograd, graphscale refuses with the reason before the engine's
# backward runs: engine.backward at ZeRO 3 (either switch; DeepSpeed alone:
# "AssertionError: 1 != 2" in compiled autograd's sizes of the partitioned
# parameters) and under DeepSpeed's switch at ZeRO 2 (dynamo: "sources must
# not be empty for symbol"); a direct loss.backward() under torch's switch
# (DeepSpeed's queued epilogue never runs: "KeyError: 0" at step()), at the
# engine's prologue, before any of its gradients.  Not at install(): the
# same engine's direct loss.backward() under DeepSpeed's switch runs
# uncompiled (DeepSpeed compiles engine.backward's only) and is exact.
"""
from __future__ import annotations

from typing import Any, Callable

from ..._backward.dynamo import eager
from ..._backward.gate import compiled_autograd_active
from ..._core.errors import GraphscaleError

__all__ = ["prologue_under_compiled_autograd", "refuse_compiled_autograd"]


def prologue_under_compiled_autograd(engine: Any, deepspeeds_prologue: Callable[[], None], governed: bool) -> None:
    """``engine``'s backward prologue (DeepSpeed's, ``deepspeeds_prologue``)
    while compiled autograd is on: run eagerly, with dynamo disabled; where
    graphscale governs the engine (``governed``) and the backward is a direct
    ``loss.backward()``, refused first (NOTE [ Under compiled autograd ])."""
    if governed and not getattr(engine, "_running_engine_backward", False):
        refuse_compiled_autograd(engine, "graphscale: a direct loss.backward()", direct=True)
    eager(deepspeeds_prologue)()


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
