"""Two engines in one loss under compiled autograd on two gloo ranks, under
graphscale (tests/helpers/ca_engines.py): run once per rank by
tests/deepspeed_engines/test_compiled_autograd_engines.py as ``python
ca_two_ranks.py CASES CONFIGS``.  Prints one JSON line: per case, what
:func:`helpers.ca_engines.train` returned on this rank."""
from __future__ import annotations

import json
import sys

from helpers.ranks import deepspeed_rank, finish


def main() -> None:
    rank, world = deepspeed_rank()

    import graphscale

    from helpers.ca_engines import train

    configs = json.loads(sys.argv[2])
    out = {json.dumps(case): train(*case, configs, install=graphscale.install, rank=rank, world=world)
           for case in json.loads(sys.argv[1])}
    finish(out)  # NOT the interpreter's teardown: tests/helpers/ranks.py


if __name__ == "__main__":
    main()
