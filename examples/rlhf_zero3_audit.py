"""Prove it at ZeRO 3: the RLHF pair diagnosed and audited by replaying the micro-step's forward.

What it shows
    The RLHF pair of ``rlhf_actor_critic.py`` (GPT-2 actor, GAS 2; GPT-2
    critic reading the actor's last hidden state, GAS 4; one PPO-style loss,
    ``loss.backward()``), at ZeRO stage 3, with dropout on.  ZeRO 3 gathers
    each module's partitioned parameters for one backward pass per forward, so
    graphscale's plain reference cannot be a second pass over the backward's
    graph; it comes from the micro-step's forward called once more instead:
    the PPO loss is computed through ``handle.replayable(ppo_loss)``, and the
    audit (or the diagnosis) calls it once more, with the same batch, the
    same dropout masks (torch's generator forked), the module buffers as they
    were, nothing accumulated into ``.grad`` and nothing stepped.

    1. DeepSpeed alone, watched by ``graphscale.diagnose(actor=..., critic=...)``
       (graphscale not installed): the engine whose parameters got another
       factor than their own 1/GAS, the factor, and why (a direct
       ``loss.backward()`` divides at each engine output a gradient crosses:
       the actor's gradient mixes its policy path, divided once, with its path
       through the critic, divided twice).
    2. ``graphscale.install(actor, critic)`` and ``graphscale.audit()`` over
       8 micro-steps with ``engine.step()`` (two critic windows): every
       backward and every accumulation boundary checked: exact.
    3. The audited engines' weights after those 8 micro-steps against a plain
       reference (the same models and dropout seeds, each model's gradient
       times its own 1/GAS, stepped every GAS micro-steps): the replays
       changed nothing.

Run (from a clone of graphscale)
    pip install torch==2.13.0 && pip install -e ".[test]"
    python examples/rlhf_zero3_audit.py

    CPU only, one process (its own one-rank gloo process group), tiny GPT-2
    configs with random weights.  About 10 s on 2 CPU cores.  Exit code 1 if
    the diagnosis finds nothing wrong with DeepSpeed alone, or graphscale is
    not exact.
"""
from __future__ import annotations

import copy
import os
import sys
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import rlhf_actor_critic as rlhf  # noqa: E402
import torch  # noqa: E402

import graphscale  # noqa: E402

STAGE, DROPOUT, MICRO_STEPS, LR = 3, 0.1, 8, 0.1


def engines(deepspeed: Any) -> tuple[dict[str, Any], dict[str, torch.nn.Module]]:
    """Actor and critic engines at ZeRO 3, and plain copies made before DeepSpeed partitions them."""
    models = {"actor": rlhf.make_actor(dropout=DROPOUT), "critic": rlhf.make_critic(dropout=DROPOUT)}
    plain = {n: copy.deepcopy(m) for n, m in models.items()}
    return {n: rlhf.make_engine(deepspeed, m, rlhf.GAS[n], LR, stage=STAGE) for n, m in models.items()}, plain


def micro_step(step_loss: Any, actor: Any, critic: Any, k: int) -> None:
    """One training micro-step as a user writes it, the loss computed by ``step_loss``."""
    torch.manual_seed(100 + k)  # dropout's seed (the reference uses the same)
    step_loss(actor, critic, rlhf.rollout(k), detach=False).backward()
    actor.step()
    critic.step()


def reference(plain: dict[str, torch.nn.Module]) -> dict[str, torch.nn.Module]:
    """The plain models trained as the engines should be: each model's gradient times its own 1/GAS."""
    opts = {n: torch.optim.SGD(m.parameters(), lr=LR) for n, m in plain.items()}
    acc = {n: [torch.zeros_like(p) for p in m.parameters()] for n, m in plain.items()}
    for k in range(MICRO_STEPS):
        torch.manual_seed(100 + k)
        rlhf.ppo_loss(plain["actor"], plain["critic"], rlhf.rollout(k), detach=False).backward()
        for n, m in plain.items():
            for a, p in zip(acc[n], m.parameters()):
                if p.grad is not None:
                    a += p.grad / rlhf.GAS[n]
                p.grad = None
            if (k + 1) % rlhf.GAS[n] == 0:
                for a, p in zip(acc[n], m.parameters()):
                    p.grad = a.clone()
                    a.zero_()
                opts[n].step()
                m.zero_grad(set_to_none=True)
    return plain


def main() -> int:
    from deepspeed.utils import safe_get_full_fp32_param

    t0 = time.perf_counter()
    warnings.filterwarnings("ignore")
    deepspeed = rlhf.start_deepspeed()

    alone, _ = engines(deepspeed)
    with graphscale.diagnose(actor=alone["actor"], critic=alone["critic"]) as found:
        micro_step(found.replayable(rlhf.ppo_loss), alone["actor"], alone["critic"], 0)
    print(f"1. DeepSpeed {deepspeed.__version__} alone, ZeRO {STAGE}, one micro-step, diagnosed by replay:")
    print(found)

    governed, plain = engines(deepspeed)
    actor, critic = governed["actor"], governed["critic"]
    with graphscale.install(actor, critic), graphscale.audit(raise_on_error=False) as check:
        step_loss = check.replayable(rlhf.ppo_loss)  # the audit calls it once more per backward: ZeRO 3
        for k in range(MICRO_STEPS):
            micro_step(step_loss, actor, critic, k)
    print(f"\n2. graphscale.install(actor, critic), audited by replay, {MICRO_STEPS} micro-steps with step():")
    print(check)

    want = reference(plain)
    weights = max(rlhf.rel_err([safe_get_full_fp32_param(p) for p in governed[n].module.parameters()],
                          [p.detach() for p in want[n].parameters()]) for n in governed)
    print(f"\n3. weights after {MICRO_STEPS} audited micro-steps vs a per-engine-GAS plain reference: "
          f"max relative error {weights:.2g}")

    wrong_alone = sorted({f.group for f in found.findings})
    ok = bool(wrong_alone) and check.ok and check.backwards == MICRO_STEPS and weights <= rlhf.EXACT
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    if not ok:
        print(f"graphscale is NOT exact: diagnosis found {wrong_alone or 'nothing'}; audit ok={check.ok}, "
              f"{check.backwards} backwards; weights {weights:.2g}")
        return 1
    print(f"graphscale is exact: at ZeRO {STAGE} the audit passed {check.backwards} backwards by replay and the "
          f"weights match the reference; DeepSpeed alone was wrong for {', '.join(wrong_alone)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
