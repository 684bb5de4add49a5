"""What the training-parity tests run (tests/deepspeed_engines/test_training_parity*.py,
tests/deepspeed_engines/test_unmanaged_accumulation.py): engines A (GAS 2), B (GAS 4) and C (GAS 8)
beside plain copies, the shapes and cases, one case trained for
``MICRO_STEPS`` micro-steps with ``step()`` after each, and what DeepSpeed
alone is documented to do."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch

import graphscale

from helpers.engines import ds_config
from helpers.functions import Boom
from helpers.grads import full_grads
from helpers.models import TanhMLP

GAS = {"A": 2, "B": 4, "C": 8}
MICRO_STEPS = 8
LR = 0.1


# bf16: forwards, gradients and (ZeRO 3) their reduction in bf16, against a
# float32 reference: measured up to 0.069 on two ranks; a wrong factor or a
# missing reduction here is an error above 0.5.
# fp16 (CPU, DeepSpeed's capability flag forced as in tests/deepspeed_engines/test_fp16.py): each
# engine's own dynamic loss scale (A 2**6, B 2**3) rides on its gradients and
# its optimizer unscales; the reduced gradient is compared times that scale.
# (At A 2**8 the forced-boundary backward overflowed fp16 in A's gradient, a
# NaN the reduced-gradient check could not compare and, before it refused NaN,
# let pass: the scales are kept apart, and low enough that no step overflows;
# training through an overflow is tests/deepspeed_engines/test_fp16.py's.)
# fp16 measured: weight change <= 0.0037, reduced gradient <= 0.028 (engine_twice, all stages and
# calls, fp16 weights 8 steps away from the float32 reference); a wrong factor is above 0.5.
# prescale / predivide: fp32 with DeepSpeed's gradient knobs, which change how the data-parallel
# all-reduce divides (before it, by the world or by the factor, the rest after): exact either way.
KNOBS: dict[str, dict[str, Any]] = {"prescale": {"prescale_gradients": True},
                                    "predivide": {"gradient_predivide_factor": 2.0}}
TOL = {"fp32": 1e-5, "bf16": 0.1, "fp16": 5e-2, "prescale": 1e-5, "predivide": 1e-5}
SCALE_POWER = {"A": 6, "B": 3, "C": 5}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "prescale": torch.float32,
          "predivide": torch.float32}
WORLD = 2


# ------------------------------------------------------------------ models and shapes
class Net(TanhMLP):
    """tanh(l1 x) then l2; ``reentrant`` checkpoints the l2 half (torch, use_reentrant=True)."""

    def __init__(self, seed: int, reentrant: bool = False) -> None:
        super().__init__(seed)
        self.reentrant = reentrant
        self.boom = False  # the output's backward raises: after the engine's output hooks, before any gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        if self.reentrant:
            import torch.utils.checkpoint as tc

            out = tc.checkpoint(self.l2, h, use_reentrant=True)
        else:
            out = self.l2(h)
        return Boom.apply(out) if self.boom else out


@dataclass
class View:
    """What a loss is built from: the engines (or the reference models), A's
    module (``engine.module``, or the same reference model) and the data."""

    m: dict[str, Callable[[torch.Tensor], torch.Tensor]]
    Am: Callable[[torch.Tensor], torch.Tensor]
    x: torch.Tensor
    y: torch.Tensor


def _sq(t: torch.Tensor) -> torch.Tensor:
    return t.float().square().sum()


def _ckpt_around(v: View, again: bool) -> torch.Tensor:
    """A and B inside one reentrant checkpoint (their forwards run again in the
    nested backward); ``again``: A forwarded once more outside it."""
    import torch.utils.checkpoint as tc

    h = v.x.detach().requires_grad_()  # reentrant checkpoint needs an input that requires grad
    inner = tc.checkpoint(lambda t: v.m["A"](t) * v.m["B"](t), h, use_reentrant=True)
    return _sq(inner + v.m["A"](v.y) if again else inner)


def _sum(v: View) -> torch.Tensor:
    return _sq(v.m["A"](v.x) + v.m["B"](v.y))


def _twice(v: View) -> torch.Tensor:
    return _sq(v.m["A"](v.x) + v.m["A"](v.y) + v.m["B"](v.y))


@dataclass(frozen=True)
class Shape:
    engines: tuple[str, ...]
    loss: Callable[[View], torch.Tensor]
    reentrant: tuple[str, ...] = ()  # engines whose model checkpoints its l2 (reentrant)


SHAPES: dict[str, Shape] = {
    "sum": Shape(("A", "B"), _sum),
    "engine_plus_module": Shape(("A", "B"), lambda v: _sq(v.m["A"](v.x) + v.Am(v.y) + v.m["B"](v.y))),
    "nested": Shape(("A", "B"), lambda v: _sq(v.m["B"](v.m["A"](v.x)))),
    "engine_twice": Shape(("A", "B"), _twice),
    "nested_engine_twice": Shape(("A", "B"), lambda v: _sq(v.m["B"](v.m["A"](v.x)) + v.m["A"](v.y))),
    "three_engines": Shape(("A", "B", "C"),
                           lambda v: _sq(v.m["A"](v.x) * v.m["B"](v.y) + v.m["C"](v.x + v.y) + v.m["A"](v.y))),
    "checkpointed": Shape(("A", "B"), _sum, reentrant=("A", "B")),
    "checkpoint_around_engines": Shape(("A", "B"), lambda v: _ckpt_around(v, again=False)),
    "checkpointed_engine_twice": Shape(("A", "B"), _twice, reentrant=("A", "B")),
    "checkpoint_around_engine_twice": Shape(("A", "B"), lambda v: _ckpt_around(v, again=True)),
    "one_engine_twice": Shape(("A",), lambda v: _sq(v.m["A"](v.x) + v.m["A"](v.y))),
}


# Reentrant checkpointing hands a parameter used twice in one backward two
# gradients, one per nested backward; ZeRO 2 and 3 reduce each parameter once
# per backward and refuse the second ("already been reduced", or an assert in
# stage 3), with or without graphscale: these shapes train at ZeRO 1 only
# (pinned at 2 and 3 by test_zero_2_and_3_refuse_a_parameter_checkpointed_twice_in_one_backward).
CHECKPOINTED_TWICE = ["checkpointed_engine_twice", "checkpoint_around_engine_twice"]


@dataclass(frozen=True)
class Case:
    shape: str
    call: str  # "engine:A" (A.backward(loss)), "engine:B" or "loss" (loss.backward())
    stage: int  # A's ZeRO stage, and every engine's unless ``others`` says
    variant: str = "fp32"
    others: int | None = None  # the ZeRO stage of the engines but A (mixed stages)

    @property
    def id(self) -> str:
        mixed = "" if self.others is None else f"-others_z{self.others}"
        return f"{self.shape}-{self.call.replace(':', '_')}-z{self.stage}{mixed}-{self.variant}"

    def stage_of(self, name: str) -> int:
        return self.stage if name == "A" or self.others is None else self.others


def training_cases(shapes: Any, calls: Any = ("engine:A", "loss"), stages: Any = (1, 2, 3),
           variant: str = "fp32", others: int | None = None) -> list[Case]:
    return [Case(s, c, st, variant, others) for s in shapes for c in calls for st in stages]


TWO_ENGINE_SHAPES = [s for s in SHAPES if s != "one_engine_twice" and s not in CHECKPOINTED_TWICE]
# ZeRO 0 in every shape and call (issue 50), its variants and DeepSpeed's gradient knobs, and ZeRO 0 beside
# ZeRO 3 (a ZeRO-3 actor A feeding a ZeRO-0 critic B, and the other way round).
ZERO0_CASES = [
    *training_cases([*TWO_ENGINE_SHAPES, *CHECKPOINTED_TWICE], ("engine:A", "loss"), (0,)),
    *training_cases(["nested"], ("engine:B",), (0,)),
    *(c for v in ("bf16", "prescale", "predivide")
      for c in training_cases(["sum", "engine_twice"], ("engine:B", "loss"), (0,), v)),
    *training_cases(["nested", "sum"], ("engine:A", "engine:B", "loss"), (3,), others=0),
    *training_cases(["nested"], ("engine:A", "loss"), (0,), others=3),
]
CASES = [
    *training_cases(TWO_ENGINE_SHAPES),
    *training_cases(CHECKPOINTED_TWICE, stages=(1,)),
    *training_cases(["nested"], ("engine:B",)),
    *training_cases(["one_engine_twice"], ("engine:A", "loss"), (0, 1, 2, 3)),
    *training_cases(["engine_twice", "nested_engine_twice"], variant="bf16"),
    # ZeRO 0, which DeepSpeed alone allows only through engine.backward over no other ZeRO-0 engine
    *ZERO0_CASES,
]


FP16_CASES = training_cases(["engine_twice", "nested_engine_twice"], variant="fp16")
TWO_RANK_CASES = [
    *training_cases(TWO_ENGINE_SHAPES),
    *training_cases(CHECKPOINTED_TWICE, stages=(1,)),
    *training_cases(["nested"], ("engine:B",)),
    *training_cases(["one_engine_twice"], ("engine:A",), (0, 3)),
    *training_cases(["engine_twice", "nested_engine_twice"], stages=(3,), variant="bf16"),
    *training_cases(["one_engine_twice", "engine_twice", "nested"], ("loss",), (0,)),
    *(c for v in ("bf16", "prescale", "predivide") for c in training_cases(["sum"], ("engine:B", "loss"), (0,), v)),
    *training_cases(["nested"], ("engine:A", "loss"), (3,), others=0),
]


# ------------------------------------------------------------------ one run
def data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)


def fp32_params(engine: Any) -> list[torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    out = []
    for p in engine.module.parameters():
        master = safe_get_full_fp32_param(p)  # None without a master copy (ZeRO 0 in fp32)
        out.append((p if master is None else master).detach().float().clone())
    return out


def rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    scale = max(w.abs().max().item() for w in want) or 1.0
    return max((g - w).abs().max().item() for g, w in zip(got, want, strict=True)) / scale


def _view(models: dict[str, Any], am: Any, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> View:
    return View(models, am, x.to(dtype), y.to(dtype))


def _loss_scale(engine: Any) -> float:
    """The fp16 loss scale the engine's optimizer expects its gradients to carry (1 in fp32 and bf16)."""
    opt = engine.optimizer
    scaler = getattr(opt, "loss_scaler", None)
    return float(scaler.cur_scale) if engine.fp16_enabled() and scaler is not None else 1.0


def _plain_grads(shape: Shape, refs: dict[str, Net], step: int, world: int) -> dict[str, list[torch.Tensor]]:
    """Each reference model's gradient, averaged over the ranks' data (no GAS factor)."""
    out = {n: [torch.zeros_like(p) for p in r.parameters()] for n, r in refs.items()}
    for r in range(world):
        x, y = data(r, step)
        for ref in refs.values():
            ref.zero_grad(set_to_none=True)
        # .backward(), not autograd.grad: reentrant checkpointing supports only the former
        shape.loss(_view(dict(refs), refs["A"], x, y, torch.float32)).backward()
        for n, ref in refs.items():
            for acc, p in zip(out[n], ref.parameters()):
                if p.grad is not None:
                    acc += p.grad / world
    return out


def _backward(call: str, loss: torch.Tensor, engines: dict[str, Any]) -> None:
    if call == "loss":
        loss.backward()
    else:
        engines[call.split(":")[1]].backward(loss)


def run_case(case: Case, rank: int, world: int, govern: bool, abort_first: bool = False) -> dict[str, Any]:
    """Train ``case`` on fresh engines beside the reference; {"status": "exact" |
    "wrong" | "raises", "train_err", "grad_err" (the one-backward check), "error"}.
    ``abort_first``: a first micro-step whose backward raises after every
    engine's output hooks ran and before any gradient; the user skips it (no
    step), the reference never sees it."""
    import deepspeed

    shape = SHAPES[case.shape]
    dtype = DTYPES[case.variant]
    refs = {n: Net(10 + k, reentrant=n in shape.reentrant) for k, n in enumerate(shape.engines)}
    start = {n: [p.detach().clone() for p in r.parameters()] for n, r in refs.items()}
    engines: dict[str, Any] = {}
    for n, ref in refs.items():
        m = copy.deepcopy(ref)  # before initialize: ZeRO-3 partitions m's parameters
        # clip 0: ZeRO clips to norm 1 unless told, the reference does not clip; fp16's hysteresis 1: an
        # overflow halves the scale at once
        fp16 = {"initial_scale_power": SCALE_POWER[n], "hysteresis": 1} if case.variant == "fp16" else None
        cfg = ds_config(GAS[n], case.stage_of(n), micro_batch=3, clip=0.0, bf16=case.variant == "bf16", fp16=fp16,
                        **KNOBS.get(case.variant, {}))
        engines[n], *_ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=LR), config=cfg)
    opts = {n: torch.optim.SGD(r.parameters(), lr=LR) for n, r in refs.items()}
    acc = {n: [torch.zeros_like(p) for p in r.parameters()] for n, r in refs.items()}
    inst = graphscale.install(*engines.values()) if govern else None
    out: dict[str, Any] = {"status": "exact", "train_err": 0.0, "grad_err": None, "error": None}
    try:
        if abort_first:
            _abort_one_backward(case, shape, engines, dtype, rank)
        for step in range(MICRO_STEPS):
            x, y = data(rank, step)
            loss = shape.loss(_view(engines, engines["A"].module, x, y, dtype))
            _backward(case.call, loss, engines)
            for e in engines.values():
                e.step()
            plain = _plain_grads(shape, refs, step, world)
            for n, ref in refs.items():
                for a, g in zip(acc[n], plain[n]):
                    a += g / GAS[n]
                if (step + 1) % GAS[n] == 0:
                    for p, a in zip(ref.parameters(), acc[n]):
                        p.grad = a.clone()
                        a.zero_()
                    opts[n].step()
        out["train_err"] = max(
            rel_err([w - w0 for w, w0 in zip(fp32_params(engines[n]), start[n])],
                 [p.detach() - w0 for p, w0 in zip(refs[n].parameters(), start[n])]) for n in refs)
        # one more backward at a forced boundary: the reduced gradient itself
        for e in engines.values():
            e.set_gradient_accumulation_boundary(True)
        x, y = data(rank, MICRO_STEPS)
        _backward(case.call, shape.loss(_view(engines, engines["A"].module, x, y, dtype)), engines)
        plain = _plain_grads(shape, refs, MICRO_STEPS, world)
        out["grad_err"] = max(rel_err(full_grads(engines[n], cpu=False),
                                   [g * _loss_scale(engines[n]) / GAS[n] for g in plain[n]])
                              for n in refs)
    except Exception as exc:  # DeepSpeed's own failure in step(): the outcome, recorded
        out.update(status="raises", error=f"{type(exc).__name__}: {exc}"[:300])
        return out
    finally:
        if inst is not None:
            inst.remove()
    tol = TOL[case.variant]
    if not (out["train_err"] <= tol and out["grad_err"] <= tol):  # (a NaN is wrong, not exact)
        out["status"] = "wrong"
    return out


def _abort_one_backward(case: Case, shape: Shape, engines: dict[str, Any], dtype: torch.dtype, rank: int) -> None:
    for e in engines.values():
        e.module.boom = True
    try:
        x, y = data(rank, -1)
        _backward(case.call, shape.loss(_view(engines, engines["A"].module, x, y, dtype)), engines)
    except RuntimeError as exc:
        if "boom" not in str(exc):
            raise
    else:
        raise AssertionError("the aborted backward did not raise")
    finally:
        for e in engines.values():
            e.module.boom = False


def explain(case: Case, result: dict[str, Any]) -> str:
    return (f"{case.id}: {result['status']} (weight-change error {result['train_err']:.3g}, "
            f"reduced-gradient error {result['grad_err']}, {result['error'] or 'no error'})")
