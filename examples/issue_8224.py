"""DeepSpeed issue 8224: ``lm_loss(engine(batch)) + lm_loss(engine.module(batch2))``.

What it shows
    One DeepSpeed engine (a GPT-2 language model, GAS 4) used twice in one
    loss: once through the engine, once through ``engine.module`` directly
    (a second batch, a reference pass, a consistency term).  Every parameter
    should get 1/4 of its plain gradient.  DeepSpeed alone divides at the
    engine's output tensors, so the ``engine.module`` path is not divided
    (``loss.backward()``, and ``engine.backward`` before DeepSpeed 0.19.6),
    and a Hugging Face output whose ``loss`` is computed from its hooked
    ``logits`` is divided twice (1/16).  ``graphscale.install(engine)`` puts
    1/4 on the engine's parameters, whichever path reached them.

    Each row runs one backward and compares every parameter's gradient with
    a plain-PyTorch oracle (the same model built from the same seed, the
    same batches, 1/4 x its gradient); "graphscale's plan" is what
    ``graphscale.explain(loss)`` reports for that backward.

Run (from a clone of graphscale)
    pip install torch==2.13.0 && pip install -e ".[test]"
    python examples/issue_8224.py

    CPU only, one process: the script starts its own one-rank gloo process
    group.  A tiny GPT-2 config with random weights: nothing is downloaded.
    About 15 s on 2 CPU cores.  Exit code 1 if graphscale is not exact.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import socket
import sys
import time
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F

import graphscale

GAS = 4
VOCAB, SEQ, BATCH = 64, 8, 2
EXACT = 1e-5  # largest relative error still called exact (float32 round-off is ~1e-7)


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


def make_lm(seed: int = 1) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).train()


def make_engine(deepspeed: Any, model: torch.nn.Module, stage: int) -> Any:
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # plain torch SGD
        "steps_per_print": 10**9,
    }
    with contextlib.redirect_stdout(sys.stderr):
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                          config=config)
    engine.set_gradient_accumulation_boundary(True)  # reduce now: gradients readable after one backward
    return engine


# ---------------------------------------------------------------- the shapes
def lm_loss(out: Any, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a model output."""
    logits = out.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def issue_shape(engine: Any, module: torch.nn.Module, ids: torch.Tensor, ids2: torch.Tensor) -> torch.Tensor:
    """The issue's shape: the engine's forward plus its module's."""
    return lm_loss(engine(input_ids=ids), ids) + lm_loss(module(input_ids=ids2), ids2)


def hf_labels_shape(engine: Any, module: torch.nn.Module, ids: torch.Tensor, ids2: torch.Tensor) -> torch.Tensor:
    """The same with Hugging Face's own loss (``labels=``): ``.loss`` is made from the hooked ``.logits``."""
    return engine(input_ids=ids, labels=ids).loss + module(input_ids=ids2, labels=ids2).loss


SHAPES: dict[str, Callable[..., torch.Tensor]] = {
    "lm_loss(engine(x)) + lm_loss(engine.module(y))": issue_shape,
    "engine(x, labels=x).loss + engine.module(y, labels=y).loss": hf_labels_shape,
}


def rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Largest |got - want| / max|want| over a list of tensors."""
    return max(float((g.float() - w).abs().max()) / (float(w.abs().max()) or 1.0) for g, w in zip(got, want))


def run(deepspeed: Any, shape: str, stage: int, call: str, govern: bool) -> tuple[float, str]:
    """One backward; the largest relative gradient error against the oracle and graphscale's plan."""
    from deepspeed.utils import safe_get_full_grad

    g = torch.Generator().manual_seed(0)
    ids, ids2 = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    plain = make_lm()
    SHAPES[shape](plain, plain, ids, ids2).backward()
    want = [p.grad / GAS for p in plain.parameters()]

    engine = make_engine(deepspeed, make_lm(), stage)
    plan = ""
    with graphscale.install(engine) if govern else contextlib.nullcontext():
        loss = SHAPES[shape](engine, engine.module, ids, ids2)
        if govern:
            explained = graphscale.explain(loss)
            plan = explained.note.split(",")[0] if explained.fast_path else f"{len(explained.multiplications)} mult."
        if call == "engine.backward(loss)":
            engine.backward(loss)
        else:
            loss.backward()
    return rel_err([safe_get_full_grad(p) for p in engine.module.parameters()], want), plan


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
    rows, worst = [], 0.0
    for shape in SHAPES:
        for stage in (1, 2):
            for call in ("engine.backward(loss)", "loss.backward()"):
                alone, _ = run(deepspeed, shape, stage, call, govern=False)
                governed, plan = run(deepspeed, shape, stage, call, govern=True)
                worst = max(worst, governed)
                rows.append((shape, f"ZeRO {stage}", call, verdict(alone), verdict(governed), plan))
    print(f"DeepSpeed issue 8224: one engine (tiny GPT-2, GAS {GAS}) and its module in one loss; DeepSpeed "
          f"{deepspeed.__version__}, torch {torch.__version__}, CPU, one rank")
    print(f"largest relative gradient error vs a plain-PyTorch oracle (every parameter: 1/{GAS} x its gradient)")
    print()
    print_table(("loss", "stage", "backward", "DeepSpeed alone", "with graphscale", "graphscale's plan"), rows)
    print(f"({time.perf_counter() - t0:.1f} s)")
    if worst <= EXACT:
        print(f"graphscale is exact: every parameter gets 1/{GAS} of its gradient (max rel err {worst:.2g})")
        return 0
    print(f"graphscale is NOT exact: max relative error {worst:.2g}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
