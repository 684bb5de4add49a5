"""DeepSpeed's ``managed_gradient_accumulation: false``: the caller owns the
accumulation boundary (backward only accumulates; ``step()`` reduces and
updates), and DeepSpeed's docs tell such callers to average the loss
themselves and pass ``scale_wrt_gas=False``.

What graphscale does with such engines is what it does with any engine: a
factor of ``1/GAS`` (the engine's configured GAS) under ``scale_wrt_gas=True``,
1 under ``scale_wrt_gas=False``, and ``Group(engine, factor=...)`` for a
caller who counts its micro-batches itself.  Each mode is checked here on real
engines at ZeRO 1-3, both backward styles, over two caller-owned windows of
3 micro-batches with ``step()`` at each window's end, against a plain
reference stepped with the sum of the plain gradients times each engine's
factor.  Without graphscale the three modes that need it fail (measured: 8
of 12 cases); the caller-averaged ``scale_wrt_gas=False`` mode is exact
either way, and stays so.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import graphscale

from helpers.engines import ds_config, require_deepspeed
from helpers.training import GAS, Net, data, fp32_params, rel_err

pytestmark = [pytest.mark.deepspeed, require_deepspeed]

N = 3  # micro-batches per caller-owned window: not either engine's GAS
WINDOWS = 2
LR = 0.1


def _loss(m: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (m["A"](x) + m["A"](y) + m["B"](y)).square().sum()  # A twice: its lifecycle once per backward


# mode -> (how the engines are installed, how backward is called, each engine's factor)
MODES = {
    "scale_wrt_gas_false_loss_averaged": ("engines", "engine:A:noscale", {"A": 1.0 / N, "B": 1.0 / N}),
    "engine_backward_scales_by_gas": ("engines", "engine:A", {"A": 1.0 / GAS["A"], "B": 1.0 / GAS["B"]}),
    "loss_backward_scales_by_gas": ("engines", "loss", {"A": 1.0 / GAS["A"], "B": 1.0 / GAS["B"]}),
    "factor_groups_count_micro_batches": ("factor", "loss", {"A": 1.0 / N, "B": 1.0 / N}),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unmanaged_accumulation_steps_each_engine_with_its_factor(ds_dist: None, stage: int, mode: str) -> None:
    import deepspeed

    how, call, factor = MODES[mode]
    refs = {"A": Net(10), "B": Net(11)}
    start = {n: [p.detach().clone() for p in r.parameters()] for n, r in refs.items()}
    engines: dict[str, Any] = {}
    for n, ref in refs.items():
        m = copy.deepcopy(ref)
        cfg = ds_config(GAS[n], stage, micro_batch=3, clip=0.0, managed_gradient_accumulation=False)
        engines[n], *_ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=LR), config=cfg)
        assert not engines[n].managed_gradient_accumulation()
    opts = {n: torch.optim.SGD(r.parameters(), lr=LR) for n, r in refs.items()}
    groups = (list(engines.values()) if how == "engines"
              else [graphscale.Group(e, factor=factor[n]) for n, e in engines.items()])
    with graphscale.install(*groups):
        for window in range(WINDOWS):
            for ref in refs.values():
                ref.zero_grad(set_to_none=True)
            for i in range(N):
                x, y = data(0, window * N + i)
                loss = _loss(engines, x, y)
                if call == "loss":
                    loss.backward()
                elif call == "engine:A":
                    engines["A"].backward(loss)
                else:
                    engines["A"].backward(loss / N, scale_wrt_gas=False)  # the caller averages
                _loss(refs, x, y).backward()
            for e in engines.values():
                e.step()
            for n, ref in refs.items():
                for p in ref.parameters():
                    p.grad = p.grad * factor[n]
                opts[n].step()
    errs = {n: rel_err([w - w0 for w, w0 in zip(fp32_params(engines[n]), start[n])],
                    [p.detach() - w0 for p, w0 in zip(refs[n].parameters(), start[n])]) for n in refs}
    assert max(errs.values()) <= 1e-5, f"weight-change error per engine {errs}"
