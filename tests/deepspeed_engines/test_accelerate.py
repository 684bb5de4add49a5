"""Accelerate with DeepSpeed: engines made by ``accelerator.prepare`` and
trained through ``accelerator.backward`` inside ``accelerator.accumulate``,
governed by ``graphscale.install(actor, critic)``.

# NOTE [ Two DeepSpeed engines through Accelerate ]
# (read from accelerate 1.15's accelerator.py, state.py, utils/deepspeed.py)
# * One ``prepare`` call takes one model under DeepSpeed ("You can't use same
#   Accelerator() instance with multiple models"); each call builds its
#   engine from the *selected* plugin of ``Accelerator(deepspeed_plugins=
#   {name: DeepSpeedPlugin(hf_ds_config=...)})``
#   (``accelerator.state.select_deepspeed_plugin(name)``).
# * An Accelerator wraps only the first engine it prepares
#   (``deepspeed_engine_wrapped``; a second prepare only warns), and
#   ``accelerator.backward(loss)`` is ``engine.set_gradient_accumulation_boundary
#   (sync_gradients); engine.backward(loss); engine.step() if sync_gradients``
#   on that one engine.  Accelerate's documented way to train two models is a
#   second ``Accelerator()`` (it shares the plugins through the singleton
#   AcceleratorState), one per engine.  That is what these tests do.
# * Accelerate has ONE gradient-accumulation count per process:
#   ``accelerator.gradient_accumulation_steps`` lives in the singleton
#   GradientState, and every DeepSpeed ``prepare`` overwrites it with that
#   engine's configured GAS (with a "mismatch ... Using DeepSpeed's value"
#   warning), so the engine prepared LAST decides when ``accumulate()`` sets
#   ``sync_gradients``.  With an actor at GAS 2 and a critic at GAS 4 in one
#   loss, the actor is prepared last and drives Accelerate's bookkeeping; the
#   critic, whose accelerator's ``backward`` is never called (one loss, one
#   backward), is stepped with ``critic.step()`` every micro-step and counts
#   its own boundary, as with plain DeepSpeed.  (Preparing the critic last
#   would step the actor every 4 micro-steps at factor 1/2: Accelerate's
#   bookkeeping, not a gradient-scaling question; the test pins the order.)
# * ``DeepSpeedOptimizerWrapper.step``/``zero_grad`` are no-ops; the engine
#   steps inside ``accelerator.backward``.
#
# On CPU, one process: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
# MASTER_PORT set (ds_dist does it, and initializes gloo first); without
# LOCAL_RANK and an initialized group, deepspeed.initialize falls back to MPI
# discovery and fails without mpi4py.  DS_ACCELERATOR=cpu.  Not
# ``Accelerator(cpu=True)``: that silently selects no DeepSpeed and prepare()
# returns the plain module.  ``train_micro_batch_size_per_gpu`` must be a
# number when no DataLoader is prepared; ``gradient_clipping`` is set to 0
# (Accelerate fills an "auto" one with 1.0; the reference does not clip).
#
# DeepSpeed alone divides by the wrong GAS in the same places as without
# Accelerate (NOTE [ DeepSpeed's two generations ] in graphscale/_adapters/deepspeed/__init__.py):
# ``accelerator.backward`` is ``engine.backward``.  graphscale governs it
# because Accelerate calls ``self.engine.backward`` on the instance, which the
# adapter shadows.
"""
from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import torch

import graphscale

from helpers.engines import ds_config, require_deepspeed
from helpers.models import tanh_mlp

try:
    import accelerate  # noqa: F401

    HAVE_ACCELERATE = True
except Exception:  # pragma: no cover - depends on the environment
    HAVE_ACCELERATE = False

pytestmark = [
    pytest.mark.deepspeed,
    require_deepspeed,
    pytest.mark.skipif(not HAVE_ACCELERATE, reason="accelerate is not installed"),
]

RTOL = 1e-6  # float32, powers of two: measured 0.0 (as in tests/deepspeed_engines/test_training_parity.py)
GAS = {"actor": 2, "critic": 4}
MICRO_STEPS = 8  # two windows of the critic, four of the actor
LR = 0.1


def _generation() -> str:
    """'tracker' for DeepSpeed >= 0.19.6 (PR 8245), 'hooks' before it."""
    import deepspeed.runtime.engine as eng

    return "tracker" if hasattr(eng, "_ENGINE_BACKWARD_GRAPH_TRACKER") else "hooks"


# variant -> (engines it builds, loss from (actor, critic, actor's module, x, y),
#             generations in which DeepSpeed alone is wrong)
# ``accelerator.backward`` is always the actor's accelerator (Accelerate's GAS = 2).
VARIANTS: dict[str, tuple[tuple[str, ...], Callable[..., torch.Tensor], frozenset[str]]] = {
    # actor + critic in one loss: >= 0.19.6 divides the whole loss by the actor's 2
    "actor_plus_critic": (("actor", "critic"), lambda A, C, Am, x, y: (A(x) + C(y)).square().sum(),
                          frozenset({"tracker"})),
    # critic on the actor's output (PPO-style value of the policy's features)
    "critic_of_actor": (("actor", "critic"), lambda A, C, Am, x, y: C(A(x)).square().sum(),
                        frozenset({"tracker", "hooks"})),
    # DeepSpeed issue 8224: engine(x) + engine.module(y), with a critic beside it
    "actor_plus_actor_module": (("actor", "critic"),
                                lambda A, C, Am, x, y: ((A(x) + Am(y)) * C(y)).sum(),
                                frozenset({"tracker", "hooks"})),
    # the same with one Accelerate engine only: exact from 0.19.6 (engine.backward
    # divides the whole loss), the module path unscaled before it
    "one_engine_plus_its_module": (("actor",), lambda A, C, Am, x, y: (A(x) + Am(y)).square().sum(),
                                   frozenset({"hooks"})),
}


@pytest.fixture
def fresh_accelerate(ds_dist: None) -> Iterator[None]:
    """Accelerate keeps process-wide singletons (AcceleratorState, GradientState),
    an environment flag and transformers' global DeepSpeed config; put all of
    them back so no other test sees this one's Accelerator."""
    from accelerate.state import AcceleratorState, GradientState

    saved = os.environ.get("ACCELERATE_USE_DEEPSPEED")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        yield
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        if saved is None:
            os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
        else:
            os.environ["ACCELERATE_USE_DEEPSPEED"] = saved
        try:
            from transformers.integrations import unset_hf_deepspeed_config
        except Exception:  # pragma: no cover - transformers is optional
            pass
        else:
            unset_hf_deepspeed_config()


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)


def _full_params(engine: Any) -> list[torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    return [safe_get_full_fp32_param(p).detach().clone() for p in engine.module.parameters()]


def _rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want, strict=True))


def train_and_compare(stage: int, variant: str, govern: bool) -> list[float]:
    """Train through Accelerate and a plain reference side by side; the worst
    relative weight error over the engines after each micro-step."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    names, loss_fn, _ = VARIANTS[variant]
    refs = {n: tanh_mlp(i + 1, sequential=True) for i, n in enumerate(names)}
    plugins = {n: DeepSpeedPlugin(hf_ds_config=ds_config(GAS[n], stage, micro_batch=3, clip=0.0)) for n in names}
    # NOTE [ Two DeepSpeed engines through Accelerate ]: one Accelerator per
    # engine, the one whose GAS Accelerate's bookkeeping follows prepared last.
    order = [n for n in names if n != "actor"] + ["actor"]
    accelerators = {n: Accelerator(deepspeed_plugins=plugins) if i == 0 else Accelerator()
                    for i, n in enumerate(order)}
    engines: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in order:
            acc = accelerators[n]
            acc.state.select_deepspeed_plugin(n)
            m = copy.deepcopy(refs[n])
            engines[n], _ = acc.prepare(m, torch.optim.SGD(m.parameters(), lr=LR))
    accelerator = accelerators["actor"]
    assert accelerator.deepspeed_engine_wrapped.engine is engines["actor"]
    assert accelerator.gradient_accumulation_steps == GAS["actor"], "Accelerate's GAS follows the last prepare"

    opts = {n: torch.optim.SGD(r.parameters(), lr=LR) for n, r in refs.items()}
    acc_grads = {n: [torch.zeros_like(p) for p in r.parameters()] for n, r in refs.items()}
    worst: list[float] = []
    inst = graphscale.install(*engines.values()) if govern else None
    try:
        for step in range(MICRO_STEPS):
            x, y = _data(step)
            A, C = engines["actor"], engines.get("critic")
            with accelerator.accumulate(A):
                assert accelerator.sync_gradients == ((step + 1) % GAS["actor"] == 0)
                loss = loss_fn(A, C, A.module, x, y)
                accelerator.backward(loss)  # steps the actor at Accelerate's boundary
                if C is not None:
                    C.step()  # its own boundary (GAS 4); its accelerator's backward never runs
            # reference: each model's gradient times its own 1/GAS, a step every GAS
            ref_loss = loss_fn(refs["actor"], refs.get("critic"), refs["actor"], x, y)
            for n, ref in refs.items():
                grads = torch.autograd.grad(ref_loss, list(ref.parameters()), retain_graph=True)
                for a, g in zip(acc_grads[n], grads):
                    a += g / GAS[n]
                if (step + 1) % GAS[n] == 0:
                    for p, a in zip(ref.parameters(), acc_grads[n]):
                        p.grad = a.clone()
                        a.zero_()
                    opts[n].step()
            worst.append(max(_rel(_full_params(engines[n]), [p.detach() for p in refs[n].parameters()])
                             for n in names))
    finally:
        if inst is not None:
            inst.remove()
    return worst


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_deepspeed_training_matches_per_engine_gas_reference(
        fresh_accelerate: None, stage: int, variant: str) -> None:
    worst = train_and_compare(stage, variant, govern=True)
    assert max(worst) <= RTOL, f"relative weight error after each micro-step: {worst}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_accelerate_deepspeed_alone_is_wrong_where_deepspeed_is(fresh_accelerate: None, variant: str) -> None:
    """Without graphscale, Accelerate's engines drift exactly where DeepSpeed's
    generation divides by the wrong GAS, and match the reference elsewhere
    (so the test above can fail, and the reference is the right one)."""
    gen = _generation()
    wrong = gen in VARIANTS[variant][2]
    worst = train_and_compare(2, variant, govern=False)
    if wrong:
        assert max(worst) > 1e-3, f"DeepSpeed alone ({gen}) matched the reference: {worst}"
    else:
        assert max(worst) <= RTOL, f"DeepSpeed alone ({gen}) should be exact here: {worst}"
