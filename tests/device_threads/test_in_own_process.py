"""The device-thread family, run whole in a child pytest whose device came
before any backward (see this folder's conftest.py): every test of the family
must pass there, and the child's own report is shown where one fails."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers.paths import REPO, TESTS
from helpers.ranks import child_env

CHILD = os.environ.get("GRAPHSCALE_DEVICE_THREADS_CHILD") == "1"  # set for the child by this test
HUNG_S = 1800  # a bound for a child that deadlocked, not a timing assertion: the family takes about a minute


def test_the_device_thread_family_passes_in_a_process_of_its_own() -> None:
    if CHILD:
        pytest.skip("this is the child: it runs the family itself")
    env = child_env(GRAPHSCALE_DEVICE_THREADS_CHILD="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rfE",
           str(TESTS / "device_threads")]
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=HUNG_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the device-thread family hung (a deadlock?): {str(exc.stdout)[-4000:]}")
    report = f"the device-thread family failed in its child:\n{done.stdout[-20000:]}\n{done.stderr[-4000:]}"
    assert done.returncode == 0, report
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-4000:]
