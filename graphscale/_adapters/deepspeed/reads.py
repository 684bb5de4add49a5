"""Reading DeepSpeed without importing it: the engine's type, the ZeRO
optimizer's type, the loss scale an engine's backward applies.  Each reads
``sys.modules``; nothing here changes an engine."""
from __future__ import annotations

import sys
from typing import Any, Callable

__all__ = ["engine_type", "is_engine", "is_zero_optimizer", "scale_reader"]


_engine_type: type | None = None  # found once: output hooks ask on every backward


def engine_type() -> type | tuple[()]:
    """DeepSpeedEngine, or () (no type) while deepspeed is not imported."""
    global _engine_type
    if _engine_type is not None:
        return _engine_type
    ds = sys.modules.get("deepspeed")
    found = getattr(getattr(getattr(ds, "runtime", None), "engine", None), "DeepSpeedEngine", None)
    if found is None:
        return ()
    _engine_type = found
    return found


def is_engine(obj: Any) -> bool:
    """True if ``obj`` is a ``deepspeed.DeepSpeedEngine`` (without importing deepspeed)."""
    return isinstance(obj, engine_type())

def _one() -> float:
    return 1.0


def scale_reader(engine: Any) -> Callable[[], float]:
    """A function reading, when called, the factor DeepSpeed's engine.backward
    multiplies the loss by (its optimizer's ``scale_if_loss``, or the ZeRO-0
    autocast grad scaler): the fp16 loss scale, 1 for bf16 and fp32.  Which
    attribute holds it is decided once, here; its value is read per call."""
    opt: Any = getattr(engine, "optimizer", None)
    if is_zero_optimizer(opt):
        if getattr(opt, "custom_loss_scaler", False):
            return lambda: float(opt.external_loss_scale)
        scaler = getattr(opt, "torch_autocast_gradscaler", None)
        if scaler is not None:
            return lambda: float(scaler.get_scale())
        loss_scaler = getattr(opt, "loss_scaler", None)
        return (lambda: float(loss_scaler.cur_scale)) if loss_scaler is not None else _one
    z0_scaler = getattr(engine, "torch_autocast_z0_gradscaler", None)
    return (lambda: float(z0_scaler.get_scale())) if z0_scaler is not None else _one


def is_zero_optimizer(opt: Any) -> bool:
    zero_type = getattr(sys.modules.get("deepspeed.runtime.base_optimizer"), "ZeROOptimizer", None)
    return zero_type is not None and isinstance(opt, zero_type)
