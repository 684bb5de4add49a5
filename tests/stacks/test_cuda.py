"""CUDA: DeepSpeed engines on a GPU (one rank, NCCL), exact against a
plain-PyTorch oracle on the CPU, and governance while autograd runs the
backward's nodes on its CUDA device threads.

Runs where torch sees a GPU and DeepSpeed's accelerator is CUDA
(``DS_ACCELERATOR=cuda``; tests/helpers/engines.py defaults it to cpu, and then
the process group is gloo); ``scripts/gpu_check.sh`` runs it so.  Everywhere
else every test here skips with the reason.

* The DeepSpeed shapes (tests/deepspeed_engines/test_shapes.py, run on CUDA): a sum
  of two engines, nested engines, an engine plus its own module, an
  upstream module, activation checkpointing (torch's and DeepSpeed's,
  reentrant and not, around and inside the engines), by ``engine.backward``,
  ``loss.backward()`` and ``torch.autograd.backward(roots)``; graphscale
  exact, DeepSpeed alone wrong exactly where documented.
* The thread scenarios of tests/hardening/test_thread_governance.py, with nothing
  emulated: on CUDA the output hooks genuinely cannot see the caller's
  thread-local (each scenario checks that they did not), so only the graph
  task binding keeps a governed backward governed, including through a
  remove() from another thread in the middle of it.

Without a GPU, the thread scenarios with plain groups run on an emulated
device whose backward runs on its own autograd device thread
(tests/helpers/device_threads.py, tests/device_threads/); what only a GPU can
check is listed in tests/device_threads/test_thread_scenarios.py.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import graphscale

from helpers.engines import HAVE_DEEPSPEED, ds_device, require_deepspeed

pytestmark = [pytest.mark.cuda, pytest.mark.deepspeed, require_deepspeed]

# CUDA's float32 kernels against the CPU oracle: other summation orders and
# tanh; 1e-5 leaves a gap of four orders of magnitude to the smallest wrong
# factor (0.5).  Not yet measured on a GPU.
CUDA_FP32_TOL = 1e-5


@pytest.fixture
def on_cuda(request: pytest.FixtureRequest) -> Iterator[None]:
    """Skip unless engines go to a GPU here; the one-rank NCCL group; float32
    matmuls without TF32 (the oracle runs in float32 on the CPU)."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU: torch sees no CUDA device here")
    if ds_device() != "cuda":
        pytest.skip(f"needs DeepSpeed's CUDA accelerator; this session's is {ds_device()!r} "
                    "(set DS_ACCELERATOR=cuda, as scripts/gpu_check.sh does)")
    request.getfixturevalue("ds_dist")
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


# ------------------------------------------------------------------ the DeepSpeed shapes on CUDA
def _shape_cases() -> list[Any]:
    from helpers.engine_shapes import SHAPES, shape_cases

    wanted = {
        "two_engines-A2B4-engine_A", "two_engines-A2B4-loss", "two_engines-A2B4-roots",
        "nested_A_of_B-A2B4-engine_A", "nested_A_of_B-A2B4-loss",
        "engine_plus_own_module-A2-engine_A", "engine_plus_own_module-A2-loss",
        "upstream_feeds_two_engines-A2B4-loss", "three_engines-A2B4C8-engine_B",
        "ckpt_around_torch_reentrant-A2B4-loss", "ckpt_around_torch_nonreentrant-A2B4-engine_A",
        "ckpt_around_ds_reentrant-A2B4-engine_A", "ckpt_around_ds_nonreentrant-A2B4-loss",
        "two_engines-ckpt_inside_torch_reentrant-A2B4-engine_A", "two_engines-ckpt_inside_ds_reentrant-A2B4-loss",
    }
    shapes = [s for s in SHAPES if s.id in wanted]
    missing = wanted - {s.id for s in shapes}
    assert not missing, f"shapes renamed in tests/deepspeed_engines/test_shapes.py: {sorted(missing)}"
    # ZeRO 1 and 3 (stage 2 sits between them; scripts/gpu_check.sh runs the whole matrix with the time left)
    return shape_cases(shapes, lambda s: tuple(st for st in s.stages if st in (1, 3)))


CUDA_SHAPES = _shape_cases() if HAVE_DEEPSPEED else []


@pytest.mark.parametrize("shape, stage, variant", CUDA_SHAPES)
def test_every_engine_gets_its_own_factor_on_cuda(on_cuda: None, shape: Any, stage: int, variant: str) -> None:
    from helpers.engine_pool import Pool
    from helpers.engine_shapes import errors, oracle, run_deepspeed

    pool = Pool(stage, variant)
    want = oracle(pool, shape)
    got = run_deepspeed(pool, shape, "graphscale")
    errs = errors(got, want, shape)
    assert max(errs.values()) <= max(pool.tol, CUDA_FP32_TOL), f"per-engine max relative error {errs}"
    assert next(iter(pool.engines.values())).device.type == "cuda"


@pytest.mark.parametrize("shape, stage, variant", CUDA_SHAPES)
def test_deepspeed_alone_is_wrong_on_cuda_exactly_where_documented(on_cuda: None, shape: Any, stage: int,
                                                                  variant: str) -> None:
    from helpers.engine_pool import Pool, generation
    from helpers.engine_shapes import errors, oracle, run_deepspeed

    pool = Pool(stage, variant)
    want = oracle(pool, shape)
    errs = errors(run_deepspeed(pool, shape, "deepspeed_alone"), want, shape)
    wrong = max(errs.values()) > max(pool.tol, CUDA_FP32_TOL)
    assert wrong == shape.ds_wrong[generation()], f"DeepSpeed alone: per-engine max relative error {errs}"


# ------------------------------------------------------------------ CUDA's device threads
def test_cuda_backward_runs_engine_output_hooks_off_the_callers_thread(on_cuda: None, make_engine: Any) -> None:
    """The premise of the thread scenarios below: an engine's output hooks
    run on an autograd device thread, not on the thread that called
    backward, and there graphscale's thread-local is empty while the task
    binding is found."""
    from graphscale._backward import running as _running

    torch.manual_seed(0)
    engine = make_engine(torch.nn.Linear(4, 4), gas=2, stage=1)
    engine.set_gradient_accumulation_boundary(True)
    seen: list[tuple[int, bool, bool]] = []

    def probe(grad: torch.Tensor) -> torch.Tensor:
        seen.append((threading.get_ident(), False, _running.task_binding() is not None))  # (no thread-local exists)
        return grad

    with graphscale.install(engine):
        out = engine(torch.randn(3, 4, device=engine.device))
        out.register_hook(probe)
        out.square().sum().backward()
    assert seen, "the probe never ran"
    (ident, local, bound), = seen
    assert ident != threading.get_ident(), "the hook ran on the caller's thread"
    assert not local and bound, f"on the device thread: thread-local seen {local}, task bound {bound}"


def _thread_cases() -> list[Any]:
    from helpers.thread_scenarios import SCENARIOS

    return [pytest.param(n, c, id=f"{n}-{c.id}") for n, s in SCENARIOS.items() for c in s.cases]


THREAD_CASES = _thread_cases() if HAVE_DEEPSPEED else []


@pytest.mark.parametrize("name, case", THREAD_CASES)
def test_output_hooks_obey_the_running_backward_on_cuda_device_threads(
        on_cuda: None, make_engine: Any, monkeypatch: pytest.MonkeyPatch, name: str, case: Any) -> None:
    from helpers.thread_scenarios import SCENARIOS

    problems = SCENARIOS[name].run(make_engine, case, monkeypatch)
    assert not problems, problems
