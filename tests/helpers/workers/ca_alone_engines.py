"""DeepSpeed alone, two engines in one loss under compiled autograd
(tests/helpers/ca_engines.py), in a fresh interpreter (as ca_alone.py, and
why): run by tests/deepspeed_engines/test_compiled_autograd_engines.py as
``python ca_alone_engines.py CASES CONFIGS`` (CASES: [switch, call, stage]
lists; CONFIGS: each engine's DeepSpeed config).  Prints one JSON line: per
case, what :func:`helpers.ca_engines.train` returned."""
from __future__ import annotations

import json
import os
import sys

from helpers.ranks import finish  # imports neither deepspeed nor graphscale


def main() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")

    import deepspeed

    from helpers.ca_engines import train

    assert "graphscale" not in sys.modules
    deepspeed.init_distributed(dist_backend="gloo")
    configs = json.loads(sys.argv[2])
    out = {json.dumps(case): train(*case, configs) for case in json.loads(sys.argv[1])}
    finish(out)  # NOT the interpreter's teardown: tests/helpers/ranks.py


if __name__ == "__main__":
    main()
