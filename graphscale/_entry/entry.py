"""The governed backward's entry: what runs in place of ``torch.autograd.backward``.

While graphscale is installed, :func:`patch` makes :func:`governed_backward`
that function (``Tensor.backward`` and DeepSpeed's ``engine.backward`` both end
in it).  It reads the call, the caller's frame and the factors once, and hands
them to one route: the native one (``_routes/native.py``) where it takes the
backward, else the Python reference (``_routes/python.py``).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from .._backward import frames as _frames
from .._backward import gate as _gate
from .._backward.call import ORIGINAL_BACKWARD, BackwardCall
from .._core import observation as _observation
from .._core import snapshot as _snapshot
from .._routes import native as _route
from .._routes import python as _python_route
from .._routes import selftest as _selftest

__all__ = ["governed_backward", "patch", "patched", "when_unpatched", "govern"]

# NOTE [ Follow one backward ]
# A top-level backward on the native route (the usual one) enters each module
# once, in this order, before torch's own backward runs; data crosses each
# line (the call, the frame, the reading), nothing calls back up:
#   entry.governed_backward         the patched torch.autograd.backward
#   call.BackwardCall.of            the call, read once
#   frames.Frame                    scale_wrt_gas, the seeds, what completes it if it raises
#   _core/snapshot.State.read       the factors, one per group, through
#   _core/group.read_pins           each group's pin: its gas or factor (and loss scale)
#   route.govern_natively           asks the gate, then makes one native call:
#   gate.reason                     may the native route take it?  Then govern.h
#   torch's engine                  straight where the call is plain, else torch's backward.
# Nested backwards, and the Python route where the native one declines:
# tests/native/test_backward_path.py pins these paths, each module with the
# function named here.  Full record: docs/development.md, 'Follow one backward'.

# NOTE [ Fast path ]
# When every installed group has the same factor f, every owned leaf is right
# with potential f everywhere: multiply the seeds by f, and plan nothing.
# That is exact when the leaves the policy protects (unowned leaves, see
# _core/snapshot.py) are not reached, and it must not happen at all when no
# owned leaf is reached (that backward is left alone).  So a probe walks
# first, only until it knows (decide.probe): under "any" to the first owned
# leaf, a few nodes away in a real model; under "plain_params" the whole graph
# unless an owned leaf and an unowned Parameter turn up (then it plans); under
# "plain" until an owned and an unowned leaf are both seen.  f == 1 touches
# nothing at all, without a probe.
# A custom-Function node may run a nested backward over leaves no walk can
# see (reentrant checkpointing; ZeRO-3 makes every Linear one).  Such a
# backward still takes the fast path (or is left alone, when no owned leaf is
# visible), and binds its graph task to the potential everything in it
# carries (f, or 1): a backward nested in it finds no plan and is planned from
# that potential (decide.plan_nested), so hidden owned leaves get their factor
# and hidden unowned Parameters their plain gradient.  Under "any" nested
# backwards of a fast-path backward need no plan (everything carries f, which
# any leaf may take).

# NOTE [ Nested backward ]
# Reentrant activation checkpointing (torch's and DeepSpeed's) calls
# torch.autograd.backward from inside a node's backward, on a graph recomputed
# there, which the outer walk could not see.  torch._C._current_autograd_node()
# names that node; the outer plan gave it a potential p, so the gradients it
# received carry p.  The inner backward is planned with base p (its seeds are
# assumed to be, or be linear in, the gradients the node received, as
# checkpointing does), owned leaves pinned to their group's factor as read by
# the *outer* backward, and unowned leaves that are not nn.Parameters (the
# detached inputs through which checkpointing returns gradients to the outer
# graph) pinned to p, so the node hands back gradients at p as the outer plan
# expects.  The outer plan is found through a process-wide registry keyed by
# node (the running state, _native/registry.h), not through thread-local
# state: CUDA backward runs nodes on autograd worker threads.  Inside a
# backward that was not planned (the fast path, or left alone), a nested
# backward is planned from the potential its graph task is bound to (see the
# fast path above), or runs untouched where nothing is bound (everything
# carries the one factor under "any"; an ungoverned backward).


# ---------------------------------------------------------------- the patch
# NOTE [ The patch outlives remove() until the backward ends ]
# remove() of the last installation may run inside a backward (a hook,
# another thread).  That backward keeps its snapshot, and the backwards
# nested in it (reentrant checkpointing recomputes and calls
# torch.autograd.backward) must still reach governed_backward to be planned
# from it; so torch.autograd.backward goes back to the original only once no
# top-level governed backward runs: at remove() if none does, else when the
# last one ends.
# What an adapter put in place for governed backwards comes off with the
# patch (when_unpatched: DeepSpeed's hook-manager descriptors), so that a
# process where graphscale was installed and removed runs as one where it
# never was.
# Once the native route governs, torch.autograd.backward is the native
# module's front, a C function that governs reentrant checkpoints' nested
# backwards itself and hands every other call to governed_backward; patched()
# knows both.  (See NOTE [ The native front ] in _native/front.h.)
_patch_lock = threading.Lock()
_front: Any = None  # the native front, once adopted (_adopt_front)
_front_tried = False  # adoption was tried (once, after the first backward the native route governed)
# One item per top-level governed backward running now, any thread (append
# and pop are atomic: no lock on every backward; the patch's lock is taken
# only where the last one ends with nothing installed).
_top_level_running: list[None] = []
_when_unpatched: list[Callable[[], None]] = []


def patch(on: bool) -> None:
    """Make ``torch.autograd.backward`` the governed one (``on``), or the
    original again as soon as no governed backward runs."""
    with _patch_lock:
        if on:
            torch.autograd.backward = _front if _front is not None else governed_backward
        elif not _top_level_running and patched():
            _unpatch()


def patched() -> bool:
    """Whether ``torch.autograd.backward`` is the governed one now (the
    Python entry, or the native front that hands it all but nested calls)."""
    now = torch.autograd.backward
    return now is governed_backward or (now is _front and now is not None)


def _adopt_front() -> None:
    """Make the native front torch.autograd.backward from now on, where the
    native route governs.
    Tried once, after the first backward the native route governed."""
    global _front, _front_tried
    with _patch_lock:
        if _front_tried:
            return
        _front_tried = True
        _front = _gate.adopt_front(governed_backward)
        if _front is not None and torch.autograd.backward is governed_backward:
            torch.autograd.backward = _front


def when_unpatched(fn: Callable[[], None]) -> None:
    """Call ``fn()`` each time ``torch.autograd.backward`` goes back to the
    original (under the patch's lock: ``fn`` must not take it)."""
    with _patch_lock:
        if fn not in _when_unpatched:
            _when_unpatched.append(fn)


def _unpatch() -> None:
    torch.autograd.backward = ORIGINAL_BACKWARD
    for fn in _when_unpatched:
        fn()


def _left_last() -> None:
    """The last top-level governed backward running ended with nothing
    installed: NOTE [ The patch outlives remove() until the backward ends ]."""
    with _patch_lock:
        if not _top_level_running and _snapshot.installed is None and patched():
            _unpatch()


# ---------------------------------------------------------------- the backward
def governed_backward(
    tensors: Any,
    grad_tensors: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    grad_variables: Any = None,
    inputs: Any = None,
) -> None:
    """``torch.autograd.backward`` with every owned leaf scaled by its group's
    factor (torch's own six parameters: the one function here that takes more
    than five).  (See NOTE [ Follow one backward ].)"""
    current_node = torch._C._current_autograd_node()
    call = BackwardCall.of(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)
    if current_node is not None:  # NOTE [ Nested backward ]: obeys the backward it runs inside
        if _route.govern_nested_natively(call, current_node):
            return None
        return _python_route.govern_nested_in_python(call, current_node)
    observers = _observation.ACTIVE.observers
    if observers:
        return observers[-1](_govern_if_installed, call)  # (graphscale.audit: it runs it once)
    state = _snapshot.installed  # (_govern_if_installed, inline: one Python call fewer per backward)
    if state is None or call.roots is None:
        return _ungoverned(call)
    return govern(call, state, None)


def _govern_if_installed(call: BackwardCall) -> None:
    """The top-level backward ``call`` governed by the installed snapshot, or
    run as torch would where none is installed any more."""
    state = _snapshot.installed
    if state is None or call.roots is None:
        return _ungoverned(call)
    return govern(call, state, None)


def _ungoverned(call: BackwardCall) -> None:
    """``call`` run as torch would: nothing is installed any more (removed
    meanwhile), or the call is malformed (torch raises its own error)."""
    return call.run(None)


def govern(call: BackwardCall, state: _snapshot.State, native: Any) -> None:
    """The top-level backward ``call`` governed by ``state``: through the
    native route (the loaded native module, or ``native``: the self-test's)
    where it takes it, else through the Python route."""
    laps = _observation.laps() if _observation.ACTIVE.phases else None
    _top_level_running.append(None)  # one more top-level backward runs
    try:
        frame = _frames.Frame(laps)  # NOTE [ A backward that raised ] in frames.py
        raised: BaseException | None = None
        try:
            reading = state.read(frame.scaling)  # may raise: nothing touched yet
            if _route.govern_natively(call, reading, frame, native):
                if not _front_tried and native is None:
                    _adopt_front()
                return None  # NOTE [ One native call per backward ] in _native/registry.h
            return _python_route.govern_in_python(call, reading, frame)
        except BaseException as exc:
            raised = exc
            raise
        finally:
            if raised is None:
                frame.stack.pop()  # (close() without its call: the usual end)
                if frame.at_end is not None:  # epilogues graphscale runs itself (frames.py)
                    frame.finish()
            else:
                frame.close(raised)
                raised = None  # (no cycle through this frame)
    finally:
        _top_level_running.pop()
        if not _top_level_running and _snapshot.installed is None:
            _left_last()


# The self-test runs whole governed backwards through govern.
# (See NOTE [ The native route's self-test ] in _routes/selftest.py.)
_gate.register_self_test(lambda native: _selftest.failure(native, govern),
                         lambda: torch.autograd.backward is not ORIGINAL_BACKWARD)
