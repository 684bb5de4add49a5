"""fp16 DeepSpeed engines per branch (NOTE [ fp16 engines ] in
graphscale/_adapters/deepspeed/__init__.py): with two fp16 engines in one loss whose dynamic
loss scales differ, every engine's parameters must receive exactly
``loss_scale(own) / GAS(own)`` x the plain gradient, under
``engine.backward(loss)``, a direct ``loss.backward()`` and
``engine.scale(loss).backward()`` alike, so that each engine's optimizer
unscales by its own scale and checks its own gradients for overflow.

Engines A (GAS 2, initial scale 2**8) and B (GAS 4, initial scale 2**4) are
real DeepSpeed engines.  The oracle is plain float32 PyTorch on copies of the
models made before ``deepspeed.initialize``, the same graph, each model's
gradient times its engine's ``loss_scale / GAS``; fp16 weights and
activations against a float32 oracle: relative tolerance ``FP16_TOL``.

Where they run.  DeepSpeed's CPU accelerator reports fp16 unsupported on
this CPU (``torch.ops.mkldnn._is_mkldnn_fp16_supported()`` is false), but torch's CPU half kernels run
these small models, and DeepSpeed's fp16 ZeRO 1/2/3 engines build and train
on the CPU once the accelerator's capability flag says yes.  So the ``cpu``
variants force ``is_fp16_supported()`` to True for the test (monkeypatched on
the accelerator's class, restored after): a real engine, real loss scaler,
real ZeRO optimizer; only the capability flag is forced.  The ``cuda``
variants (marker ``cuda``) run the same checks on a GPU without the patch,
where DeepSpeed's accelerator is CUDA (``DS_ACCELERATOR=cuda``, as
``scripts/gpu_check.sh`` runs them); elsewhere they skip with the reason.

ZeRO stage 0 is not checked: DeepSpeed 0.19.x's ``engine.backward`` does not
scale the loss for its non-ZeRO fp16 optimizers (FP16_Optimizer,
FP16_UnfusedOptimizer) while their ``step()`` still divides by their scale
(measured: DeepSpeed alone, one engine, updates 1/256 of the plain SGD step),
so there is no per-engine scale to get right.  graphscale's ``loss_scale``
reads 1 there, as DeepSpeed applies.

# NOTE [ safe_get_full_grad of an fp16 engine ]
# (DeepSpeed 0.19.5 and 0.19.8, measured here; pinned by
# test_safe_get_full_grad_of_an_fp16_engine_reads_the_scaled_gradient)
# It returns the gradient as the optimizer will see it before unscaling:
# multiplied by the loss scale (and by 1/GAS), never unscaled.
#   ZeRO-1: at an accumulation boundary (after the reduction) the float32
#     (high-precision) partition gradient; before it the float16
#     (low-precision) param.grad.
#   ZeRO-2: at a boundary float32; before it, it raises ValueError
#     ("Gradients are only available immediately after backward and before
#     engine step").
#   ZeRO-3: float32 at and before a boundary.
# After a backward that raised in DeepSpeed's post-backward check (no
# reduction ran), it returns the float16 param.grad.  So the tests below
# read gradients right after one backward at a boundary
# (engine.set_gradient_accumulation_boundary(True)).
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import graphscale

from helpers.engines import ds_config, ds_device, require_deepspeed
from helpers.grads import full_grads, max_rel_err
from helpers.models import TanhMLP as Net

pytestmark = [pytest.mark.deepspeed, require_deepspeed]

GAS = {"A": 2, "B": 4}
SCALE_POWER = {"A": 8, "B": 4}  # dynamic loss scales start apart: 256 and 16
FP16_TOL = 1e-2  # fp16 weights and activations against a float32 oracle (measured <= 1.0e-3 on the CPU)
STEP_TOL = 1e-2  # weight changes after eight fp16 micro-steps vs a float32 reference (measured <= 1.4e-3;
#                  a scale left stale after B's overflow: relative error 1)
LR = 0.1
STAGE0_SKIP = ("ZeRO stage 0: DeepSpeed 0.19.x's engine.backward does not apply its non-ZeRO fp16 optimizers' loss "
               "scale while their step() divides by it (DeepSpeed alone is wrong by 1/scale): nothing per-engine "
               "to check (module docstring)")
STAGES = [pytest.param(0, marks=pytest.mark.skip(reason=STAGE0_SKIP), id="z0"),
          *(pytest.param(s, id=f"z{s}") for s in (1, 2, 3))]


# ------------------------------------------------------------------ where fp16 engines run
def _cpu_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.accelerator import get_accelerator

    if ds_device() != "cpu":
        pytest.skip(f"the CPU variant needs DeepSpeed's CPU accelerator; this session's is {ds_device()!r} "
                    "(the cuda variant runs here instead)")
    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)


def _cuda_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.accelerator import get_accelerator

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU: torch sees no CUDA device here")
    if ds_device() != "cuda":
        pytest.skip(f"needs DeepSpeed's CUDA accelerator; this session's is {ds_device()!r} (set DS_ACCELERATOR=cuda, "
                    "as scripts/gpu_check.sh does)")
    if not get_accelerator().is_fp16_supported():
        pytest.skip("DeepSpeed reports fp16 unsupported on this GPU")


DEVICES = [pytest.param(_cpu_fp16, id="cpu"), pytest.param(_cuda_fp16, id="cuda", marks=pytest.mark.cuda)]


@pytest.fixture(params=DEVICES)
def fp16_here(request: pytest.FixtureRequest, ds_dist: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make fp16 DeepSpeed engines buildable here, or skip (see the module docstring)."""
    request.param(monkeypatch)


# ------------------------------------------------------------------ engines, graphs, oracle
def fp16_config(name: str, stage: int) -> dict[str, Any]:
    # clip 0: DeepSpeed clips to norm 1 unless told, the reference does not clip; hysteresis 1: the first
    # overflow halves the scale (DeepSpeed's default waits for a second)
    return ds_config(GAS[name], stage, clip=0.0,
                     fp16={"initial_scale_power": SCALE_POWER[name], "hysteresis": 1, "loss_scale_window": 1000})


def _f(t: torch.Tensor) -> torch.Tensor:
    return t.float()


def _two_engines(A: Any, B: Any, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    a, b = A(x), B(y)
    return [_f(a * b).sum(), _f(b).square().sum()]


# Each graph calls each engine once: an engine's second forward in one
# backward runs its ZeRO prologue twice, and DeepSpeed then skips its epilogue.
GRAPHS: dict[str, Callable[[Any, Any, torch.Tensor, torch.Tensor], list[torch.Tensor]]] = {
    "two_engines": _two_engines,
    "nested_B_of_A": lambda A, B, x, y: [_f(B(A(x))).square().sum()],
}


class Rig:
    """Fresh fp16 engines A and B (seeded: two rigs start equal), their plain
    float32 copies made before ``deepspeed.initialize``."""

    def __init__(self, stage: int, boundary: bool | None = True) -> None:
        import deepspeed

        self.engines: dict[str, Any] = {}
        self.refs: dict[str, torch.nn.Module] = {}
        for k, name in enumerate(GAS):
            torch.manual_seed(100 + k)
            m = Net()
            self.refs[name] = copy.deepcopy(m)
            engine, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=LR),
                                              config=fp16_config(name, stage))
            if boundary is not None:  # True: reduce at once, gradients readable after one backward
                engine.set_gradient_accumulation_boundary(boundary)
            self.engines[name] = engine
        self.device = self.engines["A"].device

    @staticmethod
    def inputs(k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + k)
        return torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)

    def roots(self, graph: str, k: int = 0) -> list[torch.Tensor]:
        x, y = (t.to(self.device, torch.half) for t in self.inputs(k))
        return GRAPHS[graph](self.engines["A"], self.engines["B"], x, y)

    def plain_grads(self, graph: str, k: int = 0) -> dict[str, list[torch.Tensor]]:
        """The oracle's plain gradients (no factor), float32 on the CPU."""
        torch.autograd.backward(GRAPHS[graph](self.refs["A"], self.refs["B"], *self.inputs(k)))
        out = {n: [p.grad.clone() for p in m.parameters()] for n, m in self.refs.items()}
        for m in self.refs.values():
            m.zero_grad(set_to_none=True)
        return out

    def scales(self) -> dict[str, float]:
        from graphscale._adapters.deepspeed import loss_scale

        return {n: loss_scale(e) for n, e in self.engines.items()}

    def grads(self) -> dict[str, list[torch.Tensor]]:
        return {n: full_grads(e) for n, e in self.engines.items()}

    def backward(self, call: str, roots: list[torch.Tensor]) -> None:
        loss = roots[0] if len(roots) == 1 else sum(roots[1:], roots[0])
        if call == "loss":
            loss.backward()
        elif call.startswith("engine:"):
            self.engines[call.split(":")[1]].backward(loss)
        elif call.startswith("scale:"):
            self.engines[call.split(":")[1]].scale(loss).backward()
        else:
            raise ValueError(call)


def fit_ratio(got: list[torch.Tensor], plain: list[torch.Tensor]) -> float:
    """The least-squares c in got ~ c x plain."""
    num = sum((g.double() * p.double()).sum() for g, p in zip(got, plain, strict=True))
    den = sum((p.double() ** 2).sum() for p in plain)
    return float(num / den)


CALLS = ["engine:A", "engine:B", "loss", "scale:B"]


# ------------------------------------------------------------------ one backward
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.replace(":", "_"))
@pytest.mark.parametrize("graph", list(GRAPHS))
def test_every_fp16_engine_gets_its_own_loss_scale_over_its_gas(fp16_here: None, graph: str, call: str,
                                                               stage: int) -> None:
    rig = Rig(stage)
    scales = rig.scales()
    assert scales == {"A": 2.0 ** SCALE_POWER["A"], "B": 2.0 ** SCALE_POWER["B"]}, scales
    plain = rig.plain_grads(graph)
    with graphscale.install(*rig.engines.values()):
        rig.backward(call, rig.roots(graph))
    got = rig.grads()
    errs = {n: max_rel_err(got[n], [g * scales[n] / GAS[n] for g in plain[n]]) for n in GAS}
    ratios = {n: f"{fit_ratio(got[n], plain[n]):.4g} (want {scales[n] / GAS[n]:g})" for n in GAS}
    assert max(errs.values()) <= FP16_TOL, f"relative errors {errs}; gradient / plain: {ratios}"


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.replace(":", "_"))
@pytest.mark.parametrize("graph", list(GRAPHS))
def test_deepspeed_alone_gives_fp16_engines_the_wrong_scale(fp16_here: None, graph: str, call: str,
                                                           stage: int) -> None:
    """Without graphscale DeepSpeed multiplies the whole loss by the calling
    engine's scale (none at all for a direct backward), so the other
    engine's gradients carry the caller's scale (times some 1/GAS), not
    their own; and its post-backward check refuses the backward of every
    engine that was not called (RuntimeError "Loss scaling is required"),
    after the gradients were computed."""
    rig = Rig(stage)
    scales = rig.scales()
    plain = rig.plain_grads(graph)
    try:
        rig.backward(call, rig.roots(graph))
    except RuntimeError as exc:
        assert "Loss scaling is required" in str(exc), exc
    got = rig.grads()
    ratio = {n: fit_ratio(got[n], plain[n]) for n in GAS}
    own = {n: scales[n] / GAS[n] for n in GAS}
    wrong = [n for n in GAS if abs(ratio[n] / own[n] - 1) > FP16_TOL]
    if call == "loss":  # nothing scales the loss: every engine lacks its scale
        assert wrong == list(GAS), f"gradient / plain {ratio}, own scale / GAS {own}"
        return
    caller = call.split(":")[1]
    (other,) = (n for n in GAS if n != caller)
    assert other in wrong, f"gradient / plain {ratio}, own scale / GAS {own}"
    carried = ratio[other] / scales[caller]
    assert any(abs(carried * d - 1) <= FP16_TOL for d in (1, 2, 4, 8)), (
        f"engine {other}'s gradient / plain is {ratio[other]:.4g}: not the caller's scale {scales[caller]:g} "
        "over a GAS")


# ------------------------------------------------------------------ what safe_get_full_grad reads
@pytest.mark.parametrize("boundary", [True, False], ids=["at_boundary", "before_boundary"])
@pytest.mark.parametrize("stage", STAGES)
def test_safe_get_full_grad_of_an_fp16_engine_reads_the_scaled_gradient(fp16_here: None, stage: int,
                                                                        boundary: bool) -> None:
    """NOTE [ safe_get_full_grad of an fp16 engine ] (module docstring)."""
    rig = Rig(stage, boundary=boundary)
    scales = rig.scales()
    plain = rig.plain_grads("two_engines")
    with graphscale.install(*rig.engines.values()):
        rig.backward("loss", rig.roots("two_engines"))
    if stage == 2 and not boundary:
        with pytest.raises(ValueError, match="only available immediately after backward"):
            rig.grads()
        return
    from deepspeed.utils import safe_get_full_grad

    want_dtype = torch.float16 if (stage == 1 and not boundary) else torch.float32
    for n, e in rig.engines.items():
        dtypes = {safe_get_full_grad(p).dtype for p in e.module.parameters()}
        assert dtypes == {want_dtype}, f"engine {n}: {dtypes}"
    got = rig.grads()
    for n in GAS:
        err = max_rel_err(got[n], [g * scales[n] / GAS[n] for g in plain[n]])
        assert err <= FP16_TOL, f"engine {n}: not loss_scale x 1/GAS x plain (relative error {err:.3g})"


# ------------------------------------------------------------------ training through an overflow
MICRO_STEPS = 8  # A steps after micro-steps 1, 3, 5, 7; B after 3 and 7
OVERFLOW_AT = 1  # B's gradient is inf in micro-step 1: B skips its first step and halves its scale


def _poisoned(roots: list[torch.Tensor], b_out: torch.Tensor, poison: float) -> torch.Tensor:
    """The loss plus ``poison`` x sum(B's output): inf reaches B's parameters only."""
    return sum(roots[1:], roots[0]) + poison * _f(b_out).sum()


def _step_graph(A: Any, B: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    a, b = A(x), B(y)
    return [_f(a * b).sum(), _f(b).square().sum()], b


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
