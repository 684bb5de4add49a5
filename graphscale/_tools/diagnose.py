"""``graphscale.diagnose``: what DeepSpeed alone does to each engine's gradients."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import combinations_with_replacement
from typing import Any, Callable, TypeVar

import torch

from .._backward import frames as _frames
from .._backward.call import ORIGINAL_BACKWARD, BackwardCall
from .._core import registry as _registry
from .._core.errors import GraphscaleError
from .._core.group import Group
from .._core.snapshot import State, current
from .._core.table import format_table
from .leaf_rows import Capture, dtype_rtol, reached_leaves
from .replay import Replays, needs_replay, reference

__all__ = ["diagnose", "Diagnosis", "Finding"]

# NOTE [ Diagnosis without graphscale ]
# Around a user's unmodified loop, with graphscale *not* installed, every
# top-level backward is watched and nothing is governed: first the plain
# gradient g of every parameter of the diagnosed engines that the backward
# reaches is computed (torch.autograd.grad on the same graph, bound as a
# reference pass so DeepSpeed's output hooks neither divide nor run their
# prologue, as the audit's reference is), from the loss the user gave
# (``engine.backward(loss)`` divides it by GAS before torch sees it, so there
# the reference is taken from ``loss`` itself; at ZeRO stage 3 from the
# replayed forward); then DeepSpeed's own backward runs as without graphscale,
# and a tensor hook on each parameter reads the gradient DeepSpeed's graph
# hands it.  (See NOTE [ Audit reference ] in _tools/audit.py and
# NOTE [ Audit by replay ] in _tools/replay.py.)  The factor DeepSpeed gave
# is <got, g> / <g, g>; the contract wants 1/GAS of the owning engine (1
# under scale_wrt_gas=False), times an fp16 engine's own loss scale.  A
# gradient that is no multiple of g got different factors along different
# paths (an engine's forward and a direct call of its module in one loss).
# Which shape of graph caused a wrong factor is read from the factor itself:
# 1 (not divided), another engine's 1/GAS (that engine's backward divided
# the whole loss), or a product of several (divided at the outputs of
# several engine forwards: nested engines).

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Finding:
    """A parameter whose gradient in one backward was not its engine's factor
    x its plain gradient: ``observed`` (least squares), ``expected``, whether
    the gradient was no multiple of the plain one (``mixed``), and ``cause``."""

    backward: int
    group: str
    parameter: str
    expected: float
    observed: float
    mixed: bool
    cause: str

    def __str__(self) -> str:
        got = f"a mixture (best fit {self.observed:.4g})" if self.mixed else f"{self.observed:.4g}"
        return (f"backward {self.backward}: {self.group} parameter {self.parameter!r}: DeepSpeed gave {got} x its "
                f"plain gradient, the contract {self.expected:g}; {self.cause}")


@dataclass
class Diagnosis:
    """The handle of :func:`diagnose`: a context manager and its report.

    ``backwards``: top-level backwards watched.  ``findings``: every
    :class:`Finding`.  ``ok``: none.  ``str(handle)``: one row per engine.
    """

    groups: tuple[Group, ...]
    rtol: float
    backwards: int = 0
    findings: list[Finding] = field(default_factory=list)
    _seen: dict[str, set[str]] = field(default_factory=dict, repr=False)  # group -> factors DeepSpeed gave
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _state: State | None = field(default=None, repr=False)
    _patched: Any = field(default=None, repr=False)
    _replays: Replays = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._replays = Replays("graphscale.diagnose", lambda: needs_replay(self._state))

    def replayable(self, fn: F) -> F:
        """``fn`` (the function that computes the micro-step's loss), wrapped so
        that the diagnosis may call it once more for its reference where the
        backward's graph cannot be backpropagated twice (ZeRO stage 3), as
        :meth:`graphscale.Audit.replayable` does."""
        return self._replays.wrap(fn)

    @property
    def ok(self) -> bool:
        """No wrong factor seen so far."""
        return not self.findings

    def __enter__(self) -> Diagnosis:
        if self._state is not None:
            raise GraphscaleError("graphscale.diagnose: this diagnosis is already active; make a new one.")
        if current() is not None:
            raise GraphscaleError(
                "graphscale.diagnose: graphscale is installed, so DeepSpeed's own scaling cannot be seen; "
                "diagnose outside the installation, or use graphscale.audit() inside it.")
        try:
            for g in self.groups:
                self._undo += _registry.observe(g)
            self._state = State.of(self.groups, "plain_params", where="diagnose")
        except BaseException:
            self.__exit__()
            raise
        self._patched = self._backward
        torch.autograd.backward = self._patched
        return self

    def __exit__(self, *exc: object) -> None:
        if self._patched is not None and torch.autograd.backward is self._patched:
            torch.autograd.backward = ORIGINAL_BACKWARD
        self._patched = None
        for undo in reversed(self._undo):
            undo()
        self._undo, self._state = [], None

    def report(self) -> str:
        rows = []
        for g in self.groups:
            kind, value = g.read_spec()
            wrong = [f for f in self.findings if f.group == g.name]
            causes = sorted({f.cause for f in wrong})
            gave = ", ".join(sorted(self._seen.get(g.name, {"-"})))
            rows.append([g.name, f"{value:g}" if kind == "gas" else "-", gave,
                         "exact" if not wrong else f"WRONG ({len({f.parameter for f in wrong})} parameter(s))",
                         "; ".join(causes)])
        head = (f"graphscale diagnosis (DeepSpeed alone, nothing governed): {self.backwards} backward(s), "
                f"{len(self.findings)} wrong gradient(s)")
        table = format_table(["engine", "GAS", "DeepSpeed gave (x plain)", "verdict", "why"], rows, rule=False)
        return "\n".join([head, table])

    __str__ = report

    # ------------------------------------------------------------ watching one backward
    def _backward(self, tensors: Any, grad_tensors: Any = None, retain_graph: bool | None = None,
                  create_graph: bool = False, grad_variables: Any = None, inputs: Any = None) -> None:
        call = BackwardCall.of(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)
        state = self._state
        if state is None or call.roots is None or torch._C._current_autograd_node() is not None:
            return call.run(None)  # nested backwards are part of the outer one
        caller = _frames.adapter_backward_caller()
        roots, grads = ((caller[1],), [None]) if caller is not None else (call.roots, list(call.grads or ()))
        leaves = [p for p in reached_leaves(call.roots, call.inputs_arg) if id(p) in state.owner]
        if not leaves or any(g is None and t.numel() != 1 for t, g in zip(roots, grads)):
            return call.run(None)
        ref = reference(state, roots, grads, leaves, self._replays)  # by replay where needed
        pairs = ref.compared(leaves)
        leaves = [p for p, _ in pairs]
        with Capture(leaves) as got:
            call.run(None)
        self.backwards += 1
        if ref.unfaithful is not None:  # after the real backward: every rank ran it
            raise GraphscaleError(f"graphscale.diagnose: backward {self.backwards}: {ref.unfaithful}")
        self._compare(state, leaves, [g for _, g in pairs], got.grads)

    def _compare(self, state: State, leaves: Sequence[torch.Tensor], ref: Sequence[torch.Tensor | None],
                 got: Sequence[torch.Tensor | None]) -> None:
        scaling = _frames.scaling_enabled()
        caller = _frames.adapter_backward_caller()
        for p, g, d in zip(leaves, ref, got):
            if g is None or not bool(g.any()):
                continue
            group = state.owner[id(p)]
            kind, value = group.read_spec()
            expected = ((1.0 / value if kind == "gas" else value) if scaling else 1.0) * _registry.audit_scale(group)
            gg = g.detach().double()
            dd = torch.zeros_like(gg) if d is None else d.double().reshape(gg.shape)
            observed = float((dd * gg).sum() / (gg * gg).sum())
            tol = max(self.rtol, dtype_rtol(p.dtype))
            mixed = float((dd - observed * gg).abs().max()) > tol * float((observed * gg).abs().max() or 1.0)
            self._seen.setdefault(group.name, set()).add("mixed" if mixed else f"{observed:.4g}")
            if mixed or abs(observed - expected) > tol * abs(expected):
                why = _cause(group, observed, mixed, self.groups, caller)
                self.findings.append(Finding(self.backwards, group.name, state.leaf_name(p), expected, observed,
                                             mixed, why))


def _cause(group: Group, observed: float, mixed: bool, groups: Sequence[Group], caller: Any) -> str:
    """Which shape of graph gives ``group`` the factor ``observed``."""
    if mixed:
        return ("paths with different factors meet in this gradient: it reaches the parameters both through "
                "this engine's output and through a direct call of its module (engine + engine.module), or "
                "through one engine output on one path and through two on another (nested engines)")
    gas = {g.name: float(v) for g in groups for k, v in [g.read_spec()] if k == "gas"}
    own = gas.get(group.name)
    if math.isclose(observed, 1.0, rel_tol=1e-3):
        return ("not divided at all: its gradient never passed an output of its engine's forward (a direct call "
                "of engine.module), or the dividing backward said scale_wrt_gas=False")
    for n in (1, 2, 3):
        for combo in combinations_with_replacement(sorted(gas), n):
            product = math.prod(gas[c] for c in combo)
            if not math.isclose(observed * product, 1.0, rel_tol=1e-3):
                continue
            if n == 1 and combo[0] != group.name:
                by = f"the GAS of {combo[0]} ({gas[combo[0]]:g}) instead of its own ({own:g})"
                called = caller is not None and any(getattr(g, "engine", None) is caller[0] and g.name == combo[0]
                                                    for g in groups)
                return f"divided by {by}" + (": that engine's backward divided the whole loss" if called else "")
            if n > 1:
                return (f"divided {n} times ({' x '.join(combo)}): its gradient passed the outputs of {n} engine "
                        "forwards (nested engines, or an engine forwarded twice on one path)")
    return f"got {observed:.4g} where {1.0 / own if own else 1.0:g} was due"


def diagnose(*engines: Any, rtol: float = 1e-4, **named: Any) -> Diagnosis:
    """Watch DeepSpeed alone, with graphscale not installed, and report per
    engine and parameter the factor DeepSpeed's backward gave beside the one
    it should have (``1/GAS`` of the owning engine; 1 under
    ``scale_wrt_gas=False``; times an fp16 engine's own loss scale), and the
    shape of graph that caused each wrong one.  Nothing is governed or
    changed: the gradients are DeepSpeed's own.

    Args:
        *engines: the DeepSpeed engines to watch (``deepspeed.DeepSpeedEngine``).
        **named: more engines, named in the report by their keyword
            (``diagnose(actor=actor_engine, critic=critic_engine)``).
        rtol: relative tolerance for "exact" (at least 4 units of a
            bfloat16/float16 parameter's epsilon).

    Returns:
        A :class:`Diagnosis`, a context manager: ``print(handle)`` is one row
        per engine; ``handle.findings`` every wrong gradient.

    Costs one extra backward (the plain reference) per backward, and a copy
    of the reached parameters' gradients.  Not while graphscale is installed
    (:func:`graphscale.audit` checks a governed run).  At ZeRO stage 3 a
    graph is backpropagated only once, so the reference comes from the
    micro-step's forward called once more (one more forward and backward):
    wrap the function that computes the loss with
    :meth:`Diagnosis.replayable` (``loss_of = found.replayable(loss_of)``);
    a backward there without one is refused before it runs.

    Example (``actor``, ``critic``: engines with GAS 2 and 4; DeepSpeed >= 0.19.6)::

        with graphscale.diagnose(actor=actor, critic=critic) as found:
            actor.backward(actor(x).sum() + critic(x).sum())
        print(found)   # critic: DeepSpeed gave 0.5 x plain (the contract: 0.25), WRONG,
                       # "divided by the GAS of actor (2) instead of its own (4): ..."
    """
    if not engines and not named:
        raise ValueError("graphscale.diagnose: give the DeepSpeed engines to watch: diagnose(engine_a, engine_b).")
    groups = []
    for name, obj in [*((None, e) for e in engines), *named.items()]:
        made = _registry.group_type(obj)
        if made is None:
            raise TypeError(f"graphscale.diagnose: takes DeepSpeed engines, got {type(obj).__name__}; a plain "
                            "module has no framework scaling to diagnose.")
        g = made(obj, name=name)
        why = _registry.audit_refusal(g)
        if why is not None:
            raise GraphscaleError(f"graphscale.diagnose: {why}")
        groups.append(g)
    return Diagnosis(groups=tuple(groups), rtol=rtol)
