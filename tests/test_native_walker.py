"""The native walker (graphscale/_native) makes the same plan as the Python
reference (graphscale/_core/walk.py + graphscale/_core/plan.py), and graphscale keeps
working, exactly, with the Python walker forced or as the fallback (a build
that fails: one warning, the Python walker, exact gradients).

Native checks skip cleanly where the extension cannot be compiled (CI fails
on its own check then).  tests/test_packaging.py covers the wheel, the
background build and the cache."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.autograd.graph import get_gradient_edge

import graphscale
from graphscale import _native
from graphscale._backward import native_backend as _native_backend
from graphscale._backward import pyplan as _pyplan
from graphscale._core import walk as _walk
from graphscale._core.errors import GraphscaleError
from graphscale._core.request import PlanRequest
from graphscale._core.snapshot import Reading, State
from graphscale._native import build as _build

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def native() -> Any:
    mod = _native.wait()  # the background build, if the cache was empty (None under GRAPHSCALE_WALKER=python)
    if mod is None:
        pytest.skip("the native walker cannot be compiled here (or GRAPHSCALE_WALKER=python)")
    return mod


class _Twice(torch.autograd.Function):
    """A custom Function (a PyNode in the graph) with two inputs and two outputs."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a * 2, a + b

    @staticmethod
    def backward(ctx: Any, ga: torch.Tensor, gb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ga * 2 + gb, gb


def random_case(seed: int) -> dict[str, Any]:
    """A random autograd graph over grouped, unowned and non-Parameter leaves."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    n_groups = rng.randint(1, 4)
    groups = []
    pool: list[torch.Tensor] = []
    for k in range(n_groups):
        params = [torch.nn.Parameter(torch.randn(3)) for _ in range(rng.randint(1, 3))]
        groups.append(graphscale.Group(params, gas=rng.choice([1, 2, 3, 4, 8]), name=f"g{k}"))
        pool += params
    pool += [torch.nn.Parameter(torch.randn(3)) for _ in range(rng.randint(0, 2))]  # unowned parameters
    pool += [torch.randn(3, requires_grad=True) for _ in range(rng.randint(0, 2))]  # detached-input-like
    rng.shuffle(pool)
    made: list[torch.Tensor] = []
    for _ in range(rng.randint(1, 40)):
        src = pool + made
        a, b = rng.choice(src), rng.choice(src)
        op = rng.randrange(7)
        if op == 0:
            out = a + b
        elif op == 1:
            out = a * b
        elif op == 2:
            out = torch.tanh(a)
        elif op == 3:
            out = torch.stack([a, b, a]).sum(0)
        elif op == 4:
            out = _Twice.apply(a, b)[rng.randrange(2)]
        elif op == 5:
            out = torch.cat([a, b])[:3]
        else:
            x, y = torch.unbind(torch.stack([a, b]))
            out = x - y * 0.5
        made.append(out)
    n_roots = rng.randint(1, 3)
    roots: list[torch.Tensor] = [rng.choice(made).sum() for _ in range(n_roots)]
    if rng.random() < 0.2:
        roots.append(rng.choice(pool).sum())
    if rng.random() < 0.1:
        roots.append(pool[0])  # a leaf root: its AccumulateGrad is the root node
    raw = rng.random() < 0.3
    nested = rng.random() < 0.3
    inputs = [rng.choice(made)] if raw and rng.random() < 0.5 else []
    state = State.of(groups, "plain" if raw else "any")
    factors = {g: g.factor() for g in groups}
    base = rng.choice([0.25, 0.5]) if nested else 1.0
    carrier = base if nested else None
    outer_phi = None
    if nested:  # some unowned leaves were already given a potential by an enclosing plan
        owned = {id(p) for g in groups for p in g.parameters}
        seen = {
            get_gradient_edge(t).node: rng.choice([0.125, 0.5, 1.0])
            for t in pool
            if id(t) not in owned and rng.random() < 0.5
        }
        for t in made:  # nodes an enclosing plan already hooks
            if rng.random() < 0.1:
                seen[t.grad_fn] = rng.choice([0.125, 0.5, 1.0])
        outer_phi = seen.get
    hints = {t.grad_fn: rng.choice([None, 0.25, 0.5, 1.0]) for t in made
             if isinstance(t.grad_fn, torch.autograd.function.BackwardCFunction)}
    return dict(roots=roots, state=state, factors=factors, base=base, carrier=carrier, inputs=inputs,
                outer_phi=outer_phi, hint=hints.get if rng.random() < 0.7 else None)


def assert_same_plan(native: Any, case: dict[str, Any]) -> None:
    request = PlanRequest(
        Reading(case["state"], case["factors"]), base=case["base"], carrier=case["carrier"],
        inputs=tuple(case["inputs"]), outer_phi=case.get("outer_phi"), hint=case.get("hint"),
    )
    ref, _ = _pyplan.build(case["roots"], request)
    got = _native_backend.of(native).plan(case["roots"], request)
    problems = []
    if got.num_nodes != len(ref.graph):
        problems.append(f"nodes {got.num_nodes} != {len(ref.graph)}")
    if tuple(got.seeds) != ref.seeds:
        problems.append(f"seeds {tuple(got.seeds)} != {ref.seeds}")
    if got.multiplications != ref.multiplications:
        problems.append(f"multiplications {got.multiplications} != {ref.multiplications}")
    want_hooks = [(ref.graph.nodes[i], m) for i, m in ref.edge_mults.items()]
    got_hooks = [(node, tuple(tuple(x) for x in m)) for node, m in got.hooks()]
    if len(got_hooks) != len(want_hooks) or any(
        gn is not wn or gm != wm for (gn, gm), (wn, wm) in zip(got_hooks, want_hooks)
    ):
        problems.append(f"hooks {got_hooks} != {want_hooks}")
    bad_phi = [i for i, node in enumerate(ref.graph.nodes) if got.phi_of(node) != ref.phi[i]]
    if bad_phi:
        problems.append(f"phi differs at {len(bad_phi)} node(s), first {ref.graph.nodes[bad_phi[0]]}")
    assert not problems, "native plan differs from the Python plan:\n  " + "\n  ".join(problems)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1))
def test_native_plan_equals_python_plan_on_random_graphs(native: Any, seed: int) -> None:
    assert_same_plan(native, random_case(seed))


def assert_same_probe(native: Any, roots: list[Any], state: State) -> None:
    """The two probes (NOTE [ Fast path ]): the same verdict always; the same
    "a custom-Function node was seen" where both walk the whole graph (no
    owned leaf; or the fast path under a policy that had to look for
    unowned leaves everywhere).  Where they stop early, what they saw before
    stopping depends on the order (depth-first in Python, breadth-first in
    C++): a node seen must then be one the graph has."""
    want = _pyplan.probe_python(roots, state)
    got = int(native.probe(tuple(roots), _native_backend.native_owners(state, native), state.policy_index,
                           torch.nn.Parameter))
    assert got & 3 == want & 3, f"policy {state.policy}: native verdict {got & 3}, Python {want & 3}"
    verdict = want & 3
    if verdict == _pyplan.PROBE_NO_OWNED or (verdict == _pyplan.PROBE_FAST and state.policy != "any"):
        assert got & _pyplan.PROBE_HIDDEN == want & _pyplan.PROBE_HIDDEN, f"policy {state.policy}: hidden differs"
    elif (got | want) & _pyplan.PROBE_HIDDEN:
        graph = _walk.walk([r for r in map(_walk.root_node, roots) if r is not None])
        assert any(isinstance(n, _walk.CUSTOM_FUNCTION) for n in graph.nodes), "a hidden node the graph lacks"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1))
def test_native_probe_equals_python_probe_on_random_graphs(native: Any, seed: int) -> None:
    """The plan parity test's graphs, under each policy."""
    case = random_case(seed)
    for policy in ("any", "plain_params", "plain"):
        assert_same_probe(native, case["roots"], State.of(case["state"].groups, policy))


def test_native_plan_equals_python_plan_on_a_large_graph(native: Any) -> None:
    """About 10^5 nodes, one chain 10^4 deep: both walks are iterative.

    (Not deeper: once Python wrappers of a chain's nodes have existed, torch
    2.13 frees a chain ~5*10^4 deep recursively and overflows the C stack on
    its own, with graphscale not involved.)"""
    a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    groups = (graphscale.Group([a], gas=2), graphscale.Group([b], gas=4))
    x = a * 1.0
    for i in range(10_000):
        x = x * 1.0 if i % 2 else x + 0.0
    branches = []
    for k in range(90):
        y = (b if k % 3 else a) * 1.0
        for _ in range(1_000):
            y = y + 0.0
        branches.append(y)
    loss = (x + torch.stack(branches).sum()).sum()
    state = State.of(groups, "any")
    case = dict(roots=[loss], state=state, factors={g: g.factor() for g in groups}, base=1.0, carrier=None, inputs=[])
    assert_same_plan(native, case)


def test_phi_of_unknown_node_is_none(native: Any) -> None:
    p = torch.nn.Parameter(torch.ones(2))
    groups = (graphscale.Group([p], gas=2),)
    state = State.of(groups, "any")
    plan = _native_backend.of(native).plan([(p * 2).sum()], PlanRequest(Reading(state, {groups[0]: 0.5})))
    assert plan.phi_of((p * 3).grad_fn) is None
    assert plan.phi_of(None) is None


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
    extension's own functions (no Python frame between caller and C++)."""
    from graphscale._backward import running as _running

    backend = _native_backend.of(native)
    names = _interface()
    assert {"probe", "plan", "binding", "bound", "running_plan", "running", "nested_plan", "name"} <= set(names)
    missing = [(b.name, n) for b in (_running.PYTHON, backend) for n in names if not hasattr(b, n)]
    assert not missing, missing
    for name in ("binding", "reference_binding", "bound", "running_plan", "running", "enclosing_phi", "nested_plan"):
        assert getattr(backend, name) is getattr(native, name), name
    assert _native_backend.of(native) is backend  # one backend per module
    assert (_running.PYTHON.module, backend.module) == (None, native)
