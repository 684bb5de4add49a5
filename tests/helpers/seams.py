"""The native module's test build, for the tests that count the native
route's hooks, break one on purpose, or stop it binding.

graphscale loads the release build of ``walker.cpp``; the seams that only
tests use (hooks made and alive, ScaleHook calls, an injected hook failure, a
switch that stops binding) are compiled into a second build only
(``graphscale/_native/build.py`` ``SEAMS``: ``-DGRAPHSCALE_TEST_SEAMS``, its
own module name and cache key).  :func:`swap_in` builds it once per process
(the cache makes later processes load it in milliseconds) and makes graphscale
use it for the rest of the test, through ``monkeypatch``.
"""
from __future__ import annotations

from typing import Any

import pytest

from graphscale import _native
from graphscale._native import build as _build

__all__ = ["seams_module", "swap_in"]

_module: list[Any] = []


def seams_module(required: bool = True) -> Any:
    """The test build, built into graphscale's cache if it is not there yet.
    Where the native walker is off or cannot be built: the test skips
    (``required``), else None."""
    if _module:
        return _module[0]
    if _native.walker_choice() == "python" or _native.wait() is None:
        if not required:
            return None
        pytest.skip("the native walker is off or did not build here: no native route to test")
    built = _build.build(variant=_build.SEAMS)
    module = _build.import_built(built.path, _build.SEAMS)
    assert module.seams, "the test build was compiled without GRAPHSCALE_TEST_SEAMS"
    _module.append(module)
    return module


def swap_in(monkeypatch: pytest.MonkeyPatch, required: bool = True) -> Any:
    """Make graphscale plan and govern with the test build until the test
    ends (install() after this call); the build binds graph tasks again.
    None (nothing swapped) where there is no native walker and not ``required``."""
    module = seams_module(required)
    if module is None:
        return None
    module._set_may_bind(True)
    module._inject_hook_failure(0)
    monkeypatch.setattr(_native, "_module", module)
    return module
