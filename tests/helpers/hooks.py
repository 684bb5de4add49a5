"""The hooks a backward made, and those it left: :func:`spy_handles` records
every ``RemovableHandle`` made inside it (the Python route's hooks) and counts
the native route's; :func:`graphscale_hooks_left` names those still there."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_spied: list[list[Any]] = []  # the lists spy_handles() records into, innermost last


class _SpyHandle(torch.utils.hooks.RemovableHandle):
    """RemovableHandle that records itself while spy_handles() is active.
    One class for the whole session: a class made per call leaves a weak
    reference to each in its base's subclass list until the collector runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if _spied:
            _spied[-1].append(self)


@contextmanager
def spy_handles() -> Iterator[list[Any]]:
    """Every RemovableHandle made while inside (Node and tensor register_hook make one)."""
    made = HookSpy()
    original = torch.utils.hooks.RemovableHandle
    torch.utils.hooks.RemovableHandle = _SpyHandle  # type: ignore[misc]
    _spied.append(made)
    try:
        yield made
    finally:
        _spied.pop()
        torch.utils.hooks.RemovableHandle = original  # type: ignore[misc]
        made.native_made = _native_tally()[0] - made.native_start[0]


class HookSpy(list):  # type: ignore[type-arg]
    """The RemovableHandles made inside :func:`spy_handles` (the Python
    route's hooks), plus the native route's hooks counted by the native
    module: ``len()`` is every hook made, of both routes."""

    def __init__(self) -> None:
        super().__init__()
        self.native_start = _native_tally()
        self.native_made = 0  # edge-multiplier hooks the native route made (binding hooks not counted)

    def __len__(self) -> int:
        return super().__len__() + self.native_made

    def native_left(self) -> int:
        """Native hooks (edge multipliers and bindings) still alive."""
        now = _native_tally()
        return (now[1] - self.native_start[1]) + (now[3] - self.native_start[3])


def _native_tally() -> tuple[int, int, int, int]:
    from graphscale import _native

    native = _native.loaded()
    tally = getattr(native, "hook_tally", None)  # the test build's only (helpers/seams.py)
    return tuple(tally())[:4] if tally is not None else (0, 0, 0, 0)  # type: ignore[return-value]


def graphscale_hooks_left(handles: list[Any]) -> list[str]:
    """Of ``handles``, those still registered whose hook is graphscale's."""
    left = []
    if isinstance(handles, HookSpy) and handles.native_left():
        left.append(f"{handles.native_left()} native hook(s)")
    for h in list.__iter__(handles):
        d = h.hooks_dict_ref()
        fn = d.get(h.id) if d is not None else None
        if fn is not None and getattr(fn, "__module__", "").startswith("graphscale"):
            left.append(getattr(fn, "__qualname__", repr(fn)))
    return left
