"""Misuse: every mistake a user can make with an installation fails with a
clear ``graphscale:`` error naming the object and the fix (or behaves as
documented), and never leaves a gradient half-scaled."""
from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch

import graphscale
from graphscale import GraphscaleError

from helpers.engines import require_deepspeed
from helpers.grads import full_grads, max_rel_err


def _plain_grads(loss_fn: Callable[[], torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The plain-PyTorch oracle: torch.autograd.grad is never governed."""
    return [g.clone() for g in torch.autograd.grad(loss_fn(), params)]


def _two_linears(seed: int = 0) -> tuple[torch.nn.Linear, torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2), torch.nn.Linear(2, 1), torch.randn(4, 3)


# ------------------------------------------------------------- same thing twice
def test_installing_the_same_group_twice_is_idempotent_and_lasts_until_the_last_handle() -> None:
    a, b, x = _two_linears()
    ga, gb = graphscale.Group(a, gas=2), graphscale.Group(b, gas=4)
    plain = _plain_grads(lambda: b(a(x)).sum(), [*a.parameters(), *b.parameters()])
    first = graphscale.install(ga, gb)
    second = graphscale.install(ga, ga)  # the same group again, in another handle and twice in one
    try:
        b(a(x)).sum().backward()
        got = [p.grad for p in [*a.parameters(), *b.parameters()]]
        want = [plain[0] / 2, plain[1] / 2, plain[2] / 4, plain[3] / 4]
        assert max_rel_err(got, want) < 1e-6, "an installed-twice group was scaled twice or not at all"
        first.remove()  # ga is still governed by `second`
        for p in [*a.parameters(), *b.parameters()]:
            p.grad = None
        b(a(x)).sum().backward()
        assert max_rel_err([a.weight.grad, a.bias.grad], [plain[0] / 2, plain[1] / 2]) < 1e-6
    finally:
        first.remove()
        second.remove()
    assert torch.autograd.backward is graphscale._entry.entry.ORIGINAL_BACKWARD


@require_deepspeed
@pytest.mark.deepspeed
def test_installing_the_same_engine_twice_is_idempotent_and_lasts_until_the_last_handle(make_engine: Any) -> None:
    torch.manual_seed(0)
    engine = make_engine(torch.nn.Linear(3, 2), gas=4, stage=1)
    x = torch.randn(2, 3)
    plain = _plain_grads(lambda: engine.module(x).sum(), list(engine.module.parameters()))
    first = graphscale.install(engine)
    second = graphscale.install(engine, engine)
    try:
        loss = engine(x).sum()
        engine.backward(loss)
        assert max_rel_err(full_grads(engine), [g / 4 for g in plain]) < 1e-6
        engine.zero_grad()
        first.remove()  # still governed through `second`: still divided exactly once
        loss = engine(x).sum()
        engine.backward(loss)
        assert max_rel_err(full_grads(engine), [g / 4 for g in plain]) < 1e-6
        engine.zero_grad()
    finally:
        first.remove()
        second.remove()
    assert "backward" not in engine.__dict__, "the engine kept graphscale's backward after the last remove()"
    loss = engine(x).sum()  # DeepSpeed's own behaviour is back: divided once, by itself
    engine.backward(loss)
    assert max_rel_err(full_grads(engine), [g / 4 for g in plain]) < 1e-6
    engine.zero_grad()


def test_install_docstring_states_that_installing_twice_is_idempotent() -> None:
    doc = graphscale.install.__doc__ or ""
    assert "twice" in doc and "idempotent" in doc.lower()


# ------------------------------------------------------------- remove inside a hook
def test_removing_the_handle_inside_a_backward_hook_takes_effect_from_the_next_backward() -> None:
    a, b, x = _two_linears(1)
    params = [*a.parameters(), *b.parameters()]
    plain = _plain_grads(lambda: b(a(x)).sum(), params)
    inst = graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4))
    removed_in_hook: list[bool] = []

    def remove_now(grad: torch.Tensor) -> torch.Tensor:
        inst.remove()
        removed_in_hook.append(not inst.active)
        return grad

    try:
        h = a(x)
        h.register_hook(remove_now)  # fires between b's leaves and a's leaves: the walked plan is mid-flight
        b(h).sum().backward()
    finally:
        inst.remove()
    assert removed_in_hook == [True]
    # The backward that was running keeps the snapshot it started with: exact.
    want = [plain[0] / 2, plain[1] / 2, plain[2] / 4, plain[3] / 4]
    assert max_rel_err([p.grad for p in params], want) < 1e-6
    # The next one is plain PyTorch again.
    for p in params:
        p.grad = None
    b(a(x)).sum().backward()
    assert max_rel_err([p.grad for p in params], plain) < 1e-6


@require_deepspeed
@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [1, 3], ids=["zero1", "zero3"])
@pytest.mark.parametrize("direct", [False, True], ids=["engine.backward", "loss.backward"])
def test_removing_an_engine_inside_a_backward_hook_keeps_that_backward_exact(make_engine: Any, direct: bool,
                                                                            stage: int) -> None:
    """The engine's output hooks fire *after* the removal here: they must not
    start dividing in the middle of a backward that graphscale already scales."""
    torch.manual_seed(2)
    engine = make_engine(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh()), gas=4, stage=stage)
    head = torch.nn.Linear(3, 1)
    x = torch.randn(2, 3)
    plain = _plain_grads(lambda: head(engine.module(x)).sum(), list(engine.module.parameters()))
    inst = graphscale.install(engine, graphscale.Group(head, gas=2))
    try:
        out = engine(x)
        mid = out * 1.0
        mid.register_hook(lambda g: (inst.remove(), g)[1])  # above the engine's output hook
        loss = head(mid).sum()
        if direct:
            loss.backward()
        else:
            engine.backward(loss)
    finally:
        inst.remove()
    assert max_rel_err(full_grads(engine), [g / 4 for g in plain]) < 1e-6, (
        "the engine's output hook divided again after remove() in the middle of a governed backward"
    )
    assert not _on_hook_manager(), "the backward has ended: graphscale's descriptors should be gone"
    engine.zero_grad()


def _on_hook_manager() -> set[str]:
    """graphscale's descriptors on DeepSpeed's OutputBackwardHookManager class now."""
    from deepspeed.runtime.utils import OutputBackwardHookManager

    return {n for n in ("preprocess_per_tensor_fn", "preprocess_done") if n in OutputBackwardHookManager.__dict__}


@require_deepspeed
@pytest.mark.deepspeed
def test_removing_the_last_engine_leaves_deepspeeds_hook_manager_class_as_it_was(make_engine: Any) -> None:
    """Installed and removed, graphscale leaves nothing on DeepSpeed's class
    (a process that ran it times and trains as DeepSpeed alone); an output
    made while installed and backpropagated after gets DeepSpeed's own division."""
    torch.manual_seed(3)
    engine = make_engine(torch.nn.Linear(3, 3), gas=4, stage=1)
    x = torch.randn(2, 3)
    plain = _plain_grads(lambda: engine.module(x).pow(2).sum(), list(engine.module.parameters()))
    with graphscale.install(engine):
        assert _on_hook_manager() == {"preprocess_per_tensor_fn", "preprocess_done"}
        out = engine(x)
        with graphscale.install(engine):  # nested installations: off only with the last
            pass
        assert _on_hook_manager() == {"preprocess_per_tensor_fn", "preprocess_done"}
    assert not _on_hook_manager()
    out.pow(2).sum().backward()
    assert max_rel_err(full_grads(engine), [g / 4 for g in plain]) < 1e-6
    engine.zero_grad()


# ------------------------------------------------------------- loss without grad
def _error_of(fn: Callable[[], Any]) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda t: t.backward(), id="Tensor.backward"),
        pytest.param(lambda t: torch.autograd.backward(t), id="autograd.backward"),
        pytest.param(lambda t: torch.autograd.backward([t, t * 2]), id="autograd.backward-two-roots"),
    ],
)
@pytest.mark.parametrize("gases", [(2, 2), (2, 4)], ids=["fast-path", "walked"])
def test_a_loss_that_does_not_require_grad_gets_pytorchs_own_error(call: Callable[[torch.Tensor], None],
                                                                  gases: tuple[int, int]) -> None:
    a, b, x = _two_linears(3)
    with torch.no_grad():
        dead = b(a(x)).sum()
    want = _error_of(lambda: call(dead))
    with graphscale.install(graphscale.Group(a, gas=gases[0]), graphscale.Group(b, gas=gases[1])):
        got = _error_of(lambda: call(dead))
    assert got == want
    assert a.weight.grad is None and b.weight.grad is None


@require_deepspeed
@pytest.mark.deepspeed
def test_engine_backward_of_a_loss_without_grad_gets_the_same_error_as_without_graphscale(make_engine: Any) -> None:
    engine = make_engine(torch.nn.Linear(3, 1), gas=2, stage=1)
    with torch.no_grad():
        dead = engine(torch.ones(1, 3)).sum()
    want = _error_of(lambda: engine.backward(dead))
    with graphscale.install(engine):
        got = _error_of(lambda: engine.backward(dead))
    assert got == want
    loss = engine(torch.ones(1, 3)).sum()  # and the engine still works afterwards
    engine.backward(loss)
    engine.zero_grad()


# ------------------------------------------------------------- no trainable parameters
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.nn.ReLU(), id="no-parameters"),
        pytest.param(lambda: torch.nn.Linear(2, 2).requires_grad_(False), id="frozen"),
    ],
)
def test_a_group_without_trainable_parameters_warns_naming_the_group(make: Callable[[], torch.nn.Module]) -> None:
    with pytest.warns(UserWarning, match=r"graphscale: group 'frozen-or-empty' has no parameter that requires grad"):
        inst = graphscale.install(graphscale.Group(make(), gas=2, name="frozen-or-empty"))
    inst.remove()


def test_a_group_with_trainable_parameters_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graphscale.install(graphscale.Group(torch.nn.Linear(2, 2), gas=2)).remove()


# ------------------------------------------------------------- bad gas callables
def _raises() -> int:
    raise KeyError("gas lookup failed")


BAD_GAS: list[Any] = [
    pytest.param(_raises, GraphscaleError, r"gas callable of group 'critic' raised KeyError", id="raises"),
    pytest.param(lambda: 0, ValueError, r"gas callable of group 'critic' must be a positive int", id="zero"),
    pytest.param(lambda: -2, ValueError, r"gas callable of group 'critic' must be a positive int", id="negative"),
    pytest.param(lambda: 2.5, ValueError, r"gas callable of group 'critic' must be a positive int", id="float"),
    pytest.param(lambda: True, ValueError, r"gas callable of group 'critic' must be a positive int", id="bool"),
    pytest.param(lambda: "4", ValueError, r"gas callable of group 'critic' must be a positive int", id="str"),
    pytest.param(lambda: None, ValueError, r"gas callable of group 'critic' must be a positive int", id="none"),
]


@pytest.mark.parametrize("bad, exc, match", BAD_GAS)
@pytest.mark.parametrize("other_gas", [None, 2], ids=["fast-path", "walked"])
def test_a_bad_gas_callable_fails_before_any_gradient_is_touched(bad: Callable[[], Any], exc: type, match: str,
                                                                 other_gas: int | None) -> None:
    a, b, x = _two_linears(4)
    params = [*a.parameters(), *b.parameters()]
    before = [torch.full_like(p, 7.0) for p in params]
    for p, g in zip(params, before):
        p.grad = g.clone()
    groups = [graphscale.Group(b, gas=bad, name="critic")]
    if other_gas is not None:
        groups.append(graphscale.Group(a, gas=other_gas, name="actor"))
    with graphscale.install(*groups, unowned="any"):  # a, unowned, may take the one factor: the fast path
        loss = b(a(x)).sum()
        with pytest.raises(exc, match=match) as info:
            loss.backward(retain_graph=True)
        assert str(info.value).startswith("graphscale:")
        assert all(torch.equal(p.grad, g) for p, g in zip(params, before)), "a gradient was touched"
        # Fix the callable: the same graph now backpropagates exactly, nothing was left half-applied.
        groups[0]._gas = lambda: 4
        for p in params:
            p.grad = None
        loss.backward()
    plain = _plain_grads(lambda: b(a(x)).sum(), params)
    fa = 1.0 / (other_gas or 4)  # fast path: a is unowned and takes the one factor in play
    want = [plain[0] * fa, plain[1] * fa, plain[2] / 4, plain[3] / 4]
    assert max_rel_err([p.grad for p in params], want) < 1e-6


@require_deepspeed
@pytest.mark.deepspeed
@pytest.mark.parametrize("bad, exc, match", BAD_GAS[:2])
def test_a_bad_gas_callable_fails_engine_backward_before_any_gradient_is_touched(
    make_engine: Any, bad: Callable[[], Any], exc: type, match: str
) -> None:
    torch.manual_seed(5)
    engine = make_engine(torch.nn.Linear(3, 2), gas=2, stage=1)
    critic = torch.nn.Linear(2, 1)
    x = torch.randn(2, 3)
    plain = _plain_grads(lambda: critic(engine.module(x)).sum(), list(engine.module.parameters()))
    group = graphscale.Group(critic, gas=bad, name="critic")
    with graphscale.install(engine, group):
        loss = critic(engine(x)).sum()
        with pytest.raises(exc, match=match):
            engine.backward(loss)
        assert critic.weight.grad is None
        assert all(p.grad is None for p in engine.module.parameters()), "the engine's gradients were touched"
        group._gas = lambda: 4
        loss = critic(engine(x)).sum()
        engine.backward(loss)
    # Exactly one backward's worth: the failed one left nothing half-applied to accumulate onto.
    assert max_rel_err(full_grads(engine), [g / 2 for g in plain]) < 1e-6
    engine.zero_grad()
