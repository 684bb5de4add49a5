"""One audited backward, leaf by leaf: the leaves it reaches (by the audit's
own walk, not the planner's) and each leaf's row: its ``.grad`` change beside
the factor it must have times its plain gradient (NOTE [ Audit reference ]
in _audit.py)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._errors import GraphscaleError
from ._group import Group
from ._snapshot import State
from ._walk import root_node

__all__ = ["UNOWNED", "Row", "rows_of", "err", "reached_leaves"]

UNOWNED = "(unowned)"


def reached_leaves(roots: Sequence[Any], inputs: Any) -> list[torch.Tensor]:
    """The leaves a backward of ``roots`` accumulates into, by the audit's own walk."""
    if inputs is not None:
        ins = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        return [t for t in ins if isinstance(t, torch.Tensor) and t.grad_fn is None and t.requires_grad]
    stack = [root_node(t) for t in roots]
    seen: set[Any] = set()
    out: list[torch.Tensor] = []
    ids: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor):
            if id(var) not in ids:
                ids.add(id(var))
                out.append(var)
            continue
        stack.extend(nxt for nxt, _ in node.next_functions)
    return out


@dataclass
class Row:
    """One leaf of one audited backward: its group and name, its ``.grad``
    change, its plain gradient, the rounding slack of the ``.grad`` it
    accumulated into, and the factor it must have (None until chosen)."""

    group: str
    name: str
    delta: torch.Tensor
    plain: torch.Tensor
    slack: float
    factor: Any


def _row(state: State, factors: dict[Group, float], p: torch.Tensor, g: torch.Tensor | None,
         b: torch.Tensor | None) -> Row:
    owner = state.owner.get(id(p))
    name = state.leaf_name(p) if owner is not None else f"leaf {tuple(p.shape)}"
    gg = torch.zeros(p.shape, dtype=torch.float64) if g is None else g.detach().double()
    after = p.grad
    if after is None:
        if g is not None and bool(gg.any()):
            raise GraphscaleError(
                f"graphscale.audit: parameter {name!r} (group {owner.name if owner else UNOWNED!r}) "
                "has no .grad after backward although its plain gradient is nonzero: something moved "
                "it (DeepSpeed ZeRO reduction, a bf16 optimizer's hooks). audit supports plain groups "
                "and DeepSpeed engines at ZeRO stage 0 and 1 in fp32."
            )
        delta = torch.zeros_like(gg)
    else:
        delta = after.detach().double() - (0.0 if b is None else b.double())
    slack = 0.0
    if b is not None and b.numel() and b.is_floating_point():
        slack = 4 * torch.finfo(b.dtype).eps * float(b.abs().max())
    return Row(owner.name if owner else UNOWNED, name, delta, gg, slack, factors[owner] if owner else None)


def rows_of(state: State, factors: dict[Group, float], leaves: Sequence[torch.Tensor],
          ref: Sequence[torch.Tensor | None], before: Sequence[torch.Tensor | None]) -> list[Row]:
    """Every leaf's row, each with the factor it must have.  NOTE [ Unowned
    leaves ]: a backward that reaches no owned leaf is plain PyTorch;
    otherwise the policy's protected unowned leaves get exactly g, the others
    all one factor in play (the one that explains them best)."""
    rows = [_row(state, factors, p, g, b) for p, g, b in zip(leaves, ref, before)]
    if all(r.factor is None for r in rows):
        for r in rows:
            r.factor = 1.0
        return rows
    protected = [r.factor is None and (state.policy == "plain" or (
        state.policy == "plain_params" and isinstance(p, torch.nn.Parameter))) for r, p in zip(rows, leaves)]
    free = [r for r, prot in zip(rows, protected) if r.factor is None and not prot]
    best = 1.0
    if free:
        cands = sorted({1.0, *factors.values()}, reverse=True)
        best = min(cands, key=lambda c: max(err(r.delta, c * r.plain, r.slack) for r in free))
    for r, prot in zip(rows, protected):
        if r.factor is None:
            r.factor = 1.0 if prot else best
    return rows


def err(delta: torch.Tensor, want: torch.Tensor, slack: float) -> float:
    return float((delta - want).abs().max()) - slack if delta.numel() else 0.0
