"""Reading DeepSpeed without importing it: the engine's type, the ZeRO
optimizer's type, the loss scale an engine's backward applies.  Each reads
``sys.modules``; nothing here changes an engine."""
from __future__ import annotations

import sys
from functools import partial
from types import SimpleNamespace
from typing import Any, Callable

__all__ = ["engine_type", "is_engine", "is_zero_optimizer", "scale_reader", "scale_source"]


# DeepSpeedEngine once found (engine_type), else (): output hooks read it on every backward, as
# ``found.engine or engine_type()`` (no call once found).
found = SimpleNamespace(engine=None)


def engine_type() -> type | tuple[()]:
    """DeepSpeedEngine, or () (no type) while deepspeed is not imported."""
    if found.engine is not None:
        return found.engine  # type: ignore[no-any-return]
    ds = sys.modules.get("deepspeed")
    cls = getattr(getattr(getattr(ds, "runtime", None), "engine", None), "DeepSpeedEngine", None)
    if cls is None:
        return ()
    found.engine = cls
    return cls  # type: ignore[no-any-return]


def is_engine(obj: Any) -> bool:
    """True if ``obj`` is a ``deepspeed.DeepSpeedEngine`` (without importing deepspeed)."""
    return isinstance(obj, engine_type())

def scale_source(engine: Any) -> Callable[[], Any] | None:
    """What reads, when called, the factor DeepSpeed's engine.backward
    multiplies the loss by (its optimizer's ``scale_if_loss``, or the ZeRO-0
    autocast grad scaler): the fp16 loss scale; None for bf16 and fp32 (1).
    Which attribute holds it is decided once, here; its value is read per
    call, by a callable that runs no Python of graphscale (a bound getter).
    An engine's group multiplies it into its pin (``Group.pin``)."""
    opt: Any = getattr(engine, "optimizer", None)
    if is_zero_optimizer(opt):
        if getattr(opt, "custom_loss_scaler", False):
            return partial(getattr, opt, "external_loss_scale")
        scaler = getattr(opt, "torch_autocast_gradscaler", None)
        if scaler is not None:
            return scaler.get_scale  # type: ignore[no-any-return]
        loss_scaler = getattr(opt, "loss_scaler", None)
        return partial(getattr, loss_scaler, "cur_scale") if loss_scaler is not None else None
    z0_scaler = getattr(engine, "torch_autocast_z0_gradscaler", None)
    return z0_scaler.get_scale if z0_scaler is not None else None  # type: ignore[no-any-return]


def scale_reader(engine: Any) -> Callable[[], float]:
    """:func:`scale_source` as a function that returns a float (1.0 where
    there is none)."""
    source = scale_source(engine)
    if source is None:
        return _one
    return lambda: float(source())


def _one() -> float:
    return 1.0


def is_zero_optimizer(opt: Any) -> bool:
    zero_type = getattr(sys.modules.get("deepspeed.runtime.base_optimizer"), "ZeROOptimizer", None)
    return zero_type is not None and isinstance(opt, zero_type)
