"""The models: plain-torch transformer towers (W1-W6) and ``transformers``
GPT-2 actor and critic (HF1, HF2).  transformers is imported only when a GPT-2
model is built."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .spec import HF_VOCAB


class Block(nn.Module):
    """Pre-norm attention + MLP, plain torch (no fused kernels)."""

    def __init__(self, hidden: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) * (h // self.heads) ** -0.5, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, h)
        x = x + self.proj(y)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class Tower(nn.Module):
    """An input Linear and ``layers`` blocks, each optionally checkpointed."""

    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.inp = nn.Linear(hidden, hidden)  # not checkpointed, like an embedding
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.checkpointing: str | None = None  # W5: "reentrant", W6: "non-reentrant"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for blk in self.blocks:
            if self.checkpointing:
                x = checkpoint(blk, x, use_reentrant=self.checkpointing == "reentrant")
            else:
                x = blk(x)
        return x


def make_hf_modules(layers: int, width: int, device: str) -> tuple[Any, Any]:
    """A GPT-2 actor (``GPT2LMHeadModel``) and critic (``GPT2Model`` + a linear
    value head) from one config, random init, dropout off, training mode."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

    cfg = GPT2Config(vocab_size=HF_VOCAB, n_positions=128, n_embd=width, n_layer=layers, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=HF_VOCAB - 1, eos_token_id=HF_VOCAB - 1)

    class Critic(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = GPT2Model(cfg)
            self.v_head = torch.nn.Linear(width, 1)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            hidden = self.backbone(input_ids=input_ids, use_cache=False).last_hidden_state
            return self.v_head(hidden).squeeze(-1)

    actor: Any = GPT2LMHeadModel(cfg)  # (transformers' typed .to() confuses type checkers)
    return actor.to(device).train(), Critic().to(device).train()


def hf_checkpointing(model: Any, on: bool) -> None:
    """``gradient_checkpointing_enable()`` / ``_disable()`` with transformers'
    default arguments (newer releases name them ``activation_checkpointing_*``
    and keep the old names as deprecated aliases)."""
    name = "enable" if on else "disable"
    fn: Callable[[], None] = (getattr(model, f"activation_checkpointing_{name}", None)
                              or getattr(model, f"gradient_checkpointing_{name}"))
    fn()


def hf_use_reentrant(model: Any) -> bool | None:
    """What the checkpointed blocks of ``model`` pass as use_reentrant (None: not set)."""
    for m in model.modules():
        fn = getattr(m, "_gradient_checkpointing_func", None)
        if fn is not None:
            return getattr(fn, "keywords", {}).get("use_reentrant")
    return None
