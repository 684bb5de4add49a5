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

This file: one backward.  Training through an overflow, explain and audit:
test_fp16_training.py.  The rig, graphs and configs: tests/helpers/fp16.py;
the ``fp16_here`` fixture: the family's conftest.py.
"""
from __future__ import annotations

import pytest
import torch

import graphscale

from helpers.engines import require_deepspeed
from helpers.fp16 import CALLS, FP16_TOL, GAS, GRAPHS, SCALE_POWER, STAGES, Rig, fit_ratio
from helpers.grads import max_rel_err

pytestmark = [pytest.mark.deepspeed, require_deepspeed]


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
