"""What the DeepSpeed adapter does for an engine whose governed backward
raised (NOTE [ A backward that raised ] in _backward/frames.py): end the engine's
part of it, or say why it cannot, and refuse the engine's next backward
clearly.  Part of the DeepSpeed adapter; reads ``sys.modules``, never
imports deepspeed.

# NOTE [ Ending a failed ZeRO backward ]
# torch dropped the engine's queued post-backward epilogue, so graphscale
# runs it (``_backward_epilogue``, graphscale's shadow of it) for the
# gradients the backward reached, as if the window's boundary were not
# here (DeepSpeed's override _is_gradient_accumulation_boundary = False for
# that call): the user retries the micro-step, and the retry is the
# boundary.  Measured (tests/test_failed_backward.py, DeepSpeed 0.19.5 and
# 0.19.8, ZeRO 1-3, one and two ranks): the window then trains exactly like
# plain PyTorch with the same retry; at the boundary, the epilogue run as
# the boundary lost the reached gradients at ZeRO 1 and 2 (weights off by
# 15%).  Where the backward reached no gradient of the engine (ZeRO's
# bucket empty, no parameter marked reduced), ZeRO 2's epilogue itself
# raises (IndexError in reduce_ipg_grads, measured); there is nothing to
# reduce, so only the backward depth is taken back.  If the epilogue raises
# anyway, the engine's ZeRO state is partial in a way graphscale cannot
# repair: its next governed backward is refused with the reason.  The hook
# state's "callback queued" mark is cleared too (DeepSpeed's next forward
# would; a retry over the retained graph, with no forward, queued no
# epilogue and step() raised KeyError, measured at ZeRO 1 and 2).  ZeRO 3
# cannot run a second backward over a graph whose backward ran (its
# partitioned parameters: "The size of tensor a (0) must match ...",
# measured with and without graphscale), so there a retry over the
# retained graph, with no forward since the failed backward, is refused
# with the fix: retry with a new forward.
"""
from __future__ import annotations

from typing import Any, Callable

from ..._core.errors import GraphscaleError
from .reads import is_zero_optimizer

__all__ = ["end_failed_backward", "refuse_next"]

_BOUNDARY = "_is_gradient_accumulation_boundary"  # DeepSpeed's override of its micro-step count (None: none)


def _holds_nothing(opt: Any) -> bool:
    """Whether a ZeRO optimizer holds no gradient of the running backward:
    its reduction buckets empty and no parameter marked reduced."""
    buckets = getattr(opt, "ipg_buckets", None)
    if not isinstance(buckets, dict) or any(getattr(b, "params", None) for b in buckets.values()):
        return False
    marks = getattr(opt, "params_already_reduced", ())
    return not any(marks.values() if isinstance(marks, dict) else marks)


def end_failed_backward(engine: Any, epilogue: Callable[[], None]) -> None:
    """NOTE [ Ending a failed ZeRO backward ]: run ``epilogue`` (the engine's,
    as graphscale shadows it) for the failed backward; what it raises goes on."""
    engine._manual_backward_expected = False  # (what DeepSpeed's post-backward hook clears)
    opt: Any = getattr(engine, "optimizer", None)
    state = getattr(opt, "_backward_hook_state", None)
    if state is not None and hasattr(state, "post_backward_callback_queued"):
        state.post_backward_callback_queued = False  # the callback torch dropped
    if is_zero_optimizer(opt) and _holds_nothing(opt):
        if opt._backward_active_depth > 0:
            opt.exit_backward()
        return
    boundary = engine.__dict__.get(_BOUNDARY)
    engine.__dict__[_BOUNDARY] = False  # not the window's last backward: the retry is
    try:
        epilogue()
    finally:
        engine.__dict__[_BOUNDARY] = boundary
        if hasattr(opt, "set_gradient_accumulation_boundary"):  # ZeRO's mirror of it
            opt.set_gradient_accumulation_boundary(engine.is_gradient_accumulation_boundary())


def refuse_next(engine: Any, broken: str | None) -> None:
    """The first governed prologue of ``engine`` after graphscale ended a
    failed backward of it: refuse it when ending that one raised
    ``broken``, or at ZeRO 3 when no forward ran since (a retry over the
    retained graph).  Reads DeepSpeed's "backward seen this step" mark,
    which each forward clears."""
    stage = engine.zero_optimization_stage()
    if broken is None and stage == 3 and getattr(engine.optimizer, "_backward_seen_this_step", False):
        raise GraphscaleError(
            "graphscale: a backward over the graph of this ZeRO 3 engine's backward that raised (retain_graph=True, "
            "no forward since): ZeRO 3 cannot run a second backward over a graph whose backward ran (DeepSpeed alone "
            "fails there too, mid-backward, on its partitioned parameters).  Fix: retry the micro-step with a new "
            "forward (engine(batch)); the failed backward's reached gradients are kept.  Nothing of this backward "
            "ran for this engine.")
    if broken is None:
        return
    raise GraphscaleError(
        f"graphscale: this DeepSpeed engine (ZeRO {stage}) is still inside a backward that "
        f"raised earlier: ending it (DeepSpeed's epilogue, for the gradients it had reached) failed with {broken}, so "
        "its ZeRO state (reduction bucket, backward depth) is partial.  Fix: rebuild the engine, or reload a "
        "checkpoint into a new one, and install graphscale on it; nothing of this backward ran for this engine.")
