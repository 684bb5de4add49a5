"""What graphscale does per backward, for benchmarks and tools.

The observation API: context managers that nest and restore, each seeing
every governed backward while it is active, and changing none of them.

Example::

    >>> import torch, graphscale
    >>> from graphscale import observe
    >>> a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    >>> seen = []
    >>> with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4)):
    ...     with observe.walks(lambda nodes, seconds, mults: seen.append((nodes, mults))):
    ...         (a(torch.ones(1, 2)) + b(torch.ones(1, 2))).sum().backward()
    >>> seen
    [(10, 2)]
"""
from __future__ import annotations

from contextlib import AbstractContextManager

from . import _native
from ._core.observation import (
    PhaseRecorder,
    RouteRecorder,
    WalkRecorder,
    recording_phases,
    recording_routes,
    recording_walks,
)
from ._core.observation import declines as _declines
from ._core.observation import refusals as _refusals

__all__ = ["phases", "walks", "routes", "declines", "refusals", "walker"]


def phases(record: PhaseRecorder) -> AbstractContextManager[None]:
    """Within the block, ``record(phase, seconds)`` is called with graphscale's
    own time in every governed backward, by phase: ``"prepare"``,
    ``"walk+plan"``, ``"seeds"``, ``"hooks on"``, ``"bind"``, ``"hooks off"``,
    ``"hook calls"``, ``"adapter"`` (an engine's ``backward`` wrapper); a
    nested backward's phases start with ``"nested "``.  Torch's and
    DeepSpeed's own work is in none of them.  Blocks nest; each sees every
    backward run while it is active."""
    return recording_phases(record)


def walks(record: WalkRecorder) -> AbstractContextManager[None]:
    """Within the block, ``record(nodes, seconds, multiplications)`` is called
    for every walked plan (the nodes walked, the seconds to walk and plan, the
    multiplications placed); a fast-path backward reports ``(0,
    seconds_to_probe, seeds_scaled)``.  Blocks nest."""
    return recording_walks(record)


def routes(record: RouteRecorder) -> AbstractContextManager[None]:
    """Within the block, ``record(route, reason)`` is called for every
    governed backward (nested ones included): ``("native", None)`` where the
    native route governed it, else ``("python", reason)`` with the reason the
    native route did not take it, one of ``"GRAPHSCALE_ROUTE=python"``,
    ``"native walker not ready"``, ``"self-test failed"``, ``"compiled
    autograd"``, ``"inputs="``, ``"call"``, ``"seed"``, ``"factors"``
    (docs/native-walker.md, "Which route governed a backward", says what
    each means).  Both routes give the same gradients; this says which one
    ran.  Blocks nest.

        >>> import torch, graphscale
        >>> from graphscale import observe
        >>> a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
        >>> seen = []
        >>> with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4)):
        ...     with observe.routes(lambda route, reason: seen.append(route)):
        ...         x = torch.ones(1, 2, requires_grad=True)
        ...         (a(x) + b(x)).sum().backward(inputs=[a.weight, b.weight])
        >>> seen
        ['python']
    """
    return recording_routes(record)


def declines() -> dict[str, int]:
    """How many governed backwards in this process the native route did not
    take, by reason (see :func:`routes`); the Python route governed them,
    exactly.  Empty while every backward was native."""
    return _declines()


def refusals() -> dict[str, int]:
    """How many calls graphscale refused in this process, by kind: setups
    where DeepSpeed alone has no exact answer either (docs/contract.md,
    "What graphscale refuses", lists each with what DeepSpeed alone does):
    ``"compiled autograd, ZeRO 3"``, ``"compiled autograd, ZeRO 2 under
    engine.compile"``, ``"compiled autograd, ungoverned direct backward"``,
    ``"ZeRO 3 retry over a failed backward"``, ``"engine failed closed"``.
    Each refusal raises :class:`graphscale.GraphscaleError` with its reason
    and fix; this counts them."""
    return _refusals()


def walker(timeout: float | None = None) -> str:
    """Wait (at most ``timeout`` seconds) until the native walker is built and
    loaded, or has failed, and say which: ``"native"``, or ``"python (<why>)"``
    (``GRAPHSCALE_WALKER=python``, a failed build, or still building).  The
    library never waits for the build itself (backwards plan on the Python
    walker until it is ready); benchmarks and scripts call this first."""
    module = _native.wait(timeout)
    return "native" if module is not None else f"python ({_native.status()})"
