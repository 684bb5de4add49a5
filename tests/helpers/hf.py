"""Tiny Hugging Face models and the losses users train them with, for the
DeepSpeed tests (tests/deepspeed_engines/test_hf.py).

Everything is built from a transformers config with random weights (no
download) and dropout off, so a plain-PyTorch copy of a model run on the same
batch is a deterministic oracle.  Each builder takes a seed: two calls with the
same seed return models with equal weights, which is how a test makes the
oracle's copy of a model before ``deepspeed.initialize`` partitions or casts
the engine's.

Importing this module needs only torch (pytest imports every file under
tests/ for doctests): transformers and peft are imported by the builders, and
the test modules skip with ``pytest.importorskip`` where they are missing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from transformers import GPT2Config, GPT2LMHeadModel

__all__ = ["VOCAB", "SEQ", "BATCH", "Batch", "gpt2_config", "tiny_lm", "Critic", "tiny_critic", "lora_lm",
           "enable_checkpointing", "make_batch", "lm_loss", "token_logprobs", "ppo_loss", "distill_loss"]

VOCAB = 64
SEQ = 8
BATCH = 2


def gpt2_config() -> GPT2Config:
    """Two blocks, width 32, every dropout 0, no KV cache (training only)."""
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
                      use_cache=False, bos_token_id=0, eos_token_id=0)


def tiny_lm(seed: int) -> GPT2LMHeadModel:
    """A GPT-2 language model (tied input and output embeddings), train mode."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(gpt2_config()).train()


class Critic(torch.nn.Module):
    """A value model as RLHF trainers build one: a GPT-2 backbone and a linear
    value head; one value per position, shape ``(batch, seq)``.

    ``inputs_embeds`` lets the critic read another model's hidden states (the
    backbone still adds its own position embeddings); its token embedding is
    then unused and gets no gradient.
    """

    def __init__(self) -> None:
        from transformers import GPT2Model

        super().__init__()
        config = gpt2_config()
        self.backbone = GPT2Model(config)
        self.value_head = torch.nn.Linear(config.n_embd, 1)

    def forward(self, input_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, inputs_embeds=inputs_embeds).last_hidden_state
        return self.value_head(hidden).squeeze(-1)


def tiny_critic(seed: int) -> Critic:
    torch.manual_seed(seed)
    return Critic().train()


def lora_lm(seed: int) -> Any:
    """``tiny_lm(seed)`` wrapped by ``peft.get_peft_model`` with a rank-4 LoRA
    adapter on every ``c_attn``: the base model frozen, only ``lora_A`` and
    ``lora_B`` trainable.  ``init_lora_weights=False`` makes ``lora_B``
    random as well, so both adapter matrices get a non-zero gradient."""
    import peft

    base = tiny_lm(seed)
    torch.manual_seed(seed + 1)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"],
                             fan_in_fan_out=True, init_lora_weights=False)  # GPT-2's Conv1D stores W transposed
    return peft.get_peft_model(base, config).train()


def enable_checkpointing(model: Any, reentrant: bool) -> None:
    """HF activation checkpointing of every block, reentrant or not.

    transformers 5 renamed ``gradient_checkpointing_enable`` to
    ``activation_checkpointing_enable`` and keeps the old name as a deprecated
    alias; call whichever this version has first, with the same kwargs."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@dataclass(frozen=True)
class Batch:
    """Two token batches and the fixed RL targets of the PPO-style loss."""

    ids: torch.Tensor  # (BATCH, SEQ) int64
    ids2: torch.Tensor  # a second batch, for the shapes that run two forwards
    advantages: torch.Tensor  # (BATCH, SEQ - 1): one per generated token
    returns: torch.Tensor  # (BATCH, SEQ - 1): the critic's regression target


def make_batch(seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(ids=torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
                 ids2=torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
                 advantages=torch.randn(BATCH, SEQ - 1, generator=g),
                 returns=torch.randn(BATCH, SEQ - 1, generator=g))


def _logits(out: Any) -> torch.Tensor:
    return (out.logits if hasattr(out, "logits") else out).float()


def lm_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a model output (or logits), in float32."""
    logits = _logits(out)[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def token_logprobs(out: Any, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[t+1] | ids[:t+1]) for every position, shape ``(batch, seq-1)``."""
    logp = torch.log_softmax(_logits(out)[:, :-1], dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)


def ppo_loss(actor_out: Any, values: torch.Tensor, batch: Batch, clip: float = 0.2,
             value_coef: float = 0.5) -> torch.Tensor:
    """A PPO-style objective in one scalar: the clipped policy-gradient
    surrogate on the actor's log-probs (old log-probs = the current ones,
    detached, as in the first epoch over a rollout) with the batch's fixed
    advantages, plus ``value_coef`` x the critic's squared error to the
    returns.  ``values``: the critic's output, one per position."""
    logp = token_logprobs(actor_out, batch.ids)
    ratio = torch.exp(logp - logp.detach())
    surrogate = torch.minimum(ratio * batch.advantages,
                              ratio.clamp(1 - clip, 1 + clip) * batch.advantages)
    value_loss = (values[:, :-1].float() - batch.returns).square().mean()
    return -surrogate.mean() + value_coef * value_loss


def distill_loss(student_out: Any, teacher_out: Any, temperature: float = 2.0, alpha: float = 0.5) -> torch.Tensor:
    """Knowledge distillation: ``alpha`` x T^2 x KL(teacher || student) on
    temperature-softened next-token distributions, plus ``(1 - alpha)`` x the
    student's own cross-entropy, ``student_out.loss`` (the student was called
    with ``labels=``, as HF clients do).  The teacher's logits are not
    detached: the teacher trains on the same loss (mutual learning)."""
    s = torch.log_softmax(_logits(student_out)[:, :-1] / temperature, dim=-1)
    t = torch.log_softmax(_logits(teacher_out)[:, :-1] / temperature, dim=-1)
    kl = F.kl_div(s.reshape(-1, VOCAB), t.reshape(-1, VOCAB), log_target=True, reduction="batchmean")
    return alpha * temperature**2 * kl + (1 - alpha) * student_out.loss.float()
