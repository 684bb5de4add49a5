"""One audited backward, leaf by leaf: the leaves it reaches (by the audit's
own walk, not the planner's), the gradient the backward hands each
(:class:`Capture`), and each leaf's row: that gradient beside the factor it
must have times its plain gradient.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._backward import running as _running
from .._core.group import Group
from .._core.snapshot import State
from .._planner.nodes import root_node

__all__ = ["UNOWNED", "Mismatch", "plain_reference", "Capture", "dtype_rtol", "Row", "rows_of", "err", "reached_leaves"]

UNOWNED = "(unowned)"


@dataclass(frozen=True)
class Mismatch:
    """One leaf whose gradient in one backward was not its factor x the plain gradient.

    ``observed`` is the factor that best explains what it received,
    ``<delta, g> / <g, g>`` (nan where g is zero).
    """

    backward: int
    group: str
    parameter: str
    shape: tuple[int, ...]
    expected: float
    observed: float
    max_abs_err: float

    def __str__(self) -> str:
        return (
            f"backward {self.backward}: group {self.group!r} parameter {self.parameter!r} {self.shape}: "
            f"got {self.observed:.6g} x its plain gradient, expected {self.expected:g} "
            f"(max abs error {self.max_abs_err:.3g})"
        )


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


def plain_reference(state: State, roots: Sequence[Any], seeds: Sequence[Any],
                    leaves: Sequence[torch.Tensor], retain: bool = True) -> tuple[torch.Tensor | None, ...]:
    """The plain gradient of each of ``leaves`` for a backward of ``roots``
    with ``seeds``, nothing accumulated, the graph task bound as a reference
    pass: output hooks of engines ``state`` names neither divide nor run
    their prologue.  ``retain``: the graph is the real backward's own, kept
    for it (a replayed one is not).  (See NOTE [ Audit reference ] in _tools/audit.py.)"""
    with _running.bound(roots, _running.reference_binding(state)) as bound_roots:
        return torch.autograd.grad(bound_roots, leaves, grad_outputs=list(seeds), retain_graph=retain,
                                   allow_unused=True)


class Capture:
    """While the block runs, the gradient each of ``leaves`` is handed (summed
    over the graph tasks that reach it: a nested backward's too), read by a
    tensor hook that changes nothing: what arrives at the leaf, before it is
    accumulated into ``.grad`` and before any hook on the leaf's accumulation
    (ZeRO's reduction, FSDP2's reduce-scatter) moves it.  ``grads[i]`` is None
    for a leaf the backward did not reach.  Every hook is removed on exit."""

    def __init__(self, leaves: Sequence[torch.Tensor]) -> None:
        self.leaves = leaves
        self.grads: list[torch.Tensor | None] = [None] * len(leaves)
        self.handles: list[Any] = []

    def _hook(self, i: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            got = grad.detach().clone()
            prev = self.grads[i]
            self.grads[i] = got if prev is None else prev + got

        return hook

    def __enter__(self) -> Capture:
        try:
            for i, p in enumerate(self.leaves):
                self.handles.append(p.register_hook(self._hook(i)))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def dtype_rtol(dtype: torch.dtype) -> float:
    """The relative tolerance a leaf of ``dtype`` needs at least: the reference
    and the backward round differently where the backward multiplies (a few
    units of the dtype's epsilon); 0 for float32 and float64, where the
    audit's own ``rtol`` applies alone."""
    if not dtype.is_floating_point or dtype in (torch.float32, torch.float64):
        return 0.0
    return 4 * torch.finfo(dtype).eps


@dataclass
class Row:
    """One leaf of one audited backward: its group and name, the gradient the
    backward handed it, its plain gradient, the relative tolerance its dtype
    needs (:func:`dtype_rtol`), the factor it must have (None until chosen),
    and whether it is float16 (whose backward may overflow)."""

    group: str
    name: str
    delta: torch.Tensor
    plain: torch.Tensor
    rtol: float
    factor: Any
    fp16: bool = False


def _row(state: State, factors: dict[Group, float], p: torch.Tensor, g: torch.Tensor | None,
         got: torch.Tensor | None) -> Row:
    owner = state.owner.get(id(p))
    name = state.leaf_name(p) if owner is not None else f"leaf {tuple(p.shape)}"
    # (the gradients' shape: a ZeRO-3 parameter's own tensor is empty outside its module's forward)
    shape = g.shape if g is not None else got.shape if got is not None else p.shape
    # compared in float32 at least: its rounding (~1e-7 relative) is far inside any tolerance used
    dtype = torch.promote_types(p.dtype, torch.float32) if p.dtype.is_floating_point else torch.float32
    gg = torch.zeros(shape, dtype=dtype) if g is None else g.detach().to(dtype)
    delta = torch.zeros_like(gg) if got is None else got.to(dtype).reshape(shape)
    return Row(owner.name if owner else UNOWNED, name, delta, gg, dtype_rtol(p.dtype),
               factors[owner] if owner else None, p.dtype == torch.float16)


def rows_of(state: State, factors: dict[Group, float], leaves: Sequence[torch.Tensor],
            ref: Sequence[torch.Tensor | None], got: Sequence[torch.Tensor | None]) -> list[Row]:
    """Every leaf's row, each with the factor it must have: a backward that
    reaches no owned leaf is plain PyTorch; otherwise the policy's protected
    unowned leaves get exactly g, the others all one factor in play (the one
    that explains them best).  (See NOTE [ Unowned leaves ] in _core/snapshot.py.)"""
    rows = [_row(state, factors, p, g, d) for p, g, d in zip(leaves, ref, got)]
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
        best = min(cands, key=lambda c: max(err(r.delta, c * r.plain) for r in free))
    for r, prot in zip(rows, protected):
        if r.factor is None:
            r.factor = 1.0 if prot else best
    return rows


def err(delta: torch.Tensor, want: torch.Tensor) -> float:
    """The largest absolute difference (0 for an empty leaf)."""
    return float((delta - want).abs().max()) if delta.numel() else 0.0
