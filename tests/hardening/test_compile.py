"""torch.compile'd modules and torch.func transforms inside groups and engines.

A compiled region is one autograd node (``CompiledFunctionBackward``) whose
edges lead to the parameters it uses; graphscale walks and hooks it like any
other node, so the leaves are exact.  torch.func transforms run their own
(ungoverned) differentiation inside the forward; what reaches the outer graph
is ordinary autograd nodes.  Every case is checked against the same
computation, uncompiled and untransformed, backpropagated by plain PyTorch."""
from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch

import graphscale
from graphscale._planner import walk as _walk

from helpers.engines import require_deepspeed
from helpers.grads import full_grads, max_rel_err

FULL = os.environ.get("GRAPHSCALE_FULL") == "1"


def _nets(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    actor = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    critic = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    return actor, critic, torch.randn(5, 3)


def _node_names(loss: torch.Tensor) -> set[str]:
    return {type(n).__name__ for n in _walk.walk([loss.grad_fn]).nodes}


def _governed_vs_plain(actor: torch.nn.Module, critic: torch.nn.Module,
                       governed_loss: Callable[[], torch.Tensor], plain_loss: Callable[[], torch.Tensor],
                       expect_node: str | None = None) -> None:
    params = [*actor.parameters(), *critic.parameters()]
    plain = torch.autograd.grad(plain_loss(), params)
    with graphscale.install(graphscale.Group(actor, gas=2), graphscale.Group(critic, gas=4)):
        loss = governed_loss()
        if expect_node is not None:
            assert expect_node in _node_names(loss), f"no {expect_node} in the graph: the case is not exercised"
        loss.backward()
    n = len(list(actor.parameters()))
    want = [g / 2 for g in plain[:n]] + [g / 4 for g in plain[n:]]
    got = [p.grad for p in params]
    assert all(g is not None for g in got), "a parameter got no gradient"
    assert max_rel_err(got, want) < 1e-5


# ---------------------------------------------------------------- torch.compile
SHAPES: list[Any] = [
    pytest.param(lambda a, c, x: c(a(x)).sum(), id="nested"),
    pytest.param(lambda a, c, x: (c(a(x)).sum() + a(x).pow(2).mean()), id="nested-plus-side"),
    pytest.param(lambda a, c, x: (a(x).sum() + c(x).sum()), id="parallel"),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("which", ["actor", "both"])
def test_compiled_modules_inside_groups_are_exact(shape: Callable[..., torch.Tensor], which: str) -> None:
    torch._dynamo.reset()
    actor, critic, x = _nets()
    ca = torch.compile(actor, backend="aot_eager")
    cc = torch.compile(critic, backend="aot_eager") if which == "both" else critic
    _governed_vs_plain(actor, critic, lambda: shape(ca, cc, x), lambda: shape(actor, critic, x),
                       expect_node="CompiledFunctionBackward")


def test_one_compiled_function_spanning_both_groups_is_exact() -> None:
    """One compiled node whose edges reach both groups: multiplied per edge."""
    torch._dynamo.reset()
    actor, critic, x = _nets(1)

    def loss_fn(inp: torch.Tensor) -> torch.Tensor:
        h = actor(inp)
        return critic(h).sum() + h.pow(2).mean()

    compiled = torch.compile(loss_fn, backend="aot_eager")
    _governed_vs_plain(actor, critic, lambda: compiled(x), lambda: loss_fn(x), expect_node="CompiledFunctionBackward")


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="inductor compiles C++: set GRAPHSCALE_FULL=1")
def test_inductor_compiled_modules_inside_groups_are_exact() -> None:
    torch._dynamo.reset()
    actor, critic, x = _nets(2)
    ca = torch.compile(actor)
    _governed_vs_plain(actor, critic, lambda: critic(ca(x)).sum() + ca(x).pow(2).mean(),
                       lambda: critic(actor(x)).sum() + actor(x).pow(2).mean(),
                       expect_node="CompiledFunctionBackward")


@require_deepspeed
@pytest.mark.deepspeed
@pytest.mark.parametrize("direct", [False, True], ids=["engine.backward", "loss.backward"])
def test_a_compiled_submodule_inside_a_deepspeed_engine_is_exact(make_engine: Any, direct: bool) -> None:
    torch._dynamo.reset()
    torch.manual_seed(3)
    inner = torch.nn.Linear(3, 4)
    module = torch.nn.Sequential(torch.compile(inner, backend="aot_eager"), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    critic = torch.nn.Linear(3, 1)
    x = torch.randn(5, 3)
    plain_module = torch.nn.Sequential(inner, module[1], module[2])  # same parameters, uncompiled
    plain = torch.autograd.grad(critic(plain_module(x)).sum(), [*plain_module.parameters()])
    engine = make_engine(module, gas=4, stage=1)
    with graphscale.install(engine, graphscale.Group(critic, gas=2)):
        loss = critic(engine(x)).sum()
        assert "CompiledFunctionBackward" in _node_names(loss)
        loss.backward() if direct else engine.backward(loss)
    assert max_rel_err(full_grads(engine), [g / 4 for g in plain]) < 1e-5
    engine.zero_grad()


# ---------------------------------------------------------------- torch.func
def _func_shapes() -> list[Any]:
    from torch.func import functional_call, grad, vmap

    def with_functional_call(a: torch.nn.Module, c: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = functional_call(a, dict(a.named_parameters()), (x,))
        return functional_call(c, dict(c.named_parameters()), (h,)).sum()

    def with_vmap(a: torch.nn.Module, c: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = vmap(a)(x)  # per-sample forward of the actor
        return vmap(lambda hi: c(hi))(h).sum() + h.pow(2).mean()

    def with_grad_penalty(a: torch.nn.Module, c: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = a(x)
        # the critic's input-gradient, per sample, as in a gradient penalty (double backward)
        gx = vmap(grad(lambda hi: c(hi).sum()))(h)
        return c(h).sum() + gx.pow(2).sum()

    def with_functional_grad_of_params(a: torch.nn.Module, c: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        # a meta-learning step: the actor's parameters after one inner SGD step, kept differentiable
        params = dict(a.named_parameters())
        inner = grad(lambda p: functional_call(a, p, (x,)).pow(2).mean())(params)
        fast = {k: v - 0.1 * inner[k] for k, v in params.items()}
        return c(functional_call(a, fast, (x,))).sum()

    return [
        pytest.param(with_functional_call, id="functional_call"),
        pytest.param(with_vmap, id="vmap"),
        pytest.param(with_grad_penalty, id="vmap-grad-penalty"),
        pytest.param(with_functional_grad_of_params, id="grad-inner-step"),
    ]


@pytest.mark.parametrize("shape", _func_shapes())
@pytest.mark.parametrize("gases", [(2, 4), (4, 4)], ids=["walked", "fast-path"])
def test_torch_func_transforms_inside_a_groups_forward_are_exact(shape: Callable[..., torch.Tensor],
                                                                 gases: tuple[int, int]) -> None:
    actor, critic, x = _nets(4)
    params = [*actor.parameters(), *critic.parameters()]
    plain = torch.autograd.grad(shape(actor, critic, x), params)
    with graphscale.install(graphscale.Group(actor, gas=gases[0]), graphscale.Group(critic, gas=gases[1])):
        shape(actor, critic, x).backward()
    n = len(list(actor.parameters()))
    want = [g / gases[0] for g in plain[:n]] + [g / gases[1] for g in plain[n:]]
    assert max_rel_err([p.grad for p in params], want) < 1e-5


def test_backward_inside_a_torch_func_transform_gets_pytorchs_own_error() -> None:
    from torch.func import grad

    actor, critic, x = _nets(5)

    def calls_backward(inp: torch.Tensor) -> torch.Tensor:
        loss = critic(actor(inp)).sum()
        loss.backward()
        return loss

    with pytest.raises(Exception) as plain_error:
        grad(calls_backward)(x)
    for p in [*actor.parameters(), *critic.parameters()]:
        p.grad = None
    with graphscale.install(graphscale.Group(actor, gas=2), graphscale.Group(critic, gas=4)):
        with pytest.raises(Exception) as governed_error:
            grad(calls_backward)(x)
    assert (type(governed_error.value), str(governed_error.value)) == (type(plain_error.value),
                                                                       str(plain_error.value))
