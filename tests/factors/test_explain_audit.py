"""``explain`` shows each group's factor as read now, and ``audit`` checks
custom factors (factors beyond 1/GAS, issue 10 item 4; tests/helpers/factors.py):
it passes right ones and reports them, catches a wrong GAS factor beside
factor groups, a planner applying a wrong custom factor and a wrong factor
of a factor group, reads a factor callable once per backward, and checks an
engine with a factor.
"""
from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

import graphscale

from helpers.engines import require_deepspeed
from helpers.factors import Net, Reads, engine_inputs, inputs, make_engines


# ------------------------------------------------------------------ explain and audit
def _three_groups(read: Reads) -> tuple[list[graphscale.Group], Callable[[], torch.Tensor]]:
    lm, value, aux = Net(1), Net(2), Net(3)
    x = inputs()[0]
    groups = [graphscale.Group(lm, factor=read, name="lm"), graphscale.Group(value, gas=4, name="value"),
              graphscale.Group(aux, factor=2.0, name="aux")]
    return groups, lambda: (lm(x) + value(torch.tanh(aux(x)))).square().sum()


def test_explain_lists_each_groups_factor_as_read_now() -> None:
    read = Reads(0.3)
    groups, loss_fn = _three_groups(read)
    loss = loss_fn()
    with graphscale.install(*groups):
        first = str(graphscale.explain(loss))
        read.value = 0.7
        second = graphscale.explain(loss)
    for name, factor in (("lm", r"0\.3"), ("value", r"0\.25"), ("aux", "2")):
        assert re.search(rf"^\s+{name}\s+{factor}\s+4/4\s*$", first, flags=re.M), first
    assert re.search(r"^\s+lm\s+0\.7\s+4/4\s*$", str(second), flags=re.M), str(second)
    assert {g.name: g.factor for g in second.groups} == {"lm": 0.7, "value": 0.25, "aux": 2.0}
    # explain(groups=...) without installing shows them the same way
    alone = graphscale.explain(loss, groups=groups)
    assert {g.name: g.factor for g in alone.groups} == {"lm": 0.7, "value": 0.25, "aux": 2.0}


def test_audit_passes_custom_factors_and_reports_them() -> None:
    groups, loss_fn = _three_groups(Reads(0.3))
    with graphscale.install(*groups), graphscale.audit() as check:
        loss_fn().backward()
        loss_fn().backward()
    assert check.ok and check.backwards == 2, str(check)
    rows = {line.split()[0]: line.split()[1] for line in str(check).splitlines()[2:]}
    assert rows == {"lm": "0.3", "value": "0.25", "aux": "2"}, str(check)


def test_audit_catches_a_wrong_gas_factor_beside_factor_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    groups, loss_fn = _three_groups(Reads(0.3))
    real = graphscale.Group.factor
    with graphscale.install(*groups), graphscale.audit():
        loss_fn().backward()
        monkeypatch.setattr(graphscale.Group, "factor", lambda self: 0.5 if self.name == "value" else real(self))
        with pytest.raises(graphscale.AuditError, match=r"group 'value' parameter .*got 0\.5 .*expected 0\.25") as err:
            loss_fn().backward()
    assert "'lm'" not in str(err.value) and "'aux'" not in str(err.value)


def test_audit_catches_a_planner_that_applies_a_wrong_custom_factor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner reads ``Group.pin``; the audit the group's own factor."""
    groups, loss_fn = _three_groups(Reads(0.3))
    real = graphscale.Group.pin
    with graphscale.install(*groups), graphscale.audit():
        loss_fn().backward()
        monkeypatch.setattr(graphscale.Group, "pin",
                            lambda self, scaling=True: 0.6 if self.name == "lm" else real(self, scaling))
        with pytest.raises(graphscale.AuditError, match=r"group 'lm' parameter .*got 0\.6 .*expected 0\.3"):
            loss_fn().backward()


def test_audit_catches_a_wrong_factor_of_a_factor_group(monkeypatch: pytest.MonkeyPatch) -> None:
    groups, loss_fn = _three_groups(Reads(0.3))
    real = graphscale.Group.factor
    with graphscale.install(*groups), graphscale.audit():
        loss_fn().backward()
        monkeypatch.setattr(graphscale.Group, "factor", lambda self: 0.6 if self.name == "lm" else real(self))
        with pytest.raises(graphscale.AuditError, match=r"group 'lm' parameter .*got 0\.6 .*expected 0\.3"):
            loss_fn().backward()


def test_audit_reads_a_factor_callable_once_per_backward() -> None:
    read = Reads(0.3)
    groups, loss_fn = _three_groups(read)
    with graphscale.install(*groups), graphscale.audit():
        loss_fn().backward()
    assert read.calls == 1


@pytest.mark.deepspeed
@require_deepspeed
@pytest.mark.parametrize("call", ["engine", "loss"])
def test_audit_checks_an_engine_with_a_factor(ds_dist: None, call: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """ZeRO 1 (what audit supports), micro-steps that are not a boundary
    (at a boundary ZeRO moves gradients out of .grad): right, then a planner
    applying a wrong factor to the engine."""
    from graphscale._adapters.deepspeed import EngineGroup

    engines, _ = make_engines(1, boundary=False)
    A, B = engines["A"], engines["B"]
    x, y = engine_inputs(torch.float32)

    def backward() -> None:
        loss = (A(x) + B(y)).square().sum()
        A.backward(loss) if call == "engine" else loss.backward()

    real = EngineGroup.pin
    with graphscale.install(graphscale.Group(A, factor=1.0, name="A"), B), graphscale.audit() as check:
        backward()
        assert check.ok, str(check)
        rows = {line.split()[0]: line.split()[1] for line in str(check).splitlines()[2:]}
        assert rows["A"] == "1" and sorted(rows.values()) == ["0.25", "1"], str(check)
        monkeypatch.setattr(EngineGroup, "pin",
                            lambda self, scaling=True: 0.5 if self.name == "A" else real(self, scaling))
        with pytest.raises(graphscale.AuditError, match=r"group 'A' parameter .*got 0\.5 .*expected 1"):
            backward()
