"""The probe of issue 53, run by tests/hardening/test_backwards_never_wait.py in
a child process (``python tests/helpers/workers/unrelated_backward.py ROUTE KIND``),
so that a hang is a failed test, not a hung test run.

Two groups (GAS 2 and 4) share one loss, so its backward is planned and puts
multipliers on nodes.  A tensor hook in that governed backward starts a thread
that runs the backward (``KIND`` "backward") or ``torch.autograd.grad``
(``KIND`` "grad") of an unrelated model (no group, its own graph) and waits for
it, at most WAIT_S seconds.  Without graphscale both finish at once.  Prints
``unrelated finished: True|False`` and ``governed exact: True|False``; the
governed gradients are checked against plain PyTorch times each group's
factor.  ``ROUTE``: "native" or "python" (the gate's route override).
"""
from __future__ import annotations

import sys
import threading

import torch
from torch import nn

import graphscale
from graphscale._backward import gate as _gate

WAIT_S = 20.0  # a bound for a backward that waits on another, not a timing


def main(route: str, kind: str) -> None:
    torch.manual_seed(0)
    a, b, unrelated = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
    x = torch.randn(3, 4)
    want = [torch.autograd.grad((a(x) * b(x)).sum(), p)[0] for p in (a.weight, b.weight)]
    finished = threading.Event()

    def run_unrelated() -> None:
        loss = unrelated(torch.randn(2, 4)).sum()
        if kind == "grad":
            torch.autograd.grad(loss, unrelated.weight)
        else:
            loss.backward()
        finished.set()

    def hook(g: torch.Tensor) -> torch.Tensor:
        helper = threading.Thread(target=run_unrelated, daemon=True)
        helper.start()
        helper.join(WAIT_S)
        return g

    with _gate.route_override(route == "native"), \
            graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4)):
        h = a(x)
        h.register_hook(hook)
        (h * b(x)).sum().backward()
    print("unrelated finished:", finished.is_set())
    got = [a.weight.grad, b.weight.grad]
    exact = all(g is not None and torch.allclose(g, w / f, rtol=1e-6, atol=1e-7)
                for g, w, f in zip(got, want, (2, 4)))
    print("governed exact:", exact)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
