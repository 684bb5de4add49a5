"""Nested backwards on the device-thread device (tests/helpers/device_threads.py):
reentrant checkpoints (``use_reentrant=True``) around groups, inside them and
inside each other, and a custom Function whose backward runs a backward of
its own.  On CUDA autograd runs the checkpoint's node on the device thread,
so its nested backward starts there, where no thread-local of the caller's
is visible: graphscale finds the outer potential of that node from the node
(``torch._C._current_autograd_node()``; NOTE [ Nested backward ] in the design).

Every case: each parameter exactly plain x its factor (the same backward run
plainly first), on both routes, by three backward styles, and the recompute
and every parameter's hook on the device thread.  The non-reentrant
checkpoint is left out: it aborts plain torch on this device."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.utils.checkpoint

from helpers import device_threads as dt
from helpers.device_threads_world import World


def ckpt(fn: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor, threads: dt.ThreadLog,
         name: str, reentrant: bool = True) -> torch.Tensor:
    """``checkpoint(fn, t, use_reentrant=...)``, recording the thread its recompute ran on."""
    def block(u: torch.Tensor) -> torch.Tensor:
        if torch._C._current_autograd_node() is not None:  # the recompute: inside a node of the backward
            threads.mark(name)
        return fn(u)
    return torch.utils.checkpoint.checkpoint(block, t, use_reentrant=reentrant)


class BackwardInBackward(torch.autograd.Function):
    """Identity whose backward runs ``torch.autograd.backward(inner())``: a
    nested backward the outer walk cannot see, started on the device thread."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, inner: Callable[[], torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        ctx.inner = inner
        return t.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        with torch.enable_grad():
            torch.autograd.backward(ctx.inner())
        return g, None


@dataclass(frozen=True)
class Case:
    id: str
    loss: Callable[[World, dt.ThreadLog], torch.Tensor]
    marks: tuple[str, ...]  # recomputes / nested backwards that must have run on the device thread
    groups: str = "AB"
    backwards: int = 2  # governed backwards at least: the outer one and a nested one


def _leaf(w: World) -> torch.Tensor:
    return w.x.detach().requires_grad_()  # an input leaf that needs a gradient (reentrant checkpointing wants one)


CASES = [
    Case("ckpt_around_two_groups",
         lambda w, th: ckpt(lambda t: w.A(t) * w.B(t), w.U(w.x), th, "ckpt").sum(), ("ckpt",)),
    Case("ckpt_around_nested_A_of_B",
         lambda w, th: ckpt(lambda t: w.A(torch.tanh(w.B(t))), w.U(w.x), th, "ckpt").square().sum(), ("ckpt",)),
    Case("ckpt_inside_nested_A_of_B",
         lambda w, th: w.A(torch.tanh(ckpt(lambda t: torch.tanh(w.B(t)), w.U(w.x), th, "ckpt"))).square().sum(),
         ("ckpt",)),
    Case("ckpt_inside_ckpt",
         lambda w, th: ckpt(lambda t: w.A(ckpt(lambda u: torch.tanh(w.B(u)), t, th, "inner")), w.U(w.x), th,
                            "outer").square().sum(), ("outer", "inner")),
    Case("two_ckpts_side_by_side",
         lambda w, th: (ckpt(lambda t: torch.tanh(w.A(t)), w.U(w.x), th, "a") * ckpt(
             lambda t: torch.tanh(w.B(t)), w.U(w.y), th, "b")).sum(), ("a", "b")),
    Case("ckpt_of_unowned_feeding_a_group",
         lambda w, th: w.A(ckpt(lambda t: torch.tanh(w.U(t)), _leaf(w), th, "ckpt")).square().sum(), ("ckpt",), "A"),
    Case("ckpt_around_one_group_fast_path",
         lambda w, th: ckpt(lambda t: torch.tanh(w.A(t)), _leaf(w), th, "ckpt").square().sum(), ("ckpt",), "A"),
    Case("ckpt_around_group_and_unowned",
         lambda w, th: ckpt(lambda t: w.A(t) + w.U(t), _leaf(w), th, "ckpt").square().sum(), ("ckpt",), "A"),
    Case("custom_function_backward_in_backward",
         lambda w, th: w.A(BackwardInBackward.apply(w.U(w.x), lambda: (th.mark("nested"), w.B(w.y).square().sum())[1]))
         .square().sum(), ("nested",)),
    # non-reentrant: no nested backward; the recompute runs in the unpack hooks, on the device thread
    Case("nonreentrant_ckpt_around_two_groups",
         lambda w, th: ckpt(lambda t: w.A(t) * w.B(t), w.U(w.x), th, "ckpt", reentrant=False).sum(), ("ckpt",),
         backwards=1),
    Case("nonreentrant_ckpt_inside_nested_A_of_B",
         lambda w, th: w.A(torch.tanh(ckpt(lambda t: torch.tanh(w.B(t)), w.U(w.x), th, "ckpt", reentrant=False)))
         .square().sum(), ("ckpt",), backwards=1),
]


def _retain_then_again(loss: torch.Tensor) -> None:
    loss.backward(retain_graph=True)
    loss.backward()


STYLES: dict[str, Callable[[torch.Tensor], None]] = {
    "loss.backward": lambda loss: loss.backward(),
    "autograd.backward(grad_tensors)": lambda loss: torch.autograd.backward([loss], [torch.tensor(0.5,
                                                                                                  device=loss.device)]),
    "retain_graph=True then again": _retain_then_again,
}


@pytest.mark.parametrize("route", dt.ROUTES)
@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_nested_backwards_on_the_device_thread_give_every_parameter_plain_times_its_factor(
        case: Case, style: str, route: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    dt.use_route(route, request)
    world = World(case.groups)
    threads = dt.ThreadLog()
    world.watch(threads)
    problems = world.mismatches(lambda: STYLES[style](case.loss(world, threads)), route, times=case.backwards)
    assert not problems, problems
    threads.assert_on_device_thread(*world.reached, *case.marks)
