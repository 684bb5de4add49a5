"""``graphscale.install``: the handle, the registry of what is installed, and
the interception of ``torch.autograd.backward``.

Several installations may be active at once; their groups add up.  The
registry turns them into one immutable :class:`~graphscale._backward.State`
snapshot that each backward reads once, so installing or removing on another
thread never changes a backward already running.
"""
from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from . import _backward, _native
from ._errors import ConfigurationError
from ._group import Group

__all__ = ["Installation", "install", "UNOWNED_POLICIES"]

UNOWNED_POLICIES = ("any", "raw")

_lock = threading.RLock()
_installations: list[Installation] = []


class Installation:
    """An active installation of groups; returned by :func:`install`.

    Use it as a context manager, or call :meth:`remove` (idempotent).  After
    ``remove()`` the handle keeps no reference to any group, engine, module or
    tensor.
    """

    def __init__(self, groups: tuple[Group, ...], unowned: str, detachers: list[Any]) -> None:
        self._groups: tuple[Group, ...] = groups
        self.unowned = unowned
        self._detachers = detachers
        self._names = tuple(g.name for g in groups)
        self._removed = False

    @property
    def groups(self) -> tuple[Group, ...]:
        """The groups this installation governs (empty once removed)."""
        return self._groups

    @property
    def active(self) -> bool:
        return not self._removed

    def remove(self) -> None:
        """Stop governing these groups.  Calling it again does nothing."""
        with _lock:
            if self._removed:
                return
            self._removed = True
            _installations.remove(self)
            try:
                _refresh()
            finally:
                detachers, self._detachers = self._detachers, []
                self._groups = ()
                for detach in reversed(detachers):
                    detach()

    def __enter__(self) -> Installation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._removed else "active"
        return f"<graphscale.Installation {state} groups={list(self._names)} unowned={self.unowned!r}>"


def _as_group(obj: Any, detachers: list[Any]) -> Group:
    if isinstance(obj, Group):
        return obj
    from . import _deepspeed  # the only module that knows about deepspeed, imported lazily

    if _deepspeed.is_engine(obj):
        group, detach = _deepspeed.attach(obj)
        detachers.append(detach)
        return group
    if isinstance(obj, torch.nn.Module):
        raise TypeError(
            f"graphscale: install() got a plain {type(obj).__name__} module; say what its gradient "
            f"accumulation steps are by wrapping it: graphscale.install(graphscale.Group(module, gas=N))."
        )
    raise TypeError(
        "graphscale: install() takes graphscale.Group objects and deepspeed.DeepSpeedEngine objects, "
        f"got {type(obj).__name__}."
    )


def _owner_map(groups: Iterable[Group]) -> dict[int, Group]:
    owner: dict[int, Group] = {}
    for g in groups:
        for p in g.parameters:
            prev = owner.get(id(p))
            if prev is None or prev is g:
                owner[id(p)] = g
            elif prev._gas_key != g._gas_key:
                raise ConfigurationError(
                    f"graphscale: parameter {g._param_name(p)!r} (shape {tuple(p.shape)}) is in group "
                    f"{prev.name!r} and in group {g.name!r}, whose gradient-accumulation steps may "
                    "differ, so no single factor is right for it. Put it in one group only, or give "
                    "both groups the same gas."
                )
    return owner


def _refresh() -> None:
    """Rebuild the snapshot from the active installations; patch or unpatch torch."""
    if not _installations:
        _backward.set_state(None)
        if torch.autograd.backward is _backward.governed_backward:
            torch.autograd.backward = _backward.ORIGINAL_BACKWARD
        return
    groups: list[Group] = []
    for inst in _installations:
        for g in inst._groups:
            if g not in groups:
                groups.append(g)
    state = _backward.State(
        groups=tuple(groups),
        owner=_owner_map(groups),
        raw=any(inst.unowned == "raw" for inst in _installations),
    )
    if _native._module is not None:  # NOTE [ Per-snapshot tables ]: made here, not in a backward
        _native.owners_for(state, _native._module)
    _backward.set_state(state)
    torch.autograd.backward = _backward.governed_backward


def install(*groups: Any, unowned: str = "any") -> Installation:
    """Govern every backward so each group's leaves get exactly ``1 / gas``.

    Args:
        *groups: :class:`Group` objects and/or ``deepspeed.DeepSpeedEngine``
            objects (an engine is the group of its ``module.parameters()``,
            with its own gradient-accumulation steps).
        unowned: ``"any"`` (default): a leaf that no group owns gets its plain
            gradient times one factor that graphscale chooses (1 or one of the
            factors in play, never a mixture), which keeps the fast path free;
            ``"raw"``: such leaves get exactly their plain gradient.  With
            several installations active, ``"raw"`` wins.

    Returns:
        An :class:`Installation`: a context manager with an idempotent
        ``remove()``.  Installations add up; removing one leaves the others
        working; when the last is removed ``torch.autograd.backward`` is the
        original function again.  Installing a group or engine twice (in one
        call, or again while another handle holds it) is idempotent: its
        factor still applies once, and it stays governed until the last
        handle holding it is removed.  ``remove()`` may be called from inside
        a backward hook: the backward already running keeps the snapshot it
        started with; the change applies from the next backward.

    While installed, ``Tensor.backward``, ``torch.autograd.backward`` and
    ``engine.backward`` are governed.  ``torch.autograd.grad`` accumulates
    into no ``.grad`` and is left alone.

    Raises:
        TypeError: an argument is neither a Group nor a DeepSpeed engine.
        ValueError: ``unowned`` is not ``"any"`` or ``"raw"``, or no group given.
        ConfigurationError: a parameter is in two groups with different gas.

    Example::

        >>> import torch, graphscale
        >>> a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
        >>> x = torch.ones(1, 2)
        >>> with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4)):
        ...     (a(x) + b(x)).sum().backward()
        >>> a.weight.grad, b.weight.grad
        (tensor([[0.5000, 0.5000]]), tensor([[0.2500, 0.2500]]))
    """
    if unowned not in UNOWNED_POLICIES:
        raise ValueError(f"graphscale: install(unowned=...) must be one of {UNOWNED_POLICIES}, got {unowned!r}.")
    if not groups:
        raise ValueError("graphscale: install() needs at least one Group or DeepSpeed engine.")
    _native.prepare()  # NOTE [ No backward waits for a compiler ]: cached load, or a background build
    with _lock:
        detachers: list[Any] = []
        try:
            resolved: list[Group] = []
            for obj in groups:
                g = _as_group(obj, detachers)
                if g not in resolved:
                    resolved.append(g)
            for g in resolved:
                if not any(p.requires_grad for p in g.parameters):
                    warnings.warn(
                        f"graphscale: group {g.name!r} has no parameter that requires grad; "
                        "it governs nothing.",
                        stacklevel=2,
                    )
            inst = Installation(tuple(resolved), unowned, detachers)
            _installations.append(inst)
            try:
                _refresh()  # raises ConfigurationError before anything is patched
            except BaseException:
                _installations.remove(inst)
                _refresh()
                raise
        except BaseException:
            for detach in reversed(detachers):
                detach()
            raise
        return inst
