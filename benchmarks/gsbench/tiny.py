"""graphscale's fixed cost per governed backward where the walk is
negligible: two DeepSpeed engines of one Linear(8, 8) each (ZeRO-1), four
ways of calling backward, each in interleaved blocks with and without
graphscale installed, in one process.

NOTE [ Tiny fixed cost ]
For each case, round after round, a block of backwards under DeepSpeed alone
and a block under ``graphscale.install(...)`` (which goes first alternates);
each block's median backward time, and per round graphscale's block minus
DeepSpeed's.  The case's cost is the median of those differences: what
graphscale adds to one backward, with nothing to walk (a dozen nodes).
The targets are issue 28's: <= 20 us mixed factors through
``loss.backward()``, <= 35 us through ``engine.backward``, <= 10 us on the
fast path (one factor), <= 35 us with one reentrant-checkpointed engine
(one nested backward).  graphscale is installed for a block: its 3
untimed backwards make every timed one warm, as in a user's loop.
"""
from __future__ import annotations

import gc
import time
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

import graphscale

from .env import make_engine, sync
from .stats import med, median_notch

TARGETS_US = {"mixed, loss.backward()": 20.0, "mixed, engine.backward": 35.0, "fast path (one factor)": 10.0,
              "one nested (reentrant checkpoint)": 35.0}
BLOCK, WARM = 10, 3  # backwards per block (timed), and untimed before them


class _Checkpointed(torch.nn.Module):
    """One Linear(8, 8) behind a reentrant checkpoint: one nested backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.lin, x, use_reentrant=True)


Case = tuple[tuple[Any, ...], Callable[[], Any], Callable[[Any], None]]


def cases(device: str) -> dict[str, Case]:
    """name -> (engines to install, make the loss, run its backward)."""
    torch.manual_seed(0)
    a2, b4, b2 = (make_engine(torch.nn.Linear(8, 8).to(device), gas=g) for g in (2, 4, 2))
    c2 = make_engine(_Checkpointed().to(device), gas=2)
    x = torch.randn(2, 8, device=device)
    xr = torch.randn(2, 8, device=device, requires_grad=True)  # reentrant checkpoint needs an input with grad

    def mixed() -> Any:
        return a2(x).pow(2).mean() + b4(x).pow(2).mean()

    return {
        "mixed, loss.backward()": ((a2, b4), mixed, lambda loss: loss.backward()),
        "mixed, engine.backward": ((a2, b4), mixed, lambda loss: a2.backward(loss)),
        "fast path (one factor)": ((a2, b2), lambda: a2(x).pow(2).mean() + b2(x).pow(2).mean(),
                                   lambda loss: loss.backward()),
        "one nested (reentrant checkpoint)": ((c2, b4), lambda: c2(xr).pow(2).mean() + b4(x).pow(2).mean(),
                                              lambda loss: loss.backward()),
    }


def _block(make: Callable[[], Any], run: Callable[[Any], None], device: str) -> float:
    for _ in range(WARM):
        run(make())
    times = []
    for _ in range(BLOCK):
        loss = make()
        sync(device)
        t0 = time.perf_counter()
        run(loss)
        sync(device)
        times.append(time.perf_counter() - t0)
    return med(times)


def measure(case: Case, rounds: int, device: str) -> dict[str, Any]:
    """NOTE [ Tiny fixed cost ] for one case: us added per backward."""
    engines, make, run = case
    diffs, alone = [], []
    for rnd in range(rounds + 2):  # 2 warm-up rounds dropped
        got: dict[bool, float] = {}
        for governed in ((False, True) if rnd % 2 else (True, False)):
            if governed:
                with graphscale.install(*engines):
                    got[governed] = _block(make, run, device)
            else:
                got[governed] = _block(make, run, device)
        if rnd >= 2:
            diffs.append((got[True] - got[False]) * 1e6)
            alone.append(got[False] * 1e6)
    for e in engines:
        e.module.zero_grad(set_to_none=True)
    return {"added_us": med(diffs), "notch_us": median_notch(diffs), "deepspeed_us": med(alone), "rounds": rounds}


def tiny_fixed_costs(rounds: int, device: str) -> dict[str, dict[str, Any]]:
    """Every case of :func:`cases`, garbage collector frozen and off meanwhile."""
    out = {}
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        for name, case in cases(device).items():
            out[name] = {**measure(case, rounds, device), "target_us": TARGETS_US[name]}
    finally:
        gc.enable()
        gc.unfreeze()
    return out
