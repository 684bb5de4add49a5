"""Which route governs a backward here: the native one, or the test is skipped."""
from __future__ import annotations

from typing import Any

import pytest


def native_route_or_skip() -> Any:
    """The native module, where the native route governs backwards here;
    else the test is skipped (GRAPHSCALE_ROUTE=python, or no native walker)."""
    from graphscale import _native
    from graphscale._backward import gate as _gate

    native = _native.wait()
    if native is None or not _gate.route_enabled():
        pytest.skip("the native route is off here (GRAPHSCALE_ROUTE=python, or no native walker)")
    return native
