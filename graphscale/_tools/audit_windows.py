"""The audit's check at an accumulation boundary: the reduced gradient."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._core import registry as _registry
from .._core.group import Group
from .._core.snapshot import State
from .leaf_rows import dtype_rtol

__all__ = ["Windows", "Reduced"]

# NOTE [ Audit at the boundary ]
# Each audited backward checks, on every rank, the gradient it hands each
# leaf: what graphscale scales.  (See NOTE [ Audit reference ] in _tools/audit.py.)
# What the optimizer steps with is the framework's reduction of those over a
# window of backwards and over ranks, and a backward can hand every leaf the
# right gradient and still leave nothing reduced (an engine's epilogue that
# never ran), so at a boundary the audit checks that too.  For each group
# whose adapter says how it accumulates and reduces (_registry.audit_window),
# the audit sums factor x plain gradient of every backward of the window,
# and once the framework has reduced (right after its backward epilogue)
# compares the reduced gradient with that sum averaged over the ranks that
# reduce (a collective: every rank checks the same parameters in the same
# order).  A window the audit did not see from its start (entered mid-window,
# or gradients accumulated while no audit ran), or one with a backward whose
# expected gradients are unknown (a replay that was not the micro-step's
# forward), is not checked and is reported as such; so is a boundary at which
# the framework did not reduce.


@dataclass(frozen=True)
class Reduced:
    """One parameter whose reduced gradient at a boundary was not the
    rank-averaged sum of its window's factor x plain gradients."""

    backward: int
    group: str
    parameter: str
    expected_norm: float
    got_norm: float
    max_abs_err: float

    def __str__(self) -> str:
        return (f"backward {self.backward} (accumulation boundary): group {self.group!r} parameter "
                f"{self.parameter!r}: reduced gradient norm {self.got_norm:.6g}, expected {self.expected_norm:.6g} "
                f"(the window's factor x plain gradients averaged over ranks; max abs error {self.max_abs_err:.3g})")


_UNSEEN = "the audit did not see its window from the start"


class _Window:
    __slots__ = ("window", "sums", "why", "steps", "closed", "pending")

    def __init__(self, window: Any) -> None:
        self.window = window
        self.sums: dict[int, torch.Tensor] = {}
        self.why: str | None = None if window.starts() else _UNSEEN  # why its sums are not the whole window
        self.steps = window.steps()
        self.closed = False
        self.pending = False


class Windows:
    """Every group's window for one audit."""

    def __init__(self, tolerance: Callable[[float, float, torch.dtype], bool],
                 report: Callable[[list[Reduced]], None]) -> None:
        self.tolerance, self.report = tolerance, report
        self.windows: dict[Group, _Window] = {}
        self.backwards = 0  # backwards seen (before() is called once for each)
        self.checked: dict[str, int] = {}  # group name -> boundaries checked
        self.skipped: dict[str, str] = {}  # group name -> why its last boundary was not checked

    def before(self, state: State, factors: dict[Group, float],
               expected: Sequence[tuple[torch.Tensor, torch.Tensor | None]], unknown: str | None = None) -> None:
        """Before the next backward runs: add its contributions (``expected``:
        (leaf, plain gradient)) to each window, and schedule the check of each
        window that this backward ends; ``unknown``: why its plain gradients
        are not known, so no window it adds to is checked."""
        self.backwards += 1
        n = self.backwards
        touched = {id(state.owner.get(id(p))) for p, _ in expected}
        for g in state.groups:
            w = self._window(g)
            if w is None:
                continue
            if w.pending:
                self.skipped[g.name] = "the framework did not reduce at its last boundary"
                w.pending, w.why = False, "the framework did not reduce at its last boundary"
            if w.closed:
                stepped = w.window.steps() != w.steps
                w.sums, w.why, w.closed = {}, None if stepped else _UNSEEN, False
            if unknown is not None and id(g) in touched:
                w.why = unknown
            factor = factors[g]
            for p, ref in expected:
                if ref is not None and state.owner.get(id(p)) is g:
                    add = ref.detach().double() * factor
                    prev = w.sums.get(id(p))
                    w.sums[id(p)] = add if prev is None else prev + add
            if w.window.boundary():
                w.closed, w.steps = True, w.window.steps()
                if w.why is not None:
                    self.skipped[g.name] = w.why
                elif w.window.after_reduction(self._check(n, g, w)):
                    w.pending = True

    def _window(self, g: Group) -> _Window | None:
        w = self.windows.get(g)
        if w is None:
            window = _registry.audit_window(g)
            if window is None:
                return None
            w = self.windows[g] = _Window(window)
        return w

    def _check(self, n: int, g: Group, w: _Window) -> Callable[[], None]:
        def check() -> None:
            w.pending = False
            params = g.parameters  # every rank, the same parameters in the same order
            wants = [w.sums.get(id(p)) for p in params]
            wants = [torch.zeros(_shape(p), dtype=torch.float64) if t is None else t for p, t in zip(params, wants)]
            sums: list[torch.Tensor] = wants  # type: ignore[assignment]  # (no None left)
            flat = w.window.average(torch.cat([t.reshape(-1) for t in sums]))  # one collective for the group
            found: list[Reduced] = []
            offset = 0
            for p, t in zip(params, sums):
                want = flat[offset:offset + t.numel()].view(t.shape)
                offset += t.numel()
                got = w.window.reduced(p)
                got = torch.zeros_like(want) if got is None else got.detach().double().reshape(want.shape)
                if not bool(torch.isfinite(got).all()):
                    continue  # an fp16 overflow: the step is skipped, nothing to compare
                err = float((got - want).abs().max()) if want.numel() else 0.0
                if not self.tolerance(err, float(want.abs().max()) if want.numel() else 0.0, p.dtype):
                    found.append(Reduced(n, g.name, g.param_name(p), math.sqrt(float((want * want).sum())),
                                         math.sqrt(float((got * got).sum())), err))
            self.checked[g.name] = self.checked.get(g.name, 0) + 1
            self.skipped.pop(g.name, None)
            if found:
                self.report(found)

        return check


def _shape(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's full shape (ZeRO-3 keeps it in ``ds_shape``)."""
    return tuple(getattr(p, "ds_shape", p.shape))


def rtol_for(rtol: float, dtype: torch.dtype) -> float:
    """The relative tolerance applied to a leaf of ``dtype``."""
    return max(rtol, dtype_rtol(dtype))
