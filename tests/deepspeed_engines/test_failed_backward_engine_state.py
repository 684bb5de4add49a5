"""Issues 31 and 37 on single engines in this process: what an aborted or
discarded backward leaves in an engine, and when the engine fails closed
(NOTE [ An aborted backward counts for nothing ] in
graphscale/_adapters/deepspeed/failed.py): a step right after a discarded
backward skips the micro-step; an aborted backward that reached an earlier
micro-step's gradient, cannot be discarded, or drained a bucket fails closed
naming the fix; a low-precision engine trains bit for bit like the clean
window; a backward whose DeepSpeed prologue raised retries clean.  Both
halves: test_failed_backward.py (the cases on one and two spawned ranks).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers.engines import ds_config, require_deepspeed
from helpers.workers import failed_backward as fb

# not_where_deepspeed_recovers_itself: the family's conftest.py
pytestmark = [pytest.mark.deepspeed, require_deepspeed,
              pytest.mark.usefixtures("not_where_deepspeed_recovers_itself")]


def _fail_once(engine: Any, net: fb.Net, step: int) -> None:
    """One backward of ``engine`` that raises (``Injected``), caught."""
    net.control["raise"] = True
    try:
        with pytest.raises(fb.Injected) as caught:
            fb._loss(engine(fb._data(0, step, 0))).backward()
    finally:
        net.control["raise"] = False
    return caught.value  # type: ignore[return-value]


def _assert_trained_like_plain(engine: Any, plain: torch.nn.Module, steps: Any) -> None:
    """``engine``'s weights after its window against the clean control: ``plain``
    after one SGD step on the gradients of micro-steps ``steps`` over GAS."""
    from deepspeed.utils import safe_get_full_fp32_param

    for step in steps:
        fb._loss(plain(fb._data(0, step, 1))).backward()
    for p, q in zip(engine.module.parameters(), plain.parameters()):
        want = q.detach() - fb.LR * q.grad / fb.GAS
        torch.testing.assert_close(safe_get_full_fp32_param(p).detach(), want, rtol=fb.WEIGHTS_RTOL, atol=1e-7)


@pytest.mark.parametrize("stage", fb.STAGES, ids=lambda s: f"zero{s}")
def test_step_right_after_a_discarded_backward_skips_the_micro_step(make_engine: Any, stage: int) -> None:
    """NOTE [ An aborted backward counts for nothing ]: graphscale discards the
    attempt when it raises, not at the next forward, so ``step()`` right
    after it (the user skips that micro-step) trains on the window's other
    micro-step alone, exactly (PR 8245's DeepSpeed refuses that step())."""
    import graphscale

    net, plain = fb.models("user_hook", 1)[0], fb.models("user_hook", 1)[0]
    engine = make_engine(net, fb.GAS, stage)
    with graphscale.install(engine):
        _fail_once(engine, net, 0)  # the window's first micro-step fails and is skipped
        engine.step()
        fb._loss(engine(fb._data(0, 1, 1))).backward()
        engine.step()
    _assert_trained_like_plain(engine, plain, [1])


def test_a_zero1_engine_whose_aborted_backward_reached_an_earlier_micro_steps_grad_fails_closed(
        make_engine: Any) -> None:
    """At ZeRO 1 torch adds a backward's gradients onto ``.grad``, which holds
    the window's earlier micro-steps: once an aborted backward reached one,
    the window cannot be made clean, and the engine's forward, step() and
    backward raise, naming the engine, why, and the fix; the user's error
    came out unchanged first.  The engine keeps refusing after remove()."""
    import graphscale

    net = fb.Net("user_hook")
    engine = make_engine(net, fb.GAS, 1)
    handle = graphscale.install(graphscale.Group(engine, name="actor"))
    fb._loss(engine(fb._data(0, 0, 1))).backward()
    engine.step()
    kept = fb._loss(engine(fb._data(0, 1, 2)))  # a graph made before the failure: its backward is refused too
    _fail_once(engine, net, 1)
    expected = r"engine actor \(ZeRO 1\): an aborted backward already contributed to this accumulation window"
    with pytest.raises(graphscale.GraphscaleError, match=expected) as refused:
        engine(fb._data(0, 1, 1))
    assert "build a new one" in str(refused.value) and ".grad" in str(refused.value)
    with pytest.raises(graphscale.GraphscaleError, match=expected):
        engine.step()
    with pytest.raises(graphscale.GraphscaleError, match=expected):
        kept.backward()
    handle.remove()
    with pytest.raises(graphscale.GraphscaleError, match=expected):
        engine.step()


def test_an_engine_whose_aborted_backward_cannot_be_discarded_fails_closed_with_the_fix(
        make_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where discarding the attempt itself raises (here made to, on a real
    ZeRO 2 engine), the user's error still comes out first, carrying that one
    as a note, and the engine fails closed at its next forward and step(),
    not met by an assertion inside DeepSpeed."""
    import graphscale

    net = fb.Net("user_hook")
    engine = make_engine(net, 2, 2)

    def exit_that_raises(self: Any) -> None:
        raise RuntimeError("exit_backward broke")

    with graphscale.install(engine):
        monkeypatch.setattr(type(engine.optimizer), "exit_backward", exit_that_raises)
        error = _fail_once(engine, net, 0)
        monkeypatch.undo()
        assert any("exit_backward broke" in note for note in getattr(error, "__notes__", ())), error
        for call in (lambda: engine(fb._data(0, 0, 1)), engine.step):
            with pytest.raises(graphscale.GraphscaleError, match="ZeRO 2.*discarding it raised RuntimeError"):
                call()


@pytest.mark.parametrize("stage", [2, 3], ids=lambda s: f"zero{s}")
@pytest.mark.parametrize("where", ["user_hook", "after_head"])
def test_a_bucket_drained_during_an_aborted_backward_fails_closed_and_an_undrained_one_retries_clean(
        ds_dist: None, stage: int, where: str) -> None:
    """With a reduction bucket of 4 elements, ZeRO 2 and 3 reduce the head's
    bias into the window's partitioned gradients while the backward is still
    running (before the head's weight joins the bucket): where the backward
    then raises (``user_hook``), that contribution is permanent and the
    engine fails closed at the retry's forward.  Where it raises before any
    of the engine's gradients (``after_head``) nothing drained, and the retry
    trains like the window without the failed attempt."""
    import deepspeed

    import graphscale

    net, plain = fb.models(where, 1)[0], fb.models(where, 1)[0]
    cfg = ds_config(fb.GAS, stage, micro_batch=2, zero={"reduce_bucket_size": 4})
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=fb.LR), config=cfg)
    with graphscale.install(engine):
        _fail_once(engine, net, 0)
        if where == "user_hook":
            with pytest.raises(graphscale.GraphscaleError, match="a reduction bucket was reduced during it"):
                engine(fb._data(0, 0, 1))
            return
        for step in range(fb.GAS):
            fb._loss(engine(fb._data(0, step, 1))).backward()
            engine.step()
    _assert_trained_like_plain(engine, plain, range(fb.GAS))


def _low_precision_window(dtype: str, stage: int, fail_at: int | None) -> Any:
    """One window of a ``dtype`` engine (the failed attempt at ``fail_at``,
    or none): its fp32 weights after ``step()``, or the fail-closed error."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    import graphscale

    net = fb.models("user_hook", 1)[0]
    cfg = ds_config(fb.GAS, stage, micro_batch=2, bf16=dtype == "bf16",
                    fp16={"initial_scale_power": 4} if dtype == "fp16" else None)
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=fb.LR), config=cfg)
    half = torch.bfloat16 if dtype == "bf16" else torch.float16
    with graphscale.install(engine):
        for step in range(fb.GAS):
            if step == fail_at:
                net.control["raise"] = True
                with pytest.raises(fb.Injected):
                    fb._loss(engine(fb._data(0, step, 0).to(half)).float()).backward()
                net.control["raise"] = False
            try:
                fb._loss(engine(fb._data(0, step, 1).to(half)).float()).backward()
            except graphscale.GraphscaleError as refused:
                return str(refused)
            engine.step()
    return [safe_get_full_fp32_param(p).detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", fb.STAGES, ids=lambda s: f"zero{s}")
@pytest.mark.parametrize("fail_at", fb.FAIL_AT, ids=["first", "boundary"])
def test_a_low_precision_engine_after_a_discarded_backward_trains_bit_for_bit_like_the_clean_window(
        ds_dist: None, monkeypatch: pytest.MonkeyPatch, dtype: str, stage: int, fail_at: int) -> None:
    """bf16 and fp16 engines (fp32 gradient accumulation at ZeRO 1, the fp16
    loss scale): the window with a discarded attempt gives the very weights
    of the same engine's window without it; at ZeRO 1 after an earlier
    micro-step the engine fails closed, as in fp32.  fp16 runs on DeepSpeed's
    CPU accelerator with its capability flag forced, as in tests/deepspeed_engines/test_fp16.py."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)
    linear = torch.nn.functional.linear
    try:
        got = _low_precision_window(dtype, stage, fail_at)
        want = _low_precision_window(dtype, stage, None)
    finally:
        torch.nn.functional.linear = linear  # ZeRO-3 replaces it process-wide
    if stage == 1 and fail_at == 1:
        assert isinstance(got, str) and "an aborted backward already contributed" in got, got
        return
    assert not isinstance(got, str), got
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g - w).abs().max()


@pytest.mark.parametrize("stage", fb.STAGES, ids=lambda s: f"zero{s}")
def test_a_backward_whose_deepspeed_prologue_raised_retries_clean_after_an_earlier_micro_step(
        make_engine: Any, monkeypatch: pytest.MonkeyPatch, stage: int) -> None:
    """Where DeepSpeed's own prologue raises (graphscale's compiled-autograd
    refusal raises there too), no gradient of the engine was reached: the
    retry trains like the clean window, at ZeRO 1 too, and the engine does
    not fail closed on a snapshot left from the micro-step before."""
    import graphscale

    net, plain = fb.models("user_hook", 1)[0], fb.models("user_hook", 1)[0]
    engine = make_engine(net, fb.GAS, stage)
    deepspeeds = type(engine)._backward_prologue
    armed = {"raise": False}

    def prologue(self: Any) -> None:
        if armed["raise"]:
            raise fb.Injected("injected: DeepSpeed's prologue")
        deepspeeds(self)

    monkeypatch.setattr(type(engine), "_backward_prologue", prologue)
    with graphscale.install(engine):
        fb._loss(engine(fb._data(0, 0, 1))).backward()
        engine.step()
        armed["raise"] = True
        with pytest.raises(fb.Injected):
            fb._loss(engine(fb._data(0, 1, 0))).backward()
        armed["raise"] = False
        fb._loss(engine(fb._data(0, 1, 1))).backward()
        engine.step()
    _assert_trained_like_plain(engine, plain, range(fb.GAS))
