"""DeepSpeed's output hooks under graphscale: two data descriptors on
DeepSpeed's ``OutputBackwardHookManager`` (NOTE [ DeepSpeed's two
generations ] and NOTE [ One lifecycle per backward ] in
_adapters/deepspeed/engine.py), and the table of attached engines they consult.
Part of the DeepSpeed adapter; reads ``sys.modules``, never imports deepspeed."""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch

from ..._backward.running import governing_binding, task_binding
from ..._core.errors import GraphscaleError
from .reads import engine_type

__all__ = ["attached", "is_output_hooked", "redirect_on", "PROLOGUE", "SHADOWED"]

attached: dict[int, Any] = {}  # id(engine) -> its _deepspeed_engine._EngineAdapter, while installed
# what an adapter puts on its engine instance
SHADOWED = ("backward", "scale", "_backward_epilogue", "_backward_prologue")


# ---------------------------------------------------------------- the output-hook redirect
_FN = "preprocess_per_tensor_fn"
PROLOGUE = "_backward_prologue_per_tensor"


class _Governed:
    """An engine's per-tensor function as its output hook sees it while the
    redirect is on: pass the gradient through when the running backward
    governs the engine, else DeepSpeed's own (NOTE [ DeepSpeed's two
    generations ])."""

    __slots__ = ("deepspeeds",)

    def __init__(self, deepspeeds: Callable[[Any], Any]) -> None:
        self.deepspeeds = deepspeeds

    def __call__(self, grad: Any) -> Any:
        binding = task_binding()  # NOTE [ Which snapshot an output hook obeys ] (in _backward/running.py)
        if binding is not None and id(self.deepspeeds.__self__) in binding.state.hook_owners:  # type: ignore[attr-defined]
            return grad  # graphscale places the factor at the engine's leaves
        return self.deepspeeds(grad)


def is_output_hooked(tensor: torch.Tensor) -> bool:
    """Whether one of DeepSpeed's output hooks sits on ``tensor`` itself."""
    hooks = tensor._backward_hooks
    return hooks is not None and any(getattr(h, "__qualname__", "").startswith("OutputBackwardHookManager.")
                                     for h in hooks.values())


_SEEN = "_graphscale_engine_of"  # on a manager: (its per-tensor function, the engine it names or None)
_WRAPPED = "_graphscale_governed"  # on a manager: the _Governed of its per-tensor function


def _engine_of(manager: Any) -> Any:
    """The engine whose forward made hook ``manager`` (its per-tensor function
    is the engine's bound ``_backward_prologue_per_tensor``), or None; read
    once per manager and function (the hooks ask several times a backward)."""
    d = manager.__dict__
    fn = d.get(_FN)
    seen = d.get(_SEEN)
    if seen is not None and seen[0] is fn:
        return seen[1]
    engine = getattr(fn, "__self__", None)
    if not (getattr(fn, "__name__", None) == PROLOGUE and isinstance(engine, engine_type())):
        engine = None
    d[_SEEN] = (fn, engine)
    return engine


class _PerTensorRedirect:
    """The data descriptor of NOTE [ DeepSpeed's two generations ] on
    OutputBackwardHookManager: an engine's per-tensor function reads as
    :class:`_Governed`; anything else as it was set."""

    def __get__(self, manager: Any, owner: type | None = None) -> Any:
        if manager is None:
            return self
        d = manager.__dict__
        fn = d.get(_FN)
        made = d.get(_WRAPPED)
        if made is not None and made.deepspeeds is fn:  # made once per manager and function
            return made
        if _engine_of(manager) is None:
            return fn
        made = d[_WRAPPED] = _Governed(fn)
        return made

    def __set__(self, manager: Any, value: Any) -> None:
        manager.__dict__[_FN] = value


_DONE = "preprocess_done"


class _PrologueOncePerBackward:
    """The data descriptor of NOTE [ One lifecycle per backward ] on
    OutputBackwardHookManager's ``preprocess_done``: inside a backward that
    governs the manager's engine, whether that engine's prologue ran in this
    backward (always, in a reference pass); elsewhere the manager's own flag."""

    def __get__(self, manager: Any, owner: type | None = None) -> Any:
        if manager is None:
            return self
        engine = _engine_of(manager)
        binding = None if engine is None else governing_binding(engine)
        if binding is None:
            return manager.__dict__.get(_DONE, False)
        return binding.reference or id(engine) in binding.once

    def __set__(self, manager: Any, value: Any) -> None:
        manager.__dict__[_DONE] = value
        engine = _engine_of(manager) if value else None
        binding = None if engine is None else governing_binding(engine)
        if binding is None or binding.reference or id(engine) in binding.once:
            return
        binding.once.add(id(engine))  # the manager runs the engine's prologue next
        adapter = attached.get(id(engine))
        if adapter is not None:
            adapter.prologue_starts(binding.on_failure)


_REDIRECT = _PerTensorRedirect()
_ONCE = _PrologueOncePerBackward()
_DESCRIPTORS = {_FN: _REDIRECT, _DONE: _ONCE}


def redirect_on() -> None:
    """Put the redirect and the prologue's once-per-backward flag on
    DeepSpeed's hook-manager class (idempotent).  They stay: a backward
    running when the last engine is removed still needs them, and for engines
    no backward governs they hand DeepSpeed's own values through."""
    utils = sys.modules.get("deepspeed.runtime.utils")
    cls = getattr(utils, "OutputBackwardHookManager", None)
    if cls is None:
        raise GraphscaleError(
            "graphscale: this DeepSpeed has no deepspeed.runtime.utils.OutputBackwardHookManager, through which "
            "graphscale switches the engines' own GAS division off; graphscale knows DeepSpeed 0.19.x. "
            "No engine was installed."
        )
    for name, descriptor in _DESCRIPTORS.items():
        present = cls.__dict__.get(name)
        if present is not None and present is not descriptor:
            raise GraphscaleError(
                f"graphscale: DeepSpeed's {cls.__name__}.{name} is already defined on the class (by another tool, "
                "or a DeepSpeed version graphscale does not know); graphscale cannot govern engines safely here. "
                "No engine was installed."
            )
    for name, descriptor in _DESCRIPTORS.items():
        setattr(cls, name, descriptor)
