"""What graphscale.audit costs per micro-step, on several gloo ranks.

Two DeepSpeed engines (an MLP tower each, GAS 2 and 4, one nested loss that
forwards A twice), at ZeRO stage 2 and then at ZeRO stage 3 by default (one
launch of the ranks per stage).  At stage 2 the audit's reference is a second
pass over the backward's own graph; at stage 3, where a graph is
backpropagated only once, it is the micro-step's forward replayed
(``check.replayable``, NOTE [ Audit by replay ] in graphscale/_tools/replay.py):
about one more forward and backward.  The loss is computed by the same
wrapped function at both stages (at stage 2 the wrapper only calls it).
Each rank runs interleaved rounds: a block of micro-steps governed by
graphscale alone, then the same block governed and audited, alternating
which goes first; each micro-step is forward + backward + ``step()`` of both
engines, timed on rank 0 with all ranks in lockstep.  Prints, per stage, the
median per-micro-step time of each and their ratio.  Not a test: no timed
assertion.

    python benchmarks/audit_cost.py [--ranks 2] [--stages 2,3] [--width 256] [--layers 6] [--rounds 9]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(args: argparse.Namespace, stage: int) -> int:
    """One launch of the ranks for ``stage`` (ZeRO 3 replaces torch's linear process-wide: a process of its own)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(args.ranks),
               OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    argv = [*sys.argv[1:], "--worker", "--stages", str(stage)]
    procs = [subprocess.Popen([sys.executable, __file__, *argv],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=None if r == 0 else subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for r in range(args.ranks)]
    return max(p.wait() for p in procs)


def _engine(width: int, layers: int, gas: int, stage: int, seed: int) -> object:
    import deepspeed
    import torch

    torch.manual_seed(seed)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    net = torch.nn.Sequential(*blocks)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=1e-4), config=cfg)
    return engine


def _worker(args: argparse.Namespace) -> None:
    import contextlib

    import deepspeed
    import torch

    import graphscale

    deepspeed.utils.logger.setLevel("ERROR")
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's start-up chatter: only the table on stdout
        deepspeed.init_distributed(dist_backend="gloo")
        stage = int(args.stages)
        A = _engine(args.width, args.layers, 2, stage, 0)
        B = _engine(args.width, args.layers, 4, stage, 1)
    rank = torch.distributed.get_rank()
    x = torch.randn(16, args.width, generator=torch.Generator().manual_seed(rank))

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        return B(A(x)).square().mean() + A(x).mean()

    def block(audited: bool) -> float:
        with graphscale.install(A, B), (graphscale.audit() if audited else contextlib.nullcontext()) as check:
            step_loss = check.replayable(loss_of) if audited else loss_of
            torch.distributed.barrier()
            t0 = time.perf_counter()
            for _ in range(4):  # one window of B, two of A: every boundary inside the block
                step_loss(x).backward()
                A.step()
                B.step()
            torch.distributed.barrier()
            return (time.perf_counter() - t0) / 4

    block(False), block(True)  # warm-up
    plain, audited = [], []
    for r in range(args.rounds):
        for a in ((False, True) if r % 2 else (True, False)):
            (audited if a else plain).append(block(a))
    if rank == 0:
        p, q = statistics.median(plain), statistics.median(audited)
        how = "replayed forward" if stage == 3 else "same graph"
        print(f"  ZeRO {stage}  {how:<16}  {p * 1e3:8.2f} ms  {q * 1e3:8.2f} ms  {q / p:5.2f}x", flush=True)
    sys.stdout.flush()
    os._exit(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--stages", default="2,3", help="ZeRO stages, comma-separated (0-3)")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return 0
    stages = [int(s) for s in args.stages.split(",")]
    if not set(stages) <= {0, 1, 2, 3}:
        ap.error(f"--stages: ZeRO stages are 0-3, got {args.stages}")
    print(f"graphscale.audit cost: {args.ranks} rank(s), 2 engines x {args.layers} x Linear({args.width}), "
          f"micro-step median over {args.rounds} rounds of 4 (forward, backward, step of both)")
    print(f"  stage   {'reference':<16}  {'governed':>11}  {'audited':>11}  ratio", flush=True)
    return max(_launch(args, stage) for stage in stages)


if __name__ == "__main__":
    sys.exit(main())
