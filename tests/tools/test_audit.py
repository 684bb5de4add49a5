"""graphscale.audit over plain groups: every governed backward inside it is
checked against a plain reference; a right scaling passes, a wrong one is
named.  Over DeepSpeed engines: test_audit_engines.py."""
from __future__ import annotations

import logging

import pytest
import torch

import graphscale
from graphscale._core import observation as _observe

from helpers.audit import double_every_edge_multiplier, nested


def test_a_right_scaling_passes_and_is_reported_per_group() -> None:
    groups, loss = nested()
    with graphscale.install(*groups), graphscale.audit() as check:
        loss().backward()
        loss().backward()  # accumulates into .grad: the audit compares the change
    assert check.ok and check.backwards == 2 and check.mismatches == []
    report = str(check)
    assert "2 backward(s), 0 mismatch(es)" in report
    assert [line.split()[:3] for line in report.splitlines()[2:]] == [["outer", "0.5", "2"], ["inner", "0.25", "2"]]


def test_a_wrong_edge_multiplier_is_caught_naming_group_and_parameter(monkeypatch: pytest.MonkeyPatch,
                                                                      request: pytest.FixtureRequest) -> None:
    groups, loss = nested()
    with graphscale.install(*groups), graphscale.audit() as check:
        loss().backward()  # right
        double_every_edge_multiplier(monkeypatch, request)
        with pytest.raises(graphscale.AuditError) as err:
            loss().backward()
    text = str(err.value)
    assert text.startswith("graphscale: audit found 2 gradient(s)")
    # The edge where inner's output enters outer's region carries inner's factor: inner is wrong, outer is not.
    assert "group 'inner' parameter 'weight' (3, 3): got 0.5 x its plain gradient, expected 0.25" in text
    assert "group 'inner' parameter 'bias'" in text and "'outer'" not in text
    assert {m.group for m in check.mismatches} == {"inner"} and check.backwards == 2


def test_a_wrong_group_factor_on_the_fast_path_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    group = graphscale.Group(model, gas=4, name="model")
    x = torch.randn(3, 2)
    with graphscale.install(group), graphscale.audit() as check:
        model(x).sum().backward()
        monkeypatch.setattr(graphscale.Group, "factor", lambda self: 0.5)  # 1/2 instead of 1/4
        with pytest.raises(graphscale.AuditError, match=r"group 'model' parameter 'weight'.*got 0.5 .*expected 0.25"):
            model(x).sum().backward()
    assert check.backwards == 2


def test_without_raising_every_mismatch_is_kept_logged_and_reported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, request: pytest.FixtureRequest
) -> None:
    groups, loss = nested()
    double_every_edge_multiplier(monkeypatch, request)
    with graphscale.install(*groups), graphscale.audit(raise_on_error=False) as check:
        with caplog.at_level(logging.WARNING, logger="graphscale"):
            loss().backward()
    assert not check.ok and len(check.mismatches) == 2
    assert any("audit found 2 mismatching" in r.getMessage() for r in caplog.records)
    assert "inner" in str(check) and "1 mismatch" not in str(check) and "2 mismatch(es)" in str(check)
    # The gradients are still there (the audit observes, it does not undo).
    assert groups[1].parameters[0].grad is not None


def test_unowned_leaves_under_raw_must_get_exactly_the_plain_gradient(monkeypatch: pytest.MonkeyPatch,
                                                                       request: pytest.FixtureRequest) -> None:
    torch.manual_seed(0)
    owned, free = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    x = torch.randn(3, 2)
    with graphscale.install(graphscale.Group(owned, gas=2, name="owned"), unowned="plain"), graphscale.audit() as check:
        (owned(x) + free(x)).sum().backward()
        assert check.ok
        double_every_edge_multiplier(monkeypatch, request)
        with pytest.raises(graphscale.AuditError, match=r"group '\(unowned\)' parameter 'leaf \(1, 2\)'"):
            (owned(x) + free(x)).sum().backward()


def test_the_audit_does_not_change_any_gradient() -> None:
    groups, loss = nested()
    params = [p for g in groups for p in g.parameters]
    with graphscale.install(*groups):
        loss().backward()
        plain = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        with graphscale.audit():
            loss().backward()
    for p, want in zip(params, plain):
        torch.testing.assert_close(p.grad, want, rtol=0, atol=0)


def test_audits_nest_and_restore_the_previous_one() -> None:
    groups, loss = nested()
    with graphscale.install(*groups):
        with graphscale.audit() as outer:
            with graphscale.audit() as inner:
                loss().backward()
            loss().backward()
        loss().backward()  # no audit any more
    assert (outer.backwards, inner.backwards) == (1, 1)
    assert _observe.observer() is None


def test_an_audit_outside_any_installation_observes_nothing() -> None:
    groups, loss = nested()
    with graphscale.audit() as check:
        loss().backward()
    assert check.backwards == 0


def test_where_the_graph_can_be_backpropagated_twice_the_replayable_wrapper_only_calls_the_function() -> None:
    groups, loss = nested()

    def step_loss() -> torch.Tensor:
        """The micro-step's loss."""
        return loss()

    with graphscale.install(*groups), graphscale.audit() as check:
        wrapped = check.replayable(step_loss)
        wrapped().backward()  # referenced over its own graph: no replay recorded, none called
    assert check.ok and check.backwards == 1 and check._replays.calls == []
    assert wrapped.__name__ == "step_loss" and wrapped.__doc__ == "The micro-step's loss."
    with pytest.raises(TypeError, match="graphscale.audit: replayable\\(\\) takes the function"):
        check.replayable(loss())  # type: ignore[arg-type]


def test_bad_tolerances_are_rejected() -> None:
    with pytest.raises(ValueError, match="graphscale.audit: rtol and atol must be >= 0"):
        graphscale.audit(rtol=-1)


def test_a_graph_autograd_grad_cannot_take_is_refused_clearly() -> None:
    from torch.utils.checkpoint import checkpoint

    groups, _ = nested()
    outer, inner = (g.parameters for g in groups)
    x = torch.randn(4, 3, requires_grad=True)
    with graphscale.install(*groups), graphscale.audit():
        loss = checkpoint(lambda t: torch.nn.functional.linear(torch.tanh(t), *outer), x @ inner[0].T + inner[1],
                          use_reentrant=True).sum()
        refused = r"^graphscale.audit: could not compute .*use_reentrant=False"
        with pytest.raises(graphscale.GraphscaleError, match=refused):
            loss.backward()


def test_a_non_scalar_root_without_seed_gets_torchs_own_error() -> None:
    groups, _ = nested()
    out = torch.nn.functional.linear(torch.randn(4, 3), *groups[1].parameters)
    with graphscale.install(*groups), graphscale.audit() as check:
        with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs") as err:
            out.backward()
    assert not isinstance(err.value, graphscale.GraphscaleError) and check.backwards == 0
