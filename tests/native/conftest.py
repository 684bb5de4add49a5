"""The native tests' fixtures (the suite's: tests/conftest.py)."""
from __future__ import annotations

from typing import Any

import pytest

from graphscale import _native


@pytest.fixture(scope="module")
def native() -> Any:
    """The native walker's module, once built; the test is skipped where it cannot be."""
    mod = _native.wait()  # the background build, if the cache was empty (None under GRAPHSCALE_WALKER=python)
    if mod is None:
        pytest.skip("the native walker cannot be compiled here (or GRAPHSCALE_WALKER=python)")
    return mod
