"""What the benchmark runs: names, shapes and the expected multiplications.

No torch here: the command line reads these before anything heavy is imported.
"""
from __future__ import annotations

from dataclasses import dataclass

PROG = "benchmarks/overhead.py"  # how messages name the benchmark

IMPLS = ("deepspeed", "leaf-hooks", "graphscale")  # the order of the table (and the first round)
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
# --quick counts these rows, at the first (launch-bound) size, and the cost gate
# holds their counts (NOTE [ The rows in the gate ] in gsbench/rowcounts.py).
QUICK_COUNTED = ("W1", "W2", "W5", "HF1")
DEFAULT_SIZES, DEFAULT_LAYERS = "32,256", 12  # --sizes, --layers
EXTRA_OBJECTS = 3_000_000  # install() cost section: live objects added to the heap


@dataclass
class Size:
    hidden: int
    batch: int
    seq: int
    label: str  # "launch" or "compute"


def make_sizes(sizes: str, quick: bool) -> list[Size]:
    """``--sizes`` as :class:`Size` objects: below hidden 128 launch-bound."""
    out = []
    for h in (int(h) for h in sizes.split(",")):
        label = "launch" if h < 128 else "compute"
        seq = (8 if h < 128 else 32) if quick else (16 if h < 128 else 64)
        out.append(Size(h, 2, seq, label))
    return out
