"""Which snapshot DeepSpeed's output hooks obey, driven from threads other
than the caller's (NOTE [ Which snapshot an output hook obeys ] in
graphscale/_backward/running.py).

On CUDA, autograd runs a backward's nodes on its device worker threads, so
an engine's output hook cannot see the thread-local snapshot of the governed
backward that the caller's thread holds.  graphscale binds each governed
backward's graph task (``torch._C._current_graph_task_id()``, readable on
every thread that runs the task's nodes) to its snapshot, and the hook looks
the task up in :data:`graphscale._backward.running.bindings` and reads nothing else: no
thread-local, so what the hook sees on the CPU, where nodes run on the
caller's thread, is exactly what it would see on a device worker thread.
The tests check that every output hook found its task bound, and drive
install/remove from other threads mid-backward.  Every scenario is checked against a plain
PyTorch oracle (copies of the models made before ``deepspeed.initialize``, the
same graph run plainly, each model's gradient times 1/GAS of its engine) or
against DeepSpeed alone on fresh engines with the same weights.

Each scenario must fail when what it pins is broken; :data:`SCENARIOS` says
which mutation breaks which scenario, and
``test_each_scenario_fails_under_the_mutations_it_guards_against`` runs them:

* ``unbound``: :func:`graphscale._backward.running.bound` (the Python route) and the
  native route bind nothing (the task lookup always misses): the hook sees an
  ungoverned backward.
* ``installed_now``: the hook asks "is the engine installed now?", the only
  thread-independent answer left without the binding (what issue 12 says
  graphscale did on CUDA's threads before the binding).

The binding itself is what tells a governed task from an ungoverned one, so
the scenarios of ungoverned backwards (begun before an install,
``torch.autograd.grad``) are the ones the ``installed_now`` fallback breaks.
"""
from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.utils.checkpoint

import graphscale
from graphscale._adapters.deepspeed import hooks as _deepspeed_hooks
from graphscale._backward import running as _running
from graphscale._core import snapshot as _snapshot

from helpers import seams
from helpers.engines import require_deepspeed
from helpers.grads import full_grads, max_rel_err
from helpers.models import TanhMLP as Net

pytestmark = [pytest.mark.deepspeed, require_deepspeed]

TOL = 1e-6
CUDA_TOL = 1e-5  # engines on CUDA (tests/test_cuda.py) against the CPU oracle: other kernels; not yet measured
GAS = {"A": 2, "B": 4}
WAIT_S = 120


# ------------------------------------------------------------------ models and graphs
@dataclass
class View:
    """What a graph is built from: the engines, or the plain copies."""

    A: Any
    B: Any
    Am: torch.nn.Module | None
    U: torch.nn.Module
    x: torch.Tensor
    y: torch.Tensor


def _ckpt_around(v: View) -> list[torch.Tensor]:
    # reentrant checkpointing re-runs both engines' forwards inside the
    # backward: their output hooks fire in a nested backward's graph task
    h = v.U(v.x)
    return [torch.utils.checkpoint.checkpoint(lambda t: v.A(t) * v.B(t), h, use_reentrant=True).sum()]


GRAPHS: dict[str, Callable[[View], list[torch.Tensor]]] = {
    # DeepSpeed alone divides A twice (B's output hook, then A's)
    "nested_B_of_A": lambda v: [v.B(v.A(v.x)).square().sum()],
    # DeepSpeed alone leaves the direct module call undivided
    "engine_plus_own_module": lambda v: [(v.A(v.x) + v.Am(v.y)).square().sum()],
    # DeepSpeed alone is right for a direct backward: each hook divides its own engine
    "two_engines_two_roots": lambda v: [(v.A(v.x) * v.B(v.y)).sum(), v.B(v.y).square().sum()],
    "ckpt_around_two_engines": _ckpt_around,
}
ENGINES_OF = {"nested_B_of_A": "AB", "engine_plus_own_module": "A", "two_engines_two_roots": "AB",
              "ckpt_around_two_engines": "AB"}


class Rig:
    """Fresh engines for one run (seeded, so two rigs have the same weights),
    plain copies made before ``deepspeed.initialize``, and the oracle."""

    def __init__(self, make_engine: Callable[..., Any], graph: str, stage: int = 1, boundary: bool = True) -> None:
        self.graph = graph
        self.engines: dict[str, Any] = {}
        self.refs: dict[str, torch.nn.Module] = {}
        for k, name in enumerate(ENGINES_OF[graph]):
            torch.manual_seed(100 + k)
            m = Net()
            self.refs[name] = copy.deepcopy(m)  # before initialize: ZeRO-3 partitions m's parameters
            engine = make_engine(m, gas=GAS[name], stage=stage)
            if boundary:  # reduce at once: grads readable after one backward
                engine.set_gradient_accumulation_boundary(True)
            self.engines[name] = engine
        torch.manual_seed(7)
        self.upstream = torch.nn.Linear(4, 4)
        self.upstream_ref = copy.deepcopy(self.upstream)
        # the engines' device: cuda under DS_ACCELERATOR=cuda (tests/test_cuda.py); the oracle stays on the CPU
        self.device = next(iter(self.engines.values())).device
        self.upstream.to(self.device)

    def _inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(3)
        return torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)

    def roots(self, inputs_require_grad: bool = False) -> list[torch.Tensor]:
        e = self.engines
        a = e.get("A")
        self.inputs = tuple(t.to(self.device).requires_grad_(inputs_require_grad) for t in self._inputs())
        v = View(a, e.get("B"), None if a is None else a.module, self.upstream, *self.inputs)
        return GRAPHS[self.graph](v)

    def oracle(self) -> dict[str, list[torch.Tensor]]:
        """Each engine's gradient as it must be: plain gradient x 1/GAS."""
        r = self.refs
        torch.autograd.backward(GRAPHS[self.graph](View(r.get("A"), r.get("B"), r.get("A"), self.upstream_ref,
                                                        *self._inputs())))
        want = {n: [p.grad / GAS[n] for p in m.parameters()] for n, m in r.items()}
        for m in r.values():
            m.zero_grad(set_to_none=True)
        return want

    def grads(self) -> dict[str, list[torch.Tensor]]:
        return {n: full_grads(e) for n, e in self.engines.items()}

    @property
    def tol(self) -> float:
        return TOL if self.device.type == "cpu" else CUDA_TOL

    def mismatches(self, want: dict[str, list[torch.Tensor]]) -> list[str]:
        got = self.grads()
        errs = {n: max_rel_err(got[n], want[n]) for n in want}
        return [f"engine {n}: relative error {err:.3g} vs plain x 1/{GAS[n]}" for n, err in errs.items()
                if err > self.tol]

    def backward(self, call: str, roots: list[torch.Tensor]) -> None:
        loss = roots[0] if len(roots) == 1 else sum(roots[1:], roots[0])
        if call == "loss":
            loss.backward()
        elif call == "roots":
            torch.autograd.backward(roots)
        elif call.startswith("engine:"):
            self.engines[call.split(":")[1]].backward(loss)
        else:
            raise ValueError(call)


# ------------------------------------------------------------------ emulating a device thread
@dataclass
class Hidden:
    """What :func:`caller_thread_local_hidden` saw."""

    reached: bool = False
    hook_calls: list[tuple[bool, bool]] = field(default_factory=list)  # (thread-local set, task bound)

    def problems(self) -> list[str]:
        out = []
        if not self.reached:
            out.append("the backward never reached the roots' hook")
        if not self.hook_calls:
            out.append("no DeepSpeed output hook asked graphscale which snapshot governs it")
        return out


@contextmanager
def caller_thread_local_hidden(roots: Sequence[torch.Tensor], monkeypatch: pytest.MonkeyPatch,
                               on_reach: Callable[[], None] | None = None) -> Iterator[Hidden]:
    """Enter on the thread that calls the backward.  When the backward
    reaches ``roots`` (graphscale's binding hook has run; no engine's output
    hook has), ``on_reach()`` runs (a pause).  Records, for every lookup the
    output hooks make in ``bindings``, whether the task binding was there
    (graphscale keeps no thread-local a hook could read instead: the first
    field is always False; on CUDA the hooks run on autograd's device
    threads)."""
    seen = Hidden()

    def hide(grad: torch.Tensor) -> torch.Tensor:
        if not seen.reached:
            seen.reached = True
            if on_reach is not None:
                on_reach()
        return grad

    monkeypatch.setattr(_deepspeed_hooks, "bindings", _Recording(_deepspeed_hooks.bindings, seen))
    handles = [r.register_hook(hide) for r in roots]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _in_thread(fn: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    t = threading.Thread(target=run, name="backward")
    t.start()
    return t, errors


# ------------------------------------------------------------------ the scenarios
@dataclass(frozen=True)
class Case:
    graph: str
    call: str  # "loss" (loss.backward()), "roots" (torch.autograd.backward(roots)), "engine:A"
    stage: int = 1

    @property
    def id(self) -> str:
        return f"{self.graph}-{self.call.replace(':', '_')}-z{self.stage}"


def governed_on_a_device_thread(make_engine: Callable[..., Any], case: Case,
                                monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """(a) A governed backward whose output hooks cannot see the caller's
    thread-local: each engine's hook must pass the gradient through (the task
    is bound), so each engine's parameters get exactly plain x 1/GAS."""
    rig = Rig(make_engine, case.graph, case.stage)
    want = rig.oracle()
    with graphscale.install(*rig.engines.values()):
        roots = rig.roots()
        with caller_thread_local_hidden(roots, monkeypatch) as seen:
            rig.backward(case.call, roots)
    return seen.problems() + rig.mismatches(want)


def removed_mid_backward_on_a_device_thread(make_engine: Callable[..., Any], case: Case,
                                            monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """(b) remove() from the main thread while a governed backward, begun on
    another thread, is paused before any output hook, and the hooks cannot
    see that thread's thread-local: the running backward stays governed
    (exact); the next one is DeepSpeed's own."""
    rig = Rig(make_engine, case.graph, case.stage)
    want = rig.oracle()
    inst = graphscale.install(*rig.engines.values())
    roots = rig.roots()
    reached, resume = threading.Event(), threading.Event()

    def pause() -> None:
        reached.set()
        if not resume.wait(timeout=WAIT_S):
            raise TimeoutError("the test never resumed the backward")

    seen: list[Hidden] = []

    def run() -> None:
        with caller_thread_local_hidden(roots, monkeypatch, on_reach=pause) as s:
            seen.append(s)
            rig.backward(case.call, roots)

    try:
        worker, errors = _in_thread(run)
        if not reached.wait(timeout=WAIT_S):
            resume.set()
            worker.join(timeout=WAIT_S)
            return [f"the backward never reached its roots: {errors}"]
        inst.remove()  # no engine's output hook has fired yet
        resume.set()
        worker.join(timeout=WAIT_S)
    finally:
        inst.remove()
        resume.set()
    if worker.is_alive():
        return ["the backward thread hung"]
    if errors:
        return [f"the backward raised {type(e).__name__}: {e}" for e in errors]
    return seen[0].problems() + rig.mismatches(want)


def installed_mid_ungoverned_backward(make_engine: Callable[..., Any], case: Case,
                                      monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """(c) A backward begun ungoverned (plain torch.autograd.backward: nothing
    installed yet) on one thread; another thread installs the engines before
    any output hook fires: that backward must stay DeepSpeed's own, equal to
    DeepSpeed alone on fresh engines with the same weights."""
    alone = Rig(make_engine, case.graph, case.stage)
    alone.backward(case.call, alone.roots())
    want = alone.grads()

    rig = Rig(make_engine, case.graph, case.stage)
    roots = rig.roots()
    reached, resume = threading.Event(), threading.Event()

    def pause(grad: torch.Tensor) -> torch.Tensor:
        if not reached.is_set():
            reached.set()
            if not resume.wait(timeout=WAIT_S):
                raise TimeoutError("the test never resumed the backward")
        return grad

    handles = [r.register_hook(pause) for r in roots]
    inst = None
    try:
        worker, errors = _in_thread(lambda: rig.backward(case.call, roots))
        if not reached.wait(timeout=WAIT_S):
            resume.set()
            worker.join(timeout=WAIT_S)
            return [f"the backward never reached its roots: {errors}"]
        inst = graphscale.install(*rig.engines.values())
        resume.set()
        worker.join(timeout=WAIT_S)
    finally:
        resume.set()
        for h in handles:
            h.remove()
        if inst is not None:
            inst.remove()
    if worker.is_alive():
        return ["the backward thread hung"]
    if errors:
        return [f"the backward raised {type(e).__name__}: {e}" for e in errors]
    got = rig.grads()
    errs = {n: max_rel_err(got[n], want[n]) for n in want}
    return [f"engine {n}: differs from DeepSpeed alone by {err:.3g} (relative)" for n, err in errs.items()
            if err > rig.tol]


def autograd_grad_while_installed(make_engine: Callable[..., Any], case: Case,
                                  monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """(d) torch.autograd.grad over an installed engine's outputs is not
    governed: it gets DeepSpeed's own division, equal to DeepSpeed alone's
    torch.autograd.grad on fresh engines with the same weights."""

    def grads(rig: Rig) -> list[torch.Tensor]:
        roots = rig.roots(inputs_require_grad=True)
        loss = roots[0] if len(roots) == 1 else sum(roots[1:], roots[0])
        params = [p for e in rig.engines.values() for p in e.module.parameters()]
        found = torch.autograd.grad(loss, [*rig.inputs, *params], allow_unused=True)
        return [g.detach().clone() for g in found if g is not None]

    # not at an accumulation boundary: ZeRO's epilogue would reduce gradients grad() never
    # accumulated (an IndexError in DeepSpeed, with or without graphscale; at ZeRO 2 even here)
    want = grads(Rig(make_engine, case.graph, case.stage, boundary=False))
    rig = Rig(make_engine, case.graph, case.stage, boundary=False)
    with graphscale.install(*rig.engines.values()):
        got = grads(rig)
    err = max_rel_err(got, want)
    return [] if err <= rig.tol else [f"torch.autograd.grad differs from DeepSpeed alone's: relative error {err:.3g}"]


Runner = Callable[[Callable[..., Any], Case, pytest.MonkeyPatch], list[str]]


@dataclass(frozen=True)
class Scenario:
    run: Runner
    cases: tuple[Case, ...]
    breaks_under: tuple[str, ...]  # mutations that must make every case fail


SCENARIOS: dict[str, Scenario] = {
    "governed_on_a_device_thread": Scenario(governed_on_a_device_thread, (
        Case("nested_B_of_A", "loss"),
        Case("nested_B_of_A", "roots", stage=3),
        Case("nested_B_of_A", "engine:B"),
        Case("engine_plus_own_module", "loss"),
        Case("engine_plus_own_module", "loss", stage=2),
        Case("two_engines_two_roots", "roots"),
        Case("ckpt_around_two_engines", "loss"),
        Case("ckpt_around_two_engines", "engine:A", stage=2),
    ), ("unbound",)),
    "removed_mid_backward_on_a_device_thread": Scenario(removed_mid_backward_on_a_device_thread, (
        Case("nested_B_of_A", "loss"),
        Case("nested_B_of_A", "roots", stage=3),
        Case("engine_plus_own_module", "loss", stage=2),
        # (remove() before a reentrant checkpoint recomputes: its own test below)
    ), ("unbound", "installed_now")),
    "installed_mid_ungoverned_backward": Scenario(installed_mid_ungoverned_backward, (
        Case("nested_B_of_A", "loss"),
        Case("engine_plus_own_module", "loss", stage=2),
        Case("two_engines_two_roots", "roots", stage=3),
    ), ("installed_now",)),
    "autograd_grad_while_installed": Scenario(autograd_grad_while_installed, (
        Case("nested_B_of_A", "loss"),
        Case("engine_plus_own_module", "loss"),
        Case("two_engines_two_roots", "loss", stage=3),
        # (not ZeRO 2: DeepSpeed's post-backward epilogue raises IndexError after a grad() over its
        # parameters, which accumulated nothing, with or without graphscale)
    ), ("installed_now",)),
}


@contextmanager
def _binds_nothing(roots: Sequence[Any], state: Any) -> Iterator[tuple[Any, ...]]:
    yield tuple(roots)


class _Recording:
    """What the output hooks read as ``bindings`` (graphscale.running's task
    -> binding map) inside :func:`caller_thread_local_hidden`: each lookup
    is recorded, then answered by ``asked`` (the real map, or a mutation)."""

    def __init__(self, asked: Any, seen: Hidden) -> None:
        self.asked, self.seen = asked, seen

    def __bool__(self) -> bool:
        return True  # every hook asks, so every ask is recorded

    def get(self, tid: int) -> Any:
        self.seen.hook_calls.append((False, _running.task_binding() is not None))
        return self.asked.get(tid)


class _InstalledNow:
    """A ``bindings`` that answers every task from what is installed now,
    not from the running task."""

    def __bool__(self) -> bool:
        return True

    def get(self, tid: int) -> Any:
        state = _snapshot.current()
        return None if state is None else _running.Binding(_snapshot.Reading(state, {}))


MUTATIONS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "unbound": lambda mp: (mp.setattr(_running, "bound", _binds_nothing), seams.swap_in(mp)._set_may_bind(False)),
    "installed_now": lambda mp: mp.setattr(_deepspeed_hooks, "bindings", _InstalledNow()),
}


# ------------------------------------------------------------------ the tests
@pytest.mark.parametrize("name, case", [pytest.param(n, c, id=f"{n}-{c.id}")
                                        for n, s in SCENARIOS.items() for c in s.cases])
def test_output_hooks_obey_the_running_backward_on_any_thread(make_engine: Any, monkeypatch: pytest.MonkeyPatch,
                                                              name: str, case: Case) -> None:
    problems = SCENARIOS[name].run(make_engine, case, monkeypatch)
    assert not problems, problems


def _tracker_generation() -> bool:
    import deepspeed.runtime.engine as eng

    return hasattr(eng, "_ENGINE_BACKWARD_GRAPH_TRACKER")


@pytest.mark.parametrize("name, case, mutation", [pytest.param(n, c, m, id=f"{n}-{c.id}-{m}")
                                                  for n, s in SCENARIOS.items() for c in s.cases
                                                  for m in s.breaks_under])
def test_each_scenario_fails_under_the_mutations_it_guards_against(make_engine: Any, monkeypatch: pytest.MonkeyPatch,
                                                                   name: str, case: Case, mutation: str) -> None:
    if case.call.startswith("engine:") and _tracker_generation():
        pytest.skip("DeepSpeed >= 0.19.6: engine.backward registers its graph task and every engine's output hook "
                    "then skips its division by itself, so this case passes without graphscale's binding here; "
                    "on 0.19.5 (which CI runs too) it fails without it")
    MUTATIONS[mutation](monkeypatch)
    problems = SCENARIOS[name].run(make_engine, case, monkeypatch)
    assert problems, f"{name} passed with graphscale's binding mutated ({mutation}): the test cannot fail"


# A direct backward over two engines side by side, or a checkpoint around
# them, is right under DeepSpeed alone (each output hook divides its own
# engine): those cases are there for the binding of several roots and of a
# nested backward's task, and the mutation test shows they can fail.
DS_ALONE_RIGHT = ("two_engines_two_roots", "ckpt_around_two_engines")


@pytest.mark.parametrize("case", [c for c in SCENARIOS["governed_on_a_device_thread"].cases
                                  if c.graph not in DS_ALONE_RIGHT], ids=lambda c: c.id)
def test_deepspeed_alone_is_wrong_in_the_device_thread_cases(make_engine: Any, case: Case) -> None:
    rig = Rig(make_engine, case.graph, case.stage)
    want = rig.oracle()
    rig.backward(case.call, rig.roots())
    assert rig.mismatches(want), "DeepSpeed alone is exact here: the case shows nothing"


# ------------------------------------------------------------ nested ungoverned backward, remove() before a recompute
class _GradOfEngineInBackward(torch.autograd.Function):
    """Identity whose backward runs ``torch.autograd.grad`` over an engine's
    output (a gradient penalty computed in backward): an ungoverned backward
    nested in a governed one, on the same thread."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, run: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.run = run
        return t.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        ctx.run()
        return g, None


def test_autograd_grad_nested_in_a_governed_backward_gets_deepspeeds_own_division(make_engine: Any) -> None:
    def nested_grad(rig: Rig, installed: bool) -> torch.Tensor:
        out: list[torch.Tensor] = []
        x = rig._inputs()[0]

        def run() -> None:
            with torch.enable_grad():
                xi = x.detach().requires_grad_()
                out.append(torch.autograd.grad(rig.engines["A"](xi).sum(), xi)[0])

        other = torch.nn.Linear(4, 1)
        loss = _GradOfEngineInBackward.apply(other(x), run).sum()
        if installed:
            with graphscale.install(rig.engines["A"], graphscale.Group(other, gas=2)):
                loss.backward()
        else:
            loss.backward()
        return out[0]

    # Not at an accumulation boundary: there DeepSpeed's epilogue after a torch.autograd.grad over an
    # engine's output fails by itself (IndexError in reduce_ipg_grads; with or without graphscale).
    want = nested_grad(Rig(make_engine, "engine_plus_own_module", boundary=False), installed=False)
    got = nested_grad(Rig(make_engine, "engine_plus_own_module", boundary=False), installed=True)
    assert torch.equal(got, want), f"got {(got.norm() / want.norm()).item():.3g} x DeepSpeed alone's gradient"


def test_remove_mid_backward_before_a_reentrant_checkpoint_recomputes_keeps_that_backward_exact() -> None:
    """Plain groups, one thread: the smallest reproduction.  (With DeepSpeed
    engines inside the checkpoint the same happens; on CUDA's device threads
    their output hooks then divide, on the CPU they pass through.)"""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)

    def loss_fn() -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(lambda t: a(t) * b(t), x, use_reentrant=True).sum()

    loss_fn().backward()
    plain = [a.weight.grad.clone(), b.weight.grad.clone()]
    a.zero_grad(set_to_none=True)
    b.zero_grad(set_to_none=True)
    inst = graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4))
    try:
        loss = loss_fn()
        loss.register_hook(lambda g: (inst.remove(), g)[1])  # before the checkpoint node runs
        loss.backward()
    finally:
        inst.remove()
    err = max_rel_err([a.weight.grad, b.weight.grad], [plain[0] / 2, plain[1] / 4])
    assert err < TOL, f"relative error {err:.3g} (a got plain x {(a.weight.grad.norm() / plain[0].norm()).item():.3g})"
