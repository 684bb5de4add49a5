"""graphscale and torch's dynamo: every module of graphscale but the Python
route's node hook (``_routes/hooks.py``) is on dynamo's skip list.
"""
from __future__ import annotations

import importlib.abc
import logging
import pkgutil
import sys
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["keep_out", "TRACED", "eager"]

# NOTE [ graphscale is not traced by dynamo ]
# Inside a torch.compile'd function (a training step with its backward in
# it) or under compiled autograd, dynamo offers every Python frame it meets
# to its compiler and inlines what it can.  It skips torch's own files, so
# torch.autograd.backward runs eagerly there; once graphscale replaced that
# function, dynamo compiled graphscale's governed backward itself, and broke
# on it (an InternalTorchDynamoError on the call record, measured with
# torch 2.13) or would have baked one backward's reading (its factors, its
# graph task's binding) into a graph for every later step.  So each module of
# graphscale goes on dynamo's skip list (torch._dynamo.trace_rules.add: a
# frame or call there is run eagerly, as torch's own are), except _routes/hooks.py:
# the Python route's edge multiplier, which compiled autograd lifts into its
# graph and dynamo compiles with the rest (one capture, replayed every step).
# graphscale never imports dynamo for this (2.6 s, measured): where dynamo is
# not imported yet at install(), a finder on sys.meta_path waits for
# torch._dynamo.trace_rules and adds the modules right after it is loaded,
# then takes itself off.

_log = logging.getLogger("graphscale")
_TRACE_RULES = "torch._dynamo.trace_rules"
# what dynamo may trace: the Python route's edge multiplier
TRACED = frozenset({"graphscale._routes.hooks"})
_lock = threading.Lock()
_state: dict[str, Any] = {"done": False, "finder": None}


def keep_out() -> None:
    """Put graphscale on dynamo's skip list: now if dynamo is loaded, else as
    soon as it is.  Idempotent; cheap after the first call."""
    if _state["done"]:
        return
    with _lock:
        if _state["done"]:
            return
        rules = sys.modules.get(_TRACE_RULES)
        if rules is not None and hasattr(rules, "add"):
            _skip(rules)
        elif _state["finder"] is None:
            finder = _AfterTraceRules()
            _state["finder"] = finder
            sys.meta_path.insert(0, finder)


def _modules() -> list[str]:
    """Every module of graphscale but those in TRACED.  dynamo skips a
    package's whole directory, so a package holding a traced module is left
    out (its modules are listed one by one)."""
    package = sys.modules[__name__.split(".")[0]]
    found = pkgutil.walk_packages(package.__path__, package.__name__ + ".")
    return [m.name for m in found
            if m.name not in TRACED and not (m.ispkg and any(t.startswith(m.name + ".") for t in TRACED))]


def _skip(rules: Any) -> None:
    try:
        for name in _modules():
            rules.add(name)
    except Exception as exc:  # noqa: BLE001 - a dynamo without the skip list: say so once
        _log.warning("graphscale: could not put graphscale on dynamo's skip list (%s: %s); a torch.compile'd "
                     "step with a governed backward inside may fail", type(exc).__name__, exc)
    _state["done"] = True


class _AfterTraceRules(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands on the real spec of dynamo's trace rules,
    with a loader that adds graphscale's modules once the rules are loaded."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname != _TRACE_RULES:
            return None
        with _lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _state["finder"] = None
        from importlib.util import find_spec

        spec = find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_skip(module: Any) -> None:
            exec_module(module)
            with _lock:
                _skip(module)

        loader.exec_module = exec_then_skip  # type: ignore[method-assign]
        return spec


# ---------------------------------------------------------------- under compiled autograd
def eager(fn: Any) -> Any:
    """``fn`` run with dynamo off for its whole extent (compiled autograd is on,
    so dynamo is imported).  (See NOTE [ Under compiled autograd ] in _adapters/deepspeed/compiled.py.)"""
    import torch

    return torch._dynamo.disable(fn)
