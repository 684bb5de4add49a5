"""Bystanders (issue 13): an unrelated plain model (with and without reentrant
checkpointing), a DDP model (one gloo rank, in this process) and a second,
uninstalled DeepSpeed engine, beside installed groups or an installed
engine, on the fast path (one factor in play) and the walked path (two
factors): their backwards are exactly what they are without graphscale (the
engine's: DeepSpeed's own 1/GAS), under Tensor.backward,
torch.autograd.backward and the uninstalled engine's own engine.backward.
Each case then runs a backward through the installed models, which only a
live graphscale gets right, so a bystander test cannot pass on a graphscale
that governs nothing.

Before issue 13 (main at 4a546fe) every fast-path bystander case here got the
installed factor.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import graphscale
from graphscale._entry import entry as _backward

from helpers.engines import HAVE_DEEPSPEED, require_deepspeed
from helpers.grads import full_grads, max_rel_err
from helpers.ranks import free_port
from helpers.untouched import DS_MARKS, DS_RTOL, POLICIES, Tower, data, grad_of, plain_grads, unequal


# ---------------------------------------------------------------- 2. bystanders
@pytest.fixture
def one_rank(request: pytest.FixtureRequest) -> None:
    """A one-rank gloo process group for DDP (DeepSpeed's, where it is installed)."""
    if HAVE_DEEPSPEED:
        request.getfixturevalue("ds_dist")
        return None
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                             world_size=1)
    return None


@dataclass
class Bystander:
    """A model no group owns: ``call`` runs its forward, ``module`` holds its
    parameters, ``oracle`` is a plain copy made before anything wraps it,
    ``factor`` what DeepSpeed alone multiplies its plain gradient by (1 for
    PyTorch models), ``engine`` its DeepSpeed engine, if it is one."""

    call: Callable[[torch.Tensor], torch.Tensor]
    module: nn.Module
    oracle: nn.Module
    factor: float = 1.0
    engine: Any = None


BYSTANDER_GAS = 2  # the uninstalled engine's own GAS, unlike any installed factor


def _bystander(kind: str, request: pytest.FixtureRequest) -> Bystander:
    if kind in ("plain", "plain_checkpointed"):
        m = Tower(5, reentrant=kind == "plain_checkpointed")
        return Bystander(m, m, copy.deepcopy(m))
    if kind == "ddp":
        request.getfixturevalue("one_rank")
        m = Tower(5)
        oracle = copy.deepcopy(m)
        ddp = nn.parallel.DistributedDataParallel(m)
        return Bystander(ddp, m, oracle)
    assert kind == "uninstalled_engine"
    m = Tower(5)
    oracle = copy.deepcopy(m)  # before initialize
    engine = request.getfixturevalue("make_engine")(m, gas=BYSTANDER_GAS, stage=2)
    engine.set_gradient_accumulation_boundary(True)  # grads readable after one backward
    return Bystander(engine, m, oracle, factor=1.0 / BYSTANDER_GAS, engine=engine)


def _bystander_loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().sum()


STYLES: dict[str, Callable[[Bystander, torch.Tensor], None]] = {
    "Tensor.backward": lambda b, loss: loss.backward(),
    "torch.autograd.backward": lambda b, loss: torch.autograd.backward([loss]),
    "engine.backward": lambda b, loss: b.engine.backward(loss),
}


@dataclass
class Installed:
    """What graphscale governs in a bystander case, and a control backward
    that only a live graphscale gets right: ``control()`` runs it and returns
    the relative error of every installed model's gradient against its
    factor x plain."""

    groups: list[Any]
    control: Callable[[], float]


def _installed(kind: str, path: str, request: pytest.FixtureRequest) -> Installed:
    """``kind``: plain Groups, or a DeepSpeed engine (GAS 4).  ``path``: "fast"
    (one factor, 1/4) or "walked" (a Group with gas 2 beside it)."""
    x, y = data(11), data(12)
    a, c = Tower(1), Tower(2)
    a_ref, c_ref = copy.deepcopy(a), copy.deepcopy(c)
    members: list[tuple[nn.Module, nn.Module, float]] = [(a, a_ref, 1 / 4)]
    engine = None
    if kind == "engine":
        engine = request.getfixturevalue("make_engine")(a, gas=4, stage=2)
        engine.set_gradient_accumulation_boundary(True)
        groups: list[Any] = [engine]
    else:
        groups = [graphscale.Group(a, gas=4, name="a")]
    if path == "walked":
        groups.append(graphscale.Group(c, gas=2, name="c"))
        members.append((c, c_ref, 1 / 2))

    def loss_of(a_fwd: Callable[..., Any], a_mod: nn.Module, c_mod: nn.Module) -> torch.Tensor:
        # an engine's module called directly too: DeepSpeed alone leaves that path unscaled
        out = a_fwd(x) + (a_mod(y) if engine is not None else 0) + (c_mod(y) if path == "walked" else 0)
        return out.square().sum()

    want = []  # the oracle, before anything is installed
    for _, ref, f in members:
        want += [g * f for g in plain_grads(ref, lambda _: loss_of(a_ref, a_ref, c_ref))]

    def control() -> float:
        loss_of(engine if engine is not None else a, a, c).backward()
        got = full_grads(engine) if engine is not None else [grad_of(p) for p in a.parameters()]
        if path == "walked":
            got += [grad_of(p) for p in c.parameters()]
        return max_rel_err(got, want)

    return Installed(groups, control)


def _bystander_cases() -> list[Any]:
    cases = []
    for who in ("plain", "plain_checkpointed", "ddp", "uninstalled_engine"):
        for style in STYLES:
            if style == "engine.backward" and who != "uninstalled_engine":
                continue
            for kind in ("groups", "engine"):
                if who == "uninstalled_engine" and kind == "groups":
                    continue  # a second engine beside an installed engine: the case that matters
                for path in ("fast", "walked"):
                    ds = kind == "engine" or who == "uninstalled_engine"
                    cases.append(pytest.param(who, style, kind, path, marks=DS_MARKS if ds else [],
                                              id=f"{who}-{style}-installed_{kind}-{path}"))
    return cases


@pytest.mark.parametrize("unowned", POLICIES)
@pytest.mark.parametrize("who, style, kind, path", _bystander_cases())
def test_bystander_backward_is_exactly_what_it_is_without_graphscale(
        request: pytest.FixtureRequest, who: str, style: str, kind: str, path: str, unowned: str) -> None:
    bystander = _bystander(who, request)
    installed = _installed(kind, path, request)
    x = data(21)
    oracle = [g * bystander.factor for g in plain_grads(bystander.oracle, lambda m: _bystander_loss(m(x)))]
    with graphscale.install(*installed.groups, unowned=unowned):
        assert _backward.patched()  # the Python entry, or the native front
        STYLES[style](bystander, _bystander_loss(bystander.call(x)))
        control = installed.control()
    if bystander.engine is not None:
        got = full_grads(bystander.engine)
        err = max_rel_err(got, oracle)
        assert err <= DS_RTOL, f"{who}: relative error {err} against DeepSpeed alone's plain x {bystander.factor}"
    else:
        bad = unequal([p.grad for p in bystander.module.parameters()], oracle)
        assert not bad, f"{who} is not bit-equal to plain PyTorch: {bad}"
    assert control <= DS_RTOL, f"the installed models' control backward is off by {control}: graphscale not live?"


@pytest.mark.deepspeed
@require_deepspeed
@pytest.mark.parametrize("style", list(STYLES))
def test_bystander_engine_oracle_is_what_deepspeed_alone_gives(request: pytest.FixtureRequest, style: str) -> None:
    """The oracle of the uninstalled engine above (plain x 1/its GAS) is
    DeepSpeed's own behaviour, in both generations, with nothing installed."""
    bystander = _bystander("uninstalled_engine", request)
    x = data(21)
    oracle = [g * bystander.factor for g in plain_grads(bystander.oracle, lambda m: _bystander_loss(m(x)))]
    STYLES[style](bystander, _bystander_loss(bystander.call(x)))
    err = max_rel_err(full_grads(bystander.engine), oracle)
    assert err <= DS_RTOL, f"DeepSpeed alone: relative error {err} against plain x {bystander.factor}"
