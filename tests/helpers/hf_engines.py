"""Hugging Face models under real DeepSpeed engines, what the HF tests run
(tests/deepspeed_engines/test_hf*.py): the shapes users train (RLHF actor
and critic, the DeepSpeed issue-8224 shape, distillation, ``labels=``), the
cases, the engines built from tests/helpers/hf.py's tiny models, one
backward run with and without graphscale, and the plain-PyTorch oracle."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

import graphscale

from helpers import hf  # (its builders import transformers when called: the tests skip without it first)
from helpers.engines import ds_config
from helpers.grads import max_rel_err

# NOTE [ Why DeepSpeed alone divides several times on HF outputs ]
# DeepSpeed <= 0.19.5, and >= 0.19.6 under a direct ``loss.backward()``,
# divides by GAS at a hook on every tensor of the engine's output, and a HF
# ``ModelOutput`` is a dict whose tensors lie on one path: ``loss`` is made
# from ``logits``, and ``logits`` from ``hidden_states[-1]``.  A gradient that
# crosses k hooked tensors is divided k times: ``engine(input_ids=x,
# labels=x).loss`` at GAS 4 gives 1/16, not 1/4 (ZeRO 1 and 2; both
# generations under loss.backward(), <= 0.19.5 under engine.backward()), and a
# critic reading ``hidden_states[-1]`` divides the actor's share once more.
# At ZeRO-3 a forward hook re-emits every output tensor through ZeRO-3's own
# autograd Function (PreBackwardFunctionForModule), so the hooked ``logits``
# is a new tensor that the (equally re-emitted) ``loss`` does not depend on:
# one division, exact for that shape (measured: loss's graph does not reach
# the returned logits' node at stage 3; it does at stage 1).

FP32_TOL = 1e-6


# bf16 engines against a float32 oracle.  tests/deepspeed_engines/test_shapes.py allows 3e-2
# on two Linears; through two GPT-2 blocks graphscale's bf16 gradients were
# measured 1.2-3.1e-2 off the float32 oracle (DeepSpeed 0.19.5 and 0.19.8),
# while every wrong factor here is off by at least 0.5.
BF16_TOL = 1e-1
BOTH = ("hooks", "tracker")
HOOKS = ("hooks",)


def generation() -> str:
    """'tracker' for DeepSpeed >= 0.19.6 (PR 8245), 'hooks' before it."""
    import deepspeed.runtime.engine as eng

    return "tracker" if hasattr(eng, "_ENGINE_BACKWARD_GRAPH_TRACKER") else "hooks"


# ------------------------------------------------------------------ shapes as data
Forward = Mapping[str, Callable[..., Any]]  # model name -> what a forward goes through (engine or plain model)


Modules = Mapping[str, torch.nn.Module]  # model name -> the bare module (engine.module or the plain model)


def _ppo(detach: bool) -> Callable[[Forward, Modules, hf.Batch], torch.Tensor]:
    def graph(f: Forward, m: Modules, b: hf.Batch) -> torch.Tensor:
        out = f["actor"](input_ids=b.ids, output_hidden_states=True)
        hidden = out.hidden_states[-1]
        values = f["critic"](inputs_embeds=hidden.detach() if detach else hidden)
        return hf.ppo_loss(out, values, b)

    return graph


def _issue_8224(f: Forward, m: Modules, b: hf.Batch) -> torch.Tensor:
    return hf.lm_loss(f["lm"](input_ids=b.ids), b.ids) + hf.lm_loss(m["lm"](input_ids=b.ids2), b.ids2)


def _distill(f: Forward, m: Modules, b: hf.Batch) -> torch.Tensor:
    return hf.distill_loss(f["student"](input_ids=b.ids, labels=b.ids), f["teacher"](input_ids=b.ids))


def _hf_labels(f: Forward, m: Modules, b: hf.Batch) -> torch.Tensor:
    return f["lm"](input_ids=b.ids, labels=b.ids).loss


@dataclass(frozen=True)
class Shape:
    """A loss graph and the models it runs.  ``models``: name -> kind
    ("lm" or "critic"); ``main``: the language model that a case's LoRA and
    checkpointing variants apply to."""

    graph: Callable[[Forward, Modules, hf.Batch], torch.Tensor]
    models: dict[str, str]
    main: str


SHAPES: dict[str, Shape] = {
    # critic reads the actor's last hidden state, detached: two separate regions
    "ppo_detached": Shape(_ppo(True), {"actor": "lm", "critic": "critic"}, "actor"),
    # not detached: the critic's graph nests inside the actor's
    "ppo_nested": Shape(_ppo(False), {"actor": "lm", "critic": "critic"}, "actor"),
    # lm_loss(engine(batch)) + lm_loss(engine.module(batch2)): DeepSpeed issue 8224
    "issue_8224": Shape(_issue_8224, {"lm": "lm"}, "lm"),
    # KL(teacher || student) + the student's HF loss (labels=), both trained
    "distill": Shape(_distill, {"teacher": "lm", "student": "lm"}, "student"),
    # the plainest HF client: engine(input_ids=x, labels=x).loss
    "hf_labels_loss": Shape(_hf_labels, {"lm": "lm"}, "lm"),
}


SEEDS = {"actor": 11, "critic": 12, "lm": 13, "teacher": 14, "student": 15}


@dataclass(frozen=True)
class Case:
    shape: str
    gas: dict[str, int]
    call: str  # "engine:<name>" (engine.backward(loss)) or "loss" (loss.backward())
    stage: int
    ds_wrong: tuple[str, ...]  # generations in which DeepSpeed alone is wrong here (measured)
    dtype: str = "fp32"
    lora: bool = False  # the main LM is a PEFT LoRA model (base frozen)
    ckpt: str | None = None  # HF activation checkpointing of the main LM: "reentrant" or "nonreentrant"

    @property
    def id(self) -> str:
        gas = "_".join(f"{n}{g}" for n, g in self.gas.items())
        call = "loss_backward" if self.call == "loss" else f"{self.call.split(':')[1]}_backward"
        extra = ("-lora" if self.lora else "") + (f"-ckpt_{self.ckpt}" if self.ckpt else "")
        return f"{self.shape}{extra}-{gas}-z{self.stage}-{self.dtype}-{call}"

    @property
    def tol(self) -> float:
        return BF16_TOL if self.dtype == "bf16" else FP32_TOL


AC24, AC42 = {"actor": 2, "critic": 4}, {"actor": 4, "critic": 2}


TS24 = {"teacher": 2, "student": 4}
CASES = [
    # RLHF actor + critic, one PPO-style loss
    Case("ppo_detached", AC24, "engine:actor", 1, BOTH),
    Case("ppo_detached", AC42, "loss", 2, BOTH),
    Case("ppo_nested", AC24, "engine:actor", 2, BOTH),
    Case("ppo_nested", AC24, "loss", 1, BOTH, dtype="bf16"),
    Case("ppo_nested", AC42, "engine:actor", 3, BOTH, dtype="bf16"),
    Case("ppo_nested", AC24, "engine:actor", 1, BOTH, ckpt="reentrant"),
    Case("ppo_nested", AC42, "loss", 3, BOTH, ckpt="nonreentrant"),
    Case("ppo_nested", AC24, "engine:actor", 3, BOTH, ckpt="reentrant"),
    Case("ppo_detached", AC24, "engine:actor", 2, BOTH, lora=True),
    Case("ppo_nested", AC42, "loss", 1, BOTH, lora=True, ckpt="reentrant"),
    # DeepSpeed issue 8224
    Case("issue_8224", {"lm": 4}, "engine:lm", 2, HOOKS),
    Case("issue_8224", {"lm": 4}, "loss", 2, BOTH),
    Case("issue_8224", {"lm": 2}, "engine:lm", 3, HOOKS, dtype="bf16"),
    Case("issue_8224", {"lm": 4}, "loss", 3, BOTH, lora=True, ckpt="nonreentrant"),
    # ZeRO 1 only: at ZeRO-2 and 3 DeepSpeed alone already fails here (both
    # versions): a parameter that two reentrant recomputations reach is reduced
    # twice ("has already been reduced"; ZeRO-3: a duplicate in the bucket)
    Case("issue_8224", {"lm": 4}, "engine:lm", 1, HOOKS, ckpt="reentrant"),
    # distillation: teacher and student both trained
    Case("distill", TS24, "engine:student", 1, BOTH),
    Case("distill", TS24, "loss", 2, BOTH),
    # at ZeRO-3 the student's hooked logits are a copy its loss does not depend on
    Case("distill", TS24, "engine:student", 3, ("tracker",), dtype="bf16"),
    Case("distill", TS24, "loss", 2, BOTH, ckpt="reentrant"),
]


# The plainest HF client, one engine, GAS 4, and the factor DeepSpeed alone puts
# on every one of its parameters, per generation (measured; 0.25 is right).
# NOTE [ Why DeepSpeed alone divides several times on HF outputs ]
HF_LABELS: list[tuple[Case, dict[str, float]]] = [
    (Case("hf_labels_loss", {"lm": 4}, "loss", 1, BOTH), {"hooks": 1 / 16, "tracker": 1 / 16}),
    (Case("hf_labels_loss", {"lm": 4}, "loss", 2, BOTH), {"hooks": 1 / 16, "tracker": 1 / 16}),
    (Case("hf_labels_loss", {"lm": 4}, "loss", 3, ()), {"hooks": 1 / 4, "tracker": 1 / 4}),
    (Case("hf_labels_loss", {"lm": 4}, "engine:lm", 1, HOOKS), {"hooks": 1 / 16, "tracker": 1 / 4}),
    (Case("hf_labels_loss", {"lm": 4}, "engine:lm", 2, HOOKS, ckpt="nonreentrant"),
     {"hooks": 1 / 16, "tracker": 1 / 4}),
    (Case("hf_labels_loss", {"lm": 4}, "loss", 2, BOTH, dtype="bf16", lora=True),
     {"hooks": 1 / 16, "tracker": 1 / 16}),
]


CASES += [case for case, _ in HF_LABELS]


def case_params(cases: list[Case]) -> list[Any]:
    return [pytest.param(c, id=c.id) for c in cases]


# ------------------------------------------------------------------ building and running
def build(case: Case, name: str) -> torch.nn.Module:
    """The float32 model ``name`` of ``case``, the same weights on every call."""
    shape = SHAPES[case.shape]
    kind, seed = shape.models[name], SEEDS[name]
    main = name == shape.main
    if kind == "critic":
        return hf.tiny_critic(seed)
    if main and case.lora:
        pytest.importorskip("peft", reason="the LoRA cases need peft")
        model = hf.lora_lm(seed)
    else:
        model = hf.tiny_lm(seed)
    if main and case.ckpt:
        hf.enable_checkpointing(model, reentrant=case.ckpt == "reentrant")
    return model


def trainable(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def make_engines(case: Case, gas: dict[str, int] | None = None, boundary: bool = True,
                 **config: Any) -> dict[str, Any]:
    """A fresh DeepSpeed engine (SGD on the trainable parameters) per model of
    ``case``; ``boundary`` makes every backward reduce at once, so gradients
    are readable after one backward at every ZeRO stage."""
    import deepspeed

    engines = {}
    for name in SHAPES[case.shape].models:
        model = build(case, name)
        cfg = ds_config((gas or case.gas)[name], case.stage, bf16=case.dtype == "bf16")
        cfg.update(config)
        opt = torch.optim.SGD([p for _, p in trainable(model)], lr=0.1)
        engines[name], *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        if boundary:
            engines[name].set_gradient_accumulation_boundary(True)
    return engines


def _grad_or_zeros(p: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    # a parameter no path reaches (the critic's token embedding when it reads
    # hidden states) has no gradient in plain PyTorch; ZeRO may hold zeros
    return torch.zeros(p.ds_shape if hasattr(p, "ds_shape") else p.shape) if g is None else g.detach().float().clone()


@dataclass
class Result:
    grads: dict[str, list[torch.Tensor]]  # model name -> gradient of each trainable parameter, float32
    loss: torch.Tensor
    returned: torch.Tensor | None = None  # what engine.backward returned


def run_engines(case: Case, with_graphscale: bool) -> Result:
    from deepspeed.utils import safe_get_full_grad

    engines = make_engines(case)
    batch = hf.make_batch(0)
    inst = graphscale.install(*engines.values()) if with_graphscale else None
    try:
        loss = SHAPES[case.shape].graph(engines, {n: e.module for n, e in engines.items()}, batch)
        if case.call == "loss":
            loss.backward()
            returned = None
        else:
            returned = engines[case.call.split(":")[1]].backward(loss)
    finally:
        if inst is not None:
            inst.remove()
    grads = {n: [_grad_or_zeros(p, safe_get_full_grad(p)) for _, p in trainable(e.module)]
             for n, e in engines.items()}
    return Result(grads, loss.detach().float(), returned)


def oracle(case: Case, factors: bool = True) -> Result:
    """Plain PyTorch, float32: each model's gradient times 1/GAS of its engine
    (``factors=False``: the plain gradient itself)."""
    models = {n: build(case, n) for n in SHAPES[case.shape].models}
    loss = SHAPES[case.shape].graph(models, models, hf.make_batch(0))
    loss.backward()
    grads = {n: [_grad_or_zeros(p, p.grad) / (case.gas[n] if factors else 1) for _, p in trainable(m)]
             for n, m in models.items()}
    return Result(grads, loss.detach())


def errors(got: Result, want: Result) -> dict[str, float]:
    return {n: max_rel_err(got.grads[n], want.grads[n]) for n in want.grads}


def effective_factor(got: list[torch.Tensor], plain: list[torch.Tensor]) -> float:
    """The single number c that best explains ``got ~ c x plain`` (least squares)."""
    num = sum((g.double() * p.double()).sum() for g, p in zip(got, plain, strict=True))
    den = sum(p.double().square().sum() for p in plain)
    return float(num / den)


def report(case: Case, mode: str, got: Result, want: Result) -> None:
    path = os.environ.get("GRAPHSCALE_DS_REPORT")
    if not path:
        return
    import deepspeed

    plain = oracle(case, factors=False)
    factor = {n: effective_factor(got.grads[n], plain.grads[n]) for n in got.grads}
    with open(path, "a") as f:
        f.write(json.dumps({"deepspeed": deepspeed.__version__, "case": case.id, "mode": mode,
                            "errors": errors(got, want), "factor": factor}) + "\n")
