"""The small model of the engine tests: l2(tanh(l1 x)), 4 -> 4 -> 4."""
from __future__ import annotations

import torch


class TanhMLP(torch.nn.Module):
    """l2(tanh(l1 x)), 4 -> 4 -> 4, float32: the small model of the engine tests
    (:func:`tanh_mlp` makes it; a test that needs a variant subclasses it: a
    checkpointed l2, an output whose backward raises).  ``seed``: its weights
    are drawn right after ``torch.manual_seed(seed)``; None draws them from
    torch's generator as it stands."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        self.l1 = torch.nn.Linear(4, 4)
        self.l2 = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))


def tanh_mlp(seed: int | None = None, *, sequential: bool = False) -> torch.nn.Module:
    """The two-``Linear`` model of the tests: Linear(4, 4), tanh, Linear(4, 4).

    ``sequential=False``: a :class:`TanhMLP` (parameters ``l1.*``, ``l2.*``;
    tanh a function call).  ``sequential=True``: ``nn.Sequential(Linear,
    Tanh, Linear)`` (parameters ``0.*``, ``2.*``; the Tanh a module of its
    own, which module hooks such as ZeRO 3's see).  For one ``seed`` both
    hold the same weights (the same draws, in the same order).
    """
    if not sequential:
        return TanhMLP(seed)
    if seed is not None:
        torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
