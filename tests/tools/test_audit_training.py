"""graphscale.audit where users train: DeepSpeed engines at ZeRO 0, 1 and 2, fp32
and bf16, one and two gloo ranks, eight micro-steps with ``step()`` (each
engine's boundaries and the micro-steps between them), both backward styles.

Engines A (GAS 2) and B (GAS 4) in one loss that nests B over A and forwards
A twice.  An exact run must pass every per-backward check and every
reduced-gradient check at a boundary (NOTE [ Audit at the boundary ] in
graphscale/_tools/audit_windows.py); a run made wrong on purpose must fail, naming
the group and parameter: B's pin doubled (graphscale scales B's leaves by
twice their factor: every backward and every boundary of B fails), or B's
accumulated gradient doubled after each backward of the window (every
backward hands the right gradient, the reduction is wrong: only the boundary
check can see it).  ZeRO 3, audited by replay: tests/tools/test_audit_zero3.py.
"""
from __future__ import annotations

import os
from typing import Any

import pytest

from helpers.engines import ds_config, require_deepspeed
from helpers.models import tanh_mlp
from helpers.ranks import finish, rank_results, run_ranks

GAS = {"A": 2, "B": 4}
STEPS = 8
CASES = [f"z{stage}-{dtype}-{call}" for stage in (1, 2) for dtype in ("fp32", "bf16") for call in ("loss", "engine")]
CASES += ["z0-fp32-engine", "z0-bf16-engine"]  # ZeRO 0 refuses a direct loss.backward()
WRONG = ["z1-fp32-loss-pin", "z2-bf16-engine-pin", "z1-fp32-loss-reduction"]


def _engine(name: str, stage: int, bf16: bool) -> Any:
    import deepspeed
    import torch

    net = tanh_mlp(10 + len(name) + ord(name), sequential=True)
    cfg = ds_config(GAS[name], stage, clip=0.0, bf16=bf16)
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.05), config=cfg)
    return engine


def _run(case: str) -> dict[str, Any]:
    import torch

    import graphscale
    from graphscale._adapters.deepspeed import EngineGroup

    stage, dtype, call, *wrong = case.split("-")
    bf16 = dtype == "bf16"
    A, B = _engine("A", int(stage[1]), bf16), _engine("B", int(stage[1]), bf16)
    # ZeRO 0 refuses a backward not called through the engine itself, B's included: A and A.module there
    engines = (A,) if stage == "z0" else (A, B)
    rank = int(os.environ.get("RANK", "0"))
    real_pin = EngineGroup.pin
    if wrong == ["pin"]:  # graphscale made wrong on purpose: B's leaves get twice their factor
        EngineGroup.pin = lambda self, scaling=True: real_pin(self, scaling) * (2.0 if self.engine is B else 1.0)
    def double_accumulated(p: torch.Tensor) -> None:
        p.grad.mul_(2.0)

    handles = []
    if wrong == ["reduction"]:  # the right gradient handed, the accumulated one doubled before B reduces
        handles = [p.register_post_accumulate_grad_hook(double_accumulated) for p in B.module.parameters()]
    try:
        with graphscale.install(*engines), graphscale.audit(raise_on_error=False) as check:
            for k in range(STEPS):
                g = torch.Generator().manual_seed(1000 * k + rank)
                x, y = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
                if bf16:
                    x, y = x.bfloat16(), y.bfloat16()
                if stage == "z0":
                    loss = A(x).float().square().sum() + A.module(y).float().sum()
                else:
                    loss = B(A(x)).float().square().sum() + A(y).float().sum()
                if call == "loss":
                    loss.backward()
                else:
                    A.backward(loss)
                for e in engines:
                    e.step()
    finally:
        EngineGroup.pin = real_pin
        for h in handles:
            h.remove()
    names = {A: "A", B: "B"}
    group_of = {g.name: names[g.engine] for g in map(EngineGroup, engines)}
    return {
        "ok": check.ok, "backwards": check.backwards,
        "mismatched": sorted({group_of.get(m.group, m.group) for m in check.mismatches}),
        "per_backward": len(check.mismatches),
        "reduced": sorted({group_of.get(m.group, m.group) for m in check.reduced_mismatches}),
        "reduced_backwards": sorted({m.backward for m in check.reduced_mismatches}),
        "boundaries": {group_of[n]: c for n, c in check._windows.checked.items()},
        "skipped": dict(check._windows.skipped),
        "report": str(check),
    }


def _worker() -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for case in CASES + WRONG:
        try:
            out[case] = _run(case)
        except Exception as exc:  # reported, not hidden: the test names it
            out[case] = {"error": f"{type(exc).__name__}: {exc}"}
    finish(out)  # NOT the interpreter's teardown: tests/helpers/ranks.py


@pytest.fixture(scope="module", params=[1, 2], ids=["one_rank", "two_ranks"])
def results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return rank_results(run_ranks([os.path.abspath(__file__)], world=request.param, env={"DS_ACCELERATOR": "cpu"}))


pytestmark = [pytest.mark.deepspeed, require_deepspeed]


@pytest.mark.parametrize("case", CASES)
def test_an_exact_run_passes_every_backward_and_every_boundary(results: list[dict[str, Any]], case: str) -> None:
    for rank, res in enumerate(results):
        got = res[case]
        assert "error" not in got, f"rank {rank}: {got}"
        assert got["backwards"] == STEPS and got["ok"], f"rank {rank}:\n{got['report']}"
        # every boundary of each engine in the 8 micro-steps was checked: A at 2, 4, 6, 8; B at 4, 8
        want = {n: STEPS // GAS[n] for n in (("A",) if case.startswith("z0") else ("A", "B"))}
        assert got["boundaries"] == want, got
        assert not got["skipped"], got


@pytest.mark.parametrize("case", WRONG[:2])
def test_a_wrong_factor_fails_every_backward_and_boundary_naming_the_group(results: list[dict[str, Any]],
                                                                          case: str) -> None:
    for rank, res in enumerate(results):
        got = res[case]
        assert "error" not in got, f"rank {rank}: {got}"
        assert not got["ok"] and got["mismatched"] == ["B"] and got["reduced"] == ["B"], f"rank {rank}: {got}"
        assert got["reduced_backwards"] == [4, 8], got
        assert "engine:Sequential" in got["report"] and "parameter '0.weight'" in got["report"]


def test_a_wrong_reduction_with_right_gradients_fails_only_at_the_boundary(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        got = res["z1-fp32-loss-reduction"]
        assert "error" not in got, f"rank {rank}: {got}"
        assert got["per_backward"] == 0 and got["reduced"] == ["B"], f"rank {rank}: {got}"
        assert got["reduced_backwards"] == [4, 8], got


if __name__ == "__main__":
    _worker()
