"""Several threads' backwards at once through the one device thread: the
program tests/device_threads/test_concurrency.py runs in a
child process (``python _device_threads_concurrent.py SCENARIO``), so that a
crash (SIGSEGV, SIGABRT) is a failed test, not a dead test run.  The device
thread model of tests/helpers/workers/concurrent_backwards.py's scenarios.

On CUDA, every thread's backward hands its nodes to the same device thread,
which runs them interleaved, task by task; a reentrant checkpoint's nested
backward, run by that thread, also runs other threads' nodes while it waits
for its own.  Each scenario starts THREADS caller threads behind a barrier
(the interpreter switching threads every microsecond), each running
governed backwards on the device; it counts the backwards that completed,
checks every parameter against plain PyTorch (``torch.autograd.grad`` before
install, times each group's factor, summed over the threads: float64, since
the order the threads accumulate in is not fixed) and that every parameter's
hook ran on the device thread.  ROUNDS rounds in each SETTING (two groups,
GAS 4 and 2, or one with B unowned; the native route or the Python route).
It prints ``start SETTING`` before each, one line per problem, and
``completed N of M`` at the end; exit status 0 when nothing went wrong.
"""
from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE))]  # tests/: the helpers package

import torch  # noqa: E402
import torch.utils.checkpoint  # noqa: E402

from helpers import device_threads as dt  # noqa: E402
from helpers.threads import run_threads  # noqa: E402

THREADS = 4
ROUNDS = 6
TOL = 1e-12


class Ident(torch.autograd.Function):
    """A custom Function: a node the walk cannot see through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g


class Run:
    """One setting's modules (A, B on the device), counters and problems."""

    def __init__(self, fa: float, fb: float) -> None:
        torch.manual_seed(0)
        self.A, self.B = dt.to_device(torch.nn.Linear(3, 3)), dt.to_device(torch.nn.Linear(3, 3))
        self.fa, self.fb = fa, fb
        self.threads = dt.ThreadLog()
        for name, p in self.named():
            p.register_hook(self.threads.hook(name))
        self.done = 0
        self.expected = 0
        self.lock = threading.Lock()

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"A.{n}", p) for n, p in self.A.named_parameters()] + [
            (f"B.{n}", p) for n, p in self.B.named_parameters()]

    def params(self) -> list[torch.Tensor]:
        return [p for _, p in self.named()]

    def factors(self) -> list[float]:
        return [self.fa if n.startswith("A") else self.fb for n, _ in self.named()]

    def completed(self) -> None:
        with self.lock:
            self.done += 1

    def check(self, want: Sequence[torch.Tensor]) -> list[str]:
        out = []
        for (name, p), w, f in zip(self.named(), want, self.factors()):
            if p.grad is None:
                out.append(f"{name}: no gradient")
                continue
            got, w = dt.on_cpu(p.grad), w * f
            err = float((got - w).abs().max() / w.abs().max().clamp_min(1e-300))
            if err > TOL:
                out.append(f"{name}: relative error {err:.3g} (got {float(got.norm() / w.norm()):.4g} x expected)")
            p.grad = None
        return out + self.threads.off_device()




def _inputs(k: int) -> torch.Tensor:
    return dt.to_device(torch.randn(4, 3, generator=torch.Generator().manual_seed(k)))


# ------------------------------------------------------------------ scenarios
def separate_graphs(r: Run) -> list[str]:
    """Each thread its own graph reaching A and B (edge multipliers on its own
    nodes), through a custom Function; half by torch.autograd.backward with a
    seed, half by loss.backward()."""
    xs = [_inputs(k) for k in range(THREADS)]

    def loss(x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(r.A(x))
        return (r.B(Ident.apply(h)) * 0.5).sum() + h.pow(2).sum()

    plain = [torch.autograd.grad(loss(x), r.params()) for x in xs]
    seed = torch.tensor(1.0, device=xs[0].device)

    def work(k: int) -> Callable[[], None]:
        def go() -> None:
            if k % 2:
                torch.autograd.backward([loss(xs[k])], [seed])
            else:
                loss(xs[k]).backward()
            r.completed()
        return go

    r.expected += THREADS
    errors = run_threads([work(k) for k in range(THREADS)])
    return errors + r.check([sum(g[i] for g in plain) for i in range(len(r.params()))])


def reentrant_checkpoints(r: Run) -> list[str]:
    """Each thread a reentrant checkpoint around A and B: its nested backward
    runs on the device thread, which also runs the other threads' nodes."""
    xs = [_inputs(10 + k).requires_grad_() for k in range(THREADS)]

    def block(t: torch.Tensor) -> torch.Tensor:
        return r.A(t) * torch.tanh(r.B(t))

    plain = [torch.autograd.grad(block(x).sum(), r.params()) for x in xs]

    def work(k: int) -> Callable[[], None]:
        def go() -> None:
            torch.utils.checkpoint.checkpoint(block, xs[k], use_reentrant=True).sum().backward()
            r.completed()
        return go

    r.expected += THREADS
    errors = run_threads([work(k) for k in range(THREADS)])
    return errors + r.check([sum(g[i] for g in plain) for i in range(len(r.params()))])


def one_shared_graph(r: Run) -> list[str]:
    """One graph reaching A and B, every thread on it at once: governed
    ``backward(retain_graph=True)``, and ungoverned ``torch.autograd.grad``
    over the same nodes, which must see no multiplier.  One governed
    backward runs first, alone, so the threads never meet a node's first
    hook (the exposure docs/contract.md names under "Threads")."""
    h = torch.tanh(r.A(_inputs(20)))
    out = (r.B(h) * 0.5).sum() + h.pow(2).sum()
    plain = torch.autograd.grad(out, r.params(), retain_graph=True)
    got: list[tuple[torch.Tensor, ...]] = []
    n_bw = THREADS // 2 + 1
    out.backward(retain_graph=True)

    def governed() -> None:
        out.backward(retain_graph=True)
        r.completed()

    def ungoverned() -> None:
        got.append(torch.autograd.grad(out, r.params(), retain_graph=True))
        r.completed()

    r.expected += THREADS
    errors = run_threads([governed] * n_bw + [ungoverned] * (THREADS - n_bw))
    for k, g in enumerate(got):
        for i, (p, w) in enumerate(zip(g, plain)):
            if not torch.equal(dt.on_cpu(p), dt.on_cpu(w)):
                errors.append(f"autograd.grad #{k} [{i}]: scaled")
    return errors + r.check([(n_bw + 1) * dt.on_cpu(g) for g in plain])


SCENARIOS: dict[str, Callable[[Run], list[str]]] = {
    "separate graphs, mixed factors": separate_graphs,
    "reentrant checkpoints, nested backwards on the one device thread": reentrant_checkpoints,
    "one shared graph, governed and ungoverned": one_shared_graph,
}
SETTINGS = [(groups, route) for groups in ("one group", "two groups") for route in ("native", "python")]


def main(name: str) -> int:
    import graphscale
    from graphscale import observe
    from graphscale._routes import native as _route

    torch.set_default_dtype(torch.double)
    sys.setswitchinterval(1e-6)
    problems = expected = done = 0
    for groups, route in SETTINGS:
        print("start", groups, route, flush=True)
        _route.enabled = route == "native"
        r = Run(0.25, 0.5 if groups == "two groups" else 1.0)
        made = [graphscale.Group(r.A, gas=4)] + ([graphscale.Group(r.B, gas=2)] if groups == "two groups" else [])
        with graphscale.install(*made):
            if route == "native" and observe.walker() != "native":
                print("graphscale: the native walker did not load:", observe.walker(), flush=True)
                return 2
            for k in range(ROUNDS):
                for line in SCENARIOS[name](r):
                    problems += 1
                    print(f"{groups}, {route} route, round {k}: {line}", flush=True)
        if not r.threads.seen:
            problems += 1
            print(f"{groups}, {route} route: no parameter hook ran", flush=True)
        expected, done = expected + r.expected, done + r.done
    print(f"completed {done} of {expected}", flush=True)
    return 1 if problems or done != expected else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
