"""Each group gets exactly its factor, and each engine too (factors beyond
1/GAS, issue 10 item 4; what the factor tests share: tests/helpers/factors.py):
plain groups in every shape, with at most one multiplication per group; a
parameter in two groups fed by the same factor source; an engine with a
factor beside an engine with its GAS, which DeepSpeed alone cannot give it;
``scale_wrt_gas=False`` switching custom factors off too.  Each against a
plain-PyTorch oracle computed in the same test.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import graphscale

from helpers.engines import require_deepspeed
from helpers.factors import (
    BF16_TOL,
    ENGINE_GAS,
    F025,
    F03_FN,
    F1,
    F3,
    F64_RTOL,
    FP32_TOL,
    GAS2_FN,
    GAS4,
    SHAPES,
    Net,
    Reads,
    Spec,
    engine_inputs,
    inputs,
    make_engines,
    make_models,
    owned_factors,
    plain_grads,
    recording,
)
from helpers.grads import full_grads, grad_mismatches, leaf_grads, max_rel_err


# ------------------------------------------------------------------ plain groups: exact, one multiplication each
@dataclass(frozen=True)
class Case:
    shape: str
    specs: dict[str, Spec]

    @property
    def id(self) -> str:
        return f"{self.shape}-" + "-".join(f"{n}={s}" for n, s in self.specs.items())


CASES = [
    Case("a(x)+b(y)", {"a": F1, "b": GAS4}),
    Case("a(x)+b(y)", {"a": GAS4, "b": F1}),
    Case("a(x)+b(y)", {"a": F03_FN, "b": GAS2_FN}),
    Case("a(x)+b(y)", {"a": F025, "b": GAS4}),  # equal factors: the fast path
    Case("a(x)+b(y)+c(x)", {"a": F1, "b": GAS4, "c": F03_FN}),
    Case("a(x)+b(y)+c(x)", {"a": F03_FN, "b": GAS2_FN, "c": F3}),
    Case("a(b(x))", {"a": F1, "b": GAS4}),
    Case("a(b(x))", {"a": GAS2_FN, "b": F03_FN}),
    Case("a(b(c(x)))", {"a": GAS4, "b": F1, "c": F03_FN}),
    Case("a(b(c(x)))", {"a": F3, "b": F03_FN, "c": GAS2_FN}),
    Case("a(x)+a.sub(y)", {"a": F03_FN}),
    Case("a(x)+a.sub(y)", {"a": F3}),
    Case("a(x)+a.sub(y)+b(x)", {"a": F1, "b": GAS4}),
    Case("a(x)+a.sub(y)+b(x)", {"a": GAS2_FN, "b": F03_FN}),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_each_group_gets_exactly_its_factor_with_at_most_one_multiplication_per_group(case: Case) -> None:
    shape = SHAPES[case.shape]
    models = make_models(shape.models)
    x, y = inputs()
    plain = plain_grads(shape, models, x, y)
    factor_of = owned_factors(models, case.specs)
    assert grad_mismatches(plain, plain, factor_of, "plain"), "the no-op would pass this case"
    groups = [case.specs[n].group(models[n], n) for n in shape.models]
    with graphscale.install(*groups), recording() as walks:
        loss = shape.loss(models, x, y)
        plan = graphscale.explain(loss)  # on the same roots, before the backward
        loss.backward()
    bad = grad_mismatches(plain, leaf_grads(models), factor_of, "plain", rtol=F64_RTOL)
    assert not bad, "\n".join(bad)
    assert {g.name: g.factor for g in plan.groups} == pytest.approx({n: s.factor for n, s in case.specs.items()})
    # The backward ran what explain showed: as many multiplications, and no walk on the fast path.
    assert len(walks) == 1 and walks[0][1] == len(plan.multiplications), (walks, str(plan))
    factors = {s.factor for s in case.specs.values()}
    if len(factors) == 1:
        assert plan.fast_path and walks[0] == (0, 1), str(plan)
        return
    # NOTE [ Potentials ]: the potential changes once where a group's region
    # begins.  Each group whose factor is not 1 needs one multiplication (the
    # seed carries 1; the factors here are distinct); none needs two.  (With
    # a factor-1 group the root may keep potential 1 or take another group's
    # factor: the planner's tie-break, either way within the bounds.)
    not_one = sum(1 for s in case.specs.values() if s.factor != 1.0)
    assert not_one <= len(plan.multiplications) <= len(case.specs), str(plan)
    assert not plan.fast_path


# ------------------------------------------------------------------ one leaf, two groups over one factor source
def test_a_parameter_in_two_groups_with_the_same_factor_source_is_exact() -> None:
    net, other = Net(1), Net(2)
    fn = Reads(0.3)
    x, y = inputs()
    plain = plain_grads(SHAPES["a(x)+b(y)"], {"a": net, "b": other}, x, y)
    groups = [graphscale.Group(net, factor=fn, name="whole"), graphscale.Group(net.head, factor=fn, name="head"),
              graphscale.Group(other, factor=2.0, name="other"), graphscale.Group(other.sub, factor=2.0, name="sub")]
    with graphscale.install(*groups):
        SHAPES["a(x)+b(y)"].loss({"a": net, "b": other}, x, y).backward()
    factor_of = {n: 0.3 if n.startswith("a.") else 2.0 for n in plain}
    bad = grad_mismatches(plain, leaf_grads({"a": net, "b": other}), factor_of, "plain", rtol=F64_RTOL)
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------ DeepSpeed engines
# shape -> loss from (A, B, A's module, x, y); A and B are engines or their plain copies
ENGINE_SHAPES: dict[str, Callable[..., torch.Tensor]] = {
    "A(x)+B(y)": lambda A, B, Am, x, y: (A(x) + B(y)).float().square().sum(),
    "B(A(x))": lambda A, B, Am, x, y: B(A(x)).float().square().sum(),
    # DeepSpeed issue 8224 (engine plus its own module) beside a second engine
    "A(x)+A.module(y)+B(y)": lambda A, B, Am, x, y: (A(x) + Am(y) + B(y)).float().square().sum(),
}


@dataclass(frozen=True)
class EngineCase:
    shape: str
    stage: int
    call: str  # "engine" (A.backward(loss)) or "loss" (loss.backward())
    a_spec: Spec  # A's factor in place of its 1/GAS; B keeps its own GAS
    dtype: str = "fp32"

    @property
    def id(self) -> str:
        return f"{self.shape}-z{self.stage}-{self.dtype}-{self.call}_backward-A={self.a_spec}"

    @property
    def tol(self) -> float:
        return BF16_TOL if self.dtype == "bf16" else FP32_TOL

    @property
    def factors(self) -> dict[str, float]:
        return {"A": self.a_spec.factor, "B": 1.0 / ENGINE_GAS["B"]}


ENGINE_CASES = [
    EngineCase("A(x)+B(y)", 1, "engine", F1),
    EngineCase("A(x)+B(y)", 2, "loss", F1),
    EngineCase("B(A(x))", 1, "loss", F1),
    EngineCase("B(A(x))", 2, "engine", F03_FN),
    EngineCase("A(x)+A.module(y)+B(y)", 1, "loss", F03_FN),
    EngineCase("A(x)+A.module(y)+B(y)", 2, "engine", F1),
    EngineCase("B(A(x))", 2, "loss", F1, dtype="bf16"),
    EngineCase("A(x)+A.module(y)+B(y)", 1, "engine", F1, dtype="bf16"),
]


def run_engine_case(case: EngineCase, govern: bool) -> dict[str, float]:
    """One backward of ``case`` with graphscale installed or DeepSpeed alone;
    each engine's max relative gradient error against the oracle."""
    engines, refs = make_engines(case.stage, bf16=case.dtype == "bf16")
    dtype = torch.bfloat16 if case.dtype == "bf16" else torch.float32
    loss_fn = ENGINE_SHAPES[case.shape]
    x, y = engine_inputs(torch.float32)
    loss_fn(refs["A"], refs["B"], refs["A"], x, y).backward()
    want = {n: [p.grad * case.factors[n] for p in r.parameters()] for n, r in refs.items()}
    A, B = engines["A"], engines["B"]
    inst = graphscale.install(case.a_spec.group(A, "A"), B) if govern else None
    try:
        loss = loss_fn(A, B, A.module, *engine_inputs(dtype))
        if case.call == "engine":
            A.backward(loss)
        else:
            loss.backward()
    finally:
        if inst is not None:
            inst.remove()
    return {n: max_rel_err(full_grads(e, cpu=False, missing=True), want[n]) for n, e in engines.items()}


@pytest.mark.deepspeed
@require_deepspeed
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in ENGINE_CASES])
def test_an_engine_with_a_factor_beside_an_engine_with_its_gas_is_exact(ds_dist: None, case: EngineCase) -> None:
    errs = run_engine_case(case, govern=True)
    assert max(errs.values()) <= case.tol, f"per-engine max relative gradient error {errs}"


@pytest.mark.deepspeed
@require_deepspeed
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in ENGINE_CASES])
def test_deepspeed_alone_cannot_give_an_engine_a_factor(ds_dist: None, case: EngineCase) -> None:
    """DeepSpeed alone divides A by its GAS (2) somewhere: never A's factor
    (1 or 0.3), in either generation, so the test above can fail."""
    errs = run_engine_case(case, govern=False)
    assert errs["A"] > 0.4, f"per-engine max relative gradient error {errs}"


@pytest.mark.deepspeed
@require_deepspeed
@pytest.mark.parametrize("a_spec", [F1, F03_FN], ids=str)
def test_scale_wrt_gas_false_switches_custom_factors_off_too(ds_dist: None, a_spec: Spec) -> None:
    """``engine.backward(loss, scale_wrt_gas=False)``: every group's factor is
    1 in that backward, a ``factor=`` engine's as well (``Group.pin``)."""
    engines, refs = make_engines(1)
    A, B = engines["A"], engines["B"]
    x, y = engine_inputs(torch.float32)
    ENGINE_SHAPES["B(A(x))"](refs["A"], refs["B"], refs["A"], x, y).backward()
    with graphscale.install(a_spec.group(A, "A"), B):
        A.backward(ENGINE_SHAPES["B(A(x))"](A, B, A.module, x, y), scale_wrt_gas=False)
    errs = {n: max_rel_err(full_grads(e, cpu=False, missing=True), [p.grad for p in refs[n].parameters()])
            for n, e in engines.items()}
    assert max(errs.values()) <= FP32_TOL, f"per-engine max relative error vs the plain gradient {errs}"
