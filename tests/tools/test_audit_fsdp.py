"""graphscale.audit on FSDP2 groups, one and two gloo ranks: the audit reads
each backward's gradient at the unsharded parameters (NOTE [ FSDP2's
backward leaves ] in graphscale/_adapters/fsdp.py), before FSDP2 reduce-scatters it.

A model sharded with ``fully_shard`` (GAS 2) feeds an unsharded one (GAS 4)
in one loss.  An exact run passes and its sharded gradients are, all
gathered, the rank average of the plain gradients / 2 (the audit changed
nothing); with the sharded group's pin doubled on purpose the audit fails,
naming the group and the unsharded parameter.  (FSDP2 reduces at every
backward: there is no accumulation window, so no boundary check applies.)
"""
from __future__ import annotations

import copy
import os
from typing import Any

import pytest

from helpers.ranks import finish, rank_results, run_ranks


def _run(wrong: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import graphscale

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    main = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    other = torch.nn.Linear(4, 4)
    plain_main, plain_other = copy.deepcopy(main), copy.deepcopy(other)
    fully_shard(main[0])
    fully_shard(main[2])
    fully_shard(main)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    real_pin = graphscale.Group.pin
    if wrong:
        graphscale.Group.pin = lambda self, scaling=True: real_pin(self, scaling) * (
            2.0 if self.name == "main" else 1.0)
    try:
        groups = graphscale.Group(main, gas=2, name="main"), graphscale.Group(other, gas=4, name="other")
        with graphscale.install(*groups), graphscale.audit(raise_on_error=False) as check:
            other(torch.tanh(main(x))).square().sum().backward()
    finally:
        graphscale.Group.pin = real_pin
    plain_other(torch.tanh(plain_main(x))).square().sum().backward()
    err = 0.0
    for p, q in zip(main.parameters(), plain_main.parameters()):
        want = q.grad.clone()
        dist.all_reduce(want)
        err = max(err, float((p.grad.full_tensor() - want / world / 2).abs().max()))
    return {"ok": check.ok, "mismatched": sorted({(m.group, m.parameter) for m in check.mismatches}),
            "sharded_grad_err": err, "report": str(check)}


def _worker() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = {"exact": _run(False), "wrong": _run(True)}
    finish(out)  # NOT the interpreter's teardown: tests/helpers/ranks.py


def _have_fsdp2() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module", params=[1, 2], ids=["one_rank", "two_ranks"])
def results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    if not _have_fsdp2():
        pytest.skip("torch.distributed.fsdp.fully_shard (FSDP2) is not in this torch")
    return rank_results(run_ranks([os.path.abspath(__file__)], world=request.param))


def test_an_fsdp2_run_passes_the_audit_and_trains_as_without_it(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        got = res["exact"]
        assert got["ok"], f"rank {rank}:\n{got['report']}"
        assert got["sharded_grad_err"] < 1e-6, got


def test_a_wrong_factor_on_an_fsdp2_group_is_caught_at_its_unsharded_parameters(
        results: list[dict[str, Any]]) -> None:
    for res in results:
        got = res["wrong"]
        assert not got["ok"], got
        assert {g for g, _ in got["mismatched"]} == {"main"}, got
        assert all(p.endswith("(unsharded)") for _, p in got["mismatched"]) and len(got["mismatched"]) == 4, got


if __name__ == "__main__":
    _worker()
