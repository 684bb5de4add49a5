"""Bad factors and conflicting groups are refused, and no gradient is
touched (factors beyond 1/GAS, issue 10 item 4; tests/helpers/factors.py): a bad
value when the group is made; a bad factor callable at the backward, naming
the group, on plain groups and on engines, with the next good backward
exact; ``gas=`` with ``factor=``, ``factor=None``, an engine given ``gas=``;
one parameter in two groups with different factor specifications, or in an
engine's group and another.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import graphscale

from helpers.engines import require_deepspeed
from helpers.factors import (
    F03_FN,
    F1,
    F64_RTOL,
    FP32_TOL,
    GAS2_FN,
    Net,
    Spec,
    engine_inputs,
    inputs,
    make_engines,
    recording,
)
from helpers.grads import full_grads, grad_mismatches, leaf_grads, max_rel_err

# ------------------------------------------------------------------ bad values
BAD_VALUES: dict[str, Any] = {
    "zero": 0, "zero_float": 0.0, "negative": -1, "negative_float": -0.5, "nan": math.nan,
    "inf": math.inf, "minus_inf": -math.inf, "true": True, "false": False, "string": "0.5", "list": [0.5],
}


@pytest.mark.parametrize("value", list(BAD_VALUES.values()), ids=list(BAD_VALUES))
def test_a_bad_factor_is_refused_when_the_group_is_made(value: Any) -> None:
    with pytest.raises(ValueError, match=r"^graphscale: Group\(factor=\.\.\.\) must be a positive finite number"):
        graphscale.Group(Net(1), factor=value, name="lm")


def _raises() -> float:
    raise KeyError("tokens_in_window")


# callable -> (the exception, what its message must say after the group's name)
BAD_CALLABLES: dict[str, tuple[Callable[[], Any], type[Exception], str]] = {
    **{f"returns_{k}": ((lambda v=v: v), ValueError, "must be a positive finite number")
       for k, v in BAD_VALUES.items()},
    "raises": (_raises, graphscale.GraphscaleError, r"raised KeyError: 'tokens_in_window'\. No gradient was touched"),
}


def _unchanged(before: dict[str, torch.Tensor | None], tensors: dict[str, torch.Tensor]) -> list[str]:
    changed = []
    for n, t in tensors.items():
        b = before[n]
        if (b is None) != (t.grad is None) or (b is not None and not torch.equal(b, t.grad)):
            changed.append(n)
    return changed


@pytest.mark.parametrize("path", ["fast_path", "walked"])
@pytest.mark.parametrize("bad", list(BAD_CALLABLES))
def test_a_bad_factor_callable_raises_naming_the_group_before_any_gradient_is_touched(path: str, bad: str) -> None:
    """Every leaf the backward would reach keeps its .grad: the group's, the
    other group's, an unowned Parameter's and an input's.  The next backward
    (the callable fixed) is exact."""
    fn, exc, message = BAD_CALLABLES[bad]
    lm, value, free = Net(1), Net(2), Net(3)
    x = inputs()[0].requires_grad_()
    current: list[Callable[[], Any]] = [lambda: 0.5]
    groups = [graphscale.Group(lm, factor=lambda: current[0](), name="lm")]
    if path == "walked":  # two factors and an unowned Parameter: planned
        groups.append(graphscale.Group(value, gas=4, name="value"))
        models = {"lm": lm, "value": value, "free": free}
    else:  # one group, no unowned Parameter: the seed is scaled, nothing walked
        models = {"lm": lm}
    leaves = {f"{n}.{pn}": p for n, m in models.items() for pn, p in m.named_parameters()} | {"x": x}

    def backward() -> None:
        sum(m(x) for m in models.values()).square().sum().backward()  # type: ignore[union-attr]

    plain_models = {n: copy.deepcopy(m) for n, m in models.items()}
    x_plain = x.detach().clone().requires_grad_()
    sum(m(x_plain) for m in plain_models.values()).square().sum().backward()  # type: ignore[union-attr]
    plain = leaf_grads(plain_models) | {"x": x_plain.grad}
    with graphscale.install(*groups), recording() as walks:
        backward()  # good: every .grad now holds something to keep
        assert (walks[-1][0] == 0) == (path == "fast_path"), walks
        before = leaf_grads(leaves)
        current[0] = fn
        with pytest.raises(exc, match=rf"^graphscale: the factor callable of group 'lm' {message}"):
            backward()
        assert not _unchanged(before, leaves), f"touched: {_unchanged(before, leaves)}"
        assert len(walks) == 1, "the bad backward planned"
        current[0] = lambda: 0.5
        backward()
    delta = {n: t.grad - before[n] for n, t in leaves.items()}  # type: ignore[operator]
    factor_of = {n: 0.5 if n.startswith("lm.") else 0.25 for n in leaves if n.startswith(("lm.", "value."))}
    params = [n for n in leaves if n.startswith("free.")]
    bad_grads = grad_mismatches(plain, delta, factor_of, "plain_params", rtol=F64_RTOL, params=params)
    assert not bad_grads, "\n".join(bad_grads)


def test_gas_and_factor_together_are_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"^graphscale: Group takes gas= or factor=, not both"):
        graphscale.Group(Net(1), gas=2, factor=1)  # type: ignore[call-overload]


def test_factor_none_is_refused_naming_factor() -> None:
    with pytest.raises((TypeError, ValueError), match=r"^graphscale: .*factor") as err:
        graphscale.Group(Net(1), factor=None, name="lm")  # type: ignore[arg-type]
    assert "<not given>" not in str(err.value) and "gas=" not in str(err.value)


# (stage, call, path, bad): the engines' bad values, a covering set
ENGINE_BAD = [
    (1, "engine", "walked", "returns_nan"),
    (1, "loss", "fast_path", "raises"),
    (2, "engine", "fast_path", "raises"),
    (2, "loss", "walked", "returns_zero"),
]


@pytest.mark.deepspeed
@require_deepspeed
@pytest.mark.parametrize("stage, call, path, bad", ENGINE_BAD, ids=["-".join(map(str, c)) for c in ENGINE_BAD])
def test_a_bad_engine_factor_raises_before_any_engine_gradient_is_touched(
        ds_dist: None, stage: int, call: str, path: str, bad: str) -> None:
    """Bad first (nothing accumulated yet), then good (exact against the
    oracle: the aborted backward left nothing behind), then bad again (the
    good gradients kept).  ``fast_path``: A's good factor equals B's 1/4."""
    fn, exc, message = BAD_CALLABLES[bad]
    engines, refs = make_engines(stage)
    A, B = engines["A"], engines["B"]
    good = 1.0 if path == "walked" else 0.25
    current: list[Callable[[], Any]] = [fn]
    x, y = engine_inputs(torch.float32)
    (refs["A"](x) + refs["B"](y)).square().sum().backward()
    want = [p.grad * good for p in refs["A"].parameters()] + [p.grad / 4 for p in refs["B"].parameters()]

    def grads() -> list[torch.Tensor | None]:
        return full_grads(A, cpu=False, missing=True) + full_grads(B, cpu=False, missing=True)

    def backward() -> None:
        loss = (A(x) + B(y)).square().sum()
        A.backward(loss) if call == "engine" else loss.backward()

    def same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
        return all((u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))
                   for u, v in zip(a, b, strict=True))

    with graphscale.install(graphscale.Group(A, factor=lambda: current[0](), name="A"), B), recording() as walks:
        before = grads()
        with pytest.raises(exc, match=rf"^graphscale: the factor callable of group 'A' {message}"):
            backward()
        assert same(before, grads()), "the bad backward touched an engine's gradients"
        current[0] = lambda: good
        backward()
        assert (walks[-1][0] == 0) == (path == "fast_path"), walks
        got = grads()
        assert max_rel_err(got, want) <= FP32_TOL, "not exact after an aborted backward"  # type: ignore[arg-type]
        current[0] = fn
        with pytest.raises(exc, match=rf"^graphscale: the factor callable of group 'A' {message}"):
            backward()
        assert same(got, grads()), "the bad backward touched an engine's gradients"


@pytest.mark.deepspeed
@require_deepspeed
def test_an_engine_takes_factor_not_gas(ds_dist: None) -> None:
    engines, _ = make_engines(1)
    with pytest.raises(TypeError, match=r"^graphscale: Group\(engine, gas=\.\.\.\).*give factor="):
        graphscale.Group(engines["A"], gas=2)


# ------------------------------------------------------------------ one leaf, two groups
# name -> (the first group's spec, the second's), both over the same module
SHARING: dict[str, tuple[Spec, Spec]] = {
    "factor_1_and_factor_0.5": (F1, Spec("factor", 0.5)),
    "factor_0.5_and_gas_2": (Spec("factor", 0.5), Spec("gas", 2)),  # equal values, different sources
    "factor_and_gas_callable": (F1, GAS2_FN),
    "two_factor_callables": (F03_FN, F03_FN),  # two lambdas: may differ
}


@pytest.mark.parametrize("specs", list(SHARING.values()), ids=list(SHARING))
def test_a_parameter_in_two_groups_with_different_factor_specs_is_refused_naming_both(specs: tuple[Spec, Spec]) -> None:
    net = Net(1)
    first, second = specs[0].group(net, "first"), specs[1].group(net.head, "second")
    with pytest.raises(graphscale.ConfigurationError,
                       match=r"^graphscale: parameter '(head\.)?weight' .* in group 'first' and in group 'second'"):
        graphscale.install(first, second)


@pytest.mark.deepspeed
@require_deepspeed
@pytest.mark.parametrize("other", ["the_engine_itself", "its_module_with_the_same_factor"])
def test_an_engine_with_a_factor_and_another_group_over_its_parameters_is_refused(ds_dist: None, other: str) -> None:
    """The engine's group also carries its fp16 loss scale: no plain group
    (nor the engine's own GAS group) may share its parameters."""
    engines, _ = make_engines(1)
    A = engines["A"]
    second = A if other == "the_engine_itself" else graphscale.Group(A.module, factor=1.0, name="second")
    with pytest.raises(graphscale.ConfigurationError, match=r"in group 'first' and in group '(second|engine:)"):
        graphscale.install(graphscale.Group(A, factor=1.0, name="first"), second)
