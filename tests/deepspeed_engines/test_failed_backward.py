"""Issues 31 and 37: a governed backward that raised counts for nothing: the
retry is clean, or the engine fails closed (NOTE [ A backward that raised ]
in graphscale/_backward/frames.py, NOTE [ An aborted backward counts for
nothing ] in graphscale/_adapters/deepspeed/failed.py).

tests/helpers/workers/failed_backward.py runs each case on real engines, once on one rank
and once on two gloo ranks: one accumulation window of two micro-steps in
which one backward raises (in a checkpoint's recompute, reentrant or not, in
a module's backward, in a user's tensor hook, or right after the engine's
part began), the user retries that micro-step, and training goes on with
``step()``; the weights after the window are checked against a clean
control, plain PyTorch's window without the failed attempt.  DeepSpeed
alone runs every case too, and what it does is pinned below, measured on
0.19.5 and 0.19.8.

Before issue 31 (main at 34614b3), with graphscale installed, every ZeRO 2
and ZeRO 3 case failed in the retry (ZeRO 2: "The parameter head.bias has
already been reduced"; ZeRO 3: the duplicate ds_id assertion in
``__reduce_and_partition_ipg_grads``), as DeepSpeed alone does.  Before
issue 37 (main at 036ca8d) graphscale ran the failed backward's epilogue,
so what it had reached counted: every case that reached a gradient was off
against the clean control (weights 2-10 % off), with no error.

Single engines in this process, what a discarded or aborted backward leaves
behind and when the engine fails closed: test_failed_backward_engine_state.py.
"""
from __future__ import annotations

from typing import Any

import pytest

from helpers.engines import HAVE_DEEPSPEED, require_deepspeed
from helpers.paths import WORKERS
from helpers.ranks import rank_results, run_ranks
from helpers.workers import failed_backward as fb

# not_where_deepspeed_recovers_itself: the family's conftest.py
pytestmark = [pytest.mark.deepspeed, require_deepspeed,
              pytest.mark.usefixtures("not_where_deepspeed_recovers_itself")]


WORKER = str(WORKERS / "failed_backward.py")


def _run(world: int) -> list[dict[str, Any]]:
    if not HAVE_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    return rank_results(run_ranks([WORKER], world=world, env={"DS_ACCELERATOR": "cpu"}))


@pytest.fixture(scope="module")
def one_rank() -> list[dict[str, Any]]:
    """Every case on one rank (one spawned process)."""
    return _run(1)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """Every case on two gloo ranks."""
    return _run(2)


def generation() -> str:
    """'tracker' for DeepSpeed >= 0.19.6 (PR 8245), 'hooks' before it."""
    import deepspeed.runtime.engine as eng

    return "tracker" if hasattr(eng, "_ENGINE_BACKWARD_GRAPH_TRACKER") else "hooks"


def status(result: dict[str, Any]) -> str:
    """"exact", "wrong", "fails closed at <call>" (the engine's forward,
    backward or step() raised that an aborted backward already contributed
    to the window), "refused" (graphscale refused the retry with a
    GraphscaleError), "retry raises" (a backward after the failed one
    raised), "step raises", or "did not raise" (the injected error never
    came: the case tests nothing)."""
    if "error" in result:
        if "aborted backward already contributed" in result["error"]:
            return f"fails closed at {result['at']}"
        if "GraphscaleError" in result["error"]:
            return "refused"
        return "step raises" if result["error"].startswith("step()") else "retry raises"
    if result.get("raised") != 1:
        return "did not raise"
    return "exact" if result["weights"] <= fb.WEIGHTS_RTOL else "wrong"


def deepspeed_alone(stage: int, style: str, where: str, fail_at: int, gen: str) -> str:
    """What DeepSpeed alone does after a failed backward, as measured.

    The failed backward leaves ZeRO's backward depth at 1 and, at ZeRO 2 and 3,
    the gradients it reached (the head's two) in the reduction bucket, with
    the engine's post-backward epilogue never run (test below).  Then:

    * a retry through ``engine.backward`` runs the epilogue and meets the
      stale bucket at ZeRO 2 and 3 (the retry raises); ZeRO 1 has no bucket,
      and the failed backward's reached gradients count (wrong against the
      clean control); where it reached none (``after_head``) the retry is
      exact at every stage (0.19.5: but over the retained graph at ZeRO 2
      and 3, which raises);
    * on the tracker generation (>= 0.19.6) a direct ``loss.backward()`` retry
      skips its epilogue (the depth guard sees 2: "an interrupted
      engine.backward"), so nothing is reduced and ``step()`` raises (KeyError
      0, or ZeRO 3 at the boundary: "unknown parameter type"); on the hooks
      generation it runs the epilogue like ``engine.backward``, except after a
      failed ``engine.backward`` ("mixed"): 0.19.5 leaves the engine's
      ``_running_engine_backward`` True when its backward raises, so the
      direct retry's post-backward hook skips the epilogue, and ``step()``
      raises the same way.

    A retry over the failed backward's retained graph (``retained``, no new
    forward) queues no epilogue (the callback mark stays from the failed
    backward) on the tracker generation: ``step()`` raises at every stage; on
    the hooks generation it does so where the failure was at the boundary
    micro-step, and is like ``loss.backward`` at the first (measured, not
    traced further).
    """
    if style == "mixed" or (gen == "tracker" and style in ("loss.backward", "retained")):
        return "step raises"
    if style == "retained" and fail_at == 1:
        return "step raises"
    if where == "after_head" and (stage == 1 or style != "retained"):
        return "exact"
    return "wrong" if stage == 1 else "retry raises"


def graphscale_does(stage: int, style: str, where: str, fail_at: int, engines: int = 1) -> str:
    """Exact against the clean control (the failed attempt discarded), but:
    at ZeRO 1, after an earlier micro-step of the window, a failed backward
    that reached one of an engine's gradients added it onto that micro-step's
    ``.grad`` for good, so the engine fails closed at the retry's forward (or
    at the retry's backward over the retained graph); and ZeRO 3 cannot run a
    second backward over a graph whose backward ran, so graphscale refuses
    that retry with the fix (retry with a new forward), unless the failed
    backward reached none of the engine's gradients (``after_head``: the
    engine's backward never began; exact, issue 50)."""
    if (stage, style) == (3, "retained") and where != "after_head":
        return "refused"
    reached = where != "after_head" or engines == 2  # (with two engines the critic's gradients come first)
    if stage == 1 and fail_at == 1 and reached:
        return "fails closed at backward" if style == "retained" else "fails closed at forward"
    return "exact"


CASES = [(stage, style, where, fail_at) for stage in fb.STAGES for style in fb.STYLES for where in fb.WHERES
         for fail_at in fb.FAIL_AT]


def _id(case: tuple[int, str, str, int]) -> str:
    stage, style, where, fail_at = case
    return f"zero{stage}-{style}-{where}-{'boundary' if fail_at else 'first'}"


def _key(case: tuple[int, str, str, int], mode: str) -> str:
    stage, style, where, fail_at = case
    return f"{stage}/{style}/{where}/{fail_at}/{mode}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_one_rank_retry_after_a_failed_backward_trains_like_a_window_without_it_or_fails_closed(
        one_rank: list[dict[str, Any]], case: tuple[int, str, str, int]) -> None:
    result = one_rank[0][_key(case, "graphscale")]
    assert status(result) == graphscale_does(*case[:4]), result


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_two_rank_retry_after_a_failed_backward_trains_like_a_window_without_it_or_fails_closed(
        two_ranks: list[dict[str, Any]], case: tuple[int, str, str, int]) -> None:
    bad = [f"rank {r}: {res[_key(case, 'graphscale')]}" for r, res in enumerate(two_ranks)
           if status(res[_key(case, "graphscale")]) != graphscale_does(*case[:4])]
    assert not bad, "\n".join(bad)


TWO_ENGINE_CASES = [(stage, style, where, fail_at) for stage in fb.STAGES for style in fb.STYLES[:2]
                    for where in fb.TWO_ENGINE_WHERES for fail_at in fb.FAIL_AT]


@pytest.mark.parametrize("world", [1, 2], ids=["one_rank", "two_ranks"])
@pytest.mark.parametrize("case", TWO_ENGINE_CASES, ids=_id)
def test_an_actor_and_critic_after_a_failed_backward_each_retry_clean_or_fail_closed(
        one_rank: list[dict[str, Any]], two_ranks: list[dict[str, Any]], case: tuple[int, str, str, int],
        world: int) -> None:
    """Each engine's part of the failed backward is discarded, or that engine
    fails closed, on its own (the critic's gradients were reached, then the
    actor raised), in one loss."""
    results = one_rank if world == 1 else two_ranks
    key = _key(case, "graphscale") + "/two_engines"
    want = graphscale_does(*case[:4], engines=2)
    bad = [f"rank {r}: {res[key]}" for r, res in enumerate(results) if status(res[key]) != want]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_deepspeed_alone_after_a_failed_backward_is_as_documented(
        one_rank: list[dict[str, Any]], case: tuple[int, str, str, int]) -> None:
    result = one_rank[0][_key(case, "deepspeed_alone")]
    want = deepspeed_alone(*case, generation())
    assert status(result) == want, f"want {want}: {result}"


@pytest.mark.parametrize("stage", fb.STAGES, ids=lambda s: f"zero{s}")
@pytest.mark.parametrize("style", ["engine.backward", "loss.backward"])
@pytest.mark.parametrize("where", fb.WHERES)
@pytest.mark.parametrize("mode", fb.MODES)
def test_what_a_failed_backward_leaves_in_the_engine(one_rank: list[dict[str, Any]], stage: int, style: str,
                                                     where: str, mode: str) -> None:
    """Right after the failed backward: DeepSpeed alone keeps its backward
    depth at 1 and, at ZeRO 2 and 3, the head's two gradients in the
    reduction bucket (none where it reached none), and its post-backward
    callback marked queued though torch dropped it (the next forward clears
    the mark); under graphscale the attempt is discarded: depth 0, the bucket
    empty, the mark cleared (a retry over the retained graph queues its own)."""
    got = one_rank[0][f"{stage}/{style}/{where}/left_behind/{mode}"]
    if mode == "deepspeed_alone":
        want = {"depth": 1, "callback_queued": True, "bucket_params": 0 if stage == 1 or where == "after_head" else 2}
    else:
        want = {"depth": 0, "callback_queued": False, "bucket_params": 0}
    assert {k: got.get(k) for k in want} == want, got
