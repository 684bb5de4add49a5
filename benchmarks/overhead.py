"""graphscale overhead benchmark: the project's main job.

Runs five workloads over real DeepSpeed engines (12 transformer-like blocks
each, plain torch) at two sizes, and times the backward of three
implementations side by side in one process, interleaved run by run:

* ``deepspeed``: DeepSpeed alone (fast, and wrong for W2, W3, W5);
* ``leaf-hooks``: the obvious hand fix: a tensor hook on every parameter that
  divides its gradient by its engine's GAS, with DeepSpeed's own division
  switched off (``engine.backward(loss, scale_wrt_gas=False)``);
* ``graphscale``: ``graphscale.install(*engines)``.

Every row also checks each implementation's gradients against a plain-PyTorch
oracle (the same forward without engines or checkpointing, gradients times
1/GAS of the owning engine).  See benchmarks/README.md for the columns.

    python benchmarks/overhead.py            # default: ~10 min on 2 cores
    python benchmarks/overhead.py --quick    # < 2 min
    python benchmarks/overhead.py --device cuda --json out.json --plot out.png
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import logging
import math
import os
import platform
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

IMPLS = ("deepspeed", "leaf-hooks", "graphscale")
WORKLOADS = {
    "W1": "one engine (one factor in play)",
    "W2": "two engines, one summed loss (GAS 2, 4)",
    "W3": "nested critic(actor(x)) (GAS 2, 4)",
    "W4": "engine(x) + engine.module(y) (GAS 2)",
    "W5": "W2, every block under reentrant checkpointing",
}
EXPECTED_MULTS = {"W1": 1, "W2": 2, "W3": 2, "W4": 1, "W5": 2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few repetitions, small sizes: under 2 minutes on 2 cores")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the engines run (default cpu)")
    ap.add_argument("--reps", type=int, default=None, help="timed interleaved rounds per row (default 61, half that compute-bound; quick 7)")
    ap.add_argument("--layers", type=int, default=12, help="transformer blocks per engine (default 12)")
    ap.add_argument("--sizes", default="32,256", help="hidden sizes, comma separated (default 32,256)")
    ap.add_argument("--workloads", default="W1,W2,W3,W4,W5", help="which workloads (default all)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: steadier on a shared machine)")
    ap.add_argument("--json", metavar="PATH", help="write every number to PATH as JSON")
    ap.add_argument("--plot", metavar="PATH", default=None,
                    help="PNG plot of overhead ratio vs graph nodes (default benchmarks/overhead.png)")
    ap.add_argument("--no-plot", action="store_true", help="skip the plot")
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------- models
def make_model_classes() -> tuple[type, type]:
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        """Pre-norm attention + MLP, plain torch (no fused kernels)."""

        def __init__(self, hidden: int, heads: int = 4) -> None:
            super().__init__()
            self.heads = heads
            self.ln1 = nn.LayerNorm(hidden)
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.proj = nn.Linear(hidden, hidden)
            self.ln2 = nn.LayerNorm(hidden)
            self.fc1 = nn.Linear(hidden, 4 * hidden)
            self.fc2 = nn.Linear(4 * hidden, hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, h = x.shape
            q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
            q, k, v = (z.reshape(b, t, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))
            att = torch.softmax(q @ k.transpose(-2, -1) * (h // self.heads) ** -0.5, dim=-1)
            y = (att @ v).transpose(1, 2).reshape(b, t, h)
            x = x + self.proj(y)
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))

    class Tower(nn.Module):
        def __init__(self, hidden: int, layers: int) -> None:
            super().__init__()
            self.inp = nn.Linear(hidden, hidden)  # not checkpointed, like an embedding
            self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
            self.checkpointing = False  # W5 switches reentrant checkpointing on

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for blk in self.blocks:
                if self.checkpointing:
                    x = checkpoint(blk, x, use_reentrant=True)
                else:
                    x = blk(x)
            return x

    return Block, Tower


# ----------------------------------------------------------------------------- set-up
def quiet_deepspeed() -> None:
    for name in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def init_dist(device: str) -> None:
    import torch

    if torch.distributed.is_initialized():
        return
    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    with contextlib.redirect_stdout(io.StringIO()):
        deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")


def make_engine(module: Any, gas: int) -> Any:
    import deepspeed
    import torch

    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    opt = torch.optim.SGD(module.parameters(), lr=0.0)
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=cfg)
    return engine


@dataclass
class Size:
    hidden: int
    batch: int
    seq: int
    label: str


@dataclass
class Row:
    workload: str
    size: str
    hidden: int
    nodes: int = 0
    times: dict[str, list[float]] = field(default_factory=lambda: {i: [] for i in IMPLS})
    ratios: dict[str, list[float]] = field(default_factory=lambda: {i: [] for i in IMPLS})
    peak: dict[str, list[int]] = field(default_factory=lambda: {i: [] for i in IMPLS})
    err: dict[str, float] = field(default_factory=dict)
    walked: list[int] = field(default_factory=list)
    walk_s: list[float] = field(default_factory=list)
    mults: list[int] = field(default_factory=list)
    leaf_hooks: int = 0
    py_walk_ns: float = float("nan")


# ----------------------------------------------------------------------------- memory
def peak_tensor_bytes(run: Callable[[], None], device: str) -> int:
    """Peak tensor memory above the level at the start of ``run()`` (one backward).

    cuda: torch.cuda.max_memory_allocated.  cpu: torch's profiler with
    profile_memory=True records every allocation and free of torch's CPU
    allocator, attributed to the op (or the engine, between ops) that made it;
    the running sum of those in time order, at its highest.  Tensors only (not
    Python objects, not the allocator's caching), exact to the byte, and the
    same in every run, so one profiled run per implementation is enough."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    cur = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        cur += e.self_cpu_memory_usage
        peak = max(peak, cur)
    return peak


# ----------------------------------------------------------------------------- workloads
def build_workloads(torch: Any, actor: Any, critic: Any) -> dict[str, dict[str, Any]]:
    """Each workload: engines (installed / hooked), the engine whose backward
    runs, and loss(x, y, plain) -> scalar; plain=True is the oracle's forward
    (modules called directly, no checkpointing)."""

    def w1(x: Any, y: Any, plain: bool) -> Any:
        return (actor.module(x) if plain else actor(x)).pow(2).mean()

    def w2(x: Any, y: Any, plain: bool) -> Any:
        a = actor.module(x) if plain else actor(x)
        c = critic.module(x) if plain else critic(x)
        return a.pow(2).mean() + c.pow(2).mean()

    def w3(x: Any, y: Any, plain: bool) -> Any:
        return (critic.module(actor.module(x)) if plain else critic(actor(x))).pow(2).mean()

    def w4(x: Any, y: Any, plain: bool) -> Any:
        a = actor.module(x) if plain else actor(x)
        return a.pow(2).mean() + actor.module(y).pow(2).mean()

    return {
        "W1": dict(engines=(actor,), caller=actor, loss=w1, ckpt=False),
        "W2": dict(engines=(actor, critic), caller=actor, loss=w2, ckpt=False),
        "W3": dict(engines=(actor, critic), caller=actor, loss=w3, ckpt=False),
        "W4": dict(engines=(actor,), caller=actor, loss=w4, ckpt=False),
        "W5": dict(engines=(actor, critic), caller=actor, loss=w2, ckpt=True),
    }


def set_checkpointing(engines: Any, on: bool) -> None:
    for e in engines:
        e.module.checkpointing = on


def oracle(torch: Any, wl: dict[str, Any], x: Any, y: Any) -> list[Any]:
    """Plain PyTorch: gradient of the same loss, times 1/GAS of the owner."""
    params, factors = [], []
    for e in wl["engines"]:
        for p in e.module.parameters():
            params.append(p)
            factors.append(1.0 / e.gradient_accumulation_steps())
    set_checkpointing(wl["engines"], False)
    loss = wl["loss"](x, y, True)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g * f for g, p, f in zip(grads, params, factors)]


def max_rel_err(torch: Any, got: list[Any], want: list[Any]) -> float:
    worst = 0.0
    for g, w in zip(got, want):
        scale = w.abs().max().item() or 1.0
        g = torch.zeros_like(w) if g is None else g
        worst = max(worst, (g.float() - w.float()).abs().max().item() / scale)
    return worst


class Impl:
    """Switch one implementation on for one run, and off again."""

    def __init__(self, name: str, wl: dict[str, Any]) -> None:
        self.name = name
        self.wl = wl
        self._undo: Callable[[], None] | None = None

    def __enter__(self) -> Impl:
        import graphscale

        if self.name == "graphscale":
            inst = graphscale.install(*self.wl["engines"])
            self._undo = inst.remove
        elif self.name == "leaf-hooks":
            handles = []
            for e in self.wl["engines"]:
                inv = 1.0 / e.gradient_accumulation_steps()
                for p in e.module.parameters():
                    handles.append(p.register_hook(lambda g, inv=inv: g * inv))

            def undo() -> None:
                for h in handles:
                    h.remove()

            self._undo = undo
        return self

    def backward(self, loss: Any) -> None:
        caller = self.wl["caller"]
        if self.name == "leaf-hooks":
            caller.backward(loss, scale_wrt_gas=False)
        else:
            caller.backward(loss)

    def __exit__(self, *exc: object) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None


def zero_grads(engines: Any) -> None:
    for e in engines:
        e.zero_grad()
        for p in e.module.parameters():
            p.grad = None


def grads_of(engines: Any) -> list[Any]:
    from deepspeed.utils import safe_get_full_grad

    out = []
    for e in engines:
        for p in e.module.parameters():
            g = safe_get_full_grad(p)
            out.append(None if g is None else g.detach().float().clone())
    return out


def count_nodes(loss: Any) -> int:
    from graphscale._walk import walk

    return len(walk([loss.grad_fn]))


def python_walk_ns(torch: Any, wl: dict[str, Any], loss: Any) -> float:
    """ns per node of the Python reference walker + planner on this graph."""
    import graphscale
    from graphscale import _planning, _state

    with graphscale.install(*wl["engines"]):
        state = _state.current()
        assert state is not None
        factors = {g: g.factor() for g in state.groups}
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            plan = _planning.build_plan([loss], _planning.PlanRequest(state, factors))
            best = min(best, time.perf_counter() - t0)
    return best / len(plan.graph) * 1e9


def run_row(torch: Any, wl_name: str, wl: dict[str, Any], size: Size, reps: int, device: str, bar: Any) -> Row:
    from graphscale import _state

    row = Row(workload=wl_name, size=size.label, hidden=size.hidden)
    gen = torch.Generator().manual_seed(1234)
    shape = (size.batch, size.seq, size.hidden)

    def inputs() -> tuple[Any, Any]:
        x = torch.randn(shape, generator=gen).to(device)
        y = torch.randn(shape, generator=gen).to(device)
        return x, y

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    engines = wl["engines"]
    row.leaf_hooks = sum(1 for e in engines for _ in e.module.parameters())
    # Correctness: one run of each implementation from zero gradients, against the oracle.
    x, y = inputs()
    want = oracle(torch, wl, x, y)
    set_checkpointing(engines, wl["ckpt"])
    for name in IMPLS:
        zero_grads(engines)
        with Impl(name, wl) as impl:
            impl.backward(wl["loss"](x, y, False))
        row.err[name] = max_rel_err(torch, grads_of(engines), want)
    loss = wl["loss"](x, y, False)
    row.nodes = count_nodes(loss)
    row.py_walk_ns = python_walk_ns(torch, wl, loss)
    del loss

    records: list[tuple[int, float, int]] = []

    def recorder(nodes: int, seconds: float, mults: int) -> None:
        records.append((nodes, seconds, mults))

    warmup = 2
    for rep in range(warmup + reps):
        order = IMPLS[rep % 3:] + IMPLS[: rep % 3]  # rotate who goes first
        got: dict[str, float] = {}
        for name in order:
            x, y = inputs()
            with Impl(name, wl) as impl:
                loss = wl["loss"](x, y, False)
                gc.disable()
                records.clear()
                if name == "graphscale":
                    _state.walk_recorder = recorder
                try:
                    sync()
                    t0 = time.perf_counter()
                    impl.backward(loss)
                    sync()
                    dt = time.perf_counter() - t0
                finally:
                    _state.walk_recorder = None
                    gc.enable()
                del loss
            if rep >= warmup:
                row.times[name].append(dt)
                got[name] = dt
                if name == "graphscale":
                    row.walked.append(sum(r[0] for r in records))
                    row.walk_s.append(sum(r[1] for r in records))
                    row.mults.append(sum(r[2] for r in records))
        if got:
            for name in IMPLS:
                row.ratios[name].append(got[name] / got["deepspeed"])
        bar.update(1)
    for name in IMPLS:  # peak memory: one more backward each, in steady state (gradients exist)
        x, y = inputs()
        with Impl(name, wl) as impl:
            loss = wl["loss"](x, y, False)
            row.peak[name].append(peak_tensor_bytes(lambda: impl.backward(loss), device))
            del loss
    set_checkpointing(engines, False)
    zero_grads(engines)
    return row


# ----------------------------------------------------------------------------- report
def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(row: Row) -> dict[str, Any]:
    walked = med([float(w) for w in row.walked])
    walk_us = med(row.walk_s) * 1e6
    out: dict[str, Any] = {
        "workload": row.workload,
        "size": row.size,
        "hidden": row.hidden,
        "graph_nodes": row.nodes,
        "nodes_walked": walked,
        "walk_us": walk_us,
        "walk_ns_per_node": (walk_us * 1e3 / walked) if walked else None,
        "walk_ns_per_node_min": (min(s / n for s, n in zip(row.walk_s, row.walked) if n) * 1e9
                                 if any(row.walked) else None),
        "python_walker_ns_per_node": row.py_walk_ns,
        "multiplications": med([float(m) for m in row.mults]),
        "expected_multiplications": EXPECTED_MULTS[row.workload],
        "leaf_hooks": row.leaf_hooks,
        "impl": {},
    }
    for name in IMPLS:
        r = row.ratios[name]
        out["impl"][name] = {
            "backward_ms_median": med(row.times[name]) * 1e3,
            "ratio_median": med(r),
            "ratio_min": min(r) if r else float("nan"),
            "ratio_max": max(r) if r else float("nan"),
            "peak_bytes_median": med([float(p) for p in row.peak[name]]),
            "max_rel_err": row.err[name],
            "times_s": row.times[name],
        }
    return out


def fmt_bytes(b: float) -> str:
    if b is None or b != b or b < 0:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(b) < 1024 or unit == "GiB":
            return f"{b:.0f}{unit}" if unit == "B" else f"{b:.1f}{unit}"
        b /= 1024
    return f"{b:.1f}GiB"


def table(summaries: list[dict[str, Any]]) -> str:
    head = ("row", "impl", "bwd ms", "ratio med [min-max]", "nodes", "walked", "walk us", "ns/node (min)",
            "mults", "peak mem", "max rel err")
    lines = [head]
    for s in summaries:
        for k, name in enumerate(IMPLS):
            i = s["impl"][name]
            gs = name == "graphscale"
            lines.append((
                f"{s['workload']} h{s['hidden']}" if k == 0 else "",
                name,
                f"{i['backward_ms_median']:.2f}",
                f"{i['ratio_median']:.3f} [{i['ratio_min']:.2f}-{i['ratio_max']:.2f}]",
                str(s["graph_nodes"]) if k == 0 else "",
                f"{s['nodes_walked']:.0f}" if gs else "",
                f"{s['walk_us']:.1f}" if gs else "",
                (f"{s['walk_ns_per_node']:.0f} ({s['walk_ns_per_node_min']:.0f})" if s["walk_ns_per_node"] else "-")
                if gs else
                (f"py {s['python_walker_ns_per_node']:.0f}" if k == 0 else ""),
                (f"{s['multiplications']:.0f}/{s['expected_multiplications']}" if gs else
                 ("1 (loss)" if name == "deepspeed" else f"{s['leaf_hooks']} (hooks)")),
                fmt_bytes(i["peak_bytes_median"]),
                f"{i['max_rel_err']:.1e}",
            ))
    widths = [max(len(str(line[c])) for line in lines) for c in range(len(head))]
    out = []
    for n, line in enumerate(lines):
        out.append("  ".join(str(v).ljust(w) for v, w in zip(line, widths)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def targets(summaries: list[dict[str, Any]]) -> list[str]:
    """Issue 4 item 4, checked on this run's medians."""
    out = []
    for s in summaries:
        g = s["impl"]["graphscale"]
        bound = (1.01 if s["workload"] == "W1" or s["hidden"] >= 256 else 1.03)
        checks = [
            (g["ratio_median"] <= bound, f"ratio {g['ratio_median']:.3f} <= {bound}"),
            (g["ratio_median"] < s["impl"]["leaf-hooks"]["ratio_median"],
             f"below leaf-hooks ({s['impl']['leaf-hooks']['ratio_median']:.3f})"),
            (s["multiplications"] == s["expected_multiplications"],
             f"multiplications {s['multiplications']:.0f} == {s['expected_multiplications']}"),
            (g["max_rel_err"] < 1e-5, f"exact (err {g['max_rel_err']:.1e})"),
        ]
        if s["walk_ns_per_node"]:
            checks.append((s["walk_ns_per_node"] <= 150, f"walk {s['walk_ns_per_node']:.0f} ns/node <= 150"))
        dsm, gsm = s["impl"]["deepspeed"]["peak_bytes_median"], g["peak_bytes_median"]
        if dsm is not None and dsm >= 0 and gsm >= 0:
            checks.append((gsm <= dsm * 1.01, f"peak {fmt_bytes(gsm)} within 1% of {fmt_bytes(dsm)}"))
        bad = [msg for ok, msg in checks if not ok]
        good = [msg for ok, msg in checks if ok]
        tag = f"{s['workload']} h{s['hidden']}"
        out.append(f"{tag}: " + ("all targets met" if not bad else "NOT MET: " + "; ".join(bad))
                   + (f"  (met: {'; '.join(good)})" if bad else ""))
    return out


def plot_x(s: dict[str, Any]) -> int:
    """Nodes in the backward: the loss's graph, or more where graphscale also
    walked the recomputed segments of checkpointed blocks (W5)."""
    return int(max(s["graph_nodes"], s["nodes_walked"] or 0))


def plot(summaries: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=110)
    colors = {"deepspeed": "tab:blue", "leaf-hooks": "tab:orange", "graphscale": "tab:green"}
    markers = {"deepspeed": "o", "leaf-hooks": "s", "graphscale": "^"}
    hiddens = sorted({s["hidden"] for s in summaries})
    styles = dict(zip(hiddens, ["-", "--", ":", "-."]))
    for name in IMPLS:
        for hidden in hiddens:
            pts = sorted((plot_x(s), s["impl"][name]["ratio_median"], s["workload"])
                         for s in summaries if s["hidden"] == hidden)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[hidden], marker=markers[name],
                    color=colors[name], label=f"{name} (hidden {hidden})")
            if name == "graphscale":
                for n, r, w in pts:
                    ax.annotate(w, (n, r), textcoords="offset points", xytext=(4, 2), fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("autograd nodes in the backward (W5: outer graph + recomputed blocks)")
    ax.set_ylabel("backward time / DeepSpeed alone (median)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    t_start = time.perf_counter()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/overhead.py: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    import deepspeed
    from tqdm import tqdm

    import graphscale
    from graphscale import _native

    quiet_deepspeed()
    init_dist(args.device)
    quiet_deepspeed()

    t0 = time.perf_counter()
    native = _native.wait()  # the cached build (ms), or the whole build on an empty cache
    build_s = time.perf_counter() - t0
    walker = "native" if native is not None else "python"

    hidden_sizes = [int(h) for h in args.sizes.split(",")]
    sizes = []
    for h in hidden_sizes:
        if args.quick:
            sizes.append(Size(h, 2, 8 if h < 128 else 32, "launch" if h < 128 else "compute"))
        else:
            sizes.append(Size(h, 2, 16 if h < 128 else 64, "launch" if h < 128 else "compute"))
    reps = args.reps if args.reps is not None else (7 if args.quick else 61)
    wl_names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    _, Tower = make_model_classes()

    summaries = []
    rounds = sum(2 + (reps if s.hidden < 128 else max(5, reps // 2)) for s in sizes for _ in wl_names)
    with tqdm(total=rounds, desc="interleaved rounds", unit="round", dynamic_ncols=True) as bar:
        for size in sizes:
            torch.manual_seed(0)
            actor = make_engine(Tower(size.hidden, args.layers).to(args.device), gas=2)
            critic = make_engine(Tower(size.hidden, args.layers).to(args.device), gas=4)
            wls = build_workloads(torch, actor, critic)
            gc.collect()
            gc.freeze()  # keep torch's and deepspeed's objects out of every later collection
            r = reps if size.hidden < 128 else max(5, reps // 2)
            for w in wl_names:
                bar.set_postfix_str(f"{w} hidden {size.hidden}")
                row = run_row(torch, w, wls[w], size, r, args.device, bar)
                summaries.append(summarize(row))
            del actor, critic, wls
            gc.unfreeze()
            gc.collect()

    device_name = (torch.cuda.get_device_name() if args.device == "cuda"
                   else f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores, {args.threads} torch thread(s)")
    meta = {
        "device": device_name,
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "graphscale": graphscale.__version__,
        "python": platform.python_version(),
        "walker": walker,
        "native_build_or_load_s": build_s,
        "reps": reps,
        "layers_per_engine": args.layers,
        "sizes": [vars(s) for s in sizes],
        "zero_stage": 1,
        "memory_measure": ("torch.cuda.max_memory_allocated above the start" if args.device == "cuda"
                           else "peak tensor bytes above the start (torch profiler, profile_memory=True)"),
        "wall_s": None,
    }
    title = (f"graphscale overhead: {meta['device']}\ntorch {meta['torch']}, deepspeed {meta['deepspeed']}, "
             f"{args.layers} blocks/engine, ZeRO 1, walker {walker}")
    print()
    print(title)
    print(table(summaries))
    print()
    for line in targets(summaries):
        print(line)
    meta["wall_s"] = time.perf_counter() - t_start
    print(f"\nwall time {meta['wall_s']:.0f} s; walker {walker} (built/loaded in {build_s:.1f} s); "
          f"peak memory: {meta['memory_measure']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": summaries, "targets": targets(summaries)}, f, indent=1)
        print(f"wrote {args.json}")
    if not args.no_plot:
        path = args.plot or os.path.join(os.path.dirname(os.path.abspath(__file__)), "overhead.png")
        plot(summaries, path, title)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
