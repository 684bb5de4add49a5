"""Checkpoint hints: a potential for a reentrant checkpoint's node, chosen
from the module it recomputes, so the nested backward has nothing to multiply.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._core.group import Group
from .._core.snapshot import Reading, State

__all__ = ["checkpoint_hint", "checkpoint_hint_positions"]

# NOTE [ Checkpoint hints ]
# A reentrant checkpoint (torch's or DeepSpeed's) is one custom-Function node
# in the outer graph; the parameters it uses are leaves only of the nested
# graph recomputed in its backward, which the outer walk cannot see.  Left to
# the outer plan, such a node is "free" and gets its parent's potential, and
# every nested plan then multiplies at its own seed and carriers: a few
# multiplications per checkpointed layer.  Both checkpoints keep the function
# they recompute as ctx.run_function, and the node is the ctx: when that is an
# nn.Module (or a bound method of one) all of whose owned parameters belong to
# one group, the outer plan pins the node to that group's factor, so the
# nested plan, starting from that base, has nothing to multiply.  A hint only
# chooses a potential, and any choice is exact, so a wrong or stale hint costs
# multiplications, never correctness.  (See NOTE [ Potentials ] in _planner/potentials.py.)
# Hence a module's parameters are read once, at its first hint, and kept (by
# id, weakly keyed by the module) across installations: reading them is most
# of a hint's cost, and a backward right after install() would pay it for
# every checkpointed layer.  Parameters added to or replaced in a module later are not seen.
_module_param_ids: weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, ...]] = weakref.WeakKeyDictionary()


def _module_parameters(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """``module.parameters()`` without its generator machinery (about 7x
    cheaper on a transformer block); may repeat a shared parameter."""
    stack = [module]
    seen = {id(module)}
    while stack:
        m = stack.pop()
        for p in m._parameters.values():
            if p is not None:
                yield p
        for sub in m._modules.values():
            if sub is not None and id(sub) not in seen:
                seen.add(id(sub))
                stack.append(sub)


def _hint_group(state: State, fn: Any) -> Group | None:
    if not isinstance(fn, torch.nn.Module):
        fn = getattr(fn, "__self__", None)
        if not isinstance(fn, torch.nn.Module):
            return None
    cache = state.tables.hints  # once per snapshot: NOTE [ Per-snapshot tables ]
    hit = cache.get(id(fn))
    if hit is not None and hit[0]() is fn:
        return hit[1]
    ids = _module_param_ids.get(fn)
    if ids is None:
        ids = _module_param_ids[fn] = tuple({id(p): None for p in _module_parameters(fn)})
    owner = state.owner
    groups = {owner.get(i) for i in ids}
    groups.discard(None)
    g = groups.pop() if len(groups) == 1 else None
    cache[id(fn)] = (weakref.ref(fn), g)
    return g


def checkpoint_hint(reading: Reading) -> Callable[[Any], float | None]:
    """The checkpoint hint for one backward's reading:
    ``hint(node)`` is a potential for a custom-Function node, or None."""
    state, factors = reading.state, reading.factors

    def hint(node: Any) -> float | None:
        g = _hint_group(state, getattr(node, "run_function", None))
        return None if g is None else factors.get(g)

    return hint


def checkpoint_hint_positions(state: State) -> Callable[[Any], int | None]:
    """The checkpoint hint for the native route, once per snapshot:
    ``hint(node)`` is the position in ``state.groups`` of the group whose
    factor a custom-Function node is pinned to, or None (the native side
    reads the factor of that position from the backward's own reading)."""
    positions = {g: k for k, g in enumerate(state.groups)}
    ref = weakref.ref(state)  # kept in the snapshot's own tables: no cycle through native objects

    def hint(node: Any) -> int | None:
        s = ref()
        g = None if s is None else _hint_group(s, getattr(node, "run_function", None))
        return None if g is None else positions.get(g)

    return hint
