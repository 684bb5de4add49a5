"""Outputs made before ``install()`` stay exact in a process that called
``gc.freeze()`` (found while measuring install() cost for the benchmark: an
install that searched the heap for DeepSpeed's hook managers missed the
frozen ones and divided twice; install searches no heap now, NOTE [
DeepSpeed's two generations ]).

``gc.freeze()`` moves every live object to the collector's permanent
generation, which ``gc.get_referrers`` / ``gc.get_objects`` do not scan.
Servers and data-loader set-ups call it to avoid copy-on-write after fork;
the benchmark calls it to keep torch's objects out of timed collections."""
from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch

import graphscale

from helpers.engines import require_deepspeed


@require_deepspeed
@pytest.mark.deepspeed
def test_outputs_made_before_install_are_exact_after_gc_freeze(make_engine: Any) -> None:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    plain_a, plain_b = copy.deepcopy(a), copy.deepcopy(b)
    ea, eb = make_engine(a, gas=2, stage=1), make_engine(b, gas=4, stage=1)
    x = torch.randn(2, 3)
    loss = ea(x).sum() + eb(x).sum()  # DeepSpeed's output hooks are registered here, before install
    (plain_a(x).sum() + plain_b(x).sum()).backward()  # the oracle: plain PyTorch, same graph
    gc.freeze()
    try:
        with graphscale.install(ea, eb):
            loss.backward()
    finally:
        gc.unfreeze()
    got = {"A": ea.module.weight.grad, "B": eb.module.weight.grad}
    want = {"A": plain_a.weight.grad / 2, "B": plain_b.weight.grad / 4}
    wrong = {n: (got[n] / want[n]).flatten().tolist() for n in got if not torch.allclose(got[n], want[n], rtol=1e-6)}
    assert not wrong, f"gradient / (plain / GAS) per engine, want 1.0: {wrong}"


@require_deepspeed
@pytest.mark.deepspeed
def test_deepspeed_alone_divides_outputs_made_before_a_gc_freeze_once(make_engine: Any) -> None:
    """The same graph without graphscale: DeepSpeed divides every engine by its
    own GAS exactly once here (a direct ``loss.backward()``), so the double
    division above is graphscale's, not DeepSpeed's."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    plain_a, plain_b = copy.deepcopy(a), copy.deepcopy(b)
    ea, eb = make_engine(a, gas=2, stage=1), make_engine(b, gas=4, stage=1)
    x = torch.randn(2, 3)
    loss = ea(x).sum() + eb(x).sum()
    (plain_a(x).sum() + plain_b(x).sum()).backward()
    gc.freeze()
    try:
        loss.backward()
    finally:
        gc.unfreeze()
    assert torch.allclose(ea.module.weight.grad, plain_a.weight.grad / 2, rtol=1e-6)
    assert torch.allclose(eb.module.weight.grad, plain_b.weight.grad / 4, rtol=1e-6)
