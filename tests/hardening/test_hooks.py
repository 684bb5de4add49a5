"""Other hooks next to graphscale's: what each one sees, as documented in
docs/hooks.md, "Hooks and what they see".

The oracle is always the same graph backpropagated by plain PyTorch
(``torch.autograd.grad``, which graphscale leaves alone), with the same user
hooks registered, so each hook's plain value is known."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import graphscale

from helpers.engines import require_deepspeed
from helpers.grads import full_grads, max_rel_err


class Recorder:
    """Tensor hooks that record what they see, optionally scaling it (linearly)."""

    def __init__(self, times: float = 1.0) -> None:
        self.seen: dict[str, list[torch.Tensor]] = {}
        self.times = times

    def hook(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def record(grad: torch.Tensor) -> torch.Tensor:
            self.seen.setdefault(name, []).append(grad.detach().clone())
            return grad * self.times

        return record


def _ratio(got: torch.Tensor, plain: torch.Tensor) -> float:
    """The single c with got == c * plain (asserted), for a non-zero plain."""
    k = int(plain.abs().argmax())
    c = float(got.flatten()[k] / plain.flatten()[k])
    assert torch.allclose(got, c * plain, rtol=1e-5, atol=1e-7), "the hook saw a mixture of factors"
    return c


def _nets(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    actor = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    critic = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    return actor, critic, torch.randn(5, 3)


def _forward(actor: torch.nn.Module, critic: torch.nn.Module, x: torch.Tensor, rec: Recorder,
             retain: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """critic(actor(x)) + a side term on actor only, with hooks on intermediates."""
    a_hidden = actor[1](actor[0](x))  # region below: actor's first layer only
    a_out = actor[2](a_hidden)  # region below: actor only
    c_hidden = critic[1](critic[0](a_out))  # region below: critic and actor (mixed)
    loss = critic[2](c_hidden).sum() + a_out.pow(2).mean()
    named = {"a_hidden": a_hidden, "a_out": a_out, "c_hidden": c_hidden, "loss": loss}
    for name, t in named.items():
        t.register_hook(rec.hook(name))
        if retain:
            t.retain_grad()
    return loss, named


CASES = [
    pytest.param((4, 4), "any", id="fast-path-gas4"),
    pytest.param((2, 4), "any", id="walked-gas2-gas4"),
    pytest.param((2, 4), "plain", id="walked-raw"),
    pytest.param((3, 3), "plain", id="raw-one-factor"),
]


@pytest.mark.parametrize("times", [1.0, 3.0], ids=["observing-hooks", "scaling-hooks"])
@pytest.mark.parametrize("gases, unowned", CASES)
def test_tensor_hooks_and_retain_grad_see_the_gradient_times_their_nodes_potential(
    gases: tuple[int, int], unowned: str, times: float
) -> None:
    actor, critic, x = _nets()
    params = [*actor.parameters(), *critic.parameters()]
    fa, fc = 1.0 / gases[0], 1.0 / gases[1]

    plain_rec = Recorder(times)
    loss, _ = _forward(actor, critic, x, plain_rec, retain=False)
    plain = torch.autograd.grad(loss, params)

    rec = Recorder(times)
    with graphscale.install(graphscale.Group(actor, gas=gases[0]), graphscale.Group(critic, gas=gases[1]),
                            unowned=unowned):
        loss, named = _forward(actor, critic, x, rec, retain=True)
        loss.backward()

    # The leaves are exact, hooks included (they are linear in the gradient).
    n_actor = len(list(actor.parameters()))
    want = [g * fa for g in plain[:n_actor]] + [g * fc for g in plain[n_actor:]]
    assert max_rel_err([p.grad for p in params], want) < 1e-6
    # Each hook fired once, and saw one factor times its plain gradient.
    assert {k: len(v) for k, v in rec.seen.items()} == {k: 1 for k in named}
    ratio = {k: _ratio(rec.seen[k][0], plain_rec.seen[k][0]) for k in named}
    # retain_grad sees what the last hook returned: the same factor, times the hook's own scaling.
    for k, t in named.items():
        assert t.grad is not None
        assert torch.allclose(t.grad, ratio[k] * times * plain_rec.seen[k][0], rtol=1e-5, atol=1e-7)
    in_play = {1.0, fa, fc}
    if fa == fc:  # one factor in play: every intermediate sees exactly it (fast path or not)
        assert ratio == pytest.approx({k: fa for k in named})
    else:
        # Regions that reach one group's leaves only see that group's factor ...
        assert ratio["a_hidden"] == pytest.approx(fa)
        assert ratio["a_out"] == pytest.approx(fa)
        # ... mixed regions see one of the factors in play, the plan's choice.
        assert any(ratio["c_hidden"] == pytest.approx(c) for c in in_play)
        assert any(ratio["loss"] == pytest.approx(c) for c in in_play)


@pytest.mark.parametrize("gases", [(4, 4), (2, 4)], ids=["fast-path", "walked"])
def test_post_accumulate_grad_hooks_and_leaf_hooks_see_the_scaled_gradient(gases: tuple[int, int]) -> None:
    actor, critic, x = _nets(1)
    params = [*actor.parameters(), *critic.parameters()]
    loss, _ = _forward(actor, critic, x, Recorder(), retain=False)
    plain = torch.autograd.grad(loss, params)
    factor = [1.0 / gases[0]] * len(list(actor.parameters())) + [1.0 / gases[1]] * len(list(critic.parameters()))

    after_acc: dict[int, list[torch.Tensor]] = {}
    leaf_seen: dict[int, list[torch.Tensor]] = {}
    handles = []
    for i, p in enumerate(params):
        handles.append(p.register_post_accumulate_grad_hook(
            lambda q, i=i: after_acc.setdefault(i, []).append(q.grad.detach().clone())))
        handles.append(p.register_hook(lambda g, i=i: leaf_seen.setdefault(i, []).append(g.detach().clone())))
    try:
        with graphscale.install(graphscale.Group(actor, gas=gases[0]), graphscale.Group(critic, gas=gases[1])):
            loss, _ = _forward(actor, critic, x, Recorder(), retain=False)
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    for i in range(len(params)):
        assert len(after_acc[i]) == 1 and len(leaf_seen[i]) == 1, "a hook fired more or less than once"
        want = plain[i] * factor[i]
        assert torch.allclose(after_acc[i][0], want, rtol=1e-5, atol=1e-8), "post-accumulate hook saw another value"
        assert torch.allclose(leaf_seen[i][0], want, rtol=1e-5, atol=1e-8), "leaf tensor hook saw another value"


def test_a_post_accumulate_grad_hook_that_steps_sees_the_gradient_of_this_backward_only() -> None:
    """The optimizer-in-backward pattern: step and clear .grad inside the hook."""
    actor, critic, x = _nets(2)
    ref_actor, ref_critic, _ = _nets(2)
    lr = 0.1
    hooked = []
    for p in [*actor.parameters(), *critic.parameters()]:
        def step(q: torch.Tensor) -> None:
            with torch.no_grad():
                q -= lr * q.grad
            q.grad = None
        hooked.append(p.register_post_accumulate_grad_hook(step))
    try:
        with graphscale.install(graphscale.Group(actor, gas=2), graphscale.Group(critic, gas=4)):
            for _ in range(3):
                loss, _ = _forward(actor, critic, x, Recorder(), retain=False)
                loss.backward()
    finally:
        for h in hooked:
            h.remove()
    for _ in range(3):  # the oracle: plain gradients, scaled by hand, plain SGD
        loss, _ = _forward(ref_actor, ref_critic, x, Recorder(), retain=False)
        ps = [*ref_actor.parameters(), *ref_critic.parameters()]
        grads = torch.autograd.grad(loss, ps)
        n = len(list(ref_actor.parameters()))
        with torch.no_grad():
            for i, (p, g) in enumerate(zip(ps, grads)):
                p -= lr * g * (0.5 if i < n else 0.25)
    got = [p.detach() for p in [*actor.parameters(), *critic.parameters()]]
    want = [p.detach() for p in [*ref_actor.parameters(), *ref_critic.parameters()]]
    assert max_rel_err(got, want) < 1e-6
    assert all(p.grad is None for p in [*actor.parameters(), *critic.parameters()])


@require_deepspeed
@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [1, 3], ids=["zero1", "zero3"])
@pytest.mark.parametrize("direct", [False, True], ids=["engine.backward", "loss.backward"])
def test_with_deepspeed_user_hooks_see_the_engines_factor_and_zero_reduces_scaled_gradients(
    make_engine: Any, stage: int, direct: bool
) -> None:
    torch.manual_seed(3)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    critic = torch.nn.Linear(3, 1)
    x = torch.randn(5, 3)

    def forward(run: Callable[[torch.Tensor], torch.Tensor], rec: Recorder) -> tuple[torch.Tensor, torch.Tensor]:
        out = run(x)  # the engine's output: DeepSpeed's own output hook sits on it
        out.register_hook(rec.hook("engine_out"))
        loss = critic(out).sum()
        return loss, out

    engine = make_engine(module, gas=4, stage=stage)
    plain_rec = Recorder()
    loss, _ = forward(engine.module, plain_rec)  # plain module forward: no DeepSpeed hooks
    plain = torch.autograd.grad(loss, [*engine.module.parameters(), *critic.parameters()])
    rec = Recorder()
    with graphscale.install(engine, graphscale.Group(critic, gas=2)):
        loss, out = forward(engine, rec)
        out.retain_grad()
        if direct:
            loss.backward()
        else:
            engine.backward(loss)
        got = full_grads(engine)  # reduced and partitioned by ZeRO's own hooks
    n = len(got)
    assert max_rel_err(got, [g / 4 for g in plain[:n]]) < 1e-6, "ZeRO reduced a gradient with the wrong factor"
    assert max_rel_err([p.grad for p in critic.parameters()], [g / 2 for g in plain[n:]]) < 1e-6
    # Below the engine's output only the engine's leaves: its factor, applied once
    # (DeepSpeed's output hook passes the gradient through while governed).
    assert _ratio(rec.seen["engine_out"][0], plain_rec.seen["engine_out"][0]) == pytest.approx(0.25)
    assert torch.allclose(out.grad, 0.25 * plain_rec.seen["engine_out"][0], rtol=1e-5, atol=1e-8)
    engine.zero_grad()
