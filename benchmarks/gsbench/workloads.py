"""The rows' graphs: a :class:`Workload` per row, over two DeepSpeed engines
(actor GAS 2, critic GAS 4), and the plain-PyTorch oracle they are checked
against."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .env import make_engine
from .models import Tower, hf_checkpointing, make_hf_modules
from .spec import HF_VOCAB, Size


@dataclass
class Workload:
    """One row's graph.

    ``batch(gen)`` makes fresh inputs for one run; ``loss(batch, plain)`` runs
    the forward and returns a scalar (``plain=True``: the oracle's forward,
    through the bare modules, no engine); ``checkpoint(on)`` switches this
    row's activation checkpointing on or off (the oracle runs with it off);
    ``caller.backward(loss)`` is the backward that is timed."""

    engines: tuple[Any, ...]
    caller: Any
    loss: Callable[[tuple[Any, ...], bool], Any]
    batch: Callable[[Any], tuple[Any, ...]]
    checkpoint: Callable[[bool], None] = lambda on: None


def tower_workloads(actor: Any, critic: Any, size: Size, device: str) -> dict[str, Workload]:
    """W1-W6 over two tower engines."""
    shape = (size.batch, size.seq, size.hidden)

    def batch(gen: Any) -> tuple[Any, ...]:
        return torch.randn(shape, generator=gen).to(device), torch.randn(shape, generator=gen).to(device)

    def fwd(engine: Any, plain: bool) -> Any:
        return engine.module if plain else engine

    def w1(b: tuple[Any, ...], plain: bool) -> Any:
        return fwd(actor, plain)(b[0]).pow(2).mean()

    def w2(b: tuple[Any, ...], plain: bool) -> Any:
        return fwd(actor, plain)(b[0]).pow(2).mean() + fwd(critic, plain)(b[0]).pow(2).mean()

    def w3(b: tuple[Any, ...], plain: bool) -> Any:
        return fwd(critic, plain)(fwd(actor, plain)(b[0])).pow(2).mean()

    def w4(b: tuple[Any, ...], plain: bool) -> Any:
        return fwd(actor, plain)(b[0]).pow(2).mean() + actor.module(b[1]).pow(2).mean()

    def checkpointing(mode: str) -> Callable[[bool], None]:
        def switch(on: bool) -> None:
            for e in (actor, critic):
                e.module.checkpointing = mode if on else None

        return switch

    one, two = (actor,), (actor, critic)
    return {
        "W1": Workload(one, actor, w1, batch),
        "W2": Workload(two, actor, w2, batch),
        "W3": Workload(two, actor, w3, batch),
        "W4": Workload(one, actor, w4, batch),
        "W5": Workload(two, actor, w2, batch, checkpointing("reentrant")),
        "W6": Workload(two, actor, w2, batch, checkpointing("non-reentrant")),
    }


def hf_workloads(actor: Any, critic: Any, size: Size, device: str) -> dict[str, Workload]:
    """PPO-style: the actor's clipped policy term on its log-probabilities of
    the tokens with fixed advantages (first epoch: the old policy is this one,
    detached), plus the critic's squared value error against fixed returns."""
    b, t = size.batch, size.seq

    def batch(gen: Any) -> tuple[Any, ...]:
        ids = torch.randint(0, HF_VOCAB, (b, t), generator=gen)
        adv, ret = torch.randn(b, t - 1, generator=gen), torch.randn(b, t, generator=gen)
        return ids.to(device), adv.to(device), ret.to(device)

    def ppo(bt: tuple[Any, ...], plain: bool) -> Any:
        ids, adv, ret = bt
        a = actor.module if plain else actor
        c = critic.module if plain else critic
        logits = a(input_ids=ids, use_cache=False).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        policy = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
        value = 0.5 * (c(ids) - ret).pow(2).mean()
        return policy + value

    def checkpointing(on: bool) -> None:
        hf_checkpointing(actor.module, on)
        hf_checkpointing(critic.module.backbone, on)

    two = (actor, critic)
    return {"HF1": Workload(two, actor, ppo, batch), "HF2": Workload(two, actor, ppo, batch, checkpointing)}


def family_workloads(family: str, layers: int, size: Size, device: str) -> dict[str, Workload]:
    """Fresh actor (GAS 2) and critic (GAS 4) engines, seed 0, and the rows
    over them: ``family`` "tower" (W1-W6, ``layers`` blocks of width
    ``size.hidden``) or "hf" (HF1, HF2: GPT-2, ``layers`` x ``size.hidden``)."""
    return _family(family, layers, size, device)


def _family(family: str, layers: int, size: Size, device: str) -> dict[str, Workload]:
    torch.manual_seed(0)
    if family == "tower":
        actor_m, critic_m = Tower(size.hidden, layers).to(device), Tower(size.hidden, layers).to(device)
    else:
        actor_m, critic_m = make_hf_modules(layers, size.hidden, device)
    actor, critic = make_engine(actor_m, gas=2), make_engine(critic_m, gas=4)
    build = tower_workloads if family == "tower" else hf_workloads
    return build(actor, critic, size, device)


def tiny_pair(device: str) -> Workload:
    """Two engines of one Linear(8, 8) each (GAS 2, 4) under one summed loss:
    a backward that costs almost nothing but DeepSpeed's own bookkeeping."""
    torch.manual_seed(0)
    actor = make_engine(torch.nn.Linear(8, 8).to(device), gas=2)
    critic = make_engine(torch.nn.Linear(8, 8).to(device), gas=4)

    def batch(gen: Any) -> tuple[Any, ...]:
        return (torch.randn(2, 8, generator=gen).to(device),)

    def loss(b: tuple[Any, ...], plain: bool) -> Any:
        a, c = (actor.module, critic.module) if plain else (actor, critic)
        return a(b[0]).pow(2).mean() + c(b[0]).pow(2).mean()

    return Workload((actor, critic), actor, loss, batch)


# ----------------------------------------------------------------------------- gradients
def oracle(wl: Workload, batch: tuple[Any, ...]) -> list[Any]:
    """Plain PyTorch: gradient of the same loss, times 1/GAS of the owner."""
    params, factors = [], []
    for e in wl.engines:
        for p in e.module.parameters():
            params.append(p)
            factors.append(1.0 / e.gradient_accumulation_steps())
    wl.checkpoint(False)
    loss = wl.loss(batch, True)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g * f for g, p, f in zip(grads, params, factors)]


def max_rel_err(got: list[Any], want: list[Any]) -> float:
    worst = 0.0
    for g, w in zip(got, want):
        scale = w.abs().max().item() or 1.0
        g = torch.zeros_like(w) if g is None else g
        worst = max(worst, (g.float() - w.float()).abs().max().item() / scale)
    return worst


def zero_grads(engines: Any) -> None:
    for e in engines:
        e.zero_grad()
        for p in e.module.parameters():
            p.grad = None


def grads_of(engines: Any) -> list[Any]:
    from deepspeed.utils import safe_get_full_grad

    out = []
    for e in engines:
        for p in e.module.parameters():
            g = safe_get_full_grad(p)
            out.append(None if g is None else g.detach().float().clone())
    return out


def count_nodes(loss: Any) -> int:
    """The ``grad_fn`` nodes reachable from ``loss`` (the outer graph: a
    checkpointed block is one node), each counted once."""
    seen, stack = {loss.grad_fn}, [loss.grad_fn]
    while stack:
        for nxt, _ in stack.pop().next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return len(seen)
