"""A token-normalised loss beside a mean-normalised one: per-group factors instead of 1/GAS.

What it shows
    Gradient accumulation usually divides every gradient by GAS, the number
    of micro-batches in a window.  A language-model loss that is already
    normalised by the token count of the whole window (Hugging Face's
    ``num_items_in_batch``: sum of token losses / tokens in the window) must
    not be divided again: dividing it gives the LM 1/GAS of its intended
    gradient (transformers PR 35808 fixed that for DeepSpeed by switching
    the division off for the whole loss).  When the same loss also has a
    branch normalised per micro-batch (a value head's mean squared error),
    that branch still needs 1/GAS: one loss, two factors.

    ``graphscale.Group(lm, factor=1.0)`` beside ``graphscale.Group(value_head,
    gas=GAS)`` gives each its own factor in one backward.  Or leave the LM
    branch as a plain sum and let the group divide by the window's tokens:
    ``graphscale.Group(lm, factor=lambda: 1 / tokens_in_window)``, read at
    the start of every backward.

    Two windows of GAS = 4 micro-batches whose sequences have different
    lengths (so different token counts) train a tiny GPT-2 and a value head
    on its last hidden state (detached, as a critic reads it).  At the end of
    each window the accumulated gradients are compared with the gradient of
    the intended objective, computed at once in plain PyTorch:
    ``sum of token losses / tokens in window + mean of the micro-batches'
    value losses``.

Run (from a clone of graphscale)
    pip install torch==2.13.0 && pip install -e ".[test]"
    python examples/token_normalized.py

    CPU only, plain PyTorch (no DeepSpeed, no process group).  A tiny GPT-2
    config with random weights: nothing is downloaded.  About 10 s on 2 CPU
    cores.  Exit code 1 if graphscale is not exact.
"""
from __future__ import annotations

import contextlib
import copy
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import graphscale

GAS = 4  # micro-batches per accumulation window
WINDOWS = 2
VOCAB, SEQ, BATCH, WIDTH = 64, 12, 2, 32
LR = 0.1
EXACT = 1e-5  # largest relative error still called exact (float32 round-off is ~1e-7)


# ---------------------------------------------------------------- models and data
def make_lm(seed: int = 1) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=WIDTH, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).train()


def make_value_head(seed: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1))


@dataclass(frozen=True)
class MicroBatch:
    ids: torch.Tensor  # (BATCH, SEQ), right-padded
    mask: torch.Tensor  # (BATCH, SEQ): 1 on real tokens
    returns: torch.Tensor  # (BATCH,): the value head's target

    @property
    def tokens(self) -> int:
        """Next-token targets: the real tokens after the first of each sequence."""
        return int(self.mask[:, 1:].sum())


def window(w: int) -> list[MicroBatch]:
    """GAS micro-batches whose sequences have random lengths."""
    out = []
    for i in range(GAS):
        g = torch.Generator().manual_seed(100 * w + i)
        lengths = torch.randint(3, SEQ + 1, (BATCH,), generator=g)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).float()
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append(MicroBatch(ids, mask, torch.randn(BATCH, generator=g)))
    return out


# ---------------------------------------------------------------- the loss
def token_loss_sum(lm: Any, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token cross-entropies over the real tokens, and the last hidden state."""
    out = lm(input_ids=mb.ids, attention_mask=mb.mask.long(), output_hidden_states=True)
    ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), mb.ids[:, 1:].reshape(-1), reduction="none")
    return (ce * mb.mask[:, 1:].reshape(-1)).sum(), out.hidden_states[-1]


def value_loss(value_head: Any, hidden: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """Mean squared error over this micro-batch (needs 1/GAS to become a mean over the window)."""
    pooled = (hidden.detach() * mb.mask[..., None]).sum(1) / mb.mask.sum(1, keepdim=True)
    return (value_head(pooled).squeeze(-1) - mb.returns).square().mean()


def window_objective(lm: Any, value_head: Any, batches: list[MicroBatch]) -> torch.Tensor:
    """What one window should minimise, computed at once (the reference)."""
    tokens = sum(mb.tokens for mb in batches)
    lm_total, value_total = torch.zeros(()), torch.zeros(())
    for mb in batches:
        lm_sum, hidden = token_loss_sum(lm, mb)
        lm_total = lm_total + lm_sum
        value_total = value_total + value_loss(value_head, hidden, mb)
    return lm_total / tokens + value_total / len(batches)


# ---------------------------------------------------------------- the ways to accumulate
# mode -> (a description, whether the LM branch is divided by the window's tokens in the loss)
MODES = {
    "plain accumulation: (loss / GAS).backward()": True,
    "Group(lm, gas=GAS), Group(value_head, gas=GAS)": True,
    "Group(lm, factor=1.0), Group(value_head, gas=GAS)": True,
    "Group(lm, factor=lambda: 1 / tokens), Group(value_head, gas=GAS)": False,
}


def groups_for(mode: str, lm: Any, value_head: Any, tokens: list[int]) -> list[graphscale.Group]:
    if mode.startswith("plain"):
        return []
    value = graphscale.Group(value_head, gas=GAS, name="value_head")
    if "gas=GAS), Group" in mode:
        return [graphscale.Group(lm, gas=GAS, name="lm"), value]  # divides the token-normalised branch again
    if "factor=1.0" in mode:
        return [graphscale.Group(lm, factor=1.0, name="lm"), value]
    return [graphscale.Group(lm, factor=lambda: 1.0 / tokens[0], name="lm"), value]


def rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Largest |got - want| / max|want| over a list of tensors."""
    return max(float((g - w).abs().max()) / (float(w.abs().max()) or 1.0) for g, w in zip(got, want))


def train(mode: str) -> dict[str, float]:
    """Train two windows in ``mode`` beside the reference (SGD, a step at
    the end of each window); per model, the largest relative error of the
    gradient accumulated over a window."""
    lm, value_head = make_lm(), make_value_head()
    ref_lm, ref_value = copy.deepcopy(lm), copy.deepcopy(value_head)
    opt = torch.optim.SGD([*lm.parameters(), *value_head.parameters()], lr=LR)
    ref_opt = torch.optim.SGD([*ref_lm.parameters(), *ref_value.parameters()], lr=LR)
    tokens = [0]  # the current window's token count, read by the factor callable
    groups = groups_for(mode, lm, value_head, tokens)
    errors = {"lm": 0.0, "value_head": 0.0}
    with graphscale.install(*groups) if groups else contextlib.nullcontext():
        for w in range(WINDOWS):
            batches = window(w)
            tokens[0] = sum(mb.tokens for mb in batches)  # known before the window, as num_items_in_batch is
            for mb in batches:
                lm_sum, hidden = token_loss_sum(lm, mb)
                lm_part = lm_sum / tokens[0] if MODES[mode] else lm_sum
                loss = lm_part + value_loss(value_head, hidden, mb)
                (loss / GAS if mode.startswith("plain") else loss).backward()
            window_objective(ref_lm, ref_value, batches).backward()
            for name, model, ref in (("lm", lm, ref_lm), ("value_head", value_head, ref_value)):
                errors[name] = max(errors[name], rel_err([p.grad for p in model.parameters()],
                                                         [p.grad for p in ref.parameters()]))
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
            # the next window starts from the reference's weights: each window measures the accumulation alone
            lm.load_state_dict(ref_lm.state_dict())
            value_head.load_state_dict(ref_value.state_dict())
    return errors


def verdict(err: float) -> str:
    return f"{err:.2g} {'exact' if err <= EXACT else 'WRONG'}"


def print_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(len(header))]
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print("  " + "  ".join(f"{c:<{w}}" for c, w in zip(r, widths)).rstrip())


def main() -> int:
    t0 = time.perf_counter()
    warnings.filterwarnings("ignore")
    counts = [mb.tokens for w in range(WINDOWS) for mb in window(w)]
    results = {mode: train(mode) for mode in MODES}
    print(f"token-normalised LM loss + mean-normalised value loss, GAS {GAS}, tiny GPT-2, torch {torch.__version__}")
    print(f"tokens per micro-batch: {counts}")
    print("largest relative error of each window's accumulated gradient vs the window objective")
    print()
    print_table(("how the window is accumulated", "lm", "value_head"),
                [(mode, verdict(e["lm"]), verdict(e["value_head"])) for mode, e in results.items()])
    print(f"({time.perf_counter() - t0:.1f} s)")
    worst = max(max(results[m].values()) for m in MODES if "factor" in m)
    if worst <= EXACT:
        print(f"graphscale is exact: with per-group factors both models get the window objective's gradient "
              f"(max rel err {worst:.2g})")
        return 0
    print(f"graphscale is NOT exact: max relative error {worst:.2g}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
