"""Shared test set-up: real DeepSpeed engines on the CPU accelerator (gloo),
skipped cleanly where deepspeed is missing; one of each thing the tests
build or read: the small model (:func:`tanh_mlp`), the DeepSpeed config
(:func:`ds_config`), the gradients of plain leaves and of engines
(:func:`leaf_grads`, :func:`full_grads`); and the gradient oracles'
comparisons (:func:`grad_mismatches`, :func:`max_rel_err`)."""
from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Callable

import pytest
import torch
from _ranks import free_port as _free_port  # noqa: E402  (tests/ is on sys.path for conftest)

import graphscale

try:  # deepspeed is an optional extra: its tests skip without it
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # noqa: F401

    HAVE_DEEPSPEED = True
except Exception:  # pragma: no cover - depends on the environment
    HAVE_DEEPSPEED = False

require_deepspeed = pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed is not installed")


MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject's addopts): one worker per core, at most
    MAX_WORKERS.  Every worker imports torch and DeepSpeed (about 1 GB each)
    and the two-rank tests spawn two more processes; past four workers the
    largest test file, not the core count, bounds the run.  Cores: those
    this process may run on (a container's share, not the host's count)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_WORKERS))


@pytest.fixture(scope="session", autouse=True)
def _native_walker_ready() -> None:
    """Wait once, before the first test, for the native walker (unless
    GRAPHSCALE_WALKER=python).  On a machine whose graphscale cache is empty
    (CI) install() starts a background build and plans with Python until it
    lands (NOTE [ No backward waits for a compiler ] in graphscale/_native);
    waiting here makes every test run on the walker a long run uses, never on
    the fallback by accident of timing.  A failed build is logged and the
    native tests skip (CI then fails on its own check)."""
    from graphscale import _native

    if _native.walker_choice() != "python":
        _native.wait()


def native_route_or_skip() -> Any:
    """The native module, where the native route governs backwards here;
    else the test is skipped (GRAPHSCALE_ROUTE=python, or no native walker)."""
    from graphscale import _native
    from graphscale._backward import gate as _gate

    native = _native.wait()
    if native is None or not _gate.route_enabled():
        pytest.skip("the native route is off here (GRAPHSCALE_ROUTE=python, or no native walker)")
    return native


@pytest.fixture
def python_route() -> Iterator[None]:
    """Every backward of the test takes the Python route (``graphscale/_backward/gate.py``
    route_override, which the native front obeys at once): for tests that spy on or break that
    route's own functions."""
    from graphscale._backward import gate as _gate

    with _gate.route_override(False):
        yield


@pytest.fixture(autouse=True)
def _no_installation_leaks() -> Any:
    """Every test must leave torch exactly as it found it."""
    yield
    from graphscale._backward import entry as _backward
    from graphscale._backward import install as _install
    from graphscale._backward import running as _running

    leaked = list(_install._installations)
    for inst in leaked:
        inst.remove()
    assert not leaked, f"test left installations active: {leaked}"
    assert torch.autograd.backward is _backward.ORIGINAL_BACKWARD
    assert not _running.running(), "a plan stayed registered after its backward"


@pytest.fixture(autouse=True)
def _restore_torch_linear() -> Any:
    """ZeRO-3 replaces torch.nn.functional.linear process-wide ("This will
    persist unless manually reset"), which changes every later graph's node
    types; put it back so no test depends on the order tests run in."""
    linear = torch.nn.functional.linear
    yield
    torch.nn.functional.linear = linear


def ds_device() -> str:
    """The device DeepSpeed's accelerator puts engines on: "cpu" unless the
    session runs with DS_ACCELERATOR=cuda (scripts/gpu_check.sh)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


@pytest.fixture(scope="session")
def ds_dist() -> None:
    """One-rank process group for every DeepSpeed test in this process: gloo
    on the CPU accelerator, NCCL on CUDA's."""
    if not HAVE_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    import deepspeed

    if not torch.distributed.is_initialized():
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        deepspeed.init_distributed(dist_backend="nccl" if ds_device() == "cuda" else "gloo")


class TanhMLP(torch.nn.Module):
    """l2(tanh(l1 x)), 4 -> 4 -> 4, float32: the small model of the engine tests
    (:func:`tanh_mlp` makes it; a test that needs a variant subclasses it: a
    checkpointed l2, an output whose backward raises).  ``seed``: its weights
    are drawn right after ``torch.manual_seed(seed)``; None draws them from
    torch's generator as it stands."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        self.l1 = torch.nn.Linear(4, 4)
        self.l2 = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))


def tanh_mlp(seed: int | None = None, *, sequential: bool = False) -> torch.nn.Module:
    """The two-``Linear`` model of the tests: Linear(4, 4), tanh, Linear(4, 4).

    ``sequential=False``: a :class:`TanhMLP` (parameters ``l1.*``, ``l2.*``;
    tanh a function call).  ``sequential=True``: ``nn.Sequential(Linear,
    Tanh, Linear)`` (parameters ``0.*``, ``2.*``; the Tanh a module of its
    own, which module hooks such as ZeRO 3's see).  For one ``seed`` both
    hold the same weights (the same draws, in the same order).
    """
    if not sequential:
        return TanhMLP(seed)
    if seed is not None:
        torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))


def ds_config(gas: int, stage: int, *, micro_batch: int = 1, clip: float | None = None, bf16: bool = False,
              fp16: Mapping[str, Any] | None = None, offload: bool = False, zero: Mapping[str, Any] | None = None,
              **extra: Any) -> dict[str, Any]:
    """The DeepSpeed config of every engine the tests build (and of the spawned
    workers': tests/_untouched.py, tests/_failed_backward.py; tests/_ca_alone.py
    is handed its configs): ``gas`` micro-steps per window at ZeRO ``stage``,
    the client's optimizer allowed, DeepSpeed's step log silenced.

    ``micro_batch``: ``train_micro_batch_size_per_gpu`` (the batch the test's
    inputs have).  ``clip``: ``gradient_clipping``, left out when None (the
    tests that compare with an unclipped plain reference pass 0.0).  ``bf16``:
    the bf16 section, enabled; ``fp16``: the fp16 section, enabled, with these
    settings beside it (``initial_scale_power``, ``hysteresis``...).
    ``offload``: the optimizer offloaded to the CPU (ZeRO-Offload); ``zero``:
    more ``zero_optimization`` settings; ``extra``: more top-level settings.
    A fresh dict each call: the caller may change it.
    """
    zero_cfg: dict[str, Any] = {"stage": stage, **(zero or {})}
    if offload:
        zero_cfg["offload_optimizer"] = {"device": "cpu"}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gas,
        "zero_optimization": zero_cfg,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if clip is not None:
        cfg["gradient_clipping"] = clip
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if fp16 is not None:
        cfg["fp16"] = {"enabled": True, **fp16}
    cfg.update(extra)
    return cfg


@pytest.fixture
def make_engine(ds_dist: None) -> Callable[..., Any]:
    """``make_engine(module, gas, stage, bf16=False, offload=False, lr=0.1)`` -> engine (SGD)."""
    import deepspeed

    def make(module: torch.nn.Module, gas: int, stage: int, bf16: bool = False, offload: bool = False,
             lr: float = 0.1) -> Any:
        opt = torch.optim.SGD(module.parameters(), lr=lr)
        engine, *_ = deepspeed.initialize(model=module, optimizer=opt,
                                          config=ds_config(gas, stage, bf16=bf16, offload=offload))
        return engine

    return make


def leaf_grads(leaves: Mapping[str, torch.Tensor | torch.nn.Module], clear: bool = False
               ) -> dict[str, torch.Tensor | None]:
    """Each leaf's ``.grad`` as it is now, detached and cloned, by name (None
    where a leaf has none): the one reader of plain tensors' gradients, for
    the plain-PyTorch oracle and the governed run alike.

    A module in ``leaves`` stands for its parameters, named
    ``"<its name>.<parameter name>"`` (``named_parameters()``).  ``clear``:
    each leaf's ``.grad`` is set to None once read, so the next backward's
    gradients are its own (the contract is per backward).
    """
    named: dict[str, torch.Tensor] = {}
    for name, leaf in leaves.items():
        if isinstance(leaf, torch.nn.Module):
            named.update((f"{name}.{n}", p) for n, p in leaf.named_parameters())
        else:
            named[name] = leaf
    out: dict[str, torch.Tensor | None] = {}
    for name, t in named.items():
        out[name] = None if t.grad is None else t.grad.detach().clone()
        if clear:
            t.grad = None
    return out


def full_grads(engine: Any, cpu: bool = True, missing: bool = False) -> list[Any]:
    """Every parameter's full gradient of a DeepSpeed engine, at any ZeRO
    stage, as float32 (cloned): the one reader of engines' gradients.

    ``cpu``: moved to the CPU (False: left on the engine's device).
    ``missing``: None for a parameter whose gradient DeepSpeed does not hold
    (ZeRO 1 before any backward raises "only available immediately after
    backward"); otherwise such a parameter fails the test.
    """
    from deepspeed.utils import safe_get_full_grad

    out: list[torch.Tensor | None] = []
    for p in engine.module.parameters():
        if missing:
            try:
                g = safe_get_full_grad(p)
            except ValueError:
                g = None
            if g is None:
                out.append(None)
                continue
        else:
            g = safe_get_full_grad(p)
        g = g.detach().float()
        out.append((g.cpu() if cpu else g).clone())
    return out


def max_rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Largest |got - want| / max|want| over a list of tensors (0 when equal)."""
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        scale = w.abs().max().item() or 1.0
        worst = max(worst, (g.float() - w.float()).abs().max().item() / scale)
    return worst


def grad_mismatches(
    plain: dict[str, torch.Tensor | None],
    got: dict[str, torch.Tensor | None],
    factor_of: dict[str, float],
    unowned: str,
    rtol: float = 1e-9,
    params: Collection[str] = (),
) -> list[str]:
    """Every leaf whose gradient breaks graphscale's contract, as readable lines.

    ``plain``: the gradients plain PyTorch gives (the oracle); ``got``: what the
    governed run gave; ``factor_of``: 1/gas of each owned leaf (others are
    unowned); ``params``: the unowned leaves that are ``nn.Parameter`` s.
    Owned leaves must be exactly ``factor * plain``; unowned ones exactly
    ``plain`` under ``"plain"`` (and the Parameters under
    ``"plain_params"``), else ``c * plain`` for one ``c`` in {1} and the
    factors in play.
    """
    candidates = sorted({1.0, *factor_of.values()})
    bad: list[str] = []

    def close(g: torch.Tensor, w: torch.Tensor) -> bool:
        if g.shape != w.shape:
            return False
        if w.numel() == 0:
            return True
        return (g.double() - w.double()).abs().max().item() <= rtol * w.abs().max().item()

    for name in sorted(plain.keys() | got.keys()):
        p, g = plain.get(name), got.get(name)
        if p is None or g is None:
            if (p is None) != (g is None):
                bad.append(f"{name}: plain grad is {'None' if p is None else 'set'}, governed is "
                           f"{'None' if g is None else 'set'}")
            continue
        if name in factor_of:
            want = [factor_of[name]]
        elif unowned == "plain" or (unowned == "plain_params" and name in params):
            want = [1.0]
        else:
            want = candidates
        if not any(close(g, p * c) for c in want):
            ratio = (g.double().norm() / p.double().norm().clamp_min(1e-300)).item()
            bad.append(f"{name}: want plain x {' or '.join(f'{c:g}' for c in want)}, "
                       f"got plain x ~{ratio:.6g} (max |diff| vs first: {(g - p * want[0]).abs().max().item():.3g})")
    return bad


_spied: list[list[Any]] = []  # the lists spy_handles() records into, innermost last


class _SpyHandle(torch.utils.hooks.RemovableHandle):
    """RemovableHandle that records itself while spy_handles() is active.
    One class for the whole session: a class made per call leaves a weak
    reference to each in its base's subclass list until the collector runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if _spied:
            _spied[-1].append(self)


@contextmanager
def spy_handles() -> Iterator[list[Any]]:
    """Every RemovableHandle made while inside (Node and tensor register_hook make one)."""
    made = HookSpy()
    original = torch.utils.hooks.RemovableHandle
    torch.utils.hooks.RemovableHandle = _SpyHandle  # type: ignore[misc]
    _spied.append(made)
    try:
        yield made
    finally:
        _spied.pop()
        torch.utils.hooks.RemovableHandle = original  # type: ignore[misc]
        made.native_made = _native_tally()[0] - made.native_start[0]


class HookSpy(list):  # type: ignore[type-arg]
    """The RemovableHandles made inside :func:`spy_handles` (the Python
    route's hooks), plus the native route's hooks counted by the native
    module: ``len()`` is every hook made, of both routes."""

    def __init__(self) -> None:
        super().__init__()
        self.native_start = _native_tally()
        self.native_made = 0  # edge-multiplier hooks the native route made (binding hooks not counted)

    def __len__(self) -> int:
        return super().__len__() + self.native_made

    def native_left(self) -> int:
        """Native hooks (edge multipliers and bindings) still alive."""
        now = _native_tally()
        return (now[1] - self.native_start[1]) + (now[3] - self.native_start[3])


def _native_tally() -> tuple[int, int, int, int]:
    from graphscale import _native

    native = _native.loaded()
    tally = getattr(native, "hook_tally", None)  # the test build's only (tests/_seams.py)
    return tuple(tally())[:4] if tally is not None else (0, 0, 0, 0)  # type: ignore[return-value]


def graphscale_hooks_left(handles: list[Any]) -> list[str]:
    """Of ``handles``, those still registered whose hook is graphscale's."""
    left = []
    if isinstance(handles, HookSpy) and handles.native_left():
        left.append(f"{handles.native_left()} native hook(s)")
    for h in list.__iter__(handles):
        d = h.hooks_dict_ref()
        fn = d.get(h.id) if d is not None else None
        if fn is not None and getattr(fn, "__module__", "").startswith("graphscale"):
            left.append(getattr(fn, "__qualname__", repr(fn)))
    return left


__all__ = ["spy_handles", "graphscale_hooks_left", "require_deepspeed", "ds_config", "ds_device", "full_grads",
           "max_rel_err", "grad_mismatches", "graphscale", "TanhMLP", "tanh_mlp", "leaf_grads"]
