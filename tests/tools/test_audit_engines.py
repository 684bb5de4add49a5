"""graphscale.audit over real DeepSpeed engines (one rank): ZeRO 0 and 1
engines pass and a wrong factor or plan is caught; ZeRO 3 without a replay
is refused before anything is touched, and a replay serves each root;
audited steps update the weights as unaudited ones; a window entered midway
is reported, not checked; a direct ``loss.backward()`` lets DeepSpeed run its
backward once.  Over plain groups: tests/tools/test_audit.py."""
from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch

import graphscale

from helpers.audit import double_every_edge_multiplier
from helpers.engines import require_deepspeed


# ---------------------------------------------------------------- DeepSpeed
class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(3, 3)
        self.head = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


@pytest.mark.deepspeed
@require_deepspeed
def test_audit_passes_a_zero_0_engine_plus_its_module_and_catches_a_wrong_factor(
    make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    net = Net()
    plain = copy.deepcopy(net)
    engine = make_engine(net, gas=2, stage=0)  # stage 0 allows engine.backward only
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    with graphscale.install(engine), graphscale.audit() as check:
        engine.backward(engine(x).sum() + engine.module.body(y).pow(2).sum())
        assert check.ok and check.backwards == 1
        want = torch.autograd.grad(plain(x).sum() + plain.body(y).pow(2).sum(), list(plain.parameters()))
        for p, w in zip(net.parameters(), want):
            torch.testing.assert_close(p.grad, w / 2)
        monkeypatch.setattr(graphscale.Group, "factor", lambda self: 1.0)
        with pytest.raises(graphscale.AuditError, match=r"parameter 'body.weight' .*got 1 x .*expected 0.5"):
            engine.backward(engine(x).sum() + engine.module.body(y).pow(2).sum())


@pytest.mark.deepspeed
@require_deepspeed
def test_audit_passes_two_zero_1_engines_and_catches_a_wrong_plan(
    make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    torch.manual_seed(0)
    a_net, b_net = Net(), Net()
    a_plain, b_plain = copy.deepcopy(a_net), copy.deepcopy(b_net)
    a, b = make_engine(a_net, gas=2, stage=1), make_engine(b_net, gas=4, stage=1)
    x = torch.randn(2, 3)
    with graphscale.install(a, b), graphscale.audit() as check:
        a.backward(a(x).sum() + b(x).sum())
        assert check.ok and check.backwards == 1
        # The reference ran on the engines' graph without disturbing them: the oracle's gradients.
        want_a = torch.autograd.grad(a_plain(x).sum(), list(a_plain.parameters()))
        want_b = torch.autograd.grad(b_plain(x).sum(), list(b_plain.parameters()))
        wants = [*(w / 2 for w in want_a), *(w / 4 for w in want_b)]
        for p, w in zip([*a_net.parameters(), *b_net.parameters()], wants):
            torch.testing.assert_close(p.grad, w)
        double_every_edge_multiplier(monkeypatch, request)
        named = r"group 'engine:Net#[0-9]+' parameter '(body|head)\.(weight|bias)'"
        with pytest.raises(graphscale.AuditError, match=named):
            a.backward(a(x).sum() + b(x).sum())
    assert check.mismatches and all(m.backward == 2 for m in check.mismatches)
    a.step()  # DeepSpeed's prologue was held back only for the reference: the engine still steps


@pytest.mark.deepspeed
@require_deepspeed
def test_audit_without_a_replay_refuses_zero_stage_3_before_touching_anything_saying_how_to_pass_one(
        make_engine: Callable[..., Any]) -> None:
    from deepspeed.utils import safe_get_full_grad

    net = Net()
    engine = make_engine(net, gas=2, stage=3)
    engine.set_gradient_accumulation_boundary(True)
    with graphscale.install(engine), graphscale.audit() as check:
        refused = (r"^graphscale.audit: group .* ZeRO stage 3, where a graph can be backpropagated only once.*"
                   r"stage 2.* Give it the micro-step's forward to call once more instead: in `with graphscale.audit"
                   r"\(...\) as handle:` wrap the function that computes the loss, `loss_of = handle.replayable"
                   r"\(loss_of\)`, on every rank.*No gradient was touched\.$")
        with pytest.raises(graphscale.GraphscaleError, match=refused):
            engine.backward(engine(torch.randn(2, 3)).sum())
        replayed = check.replayable(lambda t: engine(t).sum())
        with pytest.raises(graphscale.GraphscaleError, match=refused):  # a loss the replay did not return
            engine.backward(replayed(torch.randn(2, 3)) * 2)
    grads = [safe_get_full_grad(p) for p in engine.module.parameters()]
    assert all(g is None or not bool(g.any()) for g in grads)


@pytest.mark.deepspeed
@require_deepspeed
def test_a_zero_3_replay_serves_each_root_of_a_backward_and_leaves_out_inputs_made_inside_it(
        make_engine: Callable[..., Any]) -> None:
    from deepspeed.utils import safe_get_full_grad

    torch.manual_seed(0)
    net = Net()
    plain = copy.deepcopy(net)
    engine = make_engine(net, gas=2, stage=3)
    engine.set_gradient_accumulation_boundary(True)
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    calls = []
    with graphscale.install(graphscale.Group(engine, name="net")), graphscale.audit() as check:
        @check.replayable
        def losses(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:  # a ModelOutput-like dict, a tuple inside
            calls.append(x)
            h = x.clone().requires_grad_()  # an input made inside: its replay makes another
            return {"first": engine(h).sum(), "second": (engine(y).pow(2).sum(),)}

        out = losses(x, y)
        torch.autograd.backward([out["second"][0], out["first"]])  # two roots of one call, in another order
    assert check.ok and check.backwards == 1 and len(calls) == 2, str(check)
    assert list(check._stats) == ["net"]  # the input made inside is left out, not compared as unowned
    want = torch.autograd.grad(plain(x).sum() + plain(y).pow(2).sum(), list(plain.parameters()))
    for p, w in zip(engine.module.parameters(), want):
        torch.testing.assert_close(safe_get_full_grad(p), w / 2)


@pytest.mark.deepspeed
@require_deepspeed
def test_audited_steps_of_a_zero_1_engine_update_the_weights_as_unaudited_ones(
    make_engine: Callable[..., Any],
) -> None:
    # At an accumulation boundary ZeRO reduces gradients in the epilogue that its
    # once-per-backward prologue queues; the reference must not trigger it early.
    torch.manual_seed(0)
    nets = [Net(), Net()]
    nets[1].load_state_dict(nets[0].state_dict())
    start = [p.detach().clone() for p in nets[0].parameters()]
    engines = [make_engine(n, gas=2, stage=1, lr=1.0) for n in nets]
    x = [torch.randn(2, 3) for _ in range(2)]
    for i, engine in enumerate(engines):
        with graphscale.install(engine), (graphscale.audit() if i == 1 else _nothing()) as check:
            for xb in x:
                engine.backward(engine(xb).sum())
                engine.step()
        if i == 1:
            assert check.ok and check.backwards == 2
    for p, q, p0 in zip(*(n.parameters() for n in nets), start):
        torch.testing.assert_close(q, p)
        assert not torch.equal(p, p0), "the boundary step did not update the weights"


@pytest.mark.deepspeed
@require_deepspeed
def test_a_window_the_audit_entered_midway_is_reported_not_checked_and_the_next_one_is(
    make_engine: Callable[..., Any],
) -> None:
    torch.manual_seed(0)
    engine = make_engine(Net(), gas=2, stage=1)
    x = [torch.randn(2, 3) for _ in range(5)]
    with graphscale.install(engine):
        engine.backward(engine(x[0]).sum())  # micro-step 1 of the first window, not audited
        engine.step()
        with graphscale.audit() as check:
            engine.backward(engine(x[1]).sum())  # its boundary: the window began before the audit
            engine.step()
            assert "not checked: the audit did not see its window from the start" in str(check)
            for xb in x[2:4]:  # a whole window
                engine.backward(engine(xb).sum())
                engine.step()
    assert check.ok and list(check._windows.checked.values()) == [1]  # the whole window: checked
    assert "not checked" not in str(check), str(check)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.deepspeed
@require_deepspeed
def test_audit_of_a_direct_loss_backward_on_a_zero_1_engine_lets_deepspeed_run_its_backward_once(
    make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # loss.backward() on engine outputs: DeepSpeed's prologue runs from the output hook, once per
    # forward's outputs; the reference pass must leave it to the real backward.
    torch.manual_seed(0)
    net = Net()
    plain = copy.deepcopy(net)
    engine = make_engine(net, gas=4, stage=1)
    calls: list[str] = []

    def spy(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(type(engine), "_backward_prologue", spy("prologue", type(engine)._backward_prologue))
    monkeypatch.setattr(torch.autograd, "grad", spy("reference", torch.autograd.grad))
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    with graphscale.install(engine):
        with monkeypatch.context() as m, graphscale.audit() as check:  # undone before remove() restores torch
            run_backward = torch.autograd._engine_run_backward  # torch's backward and grad both call it

            def engine_run(*args: Any, **kwargs: Any) -> Any:
                if kwargs.get("accumulate_grad"):  # torch.autograd.backward's (grad's is False)
                    calls.append("backward")
                return run_backward(*args, **kwargs)

            m.setattr(torch.autograd, "_engine_run_backward", engine_run)
            (engine(x).sum() + engine.module(y).sum()).backward()
    assert check.ok and check.backwards == 1
    assert calls == ["reference", "backward", "prologue"]  # the prologue runs inside the real backward
    want = torch.autograd.grad(plain(x).sum() + plain(y).sum(), list(plain.parameters()))
    for p, w in zip(net.parameters(), want):
        torch.testing.assert_close(p.grad, w / 4)
