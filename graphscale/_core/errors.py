"""The exceptions graphscale raises, and its internal-assert helper (the
native planner's twin: ``_native/planner/errors.h``).

Every message starts with ``graphscale:``, names the object at fault and says
how to fix it.  User input is never checked with a bare ``assert``;
``internal_assert`` is for graphscale's own invariants only.
"""
from __future__ import annotations

__all__ = ["GraphscaleError", "ConfigurationError", "AuditError", "InternalError", "internal_assert"]


class GraphscaleError(RuntimeError):
    """Base class of every error graphscale raises on its own behalf."""


class ConfigurationError(GraphscaleError):
    """The groups handed to :func:`graphscale.install` contradict each other.

    Example: one parameter in two groups whose gradient-accumulation steps
    differ, so no single factor is right for it.
    """


class AuditError(GraphscaleError):
    """A governed backward gave some leaf a gradient other than factor x plain gradient
    (raised by :func:`graphscale.audit`)."""


class InternalError(GraphscaleError):
    """An invariant of graphscale itself broke: a bug, please report it."""


def internal_assert(cond: bool, msg: str) -> None:
    if not cond:
        raise InternalError(f"graphscale: internal invariant broken: {msg}. This is a bug in graphscale.")
