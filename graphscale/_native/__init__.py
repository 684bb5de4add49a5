"""The native walker: walk + plan in C++ (``walker.cpp``), same plan as Python.

``graphscale/_planner/plan.py`` (with ``_planner/walk.py`` and ``_planner/potentials.py``) is the reference;
``walker.cpp`` repeats them on the C++ autograd Nodes with the same orders and
tie-breaks (tests/native/test_walker_build.py compares the two on random graphs).
This module loads graphscale's cached build of it, or builds it in the background.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any

from . import build as _build

__all__ = [
    "WALKER_ENV",
    "WALKER_CHOICES",
    "walker_choice",
    "prepare",
    "load",
    "wait",
    "status",
    "loaded",
    "build_main",
]

# NOTE [ No backward waits for a compiler ]
# The first graphscale.install() calls prepare().  If graphscale's cache holds
# a build for this torch, interpreter and walker.cpp, it is imported there and
# then (milliseconds, no compiler).  (See NOTE [ Native walker cache ] in build.py.)
# Otherwise a build starts in a detached child process (build.py --quiet
# --background: its own session, so it survives this process and completes
# the cache for the next run; low CPU priority) and a watcher thread imports
# the result when the child succeeds and publishes it with one assignment to
# _module.  Until then every walked backward is planned by the Python walker
# (identical plans, slower walk): a backward never waits for a compiler.
# ``python -m graphscale build`` fills the cache ahead of time (a Dockerfile's
# RUN), so even the first run is native.
#
# A failed build leaves the Python walker in charge and logs ONE warning on the
# graphscale logger naming the cause and the fix.
#
# GRAPHSCALE_WALKER (read at every install(), by prepare(); a backward uses
# what the last one read) chooses: auto (the default, above), native
# (prepare(), hence install(), waits for the build and raises GraphscaleError
# if it fails, so no backward waits and none runs on Python), python (never
# build, never load).

_log = logging.getLogger("graphscale")

WALKER_ENV = "GRAPHSCALE_WALKER"
WALKER_CHOICES = ("auto", "native", "python")

_lock = threading.Lock()
_module: Any = None  # the extension once loaded: published by one assignment, read without a lock
_failed: str | None = None  # why the walker could not be built or loaded (one line)
_started = False  # prepare() ran: the cached build was loaded, or a build was started
_done = threading.Event()  # set once _module or _failed is final
ready_seconds: float | None = None  # prepare() to ready: a cached load, or the background build


_last_choice: tuple[str | None, str] = (None, "auto")  # (raw value, choice): the last one read


def walker_choice() -> str:
    """The walker asked for by ``$GRAPHSCALE_WALKER`` (read at every call)."""
    global _last_choice
    raw = os.environ.get(WALKER_ENV)
    if raw == _last_choice[0]:
        return _last_choice[1]
    value = (raw or "auto").strip().lower() or "auto"
    if value not in WALKER_CHOICES:
        from .._core.errors import ConfigurationError

        raise ConfigurationError(
            f"graphscale: {WALKER_ENV}={value!r}; expected one of {WALKER_CHOICES}."
        )
    _last_choice = (raw, value)
    return value


def prepare() -> Any:
    """Make the native walker ready without ever blocking on a compiler (except
    with ``GRAPHSCALE_WALKER=native``).  See NOTE [ No backward waits for a compiler ].

    Idempotent and cheap after the first call.  Returns the extension if it is
    loaded now, else None (a build is running, or failed, or the choice is
    ``python``).  With ``native`` it waits for the build and raises
    :class:`~graphscale.GraphscaleError` if it fails.
    """
    choice = walker_choice()
    if choice == "python":
        return None
    _ensure_started()
    if choice == "native" and _module is None:
        _done.wait()
        if _module is None:
            from .._core.errors import GraphscaleError

            raise GraphscaleError(
                f"graphscale: {WALKER_ENV}=native but the native walker could not be built: {_failed}. "
                f"Fix: {_build.FIX}; or set {WALKER_ENV}=auto to train on the Python walker when it fails."
            )
    return _module


def load() -> Any:
    """The extension, or None where the Python walker must plan (now).

    Never blocks on a build under ``auto``: until the background build is
    published it returns None.  Starts :func:`prepare` if nothing did.  With
    ``native`` it is :func:`prepare` (which waits, and raises on failure).
    """
    module = _module
    if module is not None and _last_choice[1] != "python":  # the choice read at the last install()
        return module
    return prepare()


def wait(timeout: float | None = None) -> Any:
    """Wait until the native walker is ready or has failed (at most ``timeout``
    seconds); the extension, or None.  For tests, benchmarks and scripts; the
    library itself never waits."""
    if walker_choice() == "python":
        return None
    _ensure_started()
    _done.wait(timeout)
    return _module


def status() -> str:
    """``"ready"``, ``"building"``, ``"failed: <why>"``, ``"disabled"``
    (``GRAPHSCALE_WALKER=python``) or ``"not started"``."""
    if walker_choice() == "python":
        return "disabled"
    if _module is not None:
        return "ready"
    if _failed is not None:
        return f"failed: {_failed}"
    return "building" if _started else "not started"


def _ensure_started() -> None:
    global _started
    if _started:
        return
    with _lock:
        if _started:
            return
        _started = True
        t0 = time.perf_counter()
        try:
            path = _build.built_path(_build.key_dir())
            if os.path.exists(path):
                try:
                    _publish(_build.import_built(path), t0, "loaded the cached build")
                    return
                except ImportError as exc:  # unusable: the build below replaces it
                    _log.debug("graphscale: the cached native walker %s does not load (%s); rebuilding", path, exc)
            out = tempfile.TemporaryFile()
            try:
                proc = _start_build(out)
            except BaseException:
                out.close()
                raise
        except Exception as exc:  # no cache directory, no interpreter to run, ...
            _fail(f"{type(exc).__name__}: {exc}")
            return
        watcher = threading.Thread(
            target=_watch, args=(proc, out, path, t0), name="graphscale-native-build", daemon=True
        )
        watcher.start()
        _log.info("graphscale: building the native walker in the background (pid %d); "
                  "the Python walker plans until it is ready", proc.pid)


def _start_build(out: IO[bytes]) -> subprocess.Popen[bytes]:
    """The detached build: ``build.py`` run by its path, so it builds this
    package's ``walker.cpp`` whatever ``sys.path`` says."""
    return subprocess.Popen(
        [sys.executable, _build.__file__, "--quiet", "--background"],
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # not killed with this process (or by its Ctrl-C): it completes the cache
        close_fds=True,
    )


def _watch(proc: subprocess.Popen[bytes], out: IO[bytes], path: str, t0: float) -> None:
    rc = proc.wait()
    try:
        out.seek(0)
        text = out.read().decode(errors="replace")
    finally:
        out.close()
    if rc == 0:
        try:
            _publish(_build.import_built(path), t0, "built it in the background")
            return
        except Exception as exc:
            _fail(f"the built library {path} does not load ({type(exc).__name__}: {exc})")
            return
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    ours = [ln for ln in lines if ln.startswith(_build.FAILED)]
    if ours:  # the one line _build.main prints: "<FAILED><cause>. Fix: ..."
        _fail(ours[-1][len(_build.FAILED):].split(". Fix: ")[0])
    else:  # the child died before it could say why (a traceback, a signal)
        _fail(lines[-1][:300] if lines else f"the build exited with code {rc}")


def _publish(module: Any, t0: float, how: str) -> None:
    global _module, ready_seconds
    ready_seconds = time.perf_counter() - t0
    _module = module  # the one assignment a backward can observe
    _done.set()
    _log.info("graphscale: native walker ready (%s, %.3f s)", how, ready_seconds)


def _fail(cause: str) -> None:
    global _failed
    _failed = cause
    _log.warning(
        "graphscale: the native walker could not be built: %s. Using the slower Python walker "
        "(the same plans). Fix: %s.",
        cause,
        _build.FIX,
    )
    _done.set()


def build_main(argv: list[str]) -> int:
    """``python -m graphscale build``: build (or find) the cached native walker now."""
    return _build.main(argv)


def loaded() -> Any:
    """The extension if it is loaded already, else None; never builds or loads."""
    return _module
