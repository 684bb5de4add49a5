"""Long runs: many training steps with two DeepSpeed engines of different GAS.

After every backward: no graphscale hook left on any node (every handle made
during the backward is checked through its hooks dict), and every gradient
exact against plain PyTorch accumulated by hand.  Over the run: no growth in
live Python objects (per type) or resident memory beyond noise.  After
``remove()``: no reference kept to an engine, module or tensor.

CI runs 100 steps; ``GRAPHSCALE_FULL=1`` runs the issue's 1,000."""
from __future__ import annotations

import contextlib
import gc
import os
import weakref
from collections import Counter
from typing import Any, Callable

import pytest
import torch
import torch.utils.hooks

import graphscale
from graphscale._backward import running as _running

from helpers import seams
from helpers.engines import require_deepspeed
from helpers.grads import full_grads, max_rel_err
from helpers.hooks import graphscale_hooks_left, spy_handles

FULL = os.environ.get("GRAPHSCALE_FULL") == "1"


class LiveObjects:
    """The Python objects made after :meth:`start` and still alive at :meth:`grown`,
    by type.  The objects alive at the start are held meanwhile, so no new
    object can take the id of one of them (ids are addresses), and an object
    counts as new only if it is: counting types instead is fooled by objects
    the collector reports at one time and not at another."""

    def start(self) -> None:
        gc.collect()
        self._held = gc.get_objects()
        self._ids = {id(o) for o in self._held}

    def grown(self) -> Counter[str]:
        gc.collect()
        held = self._held
        out = Counter(type(o).__qualname__ for o in gc.get_objects() if id(o) not in self._ids and o is not held)
        del self._held, self._ids
        return out



@pytest.fixture(autouse=True)
def _native_hooks_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the native route governs, its hooks are counted by the native
    module's test build (tests/helpers/seams.py)."""
    seams.swap_in(monkeypatch, required=False)

def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


GRAPHSCALE_TYPES = {"Installation", "Group", "EngineGroup", "State", "Plan", "Graph", "Running", "PyPlan",
                    "_EngineAdapter", "NativePlan"}


def _steps(make_engine: Any, steps: int, direct: bool, stage: int, governed: bool) -> tuple[dict[str, int], int, int]:
    """Train ``steps`` micro-steps; (types grown after warm-up, objects grown,
    RSS grown).  Governed: exact at every step and no graphscale hook left;
    not governed: DeepSpeed alone, the baseline of what the stack itself grows."""
    torch.manual_seed(0)
    actor = make_engine(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)),
                        gas=2, stage=stage, lr=0.01)
    critic = make_engine(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)),
                         gas=4, stage=stage, lr=0.01)
    engines = [(actor, 2), (critic, 4)]
    xs = torch.randn(16, 3, 4)

    def loss_of(a: Callable[[torch.Tensor], torch.Tensor], c: Callable[[torch.Tensor], torch.Tensor],
                x: torch.Tensor) -> torch.Tensor:
        h = a(x)
        return c(h).sum() + h.pow(2).mean()

    acc: list[list[torch.Tensor]] = [[torch.zeros_like(p) for p in e.module.parameters()] for e, _ in engines]
    warm = 10
    live = LiveObjects()
    before_rss = 0
    with graphscale.install(actor, critic) if governed else contextlib.nullcontext():
        for step in range(steps):
            if step == warm:
                live.start()
                before_rss = rss_bytes()
            x = xs[step % len(xs)]
            params = [p for e, _ in engines for p in e.module.parameters()]
            plain = torch.autograd.grad(loss_of(actor.module, critic.module, x), params)  # oracle
            k = 0
            for i, (e, gas) in enumerate(engines):
                for j, _ in enumerate(e.module.parameters()):
                    acc[i][j] += plain[k] / gas
                    k += 1
            loss = loss_of(actor, critic, x)
            with spy_handles() as made:
                if direct:
                    loss.backward()
                else:
                    actor.backward(loss)
            left = graphscale_hooks_left(made)
            assert not left, f"step {step}: graphscale hooks left on nodes: {left}"
            assert not _running.running(), f"step {step}: a plan stayed registered"
            for i, (e, _) in enumerate(engines):
                err = max_rel_err(full_grads(e), acc[i])
                assert err < 1e-5 or not governed, f"step {step}: engine {i} relative error {err:.3g}"
            boundary = [e.is_gradient_accumulation_boundary() for e, _ in engines]
            for e, _ in engines:
                e.step()
            for i, b in enumerate(boundary):
                if b:
                    acc[i] = [torch.zeros_like(t) for t in acc[i]]
            del loss, plain, made
    grown = live.grown()
    return dict(grown), sum(grown.values()), rss_bytes() - before_rss


def _train(make_engine: Any, steps: int, direct: bool, stage: int) -> None:
    grown, total, rss = _steps(make_engine, steps, direct, stage, governed=True)
    ours = {t: n for t, n in grown.items() if t in GRAPHSCALE_TYPES}
    assert not ours, f"graphscale objects accumulate over the run: {ours}"
    # What the stack grows by itself in this environment (measured: DeepSpeed
    # 0.19.5 with transformers importable keeps ~1 hook dict a step alive,
    # with or without graphscale): a growth counts against graphscale only
    # beyond the same run without it.
    base, base_total, _ = _steps(make_engine, steps, direct, stage, governed=False)
    measured = steps - 10
    print(f"\n[{steps} steps, stage {stage}, {'loss.backward' if direct else 'engine.backward'}] "
          f"live objects {total:+d} over {measured} steps (DeepSpeed alone {base_total:+d}), "
          f"RSS {rss / 2**20:+.1f} MiB; "
          f"types grown: {sorted(grown.items(), key=lambda kv: -kv[1])[:5]}")
    # Noise (measured: DeepSpeed's cyclic garbage makes counts wobble by ~50 once,
    # not per step); a leak of one object a step of any type shows over 90 steps.
    steady = {t: n - base.get(t, 0) for t, n in grown.items() if n - base.get(t, 0) >= min(60, measured * 2 // 3)}
    assert not steady, f"live Python objects grew steadily over {measured} steps: {steady}"
    assert total - max(base_total, 0) < 120, f"live Python objects grew by {total} over {measured} steps: {grown}"
    assert rss < 64 * 2**20, "resident memory grew by more than 64 MiB"


@require_deepspeed
@pytest.mark.deepspeed
@pytest.mark.parametrize("direct", [False, True], ids=["engine.backward", "loss.backward"])
def test_a_hundred_steps_with_two_engines_leave_no_hook_no_leak_and_stay_exact(make_engine: Any,
                                                                                direct: bool) -> None:
    _train(make_engine, 100, direct, stage=1)


@require_deepspeed
@pytest.mark.deepspeed
@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="1,000 steps: set GRAPHSCALE_FULL=1")
@pytest.mark.parametrize("direct", [False, True], ids=["engine.backward", "loss.backward"])
def test_a_thousand_steps_with_two_engines_leave_no_hook_no_leak_and_stay_exact(make_engine: Any,
                                                                                direct: bool) -> None:
    _train(make_engine, 1000, direct=direct, stage=1)  # ZeRO 1: the oracle runs the unpartitioned module


# ---------------------------------------------------------------- references after remove()
def _assert_dead(refs: dict[str, weakref.ref[Any]]) -> None:
    gc.collect()
    alive = [name for name, r in refs.items() if r() is not None]
    assert not alive, f"still referenced after remove(): {alive}"


def test_after_remove_no_group_module_tensor_or_gas_callable_is_kept_alive() -> None:
    actor, critic = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    gas_of = {"critic": 4}
    gas_fn = lambda: gas_of["critic"]  # noqa: E731 - a closure: it must die too
    ga, gc_ = graphscale.Group(actor, gas=2), graphscale.Group(critic, gas=gas_fn)
    inst = graphscale.install(ga, gc_)
    x = torch.randn(2, 3)
    for _ in range(3):  # walked plans
        h = actor(x)
        h.retain_grad()
        loss = critic(h).sum() + h.pow(2).mean()
        loss.backward()
    refs = {"actor": weakref.ref(actor), "critic": weakref.ref(critic), "weight": weakref.ref(actor.weight),
            "group": weakref.ref(ga), "callable-group": weakref.ref(gc_), "gas callable": weakref.ref(gas_fn),
            "intermediate": weakref.ref(h), "loss": weakref.ref(loss)}
    inst.remove()
    del actor, critic, ga, gc_, gas_fn, h, loss
    _assert_dead(refs)
    assert inst.groups == () and not inst.active  # the handle itself is still held, and holds nothing


@require_deepspeed
@pytest.mark.deepspeed
@pytest.mark.parametrize("direct", [False, True], ids=["plain-groups-too", "engine-only"])
def test_after_remove_an_engine_and_its_module_can_be_collected(make_engine: Any, direct: bool) -> None:
    # ZeRO stage 0: DeepSpeed itself keeps ZeRO 1-3 engines alive (measured without
    # graphscale), so only there can "graphscale keeps nothing" be seen directly;
    # and only where this DeepSpeed lets a trained stage-0 engine go without graphscale.
    baseline = make_engine(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh()), gas=4, stage=0)
    loss = baseline(torch.randn(2, 3)).sum()
    baseline.backward(loss)
    baseline.step()
    baseline_ref = weakref.ref(baseline)
    del baseline, loss
    gc.collect()
    if baseline_ref() is not None:
        import deepspeed

        pytest.skip(f"DeepSpeed {deepspeed.__version__} keeps a trained ZeRO-0 engine alive without graphscale")
    torch.manual_seed(1)
    engine = make_engine(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh()), gas=4, stage=0)
    head = torch.nn.Linear(3, 1)
    groups: list[Any] = [engine] + ([graphscale.Group(head, gas=2)] if direct else [])
    inst = graphscale.install(*groups)
    for _ in range(3):
        loss = head(engine(torch.randn(2, 3))).sum()
        engine.backward(loss)
        engine.step()
    refs = {"engine": weakref.ref(engine), "module": weakref.ref(engine.module),
            "weight": weakref.ref(engine.module[0].weight), "loss": weakref.ref(loss)}
    inst.remove()
    del engine, loss, groups
    _assert_dead(refs)
    assert inst.groups == ()
