"""The device-thread family runs in a process of its own.

torch's engine sizes its device threads once per process, at the first
backward; a device registered after that has no thread (torch's internal
assert in ``engine.cpp``), and a registered PrivateUse1 device changes what
other stacks see (Accelerate moves models onto it).  So in a test session the
family's tests are deselected and ``test_in_own_process.py`` runs them in a
child pytest, where this file registers the device before any backward
(``GRAPHSCALE_DEVICE_THREADS_CHILD=1``, set by that test)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
RUNNER = "test_in_own_process.py"
CHILD = os.environ.get("GRAPHSCALE_DEVICE_THREADS_CHILD") == "1"

if CHILD:
    from helpers import device_threads as _dt

    _dt.setup()  # before any backward of this process


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Outside the child: keep only the runner of this folder (the rest runs in the child)."""
    if CHILD:
        return
    family = [i for i in items if Path(str(i.fspath)).parent == HERE and Path(str(i.fspath)).name != RUNNER]
    if family:
        config.hook.pytest_deselected(items=family)
        chosen = set(map(id, family))
        items[:] = [i for i in items if id(i) not in chosen]
