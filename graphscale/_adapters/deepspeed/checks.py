"""What the DeepSpeed adapter relies on in DeepSpeed's internals, checked
before it touches anything: a release that changed one is refused at
``install()``.  Part of the DeepSpeed adapter; reads ``sys.modules``.
"""
from __future__ import annotations

import inspect
import sys
import threading
from typing import Any, Callable

import torch

from ..._core.errors import GraphscaleError
from ..._core.releases import NEWEST_TESTED, warn_if_newer

__all__ = ["check_engine", "check_installed", "TESTED"]

# NOTE [ DeepSpeed drift ]
# graphscale governs engines through DeepSpeed internals: the output-hook
# manager's flags, the engine methods it shadows, the per-tensor GAS division,
# where the fp16 loss scale lives.  A DeepSpeed release that renames or changes
# one of them must be refused at install(), not absorbed into a silently
# wrong gradient.  So before an engine is governed:
#   * once per hook-manager class, a self-test on a throwaway manager over a
#     throwaway tensor: the hook reads preprocess_per_tensor_fn and
#     preprocess_done from the instance when it fires, sets preprocess_done by
#     assignment, passes the gradient on unchanged when the function is None,
#     runs the prologue once per manager however many outputs it hooks, and
#     not again in a later backward until the flag is reset (an upstream
#     change that decides "once" per graph task instead, as PR 8135
#     proposes, fails here);
#   * once per engine class, the methods and module attributes the adapter
#     calls or shadows, and that engine.forward still registers its output
#     hooks with the engine's _backward_prologue_per_tensor;
#   * per engine (pure calls, no backward): its per-tensor prologue divides by
#     its GAS outside a backward, and the loss scale graphscale reads is the
#     one its optimizer's scale_if_loss applies (an upstream change that moves
#     the fp16 scale, as PR 8393 would for ZeRO 0, fails here).
# Each failure is a GraphscaleError naming the DeepSpeed version, the piece
# and what to do; no engine of that install() is touched.

OLDEST_TESTED = "0.19.5"  # pyproject.toml's lower bound
TESTED = f"{OLDEST_TESTED} to {NEWEST_TESTED['DeepSpeed']}"  # the releases the suite runs on (docs/works-with.md)

_lock = threading.Lock()
_passed: set[Any] = set()  # classes (hook manager, engine) whose checks passed


def _refuse(piece: str, what: str) -> GraphscaleError:
    version = getattr(sys.modules.get("deepspeed"), "__version__", "?")
    return GraphscaleError(
        f"graphscale: DeepSpeed {version}: {piece} {what}. graphscale relies on it to govern engines "
        f"(NOTE [ DeepSpeed drift ]) and was tested with DeepSpeed {TESTED}: install one of those "
        f"(e.g. pip install 'deepspeed=={NEWEST_TESTED['DeepSpeed']}') or a graphscale that knows this release. "
        "No engine was installed."
    )


def check_engine(engine: Any, scale_reader: Callable[[Any], Callable[[], float]]) -> None:
    """Raise GraphscaleError if ``engine``'s DeepSpeed lacks or changed an
    internal the adapter relies on; warn once if it is newer than tested.
    (See NOTE [ Newer releases ] in _core/releases.py.)"""
    warn_if_newer("DeepSpeed", getattr(sys.modules.get("deepspeed"), "__version__", "0"),
                  "its engines are governed where graphscale's drift checks pass, refused where they fail", 4)
    utils = sys.modules.get("deepspeed.runtime.utils")
    manager_cls = getattr(utils, "OutputBackwardHookManager", None)
    if manager_cls is None:
        raise _refuse("deepspeed.runtime.utils.OutputBackwardHookManager", "is missing")
    with _lock:
        if manager_cls not in _passed:
            _check_hook_manager(manager_cls)
            _passed.add(manager_cls)
        if type(engine) not in _passed:
            _check_engine_class(type(engine))
            _passed.add(type(engine))
    _check_engine_instance(engine, scale_reader)


def check_installed() -> None:
    """Raise GraphscaleError if the imported DeepSpeed's hook manager or
    engine class lacks or changed what the adapter relies on: the checks
    made once per class, no engine needed."""
    utils = sys.modules.get("deepspeed.runtime.utils")
    engine_mod = sys.modules.get("deepspeed.runtime.engine")
    manager_cls = getattr(utils, "OutputBackwardHookManager", None)
    engine_cls = getattr(engine_mod, "DeepSpeedEngine", None)
    if manager_cls is None or engine_cls is None:
        raise _refuse("deepspeed.runtime.utils.OutputBackwardHookManager or deepspeed.runtime.engine.DeepSpeedEngine",
                      "is missing")
    with _lock:
        for cls, check in ((manager_cls, _check_hook_manager), (engine_cls, _check_engine_class)):
            if cls not in _passed:
                check(cls)
                _passed.add(cls)


def _check_hook_manager(cls: type) -> None:
    name = cls.__name__
    calls: dict[str, Any] = {"once": 0, "per_tensor": [], "swapped": 0}

    def once() -> None:
        calls["once"] += 1

    def per_tensor(grad: torch.Tensor) -> torch.Tensor:
        calls["per_tensor"].append(grad)
        return grad

    def swapped(grad: torch.Tensor) -> torch.Tensor:
        calls["swapped"] += 1
        return grad * 3

    try:
        manager = cls(once, per_tensor)
    except TypeError as exc:
        raise _refuse(f"{name}(preprocess_once_fn, preprocess_per_tensor_fn)", f"cannot be made ({exc})") from exc
    for attr in ("preprocess_once_fn", "preprocess_per_tensor_fn", "preprocess_done", "register_hooks_on_outputs"):
        if not hasattr(manager, attr):
            raise _refuse(f"{name}.{attr}", "is missing")
    with torch.enable_grad():
        leaf = torch.ones(2, requires_grad=True)
        outs = (leaf * 1.0, leaf * 2.0)
        manager.register_hooks_on_outputs(outs)
        manager.preprocess_per_tensor_fn = swapped  # read when the hook fires?
        (outs[0].sum() + outs[1].sum()).backward(retain_graph=True)
    if calls["once"] != 1:
        raise _refuse(f"{name}'s hook", f"ran preprocess_once_fn {calls['once']} times for one backward over two "
                                        "hooked outputs, not once")
    if calls["swapped"] != 2 or calls["per_tensor"] or leaf.grad is None or leaf.grad.tolist() != [9.0, 9.0]:
        raise _refuse(f"{name}.preprocess_per_tensor_fn", "is not read from the manager when its hook fires, "
                                                          "or its result is not the gradient passed on")
    if manager.__dict__.get("preprocess_done", None) is not True:
        raise _refuse(f"{name}.preprocess_done", "is not set on the manager by its hook")
    leaf.grad = None
    (outs[0].sum() + outs[1].sum()).backward(retain_graph=True)
    if calls["once"] != 1:
        raise _refuse(f"{name}'s hook", "ran the prologue again in a later backward while preprocess_done was set "
                                        "(it decides once-per-backward by something other than preprocess_done)")
    manager.preprocess_done = False
    outs[0].sum().backward()
    if calls["once"] != 2:
        raise _refuse(f"{name}'s hook", "did not run the prologue when preprocess_done was reset")
    manager.preprocess_per_tensor_fn = None  # what a governed engine's managers read (_adapters/deepspeed/hooks.py)
    leaf.grad = None
    try:
        outs[1].sum().backward(retain_graph=True)
        passed = leaf.grad is not None and leaf.grad.tolist() == [2.0, 2.0]
    except Exception:  # (it called None)
        passed = False
    if not passed:
        raise _refuse(f"{name}'s hook", "does not pass the gradient on unchanged when preprocess_per_tensor_fn "
                                        "is None")
    manager.remove_hooks()


# What the adapter calls, shadows or reads on DeepSpeedEngine.
_ENGINE_METHODS = ("backward", "forward", "_backward_prologue", "_backward_epilogue",
                   "_backward_prologue_per_tensor", "gradient_accumulation_steps", "zero_optimization_stage")


def _undecorated(fn: Any) -> Any:
    """``fn`` without DeepSpeed's decorators (instrument_w_nvtx keeps the
    function in its closure, not in ``__wrapped__``)."""
    fn = inspect.unwrap(fn)
    inner = [c.cell_contents for c in getattr(fn, "__closure__", None) or () if inspect.isfunction(c.cell_contents)]
    kinds = [p.kind for p in inspect.signature(fn).parameters.values()]
    if len(inner) == 1 and kinds == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]:
        return _undecorated(inner[0])
    return fn


def _check_engine_class(cls: Any) -> None:
    for attr in _ENGINE_METHODS:
        if not callable(getattr(cls, attr, None)):
            raise _refuse(f"{cls.__name__}.{attr}", "is missing")
    params = inspect.signature(_undecorated(cls.backward)).parameters
    if "retain_graph" not in params or "scale_wrt_gas" not in params:
        raise _refuse(f"{cls.__name__}.backward", f"takes {tuple(params)}, not (loss, retain_graph, scale_wrt_gas)")
    forward = _undecorated(cls.forward)
    names = set(forward.__code__.co_names) if hasattr(forward, "__code__") else set()
    if not {"register_output_backward_hooks", "_backward_prologue_per_tensor"} <= names:
        raise _refuse(f"{cls.__name__}.forward", "no longer registers its output hooks through "
                                                 "register_output_backward_hooks(..., _backward_prologue_per_tensor)")
    engine_mod = sys.modules.get(cls.__module__)
    tracker = getattr(engine_mod, "_ENGINE_BACKWARD_GRAPH_TRACKER", None)
    if tracker is not None and not callable(getattr(tracker, "is_current_graph_registered", None)):
        raise _refuse("deepspeed.runtime.engine._ENGINE_BACKWARD_GRAPH_TRACKER.is_current_graph_registered",
                      "is missing")
    base = sys.modules.get("deepspeed.runtime.base_optimizer")
    zero = getattr(base, "ZeROOptimizer", None)
    if zero is None:
        raise _refuse("deepspeed.runtime.base_optimizer.ZeROOptimizer", "is missing")
    for attr in ("_backward_active_depth", "exit_backward", "scale_if_loss"):
        if not hasattr(zero, attr):
            raise _refuse(f"ZeROOptimizer.{attr}", "is missing")


# NOTE [ No functorch state left behind ]
# DeepSpeed's per-tensor prologue asks whether a functorch transform is
# running (deepspeed.utils.torch.is_functorch_transforming, which calls
# torch._C._functorch.peek_interpreter_stack); asking creates functorch's
# thread-local state on the asking thread, and it stays there.  From then on
# every backward on that thread, governed or not, pays for it at every node:
# torch's engine saves and restores the thread-local state around each node
# and deep-copies functorch's each time (measured under callgrind, torch
# 2.13: about 950 instructions a node, +3 % on a 700-node chain of plain
# torch, after one install() of an engine and its remove()).  Inside a
# backward, where DeepSpeed asks, torch's engine drops it again after the
# node; the install-time check below asks outside any backward, so it asks
# on a thread of its own, which takes the state with it when it ends.  The
# epilogue graphscale runs on the caller's thread as a governed backward
# returns (ZeRO 0, compiled autograd: NOTE [ Epilogues graphscale runs ] in
# ending.py) must run there, so the native module drops the state after it
# where asking created it (ending.leaving_no_functorch_state; without the
# native module it stays).  tests/deepspeed_engines/test_no_state_left.py.
def _on_a_thread_of_its_own(fn: Callable[[], Any]) -> Any:
    """``fn()`` run on a short-lived thread; its result, or its exception
    raised here.  See NOTE [ No functorch state left behind ]."""
    out: list[Any] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # raised on the caller's thread below
            failed.append(exc)

    thread = threading.Thread(target=run, name="graphscale-install-check", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return out[0]


def _check_engine_instance(engine: Any, scale_reader: Callable[[Any], Callable[[], float]]) -> None:
    cls = type(engine).__name__
    # global_steps: what tells graphscale the accumulation window an aborted backward was in.
    # (See NOTE [ An aborted backward counts for nothing ] in _adapters/deepspeed/failed.py.)
    for attr in ("_running_engine_backward", "_manual_backward_expected", "global_steps", "optimizer", "module"):
        if attr not in engine.__dict__ and not hasattr(engine, attr):
            raise _refuse(f"{cls} instance attribute {attr}", "is missing")
    gas = engine.gradient_accumulation_steps()
    probe = torch.full((2,), float(gas))
    got = _on_a_thread_of_its_own(lambda: engine._backward_prologue_per_tensor(probe))
    if not isinstance(got, torch.Tensor) or got.tolist() != [1.0, 1.0]:
        raise _refuse(f"{cls}._backward_prologue_per_tensor", f"no longer divides a gradient by the engine's GAS "
                                                              f"({gas}) outside engine.backward")
    opt: Any = engine.optimizer
    zero: Any = getattr(sys.modules.get("deepspeed.runtime.base_optimizer"), "ZeROOptimizer", ())
    if isinstance(opt, zero):
        with torch.enable_grad():
            loss = torch.ones((), requires_grad=True) * 1.0
            applied = float(opt.scale_if_loss(loss).detach())
        read = scale_reader(engine)()
        if applied != read:
            raise _refuse(f"{type(opt).__name__}.scale_if_loss",
                          f"multiplies the loss by {applied:g}, but the loss scale graphscale reads for this engine "
                          f"is {read:g} (the fp16 loss scale moved)")
