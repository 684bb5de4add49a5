"""The DeepSpeed-engine tests' fixtures."""
from __future__ import annotations

from typing import Callable

import pytest

from helpers.engine_pool import Pool


@pytest.fixture
def pools(ds_dist: None) -> Callable[..., Pool]:
    """``pools(stage, variant="fp32")`` -> a Pool of fresh engines for this test."""
    return Pool
