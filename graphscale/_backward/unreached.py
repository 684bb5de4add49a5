"""A governed backward that reached none of some group's parameters but
reached unowned ``nn.Parameter``s: almost always a wrapper that swapped the
group's parameters; say so once per group (both routes call this)."""
from __future__ import annotations

import os
import sys
import warnings
import weakref

import torch

from .._core.group import Group
from .._core.snapshot import State
from .backend import Plan

__all__ = ["warn_unreached_groups"]

_warned: weakref.WeakSet[Group] = weakref.WeakSet()


def warn_unreached_groups(state: State, plan: Plan) -> None:
    """A governed backward that reaches unowned nn.Parameters but none of
    some group's is almost always a wrapper (FSDP, a PEFT or compile wrapper)
    that swapped the group's parameters; say so, once per group."""
    reached = set(plan.groups_reached())
    missing = [g for k, g in enumerate(state.groups) if k not in reached and g not in _warned and g.parameters]
    if not missing:
        return
    _warned.update(missing)
    params = plan.unowned_parameters()
    shapes = ", ".join(str(tuple(p.shape)) for p in params[:6]) + (", ..." if len(params) > 6 else "")
    names = ", ".join(repr(g.name) for g in missing)
    warnings.warn(
        f"graphscale: this backward reached none of the parameters of group(s) {names} but reached "
        f"{len(params)} nn.Parameter(s) that no group owns (shapes {shapes}). A wrapper (FSDP, a PEFT or "
        "compile wrapper) may have replaced the group's parameters after the Group was made: make the "
        "Group from the wrapped model, after wrapping. Those parameters got their plain gradient "
        f"(unowned={state.policy!r}).",
        stacklevel=_user_stacklevel(),
    )


# graphscale's whole package (its backward runs through _entry/, _routes/ and _backward/) and torch
_SKIP_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
              os.path.dirname(os.path.abspath(torch.__file__)))


def _user_stacklevel() -> int:
    """The ``stacklevel`` naming the first caller outside graphscale and torch
    (the user's ``loss.backward()``, ``engine.backward(...)`` or
    ``torch.autograd.backward(...)`` line), for a warning raised here."""
    frame = sys._getframe(1)
    level = 2  # warnings.warn's caller is level 1; this function's caller is that frame
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_SKIP_DIRS):
        frame = frame.f_back
        level += 1
    return level - 1
