"""Custom autograd Functions shared by the shape and property tests."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Cube(torch.autograd.Function):
    """x**3 with a hand-written backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * 3 * x**2


class Recompute(torch.autograd.Function):
    """``module(x)`` run without grad; its backward recomputes and calls
    ``torch.autograd.backward`` seeded with ``seed_scale * grad`` (a nested
    backward, like reentrant checkpointing).  With ``scale_input_grad`` the
    gradient it returns for ``x`` is scaled by ``seed_scale`` too."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, module: nn.Module, seed_scale: float,
                scale_input_grad: bool = False) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.module, ctx.seed_scale, ctx.scale_input_grad = module, seed_scale, scale_input_grad
        with torch.no_grad():
            return module(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            xd = x.detach().requires_grad_()
            out = ctx.module(xd)
        torch.autograd.backward(out, grad * ctx.seed_scale)
        gx = xd.grad
        if ctx.scale_input_grad and ctx.seed_scale != 1:
            gx = gx * ctx.seed_scale
        return gx, None, None, None


class BackwardThrough(torch.autograd.Function):
    """``2 * h`` whose backward returns nothing for ``h`` but calls
    ``torch.autograd.backward`` on ``h`` itself (kept from forward), seeded with
    ``2 * grad``: a nested backward over part of the enclosing graph."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        ctx.keep = keep
        return h.detach() * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        torch.autograd.backward(ctx.keep, grad * 2, retain_graph=True)
        return None, None


class Boom(torch.autograd.Function):
    """Identity forward; its backward raises ``RuntimeError("boom")`` (an aborted backward)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")
