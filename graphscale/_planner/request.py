"""What one backward asks the planner: :class:`PlanRequest`.  C++ twin:
``_native/planner/request.h``."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .._core.snapshot import Reading

__all__ = ["PlanRequest"]


class PlanRequest(NamedTuple):
    """What one backward asks the planner.

    ``reading``: the snapshot and the factors read for this backward.
    ``base``: the potential the seeds already carry (1 at top level; a nested
    backward's enclosing potential: see NOTE [ Nested backward ] in _entry/entry.py).
    ``carrier``: in a nested backward, the potential unowned non-Parameter
    leaves must end at; None at top level.
    ``inputs``: the backward's ``inputs=`` (non-leaf ones receive ``.grad``
    and are pinned under ``unowned="plain"``).
    ``outer_phi``: the potential an enclosing plan gave a node, or None where
    none saw it; None at top level.
    (See NOTE [ Unowned leaves in nested backward ] in _planner/pins.py.)
    ``hint``: a potential for a custom-Function node, or None.
    (See NOTE [ Checkpoint hints ] in _backward/hints.py.)
    """

    reading: Reading
    base: float = 1.0
    carrier: float | None = None
    inputs: tuple[Any, ...] = ()
    outer_phi: Callable[[Any], float | None] | None = None
    hint: Callable[[Any], float | None] | None = None

    @property
    def input_pins(self) -> tuple[tuple[Any, float], ...]:
        """(node, potential) for each non-leaf ``inputs=`` tensor under "plain"."""
        if not self.reading.state.unowned_all_plain:
            return ()
        value = self.carrier if self.carrier is not None else 1.0
        return tuple((t.grad_fn, value) for t in self.inputs
                     if isinstance(t, torch.Tensor) and t.grad_fn is not None)

    @property
    def factor_list(self) -> list[float]:
        """The factors in the snapshot's group order (what the native walker indexes)."""
        reading = self.reading
        return list(reading.factor_list) or [reading.factors[g] for g in reading.state.groups]
