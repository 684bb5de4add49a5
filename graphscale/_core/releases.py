"""The torch and DeepSpeed releases graphscale was tested with, and the one
warning a newer release gets.
"""
from __future__ import annotations

import re
import threading
import warnings

__all__ = ["NEWEST_TESTED", "newer_than_tested", "warn_if_newer"]

# NOTE [ Newer releases ]
# pyproject.toml bounds torch and DeepSpeed from below only: the oldest
# releases the suite ran on.  An upper cap would lock out a user on a release
# newer than any graphscale was tested with (a resolver conflict, or a
# downgrade of their torch); instead such a release installs, gets ONE
# warning per process naming it, and the install-time self-tests decide:
#   * torch: the self-test runs a tiny graph with a nested backward through
#     each route against the plain oracle.  The Python route runs it at the
#     first install() of a process; if it fails, that install() and every
#     later one raise GraphscaleError naming torch's version and the failing
#     piece (the Python route is the reference everything falls back to).  If
#     only the native route fails, it is switched off with one warning and
#     every backward takes the Python route.
#     (See NOTE [ The native route's self-test ] in _routes/selftest.py.)
#   * DeepSpeed: the drift checks refuse, at install(), an engine whose
#     DeepSpeed changed an internal graphscale relies on, naming the piece.
#     (See NOTE [ DeepSpeed drift ] in _adapters/deepspeed/checks.py.)
# Exact, or refused with the piece named: never a resolver conflict, never
# silently wrong.  NEWEST_TESTED moves when CI runs a newer release.

NEWEST_TESTED = {"torch": "2.15.0", "DeepSpeed": "0.19.8"}  # the newest each CI stage runs (.ci/run)

_lock = threading.Lock()
_warned: set[tuple[str, str]] = set()


def _release(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string: "2.15.0+cu128" ->
    (2, 15, 0), "0.20.0.dev0" -> (0, 20, 0), "2.16.0a0+git1" -> (2, 16, 0)."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(n) for n in match.group(0).split(".")) if match else ()


def newer_than_tested(name: str, version: str) -> bool:
    """Whether ``version`` of ``name`` (a key of NEWEST_TESTED) is a newer
    release than the newest graphscale was tested with."""
    return _release(version) > _release(NEWEST_TESTED[name])


def warn_if_newer(name: str, version: str, decides: str, stacklevel: int = 3) -> bool:
    """Warn once per process and version if ``version`` of ``name`` is newer
    than tested; ``decides`` says what decides
    whether it is governed.  Returns whether it is newer."""
    if not newer_than_tested(name, version):
        return False
    with _lock:
        if (name, version) in _warned:
            return True
        _warned.add((name, version))
    warnings.warn(
        f"graphscale: {name} {version} is newer than the newest release graphscale was tested with "
        f"({NEWEST_TESTED[name]}); {decides} (NOTE [ Newer releases ]). If something looks wrong, report it "
        "with the output of `python -m graphscale env`.", UserWarning, stacklevel=stacklevel)
    return True
