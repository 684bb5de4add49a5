"""A factor callable is read once, at the start of every backward (factors
beyond 1/GAS, issue 10 item 4; tests/helpers/factors.py): changed between
backwards, each backward uses the value it read at its start; changed in the
middle of one, on the fast path, a walked plan or inside a nested backward,
the running backward keeps the value it read.
"""
from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

import graphscale

from helpers.factors import F64_RTOL, Net, Reads, inputs
from helpers.grads import grad_mismatches, leaf_grads


# Each path returns (loss, out): the backward's root and the tensor whose hook
# changes the factor in the middle of the backward, before a's nodes run.
def _fast_path(a: Net, b: Net, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = a(x) + a.sub(x)  # one group: the seed is scaled, nothing walked
    return out.square().sum(), out


def _walked(a: Net, b: Net, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = a(x)  # two factors: walked and planned
    return (out + b(x)).square().sum(), out


def _nested_reentrant_checkpoint(a: Net, b: Net, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a inside reentrant checkpointing on b's output: a's leaves are reached
    by a nested backward, which starts after the hook on ``out`` has run."""
    import torch.utils.checkpoint as tc

    out = tc.checkpoint(a, b(x), use_reentrant=True)
    return out.square().sum(), out


# path -> (b is a group, the graph)
PATHS: dict[str, tuple[bool, Callable[[Net, Net, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]]] = {
    "fast_path": (False, _fast_path),
    "walked": (True, _walked),
    "nested_reentrant_checkpoint": (True, _nested_reentrant_checkpoint),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_a_factor_callable_is_read_once_at_the_start_of_every_backward(path: str) -> None:
    """Changed between backwards, each backward uses the value it read at
    its start; changed in the middle of a backward (from a tensor hook that
    runs before the group's nodes, and before a nested backward begins), the
    running backward still uses the value read at its start."""
    uses_b, build = PATHS[path]
    a, b = Net(1), Net(2)
    x, _ = inputs()
    ref = {"a": copy.deepcopy(a), "b": copy.deepcopy(b)}
    loss, _ = build(ref["a"], ref["b"], x)
    loss.backward()
    plain = leaf_grads(ref)
    read = Reads(0.5)
    groups = [graphscale.Group(a, factor=read, name="a")] + ([graphscale.Group(b, gas=4, name="b")] if uses_b else [])
    models = {"a": a, "b": b}
    before = leaf_grads(models)
    with graphscale.install(*groups):
        for k, value in enumerate([0.5, 3.0, 0.125]):
            read.value = value

            def change_mid_backward(grad: torch.Tensor) -> None:
                read.value = 1000.0  # too late for this backward

            loss, out = build(a, b, x)
            out.register_hook(change_mid_backward)
            loss.backward()
            assert read.value == 1000.0, "the hook did not run"
            assert read.calls == k + 1, f"the callable was read {read.calls} times in {k + 1} backward(s)"
            after = leaf_grads(models)
            delta = {n: None if g is None else g - (0 if before[n] is None else before[n])  # type: ignore[operator]
                     for n, g in after.items()}
            factor_of = {n: value if n.startswith("a.") else 0.25 for n in plain if n.startswith("a.") or uses_b}
            bad = grad_mismatches({n: plain[n] for n in factor_of}, {n: delta[n] for n in factor_of}, factor_of,
                                  "plain", rtol=F64_RTOL)
            assert not bad, f"backward {k} (factor {value}):\n" + "\n".join(bad)
            before = after
