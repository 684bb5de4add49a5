""""""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import graphscale

from helpers.engines import ds_config, ds_device, require_deepspeed
from helpers.grads import full_grads, max_rel_err
from helpers.models import TanhMLP as Net
from helpers.fp16 import DEVICES


@pytest.fixture(params=DEVICES)
def fp16_here(request: pytest.FixtureRequest, ds_dist: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make fp16 DeepSpeed engines buildable here, or skip (see the module docstring)."""
    request.param(monkeypatch)
