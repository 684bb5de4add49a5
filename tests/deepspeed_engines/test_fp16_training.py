"""fp16 DeepSpeed engines over many micro-steps and under the tools: training
through an overflow (each engine skips its own step, then trains on) matches
a per-engine reference; explain shows each engine's loss scale over its GAS
and touches no engine; audit passes fp16 engines with their loss scales and
catches a missing one (one backward: tests/deepspeed_engines/test_fp16.py; NOTE [ fp16 engines ] in
graphscale/_adapters/deepspeed/__init__.py).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

import graphscale

from helpers.engines import require_deepspeed
from helpers.fp16 import CALLS, FP16_TOL, GAS, LR, SCALE_POWER, STAGES, STEP_TOL, Rig, as_float, fit_ratio
from helpers.grads import max_rel_err

pytestmark = [pytest.mark.deepspeed, require_deepspeed]


# ------------------------------------------------------------------ training through an overflow
MICRO_STEPS = 8  # A steps after micro-steps 1, 3, 5, 7; B after 3 and 7
OVERFLOW_AT = 1  # B's gradient is inf in micro-step 1: B skips its first step and halves its scale


def _poisoned(roots: list[torch.Tensor], b_out: torch.Tensor, poison: float) -> torch.Tensor:
    """The loss plus ``poison`` x sum(B's output): inf reaches B's parameters only."""
    return sum(roots[1:], roots[0]) + poison * as_float(b_out).sum()


def _step_graph(A: Any, B: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    a, b = A(x), B(y)
    return [as_float(a * b).sum(), as_float(b).square().sum()], b


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("call", ["engine:A", "loss", "scale:B"], ids=lambda c: c.replace(":", "_"))
def test_fp16_training_through_an_overflow_matches_a_per_engine_reference(fp16_here: None, call: str,
                                                                         stage: int) -> None:
    """Eight micro-steps of one loss over A and B, ``step()`` on both after
    each (DeepSpeed steps each at its own boundary).  B's gradient overflows
    in its first window: B must skip that step and halve its scale while A
    steps normally, and graphscale must apply B's new scale from then on.
    The float32 reference steps each model with SGD at its own GAS and skips
    B's first window.  Compared: the change of every full float32 (master)
    weight."""
    from deepspeed.utils import safe_get_full_fp32_param

    rig = Rig(stage, boundary=None)  # DeepSpeed's own accumulation boundaries
    start = {n: [safe_get_full_fp32_param(p).detach().float().cpu().clone() for p in e.module.parameters()]
             for n, e in rig.engines.items()}
    refs = rig.refs
    ref_start = {n: [p.detach().clone() for p in m.parameters()] for n, m in refs.items()}
    opts = {n: torch.optim.SGD(m.parameters(), lr=LR) for n, m in refs.items()}
    skipped_window: set[int] = set()
    with graphscale.install(*rig.engines.values()):
        for k in range(MICRO_STEPS):
            poison = float("inf") if k == OVERFLOW_AT else 0.0
            x, y = (t.to(rig.device, torch.half) for t in rig.inputs(k))
            roots, b_out = _step_graph(rig.engines["A"], rig.engines["B"], x, y)
            loss = _poisoned(roots, b_out, poison)
            rig.backward(call, [loss])
            for e in rig.engines.values():
                e.step()
            # the reference: the same micro-batch, plain float32, each model at its own GAS
            ref_roots, _ = _step_graph(refs["A"], refs["B"], *rig.inputs(k))
            torch.autograd.backward(ref_roots)
            if k == OVERFLOW_AT:
                skipped_window.add(k // GAS["B"])
            for n, m in refs.items():
                if (k + 1) % GAS[n]:
                    continue
                if n == "B" and k // GAS["B"] in skipped_window:
                    m.zero_grad(set_to_none=True)  # overflow: no step, gradients dropped
                    continue
                for p in m.parameters():
                    p.grad /= GAS[n]
                opts[n].step()
                m.zero_grad(set_to_none=True)
    scales = rig.scales()
    assert scales == {"A": 2.0 ** SCALE_POWER["A"], "B": 2.0 ** (SCALE_POWER["B"] - 1)}, (
        f"loss scales after the run {scales}: B must have halved once (its overflow), A not at all")
    for n, e in rig.engines.items():
        got = [safe_get_full_fp32_param(p).detach().float().cpu() - s for p, s in zip(e.module.parameters(), start[n])]
        want = [p.detach() - s for p, s in zip(refs[n].parameters(), ref_start[n])]
        err = max_rel_err(got, want)
        assert err <= STEP_TOL, f"engine {n}: weight change differs from the reference by {err:.3g} (relative)"


# ------------------------------------------------------------------ explain shows what the backward applies
@pytest.mark.parametrize("stage", STAGES[1:2])
def test_explain_shows_each_fp16_engines_loss_scale_over_its_gas_and_touches_no_engine(fp16_here: None,
                                                                                     stage: int) -> None:
    rig = Rig(stage)
    scales = rig.scales()
    roots = rig.roots("two_engines")
    flags = {n: e._manual_backward_expected for n, e in rig.engines.items()}
    with graphscale.install(*rig.engines.values()):
        plan = graphscale.explain(roots)
        factors = {g.name: g.factor for g in plan.groups}
        want = sorted(scales[n] / GAS[n] for n in GAS)
        assert sorted(factors.values()) == want, (factors, scales)
        # every owned leaf is planned to carry exactly its engine's pin
        leaf_potentials = {(plan.node_groups[i], plan.potentials[i]) for i in range(plan.nodes) if plan.node_groups[i]}
        assert leaf_potentials == set(factors.items()), (leaf_potentials, factors)
        assert {n: e._manual_backward_expected for n, e in rig.engines.items()} == flags  # explain changed nothing
        rig.backward("loss", roots)
    plain = rig.plain_grads("two_engines")
    got = rig.grads()
    for n in GAS:
        assert fit_ratio(got[n], plain[n]) == pytest.approx(scales[n] / GAS[n], rel=FP16_TOL)


@pytest.mark.parametrize("stage", STAGES[1:3])
@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.replace(":", "_"))
def test_audit_passes_fp16_engines_with_their_loss_scales_and_catches_a_missing_one(
        fp16_here: None, call: str, stage: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(stage, boundary=None)
    with graphscale.install(*rig.engines.values()), graphscale.audit() as check:
        for k in range(4):  # A's boundaries at 2 and 4, B's at 4
            rig.backward(call, rig.roots("two_engines", k))
            for e in rig.engines.values():
                e.step()
    assert check.ok and check.backwards == 4, str(check)
    assert sorted(check._windows.checked.values()) == [1, 2], str(check)
    assert "float16 leaves rtol=0.00390625" in str(check)
    from graphscale._adapters.deepspeed import EngineGroup

    rig = Rig(stage, boundary=None)
    monkeypatch.setattr(EngineGroup, "pin", lambda self, scaling=True: self.factor() if scaling else 1.0)
    with graphscale.install(*rig.engines.values()), graphscale.audit() as check:
        with pytest.raises(graphscale.AuditError, match=r"group 'engine:\w+#[0-9]+' parameter"):
            rig.backward(call, rig.roots("two_engines"))
