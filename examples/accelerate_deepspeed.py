"""Accelerate with DeepSpeed: two engines made by ``accelerator.prepare``, exact per engine.

What it shows
    An actor (GAS 2) and a critic (GAS 4), each a DeepSpeed engine made by
    Accelerate's DeepSpeed integration (``DeepSpeedPlugin``), trained on one
    loss with ``accelerator.backward(loss)`` inside
    ``accelerator.accumulate(...)``.  ``accelerator.backward`` is the
    engine's ``backward``, so DeepSpeed's GAS division goes wrong exactly as
    without Accelerate when one loss mixes two engines.
    ``graphscale.install(actor, critic)`` makes every engine's weights match
    a plain reference that accumulates each model's gradient times its own
    1/GAS and steps it every GAS micro-steps.

    How Accelerate takes two DeepSpeed engines (accelerate 1.x):
      * one ``Accelerator`` per engine; the first is made with
        ``deepspeed_plugins={"actor": ..., "critic": ...}`` and the second
        shares them; ``accelerator.state.select_deepspeed_plugin(name)``
        before each ``prepare``;
      * Accelerate keeps ONE gradient-accumulation count per process, taken
        from the engine prepared last: prepare the engine whose
        ``accelerator.backward`` you call (here the actor) last;
      * the critic's accelerator never runs ``backward`` (one loss, one
        backward): call ``critic.step()`` every micro-step, it counts its own
        boundary;
      * ``gradient_clipping`` is set to 0 (Accelerate fills "auto" with 1.0;
        the reference does not clip), and ``train_micro_batch_size_per_gpu``
        is a number (no DataLoader is prepared).

Run (from a clone of graphscale)
    pip install torch==2.13.0 && pip install -e ".[test]"
    python examples/accelerate_deepspeed.py

    CPU only, one process: the script sets RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT and starts a one-rank gloo process group
    before Accelerate (without them DeepSpeed looks for MPI).  About 15 s on
    2 CPU cores.  Exit code 1 if graphscale is not exact.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import os
import socket
import sys
import time
import warnings
from typing import Any, Callable

import torch

import graphscale

GAS = {"actor": 2, "critic": 4}
MICRO_STEPS = 8  # two windows of the critic, four of the actor
LR = 0.1
EXACT = 1e-5  # largest relative error still called exact (float32 round-off is ~1e-7)
ZERO_STAGE = 2


# ---------------------------------------------------------------- set-up
def start_deepspeed() -> Any:
    """Import DeepSpeed for the CPU and start a one-rank gloo process group."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        os.environ.setdefault(key, value)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's start-up chatter
        import deepspeed

        ds_comm = importlib.import_module("deepspeed.comm.torch")  # (deepspeed.comm.torch the attribute is torch)
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        if hasattr(ds_comm, "build_shm_op"):
            # One rank needs no shared-memory collectives: skip DeepSpeed's JIT
            # build of its CPU shm op (minutes on 2 cores with a cold cache).
            ds_comm.build_shm_op = lambda: None
        if not torch.distributed.is_initialized():
            deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def ds_config(gas: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": ZERO_STAGE},
        "zero_allow_untested_optimizer": True,  # plain torch SGD
        "steps_per_print": 10**9,
    }


def make_net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def fresh_accelerate_state() -> None:
    """Accelerate keeps process-wide singletons; this script builds its
    Accelerators twice (DeepSpeed alone, then with graphscale), so it resets
    them in between.  A training script that builds them once does not need this."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


# ---------------------------------------------------------------- the losses
LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "(actor(x) + critic(y))^2": lambda actor, critic, x, y: (actor(x) + critic(y)).square().sum(),
    "critic(actor(x))^2": lambda actor, critic, x, y: critic(actor(x)).square().sum(),
}


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)


def rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Largest |got - want| / max|want| over a list of tensors."""
    return max(float((g - w).abs().max()) / (float(w.abs().max()) or 1.0) for g, w in zip(got, want))


def train(loss_name: str, govern: bool) -> float:
    """Train through Accelerate beside a per-engine-GAS reference; the largest
    relative weight error over both engines and every micro-step."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.utils import safe_get_full_fp32_param

    fresh_accelerate_state()
    loss_fn = LOSSES[loss_name]
    refs = {"actor": make_net(1), "critic": make_net(2)}
    plugins = {n: DeepSpeedPlugin(hf_ds_config=ds_config(GAS[n])) for n in refs}
    # One Accelerator per engine; the actor, whose accelerator.backward runs, prepared last.
    accelerators = {"critic": Accelerator(deepspeed_plugins=plugins), "actor": Accelerator()}
    engines = {}
    with contextlib.redirect_stdout(sys.stderr):
        for name, acc in accelerators.items():
            acc.state.select_deepspeed_plugin(name)
            model = copy.deepcopy(refs[name])
            engines[name], _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    accelerator, actor, critic = accelerators["actor"], engines["actor"], engines["critic"]
    if accelerator.gradient_accumulation_steps != GAS["actor"]:
        raise RuntimeError("Accelerate's gradient-accumulation count follows the engine prepared last: "
                           "prepare the engine whose accelerator.backward runs last.")

    opts = {n: torch.optim.SGD(r.parameters(), lr=LR) for n, r in refs.items()}
    acc_grads = {n: [torch.zeros_like(p) for p in r.parameters()] for n, r in refs.items()}
    worst = 0.0
    with graphscale.install(actor, critic) if govern else contextlib.nullcontext():
        for step in range(MICRO_STEPS):
            x, y = data(step)
            with accelerator.accumulate(actor):
                loss = loss_fn(actor, critic, x, y)
                accelerator.backward(loss)  # the actor's engine.backward; it steps at Accelerate's boundary
                critic.step()  # the critic counts its own boundary (GAS 4)
            # the reference: each model's gradient times its own 1/GAS, a step every GAS micro-steps
            ref_loss = loss_fn(refs["actor"], refs["critic"], x, y)
            for name, ref in refs.items():
                grads = torch.autograd.grad(ref_loss, list(ref.parameters()), retain_graph=True)
                for a, g in zip(acc_grads[name], grads):
                    a += g / GAS[name]
                if (step + 1) % GAS[name] == 0:
                    for p, a in zip(ref.parameters(), acc_grads[name]):
                        p.grad = a.clone()
                        a.zero_()
                    opts[name].step()
            for name, engine in engines.items():
                worst = max(worst, rel_err([safe_get_full_fp32_param(p) for p in engine.module.parameters()],
                                           [p.detach() for p in refs[name].parameters()]))
    return worst


def verdict(err: float) -> str:
    return f"{err:.2g} {'exact' if err <= EXACT else 'WRONG'}"


def print_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(len(header))]
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print("  " + "  ".join(f"{c:<{w}}" for c, w in zip(r, widths)).rstrip())


def main() -> int:
    t0 = time.perf_counter()
    warnings.filterwarnings("ignore")
    deepspeed = start_deepspeed()
    import accelerate

    rows, worst = [], 0.0
    for loss_name in LOSSES:
        alone, governed = train(loss_name, govern=False), train(loss_name, govern=True)
        worst = max(worst, governed)
        rows.append((loss_name, verdict(alone), verdict(governed)))
    print(f"Accelerate {accelerate.__version__} + DeepSpeed {deepspeed.__version__} ZeRO {ZERO_STAGE}: actor "
          f"(GAS {GAS['actor']}) and critic (GAS {GAS['critic']}), accelerator.backward inside accumulate(), "
          f"torch {torch.__version__}, CPU, one rank")
    print(f"largest relative weight error over {MICRO_STEPS} micro-steps vs a per-engine-GAS plain reference")
    print()
    print_table(("loss", "Accelerate + DeepSpeed alone", "with graphscale"), rows)
    print(f"({time.perf_counter() - t0:.1f} s)")
    if worst <= EXACT:
        print(f"graphscale is exact: both engines' weights match the reference after every micro-step "
              f"(max rel err {worst:.2g})")
        return 0
    print(f"graphscale is NOT exact: max relative error {worst:.2g}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
