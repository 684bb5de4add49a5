"""What the cost gate counts: a fixed set of cases, each a warm loop of
backwards run once without graphscale (DeepSpeed alone, or plain torch) and
once with it installed; per arm the instructions inside the counted region
(under callgrind) or the Python-level calls (``sys.setprofile``).

NOTE [ Deterministic cost ]
Timings on a shared 2-core machine swing 10-20 % from one run to the next;
the instructions a backward executes and the Python functions it calls do
not move with the machine's load.  One process runs every case's arm without
graphscale, then every case's arm with ``graphscale.install(...)``, always in
the same order: per arm ``warm`` uncounted backwards (the first backwards
import things, build tables, make the snapshot's caches), then ``reps``
backwards, each inside the counted region on its own (forward outside: only
the backward is counted, as in NOTE [ Tiny fixed cost ]).  An arm's figure is
the median over its backwards; what graphscale adds per backward is the
with-arm's median minus the without-arm's.  The garbage collector is frozen
and off meanwhile, seeds are fixed, and the process runs with
PYTHONHASHSEED=0, one torch thread, the CPU accelerator and glibc's malloc
held still (NOTE [ A still heap ] in gsbench/cost_cli.py).

Python calls (``sys.setprofile``'s 'call' and 'c_call' events) repeat
exactly.  Instructions nearly do: what is left moves with the process's
memory layout, which its earlier life (the code it imported, a port number,
the gloo threads' timing) shifts from run to run: CPython's attribute cache
picks its slots by the names' addresses, malloc's searches depend on what
is where.  DeepSpeed's own backward of ~1 million instructions moves by
0.5-1 %, a few percent of a tiny case's addition (NOTE [ The cost margin ]
in gsbench/gate.py has the figures).  The median keeps one backward's odd
event (a dict resized, a heap grown) out of the figure.

The cases are tiny.py's four (two ZeRO-1 engines of one Linear(8, 8), GAS 2
and 4, under the same names as the timed table), one engine alone in the
loss, and a long chain of elementwise ops between two ``graphscale.Group``'s
over plain torch, whose added cost is also reported per node of its graph:
with two factors (the walk and plan) and with one (the probe before the fast
path, which a per-node cost in it, such as a thread-local lookup, NOTE [ No
thread-local lookup per node ] in graphscale/_native/planner/probe.h, grows by
thousands of instructions).
"""
from __future__ import annotations

import gc
import json
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

import graphscale
from graphscale import observe

from .env import make_engine
from .tiny import cases as tiny_cases
from .workloads import count_nodes

CHAIN_OPS = 2000  # elementwise ops between the two groups of the large-graph case


@dataclass(frozen=True)
class CaseSpec:
    """A case as the report names it: ``id`` (what a Cost-Change trailer
    names), what it runs, how many backwards are counted per arm (``reps``)
    after ``warm`` uncounted ones."""

    id: str
    title: str
    reps: int
    warm: int = 5


SPECS = (
    CaseSpec("mixed-loss", "mixed, loss.backward()", 20),
    CaseSpec("mixed-engine", "mixed, engine.backward", 20),
    CaseSpec("fast-path", "fast path (one factor)", 20),
    CaseSpec("nested", "one nested (reentrant checkpoint)", 20),
    CaseSpec("one-engine", "one engine alone in the loss", 20),
    CaseSpec("walk-chain", f"walk: a chain of {CHAIN_OPS} ops, two groups", 7, warm=2),
    CaseSpec("probe-chain", f"probe: a chain of {CHAIN_OPS} ops, one factor", 7, warm=2),
)
CASE_IDS = tuple(s.id for s in SPECS)


@dataclass
class Case:
    """What to install, how to make a fresh loss and run its backward."""

    installs: tuple[Any, ...]
    make: Callable[[], Any]
    run: Callable[[Any], None]


def _chain(device: str, gas: tuple[int, int] = (2, 4)) -> Case:
    """Two plain ``Linear(8, 8)``'s as groups (GAS ``gas``) with
    :data:`CHAIN_OPS` elementwise ops between them: the walk dominates where
    the two factors differ; where they are one, the probe before the fast
    path (NOTE [ Fast path ] in graphscale/_entry/entry.py), which walks
    every node to see that no other leaf is reached."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8).to(device), torch.nn.Linear(8, 8).to(device)
    x = torch.randn(2, 8, device=device)

    def make() -> Any:
        h = a(x)
        for i in range(CHAIN_OPS):
            h = h * 1.0 if i % 2 else h + 0.0
        return b(h).pow(2).mean() + a(x).pow(2).mean()

    return Case((graphscale.Group(a, gas=gas[0]), graphscale.Group(b, gas=gas[1])), make,
                lambda loss: loss.backward())


def cases(device: str) -> dict[str, Case]:
    """id -> :class:`Case`, in :data:`SPECS`' order."""
    tiny = tiny_cases(device)
    out = {spec.id: Case(*tiny[spec.title]) for spec in SPECS[:4]}
    torch.manual_seed(1)
    lone = make_engine(torch.nn.Linear(8, 8).to(device), gas=2)
    x = torch.randn(2, 8, device=device)
    out["one-engine"] = Case((lone,), lambda: lone(x).pow(2).mean(), lambda loss: loss.backward())
    out["walk-chain"] = _chain(device)
    out["probe-chain"] = _chain(device, (2, 2))
    return out


class CallCounter:
    """A ``sys.setprofile`` function counting 'call' (Python) and 'c_call'
    (C functions called from Python) events."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" or event == "c_call":
            self.calls += 1


def _counted_calls(run: Callable[[Any], None], loss: Any) -> int:
    counter = CallCounter()
    sys.setprofile(counter)
    try:
        run(loss)
    finally:
        sys.setprofile(None)
    return counter.calls


def _arm(case: Case, spec: CaseSpec, governed: bool, region: Any) -> dict[str, Any]:
    """One arm: ``spec.warm`` backwards, then ``spec.reps`` counted ones
    (NOTE [ Deterministic cost ]); ``region`` None: Python calls counted
    per backward, else each backward inside the counted region."""
    calls = []
    for _ in range(spec.warm):
        case.run(case.make())
    for _ in range(spec.reps):
        loss = case.make()
        if region is None:
            calls.append(_counted_calls(case.run, loss))
        else:
            region.region(lambda loss=loss: case.run(loss))
    out: dict[str, Any] = {"calls": calls}
    if governed and hasattr(observe, "routes"):  # which route governed it: one more backward, outside the region
        seen: list[str] = []  # (a graphscale older than observe.routes, measured for comparison, cannot say)
        with observe.routes(lambda route, reason: seen.append(route if reason is None else f"{route} ({reason})")):
            case.run(case.make())
        out["route"] = ", ".join(sorted(set(seen)))
    return out


def measure(kind: str, device: str = "cpu", only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every case, both arms; ``kind`` "instructions" (each counted backward
    inside the counted region: callgrind writes one file per backward, and
    ``regions`` says, in order, which case and arm each was) or "calls"
    (``calls_without``, ``calls_with``: per counted backward).  Returns what
    the parent process reads (JSON-able).  ``only``: these cases alone
    (all where empty)."""
    from .region import Region

    region = Region() if kind == "instructions" else None
    specs = {s.id: s for s in SPECS}
    built = {cid: case for cid, case in cases(device).items() if not only or cid in only}
    result: dict[str, Any] = {"regions": [], "cases": {
        cid: {"nodes": count_nodes(case.make()), "reps": specs[cid].reps} for cid, case in built.items()}}
    gc.collect()
    gc.freeze()
    gc.disable()
    if region is not None:
        region.instrument()
    try:
        for governed in (False, True):
            arm = "with" if governed else "without"
            for cid, case in built.items():
                if governed:
                    with graphscale.install(*case.installs):
                        got = _arm(case, specs[cid], True, region)
                else:
                    got = _arm(case, specs[cid], False, region)
                entry = result["cases"][cid]
                entry[f"calls_{arm}"] = got["calls"]
                if "route" in got:
                    entry["route"] = got["route"]
                if region is not None:
                    result["regions"] += [[cid, arm]] * specs[cid].reps
    finally:
        gc.enable()
        gc.unfreeze()
    return result


def child_main(kind: str, out_path: str, only: tuple[str, ...] = ()) -> int:
    """``benchmarks/cost.py --child KIND --out PATH``: measure, write JSON."""
    from . import env

    if not env.setup("cpu", threads=1):
        return 2
    walker = env.wait_for_walker()
    result = measure(kind, only=only)
    result["walker"] = walker
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    return 0
