"""The DeepSpeed reference-model pattern of issue 13, one rank of two: the
worker that tests/core/test_untouched.py spawns (``python tests/helpers/workers/untouched.py``,
with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set), and the oracle it
checks against.

A DeepSpeed engine (GAS 4, ZeRO 1, 2 or 3) trains beside a DDP copy of its
model, in the same process, over one accumulation window of 4 micro-steps;
each micro-step runs the engine's forward and backward, then the
reference's forward and a plain ``ref_loss.backward()``.  graphscale is
installed on the engine only ("graphscale"), or not at all
("deepspeed_alone", which shows the oracle below is DeepSpeed's own
contract, not graphscale's invention).

Oracle, computed in every rank from every rank's data with
``torch.autograd.grad`` on a plain copy (no ``.grad`` touched, so no
installation is involved): ``g_i`` = the mean over ranks of the gradient of
micro-step ``i``.

* the reference's ``.grad`` after micro-step ``k`` is ``sum_{i<=k} g_i``
  (DDP averages over ranks; nothing divides by the engine's GAS);
* the engine's full gradient at the boundary (after micro-step 4, before
  ``step()``) is ``sum_i g_i / 4`` (``loss.backward()`` on the engine's
  outputs, and ``engine.scale(loss).backward()``: DeepSpeed's output hooks
  divide by GAS) or ``sum_i g_i`` (``engine.backward(loss,
  scale_wrt_gas=False)``).

Before issue 13 (main at 4a546fe) the fast path multiplied the seed of every
backward by the one factor in play, the reference's included: its gradients
came out x 1/4 and this pattern failed (checked by running the test against
that commit's graphscale: every "graphscale" case of the reference fails
with error 0.75, every engine case passes).

Importing this module needs only torch (pytest imports every file under
tests/ for doctests); the worker imports deepspeed.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from helpers.ranks import deepspeed_rank, finish

__all__ = ["STAGES", "VARIANTS", "MODES", "GAS", "MICRO_STEPS", "run_case", "main"]

STAGES = (1, 2, 3)
GAS = 4
MICRO_STEPS = 4  # one accumulation window


def _loss_backward(engine: Any, loss: torch.Tensor) -> None:
    loss.backward()


def _engine_backward_no_gas(engine: Any, loss: torch.Tensor) -> None:
    engine.backward(loss, scale_wrt_gas=False)


def _scale_backward(engine: Any, loss: torch.Tensor) -> None:
    engine.scale(loss).backward()


# variant -> (how the engine's backward is called, the engine's factor per DeepSpeed's contract)
VARIANTS: dict[str, tuple[Callable[[Any, torch.Tensor], None], float]] = {
    "loss.backward": (_loss_backward, 1 / GAS),
    "engine.backward(scale_wrt_gas=False)": (_engine_backward_no_gas, 1.0),
    "engine.scale(loss).backward": (_scale_backward, 1 / GAS),
}
MODES = ("graphscale", "deepspeed_alone")


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def _data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(100 * rank + step))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want, strict=True))


def _ratio(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """|got| / |want| over all tensors: 1 when right, 0.25 when scaled by 1/4."""
    num = sum(float(g.double().square().sum()) for g in got) ** 0.5
    den = sum(float(w.double().square().sum()) for w in want) ** 0.5
    return num / den


def run_case(stage: int, variant: str, mode: str, rank: int, world: int) -> dict[str, Any]:
    """One engine and its DDP reference over one window: the reference's
    relative gradient error after each micro-step, the engine's at the
    boundary, and the ratios of each to its oracle (readable failures)."""
    import deepspeed

    import graphscale

    from helpers.engines import ds_config  # it imports graphscale: here, not at the module's import (torch only)
    from helpers.grads import full_grads  # it imports graphscale: here, not at the module's import (torch only)

    backward, factor = VARIANTS[variant]
    model = _net(1)
    oracle = copy.deepcopy(model)  # plain: torch.autograd.grad only
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    cfg = ds_config(GAS, stage, micro_batch=2, clip=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=cfg)
    inst = graphscale.install(engine) if mode == "graphscale" else None
    want = [torch.zeros_like(p) for p in oracle.parameters()]
    out: dict[str, Any] = {"ref": [], "ref_ratio": []}
    try:
        for step in range(MICRO_STEPS):
            x = _data(rank, step)
            backward(engine, _loss(engine(x)))
            _loss(ref(x)).backward()
            for r in range(world):
                gs = torch.autograd.grad(_loss(oracle(_data(r, step))), list(oracle.parameters()))
                for w, g in zip(want, gs):
                    w += g / world
            got = [p.grad.detach().clone() for p in ref.module.parameters()]
            out["ref"].append(_rel(got, want))
            out["ref_ratio"].append(_ratio(got, want))
            if step < MICRO_STEPS - 1:
                engine.step()  # a no-op before the boundary, but DeepSpeed's bookkeeping expects it
        got = full_grads(engine, cpu=False)
        expected = [w * factor for w in want]
        out["engine"] = _rel(got, expected)
        out["engine_ratio"] = _ratio(got, expected)
        engine.step()
    finally:
        if inst is not None:
            inst.remove()
    return out


def main() -> None:
    """One spawned rank: every case, results as JSON on stdout."""
    rank, world = deepspeed_rank()
    linear = torch.nn.functional.linear
    results: dict[str, Any] = {}
    for stage in STAGES:
        for variant in VARIANTS:
            for mode in MODES:
                key = f"{stage}/{variant}/{mode}"
                try:
                    results[key] = run_case(stage, variant, mode, rank, world)
                except Exception as exc:  # reported per case; the other cases still run
                    results[key] = {"error": f"{type(exc).__name__}: {exc}"}
                finally:
                    torch.nn.functional.linear = linear  # ZeRO-3 replaces it process-wide
    torch.distributed.barrier()
    finish(results)  # NOT the interpreter's teardown: tests/helpers/ranks.py


if __name__ == "__main__":  # graphscale comes from $PYTHONPATH (the spawning test puts the repo first)
    main()
