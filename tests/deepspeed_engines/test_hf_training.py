"""Hugging Face models under real DeepSpeed engines, trained as users train
them: eight micro-steps with ``step()``, weights against a per-engine-GAS
plain-PyTorch reference after every micro-step under graphscale, and the
drift DeepSpeed alone shows (one backward per case: test_hf.py; the harness:
tests/helpers/hf_engines.py).
"""
from __future__ import annotations

import pytest
import torch

import graphscale

from helpers.engines import require_deepspeed
from helpers.hf_engines import (
    AC24,
    AC42,
    BOTH,
    FP32_TOL,
    SHAPES,
    TS24,
    Case,
    build,
    case_params,
    make_engines,
    trainable,
)

pytestmark = [pytest.mark.deepspeed, require_deepspeed]


pytest.importorskip("transformers", reason="the Hugging Face tests need transformers")


from helpers import hf  # noqa: E402  (after the skip: its builders import transformers)

# ------------------------------------------------------------------ multi-step parity
MICRO_STEPS = 8  # two accumulation windows of the GAS-4 engine, four of the GAS-2 one
LR = 0.1
PARITY = [
    Case("ppo_nested", AC24, "loss", 3, BOTH),
    Case("distill", TS24, "engine:student", 2, BOTH),
    Case("ppo_nested", AC42, "engine:actor", 1, BOTH, lora=True, ckpt="reentrant"),
]


def _rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want, strict=True))


def train_and_compare(case: Case, with_graphscale: bool) -> list[float]:
    """Train the engines of ``case`` for MICRO_STEPS micro-steps (SGD,
    ``engine.step()`` after every one) beside plain float32 copies that
    accumulate each model's gradient times 1/GAS of its engine and step every
    GAS micro-steps; the worst relative weight error over all engines after
    each micro-step."""
    from deepspeed.utils import safe_get_full_fp32_param

    engines = make_engines(case, boundary=False, gradient_clipping=0.0)  # the reference does not clip
    refs = {n: build(case, n) for n in engines}
    opts = {n: torch.optim.SGD([p for _, p in trainable(r)], lr=LR) for n, r in refs.items()}
    acc = {n: [torch.zeros_like(p) for _, p in trainable(r)] for n, r in refs.items()}
    shape = SHAPES[case.shape]
    worst = []
    inst = graphscale.install(*engines.values()) if with_graphscale else None
    try:
        for step in range(MICRO_STEPS):
            batch = hf.make_batch(100 + step)
            loss = shape.graph(engines, {n: e.module for n, e in engines.items()}, batch)
            if case.call == "loss":
                loss.backward()
            else:
                engines[case.call.split(":")[1]].backward(loss)
            for e in engines.values():
                e.step()
            shape.graph(refs, refs, batch).backward()
            for n, ref in refs.items():
                for (_, p), a in zip(trainable(ref), acc[n], strict=True):
                    if p.grad is not None:
                        a += p.grad / case.gas[n]
                    p.grad = None
                if (step + 1) % case.gas[n] == 0:
                    for (_, p), a in zip(trainable(ref), acc[n], strict=True):
                        p.grad = a.clone()
                        a.zero_()
                    opts[n].step()
                    ref.zero_grad(set_to_none=True)
            worst.append(max(_rel([safe_get_full_fp32_param(p).detach() for _, p in trainable(engines[n].module)],
                                  [p.detach() for _, p in trainable(refs[n])]) for n in refs))
    finally:
        if inst is not None:
            inst.remove()
    return worst


@pytest.mark.parametrize("case", case_params(PARITY))
def test_training_matches_a_per_engine_gas_reference_after_every_micro_step(ds_dist: None, case: Case) -> None:
    worst = train_and_compare(case, with_graphscale=True)
    assert max(worst) <= FP32_TOL, f"relative weight error after each micro-step: {worst}"


@pytest.mark.parametrize("case", case_params(PARITY))
def test_training_under_deepspeed_alone_drifts_from_the_reference(ds_dist: None, case: Case) -> None:
    """So the parity test above can fail."""
    worst = train_and_compare(case, with_graphscale=False)
    assert max(worst) > 1e-3, f"DeepSpeed alone matched the reference: {worst}"
