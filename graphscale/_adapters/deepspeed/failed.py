"""What the DeepSpeed adapter does for an engine whose governed backward
raised: discard the aborted attempt so that its retry is clean, or, where the
attempt may already have put something permanent into the accumulation
window, make the engine fail closed.  Part of the DeepSpeed adapter; reads
``sys.modules``, never imports deepspeed.
"""
from __future__ import annotations

from typing import Any, Callable

from ..._core.errors import GraphscaleError
from ..._core.observation import record_refusal
from .reads import is_zero_optimizer

__all__ = ["Attempt", "Drains", "begin", "deepspeed_recovers", "discard", "fail_closed", "reached", "refuse_next"]

# NOTE [ An aborted backward counts for nothing ]
# torch runs no queued callback of a graph task that raised, so DeepSpeed's
# epilogue never runs for it and the engine is left mid-backward.  The
# contract (upstream PR 8245's): the aborted attempt counts for nothing.  For
# each engine whose part had begun, right when the error leaves the governed
# backward (see NOTE [ A backward that raised ] in _backward/frames.py),
# graphscale discards the attempt's state (discard) and, where the attempt
# already changed the window for good (a bucket drained during it, Drains; or
# at ZeRO 1 a gradient reached onto an earlier micro-step's .grad, measured
# from begin()), makes the engine fail closed (fail_closed).  A DeepSpeed that
# recovers by itself is left to it (deepspeed_recovers); at ZeRO 3 a retry
# over the retained graph of one that reached the engine's gradients is
# refused (refuse_next).
# Full record: docs/development.md, 'An aborted backward counts for nothing'.

# The optimizer method that drains a reduction bucket, by ZeRO stage's class (stages 1 and 2 share one).
_DRAIN = ("reduce_ipg_grads", "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads")


def deepspeed_recovers(opt: Any) -> bool:
    """Whether this DeepSpeed discards or rejects an aborted backward itself
    (PR 8245's "Recover or reject aborted ZeRO backward state")."""
    return is_zero_optimizer(opt) and callable(getattr(type(opt), "_ensure_backward_complete_before_step", None))


class Drains:
    """Counts the drains of ``opt``'s non-empty reduction buckets while
    installed (a wrapper of its drain method, shadowed on the instance);
    ``watched`` is False where this optimizer has no drain graphscale knows
    (then every reached gradient counts as permanent)."""

    __slots__ = ("count", "watched", "_opt", "_name")

    def __init__(self, opt: Any) -> None:
        self.count, self._opt = 0, opt
        name = next((n for n in _DRAIN if callable(getattr(opt, n, None))), None)
        self.watched, self._name = name is not None and isinstance(getattr(opt, "ipg_buckets", None), dict), name
        if not self.watched or name is None:
            return
        drain, buckets, drains = getattr(opt, name), opt.ipg_buckets, self

        def counted(*args: Any, **kwargs: Any) -> Any:
            if any(getattr(b, "params", None) for b in buckets.values()):
                drains.count += 1
            return drain(*args, **kwargs)

        opt.__dict__[name] = counted

    def undo(self) -> None:
        if self._name is not None:
            self._opt.__dict__.pop(self._name, None)


class Attempt:
    """What an engine's governed backward began with, read right after
    DeepSpeed's prologue (``Attempt(engine, drains, earlier)``, also named
    :func:`begin`): ZeRO's hook count, the drain count, whether the buckets
    were set up, whether this window holds an earlier completed backward
    (``earlier``, the caller's to say)."""

    __slots__ = ("fired", "drains", "ready", "earlier")

    def __init__(self, engine: Any, drains: Drains, earlier: bool) -> None:
        opt = engine.optimizer
        state = getattr(opt, "_backward_hook_state", None)  # (_fired(opt), inline: once per engine and backward)
        self.fired = int(getattr(state, "hooks_fired_this_backward", 0))
        self.drains, self.ready, self.earlier = drains.count, bool(getattr(opt, "ready_for_gradients", False)), earlier


def _fired(opt: Any) -> int:
    state = getattr(opt, "_backward_hook_state", None)
    return int(getattr(state, "hooks_fired_this_backward", 0))


begin = Attempt  # the snapshot :func:`discard` measures the attempt against (one call, once per engine and backward)


def reached(opt: Any, attempt: Attempt | None) -> bool:
    """Whether the aborted attempt reached any of the engine's gradients
    (unknown without ZeRO's per-parameter hooks: assumed; no ``attempt``:
    DeepSpeed's prologue did not finish, so none)."""
    if attempt is None:
        return False
    hooked = is_zero_optimizer(opt) and bool(getattr(opt, "_grad_acc_hooks", None)) and hasattr(
        opt, "_backward_hook_state")
    return not hooked or _fired(opt) > attempt.fired


def _permanent(opt: Any, attempt: Attempt | None, drains: Drains | None) -> str | None:
    """Why the aborted attempt may have changed the window for good, or None.
    No ``attempt``: DeepSpeed's prologue did not finish (it raised, e.g. the
    compiled-autograd refusal), so none of the engine's gradients was reached."""
    if attempt is None or drains is None:
        return None
    zero, touched = is_zero_optimizer(opt), reached(opt, attempt)
    if zero and drains.watched and drains.count > attempt.drains:
        return "a reduction bucket was reduced during it, into the window's accumulated gradients"
    if zero and not drains.watched and touched:
        return "it reached gradients of a ZeRO optimizer whose reductions graphscale cannot watch"
    adds_on = _keeps_window_in_grad(opt) or hasattr(opt, "fp32_groups_has_gradients") or getattr(
        opt, "use_grad_accum_attribute", False)  # (bf16's fp32 accumulators; ZeRO 1's grad_accum)
    if touched and attempt.earlier and adds_on:
        return "torch added the gradients it reached onto .grad, which holds this window's earlier micro-steps"
    return None


def _clear_grads(engine: Any, opt: Any) -> None:
    for p in engine.module.parameters():
        p.grad = None
        if getattr(p, "grad_accum", None) is not None:
            p.grad_accum = None
    for flags in getattr(opt, "fp32_groups_has_gradients", ()):  # bf16's fp32 accumulators
        for i in range(len(flags)):
            flags[i] = False


def _empty_buckets(opt: Any) -> None:
    for bucket in getattr(opt, "ipg_buckets", {}).values():
        (getattr(bucket, "clear_params", None) or bucket.clear)()
    large = getattr(opt, "extra_large_param_to_reduce", None)
    if isinstance(large, dict):
        large.clear()
    marks = getattr(opt, "params_already_reduced", None)
    for key in (marks if isinstance(marks, dict) else range(len(marks or ()))):
        marks[key] = False  # type: ignore[index]


def discard(engine: Any, attempt: Attempt | None, drains: Drains | None) -> str | None:
    """Take the aborted attempt's state off ``engine``; return why it may have changed the
    window for good (the engine must fail closed), or None (a clean retry)."""
    opt: Any = getattr(engine, "optimizer", None)
    why = _permanent(opt, attempt, drains)
    engine._manual_backward_expected = False  # (what DeepSpeed's post-backward hook clears)
    if is_zero_optimizer(opt):
        state = getattr(opt, "_backward_hook_state", None)
        if state is not None:
            state.post_backward_callback_queued = False  # the callback torch dropped
            if hasattr(state, "remaining_grad_acc_hooks"):
                state.remaining_grad_acc_hooks = 0
        while opt._backward_active_depth > 0:
            opt.exit_backward()
        _empty_buckets(opt)
        if attempt is not None and not attempt.ready and getattr(opt, "ready_for_gradients", False):
            opt.ready_for_gradients = False  # the attempt set the buckets up, counting a micro-step
            opt.micro_step_id -= 1
    if why is None and attempt is not None and not (attempt.earlier and _keeps_window_in_grad(opt)):
        _clear_grads(engine, opt)  # (else nothing was reached, and .grad is the window's earlier micro-steps)
    return why


def _keeps_window_in_grad(opt: Any) -> bool:
    """Whether the window's earlier micro-steps live in the parameters'
    ``.grad`` (ZeRO 0 and 1) rather than in ZeRO's partitions."""
    return not is_zero_optimizer(opt) or not getattr(opt, "partition_gradients", True)


def fail_closed(engine: Any, name: str, why: str) -> Callable[..., Any]:
    """A function that raises the fail-closed error of ``engine`` (named
    ``name``), whatever it is called with: the engine's forward and step()."""
    stage = engine.zero_optimization_stage()

    def refused(*args: Any, **kwargs: Any) -> Any:
        record_refusal("engine failed closed")
        raise GraphscaleError(
            f"graphscale: DeepSpeed engine {name} (ZeRO {stage}): an aborted backward already contributed to this "
            f"accumulation window ({why}), so it can no longer train exactly.  Fix: discard this engine, build a "
            "new one (deepspeed.initialize, from your last checkpoint) and install graphscale on it, and restart "
            "the accumulation window.  Nothing of this call ran.")

    return refused


def refuse_next(engine: Any, touched: bool) -> None:
    """The first governed prologue of ``engine`` after graphscale discarded
    a failed backward of it that reached some of its gradients (``touched``):
    refuse it at ZeRO 3 when no forward ran since (a retry over the retained
    graph).  Reads DeepSpeed's "backward seen this step" mark, which each
    forward clears.  Where the failed backward reached none of them, the
    engine's own backward never began, and the retry runs as a first one."""
    stage = engine.zero_optimization_stage()
    if touched and stage == 3 and getattr(engine.optimizer, "_backward_seen_this_step", False):
        record_refusal("ZeRO 3 retry over a failed backward")
        raise GraphscaleError(
            "graphscale: a backward over the graph of this ZeRO 3 engine's backward that raised (retain_graph=True, "
            "no forward since): ZeRO 3 cannot run a second backward over a graph whose backward ran (DeepSpeed alone "
            "fails there too, mid-backward, on its partitioned parameters).  Fix: retry the micro-step with a new "
            "forward (engine(batch)); the failed backward was discarded.  Nothing of this backward ran for this "
            "engine.")
