"""The probe: before the fast path, walk only until the answer is known (an
owned leaf reached? one that must stay plain too?).  C++ twin:
``_native/planner/probe.h``."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._core.snapshot import State
from .nodes import CUSTOM_FUNCTION, root_node

__all__ = ["probe_python", "PROBE_NO_OWNED", "PROBE_FAST", "PROBE_PLAN", "PROBE_HIDDEN"]

# The probe's verdicts (what the native probe returns too), and a flag or-ed in.
PROBE_NO_OWNED, PROBE_FAST, PROBE_PLAN = 0, 1, 2
PROBE_HIDDEN = 4  # a custom-Function node was seen


def probe_python(roots: Sequence[Any], state: State) -> int:
    """The Python twin of the native ``probe`` (see ``_backward/decide.py`` probe): PROBE_NO_OWNED, PROBE_FAST or
    PROBE_PLAN, or-ed with PROBE_HIDDEN when a custom-Function node was seen."""
    policy, owner = state.policy, state.owner
    stack = [n for n in map(root_node, roots) if n is not None]
    seen = set(stack)
    owned = unowned = hidden = False
    while stack:
        node = stack.pop()
        if isinstance(node, CUSTOM_FUNCTION):
            hidden = True
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor):
            if id(var) in owner:
                owned = True
                if policy == "any":
                    return PROBE_FAST | (PROBE_HIDDEN if hidden else 0)
            elif policy == "plain" or (policy == "plain_params" and isinstance(var, torch.nn.Parameter)):
                unowned = True
            if owned and unowned:
                return PROBE_PLAN | (PROBE_HIDDEN if hidden else 0)
            continue
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return (PROBE_FAST if owned else PROBE_NO_OWNED) | (PROBE_HIDDEN if hidden else 0)
