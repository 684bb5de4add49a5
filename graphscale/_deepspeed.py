"""DeepSpeed adapter: the only module that knows about deepspeed.

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
#   * the output hooks: the engine's _backward_prologue_per_tensor is shadowed
#     by an instance attribute that passes the gradient through while the
#     engine is installed (forwards after install bind it); hook managers made
#     by forwards *before* install are found once, at install (the collector's
#     referrers of DeepSpeed's OutputBackwardHookManager class: its instances),
#     and pointed at the same function, so outputs made before install are
#     exact too.  That function asks the running governed backward's snapshot
#     (else the registry of installed engines, never the adapter that made
#     it), so outputs made while installed and backpropagated after remove()
#     get DeepSpeed's native behaviour, and outputs made under an earlier
#     installation pass through under a later one;
#   * the loss division: engine.backward is shadowed by a function that calls
#     DeepSpeed's with scale_wrt_gas=False inside gas_scaling(scale_wrt_gas),
#     and returns loss / GAS (or loss) as DeepSpeed does.
# Everything else DeepSpeed does in backward (ZeRO prologue and epilogue,
# reduction hooks, loss scaling, timers) runs untouched.
"""
from __future__ import annotations

import gc
import sys
import threading
from typing import Any, Callable

import torch

from contextlib import contextmanager
from collections.abc import Iterator

from ._errors import GraphscaleError
from ._group import Group
from ._state import gas_scaling, governing_state

__all__ = ["is_engine", "attach", "EngineGroup", "zero_stage", "prologues_held"]

_lock = threading.Lock()
_attached: dict[int, _EngineAdapter] = {}  # id(engine) -> adapter, while installed


def is_engine(obj: Any) -> bool:
    """True if ``obj`` is a ``deepspeed.DeepSpeedEngine`` (without importing deepspeed)."""
    ds = sys.modules.get("deepspeed")
    if ds is None:
        return False
    engine_type = getattr(getattr(getattr(ds, "runtime", None), "engine", None), "DeepSpeedEngine", None)
    return engine_type is not None and isinstance(obj, engine_type)


def _is_pipeline(engine: Any) -> bool:
    pipe = sys.modules.get("deepspeed.runtime.pipe.engine")
    return pipe is not None and isinstance(engine, pipe.PipelineEngine)


def _hook_managers() -> list[Any]:
    """Every live DeepSpeed ``OutputBackwardHookManager`` (made by engine.forward).

    An instance of a Python class refers to its class, so the collector's
    referrers of the class are its instances: one pass in C over the heap,
    several times cheaper than iterating ``gc.get_objects()`` in Python.
    """
    utils = sys.modules.get("deepspeed.runtime.utils")
    cls = getattr(utils, "OutputBackwardHookManager", None)
    if cls is None:
        return []
    return [obj for obj in gc.get_referrers(cls) if type(obj) is cls]


class EngineGroup(Group):
    """The group of a DeepSpeed engine: its module's parameters, its GAS.

    ``engine``: the engine (its bound ``gradient_accumulation_steps`` is the
    group's gas callable, which holds it anyway).
    """

    __slots__ = ("engine",)

    def __init__(self, engine: Any, name: str) -> None:
        super().__init__(engine.module, gas=engine.gradient_accumulation_steps, name=name)
        self._factor_key = ("engine", id(engine))
        self.engine: Any = engine


def zero_stage(group: Group) -> int:
    """The ZeRO stage of an engine's group (0 for plain groups)."""
    engine = getattr(group, "engine", None)
    return int(engine.zero_optimization_stage()) if engine is not None else 0


@contextmanager
def prologues_held() -> Iterator[None]:
    """Hold back DeepSpeed's once-per-backward output-hook prologue (timers,
    ZeRO bookkeeping, the queued epilogue) for a backward that is not the real
    one (graphscale.audit's reference pass): the pending hook managers are
    marked done for the duration of the block."""
    pending = [m for m in _hook_managers() if getattr(m, "preprocess_done", True) is False]
    for m in pending:
        m.preprocess_done = True
    try:
        yield
    finally:
        for m in pending:
            m.preprocess_done = False


class _EngineAdapter:
    def __init__(self, engine: Any) -> None:
        self.refs = 0
        self.active = False
        cls = type(engine)
        self._native_func = cls._backward_prologue_per_tensor
        native_per_tensor = self._native_func.__get__(engine, cls)
        native_backward = cls.backward.__get__(engine, cls)
        self._had_own = {n: n in engine.__dict__ for n in ("_backward_prologue_per_tensor", "backward")}
        if any(self._had_own.values()):
            raise GraphscaleError(
                "graphscale: this engine's backward or _backward_prologue_per_tensor is already "
                "replaced on the instance (by another tool?); graphscale cannot govern it safely."
            )
        adapter = self

        key = ("engine", id(engine))

        def per_tensor(grad: Any) -> Any:
            # NOTE [ Which snapshot an output hook obeys ] (in _state.py): the
            # backward running on this thread decides, not a remove() since.
            governing = governing_state()
            if governing is not None:
                governed = key in governing.factor_keys  # NOTE [ Per-snapshot tables ]
            else:  # the registry, not this adapter: an output made under an earlier
                # installation of this engine must pass through under a later one too
                governed = _attached.get(id(engine)) is not None
            if governed:
                return grad  # graphscale places the factor at the engine's leaves
            return native_per_tensor(grad)

        def backward(loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Any:
            if not adapter.active:
                return native_backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
            gas_scaled = loss / engine.gradient_accumulation_steps() if scale_wrt_gas else loss
            had_flag = hasattr(engine, "_scale_wrt_gas")
            try:
                with gas_scaling(scale_wrt_gas):
                    native_backward(loss, retain_graph=retain_graph, scale_wrt_gas=False)
            finally:
                if had_flag:  # <= 0.19.5 keeps the last call's flag on the engine: keep its meaning
                    engine._scale_wrt_gas = scale_wrt_gas
            return gas_scaled

        backward.__doc__ = native_backward.__doc__
        self.per_tensor: Callable[[Any], Any] = per_tensor
        self.backward = backward

    def enable(self, engine: Any) -> None:
        engine._backward_prologue_per_tensor = self.per_tensor
        engine.backward = self.backward
        self.active = True
        # Outputs of forwards run before install hold DeepSpeed's own bound method.
        for manager in _hook_managers():
            fn = getattr(manager, "preprocess_per_tensor_fn", None)
            if getattr(fn, "__self__", None) is engine and getattr(fn, "__func__", None) is self._native_func:
                manager.preprocess_per_tensor_fn = self.per_tensor

    def disable(self, engine: Any) -> None:
        self.active = False
        for name in ("_backward_prologue_per_tensor", "backward"):
            engine.__dict__.pop(name, None)


def attach(engine: Any) -> tuple[EngineGroup, Callable[[], None]]:
    """Govern ``engine``; return its group and a function that undoes this once."""
    if _is_pipeline(engine):
        raise TypeError(
            "graphscale.install: PipelineEngine schedules its own micro-batches and calls backward "
            "itself; graphscale does not govern it. Install the non-pipeline engines only."
        )
    with _lock:
        adapter = _attached.get(id(engine))
        if adapter is None:
            adapter = _EngineAdapter(engine)
            _attached[id(engine)] = adapter
            adapter.enable(engine)
        adapter.refs += 1
    group = EngineGroup(engine, name=f"engine:{type(engine.module).__name__}#{id(engine) & 0xFFFF:04x}")
    done = False

    def detach() -> None:
        nonlocal done
        with _lock:
            if done:
                return
            done = True
            adapter.refs -= 1
            if adapter.refs == 0:
                adapter.disable(engine)
                del _attached[id(engine)]

    return group, detach
