"""Issues 31 and 37: a backward that raises, then a retry, then training on: the
worker that tests/deepspeed_engines/test_failed_backward.py spawns once per world size
(``python tests/helpers/workers/failed_backward.py``, with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set), and the plain-PyTorch oracle it checks against.

One engine (ZeRO 1, 2 or 3, GAS 2, SGD) over one accumulation window of two
micro-steps.  In micro-step ``fail_at`` (0: not the boundary, 1: the
boundary) the first backward raises, from ``where``:

* ``recompute``: the recompute forward of a non-reentrant checkpoint
  (DeepSpeed's own ``test_recompute_forward_exception_unwinds_for_clean_retry``);
* ``recompute_reentrant``: the same in a reentrant checkpoint (a nested backward);
* ``module_backward``: a custom autograd Function's backward;
* ``user_hook``: a tensor hook the user registered on an activation;
* ``after_head``: a custom autograd Function's backward on the model's
  output, so the backward raises after the engine's part began (its output
  hook ran DeepSpeed's prologue) and before it reached any of its gradients.

With two engines (an actor and a critic on its output, in one loss), the
actor fails after the critic's gradients were computed.

The user catches the error and retries the micro-step with another batch
(a new forward and backward), then ``step()``; the other micro-step runs
as usual.  Every backward is ``engine.backward(loss)``, or a direct
``loss.backward()``, or the failing one ``engine.backward(loss)`` and its
retry ``loss.backward()`` as in DeepSpeed's test (``style``), under
graphscale or DeepSpeed alone.

Oracle, the clean control of NOTE [ An aborted backward counts for nothing ]
(graphscale/_adapters/deepspeed/failed.py), computed in every rank from
every rank's data on a plain copy of the model: the same window without the
failed attempt (the retry's batch in its place; a retry over the retained
graph backpropagates the failed attempt's batch), gradients summed over the
window and averaged over ranks; then ``w -= lr * grad / GAS``.  The result
is the weights after ``step()`` against the oracle's, or the error that
stopped the window and the call that raised it (``at``: ``forward``,
``backward`` or ``step``), and what DeepSpeed left behind right after the
failed backward.

Importing this module needs only torch; the worker imports deepspeed.
"""
from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from helpers.ranks import deepspeed_rank, finish

__all__ = ["STAGES", "STYLES", "WHERES", "FAIL_AT", "MODES", "TWO_ENGINE_WHERES", "GAS", "run_case", "main"]

STAGES = (1, 2, 3)
# mixed: engine.backward fails, loss.backward retries; retained: loss.backward(retain_graph=True) fails, and
# the retry is loss.backward() over the same graph (no new forward)
STYLES = ("engine.backward", "loss.backward", "mixed", "retained")
WHERES = ("recompute", "recompute_reentrant", "module_backward", "user_hook", "after_head")
FAIL_AT = (0, 1)
MODES = ("graphscale", "deepspeed_alone")
TWO_ENGINE_WHERES = ("recompute", "user_hook", "after_head")  # actor + critic in one loss: under graphscale only
GAS = 2
LR = 0.1
# float32 weights after one SGD step of lr 0.1; measured 9.2e-8 (one rank)
WEIGHTS_RTOL = 1e-6


class Injected(RuntimeError):
    """The error the model raises on purpose."""


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, control: dict[str, bool]) -> torch.Tensor:
        ctx.control = control
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.control["raise"]:
            raise Injected("injected: a module's backward")
        return grad, None


class Net(torch.nn.Module):
    """head(block(l1 x)): ``block`` (l2, tanh) is where the backward raises,
    so the head's gradients are computed before it and l1's and l2's never."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(4, 8)
        self.l2 = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 2)
        self.where = where
        self.control = {"raise": False}

    def _block(self, h: torch.Tensor) -> torch.Tensor:
        if self.where.startswith("recompute") and self.control["raise"] and torch.is_grad_enabled() \
                and torch._C._current_graph_task_id() != -1:
            raise Injected("injected: a checkpoint's recompute forward")
        return torch.tanh(self.l2(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        if self.where == "recompute":
            h = checkpoint(self._block, h, use_reentrant=False)
        elif self.where == "recompute_reentrant":
            h = checkpoint(self._block, h, use_reentrant=True)
        else:
            h = self._block(h)
        if self.where == "module_backward":
            h = _RaiseInBackward.apply(h, self.control)
        elif self.where == "user_hook" and h.requires_grad:
            control = self.control

            def hook(grad: torch.Tensor) -> torch.Tensor:
                if control["raise"]:
                    raise Injected("injected: a user's tensor hook")
                return grad

            h.register_hook(hook)
        out = self.head(h)
        return _RaiseInBackward.apply(out, self.control) if self.where == "after_head" else out


def _data(rank: int, step: int, attempt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + attempt)
    return torch.randn(2, 4, generator=g, requires_grad=True)  # an input that needs grad: reentrant checkpoints


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _fail_then_retry(forward_backward: Any, control: dict[str, bool], step: int, fail_at: int) -> int:
    """Run micro-step ``step`` (retried once if it is ``fail_at``); how many backwards raised."""
    if step != fail_at:
        forward_backward(1)
        return 0
    control["raise"] = True
    try:
        forward_backward(0)
    except Injected:
        raised = 1
    else:
        raised = 0
    control["raise"] = False
    forward_backward(1)
    return raised


def models(where: str, engines: int) -> list[torch.nn.Module]:
    """The actor (``Net``), and with ``engines=2`` a critic on its output: one
    engine each.  The failure is in the actor, after the critic's gradients
    and the actor head's are computed."""
    torch.manual_seed(1)
    out: list[torch.nn.Module] = [Net(where)]
    if engines == 2:
        torch.manual_seed(2)
        out.append(torch.nn.Linear(2, 1))
    return out


def _forward(mods: list[Any], x: torch.Tensor) -> torch.Tensor:
    y = mods[0](x)
    return mods[1](y) if len(mods) > 1 else y


def oracle(where: str, fail_at: int, world: int, engines: int = 1, style: str = "") -> list[torch.Tensor]:
    """The weights after one window on plain PyTorch, as if the failed attempt never ran (module docstring)."""
    mods = models(where, engines)
    params = [p for m in mods for p in m.parameters()]
    total = [torch.zeros_like(p) for p in params]
    for r in range(world):
        for m in mods:
            m.zero_grad(set_to_none=True)
        for step in range(GAS):
            attempt = 0 if style == "retained" and step == fail_at else 1  # the batch the window's backward used
            _loss(_forward(mods, _data(r, step, attempt))).backward()
        for t, p in zip(total, params):
            if p.grad is not None:
                t.add_(p.grad)
    fresh = [p for m in models(where, engines) for p in m.parameters()]
    return [(p - LR * t / world / GAS).detach() for p, t in zip(fresh, total)]


def _left_behind(engine: Any) -> dict[str, Any]:
    """What DeepSpeed keeps of a backward between its end and the next forward."""
    opt = engine.optimizer
    state: dict[str, Any] = {"depth": getattr(opt, "_backward_active_depth", None)}
    hook_state = getattr(opt, "_backward_hook_state", None)
    if hook_state is not None:
        state["callback_queued"] = bool(hook_state.post_backward_callback_queued)
    buckets = getattr(opt, "ipg_buckets", None)  # comm dtype -> bucket
    if isinstance(buckets, dict):
        state["bucket_params"] = sum(len(b.params) for b in buckets.values())
    return state


def run_case(stage: int, style: str, where: str, fail_at: int, mode: str, rank: int, world: int,
             engines: int = 1) -> dict[str, Any]:
    """One window (module docstring): the weights' relative error against the
    oracle after ``step()``, or the error that stopped it.  ``engines=2``: an
    actor and a critic engine in one loss (``engine.backward`` is the actor's)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    import graphscale

    from helpers.engines import ds_config  # it imports graphscale: here, not at the module's import (torch only)

    mods = models(where, engines)
    model = mods[0]
    want = oracle(where, fail_at, world, engines, style)
    cfg = ds_config(GAS, stage, micro_batch=2, clip=0.0)
    eng = [deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=LR), config=cfg)[0]
           for m in mods]
    engine = eng[0]
    inst = graphscale.install(*eng) if mode == "graphscale" else None
    out: dict[str, Any] = {}
    try:
        for step in range(GAS):
            kept: dict[int, torch.Tensor] = {}

            def fb(attempt: int, step: int = step, kept: dict[int, torch.Tensor] = kept) -> None:
                out["at"] = "backward"
                if style == "retained" and attempt == 1 and kept:
                    kept.pop(0).backward()  # over the failed backward's graph
                    return
                out["at"] = "forward"
                loss = _loss(_forward(eng, _data(rank, step, attempt)))
                out["at"] = "backward"
                if style == "engine.backward" or (style == "mixed" and attempt == 0):
                    engine.backward(loss)
                elif style == "retained" and attempt == 0:
                    kept[0] = loss
                    loss.backward(retain_graph=True)
                else:
                    loss.backward()

            try:
                raised = _fail_then_retry(fb, model.control, step, fail_at)
            except Exception as exc:
                out["error"] = f"micro-step {step}: {type(exc).__name__}: {str(exc)[:300]}"
                return out
            if step == fail_at:
                out["raised"] = raised
            out["at"] = "step"
            try:
                for e in eng:
                    e.step()
            except Exception as exc:
                out["error"] = f"step() after micro-step {step}: {type(exc).__name__}: {str(exc)[:300]}"
                return out
        del out["at"]
        got = [safe_get_full_fp32_param(p).detach().float().clone() for e in eng for p in e.module.parameters()]
        out["weights"] = max(((g - w).abs().max() / (w.abs().max() or 1.0)).item() for g, w in zip(got, want))
    finally:
        if inst is not None:
            inst.remove()
        model.control["raise"] = False
    return out


def left_behind_case(stage: int, style: str, where: str, mode: str) -> dict[str, Any]:
    """What the engine holds right after a failed first backward of a window."""
    import deepspeed

    import graphscale

    from helpers.engines import ds_config  # it imports graphscale: here, not at the module's import (torch only)

    torch.manual_seed(1)
    model = Net(where)
    cfg = ds_config(GAS, stage, micro_batch=2, clip=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=cfg)
    inst = graphscale.install(engine) if mode == "graphscale" else None
    model.control["raise"] = True
    try:
        loss = _loss(engine(_data(0, 0, 0)))
        try:
            engine.backward(loss) if style == "engine.backward" else loss.backward()
        except Injected:
            pass
        return _left_behind(engine)
    finally:
        model.control["raise"] = False
        if inst is not None:
            inst.remove()


def main() -> None:
    """One spawned rank: every case, results as JSON on stdout."""
    rank, world = deepspeed_rank()
    linear = torch.nn.functional.linear
    only = os.environ.get("FAILED_BACKWARD_CASES")  # e.g. "3/loss.backward" (a prefix filter, for debugging)
    results: dict[str, Any] = {}
    for stage in STAGES:
        for style in STYLES:
            for where in WHERES:
                for fail_at in FAIL_AT:
                    for mode in MODES:
                        key = f"{stage}/{style}/{where}/{fail_at}/{mode}"
                        if only and not key.startswith(only):
                            continue
                        try:
                            results[key] = run_case(stage, style, where, fail_at, mode, rank, world)
                        except Exception as exc:  # reported per case; the other cases still run
                            results[key] = {"error": f"{type(exc).__name__}: {exc}"}
                        finally:
                            torch.nn.functional.linear = linear  # ZeRO-3 replaces it process-wide
                for fail_at in FAIL_AT if style in STYLES[:2] and where in TWO_ENGINE_WHERES else ():
                    key = f"{stage}/{style}/{where}/{fail_at}/graphscale/two_engines"
                    if only and not key.startswith(only):
                        continue
                    try:
                        results[key] = run_case(stage, style, where, fail_at, "graphscale", rank, world, engines=2)
                    except Exception as exc:
                        results[key] = {"error": f"{type(exc).__name__}: {exc}"}
                    finally:
                        torch.nn.functional.linear = linear
                for mode in MODES if world == 1 and style in STYLES[:2] else ():
                    key = f"{stage}/{style}/{where}/left_behind/{mode}"
                    if only and not key.startswith(only):
                        continue
                    try:
                        results[key] = left_behind_case(stage, style, where, mode)
                    finally:
                        torch.nn.functional.linear = linear
    torch.distributed.barrier()
    finish(results)  # NOT the interpreter's teardown: tests/helpers/ranks.py


if __name__ == "__main__":  # graphscale comes from $PYTHONPATH (the spawning test puts the repo first)
    main()
