"""The test device itself (tests/helpers/device_threads.py): it gives backwards a
device thread as CUDA does, its arithmetic is the CPU's, and the thread
check the other files rely on fails where a backward runs on the caller's
thread.  If torch stops giving the device its thread, these fail first."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
import torch.utils.checkpoint

from helpers import device_threads as dt


def _linear(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 4)


def test_setup_from_many_threads_at_once_makes_one_device_and_one_device_thread() -> None:
    got: list[tuple[torch.device, int]] = []
    barrier = threading.Barrier(6)

    def call() -> None:
        barrier.wait()
        got.append((dt.setup(), dt.device_thread()))

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(got) == {(torch.device(dt.DEVICE_TYPE, 0), dt.device_thread())}
    assert dt.device_thread() != threading.get_ident()


def test_to_device_moves_a_module_in_place_and_its_parameters_keep_their_identity() -> None:
    m = _linear(0)
    before = [id(p) for p in m.parameters()]
    assert dt.to_device(m) is m
    assert [id(p) for p in m.parameters()] == before
    assert all(p.device.type == dt.DEVICE_TYPE and isinstance(p, torch.nn.Parameter) for p in m.parameters())
    assert isinstance(m.weight, dt.DeviceThreadTensor)


def test_factories_and_copies_reach_the_device_and_come_back() -> None:
    dev = dt.setup()
    made = [torch.ones(2, device=dev), torch.full((2,), 0.5, device=dev), torch.tensor([0.5, 2.0], device=dev),
            torch.zeros(2).to(dev), torch.ones_like(torch.ones(2, device=dev))]
    assert all(isinstance(t, dt.DeviceThreadTensor) and t.device == dev for t in made)
    back = made[2].cpu()
    assert type(back) is torch.Tensor and torch.equal(back, torch.tensor([0.5, 2.0]))


def test_gradients_on_the_device_are_bit_for_bit_the_cpus() -> None:
    cpu, dev = _linear(1), dt.to_device(_linear(1))
    x = torch.randn(3, 4)
    torch.tanh(cpu(x)).square().sum().backward()
    torch.tanh(dev(dt.to_device(x))).square().sum().backward()
    for p, q in zip(cpu.parameters(), dev.parameters()):
        assert torch.equal(dt.on_cpu(q.grad), p.grad)


def test_every_kind_of_hook_runs_on_the_device_thread_not_the_callers() -> None:
    m = dt.to_device(_linear(2))
    threads = dt.ThreadLog()
    h = m(dt.to_device(torch.randn(3, 4)))
    h.register_hook(threads.hook("intermediate tensor hook"))
    m.weight.register_hook(threads.hook("leaf tensor hook"))
    m.bias.register_post_accumulate_grad_hook(lambda p: threads.mark("post-accumulate hook"))
    loss = torch.tanh(h).sum()
    loss.grad_fn.register_hook(threads.node_hook("Node post-hook"))
    loss.grad_fn.register_prehook(lambda grad_outputs: threads.mark("Node pre-hook"))
    loss.backward()
    threads.assert_on_device_thread("intermediate tensor hook", "leaf tensor hook", "post-accumulate hook",
                                    "Node post-hook", "Node pre-hook")


def test_a_reentrant_checkpoint_recomputes_and_runs_its_nested_backward_on_the_device_thread() -> None:
    m = dt.to_device(_linear(3))
    threads = dt.ThreadLog()

    def block(t: torch.Tensor) -> torch.Tensor:
        if torch._C._current_autograd_node() is not None:  # the recompute, inside the checkpoint's node
            threads.mark("recompute")
        out = torch.tanh(m(t))
        if out.requires_grad:
            out.register_hook(threads.hook("nested backward"))
        return out

    x = dt.to_device(torch.randn(3, 4)).requires_grad_()
    torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True).sum().backward()
    threads.assert_on_device_thread("recompute", "nested backward")


def test_the_thread_check_fails_where_a_backward_runs_on_the_callers_thread() -> None:
    m = _linear(4)  # on the CPU: autograd runs the nodes on the caller's thread
    threads = dt.ThreadLog()
    m.weight.register_hook(threads.hook("cpu hook"))
    m(torch.randn(2, 4)).sum().backward()
    with pytest.raises(AssertionError, match="ran on the caller"):
        threads.assert_on_device_thread("cpu hook")
    with pytest.raises(AssertionError, match="never ran"):
        dt.ThreadLog().assert_on_device_thread("a hook")


ABORTS = """
import sys
sys.path.insert(0, {tests!r})
import torch
from helpers import device_threads as dt
out = dt.to_device(torch.nn.Linear(2, 2))(dt.to_device(torch.ones(1, 2)))
out.register_hook(lambda g: 1 / 0)
try:
    out.sum().backward()
except ZeroDivisionError:
    print("raised")
"""


def test_an_exception_raised_in_a_device_node_aborts_the_process_without_graphscale() -> None:
    """A limit of the emulation, pinned so it is noticed when torch lifts it:
    an exception out of a node on the device thread unwinds through torch's
    Python device guard (``torch._C._acc`` PythonDeviceGuard.exchangeStream,
    whose call into Python fails in a noexcept path: seen in gdb) and the process aborts
    (SIGABRT, "terminate called without an active exception"), graphscale or
    not.  CUDA's guard is C++ and raises to the caller.  So the families of a
    backward that raises (tests/deepspeed_engines/test_failed_backward.py) do not run here."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", ABORTS.format(tests=tests)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == -signal.SIGABRT, (
        f"torch {torch.__version__} no longer aborts (exit {done.returncode}, stdout {done.stdout!r}): "
        "move the raising-backward families onto this device and drop this limit from tests/helpers/device_threads.py")
