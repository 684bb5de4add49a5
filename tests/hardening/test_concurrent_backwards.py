"""No backward, in any thread, crashes (contract item 3), and each stays exact,
while other threads run backwards over the same graph or their own.

Issue 38: with one group installed, torch's own
``TestMultithreadAutograd.test_multi_grad_all_hooks`` died with SIGSEGV in 7
runs of 25: five threads ran ``out.backward(inputs=..., retain_graph=True)``
on one shared graph, and the native module bound each backward's graph task
by inserting a hook into the root node's tensor pre-hooks (and erasing it
after), a vector torch's engine iterates on the other threads with no lock
(NOTE [ Binding without touching a shared node ] in
graphscale/_native/bind.h).

Each case runs one scenario of tests/helpers/workers/concurrent_backwards.py in a child
process: many threads, 40 rounds in each of four settings (one group or
two; the native route or the Python route), every gradient checked against
plain PyTorch.  A crash is the child's death by a signal, reported with the
setting it was in.  Against the code before the fix (main at 036ca8d), 3 of
the 4 cases died of SIGSEGV in each of 3 runs (every scenario whose shared
graph runs through a custom Function, so that its backwards are bound);
the separate-graphs case passed there (each thread's nodes are its own).

The last scenario, several factors on one shared graph (the plan hooks
shared nodes), died of SIGSEGV in its first round on the native route while
each backward added and removed its hooks with no lock, and gave relative
errors of 0.75-0.81 on the Python route (ungoverned ``autograd.grad`` threads
took the governed backward's multipliers); now each node keeps one hook whose
rows each graph task reads for itself (NOTE [ Multipliers per graph task ] in
_native/hooks.h), and no lock is held.  The shared-graph scenarios hook the
graph with one governed backward first, alone: the first registration of a
node's hook, while another thread runs that node's backward, is the exposure
docs/contract.md ("Threads") documents (test_backwards_never_wait.py pins
it); under ASan, CI met it once there as a SIGSEGV in torch's engine.
"""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from helpers.paths import WORKERS
from helpers.ranks import child_env
from helpers.workers import concurrent_backwards

CHILD = str(WORKERS / "concurrent_backwards.py")
HUNG_S = 600  # a bound for a child that deadlocked, not a timing assertion: a run takes seconds


def _run(scenario: str, *, walker: str = "native") -> subprocess.CompletedProcess[str]:
    env = child_env(OMP_NUM_THREADS="1")
    env.pop("GRAPHSCALE_ROUTE", None)  # the child sets each route itself
    if walker == "python":  # no native module at all: the Python route's own lock and binding
        env["GRAPHSCALE_WALKER"] = "python"
    try:
        return subprocess.run([sys.executable, CHILD, scenario], env=env, cwd=WORKERS, capture_output=True,
                              text=True, timeout=HUNG_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the child hung (a deadlock?) after: {exc.stdout!r}")


def _where(out: str) -> str:
    starts = [ln for ln in out.splitlines() if ln.startswith("start ")]
    return starts[-1][len("start "):] if starts else "before the first setting"


def _assert_clean(done: subprocess.CompletedProcess[str], settings: int) -> None:
    if done.returncode < 0:
        sig = signal.Signals(-done.returncode).name
        pytest.fail(f"the child died of {sig} in the setting '{_where(done.stdout)}'\n"
                    f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}")
    assert done.returncode == 0, f"stdout:\n{done.stdout[-5000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert done.stdout.count("start ") == settings, done.stdout


@pytest.mark.parametrize("scenario", list(concurrent_backwards.SCENARIOS))
def test_concurrent_backwards_never_crash_and_stay_exact(scenario: str) -> None:
    _assert_clean(_run(scenario), len(concurrent_backwards.SETTINGS))


@pytest.mark.parametrize("scenario", list(concurrent_backwards.SCENARIOS))
def test_concurrent_backwards_stay_exact_without_the_native_module(scenario: str) -> None:
    """The native walker disabled (a machine that cannot build it): the
    Python route alone, with its own binding (a view of each plain tensor
    root; a pre-hook on the node of any other root)."""
    _assert_clean(_run(scenario, walker="python"), len(concurrent_backwards.PYTHON_SETTINGS))
