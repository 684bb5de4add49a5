"""DeepSpeed alone under compiled autograd, in a fresh interpreter (no
graphscale imported: nothing of it, not even what an earlier test installed
and removed, can be in what dynamo traces or caches): run by
tests/deepspeed_engines/test_compiled_autograd.py as ``python ca_alone.py
CASES STEPS CONFIGS`` (CONFIGS: the DeepSpeed config per ZeRO stage, made by
helpers.engines.ds_config, which imports deepspeed, and its caller
graphscale, so it is not imported here).  Prints one JSON line: per case, whether STEPS micro-steps
with step() ran, DeepSpeed's error, and compiled autograd's captures after
each micro-step."""
from __future__ import annotations

import json
import os
import sys

from helpers.ranks import finish  # imports neither deepspeed nor graphscale


def main() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")

    import deepspeed
    import torch
    import torch._dynamo
    import torch._dynamo.compiled_autograd as ca
    from torch._dynamo.utils import counters

    assert "graphscale" not in sys.modules
    deepspeed.init_distributed(dist_backend="gloo")
    out: dict[str, object] = {}
    for case in json.loads(sys.argv[1]):
        switch, direct, stage, program = case
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(7)
        actor = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
        critic = torch.nn.Linear(4, 1)
        cfg = json.loads(sys.argv[3])[str(stage)]
        opt = torch.optim.SGD(actor.parameters(), lr=0.1)
        engine, *_ = deepspeed.initialize(model=actor, optimizer=opt, config=cfg)
        if switch == "deepspeed":
            engine.compile(backend="eager", compiled_autograd_enabled=True)
        captures = []
        try:
            for _ in range(int(sys.argv[2])):
                y = engine(torch.randn(2, 4))
                loss = critic(y).sum() if program == "critic" else y.sum()
                if switch == "torch":
                    with ca._enable(torch.compile(backend="eager")):
                        loss.backward() if direct else engine.backward(loss)
                else:
                    loss.backward() if direct else engine.backward(loss)
                engine.step()
                captures.append(int(counters["compiled_autograd"]["captures"]))
            out[json.dumps(case)] = {"ok": True, "error": "", "captures": captures}
        except Exception as exc:  # DeepSpeed's own failure: reported, not raised
            error = f"{type(exc).__name__}: {str(exc)[:200]}"
            out[json.dumps(case)] = {"ok": False, "error": error, "captures": captures}
    finish(out)  # NOT the interpreter's teardown: tests/helpers/ranks.py


if __name__ == "__main__":
    main()
