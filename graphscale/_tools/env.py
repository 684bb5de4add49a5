"""``python -m graphscale env``: what graphscale sees, in a block made to
paste into a bug report (as ``ds_report`` and ``accelerate env`` are).
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys

import torch

from .. import _native
from .._backward import gate as _gate
from .._core import registry as _registry
from .._core import releases as _releases
from .._core.errors import GraphscaleError
from .._native import build as _build

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # graphscale/ (this file is in _tools/)

__all__ = ["rows", "report"]

Row = tuple[str, str, bool]  # (what, value, usable)
_LIBRARIES = ("transformers", "accelerate", "peft")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _compiler() -> Row:
    cxx = os.environ.get("CXX") or "c++"
    path = shutil.which(cxx)
    if path is None:
        return ("C++ compiler", f"{cxx}: not found (the native walker cannot build; the Python walker plans)", True)
    try:
        first = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()
    except (OSError, subprocess.SubprocessError) as exc:
        first = [f"{type(exc).__name__}: {exc}"]
    return ("C++ compiler", f"{path}: {first[0] if first else '?'}", True)


def _native_rows(wait: float) -> list[Row]:
    from .._core.group import Group
    from .._entry.install import install

    _native.prepare()
    module = _native.wait(wait)
    key = _build.key_dir()
    log = os.path.join(key, "build-failure.log")
    rows = [("native walker", _native.status(), True), ("native walker cache", key, True),
            ("native walker build log", log if os.path.exists(log) else "none (no failed build)", True)]
    try:
        with install(Group(torch.nn.Linear(1, 1), gas=2, name="env")):  # runs the self-tests, once per process
            ok = module is not None and _gate.route_enabled() and _gate.trusted(module)
    except GraphscaleError as exc:  # the Python route's self-test failed: nothing can be governed
        return [*rows, ("Python route self-test", f"FAILED: {exc}", False)]
    rows.append(("Python route self-test", "passed (plain PyTorch x factor, bit for bit)", True))
    if module is None:
        return [*rows, ("route", "python (the native walker is not loaded)", True)]
    if not _gate.route_enabled():
        return [*rows, ("route", f"python ({_gate.ROUTE_ENV}=python)", True)]
    test = "passed (both routes and plain PyTorch agree bit for bit)" if ok else "FAILED: see the warning above"
    return [*rows, ("native route self-test", test, True), ("route", "native" if ok else "python (self-test)", True)]


def _newer(name: str, version: str) -> str:
    if not _releases.newer_than_tested(name, version):
        return ""
    return f" (newer than the newest tested, {_releases.NEWEST_TESTED[name]}: the self-tests decide)"


def rows(wait: float = 0.0) -> list[Row]:
    """Every row of the report; ``wait``: seconds to wait for a native walker
    build under way.

    One row per fact: Python, the platform, torch and its CUDA, the frameworks
    graphscale adapts (each adapter's own rows: DeepSpeed's version and its
    drift checks), the other libraries users train with, the C++ compiler and
    ninja the native walker builds with, the native walker's state and its
    build log, the route a backward takes and the native route's self-test."""
    cuda = torch.version.cuda or "none (CPU build)"
    out: list[Row] = [
        ("graphscale", f"{_version('graphscale')} ({_PACKAGE_DIR})", True),
        ("Python", f"{platform.python_version()} ({sys.executable})", True),
        ("platform", platform.platform(), True),
        ("torch", f"{torch.__version__}, CUDA {cuda}, GPU {'available' if torch.cuda.is_available() else 'none'}"
         f"{_newer('torch', torch.__version__)}", True),
    ]
    out += _registry.environment()
    out += [(name, _version(name), True) for name in _LIBRARIES]
    out += [_compiler(), ("ninja", shutil.which("ninja") or "not found (pip install ninja)", True)]
    out += _native_rows(wait)
    return out


def report(wait: float = 0.0) -> tuple[str, bool]:
    """The report's text and whether everything a backward needs is usable.

    A row is not usable where a backward needs it and it is missing or
    refused (a DeepSpeed whose drift checks fail: no engine can be
    installed); a native walker that did not build is reported but usable
    (the Python walker plans, exactly)."""
    found = rows(wait)
    width = max(len(what) for what, _, _ in found)
    lines = ["graphscale environment (paste this block into a bug report)", "-" * 60]
    lines += [f"{what:<{width}}  {value}{'' if ok else '   <-- not usable'}" for what, value, ok in found]
    return "\n".join(lines), all(ok for _, _, ok in found)
