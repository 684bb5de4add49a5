"""Many threads, backwards at once: the program tests/hardening/test_concurrent_backwards.py
runs in a child process (``python tests/helpers/workers/concurrent_backwards.py SCENARIO``),
so that a crash (SIGSEGV) is a failed test, not a dead test run.

Each scenario builds its graphs, starts THREADS threads that run backwards
together (behind a barrier, with the interpreter switching threads every
microsecond), and checks what they produced against plain PyTorch
(``torch.autograd.grad`` before anything is installed, times each group's
factor where a governed leaf is reached).  It runs ROUNDS times in each of
four settings: one group or two installed (``graphscale.Group`` objects,
GAS 4 and 2), the native route or the Python route
(``GRAPHSCALE_ROUTE=python``).  It prints ``start SETTING`` before each
setting and one line per mismatch; exit status 0 when nothing mismatched.
"""
from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.checkpoint

import graphscale
from graphscale import observe
from graphscale._backward import gate as _gate

from helpers.threads import run_threads

THREADS = 5
ROUNDS = 40
TOL = 1e-9


class Ident(torch.autograd.Function):
    """A custom Function: a node the walk cannot see through (it may hide a
    nested backward), so the backwards around it are bound (NOTE [ Fast path ])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


class World:
    """The modules: A (governed, GAS 4), B (governed in the two-group setting,
    GAS 2; an unowned Parameter otherwise), and an unrelated module U that
    carries the first group in the one-group setting of issue 38."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.A, self.B, self.U = (torch.nn.Linear(3, 3) for _ in range(3))
        for p in [*self.A.parameters(), *self.B.parameters()]:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g))
        self.x = torch.randn(4, 3, generator=g)

    def params(self) -> list[torch.Tensor]:
        return [*self.A.parameters(), *self.B.parameters()]

    def zero(self) -> None:
        for p in self.params():
            p.grad = None




def close(name: str, got: torch.Tensor | None, want: torch.Tensor) -> list[str]:
    if got is None:
        return [f"{name}: no gradient"]
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    return [] if err <= TOL else [f"{name}: relative error {err:.3g}"]


# ------------------------------------------------------------------ scenarios
def multi_grad_all_hook_inputs(w: World, fa: float, fb: float) -> list[str]:
    """Issue 38, torch's TestMultithreadAutograd.test_multi_grad_all_hooks: one
    shared graph with a custom Function and an "all" multi-grad hook, every
    thread ``out.backward(inputs=(t2, t3), retain_graph=True)``; nothing governed."""
    t = [torch.rand(2, requires_grad=True) for _ in range(4)]
    seen, lock = [], threading.Lock()

    def hook(grads: Sequence[torch.Tensor | None]) -> None:
        with lock:
            seen.append([g is not None for g in grads])

    torch.autograd.graph.register_multi_grad_hook(t, hook)
    out = (Ident.apply(t[1]) * t[2]).sum()
    plain = (t[2].detach(), t[1].detach())  # d out / d t2, d out / d t3 (the hook forbids autograd.grad)
    errors = run_threads([lambda: out.backward(inputs=(t[1], t[2]), retain_graph=True)] * THREADS)
    if seen != [[False, True, True, False]] * THREADS:
        errors.append(f"the multi-grad hook saw {seen}")
    return errors + close("t2", t[1].grad, THREADS * plain[0]) + close("t3", t[2].grad, THREADS * plain[1])


def hooks_on_one_shared_graph(w: World, fa: float, fb: float) -> list[str]:
    """One shared ungoverned graph through a custom Function, carrying an
    "any" multi-grad hook, a tensor hook on a non-leaf and post-accumulate
    hooks; threads mix ``backward(retain_graph=True)`` and ``torch.autograd.grad``."""
    a, b = torch.rand(3, requires_grad=True), torch.rand(3, requires_grad=True)
    calls, lock = {"any": 0, "tensor": 0, "post": 0}, threading.Lock()

    def count(key: str) -> Callable[..., None]:
        def fn(*_: Any) -> None:
            with lock:
                calls[key] += 1
        return fn

    h = Ident.apply(a * 2) * b
    h.register_hook(count("tensor"))
    torch.autograd.graph.register_multi_grad_hook((a, b), count("any"), mode="any")
    for leaf in (a, b):
        leaf.register_post_accumulate_grad_hook(count("post"))
    out = h.sum()
    plain = torch.autograd.grad(out, (a, b), retain_graph=True)
    calls.update(any=0, tensor=0)
    got: list[tuple[torch.Tensor, ...]] = []
    n_bw = THREADS // 2 + 1
    work = [lambda: out.backward(retain_graph=True)] * n_bw + [
        lambda: got.append(torch.autograd.grad(out, (a, b), retain_graph=True))] * (THREADS - n_bw)
    errors = run_threads(work)
    want = {"any": THREADS, "tensor": THREADS, "post": 2 * n_bw}
    if calls != want:
        errors.append(f"hook calls {calls}, expected {want}")
    for k, g in enumerate(got):
        errors += close(f"autograd.grad #{k}", g[0], plain[0]) + close(f"autograd.grad #{k}", g[1], plain[1])
    return errors + close("a", a.grad, n_bw * plain[0]) + close("b", b.grad, n_bw * plain[1])


def governed_shared_graph(w: World, fa: float, fb: float) -> list[str]:
    """One shared graph that reaches A's parameters through a checkpointed
    block (reentrant: a nested backward) and a custom Function, every thread
    ``backward(retain_graph=True)`` on it (governed), while others run
    ``torch.autograd.grad`` (ungoverned) over A's nodes."""
    def block(t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(w.A(t))

    x = w.x.clone().requires_grad_()  # an unowned leaf (reentrant checkpointing needs one)
    out = Ident.apply(torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)).sum()
    ps = list(w.A.parameters())
    plain = torch.autograd.grad(Ident.apply(block(x)).sum(), ps)  # (autograd.grad cannot enter the checkpoint)
    got: list[tuple[torch.Tensor, ...]] = []
    n_bw = THREADS // 2 + 1
    ungoverned = Ident.apply(block(x)).sum()
    work = [lambda: out.backward(retain_graph=True)] * n_bw + [
        lambda: got.append(torch.autograd.grad(ungoverned, ps, retain_graph=True))] * (THREADS - n_bw)
    errors = run_threads(work)
    for k, g in enumerate(got):
        errors += [e for i, p in enumerate(g) for e in close(f"autograd.grad #{k} of A[{i}]", p, plain[i])]
    return errors + [e for i, p in enumerate(ps) for e in close(f"A[{i}].grad", p.grad, n_bw * fa * plain[i])]


def governed_separate_graphs(w: World, fa: float, fb: float) -> list[str]:
    """Each thread its own graph reaching A and B (mixed factors: edge
    multipliers on its own nodes), a checkpointed block, a custom Function,
    seeds given, some threads with ``inputs=`` (the Python route)."""
    xs = [(w.x + k).requires_grad_() for k in range(THREADS)]

    def loss(x: torch.Tensor, ckpt: bool) -> torch.Tensor:
        def block(t: torch.Tensor) -> torch.Tensor:
            return torch.tanh(w.A(t))
        h = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True) if ckpt else block(x)
        return (w.B(Ident.apply(h)) * 0.5).sum() + h.pow(2).sum()

    pa, pb = list(w.A.parameters()), list(w.B.parameters())
    plain = [torch.autograd.grad(loss(x, False), pa + pb) for x in xs]

    def work(k: int) -> Callable[[], None]:
        if k % 2:  # (reentrant checkpointing refuses inputs=)
            return lambda: torch.autograd.backward(loss(xs[k], False), torch.tensor(1.0), inputs=pa + pb)
        return lambda: loss(xs[k], True).backward()

    errors = run_threads([work(k) for k in range(THREADS)])
    for i, p in enumerate(pa + pb):
        f = fa if i < len(pa) else fb
        errors += close(f"{'AB'[i >= len(pa)]}[{i}].grad", p.grad, f * sum(g[i] for g in plain))
    return errors


def several_factors_on_one_shared_graph(w: World, fa: float, fb: float) -> list[str]:
    """One shared graph reaching A and B (several factors: the plan puts edge
    multipliers on its nodes), every thread on it at once: governed
    ``backward(retain_graph=True)``, some with ``inputs=``, and ungoverned
    ``torch.autograd.grad`` over the same nodes, which must see no multiplier.

    One governed backward of each style runs first, alone: the first time a
    node gets its multiplier hook, torch's vector of that node's hooks grows,
    and a thread running that node at that moment could read it while it
    moves -- the one exposure left, as with any ``register_hook``
    (docs/contract.md, "Threads"; under AddressSanitizer this scenario died
    of SIGSEGV in torch's ``evaluate_function`` when the threads met it).
    Every backward after that touches only the hook's rows."""
    h = torch.tanh(w.A(w.x))
    out = (w.B(h) * 0.5).sum() + h.pow(2).sum()
    pa, pb = list(w.A.parameters()), list(w.B.parameters())
    plain = torch.autograd.grad(out, pa + pb, retain_graph=True)
    got: list[tuple[torch.Tensor, ...]] = []
    n_bw = THREADS // 2 + 1
    styles = [lambda: out.backward(retain_graph=True),
              lambda: torch.autograd.backward(out, inputs=pa + pb, retain_graph=True)]
    for first in styles:
        first()
    work = [styles[0]] * (n_bw - 1) + [styles[1]] + [
        lambda: got.append(torch.autograd.grad(out, pa + pb, retain_graph=True))] * (THREADS - n_bw)
    errors = run_threads(work)
    for k, g in enumerate(got):
        errors += [e for i, p in enumerate(g) for e in close(f"autograd.grad #{k} [{i}]", p, plain[i])]
    for i, p in enumerate(pa + pb):
        f = fa if i < len(pa) else fb
        errors += close(f"{'AB'[i >= len(pa)]}[{i}].grad", p.grad, (n_bw + len(styles)) * f * plain[i])
    return errors


SCENARIOS: dict[str, Callable[[World, float, float], list[str]]] = {
    "multi-grad all hook, inputs=, custom Function (issue 38)": multi_grad_all_hook_inputs,
    "hooks of every kind on one shared ungoverned graph": hooks_on_one_shared_graph,
    "governed and ungoverned backwards on one shared governed graph": governed_shared_graph,
    "governed backwards on separate graphs, mixed factors": governed_separate_graphs,
    "several factors on one shared graph, governed and ungoverned": several_factors_on_one_shared_graph,
}
SETTINGS = [(groups, route) for groups in ("one group", "two groups") for route in ("native", "python")]
PYTHON_SETTINGS = [s for s in SETTINGS if s[1] == "python"]  # GRAPHSCALE_WALKER=python: no native module


def main(name: str) -> int:
    scenario, failures = SCENARIOS[name], 0
    torch.set_default_dtype(torch.double)  # here, not at import: the test module imports this file
    sys.setswitchinterval(1e-6)  # threads interleave inside every hook and every Python step
    disabled = os.environ.get("GRAPHSCALE_WALKER", "").strip().lower() == "python"
    for groups, route in PYTHON_SETTINGS if disabled else SETTINGS:
        print("start", groups, route, flush=True)
        w = World()
        _gate.set_route_enabled(route == "native")
        if groups == "one group":  # B is an unowned Parameter; the group sits on U (issue 38) and on A
            fa, fb, made = 0.25, 1.0, [graphscale.Group(w.A, gas=4), graphscale.Group(w.U, gas=4)]
        else:
            fa, fb, made = 0.25, 0.5, [graphscale.Group(w.A, gas=4), graphscale.Group(w.B, gas=2)]
        with graphscale.install(*made):
            if route == "native" and observe.walker() != "native":
                print("graphscale: the native walker did not load:", observe.walker(), flush=True)
                return 2
            for r in range(ROUNDS):
                w.zero()
                for line in scenario(w, fa, fb):
                    failures += 1
                    print(f"{groups}, {route} route, round {r}: {line}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
