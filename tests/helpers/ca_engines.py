"""Two DeepSpeed engines in one loss under compiled autograd, trained step
after step beside plain copies: an actor A (GAS 2) whose output feeds a
critic B (GAS 4) and a side path of its own.  Shared by
tests/deepspeed_engines/test_compiled_autograd_engines.py (under graphscale)
and tests/helpers/workers/ca_alone.py (DeepSpeed alone, in a fresh
interpreter): imports neither graphscale nor, until called, deepspeed."""
from __future__ import annotations

import copy
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

import torch

GAS = {"A": 2, "B": 4}
STEPS = 8  # two windows of B's, four of A's
CALLS = ("loss", "engine:A", "engine:B")
SWITCHES = ("torch", "deepspeed")


def _models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(7)
    return {"A": torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4)),
            "B": torch.nn.Linear(4, 1)}


def _loss(m: dict[str, Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    h = m["A"](x)
    return m["B"](h).sum() + h.pow(2).mean()


def _batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11 + 1000 * rank)
    return [torch.randn(2, 4, generator=g) for _ in range(STEPS)]


def train(switch: str, call: str, stage: int, configs: dict[str, dict[str, Any]],
          install: Callable[..., AbstractContextManager[Any]] | None = None, rank: int = 0,
          world: int = 1) -> dict[str, Any]:
    """STEPS micro-steps with ``step()`` of both engines (ZeRO ``stage``,
    ``configs[name]`` each) under compiled autograd, switched on by
    ``switch`` (torch's ``_enable`` around the backward, or DeepSpeed's
    ``engine.compile(compiled_autograd_enabled=True)``), the backward called
    as ``call``; inside ``install(A, B)`` where given.  Returns ``ok`` (it
    ran), ``error``, ``err`` (the weights' max relative error against plain
    SGD on the copies, each model's mean gradient over its window) and
    ``captures`` (compiled autograd's, after each micro-step).  On ``world``
    ranks each rank trains on its own batches (``rank``'s), and the reference
    averages the ranks' plain gradients, so a missing reduction shows."""
    import deepspeed
    import torch._dynamo
    import torch._dynamo.compiled_autograd as ca
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    models = _models()
    refs = copy.deepcopy(models)
    engines = {}
    for n, m in models.items():
        engines[n], *_ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                              config={**configs[n], "zero_optimization": {"stage": stage}})
        if switch == "deepspeed":
            engines[n].compile(backend="eager", compiled_autograd_enabled=True)
    opts = {n: torch.optim.SGD(r.parameters(), lr=0.1) for n, r in refs.items()}
    captures: list[int] = []
    out: dict[str, Any] = {"ok": True, "error": "", "err": None, "captures": captures}
    batches = _batches(rank)
    try:
        with install(*engines.values()) if install is not None else nullcontext():
            for x in batches:
                loss = _loss(engines, x)
                with ca._enable(torch.compile(backend="eager")) if switch == "torch" else nullcontext():
                    loss.backward() if call == "loss" else engines[call[-1]].backward(loss)
                for e in engines.values():
                    e.step()
                captures.append(int(counters["compiled_autograd"]["captures"]))
    except Exception as exc:  # the outcome, recorded
        out.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        return out
    every = [_batches(r) for r in range(world)]
    for i in range(STEPS):  # the reference: the ranks' mean plain gradient, over each model's window
        params = [p for r in refs.values() for p in r.parameters()]
        plain = [sum(gs) / world for gs in zip(*(torch.autograd.grad(_loss(refs, b[i]), params) for b in every))]
        k = 0
        for n, r in refs.items():
            for p in r.parameters():
                g = plain[k] / GAS[n]
                p.grad = g if p.grad is None else p.grad + g
                k += 1
            if (i + 1) % GAS[n] == 0:
                opts[n].step()
                opts[n].zero_grad()
    got = [p.detach().float().cpu() for e in engines.values() for p in e.module.parameters()]
    want = [p.detach() for r in refs.values() for p in r.parameters()]
    start = [p.detach() for m in _models().values() for p in m.parameters()]
    out["err"] = max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want))
    out["moved"] = max(((g - s).abs().max() / s.abs().max()).item() for g, s in zip(got, start))
    return out
