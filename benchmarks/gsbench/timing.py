"""The table's rows: exactness against the oracle, interleaved timed rounds,
and peak memory, one row per workload and size."""
from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
import tempfile
import time
from typing import Any, Callable, Iterator

import torch

import graphscale

from .env import have_transformers, sync
from .impls import ALL, Impl
from .models import hf_use_reentrant
from .spec import HF_SHAPES, HF_WORKLOADS, PROG, Size
from .stats import Row, summarize
from .workloads import Workload, count_nodes, family_workloads, grads_of, max_rel_err, oracle, zero_grads

WARMUP = 2  # rounds run and dropped at the start of every row


@contextlib.contextmanager
def _native_output_held() -> Iterator[None]:
    """What C++ writes to stdout and stderr inside the block (the profiler's
    "USDT: ... profiler_start/stop" lines, the CPU allocator's warnings) goes
    to a temporary file instead of the terminal, and is shown only if the
    block raises."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 1)
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved[1], 2)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def peak_tensor_bytes(run: Callable[[], None], device: str) -> int:
    """Peak tensor memory above the level at the start of ``run()`` (one backward).

    cuda: torch.cuda.max_memory_allocated.  cpu: torch's profiler with
    profile_memory=True records every allocation and free of torch's CPU
    allocator, attributed to the op (or the engine, between ops) that made it;
    the running sum of those in time order, at its highest.  Tensors only (not
    Python objects, not the allocator's caching), exact to the byte, and the
    same in every run, so one profiled run per implementation is enough."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with _native_output_held(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    cur = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        cur += e.self_cpu_memory_usage
        peak = max(peak, cur)
    return peak


def timed_backward(impl: Impl, loss: Any, device: str,
                   phase: Callable[[str, float], None] | None = None) -> tuple[float, list[tuple[int, float, int]]]:
    """Seconds of one ``impl.backward(loss)`` (garbage collector off), and what
    graphscale's walk recorder saw during it (graphscale only)."""
    records: list[tuple[int, float, int]] = []
    gc.disable()
    try:
        with impl.observing(lambda n, s, m: records.append((n, s, m)), phase):
            sync(device)
            t0 = time.perf_counter()
            impl.backward(loss)
            sync(device)
            dt = time.perf_counter() - t0
    finally:
        gc.enable()
    return dt, records


def python_walk_ns(wl: Workload, loss: Any) -> float:
    """ns per node of the Python reference walker + planner on this graph:
    ``graphscale.explain`` walks and plans with them (best of 3)."""
    with graphscale.install(*wl.engines):
        plans = [graphscale.explain(loss) for _ in range(3)]
    return min(p.walk_us for p in plans) * 1e3 / plans[0].nodes


# ----------------------------------------------------------------------------- one row
def check_exactness(row: Row, wl: Workload, gen: torch.Generator) -> None:
    """One run of each implementation from zero gradients, against the
    oracle; then the graph's nodes and the Python walker's speed on it.
    Leaves the row's checkpointing on."""
    batch = wl.batch(gen)
    want = oracle(wl, batch)
    wl.checkpoint(True)
    for cls in ALL:
        impl = cls(wl)
        zero_grads(wl.engines)
        with impl.round():
            impl.backward(wl.loss(batch, False))
        row.err[cls.name] = max_rel_err(grads_of(wl.engines), want)
    loss = wl.loss(batch, False)
    row.nodes = count_nodes(loss)
    row.py_walk_ns = python_walk_ns(wl, loss)


def timed_rounds(row: Row, wl: Workload, gen: torch.Generator, reps: int, device: str, bar: Any) -> None:
    """``WARMUP + reps`` rounds of one backward per implementation on fresh
    forwards, the one to go first rotating; per round, each time over
    DeepSpeed alone's.  In its round each implementation runs a warm-up
    forward and backward first, untimed (graphscale: installed for the round,
    so the timed backward is not the first of its installation, as in a
    user's loop that installs once and then steps)."""
    impls = [cls(wl) for cls in ALL]
    for rep in range(WARMUP + reps):
        _one_round(row, impls[rep % 3:] + impls[: rep % 3], gen, device, rep >= WARMUP)  # rotate who goes first
        bar.update(1)


def _one_round(row: Row, order: list[Impl], gen: torch.Generator, device: str, kept: bool) -> None:
    got: dict[str, float] = {}
    for impl in order:
        with impl.round():
            impl.backward(impl.wl.loss(impl.wl.batch(gen), False))  # warm-up, untimed
            loss = impl.wl.loss(impl.wl.batch(gen), False)
            dt, records = timed_backward(impl, loss, device)
            del loss
        if kept:
            row.times[impl.name].append(dt)
            got[impl.name] = dt
            if impl.observed:
                row.walked.append(sum(r[0] for r in records))
                row.walk_s.append(sum(r[1] for r in records))
                row.mults.append(sum(r[2] for r in records))
    if got:
        for name in got:
            row.ratios[name].append(got[name] / got["deepspeed"])


def peak_memory(row: Row, wl: Workload, gen: torch.Generator, device: str) -> None:
    """Peak memory: one more backward each, in steady state (gradients exist)."""
    for cls in ALL:
        impl = cls(wl)
        with impl.round():
            loss = impl.wl.loss(impl.wl.batch(gen), False)
            row.peak[cls.name].append(peak_tensor_bytes(functools.partial(impl.backward, loss), device))
            del loss


def run_row(wl_name: str, wl: Workload, size: Size, layers: int, reps: int, device: str, bar: Any) -> Row:
    started = time.perf_counter()
    row = Row(workload=wl_name, size=size.label, hidden=size.hidden, layers=layers)
    gen = torch.Generator().manual_seed(1234)
    row.leaf_hooks = sum(1 for e in wl.engines for _ in e.module.parameters())
    check_exactness(row, wl, gen)
    timed_rounds(row, wl, gen, reps, device, bar)
    peak_memory(row, wl, gen, device)
    wl.checkpoint(False)
    zero_grads(wl.engines)
    row.wall_s = time.perf_counter() - started
    return row


# ----------------------------------------------------------------------------- the table
def size_reps(size: Size, reps: int) -> int:
    """Timed rounds per row: ``reps`` launch-bound, half that compute-bound (at least 5)."""
    return reps if size.label == "launch" else max(5, reps // 2)


def run_family(family: str, layers: int, size: Size, names: list[str], reps: int, device: str, bar: Any,
               meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows ``names`` over one family's engines (built here, freed after)."""
    wls = family_workloads(family, layers, size, device)
    if family == "hf":
        wls["HF2"].checkpoint(True)
        meta["hf_checkpoint_use_reentrant"] = hf_use_reentrant(wls["HF2"].caller.module)
        wls["HF2"].checkpoint(False)
    gc.collect()
    gc.freeze()  # keep torch's and deepspeed's objects out of every later collection
    try:
        out = []
        for w in names:
            bar.set_postfix_str(f"{w} hidden {size.hidden}")
            out.append(summarize(run_row(w, wls[w], size, layers, reps, device, bar)))
        return out
    finally:
        del wls
        gc.unfreeze()
        gc.collect()


def run_table(sizes: list[Size], wl_names: list[str], reps: int, layers: int, device: str,
              meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Every requested row, size by size: the tower engines for W1-W6, then
    the GPT-2 engines for HF1-HF2 (built per size, freed after)."""
    from tqdm import tqdm

    tower = [w for w in wl_names if w not in HF_WORKLOADS]
    hf = [w for w in wl_names if w in HF_WORKLOADS]
    if hf and not have_transformers():
        print(f"{PROG}: transformers is not installed (pip install -e '.[bench]'); "
              f"skipping {', '.join(hf)}", file=sys.stderr)
        hf = []
    summaries = []
    rounds = sum((WARMUP + size_reps(s, reps)) * (len(tower) + len(hf)) for s in sizes)
    with tqdm(total=rounds, desc="interleaved rounds", unit="round", dynamic_ncols=True) as bar:
        for size in sizes:
            families = []
            if tower:
                families.append(("tower", layers, size.hidden, tower))
            if hf:
                shape = HF_SHAPES[size.label]
                families.append(("hf", shape["layers"], shape["width"], hf))
            for family, fam_layers, hidden, names in families:
                fam_size = Size(hidden, size.batch, size.seq, size.label)
                summaries += run_family(family, fam_layers, fam_size, names, size_reps(size, reps), device,
                                        bar, meta)
    return summaries
