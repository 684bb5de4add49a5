"""pytest's hooks and fixtures for the whole suite, and nothing a test
imports (what the tests share is the ``helpers`` package, tests/helpers/):
the worker count under ``-n auto``, the native walker waited for once, no
installation and no patched ``linear`` left behind by any test, the
``python_route`` fixture, and the one-rank DeepSpeed process group with
``make_engine`` on it."""
from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import torch

import graphscale  # noqa: F401  (imported before deepspeed, by helpers.engines, as it always was)

from helpers.engines import HAVE_DEEPSPEED, ds_config, ds_device
from helpers.ranks import free_port

MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject's addopts): one worker per core, at most
    MAX_WORKERS.  Every worker imports torch and DeepSpeed (about 1 GB each)
    and the two-rank tests spawn two more processes; past four workers the
    largest test file, not the core count, bounds the run.  Cores: those
    this process may run on (a container's share, not the host's count)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_WORKERS))


@pytest.fixture(scope="session", autouse=True)
def _native_walker_ready() -> None:
    """Wait once, before the first test, for the native walker (unless
    GRAPHSCALE_WALKER=python).  On a machine whose graphscale cache is empty
    (CI) install() starts a background build and plans with Python until it
    lands (NOTE [ No backward waits for a compiler ] in graphscale/_native);
    waiting here makes every test run on the walker a long run uses, never on
    the fallback by accident of timing.  A failed build is logged and the
    native tests skip (CI then fails on its own check)."""
    from graphscale import _native

    if _native.walker_choice() != "python":
        _native.wait()


@pytest.fixture
def python_route() -> Iterator[None]:
    """Every backward of the test takes the Python route (``graphscale/_backward/gate.py``
    route_override, which the native front obeys at once): for tests that spy on or break that
    route's own functions."""
    from graphscale._backward import gate as _gate

    with _gate.route_override(False):
        yield


@pytest.fixture(autouse=True)
def _no_installation_leaks() -> Any:
    """Every test must leave torch exactly as it found it."""
    yield
    from graphscale._backward import running as _running
    from graphscale._entry import entry as _backward
    from graphscale._entry import install as _install

    leaked = list(_install._installations)
    for inst in leaked:
        inst.remove()
    assert not leaked, f"test left installations active: {leaked}"
    assert torch.autograd.backward is _backward.ORIGINAL_BACKWARD
    assert not _running.running(), "a plan stayed registered after its backward"


@pytest.fixture(autouse=True)
def _restore_torch_linear() -> Any:
    """ZeRO-3 replaces torch.nn.functional.linear process-wide ("This will
    persist unless manually reset"), which changes every later graph's node
    types; put it back so no test depends on the order tests run in."""
    linear = torch.nn.functional.linear
    yield
    torch.nn.functional.linear = linear


@pytest.fixture(scope="session")
def ds_dist() -> None:
    """One-rank process group for every DeepSpeed test in this process: gloo
    on the CPU accelerator, NCCL on CUDA's."""
    if not HAVE_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    import deepspeed

    if not torch.distributed.is_initialized():
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        deepspeed.init_distributed(dist_backend="nccl" if ds_device() == "cuda" else "gloo")


@pytest.fixture
def make_engine(ds_dist: None) -> Callable[..., Any]:
    """``make_engine(module, gas, stage, bf16=False, offload=False, lr=0.1)`` -> engine (SGD)."""
    import deepspeed

    def make(module: torch.nn.Module, gas: int, stage: int, bf16: bool = False, offload: bool = False,
             lr: float = 0.1) -> Any:
        opt = torch.optim.SGD(module.parameters(), lr=lr)
        engine, *_ = deepspeed.initialize(model=module, optimizer=opt,
                                          config=ds_config(gas, stage, bf16=bf16, offload=offload))
        return engine

    return make
