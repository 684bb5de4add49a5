"""The engine mixes of issue 3 (``SHAPES``), how each runs (under graphscale,
DeepSpeed alone, or the adapter off) and the plain-PyTorch oracle it is
checked against: what tests/deepspeed_engines/test_shapes*.py and
tests/stacks/test_cuda.py run."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

import graphscale

from helpers.engine_pool import Pool, View, checkpointed, ds_view, ref_view, set_gas
from helpers.grads import full_grads, max_rel_err


def total(t: torch.Tensor) -> torch.Tensor:
    return t.float().sum()


def _two(v: View) -> list[torch.Tensor]:
    a, b = v.A(v.x), v.B(v.y)
    return [total(a * b), total(b.square())]


def _three(v: View) -> list[torch.Tensor]:
    a, b, c = v.A(v.x), v.B(v.y), v.C(v.x + v.y)
    return [total(a * b), total(c.square() + b)]


def _upstream(v: View) -> list[torch.Tensor]:
    h = v.U(v.x)
    return [total((v.A(h) + v.B(h)).square())]


def _ckpt_name(how: tuple[str, bool]) -> str:
    return f"{how[0]}_{'reentrant' if how[1] else 'nonreentrant'}"


CHECKPOINTS = [(impl, reentrant) for impl in ("torch", "ds") for reentrant in (True, False)]


def _around(how: tuple[str, bool]) -> Callable[[View], list[torch.Tensor]]:
    def graph(v: View) -> list[torch.Tensor]:
        h = v.U(v.x)  # an input that requires grad, or reentrant checkpoint gives none
        return [total(checkpointed(how, lambda t: v.A(t) * v.B(t), h))]

    return graph


# Each graph calls each engine once; losses that forward an engine twice, and
# training with step() on one and two ranks, are tests/deepspeed_engines/test_training_parity.py's.
GRAPHS: dict[str, Callable[[View], list[torch.Tensor]]] = {
    "one_engine": lambda v: [total(v.A(v.x).square())],
    "engine_plus_own_module": lambda v: [total((v.A(v.x) + v.Am(v.y)).square())],
    "two_engines": _two,
    "three_engines": _three,
    "engine_plus_other_module": lambda v: [total((v.A(v.x) + v.Bm(v.y)).square())],
    "nested_A_of_B": lambda v: [total(v.A(v.B(v.x)).square())],
    "upstream_feeds_two_engines": _upstream,
    **{f"ckpt_around_{_ckpt_name(how)}": _around(how) for how in CHECKPOINTS},
}


@dataclass(frozen=True)
class Shape:
    graph: str
    gas: dict[str, int]
    call: str  # "engine:A", "engine:A:noscale", "loss" (sum(roots).backward()), "roots"
    ds_wrong: dict[str, bool] = field(default_factory=dict)  # generation -> DeepSpeed alone is wrong
    stages: tuple[int, ...] = (1, 2, 3)
    variants: tuple[str, ...] = ("fp32",)
    unowned: str = "any"
    ckpt_inside: tuple[str, bool] | None = None  # checkpoint inside each engine's forward

    @property
    def id(self) -> str:
        gas = "".join(f"{n}{g}" for n, g in self.gas.items())
        inside = "" if self.ckpt_inside is None else f"-ckpt_inside_{_ckpt_name(self.ckpt_inside)}"
        return f"{self.graph}{inside}-{gas}-{self.call.replace(':', '_')}"

    @property
    def scale(self) -> bool:
        return not self.call.endswith(":noscale")


def wrong_on(hooks: bool, tracker: bool) -> dict[str, bool]:
    return {"hooks": hooks, "tracker": tracker}


ENGINE_ONLY = (0, 1, 2, 3)  # stage 0 allows only engine.backward over the caller's own engine outputs
SHAPES: list[Shape] = [
    Shape("one_engine", {"A": 2}, "engine:A", wrong_on(False, False), ENGINE_ONLY),
    Shape("one_engine", {"A": 2}, "loss", wrong_on(False, False)),
    Shape("engine_plus_own_module", {"A": 2}, "engine:A", wrong_on(True, False), ENGINE_ONLY),
    Shape("engine_plus_own_module", {"A": 2}, "loss", wrong_on(True, True)),
    Shape("two_engines", {"A": 2, "B": 2}, "engine:A", wrong_on(False, False)),
    Shape("two_engines", {"A": 2, "B": 2}, "loss", wrong_on(False, False)),
    Shape("two_engines", {"A": 2, "B": 2}, "roots", wrong_on(False, False)),
    Shape("two_engines", {"A": 2, "B": 4}, "engine:A", wrong_on(False, True), variants=("fp32", "bf16", "offload")),
    Shape("two_engines", {"A": 2, "B": 4}, "engine:B", wrong_on(False, True)),
    Shape("two_engines", {"A": 2, "B": 4}, "loss", wrong_on(False, False), variants=("fp32", "bf16", "offload")),
    Shape("two_engines", {"A": 2, "B": 4}, "roots", wrong_on(False, False)),
    Shape("two_engines", {"A": 2, "B": 4}, "engine:A:noscale", wrong_on(True, False)),
    Shape("three_engines", {"A": 2, "B": 2, "C": 2}, "engine:C", wrong_on(False, False)),
    Shape("three_engines", {"A": 2, "B": 2, "C": 2}, "roots", wrong_on(False, False)),
    Shape("three_engines", {"A": 2, "B": 4, "C": 8}, "engine:A", wrong_on(False, True)),
    Shape("three_engines", {"A": 2, "B": 4, "C": 8}, "engine:B", wrong_on(False, True)),
    Shape("three_engines", {"A": 2, "B": 4, "C": 8}, "engine:C", wrong_on(False, True)),
    Shape("three_engines", {"A": 2, "B": 4, "C": 8}, "loss", wrong_on(False, False)),
    Shape("three_engines", {"A": 2, "B": 4, "C": 8}, "roots", wrong_on(False, False)),
    Shape("engine_plus_other_module", {"A": 2, "B": 4}, "engine:A", wrong_on(True, True), ENGINE_ONLY),
    Shape("engine_plus_other_module", {"A": 2, "B": 4}, "loss", wrong_on(True, True)),
    Shape("nested_A_of_B", {"A": 2, "B": 2}, "engine:A", wrong_on(True, False)),
    Shape("nested_A_of_B", {"A": 2, "B": 2}, "loss", wrong_on(True, True)),
    Shape("nested_A_of_B", {"A": 2, "B": 4}, "engine:A", wrong_on(True, True), variants=("fp32", "bf16")),
    Shape("nested_A_of_B", {"A": 2, "B": 4}, "engine:B", wrong_on(True, True)),
    Shape("nested_A_of_B", {"A": 2, "B": 4}, "loss", wrong_on(True, True), variants=("fp32", "offload")),
    Shape("upstream_feeds_two_engines", {"A": 2, "B": 4}, "loss", wrong_on(True, True), unowned="plain"),
    Shape("upstream_feeds_two_engines", {"A": 2, "B": 4}, "engine:B", wrong_on(True, True), unowned="plain"),
    *(Shape(f"ckpt_around_{_ckpt_name(how)}", {"A": 2, "B": 4}, call, wrong_on(False, call != "loss"))
      for how in CHECKPOINTS for call in ("loss", "engine:A")),
    # DeepSpeed's non-reentrant checkpoint inside a ZeRO-3 forward fails on its own
    # (recomputation sees partitioned, empty parameters), with or without graphscale.
    *(Shape("two_engines", {"A": 2, "B": 4}, call, wrong_on(False, call != "loss"), ckpt_inside=how,
            stages=(1, 2) if how == ("ds", False) else (1, 2, 3))
      for how in CHECKPOINTS for call in ("loss", "engine:A")),
]


def shape_cases(shapes: list[Shape],
                stages_filter: Callable[[Shape], tuple[int, ...]] = lambda s: s.stages) -> list[Any]:
    out = []
    for s in shapes:
        for v in s.variants:
            for st in stages_filter(s):
                if v == "offload" and st == 1:
                    continue  # ZeRO-Offload needs stage 2 or 3
                if v != "fp32" and st == 0:
                    continue
                out.append(pytest.param(s, st, v, id=f"{s.id}-z{st}-{v}"))
    return out


# ------------------------------------------------------------------ running a shape
@dataclass
class Result:
    grads: dict[str, list[torch.Tensor]]  # engine name -> full grads
    upstream: torch.Tensor | None
    returned: torch.Tensor | None
    loss: torch.Tensor


def run_backward(call: str, roots: list[torch.Tensor], engines: dict[str, Any]) -> torch.Tensor | None:
    loss = roots[0] if len(roots) == 1 else sum(roots[1:], roots[0])
    if call.startswith("engine:"):
        parts = call.split(":")
        return engines[parts[1]].backward(loss, scale_wrt_gas=len(parts) == 2)
    if call == "loss":
        loss.backward()
    else:
        torch.autograd.backward(roots)
    return None


def engines_in(pool: Pool, shape: Shape) -> dict[str, Any]:
    return {n: pool.engines[n] for n in shape.gas}


def run_deepspeed(pool: Pool, shape: Shape, mode: str, roots: list[torch.Tensor] | None = None) -> Result:
    """Run ``shape`` on the pool's engines; mode: graphscale, deepspeed_alone, adapter_off."""
    engines = engines_in(pool, shape)
    for n, e in engines.items():
        set_gas(e, shape.gas[n])
    if mode == "graphscale":
        inst = graphscale.install(*engines.values(), unowned=shape.unowned)
    elif mode == "adapter_off":
        inst = graphscale.install(*(graphscale.Group(e.module, gas=e.gradient_accumulation_steps, name=n)
                                    for n, e in engines.items()), unowned=shape.unowned)
    else:
        inst = None
    try:
        if roots is None:
            roots = GRAPHS[shape.graph](ds_view(pool, shape.gas, shape.ckpt_inside))
        loss = sum(r.detach() for r in roots).cpu()
        returned = run_backward(shape.call, roots, engines)
    finally:
        if inst is not None:
            inst.remove()
    up = pool.upstream.weight.grad
    return Result({n: full_grads(e) for n, e in engines.items()},
                  None if up is None else up.detach().float().cpu().clone(), returned, loss)


def oracle(pool: Pool, shape: Shape, gas: dict[str, int] | None = None) -> Result:
    """Plain PyTorch on the copies: each model's gradient times its factor."""
    gas = gas or shape.gas
    roots = GRAPHS[shape.graph](ref_view(pool, shape.gas, shape.ckpt_inside))
    torch.autograd.backward(roots)
    grads = {}
    for n in shape.gas:
        f = 1.0 / gas[n] if shape.scale else 1.0
        grads[n] = [p.grad * f for p in pool.refs[n].parameters()]
    up = pool.upstream_ref.weight.grad
    loss = sum(r.detach() for r in roots)
    for ref in pool.refs.values():
        ref.zero_grad(set_to_none=True)
    pool.upstream_ref.zero_grad(set_to_none=True)
    return Result(grads, None if up is None else up.clone(), None, loss)


def errors(got: Result, want: Result, shape: Shape) -> dict[str, float]:
    """Max relative error per engine, and of the upstream module under unowned="plain"."""
    errs = {n: max_rel_err(got.grads[n], want.grads[n]) for n in want.grads}
    if shape.unowned == "plain":
        assert got.upstream is not None and want.upstream is not None
        errs["U"] = max_rel_err([got.upstream], [want.upstream])
    return errs


def report(shape_id: str, mode: str, errs: dict[str, float]) -> None:
    path = os.environ.get("GRAPHSCALE_DS_REPORT")
    if not path:
        return
    import deepspeed

    with open(path, "a") as f:
        f.write(json.dumps({"deepspeed": deepspeed.__version__, "shape": shape_id, "mode": mode,
                            "max_rel_err": max(errs.values())}) + "\n")
