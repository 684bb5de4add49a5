"""Real DeepSpeed engines (CPU accelerator, gloo, one rank) in every engine mix
of issue 3, each checked against a plain-PyTorch oracle computed in the same
test: copies of the models made before ``deepspeed.initialize``, the same
graph run plainly, each model's gradient times its engine's factor.

Three modes run every shape of ``SHAPES``:

* ``graphscale``: installed; every engine's gradient must match the oracle.
* ``deepspeed_alone``: not installed; DeepSpeed must be wrong exactly where
  ``Shape.ds_wrong`` says for this DeepSpeed generation (NOTE [ DeepSpeed's two
  generations ] in graphscale/_adapters/deepspeed/__init__.py), so every shape listed there
  fails without graphscale.  Set ``GRAPHSCALE_DS_REPORT=path`` to append the
  measured errors as JSON lines.
* ``adapter_off``: graphscale governs the engines' modules as plain Groups
  while DeepSpeed keeps dividing; it must be wrong in every shape, so each
  shape also fails with the adapter switched off.

Engines are cheap on CPU but not free, so each module keeps a pool of engines
per (ZeRO stage, variant) and resets gradients and GAS before each use.
"""
from __future__ import annotations

import copy
import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

import graphscale

from helpers.engines import ds_config, ds_device, require_deepspeed
from helpers.functions import Boom
from helpers.grads import full_grads, max_rel_err
from helpers.models import TanhMLP

pytestmark = [pytest.mark.deepspeed, require_deepspeed]

FP32_TOL = 1e-6
BF16_TOL = 3e-2  # bf16 weights and activations against a float32 oracle
NAMES = ("A", "B", "C")


# ------------------------------------------------------------------ models
def _checkpoint(how: tuple[str, bool], fn: Callable[..., Any], *args: Any) -> Any:
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
        return _checkpoint(self.ckpt, self.l2, h)


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


@pytest.fixture
def pools(ds_dist: None) -> Callable[..., Pool]:
    """``pools(stage, variant="fp32")`` -> a Pool of fresh engines for this test."""
    return Pool


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
    # the engines' device (cuda under DS_ACCELERATOR=cuda: tests/test_cuda.py); the oracle stays on the CPU
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


def _sum(t: torch.Tensor) -> torch.Tensor:
    return t.float().sum()


def _two(v: View) -> list[torch.Tensor]:
    a, b = v.A(v.x), v.B(v.y)
    return [_sum(a * b), _sum(b.square())]


def _three(v: View) -> list[torch.Tensor]:
    a, b, c = v.A(v.x), v.B(v.y), v.C(v.x + v.y)
    return [_sum(a * b), _sum(c.square() + b)]


def _upstream(v: View) -> list[torch.Tensor]:
    h = v.U(v.x)
    return [_sum((v.A(h) + v.B(h)).square())]


def _ckpt_name(how: tuple[str, bool]) -> str:
    return f"{how[0]}_{'reentrant' if how[1] else 'nonreentrant'}"


CHECKPOINTS = [(impl, reentrant) for impl in ("torch", "ds") for reentrant in (True, False)]


def _around(how: tuple[str, bool]) -> Callable[[View], list[torch.Tensor]]:
    def graph(v: View) -> list[torch.Tensor]:
        h = v.U(v.x)  # an input that requires grad, or reentrant checkpoint gives none
        return [_sum(_checkpoint(how, lambda t: v.A(t) * v.B(t), h))]

    return graph


# Each graph calls each engine once; losses that forward an engine twice, and
# training with step() on one and two ranks, are tests/test_training_parity.py's.
GRAPHS: dict[str, Callable[[View], list[torch.Tensor]]] = {
    "one_engine": lambda v: [_sum(v.A(v.x).square())],
    "engine_plus_own_module": lambda v: [_sum((v.A(v.x) + v.Am(v.y)).square())],
    "two_engines": _two,
    "three_engines": _three,
    "engine_plus_other_module": lambda v: [_sum((v.A(v.x) + v.Bm(v.y)).square())],
    "nested_A_of_B": lambda v: [_sum(v.A(v.B(v.x)).square())],
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


def _wrong(hooks: bool, tracker: bool) -> dict[str, bool]:
    return {"hooks": hooks, "tracker": tracker}


ENGINE_ONLY = (0, 1, 2, 3)  # stage 0 allows only engine.backward over the caller's own engine outputs
SHAPES: list[Shape] = [
    Shape("one_engine", {"A": 2}, "engine:A", _wrong(False, False), ENGINE_ONLY),
    Shape("one_engine", {"A": 2}, "loss", _wrong(False, False)),
    Shape("engine_plus_own_module", {"A": 2}, "engine:A", _wrong(True, False), ENGINE_ONLY),
    Shape("engine_plus_own_module", {"A": 2}, "loss", _wrong(True, True)),
    Shape("two_engines", {"A": 2, "B": 2}, "engine:A", _wrong(False, False)),
    Shape("two_engines", {"A": 2, "B": 2}, "loss", _wrong(False, False)),
    Shape("two_engines", {"A": 2, "B": 2}, "roots", _wrong(False, False)),
    Shape("two_engines", {"A": 2, "B": 4}, "engine:A", _wrong(False, True), variants=("fp32", "bf16", "offload")),
    Shape("two_engines", {"A": 2, "B": 4}, "engine:B", _wrong(False, True)),
    Shape("two_engines", {"A": 2, "B": 4}, "loss", _wrong(False, False), variants=("fp32", "bf16", "offload")),
    Shape("two_engines", {"A": 2, "B": 4}, "roots", _wrong(False, False)),
    Shape("two_engines", {"A": 2, "B": 4}, "engine:A:noscale", _wrong(True, False)),
    Shape("three_engines", {"A": 2, "B": 2, "C": 2}, "engine:C", _wrong(False, False)),
    Shape("three_engines", {"A": 2, "B": 2, "C": 2}, "roots", _wrong(False, False)),
    Shape("three_engines", {"A": 2, "B": 4, "C": 8}, "engine:A", _wrong(False, True)),
    Shape("three_engines", {"A": 2, "B": 4, "C": 8}, "engine:B", _wrong(False, True)),
    Shape("three_engines", {"A": 2, "B": 4, "C": 8}, "engine:C", _wrong(False, True)),
    Shape("three_engines", {"A": 2, "B": 4, "C": 8}, "loss", _wrong(False, False)),
    Shape("three_engines", {"A": 2, "B": 4, "C": 8}, "roots", _wrong(False, False)),
    Shape("engine_plus_other_module", {"A": 2, "B": 4}, "engine:A", _wrong(True, True), ENGINE_ONLY),
    Shape("engine_plus_other_module", {"A": 2, "B": 4}, "loss", _wrong(True, True)),
    Shape("nested_A_of_B", {"A": 2, "B": 2}, "engine:A", _wrong(True, False)),
    Shape("nested_A_of_B", {"A": 2, "B": 2}, "loss", _wrong(True, True)),
    Shape("nested_A_of_B", {"A": 2, "B": 4}, "engine:A", _wrong(True, True), variants=("fp32", "bf16")),
    Shape("nested_A_of_B", {"A": 2, "B": 4}, "engine:B", _wrong(True, True)),
    Shape("nested_A_of_B", {"A": 2, "B": 4}, "loss", _wrong(True, True), variants=("fp32", "offload")),
    Shape("upstream_feeds_two_engines", {"A": 2, "B": 4}, "loss", _wrong(True, True), unowned="plain"),
    Shape("upstream_feeds_two_engines", {"A": 2, "B": 4}, "engine:B", _wrong(True, True), unowned="plain"),
    *(Shape(f"ckpt_around_{_ckpt_name(how)}", {"A": 2, "B": 4}, call, _wrong(False, call != "loss"))
      for how in CHECKPOINTS for call in ("loss", "engine:A")),
    # DeepSpeed's non-reentrant checkpoint inside a ZeRO-3 forward fails on its own
    # (recomputation sees partitioned, empty parameters), with or without graphscale.
    *(Shape("two_engines", {"A": 2, "B": 4}, call, _wrong(False, call != "loss"), ckpt_inside=how,
            stages=(1, 2) if how == ("ds", False) else (1, 2, 3))
      for how in CHECKPOINTS for call in ("loss", "engine:A")),
]


def _cases(shapes: list[Shape], stages_filter: Callable[[Shape], tuple[int, ...]] = lambda s: s.stages) -> list[Any]:
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


def _backward(call: str, roots: list[torch.Tensor], engines: dict[str, Any]) -> torch.Tensor | None:
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
        returned = _backward(shape.call, roots, engines)
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


def _report(shape_id: str, mode: str, errs: dict[str, float]) -> None:
    path = os.environ.get("GRAPHSCALE_DS_REPORT")
    if not path:
        return
    import deepspeed

    with open(path, "a") as f:
        f.write(json.dumps({"deepspeed": deepspeed.__version__, "shape": shape_id, "mode": mode,
                            "max_rel_err": max(errs.values())}) + "\n")


# ------------------------------------------------------------------ the tests
@pytest.mark.parametrize("shape, stage, variant", _cases(SHAPES))
def test_every_engine_gets_its_own_factor_under_graphscale(pools: Any, shape: Shape, stage: int, variant: str) -> None:
    pool = pools(stage, variant)
    want = oracle(pool, shape)
    got = run_deepspeed(pool, shape, "graphscale")
    errs = errors(got, want, shape)
    assert max(errs.values()) <= pool.tol, f"per-engine max relative error {errs}"
    assert torch.allclose(got.loss, want.loss, rtol=pool.tol, atol=0), "graph differs from the oracle's"
    if shape.call.startswith("engine:"):
        caller = shape.call.split(":")[1]
        expect = got.loss / shape.gas[caller] if shape.scale else got.loss
        assert got.returned is not None and torch.equal(got.returned.detach().float().cpu(), expect.float())


@pytest.mark.parametrize("shape, stage, variant", _cases(SHAPES))
def test_deepspeed_alone_is_wrong_exactly_where_documented(pools: Any, shape: Shape, stage: int,
                                                          variant: str) -> None:
    pool = pools(stage, variant)
    want = oracle(pool, shape)
    errs = errors(run_deepspeed(pool, shape, "deepspeed_alone"), want, shape)
    _report(f"{shape.id}-z{stage}-{variant}", "deepspeed_alone", errs)
    gen = generation()
    wrong = max(errs.values()) > pool.tol
    assert wrong == shape.ds_wrong[gen], (
        f"DeepSpeed alone ({gen} generation) {'is' if wrong else 'is not'} wrong here, "
        f"per-engine max relative error {errs}")


@pytest.mark.parametrize("shape, stage, variant", _cases(SHAPES, lambda s: (2,)))
def test_adapter_is_needed_in_every_shape(pools: Any, shape: Shape, stage: int, variant: str) -> None:
    pool = pools(stage, variant)
    want = oracle(pool, shape)
    errs = errors(run_deepspeed(pool, shape, "adapter_off"), want, shape)
    _report(f"{shape.id}-z{stage}-{variant}", "adapter_off", errs)
    assert max(errs.values()) > pool.tol, "governing the modules without the adapter should scale twice"


# ------------------------------------------------------------------ shapes that need more than one backward
TWO_GAS = Shape("two_engines", {"A": 2, "B": 4}, "engine:A", _wrong(False, True))
NESTED_LOSS = Shape("nested_A_of_B", {"A": 2, "B": 4}, "loss", _wrong(True, True))


def _assert_matches(got: Result, want: Result, shape: Shape, tol: float = FP32_TOL) -> None:
    errs = errors(got, want, shape)
    assert max(errs.values()) <= tol, f"per-engine max relative error {errs}"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gas_changed_after_install_is_read_at_the_next_backward(pools: Any, stage: int) -> None:
    pool = pools(stage)
    engines = engines_in(pool, TWO_GAS)
    for n, e in engines.items():
        set_gas(e, TWO_GAS.gas[n])
    with graphscale.install(*engines.values()):
        set_gas(engines["A"], 8)
        roots = GRAPHS[TWO_GAS.graph](ds_view(pool, TWO_GAS.gas))
        loss = sum(r.detach() for r in roots)
        returned = _backward(TWO_GAS.call, roots, engines)
    got = Result({n: full_grads(e) for n, e in engines.items()}, None, returned, loss)
    _assert_matches(got, oracle(pool, TWO_GAS, gas={"A": 8, "B": 4}), TWO_GAS)
    assert returned is not None and torch.equal(returned.detach(), loss / 8)


@pytest.mark.parametrize("shape", [TWO_GAS, NESTED_LOSS, Shape("two_engines", {"A": 2, "B": 4}, "loss")],
                         ids=lambda s: s.id)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_outputs_made_before_install_are_exact_after_it(pools: Any, shape: Shape, stage: int) -> None:
    pool = pools(stage)
    engines = engines_in(pool, shape)
    for n, e in engines.items():
        set_gas(e, shape.gas[n])
    roots = GRAPHS[shape.graph](ds_view(pool, shape.gas))  # DeepSpeed's output hooks registered now
    got = run_deepspeed(pool, shape, "graphscale", roots=roots)
    _assert_matches(got, oracle(pool, shape), shape)


@pytest.mark.parametrize("shape", [TWO_GAS, NESTED_LOSS], ids=lambda s: s.id)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_remove_restores_deepspeeds_own_behaviour_exactly(pools: Any, shape: Shape, stage: int) -> None:
    """Both shapes are ones DeepSpeed alone gets wrong on some generation, so
    "restored" is not the same as "exact" here."""
    native = run_deepspeed(pools(stage), shape, "deepspeed_alone")
    pool = pools(stage)  # fresh engines, same weights
    engines = engines_in(pool, shape)
    inst = graphscale.install(*engines.values())
    made_while_installed = GRAPHS[shape.graph](ds_view(pool, shape.gas))
    inst.remove()
    assert all("backward" not in e.__dict__ and "_backward_prologue_per_tensor" not in e.__dict__
               for e in engines.values())
    after = run_deepspeed(pool, shape, "deepspeed_alone", roots=made_while_installed)
    for n in native.grads:
        for g, w in zip(after.grads[n], native.grads[n], strict=True):
            assert torch.equal(g, w), f"engine {n}: gradient differs from a run never installed"
    if native.returned is not None:
        assert after.returned is not None and torch.equal(after.returned, native.returned)


# ZeRO-3 refuses a second backward over a retained graph.  ZeRO-2 loses the
# second micro-step of an engine whose backward prologue does not run again
# (DeepSpeed's output hooks run it once per forward): measured the same with
# and without graphscale, so at stage 2 only the caller's engine runs a forward.
RETAINED = [
    pytest.param(Shape("two_engines", {"A": 2, "B": 4}, "engine:A"), 1, id="two_engines-engine_A-z1"),
    pytest.param(Shape("two_engines", {"A": 2, "B": 4}, "loss"), 1, id="two_engines-loss-z1"),
    pytest.param(Shape("engine_plus_other_module", {"A": 2, "B": 4}, "engine:A"), 2,
                 id="engine_plus_other_module-engine_A-z2"),
    pytest.param(Shape("engine_plus_own_module", {"A": 2}, "engine:A"), 2, id="engine_plus_own_module-engine_A-z2"),
]


@pytest.mark.parametrize("shape, stage", RETAINED)
def test_second_backward_over_a_retained_graph_is_exact(pools: Any, shape: Shape, stage: int) -> None:
    call = shape.call
    pool = pools(stage)
    engines = engines_in(pool, shape)
    for n, e in engines.items():
        set_gas(e, shape.gas[n])
    with graphscale.install(*engines.values()):
        roots = GRAPHS[shape.graph](ds_view(pool, shape.gas))
        loss = sum(roots[1:], roots[0])
        for boundary in (False, True):  # accumulate locally, then reduce: two micro-steps
            for e in engines.values():
                e.set_gradient_accumulation_boundary(boundary)
            if call == "loss":
                loss.backward(retain_graph=True)
            else:
                engines["A"].backward(loss, retain_graph=True)
    got = Result({n: full_grads(e) for n, e in engines.items()}, None, None, loss.detach())
    want = oracle(pool, shape)
    want.grads = {n: [2 * g for g in gs] for n, gs in want.grads.items()}
    _assert_matches(got, want, shape)


# Where the failing node sits.  Only above both engines: a node failing
# between A and B in A(B(x)) leaves A's gradient of the failed backward in
# A's leaves (plain PyTorch does the same), and ZeRO's reduction state after
# a partial backward ("already reduced" at the next one) is DeepSpeed's.
ABORTS: dict[str, Callable[[View], torch.Tensor]] = {
    "at_root": lambda v: Boom.apply(_sum(v.A(v.x) * v.B(v.y))),
}


@pytest.mark.parametrize("where", list(ABORTS))
@pytest.mark.parametrize("call", ["engine:A", "loss"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_backward_aborted_by_an_exception_leaves_the_next_one_exact(pools: Any, call: str, stage: int,
                                                                   where: str) -> None:
    shape = Shape("nested_A_of_B", {"A": 2, "B": 4}, call)
    pool = pools(stage)
    engines = engines_in(pool, shape)
    for n, e in engines.items():
        set_gas(e, shape.gas[n])
    with graphscale.install(*engines.values()):
        with pytest.raises(RuntimeError, match="boom"):
            _backward(call, [ABORTS[where](ds_view(pool, shape.gas))], engines)
        roots = GRAPHS[shape.graph](ds_view(pool, shape.gas))
        loss = sum(r.detach() for r in roots)
        returned = _backward(call, roots, engines)
    got = Result({n: full_grads(e) for n, e in engines.items()}, None, returned, loss)
    _assert_matches(got, oracle(pool, shape), shape)


def test_pipeline_engine_is_refused_at_install(ds_dist: None) -> None:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    pm = PipelineModule(layers=[torch.nn.Linear(4, 4)], num_stages=1, loss_fn=torch.nn.MSELoss())
    engine, *_ = deepspeed.initialize(model=pm, optimizer=torch.optim.SGD(pm.parameters(), lr=0.1),
                                      config=ds_config(2, 1))
    with pytest.raises(TypeError, match="PipelineEngine schedules its own micro-batches"):
        graphscale.install(engine)
    assert "backward" not in engine.__dict__
