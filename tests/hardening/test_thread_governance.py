"""Which snapshot DeepSpeed's output hooks obey, driven from threads other
than the caller's (NOTE [ Which snapshot an output hook obeys ] in
graphscale/_backward/running.py).

On CUDA, autograd runs a backward's nodes on its device worker threads, so
an engine's output hook cannot see the thread-local snapshot of the governed
backward that the caller's thread holds.  graphscale binds each governed
backward's graph task (``torch._C._current_graph_task_id()``, readable on
every thread that runs the task's nodes) to its snapshot, and the hook looks
the task up in :data:`graphscale._backward.running.bindings` and reads nothing else: no
thread-local, so what the hook sees on the CPU, where nodes run on the
caller's thread, is exactly what it would see on a device worker thread.
The tests check that every output hook found its task bound, and drive
install/remove from other threads mid-backward.  Every scenario is checked against a plain
PyTorch oracle (copies of the models made before ``deepspeed.initialize``, the
same graph run plainly, each model's gradient times 1/GAS of its engine) or
against DeepSpeed alone on fresh engines with the same weights.

Each scenario must fail when what it pins is broken; :data:`SCENARIOS` says
which mutation breaks which scenario, and
``test_each_scenario_fails_under_the_mutations_it_guards_against`` runs them:

* ``unbound``: :func:`graphscale._backward.running.bound` (the Python route) and the
  native route bind nothing (the task lookup always misses): the hook sees an
  ungoverned backward.
* ``installed_now``: the hook asks "is the engine installed now?", the only
  thread-independent answer left without the binding (what issue 12 says
  graphscale did on CUDA's threads before the binding).

The binding itself is what tells a governed task from an ungoverned one, so
the scenarios of ungoverned backwards (begun before an install,
``torch.autograd.grad``) are the ones the ``installed_now`` fallback breaks.

The rig and the scenarios: tests/helpers/thread_rig.py and
tests/helpers/thread_scenarios.py (tests/stacks/test_cuda.py runs them on
CUDA's device threads).  A nested ``torch.autograd.grad`` and a remove()
before a reentrant checkpoint recomputes: test_thread_governance_nested.py.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

from graphscale._adapters.deepspeed import hooks as _deepspeed_hooks
from graphscale._backward import running as _running
from graphscale._core import snapshot as _snapshot

from helpers import seams
from helpers.engines import require_deepspeed
from helpers.thread_rig import Case, Rig
from helpers.thread_scenarios import SCENARIOS

pytestmark = [pytest.mark.deepspeed, require_deepspeed]


@contextmanager
def _binds_nothing(roots: Sequence[Any], state: Any) -> Iterator[tuple[Any, ...]]:
    yield tuple(roots)


class _InstalledNow:
    """A ``bindings`` that answers every task from what is installed now,
    not from the running task."""

    def __bool__(self) -> bool:
        return True

    def get(self, tid: int) -> Any:
        state = _snapshot.current()
        return None if state is None else _running.Binding(_snapshot.Reading(state, {}))


MUTATIONS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "unbound": lambda mp: (mp.setattr(_running, "bound", _binds_nothing), seams.swap_in(mp)._set_may_bind(False)),
    "installed_now": lambda mp: mp.setattr(_deepspeed_hooks, "bindings", _InstalledNow()),
}


# ------------------------------------------------------------------ the tests
@pytest.mark.parametrize("name, case", [pytest.param(n, c, id=f"{n}-{c.id}")
                                        for n, s in SCENARIOS.items() for c in s.cases])
def test_output_hooks_obey_the_running_backward_on_any_thread(make_engine: Any, monkeypatch: pytest.MonkeyPatch,
                                                              name: str, case: Case) -> None:
    problems = SCENARIOS[name].run(make_engine, case, monkeypatch)
    assert not problems, problems


def _tracker_generation() -> bool:
    import deepspeed.runtime.engine as eng

    return hasattr(eng, "_ENGINE_BACKWARD_GRAPH_TRACKER")


@pytest.mark.parametrize("name, case, mutation", [pytest.param(n, c, m, id=f"{n}-{c.id}-{m}")
                                                  for n, s in SCENARIOS.items() for c in s.cases
                                                  for m in s.breaks_under])
def test_each_scenario_fails_under_the_mutations_it_guards_against(make_engine: Any, monkeypatch: pytest.MonkeyPatch,
                                                                   name: str, case: Case, mutation: str) -> None:
    if case.call.startswith("engine:") and _tracker_generation():
        pytest.skip("DeepSpeed >= 0.19.6: engine.backward registers its graph task and every engine's output hook "
                    "then skips its division by itself, so this case passes without graphscale's binding here; "
                    "on 0.19.5 (which CI runs too) it fails without it")
    MUTATIONS[mutation](monkeypatch)
    problems = SCENARIOS[name].run(make_engine, case, monkeypatch)
    assert problems, f"{name} passed with graphscale's binding mutated ({mutation}): the test cannot fail"


# A direct backward over two engines side by side, or a checkpoint around
# them, is right under DeepSpeed alone (each output hook divides its own
# engine): those cases are there for the binding of several roots and of a
# nested backward's task, and the mutation test shows they can fail.
DS_ALONE_RIGHT = ("two_engines_two_roots", "ckpt_around_two_engines")


@pytest.mark.parametrize("case", [c for c in SCENARIOS["governed_on_a_device_thread"].cases
                                  if c.graph not in DS_ALONE_RIGHT], ids=lambda c: c.id)
def test_deepspeed_alone_is_wrong_in_the_device_thread_cases(make_engine: Any, case: Case) -> None:
    rig = Rig(make_engine, case.graph, case.stage)
    want = rig.oracle()
    rig.backward(case.call, rig.roots())
    assert rig.mismatches(want), "DeepSpeed alone is exact here: the case shows nothing"
