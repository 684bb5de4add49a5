"""Real DeepSpeed engines on the CPU accelerator (gloo), skipped cleanly where
deepspeed is missing: whether it is here (:data:`HAVE_DEEPSPEED`,
:data:`require_deepspeed`), the config of every engine the tests build
(:func:`ds_config`) and the device they sit on (:func:`ds_device`).  The
one-rank process group and ``make_engine`` are fixtures (tests/conftest.py)."""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import pytest

try:  # deepspeed is an optional extra: its tests skip without it
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # noqa: F401

    HAVE_DEEPSPEED = True
except Exception:  # pragma: no cover - depends on the environment
    HAVE_DEEPSPEED = False

require_deepspeed = pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed is not installed")


def ds_device() -> str:
    """The device DeepSpeed's accelerator puts engines on: "cpu" unless the
    session runs with DS_ACCELERATOR=cuda (scripts/gpu_check.sh)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def ds_config(gas: int, stage: int, *, micro_batch: int = 1, clip: float | None = None, bf16: bool = False,
              fp16: Mapping[str, Any] | None = None, offload: bool = False, zero: Mapping[str, Any] | None = None,
              **extra: Any) -> dict[str, Any]:
    """The DeepSpeed config of every engine the tests build (and of the spawned
    workers': helpers/workers/untouched.py, helpers/workers/failed_backward.py;
    helpers/workers/ca_alone.py is handed its configs): ``gas`` micro-steps per
    window at ZeRO ``stage``, the client's optimizer allowed, DeepSpeed's step
    log silenced.

    ``micro_batch``: ``train_micro_batch_size_per_gpu`` (the batch the test's
    inputs have).  ``clip``: ``gradient_clipping``, left out when None (the
    tests that compare with an unclipped plain reference pass 0.0).  ``bf16``:
    the bf16 section, enabled; ``fp16``: the fp16 section, enabled, with these
    settings beside it (``initial_scale_power``, ``hysteresis``...).
    ``offload``: the optimizer offloaded to the CPU (ZeRO-Offload); ``zero``:
    more ``zero_optimization`` settings; ``extra``: more top-level settings.
    A fresh dict each call: the caller may change it.
    """
    zero_cfg: dict[str, Any] = {"stage": stage, **(zero or {})}
    if offload:
        zero_cfg["offload_optimizer"] = {"device": "cpu"}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gas,
        "zero_optimization": zero_cfg,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if clip is not None:
        cfg["gradient_clipping"] = clip
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if fp16 is not None:
        cfg["fp16"] = {"enabled": True, **fp16}
    cfg.update(extra)
    return cfg
