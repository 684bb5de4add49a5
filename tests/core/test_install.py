"""The install handle and the registry: context manager, idempotent remove,
installations that add up, and torch restored exactly by the last removal."""
from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import graphscale
from graphscale._core import snapshot as _snapshot
from graphscale._entry import entry as _backward

from helpers.engines import require_deepspeed
from helpers.grads import grad_mismatches, leaf_grads

TORCH_BACKWARD = torch.autograd.backward  # as torch shipped it, read before any install


def _setup() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(3, 3, dtype=torch.float64), nn.Linear(3, 3, dtype=torch.float64), torch.randn(
        2, 3, dtype=torch.float64
    )


def _zero(*mods: nn.Module) -> None:
    for m in mods:
        m.zero_grad(set_to_none=True)


def _plain(a: nn.Module, b: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor | None]:
    (a(x) * b(x)).sum().backward()
    out = leaf_grads({"m0": a, "m1": b})
    _zero(a, b)
    return out


def _factors(a_factor: float | None, b_factor: float | None) -> dict[str, float]:
    out = {}
    for i, f in enumerate((a_factor, b_factor)):
        if f is not None:
            out[f"m{i}.weight"] = out[f"m{i}.bias"] = f
    return out


def test_handle_is_a_context_manager_that_governs_inside_and_restores_after() -> None:
    a, b, x = _setup()
    plain = _plain(a, b, x)
    with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4)) as handle:
        assert isinstance(handle, graphscale.Installation) and handle.active
        assert _backward.patched()  # the Python entry, or the native front
        (a(x) * b(x)).sum().backward()
    assert not handle.active
    assert torch.autograd.backward is TORCH_BACKWARD
    bad = grad_mismatches(plain, leaf_grads({"m0": a, "m1": b}), _factors(0.5, 0.25), "plain")
    assert not bad, "\n  ".join(bad)


def test_remove_is_idempotent_and_restores_torch_backward_exactly() -> None:
    a, b, x = _setup()
    plain = _plain(a, b, x)
    handle = graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4))
    handle.remove()
    handle.remove()
    with handle:  # entering/leaving a removed handle is harmless too
        pass
    assert torch.autograd.backward is TORCH_BACKWARD
    assert handle.groups == () and "removed" in repr(handle)
    (a(x) * b(x)).sum().backward()  # ungoverned again: plain gradients
    bad = grad_mismatches(plain, leaf_grads({"m0": a, "m1": b}), {}, "plain")
    assert not bad, "\n  ".join(bad)


def test_several_installations_add_up_and_removing_one_leaves_the_others_working() -> None:
    a, b, x = _setup()
    plain = _plain(a, b, x)
    ha = graphscale.install(graphscale.Group(a, gas=2), unowned="plain")
    hb = graphscale.install(graphscale.Group(b, gas=4), unowned="plain")
    try:
        (a(x) * b(x)).sum().backward()
        bad = grad_mismatches(plain, leaf_grads({"m0": a, "m1": b}), _factors(0.5, 0.25), "plain")
        assert not bad, "both installations should apply:\n  " + "\n  ".join(bad)
        _zero(a, b)

        ha.remove()
        assert _backward.patched()  # the Python entry, or the native front
        (a(x) * b(x)).sum().backward()
        bad = grad_mismatches(plain, leaf_grads({"m0": a, "m1": b}), _factors(None, 0.25), "plain")
        assert not bad, "after removing a's installation, b alone:\n  " + "\n  ".join(bad)
        _zero(a, b)
    finally:
        ha.remove()
        hb.remove()
    assert torch.autograd.backward is TORCH_BACKWARD
    (a(x) * b(x)).sum().backward()
    bad = grad_mismatches(plain, leaf_grads({"m0": a, "m1": b}), {}, "plain")
    assert not bad, "after the last removal, plain PyTorch:\n  " + "\n  ".join(bad)


def test_nested_context_managers_restore_the_outer_installation() -> None:
    a, b, x = _setup()
    plain = _plain(a, b, x)
    with graphscale.install(graphscale.Group(a, gas=2), unowned="plain"):
        with graphscale.install(graphscale.Group(b, gas=8)):
            (a(x) * b(x)).sum().backward()
            bad = grad_mismatches(plain, leaf_grads({"m0": a, "m1": b}), _factors(0.5, 0.125), "plain")  # "plain" wins
            assert not bad, "\n  ".join(bad)
            _zero(a, b)
        (a(x) * b(x)).sum().backward()
        bad = grad_mismatches(plain, leaf_grads({"m0": a, "m1": b}), _factors(0.5, None), "plain")
        assert not bad, "\n  ".join(bad)
    assert torch.autograd.backward is TORCH_BACKWARD


def test_removing_in_another_order_than_installed_restores_torch() -> None:
    a, b, _ = _setup()
    first = graphscale.install(graphscale.Group(a, gas=2))
    second = graphscale.install(graphscale.Group(b, gas=3))
    first.remove()
    assert _backward.patched()  # the Python entry, or the native front
    second.remove()
    assert torch.autograd.backward is TORCH_BACKWARD
    assert _snapshot.current() is None


def test_removed_handle_keeps_no_reference_to_modules_or_parameters() -> None:
    a, b, x = _setup()
    handle = graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4))
    (a(x) * b(x)).sum().backward()
    handle.remove()
    refs = [weakref.ref(a), weakref.ref(a.weight), weakref.ref(b)]
    del a, b, x
    gc.collect()
    assert [r() for r in refs] == [None, None, None], "a removed installation kept a module or parameter alive"


@pytest.mark.parametrize("unowned", ["any", "plain"])
def test_tensor_backward_and_autograd_backward_are_both_governed(unowned: str) -> None:
    a, b, x = _setup()
    plain = _plain(a, b, x)
    with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4), unowned=unowned):
        (a(x) * b(x)).sum().backward()
        via_tensor = leaf_grads({"m0": a, "m1": b})
        _zero(a, b)
        torch.autograd.backward([(a(x) * b(x)).sum()])
        via_function = leaf_grads({"m0": a, "m1": b})
    for got in (via_tensor, via_function):
        bad = grad_mismatches(plain, got, _factors(0.5, 0.25), unowned)
        assert not bad, "\n  ".join(bad)


def test_autograd_grad_is_left_alone() -> None:
    a, b, x = _setup()
    want = torch.autograd.grad((a(x) * b(x)).sum(), [a.weight, b.weight])
    with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4)):
        got = torch.autograd.grad((a(x) * b(x)).sum(), [a.weight, b.weight])
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert a.weight.grad is None and b.weight.grad is None



@require_deepspeed
@pytest.mark.deepspeed
def test_engines_get_default_names_no_two_share_and_each_keeps_across_installs(make_engine: Any) -> None:
    """An audit and a diagnosis report per group name: no two engines' default
    names may be the same (they were ``id(engine) & 0xFFFF``, which two engines
    shared about once in 15 runs), and one engine's name stays between installs."""
    engines = [make_engine(nn.Linear(2, 2), 2, 1) for _ in range(6)]
    names = []
    for engine in engines:
        with graphscale.install(engine) as inst:
            (group,) = inst.groups
            names.append(group.name)
    assert len(set(names)) == len(names), names
    assert all(n.startswith("engine:Linear#") for n in names), names
    numbers = [int(n.rsplit("#", 1)[1]) for n in names]
    assert numbers == sorted(numbers), names  # counted in the order first named, not drawn from an address
    with graphscale.install(engines[0], engines[1]) as inst:
        assert [g.name for g in inst.groups] == names[:2]
