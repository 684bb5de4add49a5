"""Training as users run it: micro-steps with ``engine.step()`` after each, on
one and two gloo ranks, weights against a plain-PyTorch reference.

Engines A (GAS 2), B (GAS 4) and C (GAS 8), SGD, train on one loss per
micro-step for 8 micro-steps (four windows of A, two of B, one of C).  The
reference is plain PyTorch in the same process: each rank's plain gradient of
the same loss (every rank's data is made from its rank number), averaged over
the ranks, times 1/GAS of the owner, accumulated and stepped at the owner's
window end.  After the last micro-step each engine's weights must have moved
as the reference's did: ``max|dw - dw_ref| / max|dw_ref|`` (dw: the change
from the initial weights) within 1e-5 in fp32, 0.1 in bf16 (bf16 forwards
against a float32 reference; a wrong factor or a missing reduction is an
error of order 1).  Then, on the same engines, one more backward at a forced
accumulation boundary must leave each engine's *reduced* gradient
(``safe_get_full_grad``) equal to the rank-averaged plain gradient times
1/GAS: on one rank ``.grad`` can look right while a reduction is missing,
which only the second rank or the step shows.

Why this file exists: on DeepSpeed 0.19.8 a direct ``loss.backward()`` over a
loss that forwards one engine twice ran that engine's backward prologue twice
and its epilogue never (NOTE [ One lifecycle per backward ] in
graphscale/_adapters/deepspeed/__init__.py): nothing was reduced and ``step()`` raised.  Every
shape runs under both DeepSpeed generations (CI reruns this file on 0.19.5),
with graphscale and, pinned so that an upstream change is noticed, with
DeepSpeed alone.

This file: one rank.  Two ranks: test_training_parity_two_ranks.py.  The
engines, shapes, cases and the reference they train against:
tests/helpers/training.py.
"""
from __future__ import annotations

import pytest

from helpers.engines import require_deepspeed
from helpers.training import (
    CASES,
    CHECKPOINTED_TWICE,
    FP16_CASES,
    Case,
    explain,
    run_case,
    training_cases,
)
from helpers.training_alone import deepspeed_alone, generation

pytestmark = [pytest.mark.deepspeed, require_deepspeed]


# ------------------------------------------------------------------ one rank
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_one_rank_training_under_graphscale_matches_the_per_engine_gas_reference(ds_dist: None, case: Case) -> None:
    result = run_case(case, rank=0, world=1, govern=True)
    assert result["status"] == "exact", explain(case, result)


@pytest.fixture
def cpu_fp16(ds_dist: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 engines on DeepSpeed's CPU accelerator: its capability flag forced
    (tests/deepspeed_engines/test_fp16.py explains why that is a real fp16 engine)."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        pytest.skip("the forced flag is for DeepSpeed's CPU accelerator (test_fp16.py has the cuda variants)")
    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)


@pytest.mark.parametrize("case", FP16_CASES, ids=lambda c: c.id)
def test_one_rank_fp16_training_under_graphscale_matches_the_reference(cpu_fp16: None, case: Case) -> None:
    result = run_case(case, rank=0, world=1, govern=True)
    assert result["status"] == "exact", explain(case, result)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_one_rank_training_with_deepspeed_alone_is_as_documented(ds_dist: None, case: Case) -> None:
    result = run_case(case, rank=0, world=1, govern=False)
    want = deepspeed_alone(case, generation(), world=1)
    assert result["status"] == want, f"want {want}; " + explain(case, result)


@pytest.mark.parametrize("case", training_cases(["engine_twice"]), ids=lambda c: c.id)
def test_training_after_a_backward_aborted_past_the_prologue_matches_the_reference(ds_dist: None,
                                                                                  case: Case) -> None:
    """An aborted backward that ran the engines' prologues left ZeRO's backward
    depth behind (DeepSpeed alone: the next direct backward never reduces);
    under graphscale the next backward starts clean (NOTE [ One lifecycle per
    backward ])."""
    result = run_case(case, rank=0, world=1, govern=True, abort_first=True)
    assert result["status"] == "exact", explain(case, result)


@pytest.mark.parametrize("case", training_cases(["engine_twice", "sum"], ("loss",)), ids=lambda c: c.id)
def test_deepspeed_alone_after_an_aborted_backward_is_as_documented(ds_dist: None, case: Case) -> None:
    """Tracker generation: the aborted backward's prologue leaves depth 1, the
    next direct backward's epilogue is skipped (depth 2), step() raises; the
    hooks generation has no such check."""
    result = run_case(case, rank=0, world=1, govern=False, abort_first=True)
    want = "raises" if generation() == "tracker" else deepspeed_alone(case, generation(), world=1)
    assert result["status"] == want, f"want {want}; " + explain(case, result)


@pytest.mark.parametrize("case", training_cases(CHECKPOINTED_TWICE, stages=(2, 3)), ids=lambda c: c.id)
@pytest.mark.parametrize("govern", [True, False], ids=["graphscale", "deepspeed_alone"])
def test_zero_2_and_3_refuse_a_parameter_checkpointed_twice_in_one_backward(ds_dist: None, case: Case,
                                                                           govern: bool) -> None:
    """DeepSpeed's own limit (see CHECKPOINTED_TWICE), pinned so that an upstream fix is noticed."""
    result = run_case(case, rank=0, world=1, govern=govern)
    assert result["status"] == "raises", explain(case, result)
