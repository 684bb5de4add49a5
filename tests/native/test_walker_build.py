"""graphscale keeps working, exactly, with either walker: the native one
published in the middle of a backward, the Python walker forced (never
compiling) or as the fallback (a build that fails: one warning, the Python
walker, exact gradients); an edited walker source gets its own build; the
``build`` command reports and fails as documented; both backends offer the
whole interface.  The plans themselves: test_walker.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import graphscale
from graphscale import _native
from graphscale._backward import native_backend as _native_backend
from graphscale._core.errors import GraphscaleError
from graphscale._native import build as _build

from helpers.paths import REPO


def _nested_exact(monkeypatch: pytest.MonkeyPatch, walker: str) -> None:
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setenv(_native.WALKER_ENV, walker)
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)

    def loss_fn() -> torch.Tensor:
        h = checkpoint(a, x, use_reentrant=True).tanh()
        return checkpoint(b, h, use_reentrant=True).sum() + a(x).sum()

    loss_fn().backward()
    want = [p.grad.clone() / 2 for p in a.parameters()] + [p.grad.clone() / 4 for p in b.parameters()]
    for p in [*a.parameters(), *b.parameters()]:
        p.grad = None
    with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4)):
        loss_fn().backward()
    got = [p.grad for p in [*a.parameters(), *b.parameters()]]
    errs = [(g - w).abs().max().item() for g, w in zip(got, want)]
    assert max(errs) < 1e-6, f"{walker} walker: errors {errs}"


@pytest.mark.parametrize("walker", ["python", "auto"])
def test_governed_backward_exact_with_either_walker(monkeypatch: pytest.MonkeyPatch, walker: str) -> None:
    _nested_exact(monkeypatch, walker)


def test_walker_published_during_a_backward_keeps_it_exact(
    native: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """The background build can land at any moment, e.g. between a backward's
    plan (Python) and the backwards nested in it (reentrant checkpointing):
    the nested ones are then planned natively under a Python outer plan."""
    import logging
    import re

    from torch.utils.checkpoint import checkpoint

    monkeypatch.setattr(_native, "_module", None)  # as while building: load() gives None
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)

    def loss_fn(publish: bool) -> torch.Tensor:
        h = checkpoint(a, x, use_reentrant=True)
        if publish:  # runs in the outer backward, before a's checkpoint replays a's forward
            h.register_hook(lambda g: setattr(_native, "_module", native))
        return checkpoint(b, h.tanh(), use_reentrant=True).sum() + a(x).sum()

    loss_fn(False).backward()
    want = [p.grad.clone() / 2 for p in a.parameters()] + [p.grad.clone() / 4 for p in b.parameters()]
    for p in [*a.parameters(), *b.parameters()]:
        p.grad = None
    with caplog.at_level(logging.DEBUG, logger="graphscale"):
        with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4)):
            loss_fn(True).backward()
    said = (re.search(r"walked \d+ nodes .*, (\w+) walker$", r.getMessage()) for r in caplog.records)
    walkers = [m.group(1) for m in said if m]
    # the outer plan, b's nested plan (before the hook), a's nested plan (after it)
    assert walkers == ["python", "python", "native"], walkers
    got = [p.grad for p in [*a.parameters(), *b.parameters()]]
    errs = [(g - w).abs().max().item() for g, w in zip(got, want)]
    assert max(errs) < 1e-6, errs


def test_forcing_python_never_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_native.WALKER_ENV, "python")
    monkeypatch.setattr(_native, "_module", None)
    monkeypatch.setattr(_native, "_started", False)

    def boom(*a: Any, **k: Any) -> None:
        raise AssertionError("built or loaded the native walker although GRAPHSCALE_WALKER=python")

    monkeypatch.setattr(_native, "_start_build", boom)
    monkeypatch.setattr(_build, "import_built", boom)
    assert _native.load() is None and _native.prepare() is None and _native.wait() is None
    assert _native.status() == "disabled"
    _nested_exact(monkeypatch, "python")
    assert not _native._started


def test_bad_walker_value_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_native.WALKER_ENV, "fortran")
    with pytest.raises(GraphscaleError, match="GRAPHSCALE_WALKER"):
        _native.walker_choice()


def test_an_edited_walker_source_gets_its_own_build(tmp_path: Path) -> None:
    """The cache key hashes every source (walker.cpp and the headers beside
    it and in planner/): an edit of any of them never loads a stale build; a
    copy of all of them elsewhere is the same build."""
    folder = Path(_build.SOURCE).parent
    sources = [Path(p).relative_to(folder) for p in _build.sources()]
    assert len(sources) > 1 and all((folder / p).exists() for p in sources), sources
    for name in ("same", "edited_main", "edited_header", "header_gone"):
        for p in sources:
            (tmp_path / name / p).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / p).write_bytes((folder / p).read_bytes())
    (tmp_path / "edited_main" / "walker.cpp").write_bytes(Path(_build.SOURCE).read_bytes() + b"\n// edited\n")
    header = tmp_path / "edited_header" / next(p for p in sources if p.parent.name == "planner")
    header.write_bytes(header.read_bytes() + b"\n// edited\n")
    (tmp_path / "header_gone" / sources[-1]).unlink()
    key = _build.cache_key()
    assert _build.cache_key(str(tmp_path / "same" / "walker.cpp")) == key
    for name in ("edited_main", "edited_header", "header_gone"):
        assert _build.cache_key(str(tmp_path / name / "walker.cpp")) != key, name
    assert torch.__version__.replace("-", "_") in key


# A failed build, in a process of its own with an empty cache: CXX=/bin/false
# makes torch's compiler check fail, as on a machine without a compiler.
_FAILED_BUILD_SCRIPT = r"""
import json, logging, re
import torch
import graphscale
from graphscale import _native
from graphscale._core.errors import GraphscaleError

records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append((record.levelno, record.getMessage()))
log = logging.getLogger("graphscale")
log.setLevel(logging.DEBUG)
log.addHandler(Keep())

torch.manual_seed(0)
a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
x = torch.randn(2, 3)
def loss():
    h = a(x)
    return b(h.tanh()).sum() + h.sum()  # b's gradient flows through a: a mixed-factor graph
params = [*a.parameters(), *b.parameters()]
plain = torch.autograd.grad(loss(), params)
want = [g / 2 for g in plain[:2]] + [g / 4 for g in plain[2:]]
out = {"file": graphscale.__file__, "errors": []}
try:
    for _ in range(2):  # a second install() after the failure must not warn again
        with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4)):
            for _ in range(2):  # the first maybe while the build still runs, the second after it failed
                loss().backward()
                out["errors"].append(max(float((p.grad - w).abs().max()) for p, w in zip(params, want)))
                for p in params:
                    p.grad = None
                out["waited"] = repr(_native.wait(timeout=600))
except GraphscaleError as exc:
    out["raised"] = str(exc)
out["status"] = _native.status()
out["walkers"] = [m.group(1) for lv, msg in records if (m := re.search(r"walked \d+ nodes .*, (\w+) walker$", msg))]
out["warnings"] = [msg for lv, msg in records if lv >= logging.WARNING]
print(json.dumps(out))
"""


@pytest.mark.parametrize("walker", ["auto", "native"])
def test_failed_build_falls_back_to_python_with_one_warning(tmp_path: Path, walker: str) -> None:
    """auto: every backward exact on the Python walker, one warning naming the
    cause and the fix; native: install() raises instead."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CXX": "/bin/false", _build.CACHE_ENV: str(tmp_path / "cache"),
           _native.WALKER_ENV: walker, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _FAILED_BUILD_SCRIPT], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["file"].startswith(str(REPO)), out["file"]
    assert out["status"].startswith("failed: ") and "/bin/false" in out["status"], out["status"]
    assert len(out["warnings"]) == 1, out["warnings"]
    warning = out["warnings"][0]
    for needed in ("could not be built", "/bin/false", "Python walker", "g++", "GRAPHSCALE_WALKER=python"):
        assert needed in warning, (needed, warning)
    if walker == "auto":
        assert out["waited"] == "None"
        assert len(out["errors"]) == 4 and max(out["errors"]) < 1e-6, out["errors"]
        assert out["walkers"] == ["python"] * 4, out["walkers"]
    else:
        assert "could not be built" in out["raised"] and "/bin/false" in out["raised"], out["raised"]
        assert out["errors"] == [] and out["walkers"] == []


def test_build_command_reports_the_cached_build(native: Any) -> None:
    """``python -m graphscale build`` (a Dockerfile's RUN): exit 0 and the path."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "graphscale", "build"], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr
    assert "already built" in run.stdout and _build.built_path(_build.key_dir()) in run.stdout, run.stdout


def test_build_command_fails_with_exit_code_1_and_the_fix(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CXX": "/bin/false", _build.CACHE_ENV: str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "graphscale", "build"], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 1, (run.stdout, run.stderr)
    # graphscale says one line; torch may add its own (a CUDA build of torch without a GPU says so)
    (line,) = [ln for ln in run.stderr.strip().splitlines() if ln.startswith("graphscale")]
    assert line.startswith(_build.FAILED) and "/bin/false" in line and "Fix: install a C++ compiler" in line, line
    assert not list(tmp_path.glob("*/*.so")) and list(tmp_path.glob("*/build-failure.log"))


def _interface() -> list[str]:
    from graphscale._backward.backend import Backend

    return sorted(n for n in vars(Backend) if not n.startswith("_")) + sorted(Backend.__annotations__)


def test_both_backends_offer_the_whole_interface_and_the_native_one_is_the_extension_itself(native: Any) -> None:
    """NOTE [ One interface, two backends ]: every member of the Backend
    protocol on both backends, and the native running-state methods are the
    extension's own functions (no Python frame between caller and C++), but
    ``binding`` and ``running_plan``, which hand the extension what it must
    not read by name (a reading's factors, a Python plan's ``phi_of``)."""
    from graphscale._backward import running as _running

    backend = _native_backend.of(native)
    names = _interface()
    assert {"probe", "plan", "binding", "bound", "running_plan", "running", "nested_plan", "name"} <= set(names)
    missing = [(b.name, n) for b in (_running.PYTHON, backend) for n in names if not hasattr(b, n)]
    assert not missing, missing
    for name in ("reference_binding", "bound", "running", "enclosing_phi", "nested_plan"):
        assert getattr(backend, name) is getattr(native, name), name
    assert _native_backend.of(native) is backend  # one backend per module
    assert (_running.PYTHON.module, backend.module) == (None, native)
