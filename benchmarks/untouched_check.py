"""What graphscale's check costs on the one-factor path, per backward.

A backward with one factor in play first probes its graph (NOTE [ Fast path ]
in graphscale/_entry/entry.py): under "any" until the first owned leaf, under
the default "plain_params" until an owned leaf and an unowned Parameter are
both seen (so the whole graph when every Parameter is owned), and it plans
instead when a custom autograd.Function (a reentrant checkpoint, ZeRO-3's
linear) may hide leaves.  This script times, on one CPU thread, a backward
with one Group installed against the plain backward of the same graph with
nothing installed, interleaved round by round (the order alternates), median
over many rounds, for each policy.  The path each backward takes
("untouched", "fast path", "planned") is ``graphscale.explain``'s; what
graphscale itself spends inside an installed backward (its decision, the
"walk+plan" phase: the probe, and the plan where it plans; and all its
phases together) comes from ``graphscale.observe.phases``, in one more
installed backward per round that is not timed.

Both timed sides call ``torch.autograd.backward`` with the forward outside
the timed region; the installed side runs inside ``with
graphscale.install(...)``, entered and left around it each round, untimed.
Not a test: no timed assertion.

Only graphscale's public API is used, so two things an earlier version
measured are not here: the installed backward with the check skipped (that
needed replacing graphscale's probe), and the probe alone through the Python
walker (a private function).

    GRAPHSCALE_WALKER=auto OMP_NUM_THREADS=1 python benchmarks/untouched_check.py [--rounds-scale 1.0]
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any, ContextManager

import torch

import graphscale
from graphscale import observe

POLICIES = ("plain_params", "any", "plain")
SIDES = ("plain", "installed")
Made = tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]

# NOTE: thread CPU time, not wall time: on a shared machine a wall clock
# also counts the time this thread waits for a core; CPU time does not, but
# the neighbours' cache pressure and context switches still inflate it (on
# the 2 shared cores at load 3-6, every absolute time here came out several
# times what a quiet core gives; the ratios and the paired differences are
# the numbers to read).  --wall switches to the wall clock.  graphscale's
# phases are its own perf_counter readings, wall clock either way.
Clock = Callable[[], int]  # nanoseconds


def two_linear() -> Made:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
    x = torch.randn(8, 16)
    return model, lambda m: m(x).square().mean()


def gpt2_tiny(reentrant_checkpointing: bool = False) -> Made:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).train()
    if reentrant_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


WORKLOADS: dict[str, tuple[Callable[[], Made], int]] = {
    "2-Linear (16x16, batch 8)": (two_linear, 3000),
    "GPT-2 tiny (2 layers, width 64, seq 32)": (gpt2_tiny, 400),
    "GPT-2 tiny, reentrant checkpointing": (lambda: gpt2_tiny(True), 300),
}


def verdict(plan: graphscale.ExplainedPlan) -> str:
    """The path the backward takes, as ``graphscale.explain`` says."""
    if plan.fast_path:
        return "fast path"
    return "planned" if plan.multiplications else "untouched"


def backward_us(made: Made, clock: Clock) -> float:
    """Microseconds of one backward of a fresh forward."""
    model, loss_of = made
    loss = loss_of(model)
    t0 = clock()
    torch.autograd.backward(loss)
    return (clock() - t0) / 1e3


def phases_us(made: Made) -> dict[str, float]:
    """graphscale's own microseconds, by phase, in one backward of a fresh forward."""
    model, loss_of = made
    seen: dict[str, float] = {}

    def record(phase: str, seconds: float) -> None:
        seen[phase] = seen.get(phase, 0.0) + seconds * 1e6

    with observe.phases(record):
        torch.autograd.backward(loss_of(model))
    return seen


def installed(made: Made, install: Callable[[], ContextManager[Any]], clock: Clock) -> tuple[float, dict[str, float]]:
    """Inside a fresh installation: one backward untimed, one timed, one observed.

    NOTE: the first backward after ``install()`` costs a few microseconds
    more than the next ones (on 2-Linear, ~5 %), which a training loop that
    installs once never sees; it runs untimed, so the timed one is a
    steady-state backward, as in a long-lived installation."""
    with install():
        torch.autograd.backward(made[1](made[0]))
        us = backward_us(made, clock)
        return us, phases_us(made)


def measure(make: Callable[[], Made], rounds: int, policy: str, clock: Clock) -> dict[str, Any]:
    """Interleaved rounds of two backwards of fresh graphs, plain PyTorch
    (nothing installed) and installed (then one more, observed, for
    graphscale's phases); the one to go first alternates."""
    made = make()

    def install() -> ContextManager[Any]:
        return graphscale.install(graphscale.Group(made[0], gas=4), unowned=policy)

    with install():
        plan = graphscale.explain(made[1](made[0]))
    timings: dict[str, list[float]] = {k: [] for k in (*SIDES, "decide", "own")}
    backward_us(made, clock)  # warm both paths
    installed(made, install, clock)
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                if side == "plain":
                    timings["plain"].append(backward_us(made, clock))
                    continue
                us, phases = installed(made, install, clock)
                timings["installed"].append(us)
                timings["decide"].append(phases.get("walk+plan", 0.0))
                timings["own"].append(sum(phases.values()))
    finally:
        gc.enable()
    return {
        "nodes": plan.nodes, "verdict": verdict(plan), **{k: statistics.median(v) for k, v in timings.items()},
        "p10_plain": p10(timings["plain"]), "p10_installed": p10(timings["installed"]),
        "installed_minus_plain": statistics.median(i - p for i, p in zip(timings["installed"], timings["plain"])),
    }


def p10(values: list[float]) -> float:
    """The 10th percentile: the least disturbed rounds on a shared machine."""
    return statistics.quantiles(values, n=10)[0]


COLUMNS = (  # (header, key, format)
    ("plain", "plain", ".1f"), ("installed", "installed", ".1f"), ("ratio", "ratio", ".3f"),
    ("p10 plain", "p10_plain", ".1f"), ("p10 inst.", "p10_installed", ".1f"),
    ("inst.-plain", "installed_minus_plain", ".1f"), ("decide", "decide", ".1f"), ("gs phases", "own", ".1f"),
)


def print_header(wall: bool) -> None:
    print(f"graphscale check cost: torch {torch.__version__}, {platform.python_implementation()} "
          f"{platform.python_version()}, {observe.walker()} walker, 1 thread, "
          f"{'wall clock' if wall else 'thread CPU time'}, load average {os.getloadavg()[0]:.1f}")
    print("microseconds per backward, median over interleaved rounds; p10: 10th percentile (least disturbed "
          "rounds);\ninst.-plain: median of per-round differences, installed - plain (nothing installed);\n"
          "decide / gs phases: graphscale's walk+plan phase (the probe, and the plan where it plans) / all its "
          "phases,\nin one more installed backward per round (graphscale.observe.phases, wall clock)\n")
    head = f"{'workload':40} {'policy':12} {'nodes':>5} {'path':9} " + " ".join(f"{h:>11}" for h, _, _ in COLUMNS)
    print(head)
    print("-" * len(head))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds-scale", type=float, default=1.0, help="rounds per line, times this (at least 20)")
    parser.add_argument("--wall", action="store_true", help="time with the wall clock (perf_counter)")
    args = parser.parse_args()
    clock: Clock = time.perf_counter_ns if args.wall else time.thread_time_ns
    torch.set_num_threads(1)
    print_header(args.wall)  # (waits for the native walker's build first)
    for name, (make, rounds) in WORKLOADS.items():
        for policy in POLICIES:
            r = measure(make, max(20, int(rounds * args.rounds_scale)), policy, clock)
            r["ratio"] = r["installed"] / r["plain"]
            print(f"{name:40} {policy:12} {r['nodes']:>5} {r['verdict']:9} "
                  + " ".join(f"{r[k]:>11{fmt}}" for _, k, fmt in COLUMNS), flush=True)


if __name__ == "__main__":
    main()
