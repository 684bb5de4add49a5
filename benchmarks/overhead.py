"""graphscale overhead benchmark: the project's main job.

Runs six workloads over real DeepSpeed engines (12 transformer-like blocks
each, plain torch) and two over engines built from a ``transformers`` GPT-2
config (actor + value-head critic, one PPO-style loss), at two sizes, and
times the backward of three implementations side by side in one process,
interleaved run by run:

* ``deepspeed``: DeepSpeed alone (fast, and wrong wherever two engines meet);
* ``leaf-hooks``: the obvious hand fix: a tensor hook on every parameter that
  divides its gradient by its engine's GAS, with DeepSpeed's own division
  switched off (``engine.backward(loss, scale_wrt_gas=False)``);
* ``graphscale``: ``graphscale.install(*engines)``.

Every row also checks each implementation's gradients against a plain-PyTorch
oracle (the same forward without engines or checkpointing, gradients times
1/GAS of the owning engine).  After the table: graphscale's fixed cost per
walked backward, split into phases, and what ``install()`` + ``remove()`` cost
with and without ~3 million extra live Python objects.  See
benchmarks/README.md for the rows, columns and sections.

    python benchmarks/overhead.py            # default: ~8 min on 2 cores (twice that on busy ones)
    python benchmarks/overhead.py --quick    # ~2 min
    python benchmarks/overhead.py --device cuda --json out.json --plot out.png
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
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
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

IMPLS = ("deepspeed", "leaf-hooks", "graphscale")
WORKLOADS = {
    "W1": "one engine (one factor in play)",
    "W2": "two engines, one summed loss (GAS 2, 4)",
    "W3": "nested critic(actor(x)) (GAS 2, 4)",
    "W4": "engine(x) + engine.module(y) (GAS 2)",
    "W5": "W2, every block under reentrant checkpointing",
    "W6": "W2, every block under non-reentrant checkpointing",
    "HF1": "transformers GPT-2 actor + value-head critic, PPO-style loss (GAS 2, 4)",
    "HF2": "HF1 with gradient checkpointing (transformers' default use_reentrant)",
}
HF_WORKLOADS = ("HF1", "HF2")
# Engine boundaries graphscale must multiply at: one factor in play needs one
# (the seed); two engines with different GAS under one loss need two (the
# seed, and the one edge where the other engine's gradient enters).
# NOTE [ Expected multiplications ] in benchmarks/README.md.
EXPECTED_MULTS = {"W1": 1, "W2": 2, "W3": 2, "W4": 1, "W5": 2, "W6": 2, "HF1": 2, "HF2": 2}
# GPT-2 shapes of the real-model rows, by size label (same batch and tokens as
# the tower rows of that label).
HF_SHAPES = {"launch": {"layers": 2, "width": 64}, "compute": {"layers": 6, "width": 256}}
HF_VOCAB = 2048
EXTRA_OBJECTS = 3_000_000  # install() cost section: live objects added to the heap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few repetitions, small sizes: under 3 minutes on 2 cores")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the engines run (default cpu)")
    ap.add_argument("--reps", type=int, default=None, help="timed interleaved rounds per row (default 61, half that compute-bound; quick 7)")
    ap.add_argument("--layers", type=int, default=12, help="transformer blocks per engine in W1-W6 (default 12)")
    ap.add_argument("--sizes", default="32,256", help="hidden sizes of W1-W6, comma separated (default 32,256); "
                    "below 128 is launch-bound, and HF rows follow the labels (launch: GPT-2 2 layers x 64, "
                    "compute: 6 layers x 256)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="which workloads (default all)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: steadier on a shared machine)")
    ap.add_argument("--no-fixed-costs", action="store_true",
                    help="skip the sections after the table (per-backward breakdown, install() cost)")
    ap.add_argument("--json", metavar="PATH", help="write every number to PATH as JSON")
    ap.add_argument("--plot", metavar="PATH", default=None,
                    help="PNG bar chart of the overhead ratios (default benchmarks/overhead.png)")
    ap.add_argument("--no-plot", action="store_true", help="skip the plot")
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------- graphscale's observation points
@contextlib.contextmanager
def recorders(walk: Callable[[int, float, int], None] | None,
              phase: Callable[[str, float], None] | None = None) -> Iterator[None]:
    """graphscale's walk recorder and phase recorder (graphscale.observe) for the duration."""
    from graphscale import observe

    with contextlib.ExitStack() as stack:
        if walk is not None:
            stack.enter_context(observe.walks(walk))
        if phase is not None:
            stack.enter_context(observe.phases(phase))
        yield


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
            self.checkpointing: str | None = None  # W5: "reentrant", W6: "non-reentrant"

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for blk in self.blocks:
                if self.checkpointing:
                    x = checkpoint(blk, x, use_reentrant=self.checkpointing == "reentrant")
                else:
                    x = blk(x)
            return x

    return Block, Tower


def make_hf_modules(layers: int, width: int, device: str) -> tuple[Any, Any]:
    """A GPT-2 actor (``GPT2LMHeadModel``) and critic (``GPT2Model`` + a linear
    value head) from one config, random init, dropout off, training mode."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

    cfg = GPT2Config(vocab_size=HF_VOCAB, n_positions=128, n_embd=width, n_layer=layers, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=HF_VOCAB - 1, eos_token_id=HF_VOCAB - 1)

    class Critic(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = GPT2Model(cfg)
            self.v_head = torch.nn.Linear(width, 1)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            hidden = self.backbone(input_ids=input_ids, use_cache=False).last_hidden_state
            return self.v_head(hidden).squeeze(-1)

    actor: Any = GPT2LMHeadModel(cfg)  # (transformers' typed .to() confuses type checkers)
    return actor.to(device).train(), Critic().to(device).train()


def hf_checkpointing(model: Any, on: bool) -> None:
    """``gradient_checkpointing_enable()`` / ``_disable()`` with transformers'
    default arguments (newer releases name them ``activation_checkpointing_*``
    and keep the old names as deprecated aliases)."""
    name = "enable" if on else "disable"
    fn: Callable[[], None] = (getattr(model, f"activation_checkpointing_{name}", None)
                              or getattr(model, f"gradient_checkpointing_{name}"))
    fn()


def hf_use_reentrant(model: Any) -> bool | None:
    """What the checkpointed blocks of ``model`` pass as use_reentrant (None: not set)."""
    for m in model.modules():
        fn = getattr(m, "_gradient_checkpointing_func", None)
        if fn is not None:
            return getattr(fn, "keywords", {}).get("use_reentrant")
    return None


# ----------------------------------------------------------------------------- set-up
def quiet_libraries() -> None:
    for name in ("DeepSpeed", "deepspeed", "torch.distributed", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*")
    warnings.filterwarnings("ignore", message=".*use_cache=True.*")
    warnings.filterwarnings("ignore", category=FutureWarning)


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
    label: str  # "launch" or "compute"


@dataclass
class Row:
    workload: str
    size: str
    hidden: int
    layers: int
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
    wall_s: float = 0.0  # the whole row: oracle, rounds, memory


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
@dataclass
class Workload:
    """One row's graph.

    ``batch(gen)`` makes fresh inputs for one run; ``loss(batch, plain)`` runs
    the forward and returns a scalar (``plain=True``: the oracle's forward,
    through the bare modules, no engine); ``checkpoint(on)`` switches this
    row's activation checkpointing on or off (the oracle runs with it off);
    ``caller.backward(loss)`` is the backward that is timed."""

    engines: tuple[Any, ...]
    caller: Any
    loss: Callable[[tuple[Any, ...], bool], Any]
    batch: Callable[[Any], tuple[Any, ...]]
    checkpoint: Callable[[bool], None] = lambda on: None


def tower_workloads(torch: Any, actor: Any, critic: Any, size: Size, device: str) -> dict[str, Workload]:
    shape = (size.batch, size.seq, size.hidden)

    def batch(gen: Any) -> tuple[Any, ...]:
        return torch.randn(shape, generator=gen).to(device), torch.randn(shape, generator=gen).to(device)

    def fwd(engine: Any, plain: bool) -> Any:
        return engine.module if plain else engine

    def w1(b: tuple[Any, ...], plain: bool) -> Any:
        return fwd(actor, plain)(b[0]).pow(2).mean()

    def w2(b: tuple[Any, ...], plain: bool) -> Any:
        return fwd(actor, plain)(b[0]).pow(2).mean() + fwd(critic, plain)(b[0]).pow(2).mean()

    def w3(b: tuple[Any, ...], plain: bool) -> Any:
        return fwd(critic, plain)(fwd(actor, plain)(b[0])).pow(2).mean()

    def w4(b: tuple[Any, ...], plain: bool) -> Any:
        return fwd(actor, plain)(b[0]).pow(2).mean() + actor.module(b[1]).pow(2).mean()

    def checkpointing(mode: str) -> Callable[[bool], None]:
        def switch(on: bool) -> None:
            for e in (actor, critic):
                e.module.checkpointing = mode if on else None

        return switch

    one, two = (actor,), (actor, critic)
    return {
        "W1": Workload(one, actor, w1, batch),
        "W2": Workload(two, actor, w2, batch),
        "W3": Workload(two, actor, w3, batch),
        "W4": Workload(one, actor, w4, batch),
        "W5": Workload(two, actor, w2, batch, checkpointing("reentrant")),
        "W6": Workload(two, actor, w2, batch, checkpointing("non-reentrant")),
    }


def hf_workloads(torch: Any, actor: Any, critic: Any, size: Size, device: str) -> dict[str, Workload]:
    """PPO-style: the actor's clipped policy term on its log-probabilities of
    the tokens with fixed advantages (first epoch: the old policy is this one,
    detached), plus the critic's squared value error against fixed returns."""
    b, t = size.batch, size.seq

    def batch(gen: Any) -> tuple[Any, ...]:
        ids = torch.randint(0, HF_VOCAB, (b, t), generator=gen)
        adv, ret = torch.randn(b, t - 1, generator=gen), torch.randn(b, t, generator=gen)
        return ids.to(device), adv.to(device), ret.to(device)

    def ppo(bt: tuple[Any, ...], plain: bool) -> Any:
        ids, adv, ret = bt
        a = actor.module if plain else actor
        c = critic.module if plain else critic
        logits = a(input_ids=ids, use_cache=False).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        policy = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
        value = 0.5 * (c(ids) - ret).pow(2).mean()
        return policy + value

    def checkpointing(on: bool) -> None:
        hf_checkpointing(actor.module, on)
        hf_checkpointing(critic.module.backbone, on)

    two = (actor, critic)
    return {"HF1": Workload(two, actor, ppo, batch), "HF2": Workload(two, actor, ppo, batch, checkpointing)}


def oracle(torch: Any, wl: Workload, batch: tuple[Any, ...]) -> list[Any]:
    """Plain PyTorch: gradient of the same loss, times 1/GAS of the owner."""
    params, factors = [], []
    for e in wl.engines:
        for p in e.module.parameters():
            params.append(p)
            factors.append(1.0 / e.gradient_accumulation_steps())
    wl.checkpoint(False)
    loss = wl.loss(batch, True)
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

    def __init__(self, name: str, wl: Workload) -> None:
        self.name = name
        self.wl = wl
        self._undo: Callable[[], None] | None = None

    def __enter__(self) -> Impl:
        import graphscale

        if self.name == "graphscale":
            inst = graphscale.install(*self.wl.engines)
            self._undo = inst.remove
        elif self.name == "leaf-hooks":
            handles = []
            for e in self.wl.engines:
                inv = 1.0 / e.gradient_accumulation_steps()
                for p in e.module.parameters():
                    handles.append(p.register_hook(lambda g, inv=inv: g * inv))

            def undo() -> None:
                for h in handles:
                    h.remove()

            self._undo = undo
        return self

    def backward(self, loss: Any) -> None:
        caller = self.wl.caller
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


def python_walk_ns(wl: Workload, loss: Any) -> float:
    """ns per node of the Python reference walker + planner on this graph."""
    import graphscale

    from graphscale import _planning, _state

    with graphscale.install(*wl.engines):
        state = _state.current()
        assert state is not None
        request = _planning.PlanRequest(state, state.read_factors())
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            plan = _planning.build_plan([loss], request)
            best = min(best, time.perf_counter() - t0)
    return best / len(plan.graph) * 1e9


def sync(torch: Any, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_backward(torch: Any, impl: Impl, loss: Any, device: str,
                   phase: Callable[[str, float], None] | None = None) -> tuple[float, list[tuple[int, float, int]]]:
    """Seconds of one ``impl.backward(loss)`` (garbage collector off), and what
    graphscale's walk recorder saw during it (graphscale only)."""
    records: list[tuple[int, float, int]] = []
    gs = impl.name == "graphscale"
    gc.disable()
    try:
        with recorders(lambda n, s, m: records.append((n, s, m)) if gs else None, phase if gs else None):
            sync(torch, device)
            t0 = time.perf_counter()
            impl.backward(loss)
            sync(torch, device)
            dt = time.perf_counter() - t0
    finally:
        gc.enable()
    return dt, records


def run_row(torch: Any, wl_name: str, wl: Workload, size: Size, layers: int, reps: int, device: str,
            bar: Any) -> Row:
    started = time.perf_counter()
    row = Row(workload=wl_name, size=size.label, hidden=size.hidden, layers=layers)
    gen = torch.Generator().manual_seed(1234)
    engines = wl.engines
    row.leaf_hooks = sum(1 for e in engines for _ in e.module.parameters())
    # Correctness: one run of each implementation from zero gradients, against the oracle.
    batch = wl.batch(gen)
    want = oracle(torch, wl, batch)
    wl.checkpoint(True)
    for name in IMPLS:
        zero_grads(engines)
        with Impl(name, wl) as impl:
            impl.backward(wl.loss(batch, False))
        row.err[name] = max_rel_err(torch, grads_of(engines), want)
    loss = wl.loss(batch, False)
    row.nodes = count_nodes(loss)
    row.py_walk_ns = python_walk_ns(wl, loss)
    del loss

    warmup = 2
    for rep in range(warmup + reps):
        order = IMPLS[rep % 3:] + IMPLS[: rep % 3]  # rotate who goes first
        got: dict[str, float] = {}
        for name in order:
            batch = wl.batch(gen)
            with Impl(name, wl) as impl:
                loss = wl.loss(batch, False)
                dt, records = timed_backward(torch, impl, loss, device)
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
        batch = wl.batch(gen)
        with Impl(name, wl) as impl:
            loss = wl.loss(batch, False)
            row.peak[name].append(peak_tensor_bytes(lambda: impl.backward(loss), device))
            del loss
    wl.checkpoint(False)
    zero_grads(engines)
    row.wall_s = time.perf_counter() - started
    return row


# ----------------------------------------------------------------------------- fixed per-backward cost
# NOTE [ Per-backward breakdown ]
# graphscale's own time in one walked backward, measured two ways in the
# same interleaved rounds on the same graph: the median of (graphscale's
# backward - DeepSpeed alone's backward in the same round), and graphscale's
# phase recorder (graphscale/_state.py phase_recorder: its own Python and
# native work by phase, torch's and DeepSpeed's excluded).  "everything
# else" is the measured difference minus the recorded phases: what
# graphscale's presence costs inside torch and DeepSpeed (the output-hook
# redirect, the cache lines the walk takes), plus noise.  A near-free graph
# (two one-Linear engines) gives the same split where the backward itself
# costs almost nothing: the fixed part alone.


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


def measure_breakdown(torch: Any, graph: str, wl: Workload, rounds: int, device: str) -> Breakdown:
    """NOTE [ Per-backward breakdown ] on ``wl`` (2 warm-up rounds dropped)."""
    import graphscale

    gen = torch.Generator().manual_seed(4321)
    loss = wl.loss(wl.batch(gen), False)
    bd = Breakdown(graph=graph, nodes=count_nodes(loss), rounds=rounds)
    with graphscale.install(*wl.engines):
        plan = graphscale.explain(loss)
    bd.seeds = sum(1 for m in plan.multiplications if m.kind == "seed")
    bd.hooked_nodes = len({m.node for m in plan.multiplications if m.kind == "edge"})
    bd.multiplications = len(plan.multiplications)
    del loss, plan

    events: dict[str, float] = {}

    def phase(name: str, seconds: float) -> None:
        events[name] = events.get(name, 0.0) + seconds

    per = bd.per_round_us = {"deepspeed_us": [], "graphscale_us": []}
    variants = ("deepspeed", "graphscale")
    for rnd in range(2 + rounds):
        got: dict[str, float] = {}
        events.clear()
        for name in variants[rnd % 2:] + variants[: rnd % 2]:
            with Impl(name, wl) as impl:
                loss = wl.loss(wl.batch(gen), False)
                dt, _ = timed_backward(torch, impl, loss, device, phase)
                del loss
            got[name + "_us"] = dt * 1e6
        if rnd >= 2:
            for k in per:
                per[k].append(got[k])
            bd.library_phases.append({k: v * 1e6 for k, v in events.items()})
    zero_grads(wl.engines)

    extra_rounds = [g - d for g, d in zip(per["graphscale_us"], per["deepspeed_us"])]
    extra = med(extra_rounds)
    bd.notch_us["total (measured)"] = median_notch(extra_rounds)
    names = sorted({k for r in bd.library_phases for k in r})
    bd.phases_us = {k: med([r.get(k, 0.0) for r in bd.library_phases]) for k in names}
    bd.phases_us["everything else"] = extra - sum(bd.phases_us.values())
    bd.phases_us["total (measured)"] = extra
    return bd


def tiny_pair(torch: Any, device: str) -> Workload:
    """Two engines of one Linear(8, 8) each (GAS 2, 4) under one summed loss:
    a backward that costs almost nothing but DeepSpeed's own bookkeeping."""
    torch.manual_seed(0)
    actor = make_engine(torch.nn.Linear(8, 8).to(device), gas=2)
    critic = make_engine(torch.nn.Linear(8, 8).to(device), gas=4)

    def batch(gen: Any) -> tuple[Any, ...]:
        return (torch.randn(2, 8, generator=gen).to(device),)

    def loss(b: tuple[Any, ...], plain: bool) -> Any:
        a, c = (actor.module, critic.module) if plain else (actor, critic)
        return a(b[0]).pow(2).mean() + c(b[0]).pow(2).mean()

    return Workload((actor, critic), actor, loss, batch)


def measure_install(engines: tuple[Any, ...], reps: int) -> dict[str, Any]:
    """Median ms of ``graphscale.install(*engines)`` and of its ``remove()``,
    garbage collector as the process has it."""
    import graphscale

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


def fixed_costs(torch: Any, args: argparse.Namespace, sizes: list[Size], device: str) -> dict[str, Any]:
    """The sections after the table: NOTE [ Per-backward breakdown ] on the
    small HF pair (and a near-free graph), then install() cost vs heap size."""
    out: dict[str, Any] = {"breakdown": [], "install": []}
    launch = next((s for s in sizes if s.label == "launch"), Size(32, 2, 8 if args.quick else 16, "launch"))
    rounds = 61 if args.quick else 401
    have_hf = importlib.util.find_spec("transformers") is not None
    tiny = tiny_pair(torch, device)
    gc.collect()
    gc.freeze()  # as in the table: installs between rounds do not scan torch's objects
    try:
        pair = None
        if have_hf:
            shape = HF_SHAPES["launch"]
            torch.manual_seed(0)
            am, cm = make_hf_modules(shape["layers"], shape["width"], device)
            pair = hf_workloads(torch, make_engine(am, gas=2), make_engine(cm, gas=4), launch, device)["HF1"]
            name = f"HF1 pair, GPT-2 {shape['layers']} layers x {shape['width']}"
            out["breakdown"].append(measure_breakdown(torch, name, pair, rounds, device))
        out["breakdown"].append(measure_breakdown(torch, "near-free: 2 x Linear(8, 8)", tiny, rounds, device))
    finally:
        gc.unfreeze()
    engines = (pair or tiny).engines
    reps = 3 if args.quick else 7
    gc.collect()
    out["install"].append({"heap": "this process as is", **measure_install(engines, reps)})
    ballast = [[i] for i in range(EXTRA_OBJECTS)]  # lists: always tracked by the collector
    out["install"].append({"heap": f"+{EXTRA_OBJECTS / 1e6:.0f}M live lists",
                           **measure_install(engines, reps)})
    del ballast
    gc.collect()
    out["install_engines"] = "HF1 pair (launch)" if pair is not None else "2 x Linear(8, 8)"
    out["breakdown"] = [vars(b) for b in out["breakdown"]]
    return out


# ----------------------------------------------------------------------------- report
def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def median_notch(xs: list[float]) -> float:
    """Half-width of the usual ~95 % interval of a median: 1.58 IQR / sqrt(n)."""
    q1, q3 = quartiles(xs)
    return 1.58 * (q3 - q1) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")


def quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (float("nan"), float("nan"))
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def summarize(row: Row) -> dict[str, Any]:
    walked = med([float(w) for w in row.walked])
    walk_us = med(row.walk_s) * 1e6
    out: dict[str, Any] = {
        "workload": row.workload,
        "size": row.size,
        "hidden": row.hidden,
        "layers": row.layers,
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
        "row_wall_s": row.wall_s,
        "walked_per_round": row.walked,
        "walk_s_per_round": row.walk_s,
        "multiplications_per_round": row.mults,
        "impl": {},
    }
    for name in IMPLS:
        r = row.ratios[name]
        q1, q3 = quartiles(r)
        out["impl"][name] = {
            "backward_ms_median": med(row.times[name]) * 1e3,
            "ratio_median": med(r),
            "ratio_min": min(r) if r else float("nan"),
            "ratio_max": max(r) if r else float("nan"),
            "ratio_q1": q1,
            "ratio_q3": q3,
            "peak_bytes_median": med([float(p) for p in row.peak[name]]),
            "max_rel_err": row.err[name],
            "times_s": row.times[name],
            "ratios": r,
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


def render(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to width, a rule under the header."""
    lines = [head, *rows]
    widths = [max(len(str(line[c])) for line in lines) for c in range(len(head))]
    out = []
    for n, line in enumerate(lines):
        out.append("  ".join(str(v).ljust(w) for v, w in zip(line, widths)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def row_label(s: dict[str, Any]) -> str:
    return f"{s['workload']} h{s['hidden']}"


def table(summaries: list[dict[str, Any]]) -> str:
    head = ("row", "impl", "bwd ms", "ratio med [min-max]", "nodes", "walked", "walk us", "ns/node (min)",
            "mults", "peak mem", "max rel err")
    lines = []
    for s in summaries:
        for k, name in enumerate(IMPLS):
            i = s["impl"][name]
            gs = name == "graphscale"
            lines.append((
                row_label(s) if k == 0 else "",
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
    return render(head, lines)


def breakdown_table(fixed: dict[str, Any]) -> str:
    """One line per graph: the measured difference and its phases (us per walked backward)."""
    names: list[str] = []
    for b in fixed["breakdown"]:
        names += [k for k in b["phases_us"] if k not in names and k not in ("everything else", "total (measured)")]
    head = ("graph", "nodes", "seeds+hooked", "DS bwd us", "gs extra us", *names, "everything else")
    rows = []
    for b in fixed["breakdown"]:
        ph, notch = b["phases_us"], b["notch_us"]

        def cell(k: str) -> str:
            if k not in ph:
                return "-"
            return f"{ph[k]:.0f}" + (f" +-{notch[k]:.0f}" if k in notch else "")

        rows.append((b["graph"], str(b["nodes"]), f"{b['seeds']}+{b['hooked_nodes']}",
                     f"{med(b['per_round_us']['deepspeed_us']):.0f}", cell("total (measured)"),
                     *(cell(k) for k in names), f"{ph['everything else']:.0f}"))
    return render(head, rows)


def install_table(fixed: dict[str, Any]) -> str:
    rows = [(i["heap"], f"{i['live_objects'] / 1e6:.2f}M", f"{i['install_ms']:.1f}", f"{i['remove_ms']:.1f}",
             f"{i['total_ms']:.1f}") for i in fixed["install"]]
    return render(("heap", "gc-tracked objects", "install ms", "remove ms", "install+remove ms"), rows)


def targets(summaries: list[dict[str, Any]]) -> list[str]:
    """Issue 4 item 4 and issue 11, checked on this run's medians."""
    out = []
    for s in summaries:
        g = s["impl"]["graphscale"]
        one_factor = s["expected_multiplications"] == 1  # W1, W4: the fast path (issues 11, 13)
        bound = (1.01 if one_factor or s["size"] == "compute" else 1.03)
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
        out.append(f"{row_label(s)}: " + ("all targets met" if not bad else "NOT MET: " + "; ".join(bad))
                   + (f"  (met: {'; '.join(good)})" if bad else ""))
    return out


# ----------------------------------------------------------------------------- plot
PLOT_IMPLS = {"leaf-hooks": "tab:orange", "graphscale": "tab:green"}
PANEL_TITLES = {"launch": "launch-bound", "compute": "compute-bound"}


def plot(summaries: list[dict[str, Any]], path: str, title: str) -> None:
    """One panel per size; one group of bars per workload, the implementations
    side by side, each bar drawn from the DeepSpeed-alone line (ratio 1.0) to
    its median ratio, whiskers over the inter-quartile range of the per-round
    ratios.  Hatched: gradients not exact.  Nothing joins different workloads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    labels = [lab for lab in PANEL_TITLES if any(s["size"] == lab for s in summaries)]
    fig, axes = plt.subplots(len(labels), 1, figsize=(9, 3.6 * len(labels) + 0.6), dpi=110, squeeze=False)
    width = 0.36
    for ax, label in zip(axes[:, 0], labels):
        rows = [s for s in summaries if s["size"] == label]
        lo, hi = 1.0, 1.0
        for k, name in enumerate(PLOT_IMPLS):
            xs = [n + (k - 0.5) * width for n in range(len(rows))]
            meds = [s["impl"][name]["ratio_median"] for s in rows]
            q1 = [s["impl"][name]["ratio_q1"] for s in rows]
            q3 = [s["impl"][name]["ratio_q3"] for s in rows]
            bars = ax.bar(xs, [m - 1.0 for m in meds], width, bottom=1.0, color=PLOT_IMPLS[name],
                          edgecolor="black", linewidth=0.5, label=name)
            for bar_, s in zip(bars, rows):
                if s["impl"][name]["max_rel_err"] >= 1e-5:
                    bar_.set_hatch("///")
            ax.errorbar(xs, meds, yerr=[[m - a for m, a in zip(meds, q1)], [b - m for m, b in zip(meds, q3)]],
                        fmt="none", ecolor="black", elinewidth=0.9, capsize=2.5)
            for x, m, b_ in zip(xs, meds, q3):
                ax.annotate(f"{m:.3f}", (x, max(m, b_, 1.0)), textcoords="offset points", xytext=(0, 2),
                            ha="center", va="bottom", fontsize=6.5, rotation=90)
            lo, hi = min(lo, *q1, *meds), max(hi, *q3, *meds)
        ax.axhline(1.0, color="tab:blue", lw=1.4, label="DeepSpeed alone (= 1.0)")
        ticks = []
        for s in rows:
            ds = s["impl"]["deepspeed"]
            wrong = "\nDS wrong" if ds["max_rel_err"] >= 1e-5 else ""
            ticks.append(f"{s['workload']} h{s['hidden']}\n{ds['backward_ms_median']:.1f} ms{wrong}")
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(ticks, fontsize=7.5)
        span = hi - lo
        ax.set_ylim(lo - 0.08 * span - 0.005, hi + 0.25 * span + 0.005)
        ax.set_ylabel("backward / DeepSpeed alone", fontsize=8)
        ax.tick_params(axis="y", labelsize=7.5)
        ax.grid(axis="y", lw=0.3, alpha=0.6)
        ax.set_title(f"{PANEL_TITLES[label]}: bars = median ratio, whiskers = inter-quartile range over rounds",
                     fontsize=8.5)
        handles, names = ax.get_legend_handles_labels()
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///"))
        names.append("hatched: gradients not exact")
        ax.legend(handles, names, fontsize=7, ncol=4, loc="upper left")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def make_sizes(args: argparse.Namespace) -> list[Size]:
    sizes = []
    for h in (int(h) for h in args.sizes.split(",")):
        label = "launch" if h < 128 else "compute"
        seq = (8 if h < 128 else 32) if args.quick else (16 if h < 128 else 64)
        sizes.append(Size(h, 2, seq, label))
    return sizes


def run_table(torch: Any, args: argparse.Namespace, sizes: list[Size], wl_names: list[str], reps: int,
              meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Every requested row, size by size: the tower engines for W1-W6, then
    the GPT-2 engines for HF1-HF2 (built per size, freed after)."""
    from tqdm import tqdm

    _, Tower = make_model_classes()
    tower = [w for w in wl_names if w not in HF_WORKLOADS]
    hf = [w for w in wl_names if w in HF_WORKLOADS]
    if hf and importlib.util.find_spec("transformers") is None:
        print("benchmarks/overhead.py: transformers is not installed (pip install -e '.[bench]'); "
              f"skipping {', '.join(hf)}", file=sys.stderr)
        hf = []
    summaries = []

    def size_reps(size: Size) -> int:
        return reps if size.label == "launch" else max(5, reps // 2)

    rounds = sum((2 + size_reps(s)) * (len(tower) + len(hf)) for s in sizes)
    with tqdm(total=rounds, desc="interleaved rounds", unit="round", dynamic_ncols=True) as bar:
        for size in sizes:
            families = []
            if tower:
                families.append(("tower", args.layers, size.hidden, tower))
            if hf:
                shape = HF_SHAPES[size.label]
                families.append(("hf", shape["layers"], shape["width"], hf))
            for family, layers, hidden, names in families:
                torch.manual_seed(0)
                if family == "tower":
                    actor_m, critic_m = Tower(hidden, layers).to(args.device), Tower(hidden, layers).to(args.device)
                else:
                    actor_m, critic_m = make_hf_modules(layers, hidden, args.device)
                actor, critic = make_engine(actor_m, gas=2), make_engine(critic_m, gas=4)
                fam_size = Size(hidden, size.batch, size.seq, size.label)
                build = tower_workloads if family == "tower" else hf_workloads
                wls = build(torch, actor, critic, fam_size, args.device)
                if family == "hf":
                    wls["HF2"].checkpoint(True)
                    meta["hf_checkpoint_use_reentrant"] = hf_use_reentrant(actor.module)
                    wls["HF2"].checkpoint(False)
                gc.collect()
                gc.freeze()  # keep torch's and deepspeed's objects out of every later collection
                try:
                    for w in names:
                        bar.set_postfix_str(f"{w} hidden {hidden}")
                        row = run_row(torch, w, wls[w], fam_size, layers, size_reps(size), args.device, bar)
                        summaries.append(summarize(row))
                finally:
                    del actor, critic, actor_m, critic_m, wls
                    gc.unfreeze()
                    gc.collect()
    return summaries


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # DeepSpeed puts engines on its accelerator's device, whatever device the module was moved to:
    # the two must agree (an inherited DS_ACCELERATOR=cpu under --device cuda would time CPU engines).
    accelerator = os.environ.setdefault("DS_ACCELERATOR", args.device)
    if accelerator != args.device:
        print(f"benchmarks/overhead.py: --device {args.device} but DS_ACCELERATOR={accelerator}; "
              f"unset it or set DS_ACCELERATOR={args.device}", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/overhead.py: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    import deepspeed

    import graphscale
    from graphscale import _native

    quiet_libraries()
    init_dist(args.device)
    quiet_libraries()
    wl_names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in wl_names if w not in WORKLOADS]
    if unknown:
        print(f"benchmarks/overhead.py: unknown workloads {unknown}; choose from {list(WORKLOADS)}", file=sys.stderr)
        return 2

    t0 = time.perf_counter()
    native = _native.wait()  # a background build on a fresh machine: wait for it before timing
    build_s = time.perf_counter() - t0
    walker = "native" if native is not None else "python"

    sizes = make_sizes(args)
    reps = args.reps if args.reps is not None else (7 if args.quick else 61)
    device_name = (torch.cuda.get_device_name() if args.device == "cuda"
                   else f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores, {args.threads} torch thread(s)")
    meta: dict[str, Any] = {
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
        "hf_shapes": HF_SHAPES,
        "hf_vocab": HF_VOCAB,
        "zero_stage": 1,
        "memory_measure": ("torch.cuda.max_memory_allocated above the start" if args.device == "cuda"
                           else "peak tensor bytes above the start (torch profiler, profile_memory=True)"),
        "plot_whiskers": "inter-quartile range (25th-75th percentile) of the per-round ratios",
        "wall_s": None,
    }
    if importlib.util.find_spec("transformers") is not None:
        import transformers

        meta["transformers"] = transformers.__version__
    summaries = run_table(torch, args, sizes, wl_names, reps, meta)
    table_s = time.perf_counter() - t_start

    title = (f"graphscale overhead: {meta['device']}\ntorch {meta['torch']}, deepspeed {meta['deepspeed']}"
             + (f", transformers {meta['transformers']}" if "transformers" in meta else "")
             + f", {args.layers} blocks/engine (W1-W6), ZeRO 1, walker {walker}")
    print()
    print(title)
    print(table(summaries))
    print()
    for line in targets(summaries):
        print(line)
    if "hf_checkpoint_use_reentrant" in meta:
        print(f"HF2: transformers' gradient checkpointing with its default arguments: "
              f"use_reentrant={meta['hf_checkpoint_use_reentrant']}")

    fixed = None
    if not args.no_fixed_costs:
        t0 = time.perf_counter()
        fixed = fixed_costs(torch, args, sizes, args.device)
        fixed["wall_s"] = time.perf_counter() - t0
        print("\ngraphscale's fixed cost per walked backward (median over "
              f"{fixed['breakdown'][0]['rounds']} interleaved rounds; {fixed['breakdown'][0]['source']}):")
        print(breakdown_table(fixed))
        print(f"\ninstall({fixed['install_engines']}) + remove(), median ms:")
        print(install_table(fixed))
    meta["wall_s"] = time.perf_counter() - t_start
    meta["table_wall_s"] = table_s
    print(f"\nwall time {meta['wall_s']:.0f} s (table {table_s:.0f} s); walker {walker} "
          f"(built/loaded in {build_s:.1f} s); peak memory: {meta['memory_measure']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": summaries, "targets": targets(summaries), "fixed_costs": fixed},
                      f, indent=1)
        print(f"wrote {args.json}")
    if not args.no_plot:
        path = args.plot or os.path.join(os.path.dirname(os.path.abspath(__file__)), "overhead.png")
        plot(summaries, path, title)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
