"""``graphscale.audit``: check every governed backward against a plain reference."""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import torch

from .._backward import frames as _frames
from .._backward.call import BackwardCall
from .._core import registry as _registry
from .._core.errors import AuditError, GraphscaleError
from .._core.group import Group, spec_reads
from .._core.observation import observing
from .._core.snapshot import State, current
from .._core.table import format_table
from .._routes import python as _python_route
from .audit_windows import Reduced, Windows, rtol_for
from .leaf_rows import UNOWNED, Capture, Mismatch, Row, reached_leaves, rows_of
from .replay import Replays, needs_replay, reference

__all__ = ["audit", "Audit", "AuditError", "Mismatch"]

# NOTE [ Audit reference ]
# Inside an audit, each top-level governed backward first computes the plain
# gradient g of every leaf it will reach, with torch.autograd.grad(roots,
# inputs=leaves, retain_graph=True), *before* graphscale registers any hook of
# its own: the reference runs on the same graph with graphscale's
# multiplications absent.  It asks for the leaves as inputs, so no
# AccumulateGrad node runs: nothing is accumulated and no hook that DeepSpeed
# keeps on parameters (ZeRO reduction) fires.  DeepSpeed's output hooks do
# fire: their per-tensor GAS division is switched off for installed engines,
# and their once-per-backward prologue (timers, ZeRO bookkeeping, the queued
# epilogue) does not run: the reference's graph task is bound as a reference
# pass.  (See NOTE [ Once per backward ] in _backward/running.py.)  Then the
# real backward runs with a tensor hook on every reached leaf
# (_leaf_rows.Capture) that reads the gradient handed to the leaf before it is
# accumulated, before ZeRO's or any other accumulation hook moves it (so ZeRO
# stage 2 and several ranks read the same as stage 0 on one), and it is
# compared with factor x g, factor = 1 / gas() read independently of the
# planner, so a wrong plan, a wrong seed or a wrong factor all show.  The
# leaves are found by the audit's own walk, not by the planner's.
# What the optimizer then steps with is checked at each accumulation boundary:
# see NOTE [ Audit at the boundary ] in _tools/audit_windows.py.
# Where a group's graph cannot be backpropagated twice (ZeRO 3), the reference
# comes from a replay of the micro-step's forward instead: see
# NOTE [ Audit by replay ] in _tools/replay.py.

_log = logging.getLogger("graphscale")
F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class _GroupStats:
    factor: float = float("nan")
    leaves: int = 0
    backwards: int = 0
    got_sq: float = 0.0  # last backward's squared gradient norm
    want_sq: float = 0.0
    worst_rel: float = 0.0
    mismatches: int = 0


@dataclass
class Audit:
    """The handle of :func:`audit`: a context manager and its report.

    ``backwards``: governed backwards audited so far.  ``mismatches``: every
    :class:`Mismatch` found; ``reduced_mismatches``: every parameter whose
    reduced gradient at an accumulation boundary was wrong.  ``ok``:
    neither.  :meth:`report` (also ``str(handle)``) is a per-group table: the
    factor, the leaves checked, the gradient norm the last backward gave the
    group's leaves and the norm it should have given, the worst relative
    error seen, and the boundaries whose reduced gradient was checked; then
    the tolerances used.
    """

    rtol: float
    atol: float
    raise_on_error: bool
    backwards: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    reduced_mismatches: list[Reduced] = field(default_factory=list)
    _stats: dict[str, _GroupStats] = field(default_factory=dict, repr=False)
    _observing: Any = field(default=None, repr=False)
    _entered: bool = field(default=False, repr=False)
    _windows: Windows = field(init=False, repr=False)
    _dtypes: set[torch.dtype] = field(default_factory=set, repr=False)
    _replays: Replays = field(default_factory=lambda: Replays("graphscale.audit", lambda: needs_replay(current())),
                              repr=False)

    def __post_init__(self) -> None:
        self._windows = Windows(self._within, self._found_reduced)

    def replayable(self, fn: F) -> F:
        """``fn`` (the function that computes the micro-step's loss from its
        batch), wrapped so that the audit may call it once more, with the same
        arguments, as the reference of a backward of what it returned: where
        the backward's own graph cannot be backpropagated twice (a DeepSpeed
        engine at ZeRO stage 3).  The replay draws the same randomness
        (torch's generators, forked), leaves every module buffer it changes
        as it was, accumulates into no ``.grad`` and steps nothing; it costs
        about one more forward and backward.  Wrap it on every rank.
        Elsewhere the wrapper only calls ``fn``.

        Example (a plain group: its own graph serves, no replay runs)::

            >>> import torch, graphscale
            >>> model = torch.nn.Linear(2, 1)
            >>> with graphscale.install(graphscale.Group(model, gas=2)), graphscale.audit() as check:
            ...     loss_of = check.replayable(lambda x: model(x).sum())
            ...     loss_of(torch.ones(3, 2)).backward()
            >>> check.ok, check.backwards
            (True, 1)
        """
        return self._replays.wrap(fn)

    def _within(self, err: float, scale: float, dtype: torch.dtype) -> bool:
        return err <= self.atol + rtol_for(self.rtol, dtype) * scale

    def __enter__(self) -> Audit:
        if self._entered:
            raise GraphscaleError("graphscale.audit: this audit is already active; make a new one with audit().")
        self._entered = True
        self._observing = observing(self._observe)
        self._observing.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._observing.__exit__(*exc)
        self._observing = None

    def report(self) -> str:
        w = self._windows
        lines = [
            f"graphscale audit: {self.backwards} backward(s), "
            f"{len(self.mismatches) + len(self.reduced_mismatches)} mismatch(es) ({self._tolerances()})"
        ]
        rows = [[name, f"{s.factor:g}", str(s.leaves), str(s.backwards), f"{math.sqrt(s.got_sq):.6g}",
                 f"{math.sqrt(s.want_sq):.6g}", f"{s.worst_rel:.3g}",
                 str(w.checked.get(name, 0)) if name in w.checked or name in w.skipped else "-"]
                for name, s in self._stats.items()]
        headers = ["group", "factor", "leaves", "backwards", "grad norm (last)", "expected", "worst rel err",
                   "boundaries"]
        lines.append(format_table(headers, rows, rule=False))
        lines += [f"  {m}" for m in (*self.mismatches, *self.reduced_mismatches)]
        lines += [f"  group {name!r}: last boundary not checked: {why}" for name, why in w.skipped.items()]
        return "\n".join(lines)

    def _tolerances(self) -> str:
        said = [f"rtol={self.rtol:g}, atol={self.atol:g}"]
        for dtype in sorted(self._dtypes, key=str):
            if rtol_for(self.rtol, dtype) != self.rtol:
                said.append(f"{str(dtype).removeprefix('torch.')} leaves rtol={rtol_for(self.rtol, dtype):g}")
        return "; ".join(said)

    def _found_reduced(self, found: list[Reduced]) -> None:
        self.reduced_mismatches.extend(found)
        self._raise_or_log(found, "reduced gradient(s) at an accumulation boundary",
                           "that are not the window's factor x plain gradients averaged over ranks")

    __str__ = report

    @property
    def ok(self) -> bool:
        """No mismatch found so far (per backward, or at a boundary)."""
        return not self.mismatches and not self.reduced_mismatches

    # ------------------------------------------------------------ the check
    def _observe(self, run: Callable[[BackwardCall], None], call: BackwardCall) -> None:
        state = current()
        if state is None or call.roots is None or torch._C._current_autograd_node() is not None:
            return run(call)  # nested backwards are checked as part of the outer one
        if state.pending:  # adapter leaves made since install: NOTE [ FSDP2's backward leaves ] in _adapters/fsdp.py
            state = state.ready()
        roots, grads = call.roots, call.grads
        assert grads is not None  # normalized with the roots
        if any(g is None and isinstance(t, torch.Tensor) and t.numel() != 1 for t, g in zip(roots, grads)):
            return run(call)  # no seed for a non-scalar root: torch raises its own error
        _check_supported(state)
        scaling = _frames.scaling_enabled()
        reads = {g: g.read_spec() for g in state.groups}  # once: the backward reuses them (spec_reads)
        factors = {g: _expected_factor(g, reads[g], scaling) for g in state.groups}
        leaves = reached_leaves(roots, call.inputs_arg)
        if not leaves:
            return run(call)
        # the plain gradient of the loss as given, without what its seeds carry already (an fp16 loss scale)
        carried = _python_route.carries(roots, _frames.adapter_backward_frame()[1])
        seeds = _python_route.scaled_seeds(roots, grads, [1.0 / c for c in carried]) if any(c != 1.0 for c in carried) \
            else list(grads)
        if seeds is None:
            return run(call)  # a seed torch cannot make: torch raises its own error
        # bound: DeepSpeed's output hooks see a governed backward (NOTE [ Which snapshot an output hook obeys ])
        ref = reference(state, roots, seeds, leaves, self._replays)  # or by replay: NOTE [ Audit by replay ]
        pairs = ref.compared(leaves)
        leaves, plain = [p for p, _ in pairs], [g for _, g in pairs]
        self._dtypes.update(p.dtype for p in leaves)
        unknown = None if ref.unfaithful is None else "a replay that was not the micro-step's forward"
        self._windows.before(state, factors, pairs, unknown)
        with spec_reads(reads), Capture(leaves) as got:
            run(call)
        self.backwards += 1
        if ref.unfaithful is not None:  # said after the real backward, which every rank ran
            raise GraphscaleError(f"graphscale.audit: backward {self.backwards}: {ref.unfaithful}")
        self._compare(state, factors, leaves, (plain, got.grads))

    def _compare(self, state: State, factors: dict[Group, float], leaves: Sequence[torch.Tensor],
                 observed: tuple[Sequence[torch.Tensor | None], Sequence[torch.Tensor | None]]) -> None:
        """Check the gradient the backward handed each leaf against its factor
        x its plain gradient; ``observed``: (the plain gradients, the handed ones)."""
        rows = rows_of(state, factors, leaves, *observed)
        found: list[Mismatch] = []
        seen_groups: dict[str, tuple[float, float, float, int]] = {}
        for row in rows:
            want = row.plain * row.factor
            diff = row.delta - want
            err = float(diff.abs().max()) if diff.numel() else 0.0
            scale = float(want.abs().max()) if want.numel() else 0.0
            got_sq, want_sq, worst, count = seen_groups.get(row.group, (0.0, 0.0, 0.0, 0))
            rel = err / scale if scale else (0.0 if err == 0 else math.inf)
            seen_groups[row.group] = (got_sq + float(row.delta.square().sum()), want_sq + float(want.square().sum()),
                                      max(worst, rel), count + 1)
            if not math.isfinite(err) and math.isfinite(scale) and row.fp16:
                continue  # an fp16 engine's overflow: DeepSpeed skips this step
            if err > self.atol + max(self.rtol, row.rtol) * scale:
                gn = float(row.plain.square().sum())
                got = float((row.delta * row.plain).sum()) / gn if gn else math.nan
                found.append(Mismatch(self.backwards, row.group, row.name, tuple(row.delta.shape), row.factor, got,
                                      err))
        self._tally(state, rows, seen_groups, found)
        if found:
            self.mismatches.extend(found)
            self._raise_or_log(found, "gradient(s)", "that are not their group's factor x the plain gradient")

    def _raise_or_log(self, found: Sequence[object], what: str, wrong: str) -> None:
        text = "\n  ".join(str(m) for m in found)
        if self.raise_on_error:
            raise AuditError(f"graphscale: audit found {len(found)} {what} {wrong}:\n  {text}\n"
                             "Inspect the plan with graphscale.explain(...) on the same roots.")
        _log.warning("graphscale: audit found %d mismatching %s:\n  %s", len(found), what, text)

    def _tally(self, state: State, rows: Sequence[Row], seen_groups: dict[str, tuple[float, float, float, int]],
               found: Sequence[Mismatch]) -> None:
        """Fold one backward's per-group sums into the report's statistics."""
        order = [g.name for g in state.groups if g.name in seen_groups] + [UNOWNED] * (UNOWNED in seen_groups)
        for group in order:
            got_sq, want_sq, worst, count = seen_groups[group]
            s = self._stats.setdefault(group, _GroupStats())
            s.factor = next(r.factor for r in rows if r.group == group)
            s.leaves, s.backwards = count, s.backwards + 1
            s.got_sq, s.want_sq, s.worst_rel = got_sq, want_sq, max(s.worst_rel, worst)
            s.mismatches += sum(1 for m in found if m.group == group)


def audit(rtol: float = 1e-5, atol: float = 1e-6, raise_on_error: bool = True) -> Audit:
    """Check every governed backward inside the block against a plain reference.

    Each top-level governed backward (``loss.backward()``,
    ``torch.autograd.backward``, ``engine.backward``) run inside the block
    first computes every reached leaf's plain gradient g, then runs as usual,
    and checks, on every rank, that the gradient the backward handed each
    leaf (read as it arrives, before any hook moves it: ZeRO's reduction
    included) is exactly ``factor(G) x g`` for its group G (the group's
    factor, 1 under ``scale_wrt_gas=False``, times an fp16 engine's loss
    scale); leaves no group owns must get ``g`` where the policy protects
    them, the others all one factor in play; in a backward that reaches no
    owned leaf every leaf ``g``.  A leaf fails when
    ``max|got - factor*g| > atol + rtol' * max|factor*g|``, where ``rtol'`` is
    ``rtol``, or for a bfloat16 / float16 leaf at least 4 units of its
    dtype's epsilon (the report says which applied).  A float16 leaf that
    overflowed (DeepSpeed skips that step) is not compared.

    At each accumulation boundary of a DeepSpeed engine it also checks the
    reduced gradient the optimizer will step with: the window's factor x g
    summed, averaged over the engine's data-parallel ranks.  So a run on
    several ranks is audited at every micro-step and every boundary.

    Args:
        rtol: relative tolerance, as above.
        atol: absolute tolerance, as above.
        raise_on_error: raise :class:`AuditError` at the first failing
            backward or boundary, naming every failing group and parameter;
            with False, log a warning and keep them in ``handle.mismatches``
            and ``handle.reduced_mismatches``.

    Returns:
        An :class:`Audit` handle; ``print(handle)`` is the per-group
        gradient-norm report.

    Costs about one extra backward per backward (with a replay: one extra
    forward and backward), a copy of the gradients the backward hands the
    reached leaves, and at a boundary one all-reduce of the window's expected
    gradients.  Nested backwards (reentrant checkpointing) are checked as
    part of the outer one, which needs ``torch.autograd.grad`` to work on the
    graph.  The audit is process wide; run one at a time, on every rank.

    Supported: :class:`Group` s (FSDP2 ones included: read at their unsharded
    parameters, before the reduce-scatter), and DeepSpeed engines at ZeRO
    stage 0 to 3, fp32, bf16 and fp16, on any number of ranks.  At ZeRO
    stage 3 a graph can be backpropagated only once, so the reference comes
    from the micro-step's forward called once more: wrap the function that
    computes the loss with :meth:`Audit.replayable`; a backward there without
    one is refused before it runs, saying so.

    Example::

        >>> import torch, graphscale
        >>> actor, critic = torch.nn.Linear(2, 1), torch.nn.Linear(1, 1)
        >>> groups = graphscale.Group(actor, gas=2, name="a"), graphscale.Group(critic, gas=4, name="b")
        >>> with graphscale.install(*groups), graphscale.audit() as check:
        ...     h = actor(torch.ones(1, 2))
        ...     (h + critic(h)).sum().backward()
        >>> check.ok, check.backwards
        (True, 1)
        >>> print(check)  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
        graphscale audit: 1 backward(s), 0 mismatch(es) (rtol=1e-05, atol=1e-06)
          group  factor  leaves  backwards  grad norm (last)  expected  worst rel err  boundaries
          a      0.5     2       1          ...
          b      0.25    2       1          ...
    """
    if rtol < 0 or atol < 0:
        raise ValueError(f"graphscale.audit: rtol and atol must be >= 0, got rtol={rtol}, atol={atol}.")
    return Audit(rtol=rtol, atol=atol, raise_on_error=raise_on_error)


# ---------------------------------------------------------------- helpers
def _expected_factor(group: Group, spec: tuple[str, float], scaling: bool) -> float:
    """The factor the contract promises ``group``, from its configuration read for this backward
    (``spec``: ("gas", GAS) or ("factor", factor)), on a path of its own (not the planner's
    ``factor()``), so that a wrong factor shows; times an fp16 engine's loss scale."""
    kind, value = spec
    factor = (1.0 / value if kind == "gas" else value) if scaling else 1.0
    return factor * _registry.audit_scale(group)


def _check_supported(state: State) -> None:
    """Raise before the backward runs where an adapter says the audit cannot read a group's gradients."""
    for g in state.groups:
        why = _registry.audit_refusal(g)
        if why is not None:
            raise GraphscaleError(f"graphscale.audit: {why} No gradient was touched.")

