"""A user's install: the sdist and the wheel carry the native walker's source
and the ``py.typed`` marker, and a wheel installed (not editable) into a
fresh environment with an empty graphscale cache never makes a backward wait
for the compiler: backwards during the build are planned by the Python
walker, later ones by the native walker, every one exact; the next process
loads the cached build at install().

NOTE [ No backward waits for a compiler ] in graphscale/_native/__init__.py.
One real C++ build (~30 s on 2 cores, more on a busy machine)."""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from helpers.paths import REPO

NATIVE_FILES = ("graphscale/_native/__init__.py", "graphscale/_native/build.py", "graphscale/_native/walker.cpp",
                *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "graphscale" / "_native").rglob("*.h")))
TYPED = "graphscale/py.typed"  # PEP 561: a user's type checker reads graphscale's annotations

pytestmark = pytest.mark.skipif(os.name == "nt", reason="the test holds the build's lock with fcntl")

# Runs in the fresh environment.  Two engines' worth of parameters (plain
# modules: the walker, not DeepSpeed, is under test) with GAS 2 and 4 in one
# graph, so every backward is walked.  Which walker planned each backward is
# read from graphscale's DEBUG line "walked N nodes in ... us, ..., <walker> walker".
_COMMON = r"""
import fcntl, json, logging, os, re, sys
import torch
import graphscale
from graphscale import _native
from graphscale._native import _build

messages = []
class Keep(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())
log = logging.getLogger("graphscale")
log.setLevel(logging.DEBUG)
log.addHandler(Keep())

def walkers():
    found = [m.group(1) for msg in messages if (m := re.search(r"walked \d+ nodes .*, (\w+) walker$", msg))]
    messages.clear()
    return found

torch.manual_seed(0)
a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
x = torch.randn(3, 4)
def loss():
    h = a(x)
    return b(h.tanh()).sum() + h.pow(2).sum()  # b's gradient flows through a: a mixed-factor graph
params = [*a.parameters(), *b.parameters()]
plain = torch.autograd.grad(loss(), params)  # the oracle: plain PyTorch, each group's gradient over its GAS
want = [g / 2 for g in plain[:2]] + [g / 4 for g in plain[2:]]

def max_err(grads):
    return max(float(((g - w).abs().max() / w.abs().max())) for g, w in zip(grads, want))

def governed():
    for p in params:
        p.grad = None
    loss().backward()
    return max_err([p.grad for p in params])

def install():
    return graphscale.install(graphscale.Group(a, gas=2, name="a"), graphscale.Group(b, gas=4, name="b"))

out = {"file": graphscale.__file__, "one_factor_err": max_err(torch.autograd.grad(loss() / 2, params))}
"""

# First process, empty cache.  It holds the build's lock (NOTE [ Native walker
# cache ]) so the background build cannot finish before the first backward:
# "during the build" is certain, not a race.
_FIRST = _COMMON + r"""
import signal
def stalled(*_):
    raise SystemExit("graphscale: install() or a backward waited for the build (it holds no compiler lock here)")
signal.signal(signal.SIGALRM, stalled)
signal.alarm(300)  # a hang guard, not a timing check: a waiting install() would otherwise deadlock on our lock
key = _build.key_dir()
os.makedirs(key, exist_ok=True)
lock = os.open(os.path.join(key, "lock"), os.O_RDWR | os.O_CREAT)
fcntl.flock(lock, fcntl.LOCK_EX)
with install():
    out["status_during"] = _native.status()
    out["err_during"] = governed()
    out["walkers_during"] = walkers()
    signal.alarm(0)
    os.close(lock)  # let the build run
    out["waited"] = _native.wait(timeout=900) is not None
    out["status_after"] = _native.status()
    out["err_after"] = governed()
    out["walkers_after"] = walkers()
out["cached"] = os.path.exists(_build.built_path(key))
print(json.dumps(out))
"""

# Second process, same cache: install() loads the cached build itself.
_SECOND = _COMMON + r"""
with install():
    out["status_at_install"] = _native.status()
    out["err"] = governed()
    out["walkers"] = walkers()
print(json.dumps(out))
"""


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    run = subprocess.run(cmd, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    assert run.returncode == 0, f"{cmd} failed:\n{run.stdout}\n{run.stderr}"
    return run


def _source_copy(dest: Path) -> Path:
    """What a release is built from, copied so the build leaves nothing in the
    checkout (setuptools writes build/ and *.egg-info next to pyproject.toml)."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, dest / name)
    shutil.copytree(REPO / "graphscale", dest / "graphscale",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    return dest


def _venv_over_this_environment(venv: Path) -> Path:
    """A new virtual environment whose interpreter also sees the packages of
    the one running this test; its python.

    Not ``venv --system-site-packages``: made from a virtual environment's
    interpreter, that sees the *base* interpreter's packages (where a user's
    venv has installed nothing), not the running environment's.  A ``.pth``
    file listing this environment's site directories appends them after the
    new venv's own, so what is installed into the venv wins, and the ``.pth``
    files in those directories (an editable graphscale's) are not run."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    here = [p for p in dict.fromkeys([*site.getsitepackages(), site.getusersitepackages(), *sys.path])
            if os.path.isdir(p) and os.path.basename(p) in ("site-packages", "dist-packages")]
    Path(purelib, "_outer_environment.pth").write_text("".join(f"{p}\n" for p in here))
    return python


def test_fresh_venv_sees_this_environments_torch_but_not_its_graphscale(tmp_path: Path) -> None:
    """The helper itself, from wherever pytest runs (a venv or a system
    install): torch comes from this environment, graphscale from nowhere
    until the wheel is installed."""
    python = _venv_over_this_environment(tmp_path / "venv")
    probe = ("import importlib.util, json, torch; "
             "print(json.dumps([torch.__file__, importlib.util.find_spec('graphscale') is None]))")
    torch_file, no_graphscale = json.loads(_run([str(python), "-c", probe], cwd=tmp_path,
                                                env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
                                                ).stdout.strip().splitlines()[-1])
    import torch

    assert Path(torch_file).resolve() == Path(torch.__file__).resolve()
    assert no_graphscale


def test_wheel_install_ships_native_walker_and_never_stalls_a_backward(tmp_path: Path) -> None:
    src = _source_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    # The sdist (what an index serves), then the wheel built from it (what pip
    # install does with an sdist), so both are checked.
    sdist = _run([sys.executable, "-c",
                  f"from setuptools import build_meta; print(build_meta.build_sdist({str(dist)!r}))"],
                 cwd=src).stdout.strip().splitlines()[-1]
    with tarfile.open(dist / sdist) as tar:
        in_sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {*NATIVE_FILES, TYPED} <= in_sdist, sorted(in_sdist)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", str(dist), str(dist / sdist)], cwd=tmp_path)
    (wheel,) = dist.glob("graphscale-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = set(zf.namelist())
    assert {*NATIVE_FILES, TYPED} <= in_wheel, sorted(in_wheel)

    # A fresh environment that sees this one's torch (a virtual environment
    # or a system install).  This one may hold an editable graphscale (CI and
    # development do): the venv's own install must win, which the scripts
    # check through graphscale.__file__.
    venv = tmp_path / "venv"
    python = _venv_over_this_environment(venv)
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
          "--ignore-installed", str(wheel)], cwd=tmp_path)

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GRAPHSCALE_WALKER")}
    env.update({"GRAPHSCALE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"})
    outs = []
    for script in (_FIRST, _SECOND):  # run from outside the checkout
        run = _run([str(python), "-c", script], cwd=tmp_path, env=env, timeout=1200)
        outs.append(json.loads(run.stdout.strip().splitlines()[-1]))
    first, second = outs
    site = str(venv / "lib")
    assert first["file"].startswith(site) and second["file"].startswith(site), (first["file"], second["file"])
    # graphscale is needed here: one factor for the whole loss (DeepSpeed alone) is wrong for b.
    assert first["one_factor_err"] > 0.5, first

    assert first["status_during"] == "building", first
    assert first["walkers_during"] == ["python"] and first["err_during"] < 1e-6, first
    assert first["waited"] and first["status_after"] == "ready" and first["cached"], first
    assert first["walkers_after"] == ["native"] and first["err_after"] < 1e-6, first

    assert second["status_at_install"] == "ready", second
    assert second["walkers"] == ["native"] and second["err"] < 1e-6, second

    # The environment report from the installed wheel (its own graphscale, the cache just built).
    report = _run([str(python), "-m", "graphscale", "env", "--wait", "0"], cwd=tmp_path, env=env, timeout=600).stdout
    assert f"({site}" in report.replace(str(venv / "lib"), f"{site}") and "native walker            ready" in report
    assert "\nroute                    native" in report, report
