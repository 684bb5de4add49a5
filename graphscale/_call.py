"""A ``torch.autograd.backward`` call read once: its roots, its seeds, its
``inputs=``; and the seeds multiplied.

torch takes any iterable; a generator can be read once, so everything is
read here, and torch is handed the same items graphscale planned for.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from . import _state

__all__ = ["materialize", "normalize", "scaled_seeds", "carries"]


def materialize(arg: Any) -> Any:
    """``arg`` as a tuple when it is an iterable other than a tensor, tuple or list."""
    if arg is None or isinstance(arg, (torch.Tensor, tuple, list)):  # GradientEdge is a tuple
        return arg
    try:
        return tuple(arg)
    except TypeError:  # not iterable: torch's own error message is the right one
        return arg


def normalize(tensors: Any, grad_tensors: Any) -> tuple[tuple[Any, ...], list[Any]] | None:
    """(roots, seeds) of a backward call, or None when torch would reject it."""
    if isinstance(tensors, (torch.Tensor, GradientEdge)):
        roots: tuple[Any, ...] = (tensors,)
    else:
        roots = tuple(tensors)
    if grad_tensors is None:
        grads: list[Any] = [None] * len(roots)
    elif isinstance(grad_tensors, torch.Tensor):
        grads = [grad_tensors]
    else:
        grads = list(grad_tensors)
    if len(grads) != len(roots):
        return None
    for t in roots:
        if isinstance(t, GradientEdge):
            continue
        if not isinstance(t, torch.Tensor) or (t.grad_fn is None and not t.requires_grad):
            return None
    return roots, grads


def scaled_seeds(roots: Sequence[Any], grads: Sequence[Any], mults: Sequence[float]) -> list[Any] | None:
    """Seeds multiplied by ``mults``; None when a seed cannot be made (let torch raise)."""
    out = list(grads)
    for r, m in enumerate(mults):
        if m == 1.0:
            continue
        g = out[r]
        if g is None:
            t = roots[r]
            if isinstance(t, GradientEdge):  # implicit seed of a scalar edge, as torch makes it
                md = t.node._input_metadata[t.output_nr]
                if md.is_nested_tensor or torch.Size(md.shape).numel() != 1:
                    return None
                g = torch.ones(md.shape, dtype=md.dtype, device=md.device)
            elif not isinstance(t, torch.Tensor) or t.numel() != 1:
                return None
            else:  # torch's implicit seed, already multiplied: one op instead of two
                out[r] = torch.full_like(t, m, memory_format=torch.preserve_format)
                continue
        out[r] = g * m
    return out


def carries(roots: Sequence[Any], default: float) -> list[float]:
    """What each root's seed carries already: ``default`` (an fp16
    ``engine.backward``'s loss scale), or a tag left by ``engine.scale``."""
    return [t.__dict__.get(_state.CARRIES_ATTR, default) if isinstance(t, torch.Tensor) else default for t in roots]
