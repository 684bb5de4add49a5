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

This script is the entry point; the benchmark is the package next to it,
``benchmarks/gsbench/`` (environment, workloads, implementations, timing,
fixed costs, report).

    python benchmarks/overhead.py            # default: ~8 min on 2 cores (twice that on busy ones)
    python benchmarks/overhead.py --quick    # ~2 min
    python benchmarks/overhead.py --device cuda --json out.json --plot out.png
"""
from __future__ import annotations

import os
import sys


def run() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:  # (python puts it there when run as a script; not under -P or runpy)
        sys.path.insert(0, here)
    from gsbench.cli import main

    return main(description=(__doc__ or "").split("\n\n")[0])


if __name__ == "__main__":
    sys.exit(run())
