"""The native walker: walk + plan in C++ (``walker.cpp``), same plan as Python.

``graphscale/_walk.py`` + ``graphscale/_plan.py`` are the reference semantics;
``walker.cpp`` repeats them on the C++ autograd Nodes with the same orders and
tie-breaks (tests/test_native_walker.py compares the two on random graphs).
It is compiled with ``torch.utils.cpp_extension.load`` on first use (a walked
backward) and cached under ``~/.cache/torch_extensions`` (or
``$TORCH_EXTENSIONS_DIR``); later processes load the cached build.

``GRAPHSCALE_WALKER`` chooses: ``auto`` (default: native, or the Python walker
with one logged warning where compilation fails), ``native`` (compilation
failure is an error), ``python`` (never compile).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

__all__ = ["WALKER_ENV", "WALKER_CHOICES", "walker_choice", "load", "loaded", "owners_for"]

_log = logging.getLogger("graphscale")

WALKER_ENV = "GRAPHSCALE_WALKER"
WALKER_CHOICES = ("auto", "native", "python")

_lock = threading.Lock()
_module: Any = None
_failed: BaseException | None = None
compile_seconds: float | None = None  # wall time of the load() that built or loaded the extension


def walker_choice() -> str:
    """The walker asked for by ``$GRAPHSCALE_WALKER`` (read at every call)."""
    value = os.environ.get(WALKER_ENV, "auto").strip().lower() or "auto"
    if value not in WALKER_CHOICES:
        from .._errors import ConfigurationError

        raise ConfigurationError(
            f"graphscale: {WALKER_ENV}={value!r}; expected one of {WALKER_CHOICES}."
        )
    return value


def load() -> Any:
    """The compiled extension, or None where the Python walker must be used.

    Compiles at most once per process (and once per machine, thanks to the
    cache).  Raises :class:`~graphscale.GraphscaleError` only when
    ``GRAPHSCALE_WALKER=native`` and the extension cannot be built.
    """
    global _module, _failed, compile_seconds
    choice = walker_choice()
    if choice == "python":
        return None
    if _module is None and _failed is None:
        with _lock:
            if _module is None and _failed is None:
                t0 = time.perf_counter()
                try:
                    import torch
                    from torch.utils import cpp_extension

                    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "walker.cpp")
                    # One build per torch version: environments with different
                    # torch builds share ~/.cache/torch_extensions without
                    # rebuilding over each other.
                    tag = "".join(ch if ch.isalnum() else "_" for ch in torch.__version__)
                    _module = cpp_extension.load(
                        name=f"graphscale_native_walker_{tag}",
                        sources=[src],
                        extra_cflags=["-O3"],
                        verbose=False,
                    )
                    compile_seconds = time.perf_counter() - t0
                    _log.info("graphscale: native walker ready (%.1f s to build or load)", compile_seconds)
                except Exception as exc:  # no compiler, no headers, a torch whose internals moved
                    _failed = exc
                    _log.warning(
                        "graphscale: the native walker could not be built (%s: %s); using the slower "
                        "Python walker. Set %s=python to skip the attempt.",
                        type(exc).__name__,
                        str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else "",
                        WALKER_ENV,
                    )
    if _module is None and choice == "native":
        from .._errors import GraphscaleError

        raise GraphscaleError(
            f"graphscale: {WALKER_ENV}=native but the native walker could not be built: {_failed!r}. "
            f"Install a C++ compiler (g++) and ninja, or set {WALKER_ENV}=auto or python."
        ) from _failed
    return _module


def loaded() -> Any:
    """The extension if it is loaded already, else None; never builds or loads."""
    return _module


def owners_for(state: Any, module: Any) -> Any:
    """The native ``Owners`` lookup (TensorImpl* -> group position) of ``state``.

    Built once per installed state and kept on it (NOTE [ Per-snapshot tables ]
    in graphscale/_state.py): install/remove makes a new state, and the
    table goes with it, so it keeps no group, parameter or module alive
    (tests/test_hardening_longrun.py).  Group positions follow ``state.groups``.
    """
    owners = state.cache.get("owners")
    if owners is not None and owners[0] is module:
        return owners[1]
    impls: list[int] = []
    positions: list[int] = []
    owner = state.owner
    for k, g in enumerate(state.groups):
        for p in g.parameters:
            if owner.get(id(p)) is g:
                impls.append(p._cdata)
                positions.append(k)
    table = module.Owners(impls, positions)
    state.cache["owners"] = (module, table)
    return table
