"""Every graph shape of issue 2, item 4, against a plain-PyTorch oracle.

Each case runs the same program twice from the same seed: once plain, once
with graphscale installed.  Owned leaves must get exactly ``plain / gas`` of
their group; unowned leaves exactly ``plain`` under ``unowned="plain"`` and
``plain`` times one factor in play under ``"any"`` (see ``grad_mismatches``).
Every case also checks that the plain gradients themselves would fail that
comparison, so a graphscale that did nothing could not pass.

The plain world the programs run in: tests/helpers/worlds.py.  Beside the
shapes: create_graph, a callable GAS (test_shapes_per_backward.py); the walk's
size and the multiplications it places (test_walk_once.py).
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils.checkpoint import checkpoint

from helpers.functions import BackwardThrough, Cube, Recompute
from helpers.worlds import D, Program, World, run_plain_and_governed


# ---------------------------------------------------------------- custom Functions
# ---------------------------------------------------------------- the shapes
def sum_of_groups(w: World) -> None:
    (w.g[0](w.x) + w.g[1](w.x)).sum().backward()


def product_of_groups(w: World) -> None:
    (w.g[0](w.x) * w.g[1](w.x)).sum().backward()


def sum_and_product_of_three(w: World) -> None:
    (w.g[0](w.x) * w.g[1](w.x) + w.g[2](w.y)).sum().backward()


def nested(w: World) -> None:
    w.g[0](w.g[1](w.x)).sum().backward()


def nested_three_deep_with_skip(w: World) -> None:
    h = w.g[2](w.x)
    (w.g[0](w.g[1](h) + h)).sum().backward()


def submodule_called_directly(w: World) -> None:
    (w.g[0](w.x) + w.g[0].sub(w.y)).sum().backward()


def submodule_called_directly_next_to_other_group(w: World) -> None:
    (w.g[0](w.x) + w.g[0].sub(w.y) * w.g[1](w.y)).sum().backward()


def shared_upstream_tensor(w: World) -> None:
    h = torch.tanh(w.pre(w.x))
    (w.g[0](h) + w.g[1](h) * w.g[2](h)).sum().backward()


def shared_unowned_parameter(w: World) -> None:
    (w.g[0](w.x @ w.w) + w.g[1](w.y @ w.w.t())).sum().backward()


def detach(w: World) -> None:
    h = w.g[0](w.x)
    (h + w.g[1](h.detach()) + w.g[2](w.g[1](w.y).detach())).sum().backward()


def checkpoint_reentrant(w: World) -> None:
    h = w.pre(w.x)
    out = w.g[0](checkpoint(w.g[1], h, use_reentrant=True))
    (out + checkpoint(w.g[2], w.g[0](w.y), use_reentrant=True)).sum().backward()


def checkpoint_reentrant_with_unowned_inside(w: World) -> None:
    def seg(h: torch.Tensor) -> torch.Tensor:
        return w.g[1](w.pre(h) @ w.w)

    (w.g[0](checkpoint(seg, w.x, use_reentrant=True)) + w.pre(w.y) @ w.w).sum().backward()


def checkpoint_reentrant_unowned_shared_across_regions(w: World) -> None:
    """``pre`` is used inside a checkpoint below g0 and outside it below g1."""

    def seg(h: torch.Tensor) -> torch.Tensor:
        return w.g[1](w.pre(h) @ w.w)

    (w.g[0](checkpoint(seg, w.x, use_reentrant=True)) + w.g[1](w.pre(w.y) @ w.w)).sum().backward()


def checkpoint_reentrant_in_two_regions(w: World) -> None:
    """The same unowned layer checkpointed below g0 and below g1."""
    a = w.g[0](checkpoint(w.pre, w.x, use_reentrant=True))
    b = w.g[1](checkpoint(w.pre, w.y, use_reentrant=True))
    (a + b).sum().backward()


def checkpoint_non_reentrant(w: World) -> None:
    h = w.pre(w.x)
    out = w.g[0](checkpoint(w.g[1], h, use_reentrant=False))
    (out + checkpoint(w.g[2], w.g[0](w.y), use_reentrant=False)).sum().backward()


def custom_function(w: World) -> None:
    (w.g[0](Cube.apply(w.g[1](w.x))) + Cube.apply(w.g[0](w.y))).sum().backward()


def custom_function_nested_backward(w: World) -> None:
    (w.g[0](Recompute.apply(w.g[1](w.x), w.g[2], 1.0, True)) + w.g[1](w.y)).sum().backward()


def custom_function_nested_backward_scaled_seed(w: World) -> None:
    h = Recompute.apply(w.pre(w.x), w.g[1], 2.0, True)
    (w.g[0](h) + Recompute.apply(w.g[0](w.y), w.pre, 2.0, True)).sum().backward()


def custom_function_backward_through_enclosing_graph(w: World) -> None:
    u = w.pre(w.x)
    h = w.g[1](u)
    (w.g[0](BackwardThrough.apply(h, h)) + w.g[2](u)).sum().backward()


def several_roots(w: World) -> None:
    torch.autograd.backward([w.g[0](w.x).sum(), (w.g[1](w.x) * w.g[0](w.y)).sum(), w.g[1](w.y).mean()])


def non_scalar_roots_with_grad_tensors(w: World) -> None:
    a, b = w.g[0](w.x), w.g[1](w.g[0](w.y))
    torch.autograd.backward([a, b], [w.randn(*a.shape), w.randn(*b.shape)])


def roots_seeds_and_inputs_as_generators(w: World) -> None:
    a, b = w.g[0](w.x), w.g[1](w.g[0](w.y))
    seeds = [w.randn(*a.shape), w.randn(*b.shape)]
    inputs = [w.g[0].inp.weight, w.g[1].sub.bias, w.g[1].inp.weight, w.x]
    torch.autograd.backward((r for r in (a, b)), (s for s in seeds), inputs=(t for t in inputs))


def inputs_leaves(w: World) -> None:
    loss = (w.g[0](w.x) + w.g[1](w.x)).sum()
    torch.autograd.backward(loss, inputs=[w.g[0].inp.weight, w.g[1].sub.bias, w.x])


def inputs_non_leaf(w: World) -> dict[str, torch.Tensor]:
    h = w.pre(w.x)
    loss = (w.g[0](h) * w.g[1](h)).sum()
    torch.autograd.backward(loss, inputs=[h, w.g[1].inp.weight])
    return {"h(non-leaf input)": h}


def retained_graph_second_backward(w: World) -> None:
    loss = (w.g[0](w.g[1](w.x)) + w.g[1](w.y)).sum()
    loss.backward(retain_graph=True)
    loss.backward()


def root_is_a_leaf(w: World) -> None:
    loss = (w.g[0](w.x) + w.g[1](w.x)).sum()
    bias = w.g[1].sub.bias
    torch.autograd.backward([loss, bias, w.y], [None, w.randn(*bias.shape), w.randn(*w.y.shape)])


def root_is_only_a_leaf(w: World) -> None:
    torch.autograd.backward([w.g[0].sub.weight, w.g[1].inp.bias], [w.randn(D, D), w.randn(D)])


def gradient_edge_root(w: World) -> None:
    a = w.g[0](w.x) + w.g[1](w.x)
    torch.autograd.backward(get_gradient_edge(a), w.randn(*a.shape))


def gradient_edge_root_implicit_seed(w: World) -> None:
    loss = (w.g[0](w.x) * w.g[1](w.y)).sum()
    torch.autograd.backward(get_gradient_edge(loss))


def _torch_takes(call: Callable[[torch.Tensor], None]) -> bool:
    """Whether this torch's own torch.autograd.backward accepts a call form."""
    try:
        call(torch.ones(2, requires_grad=True).mul(2).sum())
        return True
    except (TypeError, AssertionError, RuntimeError):
        return False


NEEDS_BARE_EDGE = pytest.mark.skipif(
    not _torch_takes(lambda t: torch.autograd.backward(get_gradient_edge(t))),
    reason="this torch's torch.autograd.backward takes no bare GradientEdge root (2.6 does not, 2.13 does)")


NEEDS_GENERATORS = pytest.mark.skipif(
    not _torch_takes(lambda t: torch.autograd.backward((r for r in [t]), inputs=(i for i in [t]))),
    reason="this torch's torch.autograd.backward takes no generators (2.6 does not, 2.13 does)")


CASES = [
    pytest.param(sum_of_groups, (2, 4), id="sum_of_groups"),
    pytest.param(product_of_groups, (2, 4), id="product_of_groups"),
    pytest.param(sum_and_product_of_three, (2, 4, 3), id="sum_and_product_of_three"),
    pytest.param(nested, (2, 4), id="nested"),
    pytest.param(nested, (4, 1), id="nested_inner_gas_1"),
    pytest.param(nested_three_deep_with_skip, (2, 4, 8), id="nested_three_deep_with_skip"),
    pytest.param(submodule_called_directly, (2,), id="submodule_called_directly"),
    pytest.param(submodule_called_directly_next_to_other_group, (2, 4),
                 id="submodule_called_directly_next_to_other_group"),
    pytest.param(shared_upstream_tensor, (2, 4, 8), id="shared_upstream_tensor"),
    pytest.param(shared_unowned_parameter, (2, 4), id="shared_unowned_parameter"),
    pytest.param(detach, (2, 4, 3), id="detach"),
    pytest.param(checkpoint_reentrant, (2, 4, 8), id="checkpoint_reentrant"),
    pytest.param(checkpoint_reentrant_with_unowned_inside, (2, 4),
                 id="checkpoint_reentrant_with_unowned_inside"),
    pytest.param(checkpoint_reentrant_unowned_shared_across_regions, (2, 4),
                 id="checkpoint_reentrant_unowned_shared_across_regions"),
    pytest.param(checkpoint_reentrant_in_two_regions, (2, 4), id="checkpoint_reentrant_in_two_regions"),
    pytest.param(checkpoint_non_reentrant, (2, 4, 8), id="checkpoint_non_reentrant"),
    pytest.param(custom_function, (2, 4), id="custom_function"),
    pytest.param(custom_function_nested_backward, (2, 4, 8), id="custom_function_nested_backward"),
    pytest.param(custom_function_nested_backward_scaled_seed, (2, 4),
                 id="custom_function_nested_backward_seeded_with_2_grad"),
    pytest.param(custom_function_backward_through_enclosing_graph, (2, 4, 8),
                 id="custom_function_nested_backward_through_enclosing_graph"),
    pytest.param(several_roots, (2, 4), id="several_roots"),
    pytest.param(non_scalar_roots_with_grad_tensors, (2, 4), id="non_scalar_roots_with_grad_tensors"),
    pytest.param(inputs_leaves, (2, 4), id="inputs_leaves"),
    pytest.param(roots_seeds_and_inputs_as_generators, (2, 4), id="roots_seeds_and_inputs_as_generators",
                 marks=NEEDS_GENERATORS),
    pytest.param(roots_seeds_and_inputs_as_generators, (4, 4), id="roots_seeds_and_inputs_as_generators_fast_path",
                 marks=NEEDS_GENERATORS),
    pytest.param(inputs_non_leaf, (2, 4), id="inputs_non_leaf"),
    pytest.param(retained_graph_second_backward, (2, 4), id="retained_graph_second_backward"),
    pytest.param(root_is_a_leaf, (2, 4), id="root_is_a_leaf"),
    pytest.param(root_is_only_a_leaf, (2, 4), id="root_is_only_a_leaf"),
    pytest.param(root_is_only_a_leaf, (4, 4), id="root_is_only_a_leaf_fast_path"),
    pytest.param(gradient_edge_root, (2, 4), id="gradient_edge_root", marks=NEEDS_BARE_EDGE),
    pytest.param(gradient_edge_root_implicit_seed, (2, 4), id="gradient_edge_root_implicit_seed",
                 marks=NEEDS_BARE_EDGE),
    pytest.param(gradient_edge_root_implicit_seed, (4, 4), id="gradient_edge_root_implicit_seed_fast_path",
                 marks=NEEDS_BARE_EDGE),
]


@pytest.mark.parametrize("unowned", ["any", "plain_params", "plain"])
@pytest.mark.parametrize("program, gas", CASES)
def test_shape_matches_plain_oracle_scaled_per_group(program: Program, gas: tuple[int, ...], unowned: str) -> None:
    run_plain_and_governed(program, gas, unowned)
