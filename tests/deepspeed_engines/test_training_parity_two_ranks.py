"""Training as users run it, on two gloo ranks: micro-steps with
``engine.step()`` after each, weights against the rank-averaged plain-PyTorch
reference, under graphscale and with DeepSpeed alone (one rank and the why:
tests/deepspeed_engines/test_training_parity.py; the harness: tests/helpers/training.py).  This file
is also the worker each rank runs (``python
tests/deepspeed_engines/test_training_parity_two_ranks.py``, spawned by
tests/helpers/ranks.py).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest
import torch

from helpers.engines import require_deepspeed
from helpers.ranks import deepspeed_rank, finish, rank_results, run_ranks
from helpers.training import TWO_RANK_CASES, WORLD, Case, explain, run_case
from helpers.training_alone import deepspeed_alone, generation

pytestmark = [pytest.mark.deepspeed, require_deepspeed]


# ------------------------------------------------------------------ two ranks
def _worker() -> None:
    """Entry point of one spawned rank: every two-rank case, with graphscale and
    with DeepSpeed alone; results as JSON on stdout."""
    rank, world = deepspeed_rank()
    out = {}
    for case in TWO_RANK_CASES:
        for mode in ("graphscale", "deepspeed_alone"):
            t0 = time.perf_counter()
            out[f"{mode}/{case.id}"] = run_case(case, rank, world, govern=mode == "graphscale")
            print(f"{mode}/{case.id}: {out[f'{mode}/{case.id}']['status']} in {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
    out["generation"] = generation()
    torch.distributed.barrier()
    finish(out)  # NOT the interpreter's teardown: tests/helpers/ranks.py


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict[str, Any]]:
    """Every two-rank case, run once for the module by two spawned gloo ranks."""
    return rank_results(run_ranks([os.path.abspath(__file__)], world=WORLD, env={"DS_ACCELERATOR": "cpu"}))


# DeepSpeed before 0.19.8, ZeRO 3, two gloo ranks: runs differ from run to run.
# 0.19.5 (hooks generation): CI saw sum/loss.backward() under graphscale 0.026
# weight-change error once, exact in three other runs; checkpointed/loss.backward()
# with DeepSpeed alone 0.067 once, exact once.  Traced to DeepSpeed 0.19.5 itself:
# rerunning sum/loss.backward() at ZeRO 3 on two gloo ranks (a case DeepSpeed alone
# trains exactly on 0.19.5 otherwise), 3 times per process in 9 processes, DeepSpeed
# alone gave weight-change error 15.1 once and NaN twice in 27 runs, graphscale 0.14
# once (the first run of a process); the same with DeepSpeed's CPU shared-memory
# collective off.  0.19.6 and 0.19.7 (tracker generation), five runs of this file's
# two-rank worker each, counting the ZeRO 3 cases that must be exact: DeepSpeed alone
# wrong in 1/20 (0.19.6: sum/loss.backward() 0.11) and 2/20 (0.19.7:
# checkpointed/loss.backward() 0.28, and 1.8e13), graphscale in 7/110 (0.19.6, some
# NaN) and 3/110 (0.19.7; CI saw sum/loss.backward() 0.124 and one_engine_twice 0.079
# in one run).  0.19.8: 0/20 and 0/110 in the same five runs, and exact in every CI
# run.  Skipped there, not pinned.
ZERO3_FLAKY_BEFORE = (0, 19, 8)
ZERO3_HOOKS_FLAKY = ("DeepSpeed before 0.19.8, ZeRO 3 on two gloo ranks, is not reproducible from run to run here: "
                     "DeepSpeed alone gives wrong and NaN weights in some runs of an otherwise exact case "
                     "(see the comment at ZERO3_HOOKS_FLAKY); 0.19.8 is exact in every run")


def _skip_flaky(results: list[dict[str, Any]], case: Case) -> None:
    import deepspeed

    release = tuple(int(n) for n in deepspeed.__version__.split("+")[0].split(".")[:3])
    if case.stage == 3 and release < ZERO3_FLAKY_BEFORE:
        pytest.skip(ZERO3_HOOKS_FLAKY)


@pytest.mark.multirank
@pytest.mark.parametrize("case", TWO_RANK_CASES, ids=lambda c: c.id)
def test_two_rank_training_under_graphscale_matches_the_rank_averaged_reference(
        two_rank_results: list[dict[str, Any]], case: Case) -> None:
    _skip_flaky(two_rank_results, case)
    bad = [f"rank {r}: " + explain(case, res[f"graphscale/{case.id}"])
           for r, res in enumerate(two_rank_results) if res[f"graphscale/{case.id}"]["status"] != "exact"]
    assert not bad, "\n".join(bad)


@pytest.mark.multirank
@pytest.mark.parametrize("case", TWO_RANK_CASES, ids=lambda c: c.id)
def test_two_rank_training_with_deepspeed_alone_is_as_documented(
        two_rank_results: list[dict[str, Any]], case: Case) -> None:
    _skip_flaky(two_rank_results, case)
    want = deepspeed_alone(case, two_rank_results[0]["generation"], world=WORLD)
    bad = [f"rank {r}: want {want}; " + explain(case, res[f"deepspeed_alone/{case.id}"])
           for r, res in enumerate(two_rank_results)
           if res[f"deepspeed_alone/{case.id}"]["status"] not in want.split(" or ")]
    assert not bad, "\n".join(bad)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _worker()
