"""Several threads' governed backwards at once through the one device thread
of the device-thread device (tests/helpers/device_threads.py), in a child process
(tests/helpers/workers/device_threads_concurrent.py) so that a crash fails
the test instead of killing pytest.  Each child runs its scenario on both
routes, with one group and with two, and reports every completed backward,
every gradient off plain x factor and every hook off the device thread.

What CUDA adds to tests/hardening/test_concurrent_backwards.py: the nodes of all the
threads' backwards run on one thread, interleaved, and a reentrant
checkpoint's nested backward, run by that thread, runs the other threads'
nodes while it waits for its own."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from helpers.workers import device_threads_concurrent as child

HERE = os.path.dirname(os.path.abspath(__file__))
HUNG_S = 300  # a bound for a child that deadlocked, not a timing assertion: a run takes seconds


def _run(scenario: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("GRAPHSCALE_ROUTE", None)  # the child sets each route itself
    try:
        return subprocess.run([sys.executable, child.__file__, scenario], env=env, cwd=HERE, capture_output=True,
                              text=True, timeout=HUNG_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the child hung (a deadlock?) after: {exc.stdout!r}")


@pytest.mark.parametrize("scenario", list(child.SCENARIOS))
def test_concurrent_backwards_through_the_one_device_thread_complete_and_stay_exact(scenario: str) -> None:
    done = _run(scenario)
    starts = [ln for ln in done.stdout.splitlines() if ln.startswith("start ")]
    if done.returncode < 0:
        where = starts[-1][len("start "):] if starts else "before the first setting"
        pytest.fail(f"the child died of {signal.Signals(-done.returncode).name} in the setting '{where}'\n"
                    f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}")
    assert done.returncode == 0, f"stdout:\n{done.stdout[-5000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert len(starts) == len(child.SETTINGS), done.stdout
    n = len(child.SETTINGS) * child.ROUNDS * child.THREADS
    assert f"completed {n} of {n}" in done.stdout, done.stdout
