"""The rig of the thread-governance tests: engines beside plain copies of
their models, graphs over them, and backwards driven from threads other than
the caller's (tests/hardening/test_thread_governance*.py,
tests/stacks/test_cuda.py)."""
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

from graphscale._adapters.deepspeed import hooks as _deepspeed_hooks
from graphscale._backward import running as _running

from helpers.grads import full_grads, max_rel_err
from helpers.models import TanhMLP as Net

TOL = 1e-6
CUDA_TOL = 1e-5  # engines on CUDA (tests/stacks/test_cuda.py) against the CPU oracle: other kernels; not yet measured
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
        # the engines' device: cuda under DS_ACCELERATOR=cuda (tests/stacks/test_cuda.py); the oracle stays on the CPU
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

    monkeypatch.setattr(_deepspeed_hooks, "bindings", Recording(_deepspeed_hooks.bindings, seen))
    handles = [r.register_hook(hide) for r in roots]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def in_thread(fn: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
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


class Recording:
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
