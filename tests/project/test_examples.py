"""Smoke test of ``examples/``: every script runs in a fresh interpreter,
exits 0 and says that graphscale is exact (each script checks itself against
a plain-PyTorch reference and exits 1 otherwise).

The scripts are what users copy: they must run as ``python examples/x.py``
from a clone, with no help from the test suite (no conftest, no fixtures;
they start their own one-rank process group), so they run here in
subprocesses, from the repository root, with this interpreter and the
environment pytest runs in (``PYTHONPATH``, ``TORCH_EXTENSIONS_DIR``,
``GRAPHSCALE_WALKER`` pass through).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from helpers.paths import REPO

ROOT = REPO
EXAMPLES = ROOT / "examples"
# Each takes 10-25 s on 2 CPU cores with warm caches; the limit leaves room for
# a loaded CI machine (a script stuck on a collective would otherwise hang).
TIMEOUT_S = 240


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# script -> what it imports beyond torch and graphscale
SCRIPTS: dict[str, tuple[str, ...]] = {
    "rlhf_actor_critic.py": ("deepspeed", "transformers"),
    "issue_8224.py": ("deepspeed", "transformers"),
    "token_normalized.py": ("transformers",),
    "accelerate_deepspeed.py": ("deepspeed", "accelerate"),
    "diagnose_actor_critic.py": ("deepspeed", "transformers"),
    "rlhf_zero3_audit.py": ("deepspeed", "transformers"),
}


def _params() -> list[object]:
    out = []
    for script, needs in SCRIPTS.items():
        missing = [m for m in needs if not _have(m)]
        marks = [pytest.mark.skipif(bool(missing), reason=f"{script} needs {', '.join(missing)}")]
        if "deepspeed" in needs:
            marks.append(pytest.mark.deepspeed)
        out.append(pytest.param(script, marks=marks, id=script.removesuffix(".py")))
    return out


def test_every_example_is_listed_here_and_in_the_readme() -> None:
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert scripts == sorted(SCRIPTS)
    readme = (EXAMPLES / "README.md").read_text()
    assert all(f"`{s}`" in readme for s in scripts), "examples/README.md misses a script"


@pytest.mark.parametrize("script", _params())
def test_example_runs_and_graphscale_is_exact(script: str) -> None:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # the script picks its own free port, not this process's group's
    proc = subprocess.run([sys.executable, str(EXAMPLES / script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    output = f"--- stdout\n{proc.stdout}\n--- stderr (last 3000 chars)\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, output
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("graphscale is exact:"), output
