"""The scenarios of the thread-governance tests (NOTE [ Which snapshot an
output hook obeys ] in graphscale/_backward/running.py): a backward governed
on a device thread, removed in its middle, an ungoverned one installed into,
and ``torch.autograd.grad`` while installed; each names the mutations it
guards against."""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.utils.checkpoint

import graphscale

from helpers.grads import max_rel_err
from helpers.thread_rig import WAIT_S, Case, Hidden, Rig, caller_thread_local_hidden, in_thread


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
        worker, errors = in_thread(run)
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
        worker, errors = in_thread(lambda: rig.backward(case.call, roots))
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
