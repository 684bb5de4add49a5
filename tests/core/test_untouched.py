"""Touch only what is governed (issue 13), against plain-PyTorch oracles
computed in the same test: the issue's snippet (a Linear in no group, beside
an installed one, gets exactly plain PyTorch's gradient, under every
policy), and mixed graphs: one loss over installed groups and unowned
models.  The default ("plain_params") gives unowned nn.Parameters exactly
their plain gradient; "plain" every unowned leaf; "any" plain x one factor in
play; an input that requires grad may get one factor in play under the
default.  Includes reentrant checkpointing with an unowned module inside the
checkpointed function, and engines (the default against DeepSpeed's
whole-loss division in engine.backward).

The rest of issue 13: test_untouched_bystanders.py (models beside the
installed ones), test_swapped_parameters.py (the wrapper warning) and
test_untouched_reference_model.py (DeepSpeed's reference-model pattern on two
ranks).  Before issue 13 (main at 4a546fe) the fast path multiplied every
backward's seeds by the one factor in play: the snippet gave 0.25.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import graphscale

from helpers.engines import require_deepspeed
from helpers.grads import full_grads, grad_mismatches, leaf_grads, max_rel_err
from helpers.routes import native_route_or_skip
from helpers.untouched import DS_RTOL, POLICIES, Tower, data, grad_of, linear, plain_grads, unequal


# ---------------------------------------------------------------- 1. the issue's snippet
@pytest.mark.parametrize("unowned", POLICIES)
def test_issue_snippet_linear_in_no_group_gets_plain_gradient(unowned: str) -> None:
    a, b = nn.Linear(2, 1), nn.Linear(2, 1)
    oracle = plain_grads(copy.deepcopy(b), lambda m: m(torch.ones(1, 2)).sum())
    assert torch.equal(oracle[0], torch.ones(1, 2))
    with graphscale.install(graphscale.Group(a, gas=4), unowned=unowned):
        b(torch.ones(1, 2)).sum().backward()
        a(torch.ones(1, 2)).sum().backward()  # the installation is live: a gets its 1/4
    assert torch.equal(grad_of(b.weight), oracle[0]), f"b.weight.grad {b.weight.grad}, plain PyTorch {oracle[0]}"
    assert torch.equal(grad_of(b.bias), oracle[1])
    assert torch.equal(grad_of(a.weight), torch.full((1, 2), 0.25))


@pytest.mark.parametrize("unowned", POLICIES)
def test_backward_through_no_parameter_at_all_leaves_its_input_plain(unowned: str) -> None:
    """An input's own gradient (a saliency map, a gradient penalty's first
    backward) reaches no Parameter: plain, even under "any"."""
    a = nn.Linear(2, 1)
    x = torch.tensor([[1.0, -2.0]], requires_grad=True)
    with graphscale.install(graphscale.Group(a, gas=4), unowned=unowned):
        (x * x).sum().backward()
    assert torch.equal(grad_of(x), 2 * x.detach())


def test_autograd_grad_is_torchs_own_while_installed_and_a_scripted_call_stays_plain() -> None:
    """graphscale leaves ``torch.autograd.grad`` alone: while installed it is
    torch's own function (no wrapper, no lock), and TorchScript compiles a
    call of it to ``aten::grad`` with plain PyTorch's result.
    (See NOTE [ Multipliers per graph task ] in _native/hooks.h.)"""
    a = nn.Linear(2, 1)
    x = torch.tensor([[1.0, -2.0]], requires_grad=True)
    before = torch.autograd.grad
    with graphscale.install(graphscale.Group(a, gas=4)):
        assert torch.autograd.grad is before

        @torch.jit.script
        def penalty(y: torch.Tensor, inp: torch.Tensor) -> list[Optional[torch.Tensor]]:
            return torch.autograd.grad([y.sum()], [inp], retain_graph=True)

        got = penalty(x * x * 3.0, x)[0]
        (a(x).sum()).backward()
    assert got is not None and torch.equal(got, 6 * x.detach())
    assert torch.equal(grad_of(a.weight), x.detach() / 4)  # the installed group still governed


# ---------------------------------------------------------------- 3. mixed graphs
@dataclass(frozen=True)
class Mixed:
    """One loss over installed Groups (``gas``: name -> gas) and the unowned
    Linear ``u``; ``x_requires_grad``: the input ``x`` is a leaf that
    requires grad (not a Parameter)."""

    gas: dict[str, int]
    loss: Callable[[dict[str, nn.Module], torch.Tensor, torch.Tensor], torch.Tensor]
    x_requires_grad: bool = False


def _ckpt(fn: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return checkpoint(fn, h, use_reentrant=True)


MIXED: dict[str, Mixed] = {
    "fast/unowned_beside": Mixed({"a": 4}, lambda m, x, y: (m["a"](x) + m["u"](y)).square().sum()),
    "fast/unowned_on_top": Mixed({"a": 4}, lambda m, x, y: m["u"](torch.tanh(m["a"](x))).square().sum()),
    "fast/unowned_below": Mixed({"a": 4}, lambda m, x, y: m["a"](torch.tanh(m["u"](x))).square().sum()),
    "walked/unowned_beside": Mixed({"a": 2, "c": 4},
                                   lambda m, x, y: (m["a"](x) + m["c"](y) + m["u"](y)).square().sum()),
    "walked/unowned_between": Mixed({"a": 2, "c": 4},
                                    lambda m, x, y: m["c"](torch.tanh(m["u"](torch.tanh(m["a"](x))))).square().sum()),
    "fast/input_requires_grad": Mixed({"a": 4}, lambda m, x, y: (m["a"](x) * m["u"](x)).sum(), x_requires_grad=True),
    "walked/input_requires_grad": Mixed({"a": 2, "c": 4},
                                        lambda m, x, y: (m["a"](x) * m["c"](x) + m["u"](x)).sum(),
                                        x_requires_grad=True),
    # NOTE: reentrant checkpoints below: the unowned u is a leaf only of the
    # graph recomputed inside the checkpoint's backward (a nested backward)
    "fast/reentrant_ckpt_unowned_inside": Mixed(
        {"a": 4}, lambda m, x, y: _ckpt(lambda h: m["u"](torch.tanh(h)), m["a"](x)).square().sum()),
    "walked/reentrant_ckpt_unowned_inside": Mixed(
        {"a": 2, "c": 4}, lambda m, x, y: m["c"](_ckpt(lambda h: m["u"](torch.tanh(h)), m["a"](x))).square().sum()),
    "fast/reentrant_ckpt_owned_and_unowned_inside": Mixed(
        {"a": 4, "c": 4}, lambda m, x, y: _ckpt(lambda h: m["c"](torch.tanh(m["u"](h))), m["a"](x)).square().sum()),
    "walked/reentrant_ckpt_owned_and_unowned_inside": Mixed(
        {"a": 2, "c": 4}, lambda m, x, y: _ckpt(lambda h: m["c"](torch.tanh(m["u"](h))), m["a"](x)).square().sum()),
    "fast/reentrant_ckpt_unowned_inside_and_outside": Mixed(
        {"a": 4}, lambda m, x, y: (_ckpt(lambda h: m["u"](torch.tanh(h)), m["a"](x)) + m["u"](y)).square().sum()),
}


def _mixed_run(case: Mixed, seed: int = 3) -> tuple[dict[str, nn.Module], torch.Tensor, torch.Tensor]:
    mods: dict[str, nn.Module] = {n: linear(seed + i) for i, n in enumerate(("a", "c", "u"))}
    x, y = data(31), data(32)
    if case.x_requires_grad:
        x.requires_grad_(True)
    return mods, x, y


@pytest.mark.parametrize("unowned", POLICIES)
@pytest.mark.parametrize("case", list(MIXED))
def test_mixed_graph_unowned_leaves_get_what_the_policy_says(case: str, unowned: str) -> None:
    spec = MIXED[case]
    mods, x, y = _mixed_run(spec)
    ref_mods, ref_x, ref_y = _mixed_run(spec)
    spec.loss(ref_mods, ref_x, ref_y).backward()  # plain PyTorch: nothing installed yet
    plain = leaf_grads({**ref_mods, "x": ref_x} if ref_x.requires_grad else ref_mods)
    groups = [graphscale.Group(mods[n], gas=g, name=n) for n, g in spec.gas.items()]
    with graphscale.install(*groups, unowned=unowned):
        spec.loss(mods, x, y).backward()
    got = leaf_grads({**mods, "x": x} if x.requires_grad else mods)
    factor_of = {k: 1 / spec.gas[k.split(".")[0]] for k in plain if k.split(".")[0] in spec.gas}
    params = {k for k in plain if k.startswith("u.")}
    bad = grad_mismatches(plain, got, factor_of, unowned, params=params)
    assert not bad, "\n".join(bad)
    # u's plain gradient is not zero: a graphscale that scaled it by a factor could not pass
    assert params and all((t := plain[k]) is not None and bool(torch.count_nonzero(t)) for k in params)


@pytest.mark.parametrize("flagged", [True, False])
@pytest.mark.parametrize("gas", [(2,), (2, 4)], ids=["probe", "plan"])
@pytest.mark.parametrize("route", ["native", "python"])
def test_a_tensor_flagged_is_param_is_an_unowned_parameter(route: str, gas: tuple[int, ...], flagged: bool,
                                                           request: pytest.FixtureRequest) -> None:
    """``isinstance(t, nn.Parameter)`` is True for a plain tensor with
    ``_is_param`` set (torch's Parameter metaclass): under the default policy
    such an unowned leaf gets exactly its plain gradient, on both routes, in
    the fast path's probe (one factor) and in a walked plan (two factors).
    Unflagged, the same leaf is an input and takes a factor in play, so the
    test reads the flag (the native walker reads it from the tensor's dict)."""
    from graphscale import observe
    if route == "python":
        request.getfixturevalue("python_route")
    else:
        native_route_or_skip()
    mods = [linear(40 + k) for k in range(len(gas))]
    w = torch.randn(4, 1, generator=torch.Generator().manual_seed(41)).requires_grad_()
    if flagged:
        w._is_param = True  # type: ignore[attr-defined]
    assert isinstance(w, nn.Parameter) is flagged and type(w) is torch.Tensor
    x = data(42)
    plain = 2 * x.sum(0, keepdim=True).T  # d/dw of (x @ w).sum() * 2
    seen: list[str] = []
    with graphscale.install(*(graphscale.Group(m, gas=g) for m, g in zip(mods, gas))):
        with observe.routes(lambda r, reason: seen.append(r)):
            (sum(m(x).sum() for m in mods) + (x @ w).sum() * 2).backward()
    assert seen == [route]
    if flagged:
        assert torch.equal(grad_of(w), plain), f"w.grad {w.grad}, plain {plain}"
    else:
        assert not torch.equal(grad_of(w), plain) and any(torch.allclose(grad_of(w), plain / g) for g in gas)


# engines: unowned u beside an installed engine A (GAS 4), in one loss
ENGINE_MIXED_STYLES = {
    "loss.backward": lambda engine, loss: loss.backward(),
    "engine.backward": lambda engine, loss: engine.backward(loss),
}


@pytest.mark.deepspeed
@require_deepspeed
@pytest.mark.parametrize("style", list(ENGINE_MIXED_STYLES))
def test_engine_beside_unowned_model_default_gives_it_its_plain_gradient(make_engine: Any, style: str) -> None:
    """DeepSpeed >= 0.19.6 alone divides the whole loss of engine.backward by
    GAS, u included (u x 1/4), <= 0.19.5 leaves u alone; graphscale's default:
    exactly plain for u, 1/4 for A's parameters (fast path and probe)."""
    a, u = Tower(1), Tower(2)
    a_ref, u_ref = copy.deepcopy(a), copy.deepcopy(u)
    x, y = data(41), data(42)

    def loss_of(a_fwd: Callable[..., Any], u_mod: nn.Module) -> torch.Tensor:
        return (a_fwd(x) * u_mod(y)).sum()

    want_a = [g / 4 for g in torch.autograd.grad(loss_of(a_ref, u_ref), list(a_ref.parameters()))]
    want_u = list(torch.autograd.grad(loss_of(a_ref, u_ref), list(u_ref.parameters())))
    engine = make_engine(a, gas=4, stage=2)
    engine.set_gradient_accumulation_boundary(True)
    with graphscale.install(engine):
        ENGINE_MIXED_STYLES[style](engine, loss_of(engine, u))
    err = max_rel_err(full_grads(engine), want_a)
    assert err <= DS_RTOL, f"engine's parameters: relative error {err} against plain x 1/4"
    bad = unequal([p.grad for p in u.parameters()], want_u)
    assert not bad, f"unowned u is not its plain gradient: {bad}"
