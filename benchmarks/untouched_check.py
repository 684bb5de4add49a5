"""What the issue-13 check costs on the one-factor path, per backward.

Since issue 13 a backward with one factor in play first probes its graph
(NOTE [ Fast path ] in graphscale/_backward.py): under "any" until the first
owned leaf, under the default "plain_params" until an owned leaf and an
unowned Parameter are both seen (so the whole graph when every Parameter is
owned), and it plans instead when a custom autograd.Function (a reentrant
checkpoint, ZeRO-3's linear) may hide leaves.  This script times, on one CPU
thread, a backward with one Group installed against the plain backward of the
same graph, interleaved round by round (the order alternates), median over
many rounds, for each policy; against the same installation with the check
skipped (the probe answering "fast path" as before issue 13); and the probe
alone on a fresh graph.

Both sides call the backward function directly (plain: torch's
``torch.autograd.backward`` as graphscale found it; installed: the governed
one), with the forward outside the timed region.  Not a test: no timed
assertion; the numbers go into the closing note of issue 13.

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
from typing import Any

import torch

import graphscale
from graphscale import _backward, _native, _planning, _state

POLICIES = ("plain_params", "any", "plain")

# NOTE: thread CPU time, not wall time: on a shared machine a wall clock
# also counts the time this thread waits for a core; CPU time does not, but
# the neighbours' cache pressure and context switches still inflate it (on
# the 2 shared cores at load 3-6, every absolute time here came out several
# times what a quiet core gives; the ratios and the paired differences are
# the numbers to read).  --wall switches to the wall clock.
_clock = time.thread_time_ns


def two_linear() -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
    x = torch.randn(8, 16)
    return model, lambda m: m(x).square().mean()


def gpt2_tiny(reentrant_checkpointing: bool = False) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).train()
    if reentrant_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


WORKLOADS: dict[str, tuple[Callable[[], Any], int]] = {
    "2-Linear (16x16, batch 8)": (two_linear, 3000),
    "GPT-2 tiny (2 layers, width 64, seq 32)": (gpt2_tiny, 400),
    "GPT-2 tiny, reentrant checkpointing": (lambda: gpt2_tiny(True), 300),
}


def _nodes(root: torch.Tensor) -> int:
    """The grad_fn nodes reachable from ``root`` (what a whole-graph probe walks)."""
    assert root.grad_fn is not None
    seen, stack = {root.grad_fn}, [root.grad_fn]
    while stack:
        for nxt, _ in stack.pop().next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return len(seen)


def _no_probe(roots: Any, state: Any) -> tuple[int, bool]:
    """What the one-factor path did before issue 13: no check (FAST, no custom Function seen)."""
    return _planning.FAST, False


SIDES = ("plain", "installed", "unchecked")


def measure(make: Callable[[], Any], rounds: int, policy: str) -> dict[str, Any]:
    """Interleaved rounds of three backwards of fresh graphs: plain PyTorch,
    installed, and installed with the check skipped (``probe`` answering FAST
    as before issue 13); then the probe alone on a fresh graph, native (or
    whichever walker is in use) and Python."""
    model, loss_of = make()
    plain_backward = _backward.ORIGINAL_BACKWARD
    probe = _planning.probe
    timings: dict[str, list[float]] = {k: [] for k in (*SIDES, "probe", "probe_python")}
    with graphscale.install(graphscale.Group(model, gas=4), unowned=policy):
        state = _state.current()
        assert state is not None
        loss = loss_of(model)
        nodes = _nodes(loss)
        verdict = {_planning.NO_OWNED: "untouched", _planning.FAST: "fast path", _planning.PLAN: "planned"}[
            probe([loss], state)[0]]
        for side in SIDES:  # warm every path
            _planning.probe = _no_probe if side == "unchecked" else probe
            (plain_backward if side == "plain" else torch.autograd.backward)(loss_of(model))
        gc.collect()
        gc.disable()
        try:
            for r in range(rounds):
                order = SIDES[r % 3:] + SIDES[:r % 3]
                if r % 2:
                    order = order[::-1]
                for side in order:
                    _planning.probe = _no_probe if side == "unchecked" else probe
                    loss = loss_of(model)
                    fn = plain_backward if side == "plain" else torch.autograd.backward
                    t0 = _clock()
                    fn(loss)
                    timings[side].append((_clock() - t0) / 1e3)
                _planning.probe = probe
                loss = loss_of(model)
                t0 = _clock()
                probe([loss], state)
                timings["probe"].append((_clock() - t0) / 1e3)
                loss = loss_of(model)
                t0 = _clock()
                _planning._probe_python([loss], state)
                timings["probe_python"].append((_clock() - t0) / 1e3)
                del loss
        finally:
            _planning.probe = probe
            gc.enable()
    med = {k: statistics.median(v) for k, v in timings.items()}
    return {
        "nodes": nodes, "verdict": verdict, **med,
        "p10_plain": _p10(timings["plain"]), "p10_installed": _p10(timings["installed"]),
        "installed_minus_plain": statistics.median(i - p for i, p in zip(timings["installed"], timings["plain"])),
        "check": statistics.median(i - u for i, u in zip(timings["installed"], timings["unchecked"])),
    }


def _p10(values: list[float]) -> float:
    """The 10th percentile: the least disturbed rounds on a shared machine."""
    return statistics.quantiles(values, n=10)[0]


COLUMNS = (  # (header, key, format)
    ("plain", "plain", ".1f"), ("installed", "installed", ".1f"), ("ratio", "ratio", ".3f"),
    ("p10 plain", "p10_plain", ".1f"), ("p10 inst.", "p10_installed", ".1f"),
    ("inst.-plain", "installed_minus_plain", ".1f"), ("check", "check", ".1f"),
    ("probe", "probe", ".1f"), ("py probe", "probe_python", ".1f"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds-scale", type=float, default=1.0)
    parser.add_argument("--wall", action="store_true", help="time with the wall clock (perf_counter)")
    args = parser.parse_args()
    global _clock
    if args.wall:
        _clock = time.perf_counter_ns
    torch.set_num_threads(1)
    native = _native.wait()
    walker = "native" if native is not None else f"python ({_native.status()})"
    print(f"graphscale check cost: torch {torch.__version__}, {platform.python_implementation()} "
          f"{platform.python_version()}, {walker} walker, 1 thread, "
          f"{'wall clock' if args.wall else 'thread CPU time'}, load average {os.getloadavg()[0]:.1f}")
    print("microseconds per backward, median over interleaved rounds; p10: 10th percentile (least disturbed "
          "rounds);\ninst.-plain and check: medians of per-round differences, installed - plain and installed - "
          "installed with the check skipped;\nprobe / py probe: the check alone on a fresh graph (walker in use / "
          "Python twin)\n")
    head = f"{'workload':40} {'policy':12} {'nodes':>5} {'path':9} " + " ".join(f"{h:>11}" for h, _, _ in COLUMNS)
    print(head)
    print("-" * len(head))
    for name, (make, rounds) in WORKLOADS.items():
        for policy in POLICIES:
            r = measure(make, max(20, int(rounds * args.rounds_scale)), policy)
            r["ratio"] = r["installed"] / r["plain"]
            print(f"{name:40} {policy:12} {r['nodes']:>5} {r['verdict']:9} "
                  + " ".join(f"{r[k]:>11{fmt}}" for _, k, fmt in COLUMNS), flush=True)


if __name__ == "__main__":
    main()
