"""What the tests of factors beyond 1/GAS share (issue 10 item 4):
``Group(..., factor=number or callable)`` in place of ``gas=``, for plain
groups and DeepSpeed engines.

Every gradient of those tests is checked against a plain-PyTorch oracle
computed in the same test: copies of the models made before anything is
installed (or before ``deepspeed.initialize``), the same graph run plainly,
each model's gradient times its group's factor.  Every case can fail: the
no-op (plain gradients) and DeepSpeed alone are shown to be wrong where they
are.  The tests, by what they pin:

* tests/factors/test_exact.py: each group, and each engine, gets exactly its factor;
* tests/factors/test_read_once.py: a factor callable is read once, at the start of every backward;
* tests/factors/test_window_objective.py: a token-normalised language-model loss
  beside a mean-normalised value loss matches the window's objective;
* tests/factors/test_refused.py: bad factors and conflicting groups are refused, no gradient touched;
* tests/factors/test_explain_audit.py: ``explain`` shows custom factors, ``audit`` checks them.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

import graphscale
from graphscale import observe

from helpers.engines import ds_config
from helpers.grads import leaf_grads
from helpers.models import tanh_mlp

F64_RTOL = 1e-12  # float64 models; factors such as 0.3 are not powers of two
FP32_TOL = 1e-6
BF16_TOL = 3e-2  # bf16 weights and activations against a float32 oracle (tests/deepspeed_engines/test_shapes.py)


# ------------------------------------------------------------------ factor specifications as data
@dataclass(frozen=True)
class Spec:
    """How a group's factor is given: ``factor=value``, ``factor=lambda: value``,
    ``gas=value`` or ``gas=lambda: value``."""

    kind: str  # "factor" | "factor_fn" | "gas" | "gas_fn"
    value: float

    @property
    def factor(self) -> float:
        return self.value if self.kind.startswith("factor") else 1.0 / self.value

    def group(self, module: Any, name: str) -> graphscale.Group:
        v = self.value
        if self.kind == "factor":
            return graphscale.Group(module, factor=v, name=name)
        if self.kind == "factor_fn":
            return graphscale.Group(module, factor=lambda: v, name=name)
        if self.kind == "gas":
            return graphscale.Group(module, gas=int(v), name=name)
        return graphscale.Group(module, gas=lambda: int(v), name=name)

    def __str__(self) -> str:
        return f"{self.kind}{self.value:g}"


F1, F3, F03_FN, F025 = Spec("factor", 1.0), Spec("factor", 3.0), Spec("factor_fn", 0.3), Spec("factor", 0.25)
GAS4, GAS2_FN = Spec("gas", 4), Spec("gas_fn", 2)


# ------------------------------------------------------------------ plain models and shapes
class Net(torch.nn.Module):
    """head(tanh(sub(x))), float64; ``sub`` is the submodule the
    engine-plus-module shape calls directly."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.sub = torch.nn.Linear(3, 3, dtype=torch.float64)
        self.head = torch.nn.Linear(3, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.sub(x)))


Models = dict[str, torch.nn.Module]


@dataclass(frozen=True)
class Shape:
    models: tuple[str, ...]
    loss: Callable[[Models, torch.Tensor, torch.Tensor], torch.Tensor]


SHAPES: dict[str, Shape] = {
    "a(x)+b(y)": Shape(("a", "b"), lambda m, x, y: (m["a"](x) + m["b"](y)).square().sum()),
    "a(x)+b(y)+c(x)": Shape(("a", "b", "c"), lambda m, x, y: (m["a"](x) + m["b"](y) + m["c"](x)).square().sum()),
    "a(b(x))": Shape(("a", "b"), lambda m, x, y: m["a"](m["b"](x)).square().sum()),
    "a(b(c(x)))": Shape(("a", "b", "c"), lambda m, x, y: m["a"](m["b"](m["c"](x))).square().sum()),
    # the engine-plus-module shape (DeepSpeed issue 8224) with plain groups
    "a(x)+a.sub(y)": Shape(("a",), lambda m, x, y: (m["a"](x) + m["a"].sub(y)).square().sum()),
    "a(x)+a.sub(y)+b(x)": Shape(("a", "b"), lambda m, x, y: (m["a"](x) + m["a"].sub(y) + m["b"](x)).square().sum()),
}


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(4, 3, generator=g, dtype=torch.float64),
            torch.randn(4, 3, generator=g, dtype=torch.float64))


def make_models(names: tuple[str, ...]) -> Models:
    return {n: Net(i + 1) for i, n in enumerate(names)}


def plain_grads(shape: Shape, models: Models, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """The oracle: plain PyTorch on copies of ``models``."""
    copies = {n: copy.deepcopy(m) for n, m in models.items()}
    shape.loss(copies, x, y).backward()
    return leaf_grads(copies)


def owned_factors(models: Models, specs: dict[str, Spec]) -> dict[str, float]:
    return {f"{n}.{pn}": specs[n].factor for n, m in models.items() for pn, _ in m.named_parameters()}


@contextmanager
def recording() -> Iterator[list[tuple[int, int]]]:
    """Every governed backward's (nodes walked, multiplications), through the
    walk recorder (the fast path records (0, seeds scaled))."""
    seen: list[tuple[int, int]] = []
    with observe.walks(lambda nodes, seconds, mults: seen.append((nodes, mults))):
        yield seen


# ------------------------------------------------------------------ a factor callable that counts its calls
class Reads:
    """A factor callable that counts its calls and returns ``value``."""

    def __init__(self, value: float) -> None:
        self.value = value
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return self.value


# ------------------------------------------------------------------ DeepSpeed engines: A (GAS 2) and B (GAS 4)
ENGINE_GAS = {"A": 2, "B": 4}


def engine_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(3, 4, generator=g).to(dtype), torch.randn(3, 4, generator=g).to(dtype)


def make_engines(stage: int, bf16: bool = False,
             boundary: bool = True) -> tuple[dict[str, Any], dict[str, torch.nn.Module]]:
    """Fresh engines A and B and float32 copies made before initialize.
    ``boundary``: reduce at every backward (gradients readable after one)."""
    import deepspeed

    engines, refs = {}, {}
    for i, name in enumerate(("A", "B")):
        m = tanh_mlp(10 + i)
        refs[name] = copy.deepcopy(m)
        engines[name], *_ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                                 config=ds_config(ENGINE_GAS[name], stage, bf16=bf16))
        if boundary:
            engines[name].set_gradient_accumulation_boundary(True)
    return engines, refs
