"""``python -m graphscale demo``: where DeepSpeed's GAS scaling goes wrong, measured.

Builds small real DeepSpeed engines on the CPU (one rank, gloo, ZeRO stage 1)
and runs each graph shape of the design table twice: DeepSpeed alone, and
with graphscale installed.  Every parameter's gradient is compared with a
plain-PyTorch oracle, and the largest relative error per shape is tabulated.
This module returns text; only ``graphscale/__main__.py`` prints it.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._core.table import format_table
from .._entry.install import install
from .explain import explain

__all__ = ["Shape", "Row", "SHAPES", "run_demo", "format_report", "EXACT"]

EXACT = 1e-5  # largest relative error still called exact (float32 round-off is ~1e-7)
_STAGE = 1  # stage 0 refuses a direct loss.backward(); stage 1 keeps gradients in .grad


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(4, 4)
        self.l2 = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))


@dataclass(frozen=True)
class Shape:
    """One graph shape: its engines' GAS, its loss, how backward is called.

    ``loss(A, A_module, B, B_module, x, y)``: ``A``/``B`` are engines (or, for
    the oracle, the plain modules themselves).  ``backward``: ``"tensor"``
    (``loss.backward()``), ``"engine"`` (``A.backward(loss)``) or
    ``"engine_unscaled"`` (``A.backward(loss, scale_wrt_gas=False)``, where
    every factor is 1).
    """

    name: str
    gas: tuple[int, ...]
    loss: Callable[..., torch.Tensor]
    backward: str


SHAPES: tuple[Shape, ...] = (
    Shape("A(x) + A.module(y), loss.backward()  [DS issue 8224]", (4,),
          lambda a, am, b, bm, x, y: a(x).sum() + am(y).pow(2).sum(), "tensor"),
    Shape("A(x) + B(x), A.backward(loss), GAS 2 and 4", (2, 4),
          lambda a, am, b, bm, x, y: a(x).sum() + b(x).pow(2).sum(), "engine"),
    Shape("nested A(B(x)), A.backward(loss), GAS 2 and 4", (2, 4),
          lambda a, am, b, bm, x, y: a(b(x)).pow(2).sum(), "engine"),
    Shape("A(x) + B(x), A.backward(loss, scale_wrt_gas=False)", (2, 4),
          lambda a, am, b, bm, x, y: a(x).sum() + b(x).pow(2).sum(), "engine_unscaled"),
)


@dataclass(frozen=True)
class Row:
    """One shape's result: the largest relative gradient error of DeepSpeed
    alone and with graphscale, and graphscale's plan for it."""

    shape: str
    deepspeed_alone: float
    graphscale: float
    plan: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _setup() -> Any:
    """Import deepspeed quietly and start a one-rank gloo group if none is running."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        try:
            comm: Any = importlib.import_module("deepspeed.comm.torch")
        except ImportError:  # pragma: no cover - other DeepSpeed layouts
            comm = None
        if os.environ["WORLD_SIZE"] == "1" and hasattr(comm, "build_shm_op"):
            # One rank needs no shared-memory collectives; skip the JIT build of
            # DeepSpeed's shm op (minutes on 2 cores when its cache is cold).
            comm.build_shm_op = lambda: None
        if not torch.distributed.is_initialized():
            deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def _engine(deepspeed: Any, module: torch.nn.Module, gas: int) -> Any:
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": _STAGE},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    with contextlib.redirect_stdout(sys.stderr):
        engine, *_ = deepspeed.initialize(
            model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1), config=config
        )
    return engine


def _rel_err(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    worst = 0.0
    for g, w in zip(got, want):
        scale = float(w.abs().max()) or 1.0
        worst = max(worst, float((g.float() - w.float()).abs().max()) / scale)
    return worst


def _run_shape(deepspeed: Any, shape: Shape, governed: bool) -> tuple[float, str]:
    from deepspeed.utils import safe_get_full_grad

    torch.manual_seed(0)
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    nets = [_Net() for _ in shape.gas]
    plain = [copy.deepcopy(n) for n in nets]
    engines = [_engine(deepspeed, n, gas) for n, gas in zip(nets, shape.gas)]

    def args(mods: Sequence[Any], modules: Sequence[torch.nn.Module]) -> tuple[Any, ...]:
        b, bm = (mods[1], modules[1]) if len(mods) > 1 else (None, None)
        return (mods[0], modules[0], b, bm, x, y)

    # The oracle: plain PyTorch (copies of the models made before deepspeed.initialize, the same graph),
    # each model's gradient times its engine's factor.
    params = [list(p.parameters()) for p in plain]
    grads = torch.autograd.grad(shape.loss(*args(plain, plain)), [q for ps in params for q in ps])
    unscaled = shape.backward == "engine_unscaled"
    want: list[torch.Tensor] = []
    it = iter(grads)
    for ps, gas in zip(params, shape.gas):
        want += [next(it) * (1.0 if unscaled else 1.0 / gas) for _ in ps]

    plan = ""
    with (install(*engines) if governed else contextlib.nullcontext()):
        loss = shape.loss(*args(engines, [e.module for e in engines]))
        if governed:
            explained = explain(loss, scale_wrt_gas=not unscaled)
            n = len(explained.multiplications)
            plan = explained.note.split(",")[0] if explained.fast_path else f"{n} multiplication{'s' * (n != 1)}"
            if not n:
                plan = "nothing to multiply"
        if shape.backward == "tensor":
            loss.backward()
        else:
            engines[0].backward(loss, scale_wrt_gas=not unscaled)
    got = [safe_get_full_grad(p).detach().clone() for e in engines for p in e.module.parameters()]
    return _rel_err(got, want), plan


def run_demo(shapes: Sequence[Shape] = SHAPES) -> tuple[list[Row], str]:
    """Run every shape both ways; return the rows and a header line naming
    the versions.  Needs deepspeed; starts a one-rank gloo process group if
    none is running (setting RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
    MASTER_PORT where unset)."""
    t0 = time.perf_counter()
    deepspeed = _setup()
    rows = []
    for shape in shapes:
        alone, _ = _run_shape(deepspeed, shape, governed=False)
        governed, plan = _run_shape(deepspeed, shape, governed=True)
        rows.append(Row(shape.name, alone, governed, plan))
    header = (
        f"DeepSpeed {deepspeed.__version__}, torch {torch.__version__}, ZeRO stage {_STAGE}, CPU, one rank, "
        f"{os.environ.get('GRAPHSCALE_WALKER', 'auto')} walker; {time.perf_counter() - t0:.1f} s"
    )
    return rows, header


def format_report(rows: Sequence[Row], header: str) -> str:
    """The demo's report: one row per shape, errors relative to the oracle."""

    def cell(err: float) -> str:
        return f"{err:.2g}  " + ("exact" if err <= EXACT else "WRONG")

    table = format_table(["shape", "DeepSpeed alone", "with graphscale", "graphscale's plan"],
                          [[r.shape, cell(r.deepspeed_alone), cell(r.graphscale), r.plan] for r in rows])
    lines = [
        f"graphscale demo: {header}",
        "largest relative gradient error vs a plain-PyTorch oracle (each engine's parameters: 1/GAS x the "
        "plain gradient; 1 under scale_wrt_gas=False)",
        "",
        table,
    ]
    lines += [
        "",
        "DeepSpeed divides by GAS at each engine's output tensors (<= 0.19.5), or divides the whole loss by the",
        "GAS of the engine whose backward runs (>= 0.19.6). graphscale puts 1/GAS on each engine's own parameters;",
        "graphscale.explain(loss) shows where it multiplies.",
    ]
    return "\n".join(lines)
