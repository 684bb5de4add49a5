"""``graphscale.install``: the handle, the registry of what is installed, and
the interception of ``torch.autograd.backward``.

Several installations may be active at once; their groups add up.  The
registry turns them into one immutable :class:`~graphscale._core.snapshot.State`
snapshot that each backward reads once, so installing or removing on another
thread never changes a backward already running.
"""
from __future__ import annotations

import threading
import warnings
from typing import Any

import torch

from .. import _native
from .._backward import dynamo as _dynamo
from .._backward import gate as _gate
from .._backward import native_backend as _native_backend
from .._core import registry as _registry
from .._core import releases as _releases
from .._core import snapshot as _snapshot
from .._core.group import Group
from .._routes import native as _route
from .._routes import selftest as _selftest
from . import entry as _entry

__all__ = ["Installation", "install"]

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
    """``obj`` as a group (an adapter's object, e.g. a DeepSpeed engine, makes
    its own), attached by every adapter it concerns (detachers appended)."""
    if not isinstance(obj, Group):
        made = _registry.group_type(obj)
        if made is not None:
            obj = made(obj)
    if isinstance(obj, Group):
        detachers.extend(_registry.attach(obj))
        return obj
    if isinstance(obj, torch.nn.Module):
        raise TypeError(
            f"graphscale: install() got a plain {type(obj).__name__} module; say what its gradient "
            f"accumulation steps are by wrapping it: graphscale.install(graphscale.Group(module, gas=N))."
        )
    raise TypeError(
        "graphscale: install() takes graphscale.Group objects and deepspeed.DeepSpeedEngine objects, "
        f"got {type(obj).__name__}."
    )



def _refresh() -> None:
    """Rebuild the snapshot from the active installations; patch or unpatch torch."""
    if not _installations:
        _snapshot.set_current(None)
        _entry.patch(False)  # NOTE [ The patch outlives remove() until the backward ends ]
        return
    state = _snapshot.State.of(
        (g for inst in _installations for g in inst._groups),
        _snapshot.strictest(inst.unowned for inst in _installations),
    )
    native = _native.load()  # (prepare() ran: never waits for a build)
    if native is not None:  # NOTE [ Per-snapshot tables ]: made here, not in a backward
        _native_backend.native_owners(state, native)
        _route.governor(native, state)
    _snapshot.set_current(state)
    _entry.patch(True)
    _selftest.require_python_route(_entry.govern)  # NOTE [ Newer releases ]: once per process; raises where it fails
    if native is not None and _gate.route_enabled():
        _gate.self_test(native)  # NOTE [ The native route's self-test ]: once per process, before any backward


def install(*groups: Any, unowned: str = "plain_params") -> Installation:
    """Govern every backward so each group's leaves get exactly its factor
    (``1 / gas``, or the ``factor`` it was given).

    Args:
        *groups: :class:`Group` objects and/or ``deepspeed.DeepSpeedEngine``
            objects (an engine is the group of its ``module.parameters()``,
            with its own gradient-accumulation steps; ``Group(engine,
            factor=...)`` gives it another factor).
        unowned: what leaves that no group owns receive in a backward that
            reaches owned ones (NOTE [ Unowned leaves ] in ``_core/snapshot.py``; a
            backward that reaches no owned leaf is left alone whatever the
            policy): ``"plain_params"`` (default): an unowned ``nn.Parameter``
            exactly its plain gradient, other unowned leaves (inputs that
            require grad) their plain gradient times one factor graphscale
            chooses; ``"plain"``: every unowned leaf exactly its plain
            gradient; ``"any"``: every unowned leaf its plain gradient times
            one factor graphscale chooses (1 or one in play, never a mixture),
            the cheapest.  With several installations active, the strictest
            policy applies.

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
        ValueError: ``unowned`` is not a policy name, or no group given.
        ConfigurationError: a parameter is in two groups whose factors may differ.

    Example::

        >>> import torch, graphscale
        >>> a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
        >>> x = torch.ones(1, 2)
        >>> with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4)):
        ...     (a(x) + b(x)).sum().backward()
        >>> a.weight.grad, b.weight.grad
        (tensor([[0.5000, 0.5000]]), tensor([[0.2500, 0.2500]]))
    """
    _snapshot.check_policy(unowned, "install")
    if not groups:
        raise ValueError("graphscale: install() needs at least one Group or DeepSpeed engine.")
    _releases.warn_if_newer("torch", torch.__version__, "the install-time self-test of both routes decides whether "
                            "it is governed, and on which route")
    _native.prepare()  # NOTE [ No backward waits for a compiler ]: cached load, or a background build
    _dynamo.keep_out()  # NOTE [ graphscale is not traced by dynamo ]
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
