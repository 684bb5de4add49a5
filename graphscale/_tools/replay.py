"""The reference of an audited (or diagnosed) backward: over the backward's
own graph, or from the micro-step's forward called once more.
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .._backward import frames as _frames
from .._core import registry as _registry
from .._core.errors import GraphscaleError
from .._core.snapshot import State
from .leaf_rows import dtype_rtol, plain_reference, reached_leaves

__all__ = ["Replays", "Reference", "reference", "needs_replay"]

# NOTE [ Audit by replay ]
# The plain reference is a second pass over the backward's own graph.
# (See NOTE [ Audit reference ] in _tools/audit.py.)  Where a group's adapter
# says that cannot be (audit_replay in _core/registry.py: a DeepSpeed engine
# at ZeRO 3, which gathers its partitioned parameters for one backward per
# forward), the reference comes from a fresh graph: the function the user
# wrapped with handle.replayable(fn), called once more with the arguments of
# the call that returned the backward's root (matched by identity), from the
# random-number state and module buffers that call found (both put back
# afterwards), as torch.autograd.grad over the real backward's leaves, bound
# as a reference pass (nothing accumulated or stepped).  It runs inside the
# audited backward, before the real one, at the same point on every rank.  A
# replayed root that is not the real one is said with GraphscaleError once the
# real backward has run, and its gradients are not compared.  Cost: one more
# forward and backward per audited backward.
# Full record: docs/development.md, 'Audit by replay'.

F = TypeVar("F", bound=Callable[..., Any])
_KEPT = 32  # calls whose result may still be backpropagated, at most (the oldest go first)


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors in ``out``: a tensor, or tuples, lists and dicts of them
    (a Hugging Face ModelOutput is a dict), in a fixed order; iterative."""
    found, stack = [], [out]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, Mapping):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, (tuple, list)):
            stack.extend(reversed(item))
    return found


def _rng() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


_Saved = list[tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor]]  # (module, name, buffer, its value)


class _BufferLog:
    """While the block runs, each buffer of every module whose forward runs
    in it, as it was before that module's first forward there (a global
    forward pre-hook, removed on exit)."""

    def __enter__(self) -> _BufferLog:
        self.saved: dict[tuple[int, str], tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor]] = {}
        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self._before)
        return self

    def _before(self, module: torch.nn.Module, args: Any) -> None:
        for name, b in module._buffers.items():
            if b is not None and (id(module), name) not in self.saved:
                self.saved[(id(module), name)] = (module, name, b, b.detach().clone())

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()

    def values(self) -> _Saved:
        return list(self.saved.values())


def _write(saved: _Saved) -> None:
    """Put each buffer back in its module and its value into it, through
    ``.data``: its version counter unchanged, as a module's own update of
    its running statistics leaves it (a graph that saved the buffer for
    backward, the real one among them, still runs)."""
    for module, name, b, value in saved:
        module._buffers[name] = b
        b.data.copy_(value)


class _Call:
    """One call of a replayable function: what replays it, and weak
    references to the tensors it returned (the roots a backward may take)."""

    __slots__ = ("fn", "args", "kwargs", "rng", "buffers", "outputs")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 before: tuple[tuple[torch.Tensor, list[torch.Tensor] | None], _Saved | None]) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.rng, self.buffers = before  # as the call found them (buffers: None where none were read)
        self.outputs: list[weakref.ref[torch.Tensor]] = []

    def alive(self) -> bool:
        return any(r() is not None for r in self.outputs)

    def replay(self) -> list[torch.Tensor]:
        """The tensors the function returns when called once more, from the
        randomness and the buffers the first call found, both put back
        afterwards."""
        now, kept = _rng(), [(m, n, b, b.detach().clone()) for m, n, b, _ in self.buffers or ()]
        log = _BufferLog()
        try:
            _set_rng(self.rng)
            _write(self.buffers or [])
            with log, torch.enable_grad():
                out = _tensors(self.fn(*self.args, **self.kwargs))
        finally:
            _set_rng(now)
            _write([*log.values(), *kept])  # (the ones the first call read last: their value after it)
        if len(out) != len(self.outputs):
            raise GraphscaleError(f"graphscale: the replay of {_name(self.fn)} returned {len(out)} tensor(s), its "
                                  f"first call {len(self.outputs)}: a replayable function must compute the same "
                                  "thing when called again with the same arguments.")
        return out


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


class Replays:
    """The calls of one handle's replayable functions that a backward may
    still take; ``where``: the handle's function, for messages."""

    def __init__(self, where: str, needed: Callable[[], bool]) -> None:
        self.where, self.needed = where, needed  # needed(): a backward now would need a replay
        self.calls: list[_Call] = []

    def wrap(self, fn: F) -> F:
        """``fn``, recording each call so that a backward of its result can replay it."""
        if not callable(fn):
            raise TypeError(f"{self.where}: replayable() takes the function that computes the micro-step's loss, "
                            f"got {type(fn).__name__}.")

        @functools.wraps(fn)
        def replayable(*args: Any, **kwargs: Any) -> Any:
            if not self.needed():
                return fn(*args, **kwargs)
            call = _Call(fn, args, kwargs, (_rng(), None))
            with _BufferLog() as log:
                out = fn(*args, **kwargs)
            call.buffers, call.outputs = log.values(), [weakref.ref(t) for t in _tensors(out)]
            self.calls = [c for c in self.calls[-(_KEPT - 1):] if c.alive()]
            self.calls.append(call)
            return out

        return replayable  # type: ignore[return-value]

    def take(self, roots: Sequence[Any]) -> list[tuple[_Call, int]] | None:
        """For each root, the call that returned it and its place among that
        call's tensors; None if one is not found (nothing is taken then)."""
        found = []
        for t in roots:
            hit = next(((c, i) for c in reversed(self.calls) for i, r in enumerate(c.outputs) if r() is t), None)
            if hit is None:
                return None
            found.append(hit)
        taken = {id(c) for c, _ in found}
        self.calls = [c for c in self.calls if id(c) not in taken and c.alive()]
        return found


@dataclass(frozen=True)
class Reference:
    """An audited backward's plain gradient of each leaf (None: not reached);
    ``left_out``: ids of unowned leaves the replay does not reach, not to be
    compared; ``unfaithful``: why the replay's reference says nothing (raise
    it once the real backward ran), or None."""

    grads: tuple[torch.Tensor | None, ...]
    left_out: frozenset[int] = frozenset()
    unfaithful: str | None = None

    def compared(self, leaves: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(leaf, plain gradient) of each of ``leaves`` (the ones this was
        computed for, in order) to compare, the ones left out removed."""
        return [(p, g) for p, g in zip(leaves, self.grads) if id(p) not in self.left_out]


def needs_replay(state: State | None) -> bool:
    """Whether a backward reaching every group of ``state`` would need a replay."""
    return state is not None and any(_registry.audit_replay(g) is not None for g in state.groups)


def _why_replay(state: State, leaves: Sequence[torch.Tensor]) -> str | None:
    """The first reached group's adapter reason the same graph cannot give its reference."""
    reached = {id(g): g for p in leaves if (g := state.owner.get(id(p))) is not None}
    return next((why for g in reached.values() if (why := _registry.audit_replay(g)) is not None), None)


def reference(state: State, roots: Sequence[Any], seeds: Sequence[Any], leaves: Sequence[torch.Tensor],
              replays: Replays) -> Reference:
    """The plain gradient of each of ``leaves`` for a backward of ``roots``
    with ``seeds`` (what the seeds carry already stripped): over the same
    graph, or by replay where a reached group needs it; raises the refusal
    where it needs one and none matches."""
    why = _why_replay(state, leaves)
    if why is None:
        try:
            return Reference(plain_reference(state, roots, seeds, leaves))
        except RuntimeError as exc:
            raise GraphscaleError(
                f"{replays.where}: could not compute the plain reference gradient with torch.autograd.grad "
                f"({exc}). Reentrant activation checkpointing, for one, does not support it: use "
                "use_reentrant=False, or leave the checkpointed model out. No gradient was touched.") from exc
    caller = _frames.adapter_backward_caller()
    matched = replays.take(roots)
    if matched is None and caller is not None and len(roots) == 1:  # engine.backward(loss): the user's loss
        matched, seeds, roots = replays.take([caller[1]]), [None], [caller[1]]
    if matched is None:
        raise GraphscaleError(
            f"{replays.where}: {why} Give it the micro-step's forward to call once more instead: in "
            f"`with {replays.where}(...) as handle:` wrap the function that computes the loss, "
            "`loss_of = handle.replayable(loss_of)`, on every rank, and backpropagate what `loss_of(...)` returns "
            "(`engine.backward(loss)` or `loss.backward()`); the reference is then taken from the replayed forward "
            "(about one more forward and backward). No gradient was touched.")
    return _replayed(state, matched, [(r, s) for r, s in zip(roots, seeds)], leaves)


def _replayed(state: State, matched: list[tuple[_Call, int]], real: list[tuple[Any, Any]],
              leaves: Sequence[torch.Tensor]) -> Reference:
    outs: dict[int, list[torch.Tensor]] = {}
    for c, _ in matched:
        if id(c) not in outs:
            outs[id(c)] = c.replay()
    roots = [outs[id(c)][i] for c, i in matched]
    unfaithful = next((why for (t, _), r in zip(real, roots) if (why := _differs(t, r)) is not None), None)
    reached = {id(p) for p in reached_leaves(roots, None)}
    missing = [p for p in leaves if id(p) not in reached]
    owned = [state.leaf_name(p) for p in missing if id(p) in state.owner]
    if owned and unfaithful is None:
        unfaithful = f"it does not reach {', '.join(map(repr, owned[:3]))}, which the backward reaches"
    grads = plain_reference(state, roots, [s for _, s in real], leaves, retain=False)
    if unfaithful is not None:
        names = ", ".join(_name(c.fn) for c, _ in matched)
        unfaithful = (f"the replay of {names} is not the micro-step's forward: {unfaithful}. It must compute the "
                      "same loss when called again (the same batch, randomness drawn from torch's generators only, "
                      "no model state changed since the forward), so this backward's gradients were not checked.")
    return Reference(grads, frozenset(id(p) for p in missing if id(p) not in state.owner), unfaithful)


def _differs(real: Any, replayed: torch.Tensor) -> str | None:
    """Why ``replayed`` is not the value of ``real``, or None (NaN equals NaN)."""
    if not isinstance(real, torch.Tensor) or real.shape != replayed.shape:
        return f"it returned shape {tuple(replayed.shape)}, the backward's root is {getattr(real, 'shape', real)}"
    a, b = real.detach().float(), replayed.detach().float()
    both_nan = a.isnan() & b.isnan()
    err = float(torch.where(both_nan, 0.0, (a - b).abs()).max()) if a.numel() else 0.0
    scale = float(torch.where(both_nan, 0.0, a.abs()).max()) if a.numel() else 0.0
    if err <= max(1e-5, dtype_rtol(real.dtype)) * scale + 1e-12:
        return None
    return f"it returned {_value(b)}, the backward's root is {_value(a)}"


def _value(t: torch.Tensor) -> str:
    return f"{float(t):.8g}" if t.numel() == 1 else f"a tensor of norm {float(t.norm()):.8g}"
