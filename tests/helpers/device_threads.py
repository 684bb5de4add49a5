"""A test device whose backward runs on its own autograd device thread, as
CUDA's does, on a machine without a GPU (issue 51, item 2).

What it emulates: CUDA's per-device autograd thread.  torch's engine runs
every backward node whose inputs live on a non-CPU device on that device's
worker thread, not on the thread that called backward, and a reentrant
checkpoint's nested backward, called from inside such a node, runs on that
same thread.  Here the device is torch's PrivateUse1 backend, set up from
Python (``torch.utils.backend_registration._setup_privateuseone_for_python_backend``)
and renamed :data:`DEVICE_TYPE`; its tensors are :class:`DeviceThreadTensor`,
a wrapper subclass whose ops run on a CPU tensor inside.  Autograd sees a
device tensor, so it gives the backward to the device thread; the arithmetic
is the CPU's, so gradients are bit-for-bit the CPU's.

What it does not emulate: streams and their synchronisation (there is one
implicit stream: every op runs synchronously on the device thread), real
kernels (CUDA's summation orders, TF32, fp16/bf16 kernels), NCCL or any
collective, device memory (allocator, ``empty_cache``, out-of-memory), several
devices, and DeepSpeed's CUDA accelerator.  An exception raised in a
backward node on the device aborts the process (seen in gdb: a stream
guard's destructor, unwinding, calls torch's Python device guard's
exchangeStream, whose call into Python fails in a noexcept path:
std::terminate; CUDA's guard is C++),
so a backward that raises cannot be tested here.  RNG state is not per
device (the backend module has no ``_initialized``, so checkpoint keeps only
the CPU's).  Both checkpoints work here.  Issue 51 reported that a
non-reentrant checkpoint aborts plain torch on such a device; on this one
it does not (tests/device_threads/test_nested.py runs it),
with or without the factories below: presumably that wrapper raised inside
a node, which aborts as said above (not reproduced).

Checked on torch 2.13.0 (CPU build).  The private API it rests on is marked
experimental: :func:`setup` fails with the torch version in the message if
the device stops giving backwards their own thread.

Use::

    dev = setup()                      # once per process; idempotent
    model = to_device(torch.nn.Linear(4, 4))
    threads = ThreadLog()
    out = model(to_device(torch.randn(2, 4)))
    out.register_hook(threads.hook("out"))
    out.sum().backward()
    threads.assert_on_device_thread()  # every recorded hook ran there
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils._pytree import tree_map

__all__ = ["DEVICE_TYPE", "CHECKED_ON", "DeviceThreadTensor", "setup", "to_device", "device_thread", "ThreadLog",
           "on_cpu"]

DEVICE_TYPE = "gsthread"  # PrivateUse1, renamed: torch.device("gsthread", 0)
CHECKED_ON = ("2.13.0",)  # torch releases this device was checked on

_lock = threading.Lock()
_state: dict[str, Any] = {}  # "device", "thread", "lib": what setup() made, once per process


class _BackendModule:
    """``torch.gsthread``: what torch asks of a device module.  One device;
    ``get_amp_supported_dtype`` for the autocast probe of a reentrant
    checkpoint (torch.utils.checkpoint reads the autocast state of the
    inputs' device type); no ``_initialized``: checkpoint keeps no RNG state
    for this device."""

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]


def _is_ours(x: Any) -> bool:
    return isinstance(x, torch.device) and x.type == DEVICE_TYPE


def _cpu_device(x: Any) -> Any:
    return torch.device("cpu") if _is_ours(x) else x


class DeviceThreadTensor(torch.Tensor):
    """A tensor on :data:`DEVICE_TYPE` holding a CPU tensor (``.inner``).
    Every op unwraps, runs on the CPU, and wraps what it returns, unless the
    op was asked for another device (``.cpu()``, ``.to("cpu")``)."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, requires_grad: bool = False) -> DeviceThreadTensor:
        assert type(inner) is torch.Tensor and inner.device.type == "cpu", type(inner)  # test helper invariant
        r = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            layout=inner.layout, device=torch.device(DEVICE_TYPE, 0), requires_grad=requires_grad)
        r.inner = inner
        return r

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"DeviceThreadTensor({self.inner!r})"

    def __reduce_ex__(self, proto: Any) -> Any:
        raise TypeError("DeviceThreadTensor does not pickle; move it to the CPU first (on_cpu)")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        target = kwargs.get("device")
        stays = target is None or _is_ours(target)

        def unwrap(t: Any) -> Any:
            return t.inner if isinstance(t, DeviceThreadTensor) else _cpu_device(t)

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if func._schema.is_mutable and args and isinstance(args[0], DeviceThreadTensor):
            return args[0]  # in place (copy_, fill_, add_): the tensor itself, as a device returns it
        if not stays:
            return out
        return tree_map(lambda t: cls(t) if type(t) is torch.Tensor else t, out)


def _empty(size: Any, *, dtype: Any = None, layout: Any = None, device: Any = None, pin_memory: Any = None,
           memory_format: Any = None) -> torch.Tensor:
    return DeviceThreadTensor(torch.empty(size, dtype=dtype, layout=layout, memory_format=memory_format))


def _empty_strided(size: Any, stride: Any, *, dtype: Any = None, layout: Any = None, device: Any = None,
                   pin_memory: Any = None) -> torch.Tensor:
    return DeviceThreadTensor(torch.empty_strided(size, stride, dtype=dtype, layout=layout))


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    # reached with the Python key excluded (torch.tensor(data, device=...)): copy between the inner tensors
    (dst.inner if isinstance(dst, DeviceThreadTensor) else dst).copy_(
        src.inner if isinstance(src, DeviceThreadTensor) else src)
    return dst


def setup() -> torch.device:
    """Make :data:`DEVICE_TYPE` once in this process (later calls return the
    same device; safe from several threads and in every pytest-xdist worker,
    each its own process) and check that its backward runs on a device
    thread.  Raises RuntimeError if PrivateUse1 is already taken by another
    name, or if torch stopped giving this device a thread of its own."""
    with _lock:
        if "device" in _state:
            return _state["device"]
        taken = torch._C._get_privateuse1_backend_name()
        if taken not in ("privateuseone", DEVICE_TYPE):
            raise RuntimeError(f"tests/helpers/device_threads.py: PrivateUse1 is already {taken!r} in this process")
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        if taken == "privateuseone":
            _setup_privateuseone_for_python_backend(DEVICE_TYPE, backend_module=_BackendModule())
        lib = torch.library.Library("aten", "IMPL")  # factories asked for this device: ones(device=...), .to()
        lib.impl("empty.memory_format", _empty, "PrivateUse1")
        lib.impl("empty_strided", _empty_strided, "PrivateUse1")
        lib.impl("_copy_from", _copy_from, "PrivateUse1")
        device = torch.device(DEVICE_TYPE, 0)
        _state.update(lib=lib, thread=_probe_device_thread(device))
        _state["device"] = device
        return device


def _probe_device_thread(device: torch.device) -> int:
    caller, seen = threading.get_ident(), []
    x = torch.ones(2, device=device, requires_grad=True)
    y = (x * 2).sum()
    y.register_hook(lambda g: seen.append(threading.get_ident()))
    y.backward()
    if not seen or seen[0] == caller or not isinstance(x.grad, DeviceThreadTensor):
        raise RuntimeError(f"tests/helpers/device_threads.py: on torch {torch.__version__} the backward of a "
                           f"{DEVICE_TYPE} tensor ran on the caller's thread (checked on {CHECKED_ON}): "
                           "the device no longer emulates CUDA's device threads")
    return seen[0]


def device_thread() -> int:
    """The ident (``threading.get_ident()``) of this process's device thread."""
    setup()
    return _state["thread"]


T = TypeVar("T", torch.nn.Module, torch.Tensor)


def to_device(obj: T) -> T:
    """A module moved onto the device (in place, as ``Module.to``: its
    parameters keep their identity), or a tensor's copy there (a leaf,
    ``requires_grad`` as the source's)."""
    device = setup()
    if isinstance(obj, torch.nn.Module):
        with _lock:  # swap, as CUDA's .to() keeps them: groups, optimizers and hooks made before still hold
            swap = torch.__future__.get_swap_module_params_on_conversion()
            torch.__future__.set_swap_module_params_on_conversion(True)
            try:
                return obj.to(device)
            finally:
                torch.__future__.set_swap_module_params_on_conversion(swap)
    out = obj.detach().to(device)
    return out.requires_grad_(obj.requires_grad) if obj.is_leaf else out


def on_cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    """A device tensor's values as a plain CPU tensor (None stays None)."""
    if t is None:
        return None
    return t.detach().inner.clone() if isinstance(t, DeviceThreadTensor) else t.detach().clone()


class ThreadLog:
    """Which thread each hook ran on.  ``hook(name)`` makes a tensor hook
    and ``node_hook(name)`` a Node post-hook that record and pass the
    gradient through; ``mark(name)`` records from any callable.  Build it on
    the thread that calls backward (its caller)."""

    def __init__(self) -> None:
        self.caller = threading.get_ident()
        self.seen: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def mark(self, name: str) -> None:
        with self._lock:
            self.seen.append((name, threading.get_ident()))

    def hook(self, name: str) -> Callable[[torch.Tensor], None]:
        return lambda grad: self.mark(name)

    def node_hook(self, name: str) -> Callable[..., None]:
        return lambda grad_inputs, grad_outputs: self.mark(name)

    def off_device(self) -> list[str]:
        """The recorded hooks that ran anywhere but on the device thread."""
        dev = device_thread()
        return [f"{name} ran on {'the caller' if t == self.caller else 'another thread'} ({t}), "
                f"not on the device thread ({dev})" for name, t in self.seen if t != dev]

    def assert_on_device_thread(self, *names: str) -> None:
        """Every recorded hook ran on the device thread, and each of ``names``
        ran at least once (so a test whose hooks never ran fails too)."""
        missing = sorted(set(names) - {n for n, _ in self.seen})
        assert not missing, f"never ran: {missing} (ran: {self.seen})"
        assert self.seen, "no hook ran"
        wrong = self.off_device()
        assert not wrong, wrong


# ------------------------------------------------------------------ for the tests in tests/device_threads/
ROUTES = ("native", "python")  # parametrize every family on both (style notes, 13)


def use_route(route: str, request: Any) -> None:
    """Every governed backward of the test takes ``route``: "python" switches
    the native route off (tests/conftest.py's ``python_route`` fixture);
    "native" skips the test where the native route is off here
    (``GRAPHSCALE_ROUTE=python``, or no native walker)."""
    from helpers.routes import native_route_or_skip

    if route == "python":
        request.getfixturevalue("python_route")
    else:
        native_route_or_skip()


class RouteLog:
    """Which route governed each backward while inside (``observe.routes``)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None]] = []
        self._lock = threading.Lock()

    def __enter__(self) -> RouteLog:
        from graphscale import observe

        self._cm = observe.routes(self._record)
        self._cm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)

    def _record(self, route: str, reason: str | None) -> None:
        with self._lock:
            self.seen.append((route, reason))

    def assert_took(self, route: str, at_least: int = 1) -> None:
        """At least ``at_least`` governed backwards, every one on ``route``."""
        assert len(self.seen) >= at_least, f"{len(self.seen)} governed backward(s), expected >= {at_least}"
        other = [s for s in self.seen if s[0] != route]
        assert not other, f"expected every backward on the {route} route, saw {self.seen}"


def exact_mismatches(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor]) -> list[str]:
    """Every name whose gradient is not bit-for-bit ``want`` (power-of-two
    factors are exact in floating point), with the ratio it got instead."""
    out = []
    for name, w in want.items():
        g = on_cpu(got.get(name))
        if g is None:
            out.append(f"{name}: no gradient")
        elif not torch.equal(g, w):
            k = int(w.abs().argmax())
            out.append(f"{name}: got {float(g.flatten()[k] / w.flatten()[k]):.6g} x the expected gradient "
                       f"(max abs diff {float((g - w).abs().max()):.3g})")
    return out
