"""DeepSpeed engines A, B and C per (ZeRO stage, variant), each beside a plain
copy of its model made before ``deepspeed.initialize``, and the views that
run one graph on the engines or on the copies: what the DeepSpeed shape tests
(tests/deepspeed_engines/test_shapes*.py, tests/stacks/test_cuda.py) run on."""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

from helpers.engines import ds_config, ds_device
from helpers.models import TanhMLP

FP32_TOL = 1e-6
BF16_TOL = 3e-2  # bf16 weights and activations against a float32 oracle
NAMES = ("A", "B", "C")


# ------------------------------------------------------------------ models
def checkpointed(how: tuple[str, bool], fn: Callable[..., Any], *args: Any) -> Any:
    impl, reentrant = how
    if impl == "torch":
        import torch.utils.checkpoint as tc

        return tc.checkpoint(fn, *args, use_reentrant=reentrant)
    from deepspeed.runtime.activation_checkpointing import checkpointing as dc

    if not dc.is_configured():
        dc.configure(None)
    broken = _ds_checkpointing_broken()
    if broken:
        pytest.skip(f"deepspeed.checkpointing does not run on this accelerator: {broken}")
    return dc.checkpoint(fn, *args) if reentrant else dc.non_reentrant_checkpoint(fn, *args)


@functools.lru_cache(maxsize=None)
def _ds_checkpointing_broken() -> str:
    """Why DeepSpeed's own checkpointing fails on a plain Linear here, or ''.
    (0.19.5 asks the CPU accelerator for a Stream, which it has not.)"""
    from deepspeed.runtime.activation_checkpointing import checkpointing as dc

    device = ds_device()
    lin, x = torch.nn.Linear(2, 2).to(device), torch.ones(1, 2, device=device, requires_grad=True)
    try:
        dc.checkpoint(lin, x).sum().backward()
        dc.non_reentrant_checkpoint(lin, x).sum().backward()
    except Exception as exc:  # DeepSpeed's own failure, reported in the skip reason
        return f"{type(exc).__name__}: {exc}"
    return ""


class Net(TanhMLP):
    """tanh(l1 x) then l2; ``ckpt`` checkpoints the l2 half (params inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.ckpt: tuple[str, bool] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        if self.ckpt is None:
            return self.l2(h)
        return checkpointed(self.ckpt, self.l2, h)


def generation() -> str:
    """'tracker' for DeepSpeed >= 0.19.6 (PR 8245), 'hooks' before it."""
    import deepspeed.runtime.engine as eng

    return "tracker" if hasattr(eng, "_ENGINE_BACKWARD_GRAPH_TRACKER") else "hooks"


def set_gas(engine: Any, gas: int) -> None:
    engine.set_train_batch_size(gas * engine.train_micro_batch_size_per_gpu() * engine.dp_world_size)
    assert engine.gradient_accumulation_steps() == gas


class Pool:
    """Engines A, B, C of one (stage, variant), made on first use, each with a
    plain copy of its model made before ``deepspeed.initialize``; a plain
    upstream module and its copy.

    Every test gets fresh engines: DeepSpeed's ZeRO bookkeeping between a
    backward and the next ``step()`` is its own business, and an engine that
    ran a backward without stepping is not a clean start for the next test.
    """

    def __init__(self, stage: int, variant: str = "fp32") -> None:
        self.stage, self.variant = stage, variant
        self.engines = _Lazy(self._make)
        self.refs: dict[str, Net] = {}
        torch.manual_seed(7)
        self.upstream = torch.nn.Linear(4, 4)
        self.upstream_ref = copy.deepcopy(self.upstream)

    def _make(self, name: str) -> Any:
        import deepspeed

        torch.manual_seed(100 + NAMES.index(name))
        m = Net()
        self.refs[name] = copy.deepcopy(m)  # before initialize: ZeRO-3 partitions m's parameters
        cfg = ds_config(2, self.stage, bf16=self.variant == "bf16", offload=self.variant == "offload",
                        zero_force_ds_cpu_optimizer=False)  # ZeRO-Offload with the client's SGD
        engine, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), config=cfg)
        engine.set_gradient_accumulation_boundary(True)  # reduce at once: grads readable after one backward
        return engine

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.variant == "bf16" else torch.float32

    @property
    def tol(self) -> float:
        return BF16_TOL if self.variant == "bf16" else FP32_TOL


class _Lazy(dict):  # type: ignore[type-arg]
    def __init__(self, make: Callable[[str], Any]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, key: str) -> Any:
        value = self[key] = self._make(key)
        return value


# ------------------------------------------------------------------ shapes as data
@dataclass
class View:
    """What a shape's graph is built from: engines, or the plain copies."""

    A: Any
    B: Any
    C: Any
    Am: torch.nn.Module
    Bm: torch.nn.Module
    U: torch.nn.Module
    x: torch.Tensor
    y: torch.Tensor


def ds_view(pool: Pool, names: Any, ckpt: tuple[str, bool] | None = None) -> View:
    e = {n: pool.engines[n] for n in names}
    m = {n: e[n].module for n in e}
    for mod in m.values():
        mod.ckpt = ckpt
    # the engines' device (cuda under DS_ACCELERATOR=cuda: tests/stacks/test_cuda.py); the oracle stays on the CPU
    device = ds_device()
    x, y = _inputs(pool.dtype, device)
    upstream = pool.upstream.to(device=device, dtype=pool.dtype)
    return View(e.get("A"), e.get("B"), e.get("C"), m.get("A"), m.get("B"), upstream, x, y)


def ref_view(pool: Pool, names: Any, ckpt: tuple[str, bool] | None = None) -> View:
    for n in names:
        pool.engines[n]  # the copies are made with the engines
    r = pool.refs
    for mod in r.values():
        mod.ckpt = ckpt
    x, y = _inputs(torch.float32)
    return View(r.get("A"), r.get("B"), r.get("C"), r.get("A"), r.get("B"), pool.upstream_ref, x, y)


def _inputs(dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return (torch.randn(3, 4, generator=g).to(device, dtype), torch.randn(3, 4, generator=g).to(device, dtype))
