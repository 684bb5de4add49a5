"""Hugging Face models under real DeepSpeed engines (CPU accelerator, gloo,
one rank), as users train them: RLHF actor and critic, the DeepSpeed
issue-8224 shape, distillation, HF activation checkpointing, a PEFT LoRA
adapter, and the plainest HF client ``engine(input_ids=x, labels=x).loss``.

Every case is checked against a plain-PyTorch oracle computed in the same
test: the same models built again from the same seed (float32, before
``deepspeed.initialize`` casts or partitions the engine's), the same graph run
plainly, each model's gradient times 1/GAS of its engine.  Every case also
runs DeepSpeed alone (graphscale not installed) and asserts that it is wrong
exactly in the generations ``Case.ds_wrong`` lists (NOTE [ DeepSpeed's two
generations ] in graphscale/_adapters/deepspeed/__init__.py), so a graphscale that did nothing
would fail every case listed there.  ``GRAPHSCALE_DS_REPORT=path`` appends the
measured errors as JSON lines.

The cases are a covering set, not the cross product (the file must run in
under 90 s on two CPU cores, imports included): every shape, model variant, ZeRO stage,
dtype and backward style appears, and the pairs that interact are combined
(LoRA with reentrant checkpointing, where HF makes the embedding output a
leaf; checkpointing at ZeRO-3, which gathers parameters again in the
recomputation; bf16 with nesting).

This file: one backward per case.  Eight micro-steps with ``step()``:
test_hf_training.py.  The shapes, cases, engines and oracle:
tests/helpers/hf_engines.py (the models: tests/helpers/hf.py).
"""
from __future__ import annotations

import pytest
import torch

from helpers.engines import require_deepspeed
from helpers.grads import max_rel_err
from helpers.hf_engines import (
    CASES,
    HF_LABELS,
    Case,
    case_params,
    effective_factor,
    errors,
    generation,
    oracle,
    report,
    run_engines,
)

pytestmark = [pytest.mark.deepspeed, require_deepspeed]


pytest.importorskip("transformers", reason="the Hugging Face tests need transformers")


# ------------------------------------------------------------------ the tests
@pytest.mark.parametrize("case", case_params(CASES))
def test_hf_engines_get_their_own_factor_under_graphscale(ds_dist: None, case: Case) -> None:
    want = oracle(case)
    got = run_engines(case, with_graphscale=True)
    report(case, "graphscale", got, want)
    errs = errors(got, want)
    assert max(errs.values()) <= case.tol, f"per-engine max relative error {errs}"
    assert torch.allclose(got.loss, want.loss, rtol=case.tol, atol=0), "graph differs from the oracle's"
    if case.call != "loss":
        gas = case.gas[case.call.split(":")[1]]
        assert got.returned is not None and torch.equal(got.returned.detach().float(), (got.loss / gas).float())


@pytest.mark.parametrize("case", case_params([c for c in CASES if c.shape != "hf_labels_loss"]))
def test_deepspeed_alone_is_wrong_exactly_where_measured(ds_dist: None, case: Case) -> None:
    want = oracle(case)
    got = run_engines(case, with_graphscale=False)
    report(case, "deepspeed_alone", got, want)
    errs = errors(got, want)
    gen = generation()
    wrong = max(errs.values()) > case.tol
    assert wrong == (gen in case.ds_wrong), (
        f"DeepSpeed alone ({gen} generation) {'is' if wrong else 'is not'} wrong here, "
        f"per-engine max relative error {errs}")


@pytest.mark.parametrize("case, factors", [pytest.param(c, f, id=c.id) for c, f in HF_LABELS])
def test_deepspeed_alone_divides_hf_labels_loss_once_per_hooked_output(ds_dist: None, case: Case,
                                                                       factors: dict[str, float]) -> None:
    """``engine(input_ids=x, labels=x).loss``: DeepSpeed alone divides at the
    ``loss`` and again at the ``logits`` it was made from, 1/GAS^2 instead of
    1/GAS, wherever its output hooks divide (NOTE [ Why DeepSpeed alone
    divides several times on HF outputs ]); graphscale gives 1/GAS (the
    first test)."""
    plain = oracle(case, factors=False)
    got = run_engines(case, with_graphscale=False)
    want = oracle(case)
    report(case, "deepspeed_alone", got, want)
    factor = factors[generation()]
    errs = {n: max_rel_err(got.grads[n], [factor * p for p in plain.grads[n]]) for n in plain.grads}
    assert max(errs.values()) <= case.tol, (
        f"DeepSpeed alone ({generation()} generation) is not plain x {factor:g} here, "
        f"per-engine max relative error {errs}; least-squares factor "
        f"{ {n: effective_factor(got.grads[n], plain.grads[n]) for n in plain.grads} }")
    assert (max(errors(got, want).values()) > case.tol) == (generation() in case.ds_wrong)
