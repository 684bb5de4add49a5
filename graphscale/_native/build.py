"""Build the native walker into graphscale's own cache, and load a cached build.

Self-contained on purpose (the standard library and torch only, no import
from graphscale): the background build (graphscale/_native/__init__.py) runs
this file by its path in a child process, so the child builds exactly the
``walker.cpp`` next to it, whichever graphscale ``sys.path`` would find.
``python -m graphscale build`` runs :func:`main` too.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, Callable, NamedTuple

__all__ = [
    "CACHE_ENV", "SANITIZE_ENV", "MODULE_NAME", "Variant", "RELEASE", "SEAMS", "SOURCE", "BuildError", "Built",
    "cache_root", "cache_key", "sources", "key_dir", "built_path", "import_built", "build", "main",
]

# NOTE [ Native walker cache ]
# Where: $GRAPHSCALE_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/graphscale; one
# directory per key (cache_key): torch version, Python cache tag, machine,
# torch's C++ ABI flag and a hash of the sources (walker.cpp and the headers
# beside it and in planner/: sources()) and the compiler flags.  An edited source, another
# torch or another interpreter gets its own build; nothing is ever rebuilt
# over a build another key uses.  Per key:
#
#     <key>/graphscale_native_walker.so   the build (replaced atomically)
#     <key>/lock                          flock()ed by the process that builds
#     <key>/build-XXXXXXXX/               torch's build directory, one per build
#     <key>/build-failure.log             the last failed build's full output
#
# Building: torch.utils.cpp_extension.load with a fresh build_directory of its
# own, so torch's lock file (which a killed build leaves behind, and on which
# later builds of the same directory wait forever) is never shared; the built
# library is copied next to the key and renamed over the old one with
# os.replace, so a reader sees the old build, the new one or none, never a
# half-written file.  Builders of one key on one machine take turns on an
# flock of <key>/lock: the kernel drops it when its holder dies, so it cannot
# go stale, and a builder that gets it after another one finished finds the
# build and compiles nothing.  Where the file system has no locks, builders
# duplicate the work and the last rename wins (the builds are identical).
#
# Loading: import the cached library directly (ExtensionFileLoader), without
# a compiler, ninja or any lock: about 2 ms.

CACHE_ENV = "GRAPHSCALE_CACHE"
MODULE_NAME = "graphscale_native_walker"  # the extension's PyInit_ name: torch builds it under this name
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "walker.cpp")
CFLAGS = ("-O3",)
# NOTE [ Sanitizer builds ]
# GRAPHSCALE_SANITIZE=address (or thread), read at import: both variants built with that sanitizer (keys
# ending in -asan / -tsan) and loaded.  Only walker.cpp is instrumented: preload the runtime
# (LD_PRELOAD=$(g++ -print-file-name=libasan.so)).  CI: .ci/run; why not TSan: docs/native-walker.md.
SANITIZE_ENV = "GRAPHSCALE_SANITIZE"
_SANITIZERS = {"address": ("asan", ("-fsanitize=address", "-fno-omit-frame-pointer", "-g")),
               "thread": ("tsan", ("-fsanitize=thread", "-g"))}


def _sanitizer() -> tuple[str, tuple[str, ...]]:
    """(key suffix, flags) of $GRAPHSCALE_SANITIZE, or ("", ()) when unset."""
    name = os.environ.get(SANITIZE_ENV, "").strip().lower()
    if name and name not in _SANITIZERS:
        raise ValueError(f"graphscale: {SANITIZE_ENV}={name!r}: expected one of {sorted(_SANITIZERS)} or nothing")
    return _SANITIZERS[name] if name else ("", ())


class Variant(NamedTuple):
    """One build of ``walker.cpp``: its module name, compiler and linker
    flags.  :data:`RELEASE` is what graphscale loads; :data:`SEAMS` the test
    build (hook counters, an injected hook failure, a switch that stops
    binding: ``GRAPHSCALE_TEST_SEAMS``; tests/helpers/seams.py loads it beside the
    release build).  Both carry $GRAPHSCALE_SANITIZE's flags."""

    module_name: str
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...] = ()
    suffix: str = ""  # the sanitizer's, at the end of the cache key


_SAN_SUFFIX, _SAN_FLAGS = _sanitizer()
# -DNDEBUG in the release build, as torch builds itself: pybind11 otherwise checks that the GIL is held
# on every reference count it changes (PyGILState_Check, ~5k instructions of a tiny governed backward,
# benchmarks/cost.py).  The test build and the sanitizer builds keep that check and every assert.
_NDEBUG = () if _SAN_FLAGS else ("-DNDEBUG",)
RELEASE = Variant(MODULE_NAME, (*CFLAGS, *_NDEBUG, *_SAN_FLAGS), _SAN_FLAGS, _SAN_SUFFIX)
SEAMS = Variant(MODULE_NAME + "_seams", (*CFLAGS, *_SAN_FLAGS, "-DGRAPHSCALE_TEST_SEAMS"), _SAN_FLAGS, _SAN_SUFFIX)
FIX = (
    "install a C++ compiler (g++) and ninja (pip install ninja), or point {env} at a writable "
    "directory, then run `python -m graphscale build`; or set GRAPHSCALE_WALKER=python to use the "
    "Python walker without trying"
).format(env=CACHE_ENV)
FAILED = "graphscale: the native walker did not build: "  # main()'s failure line starts so
_STALE_BUILD_S = 24 * 3600  # a build directory this old belongs to a build that died


class BuildError(RuntimeError):
    """The native walker did not build; ``summary`` is one line, ``log`` the full output."""

    def __init__(self, summary: str, log: str | None) -> None:
        super().__init__(summary)
        self.summary = summary
        self.log = log


class Built(NamedTuple):
    path: str  # the cached library
    seconds: float  # compile time, or the time to load the cached build
    cached: bool  # True: it was built already (nothing compiled)


def cache_root() -> str:
    """``$GRAPHSCALE_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/graphscale`` (read at every call)."""
    env = os.environ.get(CACHE_ENV, "").strip()
    if env:
        return os.path.abspath(os.path.expanduser(env))
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(xdg), "graphscale")


def _safe(part: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "._+" else "_" for ch in part)


def cache_key(source: str = SOURCE, variant: Variant = RELEASE) -> str:
    """The build's identity, e.g. ``torch2.13.0+cpu-cpython-311-x86_64-cxx11abi1-3f2a...``.

    Anything that changes the compiled library or what it links against is in
    it: torch's version, the interpreter (cache tag), the machine, torch's C++
    ABI flag, and a hash of the sources' names and bytes and the compiler flags.
    """
    import torch

    digest = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(source))
    for path in sources(source):  # each named relative to walker.cpp's folder: a header that moves changes the key
        with open(path, "rb") as f:
            digest.update(os.path.relpath(path, here).replace(os.sep, "/").encode() + b"\0" + f.read())
    digest.update(repr((variant.cflags, variant.ldflags) if variant.ldflags else variant.cflags).encode())
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", False)))
    parts = (
        f"torch{torch.__version__}",
        sys.implementation.cache_tag or sys.implementation.name,
        platform.machine() or "unknown",
        f"cxx11abi{abi}",
        digest.hexdigest()[:16],
    )
    key = "-".join(_safe(p) for p in parts) + ("" if variant == RELEASE else "-" + variant.module_name)
    return key + ("-" + variant.suffix if variant.suffix else "")


def sources(source: str = SOURCE) -> list[str]:
    """``source`` and the ``*.h`` beside it and in ``planner/``: the one translation unit it includes."""
    folder = glob.escape(os.path.dirname(os.path.abspath(source)))
    return [source] + sorted(glob.glob(os.path.join(folder, "*.h")) + glob.glob(os.path.join(folder, "planner", "*.h")))


def key_dir(source: str = SOURCE, variant: Variant = RELEASE) -> str:
    """The cache directory of this interpreter's, torch's and ``source``'s build."""
    return os.path.join(cache_root(), cache_key(source, variant))


def built_path(directory: str, variant: Variant = RELEASE) -> str:
    """Where the build of ``directory`` (a :func:`key_dir`) lives, whether or not it exists."""
    return os.path.join(directory, variant.module_name + (".pyd" if os.name == "nt" else ".so"))


def import_built(path: str, variant: Variant = RELEASE) -> Any:
    """Import the extension at ``path``: no compiler, no ninja, no lock.

    Not entered in ``sys.modules`` (as torch's own loader does); torch must be
    imported first (it is, by whoever calls this)."""
    import torch  # noqa: F401  - the library links against libtorch's symbols

    loader = importlib.machinery.ExtensionFileLoader(variant.module_name, path)
    spec = importlib.util.spec_from_file_location(variant.module_name, path, loader=loader)
    if spec is None:  # pragma: no cover - spec_from_file_location with a loader always gives one
        raise ImportError(f"graphscale: no import spec for {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@contextmanager
def _exclusive(path: str, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold an ``flock`` on ``path``; released by the kernel if this process
    dies.  ``on_wait`` is called first if another process holds it."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: builders duplicate work
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                pass
        except OSError:  # a file system without locks: duplicate work, same result
            pass
        yield
    finally:
        os.close(fd)  # drops the lock


def _remove_stale_builds(directory: str) -> None:
    now = time.time()
    for entry in os.listdir(directory):
        full = os.path.join(directory, entry)
        try:
            if entry.startswith("build-") and os.path.isdir(full) and now - os.path.getmtime(full) > _STALE_BUILD_S:
                shutil.rmtree(full, ignore_errors=True)
        except OSError:
            pass


def summarize(text: str) -> str:
    """One line out of a build's output: the compiler's first ``error:``, else
    the first line mentioning an error, else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for marker in ("error:", "error"):
        for ln in lines:
            if marker in ln.lower() and not ln.lower().startswith("ninja: build stopped"):
                return ln[:300]
    return lines[-1][:300] if lines else "no output"


def build(force: bool = False, source: str = SOURCE, on_wait: Callable[[], None] | None = None,
          variant: Variant = RELEASE) -> Built:
    """Build ``source`` into the cache (or find it built).

    Runs once per process at most (torch renames a second build of one name
    in one process): the CLI and the background build are fresh processes.
    ``on_wait`` is called if another process is building the same key (this
    one then waits for it and, usually, finds its build).  Raises
    :class:`BuildError` when the compiler fails, ``OSError`` when the cache
    cannot be written.
    """
    directory = key_dir(source, variant)
    target = built_path(directory, variant)
    failure_log = os.path.join(directory, "build-failure.log")
    os.makedirs(directory, exist_ok=True)
    with _exclusive(os.path.join(directory, "lock"), on_wait):
        if not force and os.path.exists(target):
            t0 = time.perf_counter()
            try:
                import_built(target, variant)
                return Built(target, time.perf_counter() - t0, True)
            except ImportError:  # e.g. a torch rebuilt under the same version: build over it
                pass
        _remove_stale_builds(directory)
        tmp = tempfile.mkdtemp(prefix="build-", dir=directory)
        try:
            from torch.utils import cpp_extension

            t0 = time.perf_counter()
            try:
                module = cpp_extension.load(
                    name=variant.module_name,
                    sources=[source],
                    extra_cflags=list(variant.cflags),
                    extra_ldflags=list(variant.ldflags),
                    build_directory=tmp,
                    verbose=False,
                )
            except Exception as exc:  # no compiler, no ninja, no headers, a torch whose internals moved
                log: str | None = failure_log
                try:
                    with open(failure_log, "w") as f:
                        f.write(f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}")
                except OSError:
                    log = None
                raise BuildError(f"{type(exc).__name__}: {summarize(str(exc))}", log) from exc
            seconds = time.perf_counter() - t0
            if module.__name__ != variant.module_name:  # pragma: no cover - see the docstring
                raise BuildError(f"torch built {module.__name__!r}, not {variant.module_name!r}: build in a fresh "
                                 "process", None)
            partial = f"{target}.{os.getpid()}.tmp"
            shutil.copyfile(module.__file__, partial)
            os.replace(partial, target)
            with suppress(FileNotFoundError):
                os.remove(failure_log)  # an earlier failure's, now stale
            return Built(target, seconds, False)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m graphscale build``: build into the cache, print where and how long; 0 or 1.

    With ``--quiet`` (the background build) nothing is printed unless the
    build fails, and then one line on stderr, which the parent process logs.
    """
    parser = argparse.ArgumentParser(
        prog="python -m graphscale build",
        description=("Build the native walker into graphscale's cache (or find it built there); "
                     "print where and how long."),
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if a build is cached")
    parser.add_argument("--quiet", action="store_true", help="print nothing unless the build fails")
    parser.add_argument("--background", action="store_true", help="run at a low CPU priority")
    args = parser.parse_args(argv)
    if args.background and hasattr(os, "nice"):
        try:
            os.nice(10)  # yield the CPU to the training that started this build
        except OSError:
            pass
    try:
        def waiting() -> None:
            if not args.quiet:
                print("graphscale: another process is building the native walker; waiting for it", flush=True)

        built = build(force=args.force, on_wait=waiting)
    except BuildError as exc:
        where = f" (full output: {exc.log})" if exc.log else ""
        print(f"{FAILED}{exc.summary}{where}. Fix: {FIX}.", file=sys.stderr)
        return 1
    except Exception as exc:  # the cache cannot be written, torch cannot be imported, ...
        cause = " ".join(str(exc).split())[:300]  # one line: the parent process reads it back
        print(f"{FAILED}{type(exc).__name__}: {cause}. Fix: {FIX}.", file=sys.stderr)
        return 1
    if not args.quiet:
        if built.cached:
            print(f"graphscale: native walker already built: {built.path} (loaded in {built.seconds:.3f} s)")
        else:
            print(f"graphscale: native walker built in {built.seconds:.1f} s: {built.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
