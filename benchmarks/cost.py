"""graphscale's cost per backward, counted: instructions and Python calls
that graphscale adds to a backward, and a gate on them.

Timings on a shared machine swing 10-20 % between runs; these counts do not
move with the machine's load.  A fixed set of cases (two ZeRO-1 engines of
one Linear(8, 8), GAS 2 and 4: mixed ``loss.backward()``, ``engine.backward``,
the fast path, one reentrant-checkpointed block; one engine alone; a walk of
a 2000-op chain between two groups), each a warm loop of backwards run
without graphscale (DeepSpeed alone, plain torch) and with it installed, in
two processes: one counts Python calls (``sys.setprofile``), one runs under
valgrind's callgrind and counts instructions inside a dedicated C function
that each backward runs in.  What graphscale adds per backward is the
difference.  The figures of the last landed commit are stored in
``benchmarks/cost_baseline.json``; ``--check`` fails where a case grew past
the margin (3 % + a small slack) without a ``Cost-Change: <case>: <why>``
trailer on a commit since the baseline's.  See docs/benchmark.md,
"Deterministic counts".

    python benchmarks/cost.py             # measure, print beside the baseline (~3 min on 2 cores)
    python benchmarks/cost.py --check     # the gate (CI): exit 1 on an unexplained growth
    python benchmarks/cost.py --update    # two runs, write the baseline at this commit
"""
from __future__ import annotations

import os
import sys


def run() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:  # (python puts it there when run as a script; not under -P or runpy)
        sys.path.insert(0, here)
    from gsbench.cost_cli import main

    return main(description=(__doc__ or "").split("\n\n")[0])


if __name__ == "__main__":
    sys.exit(run())
