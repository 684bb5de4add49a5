"""Two (or more) gloo ranks on loopback for a test: spawn a worker script once
per rank and read what each printed.

A worker prints one line ``RESULT <json>`` at the end; :func:`rank_results`
returns those, and fails the test naming the rank that printed none.  This
module imports neither deepspeed (but inside :func:`deepspeed_rank`) nor
graphscale, so a worker may import it too.  A spawned process finds the
``helpers`` package through :func:`child_env` (tests/ on its PYTHONPATH).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from helpers.paths import REPO, TESTS

TIMEOUT_S = 300


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for MASTER_PORT or a tcp:// init_method)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment of a spawned test process: ``base`` (this process's
    when None) with the repository and tests/ first on PYTHONPATH, so the
    child imports this checkout's graphscale and the ``helpers`` package as
    the tests do; plus ``extra``."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def run_ranks(args: Sequence[str], world: int = 2, env: Mapping[str, str] | None = None) -> list[tuple[int, str]]:
    """Run ``python <args>`` once per rank from the repository root, with
    RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set for gloo on
    loopback, one OpenMP thread each and the repository and tests/ on
    PYTHONPATH (:func:`child_env`; plus ``env``); (exit status, stdout and
    stderr) per rank.  Skips the test when a process cannot be spawned;
    fails it when a rank runs past 300 s."""
    base = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
                     OMP_NUM_THREADS="1", **(env or {}))
    procs: list[subprocess.Popen[bytes]] = []
    # Each rank writes to a file, not a pipe: a pipe read one rank after the
    # other fills up for the rank not being read (64 KiB of DeepSpeed's
    # warnings), which then blocks in write() while the other waits for it in
    # a collective.
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(world)]
        try:
            for rank in range(world):
                procs.append(subprocess.Popen([sys.executable, *args],
                                              env=dict(base, RANK=str(rank), LOCAL_RANK=str(rank)),
                                              stdout=logs[rank], stderr=subprocess.STDOUT, cwd=REPO))
        except OSError as exc:
            for p in procs:
                p.kill()
            pytest.skip(f"cannot spawn a second rank: {exc}")
        deadline = time.monotonic() + TIMEOUT_S
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                pytest.fail(f"a rank did not finish within {TIMEOUT_S} s (gloo rendezvous on loopback?)")
        runs = []
        for p, log in zip(procs, logs):
            log.seek(0)
            runs.append((p.returncode, log.read().decode(errors="replace")))
    return runs


def deepspeed_rank() -> tuple[int, int]:
    """Start a spawned rank's DeepSpeed on gloo (the CPU accelerator unless
    DS_ACCELERATOR says otherwise, DeepSpeed's log at ERROR): (rank, world).
    Imports deepspeed here, not at this module's import."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.utils.logger.setLevel("ERROR")
    deepspeed.init_distributed(dist_backend="gloo")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def finish(result: Any) -> None:
    """End a worker: print ``RESULT <json>`` and leave the process without the
    interpreter's teardown.

    A rank's gloo process groups outlive ``destroy_process_group()`` while
    anything still refers to them (DeepSpeed's and DDP's subgroups: two sets of
    gloo threads were still running at exit, seen in gdb), and tearing them
    down at interpreter exit aborted ranks that had already printed an exact
    result ("terminate called without an active exception", SIGABRT): in CI
    under DeepSpeed 0.19.5 and 0.19.8, about one run in ten under load.  The
    result is all a test reads, so the worker exits at once after it.
    """
    print("RESULT " + json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)


def result_of(returncode: int, out: str) -> Any | None:
    """The JSON of a rank's last ``RESULT`` line, or None when it failed or printed none."""
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if returncode != 0 or not lines:
        return None
    return json.loads(lines[-1][len("RESULT "):])


def rank_results(runs: Sequence[tuple[int, str]]) -> list[Any]:
    """Every rank's result (:func:`result_of`); fails the test with the output
    of the first rank that has none."""
    results = []
    for rank, (code, out) in enumerate(runs):
        result = result_of(code, out)
        if result is None:
            pytest.fail(f"rank {rank} exited {code}:\n{out[-3000:]}")
        results.append(result)
    return results
