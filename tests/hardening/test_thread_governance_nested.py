"""Inside a governed backward, on the thread that runs it: a
``torch.autograd.grad`` of an engine nested in it gets DeepSpeed's own
division, and a remove() before a reentrant checkpoint recomputes keeps that
backward exact (NOTE [ Which snapshot an output hook obeys ] in
graphscale/_backward/running.py; the rig: tests/helpers/thread_rig.py).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils.checkpoint

import graphscale

from helpers.engines import require_deepspeed
from helpers.grads import max_rel_err
from helpers.thread_rig import TOL, Rig

pytestmark = [pytest.mark.deepspeed, require_deepspeed]


# ------------------------------------------------------------ nested ungoverned backward, remove() before a recompute
class _GradOfEngineInBackward(torch.autograd.Function):
    """Identity whose backward runs ``torch.autograd.grad`` over an engine's
    output (a gradient penalty computed in backward): an ungoverned backward
    nested in a governed one, on the same thread."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, run: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.run = run
        return t.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        ctx.run()
        return g, None


def test_autograd_grad_nested_in_a_governed_backward_gets_deepspeeds_own_division(make_engine: Any) -> None:
    def nested_grad(rig: Rig, installed: bool) -> torch.Tensor:
        out: list[torch.Tensor] = []
        x = rig._inputs()[0]

        def run() -> None:
            with torch.enable_grad():
                xi = x.detach().requires_grad_()
                out.append(torch.autograd.grad(rig.engines["A"](xi).sum(), xi)[0])

        other = torch.nn.Linear(4, 1)
        loss = _GradOfEngineInBackward.apply(other(x), run).sum()
        if installed:
            with graphscale.install(rig.engines["A"], graphscale.Group(other, gas=2)):
                loss.backward()
        else:
            loss.backward()
        return out[0]

    # Not at an accumulation boundary: there DeepSpeed's epilogue after a torch.autograd.grad over an
    # engine's output fails by itself (IndexError in reduce_ipg_grads; with or without graphscale).
    want = nested_grad(Rig(make_engine, "engine_plus_own_module", boundary=False), installed=False)
    got = nested_grad(Rig(make_engine, "engine_plus_own_module", boundary=False), installed=True)
    assert torch.equal(got, want), f"got {(got.norm() / want.norm()).item():.3g} x DeepSpeed alone's gradient"


def test_remove_mid_backward_before_a_reentrant_checkpoint_recomputes_keeps_that_backward_exact() -> None:
    """Plain groups, one thread: the smallest reproduction.  (With DeepSpeed
    engines inside the checkpoint the same happens; on CUDA's device threads
    their output hooks then divide, on the CPU they pass through.)"""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)

    def loss_fn() -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(lambda t: a(t) * b(t), x, use_reentrant=True).sum()

    loss_fn().backward()
    plain = [a.weight.grad.clone(), b.weight.grad.clone()]
    a.zero_grad(set_to_none=True)
    b.zero_grad(set_to_none=True)
    inst = graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4))
    try:
        loss = loss_fn()
        loss.register_hook(lambda g: (inst.remove(), g)[1])  # before the checkpoint node runs
        loss.backward()
    finally:
        inst.remove()
    err = max_rel_err([a.weight.grad, b.weight.grad], [plain[0] / 2, plain[1] / 4])
    assert err < TOL, f"relative error {err:.3g} (a got plain x {(a.weight.grad.norm() / plain[0].norm()).item():.3g})"
