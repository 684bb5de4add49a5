"""graphscale leaves no functorch thread-local state on the thread that
installs it (NOTE [ No functorch state left behind ] in
graphscale/_adapters/deepspeed/checks.py).

Found by counting the main job's rows (issue 52): after one ``install()`` of
an engine and its ``remove()``, every later backward on that thread, of any
model, ran about 950 more instructions per node (+3 % on a 700-node chain of
plain torch): the install-time check had called DeepSpeed's per-tensor
prologue, which asks functorch whether a transform runs, and asking creates
functorch's thread-local state for good; torch's engine then deep-copies it
twice at every node.

Each scenario runs on a fresh thread (whose state starts empty: the test
process's main thread may hold one from another test) and reads the pointer
torch keeps for that state (``at::functorch::functorchTLSAccessor``, found
in libtorch_cpu by its C++ name)."""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, Callable

import pytest
import torch

import graphscale

from helpers.engines import require_deepspeed

_ACCESSOR = "_ZN2at9functorch20functorchTLSAccessorEv"  # at::functorch::functorchTLSAccessor()


def _accessor() -> Any:
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        fn = getattr(ctypes.CDLL(lib), _ACCESSOR)
    except (OSError, AttributeError):
        pytest.skip(f"{_ACCESSOR} is not exported by {lib} (another torch build)")
    fn.restype = ctypes.c_void_p
    return fn


def _functorch_state_after(scenario: Callable[[], None]) -> bool:
    """Run ``scenario`` on a fresh thread; whether functorch's thread-local
    state exists on that thread when it returns."""
    accessor, seen, failed = _accessor(), [], []

    def run() -> None:
        try:
            assert ctypes.c_void_p.from_address(accessor()).value is None, "a fresh thread starts without it"
            scenario()
            seen.append(ctypes.c_void_p.from_address(accessor()).value is not None)
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the scenario did not finish in 120 s"
    if failed:
        raise failed[0]
    return seen[0]


@require_deepspeed
@pytest.mark.deepspeed
@pytest.mark.parametrize("call", ["engine.backward", "loss.backward"])
def test_install_a_governed_backward_and_remove_leave_no_functorch_state_on_the_thread(make_engine: Any,
                                                                                      call: str) -> None:
    torch.manual_seed(0)
    engine = make_engine(torch.nn.Linear(4, 4), gas=2, stage=1)

    def scenario() -> None:
        with graphscale.install(engine):
            loss = engine(torch.randn(2, 4)).pow(2).mean()
            engine.backward(loss) if call == "engine.backward" else loss.backward()

    assert not _functorch_state_after(scenario)


@require_deepspeed
@pytest.mark.deepspeed
def test_a_governed_direct_backward_at_zero_0_leaves_no_functorch_state_on_the_thread(make_engine: Any) -> None:
    """At ZeRO 0 graphscale runs the engine's post-backward hook on the
    caller's thread as the backward returns (NOTE [ Epilogues graphscale runs
    ]); that hook asks functorch too, and the native module drops what the
    asking created."""
    from graphscale import _native

    if _native.wait(timeout=600) is None:
        pytest.skip("the native module is not loaded here (without it the state stays)")
    torch.manual_seed(0)
    engine = make_engine(torch.nn.Linear(4, 4), gas=2, stage=0)

    def scenario() -> None:
        with graphscale.install(engine):
            engine(torch.randn(2, 4)).pow(2).mean().backward()

    assert not _functorch_state_after(scenario)


@require_deepspeed
@pytest.mark.deepspeed
def test_deepspeed_alone_leaves_no_functorch_state_and_its_prologue_outside_a_backward_does(make_engine: Any) -> None:
    """The control: DeepSpeed's own ``engine.backward`` leaves none (it asks
    inside the backward), and the call graphscale's check makes, asked on the
    caller's thread outside a backward, does: what the test above would see
    if the check ran there."""
    torch.manual_seed(0)
    engine = make_engine(torch.nn.Linear(4, 4), gas=2, stage=1)

    def alone() -> None:
        engine.backward(engine(torch.randn(2, 4)).pow(2).mean())

    assert not _functorch_state_after(alone)
    assert _functorch_state_after(lambda: engine._backward_prologue_per_tensor(torch.ones(2)))
