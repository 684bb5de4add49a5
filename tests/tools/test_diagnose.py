"""graphscale.diagnose: DeepSpeed alone, watched, nothing governed.

For each known shape (NOTE [ Diagnosis without graphscale ] in
graphscale/_tools/diagnose.py) real engines A (GAS 2) and B (GAS 4) run one
backward as DeepSpeed alone runs it.  The truth is measured in the same test
and independently of the diagnosis: each parameter's reduced gradient
(``safe_get_full_grad`` at a forced boundary) against a plain-PyTorch oracle
(copies of the models made before ``deepspeed.initialize``).  The diagnosis
must name exactly the parameters the truth says are wrong, with the factor
the truth measured, and its pinned cause; and the wrong engines of each shape
are pinned per DeepSpeed generation (both run in CI).  At ZeRO stage 1 and at
stage 3, where the reference comes from the micro-step's forward called once
more (``found.replayable``: NOTE [ Audit by replay ] in
graphscale/_tools/replay.py); without one, stage 3 is refused before the backward.
"""
from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

import graphscale

from helpers.engines import ds_config, require_deepspeed
from helpers.grads import full_grads
from helpers.models import tanh_mlp

pytestmark = [pytest.mark.deepspeed, require_deepspeed]

GAS = {"A": 2, "B": 4}


def generation() -> str:
    """'tracker' for DeepSpeed >= 0.19.6 (PR 8245), 'hooks' before it."""
    import deepspeed.runtime.engine as eng

    return "tracker" if hasattr(eng, "_ENGINE_BACKWARD_GRAPH_TRACKER") else "hooks"


# name -> (loss(A, A_module, B, B_module, x), call, {generation: {engine: cause pattern}})
SHAPES: dict[str, tuple[Callable[..., torch.Tensor], str, dict[str, dict[str, str]]]] = {
    "one_engine": (lambda A, Am, B, Bm, x: A(x).square().sum(), "A", {"tracker": {}, "hooks": {}}),
    "sum_of_two": (lambda A, Am, B, Bm, x: A(x).sum() + B(x).square().sum(), "A",
                   {"tracker": {"B": r"divided by the GAS of A \(2\) instead of its own \(4\): that engine's backward"},
                    "hooks": {}}),
    "nested": (lambda A, Am, B, Bm, x: B(A(x)).square().sum(), "loss",
               {g: {"A": r"divided 2 times \(A x B\)"} for g in ("tracker", "hooks")}),
    "engine_and_module": (lambda A, Am, B, Bm, x: A(x).sum() + Am(x).square().sum(), "loss",
                          {g: {"A": r"engine \+ engine.module"} for g in ("tracker", "hooks")}),
}


def _engines(stage: int = 1) -> tuple[dict[str, Any], dict[str, torch.nn.Module]]:
    import deepspeed

    engines, plain = {}, {}
    for k, name in enumerate(GAS):
        net = tanh_mlp(k, sequential=True)
        plain[name] = copy.deepcopy(net)
        engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.0),
                                          config=ds_config(GAS[name], stage))
        engine.set_gradient_accumulation_boundary(True)  # the gradients are readable after one backward
        engines[name] = engine
    return engines, plain


@pytest.mark.parametrize("stage", [1, 3], ids=["zero1", "zero3_replayed"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_diagnosis_names_what_deepspeed_alone_got_wrong_and_why(ds_dist: None, shape: str, stage: int) -> None:
    from deepspeed.utils import safe_get_full_grad

    loss_of, call, causes = SHAPES[shape]
    engines, plain = _engines(stage)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(7))
    A, B = engines["A"], engines["B"]
    oracle = loss_of(plain["A"], plain["A"], plain["B"], plain["B"], x)
    want = dict(zip([f"{n}.{p}" for n in GAS for p, _ in plain[n].named_parameters()],
                    torch.autograd.grad(oracle, [q for n in GAS for q in plain[n].parameters()], allow_unused=True)))
    with graphscale.diagnose(A=A, B=B) as found:
        step_loss = found.replayable(loss_of)  # used where the graph cannot be backpropagated twice (ZeRO 3)
        loss = step_loss(A, A.module, B, B.module, x)
        loss.backward() if call == "loss" else engines[call].backward(loss)
    assert found.backwards == 1
    def full_grad(p: torch.Tensor) -> torch.Tensor | None:
        try:
            return safe_get_full_grad(p)
        except ValueError:  # an engine this backward did not reach has none
            return None

    # the truth, measured apart from the diagnosis
    truly_wrong = set()
    for n, e in engines.items():
        for pname, p in e.module.named_parameters():
            g, w = full_grad(p), want[f"{n}.{pname}"]
            if w is None:
                continue
            got = torch.zeros_like(w) if g is None else g.detach()
            if not torch.allclose(got, w / GAS[n], rtol=1e-4, atol=1e-7):
                truly_wrong.add(f"{n}.{pname}")
    named = {f"{f.group}.{f.parameter}": f for f in found.findings}
    assert set(named) == truly_wrong, str(found)
    pinned = causes[generation()]
    assert {k.split(".")[0] for k in truly_wrong} == set(pinned), (generation(), str(found))
    for key, f in named.items():
        assert f.expected == 1.0 / GAS[f.group]
        assert re.search(pinned[f.group], f.cause), (f.cause, pinned[f.group])
        if not f.mixed:  # the factor the diagnosis read is the one DeepSpeed gave
            w = want[key]
            got = full_grad(dict(engines[f.group].module.named_parameters())[key.split(".", 1)[1]])
            assert f.observed == pytest.approx(float((got.double() * w.double()).sum() / (w.double() ** 2).sum()),
                                               rel=1e-5)
    assert found.ok == (not truly_wrong)
    assert ("WRONG" in str(found)) == bool(truly_wrong)


def test_a_diagnosis_changes_no_gradient_and_leaves_nothing_behind(ds_dist: None) -> None:
    from graphscale._backward import call as _call

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(3))
    runs = []
    for diagnosed in (False, True):
        engines, _ = _engines()
        A, B = engines["A"], engines["B"]
        if diagnosed:
            with graphscale.diagnose(A, B):
                A.backward(A(x).sum() + B(x).square().sum())
        else:
            A.backward(A(x).sum() + B(x).square().sum())
        runs.append(full_grads(A, cpu=False) + full_grads(B, cpu=False))
        assert "backward" not in A.__dict__ and "backward" not in B.__dict__
    assert torch.autograd.backward is _call.ORIGINAL_BACKWARD
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_diagnose_refuses_inside_an_installation_and_non_engines(ds_dist: None) -> None:
    engines, _ = _engines()
    with graphscale.install(engines["A"]):
        with pytest.raises(graphscale.GraphscaleError, match="graphscale is installed"):
            with graphscale.diagnose(engines["B"]):
                pass
    with pytest.raises(TypeError, match="takes DeepSpeed engines"):
        graphscale.diagnose(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="give the DeepSpeed engines"):
        graphscale.diagnose()


def test_at_zero_3_a_diagnosis_without_a_replay_is_refused_before_the_backward_saying_how(ds_dist: None) -> None:
    from deepspeed.utils import safe_get_full_grad

    engines, _ = _engines(stage=3)
    A, B = engines["A"], engines["B"]
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(5))
    with graphscale.diagnose(A=A, B=B) as found:
        refused = (r"^graphscale.diagnose: group '[AB]' is a DeepSpeed engine at ZeRO stage 3, where a graph can be "
                   r"backpropagated only once.*handle.replayable\(loss_of\).*No gradient was touched\.$")
        with pytest.raises(graphscale.GraphscaleError, match=refused):
            A.backward(A(x).sum() + B(x).square().sum())
    assert found.backwards == 0 and not A._running_engine_backward  # (DeepSpeed 0.19.5 alone would leave it set)
    assert all(not bool(g.any()) for e in (A, B) for p in e.module.parameters()
               if (g := safe_get_full_grad(p)) is not None)


def test_a_zero_3_replay_that_is_not_the_forward_is_said_after_the_backward(ds_dist: None) -> None:
    engines, _ = _engines(stage=3)
    A, B = engines["A"], engines["B"]
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(5))
    calls = []

    def drifting(x: torch.Tensor) -> torch.Tensor:  # changes between calls: not a replay of the forward
        calls.append(x)
        return A(x).sum() * len(calls) + B(x).square().sum()

    with graphscale.diagnose(A=A, B=B) as found:
        with pytest.raises(graphscale.GraphscaleError, match=r"^graphscale.diagnose: backward 1: the replay of "
                           r".*drifting is not the micro-step's forward: it returned .*, the backward's root is "):
            A.backward(found.replayable(drifting)(x))
    assert len(calls) == 2 and found.backwards == 1 and not found.findings
