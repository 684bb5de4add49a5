"""Real DeepSpeed engines (CPU accelerator, gloo, one rank) in every engine mix
of issue 3, each checked against a plain-PyTorch oracle computed in the same
test: copies of the models made before ``deepspeed.initialize``, the same
graph run plainly, each model's gradient times its engine's factor.

Three modes run every shape of ``SHAPES`` (tests/helpers/engine_shapes.py):

* ``graphscale``: installed; every engine's gradient must match the oracle.
* ``deepspeed_alone``: not installed; DeepSpeed must be wrong exactly where
  ``Shape.ds_wrong`` says for this DeepSpeed generation (NOTE [ DeepSpeed's two
  generations ] in graphscale/_adapters/deepspeed/__init__.py), so every shape listed there
  fails without graphscale.  Set ``GRAPHSCALE_DS_REPORT=path`` to append the
  measured errors as JSON lines.
* ``adapter_off``: graphscale governs the engines' modules as plain Groups
  while DeepSpeed keeps dividing; it must be wrong in every shape, so each
  shape also fails with the adapter switched off.

Engines are cheap on CPU but not free, so each test takes engines from a pool
per (ZeRO stage, variant) (tests/helpers/engine_pool.py) and resets gradients
and GAS before each use.  The shapes that need more than one backward, or an
install in the middle: test_shapes_lifecycle.py.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers.engine_pool import generation
from helpers.engine_shapes import SHAPES, Shape, errors, oracle, report, run_deepspeed, shape_cases
from helpers.engines import require_deepspeed

pytestmark = [pytest.mark.deepspeed, require_deepspeed]


# ------------------------------------------------------------------ the tests
@pytest.mark.parametrize("shape, stage, variant", shape_cases(SHAPES))
def test_every_engine_gets_its_own_factor_under_graphscale(pools: Any, shape: Shape, stage: int, variant: str) -> None:
    pool = pools(stage, variant)
    want = oracle(pool, shape)
    got = run_deepspeed(pool, shape, "graphscale")
    errs = errors(got, want, shape)
    assert max(errs.values()) <= pool.tol, f"per-engine max relative error {errs}"
    assert torch.allclose(got.loss, want.loss, rtol=pool.tol, atol=0), "graph differs from the oracle's"
    if shape.call.startswith("engine:"):
        caller = shape.call.split(":")[1]
        expect = got.loss / shape.gas[caller] if shape.scale else got.loss
        assert got.returned is not None and torch.equal(got.returned.detach().float().cpu(), expect.float())


@pytest.mark.parametrize("shape, stage, variant", shape_cases(SHAPES))
def test_deepspeed_alone_is_wrong_exactly_where_documented(pools: Any, shape: Shape, stage: int,
                                                          variant: str) -> None:
    pool = pools(stage, variant)
    want = oracle(pool, shape)
    errs = errors(run_deepspeed(pool, shape, "deepspeed_alone"), want, shape)
    report(f"{shape.id}-z{stage}-{variant}", "deepspeed_alone", errs)
    gen = generation()
    wrong = max(errs.values()) > pool.tol
    assert wrong == shape.ds_wrong[gen], (
        f"DeepSpeed alone ({gen} generation) {'is' if wrong else 'is not'} wrong here, "
        f"per-engine max relative error {errs}")


@pytest.mark.parametrize("shape, stage, variant", shape_cases(SHAPES, lambda s: (2,)))
def test_adapter_is_needed_in_every_shape(pools: Any, shape: Shape, stage: int, variant: str) -> None:
    pool = pools(stage, variant)
    want = oracle(pool, shape)
    errs = errors(run_deepspeed(pool, shape, "adapter_off"), want, shape)
    report(f"{shape.id}-z{stage}-{variant}", "adapter_off", errs)
    assert max(errs.values()) > pool.tol, "governing the modules without the adapter should scale twice"
