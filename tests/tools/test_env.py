"""``python -m graphscale env``: the report a user pastes into a bug report,
and its exit status (non-zero when a backward's need is missing or refused).
tests/project/test_packaging.py runs it from a built wheel too."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import graphscale
from graphscale import _native
from graphscale._backward import gate as _gate
from graphscale._tools import env as _env

from helpers.engines import HAVE_DEEPSPEED


def test_env_prints_every_row_and_exits_zero_here() -> None:
    run = subprocess.run([sys.executable, "-m", "graphscale", "env", "--wait", "600"], capture_output=True,
                         text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    text = run.stdout
    for what in ("graphscale", "Python", "torch", "DeepSpeed", "transformers", "accelerate", "peft",
                 "C++ compiler", "ninja", "native walker", "native walker build log", "Python route self-test",
                 "route"):
        assert any(line.startswith(what + " ") for line in text.splitlines()), (what, text)
    assert torch.__version__ in text and graphscale.__version__ in text
    assert "Python route self-test   passed" in text, text
    if not _gate.route_enabled():  # GRAPHSCALE_ROUTE=python, which the report's process inherits
        assert "\nroute                    python (GRAPHSCALE_ROUTE=python)" in text, text
    elif _native.walker_choice() != "python":
        assert "native route self-test   passed" in text and "\nroute                    native" in text, text


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed is not installed")
def test_a_deepspeed_whose_drift_checks_fail_makes_env_exit_non_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    from graphscale._adapters import deepspeed as _deepspeed

    def refused() -> None:
        raise graphscale.GraphscaleError("graphscale: DeepSpeed 9.9.9: OutputBackwardHookManager.preprocess_done "
                                         "is missing (simulated)")

    monkeypatch.setattr(_deepspeed, "check_installed", refused)
    text, ok = _env.report()
    assert not ok
    (line,) = [ln for ln in text.splitlines() if ln.startswith("DeepSpeed drift checks")]
    assert "FAILED" in line and "preprocess_done" in line and line.endswith("<-- not usable")


def test_a_native_walker_that_is_not_there_is_reported_but_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "wait", lambda timeout=None: None)
    monkeypatch.setattr(_native, "status", lambda: "failed: no compiler (simulated)")
    text, ok = _env.report()
    assert "failed: no compiler (simulated)" in text and "python (the native walker is not loaded)" in text
    assert ok or "not usable" in text.split("native walker")[0]  # only a framework's row can make it unusable
