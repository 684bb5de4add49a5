"""A torch or DeepSpeed newer than the newest graphscale was tested with
installs (pyproject bounds them from below only), gets one warning naming
it, and the install-time self-tests decide: governed exactly, or refused with
the piece named (NOTE [ Newer releases ] in graphscale/_core/releases.py).

torch 2.15 cannot be installed on CI's machines, so each newer release here
is a faked version string on the real, installed torch or DeepSpeed; a
torch that broke what the Python route relies on is simulated by a node
post-hook whose returned gradients are dropped (what torch would do if it
stopped honouring a post-hook's return value).
"""
from __future__ import annotations

import re
import tomllib
import warnings
from typing import Any, Callable

import pytest
import torch

import graphscale
from graphscale._adapters.deepspeed import checks as _deepspeed_checks
from graphscale._core import releases as _releases
from graphscale._entry import entry as _backward
from graphscale._routes import python as _python_route
from graphscale._routes import selftest as _selftest
from graphscale._tools import env as _env

from helpers.engines import require_deepspeed
from helpers.paths import REPO

NEWER_TORCH = "2.99.0+cpu"
NEWER_DEEPSPEED = "0.99.0"


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that has warned about nothing and run no Python-route self-test yet."""
    monkeypatch.setattr(_releases, "_warned", set())
    monkeypatch.setattr(_selftest, "_python_verdict", [])


def _newer_warnings(caught: list[warnings.WarningMessage], name: str, version: str) -> list[str]:
    return [str(w.message) for w in caught if f"{name} {version} is newer than the newest release" in str(w.message)]


def _exact_two_groups() -> None:
    """Two groups (GAS 2 and 4) in one loss, checked against plain PyTorch."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    x = torch.randn(5, 3)
    b(torch.tanh(a(x))).sum().backward()
    plain = [p.grad.clone() for p in (*a.parameters(), *b.parameters())]  # type: ignore[union-attr]
    for p in (*a.parameters(), *b.parameters()):
        p.grad = None
    with graphscale.install(graphscale.Group(a, gas=2), graphscale.Group(b, gas=4)):
        b(torch.tanh(a(x))).sum().backward()
    got = [p.grad for p in (*a.parameters(), *b.parameters())]
    for g, want, f in zip(got, plain, (2, 2, 4, 4)):
        assert torch.equal(g, want / f)  # type: ignore[arg-type]


@pytest.mark.parametrize("version,newer", [("2.15.0", False), ("2.15.0+cu132", False), ("2.14.1", False),
                                           ("2.6.0", False), ("2.15.1", True), ("2.16.0", True),
                                           ("2.16.0a0+git1234", True), ("3.0", True)])
def test_newer_than_tested_compares_release_numbers(version: str, newer: bool) -> None:
    assert _releases.newer_than_tested("torch", version) is newer


def test_a_newer_torch_warns_once_naming_its_version_and_stays_exact(fresh: None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", NEWER_TORCH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _exact_two_groups()
        _exact_two_groups()  # a second install: no second warning
    found = _newer_warnings(caught, "torch", NEWER_TORCH)
    assert len(found) == 1, [str(w.message) for w in caught]
    assert _releases.NEWEST_TESTED["torch"] in found[0] and "self-test" in found[0]
    assert _selftest._python_verdict == [None]  # the Python route's self-test ran, and passed


def test_a_tested_torch_gets_no_warning(fresh: None) -> None:
    assert not _releases.newer_than_tested("torch", torch.__version__), "CI runs a torch NEWEST_TESTED does not name"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _exact_two_groups()
    assert not [w for w in caught if "is newer than the newest release" in str(w.message)]


def _drop_post_hook_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch that ignores what a node post-hook returns (the piece the Python route's edge multipliers use)."""
    def post_hook(mults: Any, laps: Any, *task: Any) -> Callable[..., None]:
        return lambda grad_inputs, grad_outputs: None

    monkeypatch.setattr(_python_route, "post_hook", post_hook)


def _refusal(module: torch.nn.Module) -> str:
    with pytest.raises(graphscale.GraphscaleError) as err:
        graphscale.install(graphscale.Group(module, gas=2))
    return str(err.value)


def test_a_newer_torch_that_breaks_the_python_route_is_refused_at_install(fresh: None,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", NEWER_TORCH)
    _drop_post_hook_results(monkeypatch)
    a = torch.nn.Linear(2, 2)
    with pytest.warns(UserWarning, match="is newer than the newest release"):
        first = _refusal(a)
    second = _refusal(a)  # the verdict holds for the process: every install() is refused
    assert first == second
    for needle in (f"torch {NEWER_TORCH}", "Python route failed its self-test", "a planned backward, python route",
                   "want plain x factor", "torch==", "Nothing was installed"):
        assert needle in first, first
    assert torch.autograd.backward is _backward.ORIGINAL_BACKWARD
    report, usable = _env.report()
    assert not usable and re.search(r"Python route self-test +FAILED: graphscale: torch 2\.99", report), report


def test_the_environment_report_names_a_newer_torch(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", NEWER_TORCH)
    report, usable = _env.report()
    assert usable, report
    newest = re.escape(_releases.NEWEST_TESTED["torch"])
    assert re.search(rf"torch +2\.99\.0\+cpu.*newer than the newest tested, {newest}", report), report
    assert re.search(r"Python route self-test +passed", report), report


def test_pyproject_bounds_torch_and_deepspeed_from_below_only() -> None:
    """No upper cap that would lock a user on a newer release out (or downgrade their torch)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    specs = [*project["dependencies"], *(s for extra in project["optional-dependencies"].values() for s in extra)]
    capped = [s for s in specs if "<" in s]
    assert not capped, f"upper caps: {capped}"
    torch_spec = [s for s in project["dependencies"] if s.startswith("torch")]
    assert torch_spec == ["torch>=2.6"], torch_spec
    ds = {s for s in specs if s.startswith("deepspeed")}
    assert ds == {f"deepspeed>={_deepspeed_checks.OLDEST_TESTED}"}, ds


@require_deepspeed
@pytest.mark.deepspeed
def test_a_newer_deepspeed_warns_once_and_its_engines_stay_exact(
        fresh: None, make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import deepspeed

    monkeypatch.setattr(_deepspeed_checks, "_passed", set())
    monkeypatch.setattr(deepspeed, "__version__", NEWER_DEEPSPEED)
    torch.manual_seed(0)
    actor, critic = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    ref_a, ref_c = (torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    ref_a.load_state_dict(actor.state_dict())
    ref_c.load_state_dict(critic.state_dict())
    engine = make_engine(actor, gas=2, stage=1)
    x = torch.randn(4, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with graphscale.install(engine, graphscale.Group(critic, gas=4)):
            critic(torch.tanh(engine(x))).sum().backward()
        with graphscale.install(engine):
            pass
    found = _newer_warnings(caught, "DeepSpeed", NEWER_DEEPSPEED)
    assert len(found) == 1 and "drift checks" in found[0], [str(w.message) for w in caught]
    ref_c(torch.tanh(ref_a(x))).sum().backward()
    from deepspeed.utils import safe_get_full_grad

    for p, r in zip(engine.module.parameters(), ref_a.parameters()):
        torch.testing.assert_close(safe_get_full_grad(p), r.grad / 2)  # type: ignore[operator]
    for p, r in zip(critic.parameters(), ref_c.parameters()):
        torch.testing.assert_close(p.grad, r.grad / 4)  # type: ignore[operator]


@require_deepspeed
@pytest.mark.deepspeed
def test_a_newer_deepspeed_that_changed_an_internal_is_refused_naming_it(
        fresh: None, make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import deepspeed

    monkeypatch.setattr(_deepspeed_checks, "_passed", set())
    engine = make_engine(torch.nn.Linear(3, 3), gas=2, stage=1)
    monkeypatch.setattr(deepspeed, "__version__", NEWER_DEEPSPEED)
    monkeypatch.delattr(type(engine), "_backward_prologue_per_tensor")
    with pytest.warns(UserWarning, match=f"DeepSpeed {NEWER_DEEPSPEED} is newer"):
        with pytest.raises(graphscale.GraphscaleError) as err:
            graphscale.install(engine)
    msg = str(err.value)
    for needle in (f"DeepSpeed {NEWER_DEEPSPEED}", "_backward_prologue_per_tensor is missing", "deepspeed==0.19.8",
                   "No engine was installed"):
        assert needle in msg, msg
    assert torch.autograd.backward is _backward.ORIGINAL_BACKWARD
