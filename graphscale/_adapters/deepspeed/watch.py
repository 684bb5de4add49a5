"""The diagnosis' watch of a DeepSpeed engine graphscale does not govern
(``graphscale.diagnose``, through the registry's ``Adapter.observe``): the
hook-manager descriptors on and ``engine.backward`` shadowed by a wrapper
that only says which engine's backward runs.  Part of the DeepSpeed adapter;
reads ``sys.modules``, never imports deepspeed."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..._backward.frames import adapter_backward
from ..._core.errors import GraphscaleError
from .checks import check_engine
from .hooks import attached as _attached
from .hooks import lock as _lock
from .hooks import observed as _observed
from .hooks import redirect_off, redirect_on
from .reads import scale_reader

__all__ = ["observe"]


def observe(engine: Any) -> Callable[[], None]:
    """Watch ``engine`` without governing it (``graphscale.diagnose``): the
    hook-manager descriptors on (they hand DeepSpeed's own values to every
    backward no snapshot governs, and hold the prologue in a reference pass),
    and ``engine.backward`` shadowed by a wrapper that only says, while it
    runs, which engine's backward this is and its ``scale_wrt_gas``.  Returns
    the function that undoes the shadow."""
    with _lock:
        if id(engine) in _attached:
            raise GraphscaleError(
                "graphscale.diagnose: this engine is installed (graphscale governs it), so DeepSpeed's own "
                "scaling cannot be seen; use graphscale.audit() inside the installation instead.")
        check_engine(engine, scale_reader)  # NOTE [ DeepSpeed drift ]
        if "backward" in engine.__dict__:
            raise GraphscaleError("graphscale.diagnose: this engine's backward is already replaced on the "
                                  "instance (another diagnosis, or another tool); diagnose it once.")
        redirect_on()
        _observed.add(id(engine))
        cls = type(engine)
        deepspeeds_backward = cls.backward.__get__(engine, cls)

        def backward(loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Any:
            running = getattr(engine, "_running_engine_backward", False)
            try:
                with adapter_backward(scale_wrt_gas, 1.0, (engine, loss)):
                    return deepspeeds_backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
            finally:  # <= 0.19.5 leaves it True when its backward raised (the diagnosis' refusal, for one)
                engine._running_engine_backward = running

        backward.__doc__ = deepspeeds_backward.__doc__
        engine.backward = backward

    def undo() -> None:
        with _lock:
            if engine.__dict__.get("backward") is backward:
                del engine.__dict__["backward"]
                _observed.discard(id(engine))
                redirect_off()

    return undo
