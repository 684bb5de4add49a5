"""RLHF actor and critic: two DeepSpeed engines in one PPO loss, each exactly its own 1/GAS.

What it shows
    A GPT-2 actor (the policy) and a GPT-2 critic (a backbone and a value
    head reading the actor's last hidden state), each its own DeepSpeed
    engine with its own gradient accumulation: actor GAS 2, critic GAS 4.
    One PPO-style loss (clipped policy surrogate + value regression) trains
    both.  DeepSpeed alone divides by the wrong GAS somewhere: by the calling
    engine's GAS for the whole loss (DeepSpeed >= 0.19.6, ``engine.backward``),
    or at every hooked output tensor, so a gradient that crosses two engines'
    outputs is divided twice (``loss.backward()``, and DeepSpeed <= 0.19.5).
    ``graphscale.install(actor, critic)`` gives every parameter its own
    engine's 1/GAS, whatever the graph and however backward is called.

    Part 1 checks one backward per variant (critic on the actor's hidden
    state detached or not; ``actor.backward(loss)`` or ``loss.backward()``)
    against a plain-PyTorch oracle: the same models built from the same seeds,
    the same batch, each model's gradient times 1/GAS of its engine.
    Part 2 trains both engines for two critic windows (8 micro-steps,
    ``engine.step()`` after each) and compares the weights with a plain
    reference that steps each model every GAS micro-steps.

Run (from a clone of graphscale)
    pip install torch==2.13.0 && pip install -e ".[test]"
    python examples/rlhf_actor_critic.py

    CPU only, one process: the script starts its own one-rank gloo process
    group.  Tiny GPT-2 configs with random weights: nothing is downloaded.
    About 20 s on 2 CPU cores.  Exit code 1 if graphscale is not exact.
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
from typing import Any

import torch

import graphscale

GAS = {"actor": 2, "critic": 4}
VOCAB, SEQ, BATCH = 64, 8, 2
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


def ds_config(gas: int, stage: int = ZERO_STAGE) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,  # the reference does not clip
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # plain torch SGD
        "steps_per_print": 10**9,
    }


def make_engine(deepspeed: Any, model: torch.nn.Module, gas: int, lr: float, stage: int = ZERO_STAGE) -> Any:
    with contextlib.redirect_stdout(sys.stderr):
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
                                          config=ds_config(gas, stage))
    return engine


# ---------------------------------------------------------------- models
def gpt2_config(dropout: float = 0.0) -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=dropout,
                      embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False, bos_token_id=0, eos_token_id=0)


def make_actor(seed: int = 1, dropout: float = 0.0) -> torch.nn.Module:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(gpt2_config(dropout)).train()


class Critic(torch.nn.Module):
    """A value model as RLHF trainers build one: a GPT-2 backbone and a value
    head, one value per position; it reads the actor's hidden states."""

    def __init__(self, dropout: float = 0.0) -> None:
        from transformers import GPT2Model

        super().__init__()
        self.backbone = GPT2Model(gpt2_config(dropout))
        self.value_head = torch.nn.Linear(32, 1)

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        return self.value_head(self.backbone(inputs_embeds=inputs_embeds).last_hidden_state).squeeze(-1)


def make_critic(seed: int = 2, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return Critic(dropout).train()


# ---------------------------------------------------------------- the PPO-style loss
def rollout(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            "advantages": torch.randn(BATCH, SEQ - 1, generator=g),
            "returns": torch.randn(BATCH, SEQ - 1, generator=g)}


def ppo_loss(actor: Any, critic: Any, batch: dict[str, torch.Tensor], detach: bool,
             clip: float = 0.2, value_coef: float = 0.5) -> torch.Tensor:
    """Clipped policy surrogate on the actor's token log-probs (old log-probs
    = the current ones detached, the first epoch over a rollout) plus the
    critic's squared error, the critic reading the actor's last hidden state."""
    out = actor(input_ids=batch["ids"], output_hidden_states=True)
    logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1).gather(-1, batch["ids"][:, 1:, None]).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())
    adv = batch["advantages"]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    hidden = out.hidden_states[-1]
    values = critic(inputs_embeds=hidden.detach() if detach else hidden)
    value_loss = (values[:, :-1].float() - batch["returns"]).square().mean()
    return -surrogate.mean() + value_coef * value_loss


# ---------------------------------------------------------------- part 1: one backward, every gradient
def rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Largest |got - want| / max|want| over a list of tensors."""
    return max(float((g.float() - w).abs().max()) / (float(w.abs().max()) or 1.0) for g, w in zip(got, want))


def one_backward(deepspeed: Any, detach: bool, call: str, govern: bool) -> dict[str, float]:
    """Each engine's largest relative gradient error against the oracle."""
    from deepspeed.utils import safe_get_full_grad

    batch = rollout(0)
    plain = {"actor": make_actor(), "critic": make_critic()}
    ppo_loss(plain["actor"], plain["critic"], batch, detach).backward()
    want = {n: [torch.zeros_like(p) if p.grad is None else p.grad / GAS[n] for p in m.parameters()]
            for n, m in plain.items()}

    engines = {"actor": make_engine(deepspeed, make_actor(), GAS["actor"], lr=0.1),
               "critic": make_engine(deepspeed, make_critic(), GAS["critic"], lr=0.1)}
    for e in engines.values():
        e.set_gradient_accumulation_boundary(True)  # reduce now: gradients readable after one backward
    with graphscale.install(*engines.values()) if govern else contextlib.nullcontext():
        loss = ppo_loss(engines["actor"], engines["critic"], batch, detach)
        if call == "actor.backward(loss)":
            engines["actor"].backward(loss)
        else:
            loss.backward()
    got = {n: [torch.zeros_like(w) if g is None else g for g, w in
               zip((safe_get_full_grad(p) for p in e.module.parameters()), want[n])]
           for n, e in engines.items()}
    return {n: rel_err(got[n], want[n]) for n in engines}


# ---------------------------------------------------------------- part 2: training
def train(deepspeed: Any, govern: bool, micro_steps: int = 8, lr: float = 0.1) -> float:
    """Train both engines (critic on the actor's hidden state, not detached;
    ``loss.backward()``) beside a plain reference that accumulates each
    model's gradient times its own 1/GAS and steps every GAS micro-steps;
    the largest relative weight error after the last micro-step."""
    from deepspeed.utils import safe_get_full_fp32_param

    refs = {"actor": make_actor(), "critic": make_critic()}
    engines = {n: make_engine(deepspeed, copy.deepcopy(r), GAS[n], lr=lr) for n, r in refs.items()}
    opts = {n: torch.optim.SGD(r.parameters(), lr=lr) for n, r in refs.items()}
    acc = {n: [torch.zeros_like(p) for p in r.parameters()] for n, r in refs.items()}
    with graphscale.install(*engines.values()) if govern else contextlib.nullcontext():
        for step in range(micro_steps):
            batch = rollout(100 + step)
            ppo_loss(engines["actor"], engines["critic"], batch, detach=False).backward()
            for e in engines.values():
                e.step()  # each engine steps at its own boundary
            ppo_loss(refs["actor"], refs["critic"], batch, detach=False).backward()
            for n, ref in refs.items():
                for a, p in zip(acc[n], ref.parameters()):
                    if p.grad is not None:
                        a += p.grad / GAS[n]
                    p.grad = None
                if (step + 1) % GAS[n] == 0:
                    for a, p in zip(acc[n], ref.parameters()):
                        p.grad = a.clone()
                        a.zero_()
                    opts[n].step()
                    ref.zero_grad(set_to_none=True)
    return max(rel_err([safe_get_full_fp32_param(p) for p in engines[n].module.parameters()],
                       [p.detach() for p in refs[n].parameters()]) for n in refs)


def print_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(len(header))]
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print("  " + "  ".join(f"{c:<{w}}" for c, w in zip(r, widths)).rstrip())


def verdict(err: float) -> str:
    return f"{err:.2g} {'exact' if err <= EXACT else 'WRONG'}"


def main() -> int:
    t0 = time.perf_counter()
    warnings.filterwarnings("ignore")
    deepspeed = start_deepspeed()
    rows = []
    for detach in (True, False):
        for call in ("actor.backward(loss)", "loss.backward()"):
            alone = one_backward(deepspeed, detach, call, govern=False)
            governed = one_backward(deepspeed, detach, call, govern=True)
            rows.append(("hidden.detach()" if detach else "hidden (nested)", call, alone, governed))
    train_alone, train_governed = train(deepspeed, govern=False), train(deepspeed, govern=True)

    print(f"RLHF actor (GAS {GAS['actor']}) + critic (GAS {GAS['critic']}), tiny GPT-2, DeepSpeed "
          f"{deepspeed.__version__} ZeRO {ZERO_STAGE}, torch {torch.__version__}, CPU, one rank")
    print("largest relative gradient error per engine vs a plain-PyTorch oracle (each model: 1/GAS x its gradient)")
    print()
    header = ("critic reads actor's", "backward", "engine", "DeepSpeed alone", "with graphscale")
    table = [(inp if i == 0 else "", call if i == 0 else "", engine, verdict(alone[engine]), verdict(governed[engine]))
             for inp, call, alone, governed in rows for i, engine in enumerate(("actor", "critic"))]
    print_table(header, table)
    worst = max(governed[e] for *_, governed in rows for e in governed)
    print()
    print(f"training, 8 micro-steps, weights vs a per-engine-GAS reference: DeepSpeed alone {verdict(train_alone)}, "
          f"with graphscale {verdict(train_governed)}")
    worst = max(worst, train_governed)
    print(f"({time.perf_counter() - t0:.1f} s)")
    if worst <= EXACT:
        print(f"graphscale is exact: every engine's gradients and weights match the oracle (max rel err {worst:.2g})")
        return 0
    print(f"graphscale is NOT exact: max relative error {worst:.2g}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
