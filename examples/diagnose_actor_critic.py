"""Is DeepSpeed scaling my gradients right?  Ask graphscale.diagnose, then audit the fix.

What it shows
    The RLHF pair of ``rlhf_actor_critic.py`` (GPT-2 actor, GAS 2; GPT-2
    critic reading the actor's last hidden state, GAS 4), one PPO-style loss,
    ``actor.backward(loss)``, as a user's unmodified training step.

    1. DeepSpeed alone, watched by ``graphscale.diagnose(actor=..., critic=...)``
       (graphscale not installed, nothing changed): the report names each
       engine whose parameters got another factor than their own 1/GAS, the
       factor they got, and why (DeepSpeed >= 0.19.6: the critic is divided
       by the actor's GAS, because ``actor.backward`` divides the whole loss;
       <= 0.19.5: the actor's gradient mixes a path divided once, its policy
       term, with one divided twice, through the critic, as each engine output
       it crosses divides).
    2. The same step under ``graphscale.install(actor, critic)`` and
       ``graphscale.audit()``: every backward and every accumulation boundary
       checked against a plain reference, over 4 micro-steps with
       ``engine.step()``: exact.

Run (from a clone of graphscale)
    pip install torch==2.13.0 && pip install -e ".[test]"
    python examples/diagnose_actor_critic.py

    CPU only, one process (its own one-rank gloo process group), tiny GPT-2
    configs with random weights.  About 15 s on 2 CPU cores.  Exit code 1 if
    the diagnosis finds nothing wrong with DeepSpeed alone, or the audit
    finds graphscale inexact.
"""
from __future__ import annotations

import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rlhf_actor_critic import GAS, make_actor, make_critic, make_engine, ppo_loss, rollout, start_deepspeed  # noqa: E402

import graphscale  # noqa: E402


def step(actor: object, critic: object, k: int) -> None:
    """One training micro-step as a user writes it."""
    loss = ppo_loss(actor, critic, rollout(k), detach=False)
    actor.backward(loss)  # type: ignore[attr-defined]
    actor.step()  # type: ignore[attr-defined]
    critic.step()  # type: ignore[attr-defined]


def main() -> int:
    t0 = time.perf_counter()
    warnings.filterwarnings("ignore")
    deepspeed = start_deepspeed()

    actor = make_engine(deepspeed, make_actor(), GAS["actor"], lr=0.1)
    critic = make_engine(deepspeed, make_critic(), GAS["critic"], lr=0.1)
    with graphscale.diagnose(actor=actor, critic=critic) as found:
        step(actor, critic, 0)
    print(f"1. DeepSpeed {deepspeed.__version__} alone, one micro-step:")
    print(found)

    actor = make_engine(deepspeed, make_actor(), GAS["actor"], lr=0.1)
    critic = make_engine(deepspeed, make_critic(), GAS["critic"], lr=0.1)
    with graphscale.install(actor, critic), graphscale.audit(raise_on_error=False) as check:
        for k in range(4):
            step(actor, critic, k)
    print("\n2. graphscale.install(actor, critic), audited, 4 micro-steps with step():")
    print(check)

    wrong_alone = sorted({f.group for f in found.findings})
    ok = bool(wrong_alone) and check.ok and check.backwards == 4
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    if not ok:
        print(f"graphscale is NOT exact: diagnosis found {wrong_alone or 'nothing'}; audit ok={check.ok}")
        return 1
    print(f"graphscale is exact: the audit passed {check.backwards} backwards; DeepSpeed alone was wrong for "
          f"{', '.join(wrong_alone)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
