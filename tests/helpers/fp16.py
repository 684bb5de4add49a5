"""Two fp16 DeepSpeed engines in one loss, as the fp16 tests
(tests/deepspeed_engines/test_fp16*.py) and scripts/fp16_check.py run them:
the configs, the CPU and CUDA fp16 set-ups, the graphs, the ``Rig`` that
builds engines beside plain copies, and the least-squares ratio of a
gradient to the plain one."""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from helpers.engines import ds_config, ds_device
from helpers.grads import full_grads
from helpers.models import TanhMLP as Net

GAS = {"A": 2, "B": 4}
SCALE_POWER = {"A": 8, "B": 4}  # dynamic loss scales start apart: 256 and 16
FP16_TOL = 1e-2  # fp16 weights and activations against a float32 oracle (measured <= 1.0e-3 on the CPU)
STEP_TOL = 1e-2  # weight changes after eight fp16 micro-steps vs a float32 reference (measured <= 1.4e-3;


#                  a scale left stale after B's overflow: relative error 1)
LR = 0.1
STAGE0_SKIP = ("ZeRO stage 0: DeepSpeed 0.19.x's engine.backward does not apply its non-ZeRO fp16 optimizers' loss "
               "scale while their step() divides by it (DeepSpeed alone is wrong by 1/scale): nothing per-engine "
               "to check (module docstring)")


STAGES = [pytest.param(0, marks=pytest.mark.skip(reason=STAGE0_SKIP), id="z0"),
          *(pytest.param(s, id=f"z{s}") for s in (1, 2, 3))]


# ------------------------------------------------------------------ where fp16 engines run
def _cpu_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.accelerator import get_accelerator

    if ds_device() != "cpu":
        pytest.skip(f"the CPU variant needs DeepSpeed's CPU accelerator; this session's is {ds_device()!r} "
                    "(the cuda variant runs here instead)")
    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)


def _cuda_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.accelerator import get_accelerator

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU: torch sees no CUDA device here")
    if ds_device() != "cuda":
        pytest.skip(f"needs DeepSpeed's CUDA accelerator; this session's is {ds_device()!r} (set DS_ACCELERATOR=cuda, "
                    "as scripts/gpu_check.sh does)")
    if not get_accelerator().is_fp16_supported():
        pytest.skip("DeepSpeed reports fp16 unsupported on this GPU")


DEVICES = [pytest.param(_cpu_fp16, id="cpu"), pytest.param(_cuda_fp16, id="cuda", marks=pytest.mark.cuda)]


# ------------------------------------------------------------------ engines, graphs, oracle
def fp16_config(name: str, stage: int) -> dict[str, Any]:
    # clip 0: DeepSpeed clips to norm 1 unless told, the reference does not clip; hysteresis 1: the first
    # overflow halves the scale (DeepSpeed's default waits for a second)
    return ds_config(GAS[name], stage, clip=0.0,
                     fp16={"initial_scale_power": SCALE_POWER[name], "hysteresis": 1, "loss_scale_window": 1000})


def as_float(t: torch.Tensor) -> torch.Tensor:
    return t.float()


def _two_engines(A: Any, B: Any, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    a, b = A(x), B(y)
    return [as_float(a * b).sum(), as_float(b).square().sum()]


# Each graph calls each engine once: an engine's second forward in one
# backward runs its ZeRO prologue twice, and DeepSpeed then skips its epilogue.
GRAPHS: dict[str, Callable[[Any, Any, torch.Tensor, torch.Tensor], list[torch.Tensor]]] = {
    "two_engines": _two_engines,
    "nested_B_of_A": lambda A, B, x, y: [as_float(B(A(x))).square().sum()],
}


class Rig:
    """Fresh fp16 engines A and B (seeded: two rigs start equal), their plain
    float32 copies made before ``deepspeed.initialize``."""

    def __init__(self, stage: int, boundary: bool | None = True) -> None:
        import deepspeed

        self.engines: dict[str, Any] = {}
        self.refs: dict[str, torch.nn.Module] = {}
        for k, name in enumerate(GAS):
            torch.manual_seed(100 + k)
            m = Net()
            self.refs[name] = copy.deepcopy(m)
            engine, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=LR),
                                              config=fp16_config(name, stage))
            if boundary is not None:  # True: reduce at once, gradients readable after one backward
                engine.set_gradient_accumulation_boundary(boundary)
            self.engines[name] = engine
        self.device = self.engines["A"].device

    @staticmethod
    def inputs(k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + k)
        return torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)

    def roots(self, graph: str, k: int = 0) -> list[torch.Tensor]:
        x, y = (t.to(self.device, torch.half) for t in self.inputs(k))
        return GRAPHS[graph](self.engines["A"], self.engines["B"], x, y)

    def plain_grads(self, graph: str, k: int = 0) -> dict[str, list[torch.Tensor]]:
        """The oracle's plain gradients (no factor), float32 on the CPU."""
        torch.autograd.backward(GRAPHS[graph](self.refs["A"], self.refs["B"], *self.inputs(k)))
        out = {n: [p.grad.clone() for p in m.parameters()] for n, m in self.refs.items()}
        for m in self.refs.values():
            m.zero_grad(set_to_none=True)
        return out

    def scales(self) -> dict[str, float]:
        from graphscale._adapters.deepspeed import loss_scale

        return {n: loss_scale(e) for n, e in self.engines.items()}

    def grads(self) -> dict[str, list[torch.Tensor]]:
        return {n: full_grads(e) for n, e in self.engines.items()}

    def backward(self, call: str, roots: list[torch.Tensor]) -> None:
        loss = roots[0] if len(roots) == 1 else sum(roots[1:], roots[0])
        if call == "loss":
            loss.backward()
        elif call.startswith("engine:"):
            self.engines[call.split(":")[1]].backward(loss)
        elif call.startswith("scale:"):
            self.engines[call.split(":")[1]].scale(loss).backward()
        else:
            raise ValueError(call)


def fit_ratio(got: list[torch.Tensor], plain: list[torch.Tensor]) -> float:
    """The least-squares c in got ~ c x plain."""
    num = sum((g.double() * p.double()).sum() for g, p in zip(got, plain, strict=True))
    den = sum((p.double() ** 2).sum() for p in plain)
    return float(num / den)


CALLS = ["engine:A", "engine:B", "loss", "scale:B"]
