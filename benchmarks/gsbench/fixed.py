"""The sections after the table: graphscale's fixed cost per walked backward,
by phase, and what ``install()`` + ``remove()`` cost as the heap grows."""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import graphscale

from .env import have_transformers, make_engine
from .impls import DeepSpeedAlone, Graphscale
from .models import make_hf_modules
from .spec import EXTRA_OBJECTS, HF_SHAPES, Size
from .stats import med, median_notch
from .timing import WARMUP, timed_backward
from .workloads import Workload, count_nodes, hf_workloads, tiny_pair, zero_grads

# NOTE [ Per-backward breakdown ]
# graphscale's own time in one walked backward, measured two ways in the
# same interleaved rounds on the same graph: the median of (graphscale's
# backward - DeepSpeed alone's backward in the same round), and graphscale's
# phase recorder (graphscale.observe.phases: its own Python and native work
# by phase, torch's and DeepSpeed's excluded).  "everything else" is the
# measured difference minus the recorded phases: what graphscale's presence
# costs inside torch and DeepSpeed (the output-hook redirect, the cache
# lines the walk takes), plus noise.  A near-free graph (two one-Linear
# engines) gives the same split where the backward itself costs almost
# nothing: the fixed part alone.


@dataclass
class Breakdown:
    graph: str
    nodes: int
    rounds: int
    seeds: int = 0
    hooked_nodes: int = 0
    multiplications: int = 0
    per_round_us: dict[str, list[float]] = field(default_factory=dict)
    library_phases: list[dict[str, float]] = field(default_factory=list)  # per round, us
    phases_us: dict[str, float] = field(default_factory=dict)
    notch_us: dict[str, float] = field(default_factory=dict)  # +- of a median of paired differences
    source: str = "graphscale's phase recorder"


def plan_shape(bd: Breakdown, wl: Workload, loss: Any) -> None:
    """Seeds scaled, nodes hooked and multiplications, from ``graphscale.explain``."""
    with graphscale.install(*wl.engines):
        plan = graphscale.explain(loss)
    bd.seeds = sum(1 for m in plan.multiplications if m.kind == "seed")
    bd.hooked_nodes = len({m.node for m in plan.multiplications if m.kind == "edge"})
    bd.multiplications = len(plan.multiplications)


def breakdown_rounds(bd: Breakdown, wl: Workload, gen: torch.Generator, device: str) -> None:
    """``WARMUP + bd.rounds`` rounds of DeepSpeed alone and graphscale, the
    first to go alternating; per kept round, both backwards' us and
    graphscale's phases."""
    events: dict[str, float] = {}

    def phase(name: str, seconds: float) -> None:
        events[name] = events.get(name, 0.0) + seconds

    per = bd.per_round_us = {"deepspeed_us": [], "graphscale_us": []}
    variants = (DeepSpeedAlone(wl), Graphscale(wl))
    for rnd in range(WARMUP + bd.rounds):
        got: dict[str, float] = {}
        for impl in variants[rnd % 2:] + variants[: rnd % 2]:
            with impl.round():
                impl.backward(wl.loss(wl.batch(gen), False))  # warm-up, untimed (gsbench/timing.py)
                events.clear()
                loss = wl.loss(wl.batch(gen), False)
                dt, _ = timed_backward(impl, loss, device, phase)
                del loss
            got[impl.name + "_us"] = dt * 1e6
        if rnd >= WARMUP:
            for k in per:
                per[k].append(got[k])
            bd.library_phases.append({k: v * 1e6 for k, v in events.items()})


def measure_breakdown(graph: str, wl: Workload, rounds: int, device: str) -> Breakdown:
    """NOTE [ Per-backward breakdown ] on ``wl`` (2 warm-up rounds dropped)."""
    gen = torch.Generator().manual_seed(4321)
    loss = wl.loss(wl.batch(gen), False)
    bd = Breakdown(graph=graph, nodes=count_nodes(loss), rounds=rounds)
    plan_shape(bd, wl, loss)
    del loss
    breakdown_rounds(bd, wl, gen, device)
    zero_grads(wl.engines)

    per = bd.per_round_us
    extra_rounds = [g - d for g, d in zip(per["graphscale_us"], per["deepspeed_us"])]
    extra = med(extra_rounds)
    bd.notch_us["total (measured)"] = median_notch(extra_rounds)
    names = sorted({k for r in bd.library_phases for k in r})
    bd.phases_us = {k: med([r.get(k, 0.0) for r in bd.library_phases]) for k in names}
    bd.phases_us["everything else"] = extra - sum(bd.phases_us.values())
    bd.phases_us["total (measured)"] = extra
    return bd


def measure_install(engines: tuple[Any, ...], reps: int) -> dict[str, Any]:
    """Median ms of ``graphscale.install(*engines)`` and of its ``remove()``,
    garbage collector as the process has it."""
    ins, rem = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        inst = graphscale.install(*engines)
        t1 = time.perf_counter()
        inst.remove()
        t2 = time.perf_counter()
        ins.append((t1 - t0) * 1e3)
        rem.append((t2 - t1) * 1e3)
    return {
        "live_objects": len(gc.get_objects()),
        "install_ms": med(ins),
        "remove_ms": med(rem),
        "total_ms": med([a + b for a, b in zip(ins, rem)]),
        "install_ms_all": ins,
        "remove_ms_all": rem,
    }


def hf_pair(launch: Size, device: str) -> tuple[str, Workload]:
    """HF1 over the launch-bound GPT-2 engines, and its name in the table."""
    shape = HF_SHAPES["launch"]

    torch.manual_seed(0)
    am, cm = make_hf_modules(shape["layers"], shape["width"], device)
    pair = hf_workloads(make_engine(am, gas=2), make_engine(cm, gas=4), launch, device)["HF1"]
    return f"HF1 pair, GPT-2 {shape['layers']} layers x {shape['width']}", pair


def install_costs(engines: tuple[Any, ...], reps: int) -> list[dict[str, Any]]:
    """install() + remove() in the process as it is, then with EXTRA_OBJECTS more live objects."""
    gc.collect()
    out = [{"heap": "this process as is", **measure_install(engines, reps)}]
    ballast = [[i] for i in range(EXTRA_OBJECTS)]  # lists: always tracked by the collector
    out.append({"heap": f"+{EXTRA_OBJECTS / 1e6:.0f}M live lists", **measure_install(engines, reps)})
    del ballast
    gc.collect()
    return out


def fixed_costs(sizes: list[Size], quick: bool, device: str) -> dict[str, Any]:
    """The sections after the table: NOTE [ Per-backward breakdown ] on the
    small HF pair (and a near-free graph), NOTE [ Tiny fixed cost ] (tiny.py),
    then install() cost vs heap size."""
    out: dict[str, Any] = {"breakdown": [], "install": [], "tiny": {}}
    launch = next((s for s in sizes if s.label == "launch"), Size(32, 2, 8 if quick else 16, "launch"))
    rounds = 61 if quick else 401
    tiny = tiny_pair(device)
    gc.collect()
    gc.freeze()  # as in the table: installs between rounds do not scan torch's objects
    try:
        pair = None
        if have_transformers():
            name, pair = hf_pair(launch, device)
            out["breakdown"].append(measure_breakdown(name, pair, rounds, device))
        out["breakdown"].append(measure_breakdown("near-free: 2 x Linear(8, 8)", tiny, rounds, device))
    finally:
        gc.unfreeze()
    from .tiny import tiny_fixed_costs

    out["tiny"] = tiny_fixed_costs(15 if quick else 101, device)
    out["install"] = install_costs((pair or tiny).engines, 3 if quick else 7)
    out["install_engines"] = "HF1 pair (launch)" if pair is not None else "2 x Linear(8, 8)"
    out["breakdown"] = [vars(b) for b in out["breakdown"]]
    return out
