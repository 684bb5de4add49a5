"""The gradients the tests read and the oracles' comparisons: plain leaves'
(:func:`leaf_grads`) and engines' (:func:`full_grads`) gradients, and how far
a governed run is from the plain-PyTorch oracle (:func:`max_rel_err`,
:func:`grad_mismatches`, which names every leaf that breaks the contract)."""
from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch


def leaf_grads(leaves: Mapping[str, torch.Tensor | torch.nn.Module], clear: bool = False
               ) -> dict[str, torch.Tensor | None]:
    """Each leaf's ``.grad`` as it is now, detached and cloned, by name (None
    where a leaf has none): the one reader of plain tensors' gradients, for
    the plain-PyTorch oracle and the governed run alike.

    A module in ``leaves`` stands for its parameters, named
    ``"<its name>.<parameter name>"`` (``named_parameters()``).  ``clear``:
    each leaf's ``.grad`` is set to None once read, so the next backward's
    gradients are its own (the contract is per backward).
    """
    named: dict[str, torch.Tensor] = {}
    for name, leaf in leaves.items():
        if isinstance(leaf, torch.nn.Module):
            named.update((f"{name}.{n}", p) for n, p in leaf.named_parameters())
        else:
            named[name] = leaf
    out: dict[str, torch.Tensor | None] = {}
    for name, t in named.items():
        out[name] = None if t.grad is None else t.grad.detach().clone()
        if clear:
            t.grad = None
    return out


def full_grads(engine: Any, cpu: bool = True, missing: bool = False) -> list[Any]:
    """Every parameter's full gradient of a DeepSpeed engine, at any ZeRO
    stage, as float32 (cloned): the one reader of engines' gradients.

    ``cpu``: moved to the CPU (False: left on the engine's device).
    ``missing``: None for a parameter whose gradient DeepSpeed does not hold
    (ZeRO 1 before any backward raises "only available immediately after
    backward"); otherwise such a parameter fails the test.
    """
    from deepspeed.utils import safe_get_full_grad

    out: list[torch.Tensor | None] = []
    for p in engine.module.parameters():
        if missing:
            try:
                g = safe_get_full_grad(p)
            except ValueError:
                g = None
            if g is None:
                out.append(None)
                continue
        else:
            g = safe_get_full_grad(p)
        g = g.detach().float()
        out.append((g.cpu() if cpu else g).clone())
    return out


def max_rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Largest |got - want| / max|want| over a list of tensors (0 when equal)."""
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        scale = w.abs().max().item() or 1.0
        worst = max(worst, (g.float() - w.float()).abs().max().item() / scale)
    return worst


def grad_mismatches(
    plain: dict[str, torch.Tensor | None],
    got: dict[str, torch.Tensor | None],
    factor_of: dict[str, float],
    unowned: str,
    rtol: float = 1e-9,
    params: Collection[str] = (),
) -> list[str]:
    """Every leaf whose gradient breaks graphscale's contract, as readable lines.

    ``plain``: the gradients plain PyTorch gives (the oracle); ``got``: what the
    governed run gave; ``factor_of``: 1/gas of each owned leaf (others are
    unowned); ``params``: the unowned leaves that are ``nn.Parameter`` s.
    Owned leaves must be exactly ``factor * plain``; unowned ones exactly
    ``plain`` under ``"plain"`` (and the Parameters under
    ``"plain_params"``), else ``c * plain`` for one ``c`` in {1} and the
    factors in play.
    """
    candidates = sorted({1.0, *factor_of.values()})
    bad: list[str] = []

    def close(g: torch.Tensor, w: torch.Tensor) -> bool:
        if g.shape != w.shape:
            return False
        if w.numel() == 0:
            return True
        return (g.double() - w.double()).abs().max().item() <= rtol * w.abs().max().item()

    for name in sorted(plain.keys() | got.keys()):
        p, g = plain.get(name), got.get(name)
        if p is None or g is None:
            if (p is None) != (g is None):
                bad.append(f"{name}: plain grad is {'None' if p is None else 'set'}, governed is "
                           f"{'None' if g is None else 'set'}")
            continue
        if name in factor_of:
            want = [factor_of[name]]
        elif unowned == "plain" or (unowned == "plain_params" and name in params):
            want = [1.0]
        else:
            want = candidates
        if not any(close(g, p * c) for c in want):
            ratio = (g.double().norm() / p.double().norm().clamp_min(1e-300)).item()
            bad.append(f"{name}: want plain x {' or '.join(f'{c:g}' for c in want)}, "
                       f"got plain x ~{ratio:.6g} (max |diff| vs first: {(g - p * want[0]).abs().max().item():.3g})")
    return bad
