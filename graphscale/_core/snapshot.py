"""What is installed: the immutable snapshot every backward reads once.

* :class:`State`: the installed groups, who owns which leaf, the unowned
  policy; made by :meth:`State.of`, published by ``install``/``remove``
  (:func:`set_current`; read as :data:`installed` or :func:`current`);
* :class:`Reading`: a snapshot with the factors one backward read from it;
* :class:`Tables`: what a backward needs that depends only on the snapshot.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from . import registry as _registry
from .errors import ConfigurationError
from .group import Group, read_pins

__all__ = ["UNOWNED_POLICIES", "check_policy", "strictest", "State", "Reading", "Tables", "current",
           "set_current", "installed"]

# NOTE [ Unowned leaves ]
# A backward whose graph reaches no owned leaf is left exactly as plain
# PyTorch runs it, whatever the policy: models graphscale does not govern (a
# reference, reward or EMA model, a DDP baseline) live in the same process.
# In a backward that does reach owned leaves, the policy says what the leaves
# no group owns receive:
#   "plain_params" (default): every unowned nn.Parameter exactly its plain
#       gradient (a module left out of every group is almost always a
#       mistake, and must not be rescaled silently); other unowned leaves
#       (inputs that require grad) g times one factor graphscale chooses.
#   "plain": every unowned leaf exactly its plain gradient.
#   "any": every unowned leaf g times one factor graphscale chooses (1 or one
#       in play, never a mixture): the cheapest, opt-in.
# The fast path (one factor in play) first walks until it knows the answer.
# (See NOTE [ Fast path ] in _entry/entry.py.)  The index of a policy in
# UNOWNED_POLICIES is what the native walker takes.
UNOWNED_POLICIES = ("any", "plain_params", "plain")
_RENAMED = {"raw": "plain"}


def _own(owner: dict[int, Group], p: torch.Tensor, g: Group, name: str) -> None:
    prev = owner.get(id(p))
    if prev is None or prev is g:
        owner[id(p)] = g
    elif prev.factor_key != g.factor_key:
        raise ConfigurationError(
            f"graphscale: parameter {name!r} (shape {tuple(p.shape)}) is in group "
            f"{prev.name!r} and in group {g.name!r}, whose factors (gradient-accumulation steps) "
            "may differ, so no single factor is right for it. Put it in one group only, or give "
            "both groups the same gas (or factor)."
        )


def _owner_map(groups: Iterable[Group]) -> dict[int, Group]:
    """id(leaf) -> owning group; a leaf in two groups whose factors may differ is an error."""
    owner: dict[int, Group] = {}
    for g in groups:
        for p in g.parameters:
            _own(owner, p, g, g.param_name(p))
    return owner


def _adapter_leaves(groups: Iterable[Group], owner: dict[int, Group]) -> tuple[
        dict[int, tuple[torch.Tensor, str]], tuple[Callable[[], bool], ...]]:
    """The leaves adapters say the groups' backwards reach in place of their
    parameters, added to ``owner`` (id -> (leaf, name)), and the checks of
    those not made yet.  (See NOTE [ FSDP2's backward leaves ] in _adapters/fsdp.py.)"""
    leaves, pending = _registry.backward_leaves(groups, lambda g, p: owner.get(id(p)) is g)
    extra: dict[int, tuple[torch.Tensor, str]] = {}
    for g, leaf, name in leaves:
        _own(owner, leaf, g, name)
        extra[id(leaf)] = (leaf, name)
    return extra, tuple(pending)


def check_policy(unowned: object, where: str) -> str:
    """``unowned`` if it names a policy, else a ValueError naming the choices."""
    if unowned in _RENAMED:
        raise ValueError(f"graphscale: {where}(unowned={unowned!r}) is now unowned={_RENAMED[unowned]!r} "
                         f"(same meaning); the policies are {UNOWNED_POLICIES}.")
    if unowned not in UNOWNED_POLICIES:
        raise ValueError(f"graphscale: {where}(unowned=...) must be one of {UNOWNED_POLICIES} "
                         f"(NOTE [ Unowned leaves ]), got {unowned!r}.")
    return unowned  # type: ignore[return-value]


def strictest(policies: Iterable[str]) -> str:
    """The policy that satisfies every one of ``policies`` (installations add up)."""
    return UNOWNED_POLICIES[max((UNOWNED_POLICIES.index(p) for p in policies), default=1)]


# NOTE [ Per-snapshot tables ]
# A State lives from one install()/remove() to the next, through many
# backwards, so whatever a backward needs that depends only on what is
# installed is made once per State, never per backward: the owner map, the
# set of objects whose output hooks obey governed backwards (the DeepSpeed
# adapter's O(1) test in its per-tensor hook), the native walker's owner
# table (native_owners in _backward/native_backend.py; built at install when
# the extension is loaded already, else at the first walked backward) and the
# checkpoint hints (see NOTE [ Checkpoint hints ] in _backward/hints.py).
# They are the fields of Tables.  Factors are not among them: a gas callable
# is read at the start of every top-level backward.
class Tables:
    """What a backward needs that depends only on the snapshot, made lazily,
    once per snapshot.

    ``hints``: id(module) -> (weak reference to it, the one group owning its
    parameters or None), for checkpoint hints.  ``native_owners``: (the native
    extension, its ``Owners`` table of this snapshot) once built;
    ``native_governor``: (the native extension, its ``Governor`` of this
    snapshot) once the native route made it (_routes/native.py)."""

    __slots__ = ("hints", "native_owners", "native_governor")

    def __init__(self) -> None:
        self.hints: dict[int, tuple[Any, Group | None]] = {}
        self.native_owners: tuple[Any, Any] | None = None
        self.native_governor: tuple[Any, Any] | None = None


@dataclass(frozen=True)
class State:
    """A snapshot of what is installed, read once per backward.

    Make one with :meth:`State.of`.  ``owner`` maps ``id(leaf)`` to its group
    (the groups keep the leaves alive); ``policy``: what unowned leaves get
    (UNOWNED_POLICIES); ``extra``: leaves owned through an adapter
    (held here), ``pending``: checks of such leaves not made yet.
    """

    groups: tuple[Group, ...]
    owner: dict[int, Group]
    policy: str
    extra: dict[int, tuple[torch.Tensor, str]] = field(default_factory=dict, repr=False, compare=False)
    pending: tuple[Callable[[], bool], ...] = field(default=(), repr=False, compare=False)
    # Derived from the above, once: the per-snapshot tables.
    hook_owners: frozenset[int] = field(init=False, repr=False, compare=False)  # id() of, see _registry.hook_owner
    tables: Tables = field(init=False, repr=False, compare=False)
    # The policy as the native walker takes it (its index in UNOWNED_POLICIES);
    # every unowned leaf must get exactly its plain gradient (policy "plain").
    policy_index: int = field(init=False, repr=False, compare=False)
    unowned_all_plain: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        owners = (_registry.hook_owner(g) for g in self.groups)
        object.__setattr__(self, "hook_owners", frozenset(id(o) for o in owners if o is not None))
        object.__setattr__(self, "tables", Tables())
        object.__setattr__(self, "policy_index", UNOWNED_POLICIES.index(self.policy))
        object.__setattr__(self, "unowned_all_plain", self.policy == "plain")

    @classmethod
    def of(cls, groups: Iterable[Group], unowned: str, where: str = "install") -> State:
        """The snapshot of ``groups`` (duplicates dropped, order kept) under the
        ``unowned`` policy.

        Raises:
            ValueError: ``unowned`` is not a policy name.
            ConfigurationError: a leaf is in two groups whose factors may differ.
        """
        policy = check_policy(unowned, where)
        unique: list[Group] = []
        for g in groups:
            if g not in unique:
                unique.append(g)
        owner = _owner_map(unique)
        extra, pending = _adapter_leaves(unique, owner)
        return cls(groups=tuple(unique), owner=owner, policy=policy, extra=extra, pending=pending)

    def owned_leaves(self) -> Iterator[tuple[torch.Tensor, int]]:
        """Every owned leaf and the position of its group in ``groups``."""
        position = {g: k for k, g in enumerate(self.groups)}
        for k, g in enumerate(self.groups):
            for p in g.parameters:
                if self.owner.get(id(p)) is g:
                    yield p, k
        for leaf, _ in self.extra.values():
            yield leaf, position[self.owner[id(leaf)]]

    def leaf_name(self, leaf: torch.Tensor) -> str:
        """The name of an owned leaf (its group's parameter name), or ``"?"``."""
        extra = self.extra.get(id(leaf))
        if extra is not None and extra[0] is leaf:
            return extra[1]
        g = self.owner.get(id(leaf))
        return g.param_name(leaf) if g is not None else "?"

    def ready(self) -> State:
        """This snapshot, or a new one that owns the adapter leaves made since
        (FSDP2's unsharded parameters), published if this one is still current."""
        if not self.pending or not any(made() for made in self.pending):
            return self
        fresh = State.of(self.groups, self.policy)
        with _swap_lock:
            if installed is self:
                set_current(fresh)
        return fresh

    def read(self, scaling: bool = True) -> Reading:
        """Every group's pin, read now (:meth:`Group.pin`: its factor, 1 when
        ``not scaling``, i.e. ``engine.backward(scale_wrt_gas=False)``, times an
        fp16 engine's loss scale), with this snapshot, or with the one that
        owns adapter leaves made since (:meth:`ready`).  A callable may raise:
        nothing is touched yet."""
        state = self.ready() if self.pending else self
        pins = read_pins(state.groups, scaling)
        # Reading(...) without its Python-level __new__ (a NamedTuple's is; this is what it does).
        return tuple.__new__(Reading, (state, dict(zip(state.groups, pins)), pins))


class Reading(NamedTuple):
    """A snapshot and the factors one backward read from it (one per group):
    what a backward is planned and applied with, and what a backward nested in
    it is planned with too.  ``factor_list``: the same factors in the
    snapshot's group order (what the native module indexes)."""

    state: State
    factors: Mapping[Group, float]
    factor_list: Sequence[float] = ()


installed: State | None = None  # the snapshot of what is installed now (set_current), read by every backward
_swap_lock = threading.Lock()


def set_current(state: State | None) -> None:
    """Publish the snapshot later backwards read (``install``/``remove`` only)."""
    global installed
    installed = state


def current() -> State | None:
    """The snapshot of what is installed now, or None."""
    return installed
