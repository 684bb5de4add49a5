"""The Python route's node hook: one edge multiplier row on one node
(``grad_inputs[k] * m``), what ``ScaleHook`` in ``_native/hooks.h`` does.

Its own module on purpose: under compiled autograd dynamo traces it into the
captured graph (the multiplication is compiled with the rest), while every
other module of graphscale is kept out of dynamo's tracing (``_backward/dynamo.py``).
"""
from __future__ import annotations

import time
from typing import Any, Callable

from .._core import observation as _observation

__all__ = ["post_hook"]


def post_hook(mults: tuple[tuple[int, float], ...], laps: _observation.Laps | None, key: int = 0,
              task_has: Callable[[int], bool] | None = None) -> Callable[..., Any]:
    """A ``Node.register_hook`` post-hook multiplying ``grad_inputs[k]`` by
    ``m`` for each ``(k, m)`` of ``mults`` (None stays None), in the graph
    tasks that read ``key`` only (``task_has(key)``; key 0: in every task,
    under compiled autograd, which has no graph task to ask); timed into
    ``laps``' "hook calls" phase when a phase recorder is active.  (See NOTE
    [ Multipliers per graph task ] in _native/hooks.h.)"""
    def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
        if key and not task_has(key):  # type: ignore[misc]
            return grad_inputs  # another backward over this node: not this backward's multipliers
        out = list(grad_inputs)
        for k, m in mults:
            g = out[k]
            if g is not None:
                out[k] = g * m
        return tuple(out)

    if laps is None:
        return hook
    record, name = laps.record, laps.prefix + "hook calls"

    def timed(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
        t0 = time.perf_counter()
        out = hook(grad_inputs, grad_outputs)
        record(name, time.perf_counter() - t0)
        return out

    return timed
