"""What is installed, and what is running: the snapshot every backward reads.

This module holds graphscale's process-wide state and nothing else:

* :class:`State`: an immutable snapshot of the installed groups, made by
  :meth:`State.of` (the one constructor, used by ``install`` and
  ``explain``), read once by each backward;
* the thread-local context of a backward: ``engine.backward``'s
  ``scale_wrt_gas`` (:func:`gas_scaling`) and the snapshot of the governed
  backward running on this thread (:func:`governing`);
* the registry of walked plans whose backward is running (:func:`running_plan`,
  :func:`find_enclosing`), which nested backwards plan from;
* two observation points for tools: :data:`observer` (``graphscale.audit``)
  and :data:`walk_recorder` (``benchmarks/overhead.py``).

# NOTE [ Per-snapshot tables ]
# A State lives from one install()/remove() to the next, through many
# backwards, so whatever a backward needs that depends only on what is
# installed is made once per State, never per backward: the owner map, the
# set of governed factor keys (the DeepSpeed adapter's O(1) test in its
# per-tensor hook), the native walker's owner table (graphscale/_native
# owners_for; built at install when the extension is loaded already, else at
# the first walked backward) and the checkpoint hints (NOTE [ Checkpoint
# hints ] in _planning.py).  Factors are not among them: a gas callable is
# read at the start of every top-level backward.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from ._errors import ConfigurationError
from ._group import Group

__all__ = [
    "UNOWNED_POLICIES", "check_policy", "strictest", "State", "current", "set_current", "engine_backward",
    "engine_backward_frame", "gas_scaling_enabled", "CARRIES_ATTR", "Binding",
    "bound", "task_binding", "task_state", "governing_binding", "backward_state", "Running", "running_plan",
    "running", "find_enclosing",
    "enclosing_phi",
]

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
# The fast path (one factor in play) first walks until it knows the answer
# (NOTE [ Fast path ] in _backward.py).  The index of a policy in
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


def _fsdp_leaves(groups: Iterable[Group], owner: dict[int, Group]) -> tuple[dict[int, tuple[torch.Tensor, str]],
                                                                          tuple[Any, ...]]:
    """NOTE [ FSDP2's backward leaves ]: the unsharded parameters of the
    groups' FSDP2 modules, added to ``owner`` (id -> (leaf, name)), and the
    FSDPParams whose unsharded parameter is not made yet."""
    extra: dict[int, tuple[torch.Tensor, str]] = {}
    pending: list[Any] = []
    if "torch.distributed.fsdp" not in sys.modules:
        return extra, ()
    from . import _fsdp

    for g in groups:
        module = g.module
        if module is None:
            continue
        for fp in _fsdp.fsdp_params(module):
            sharded = _fsdp.sharded_of(fp)
            if owner.get(id(sharded)) is not g:
                continue
            leaf = _fsdp.unsharded_of(fp)
            if leaf is None:
                pending.append(fp)
                continue
            name = f"{g.param_name(sharded)} (unsharded)"
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


@dataclass(frozen=True)
class State:
    """A snapshot of what is installed, read once per backward.

    Make one with :meth:`State.of`.  ``owner`` maps ``id(leaf)`` to its group
    (the groups keep the leaves alive); ``policy``: what unowned leaves get
    (NOTE [ Unowned leaves ]).
    """

    groups: tuple[Group, ...]
    owner: dict[int, Group]
    policy: str
    # NOTE [ FSDP2's backward leaves ]: leaves owned through a group's FSDP2
    # module (held here), and the FSDPParams whose leaf is not made yet.
    extra: dict[int, tuple[torch.Tensor, str]] = field(default_factory=dict, repr=False, compare=False)
    pending: tuple[Any, ...] = field(default=(), repr=False, compare=False)
    # Derived from the above, once (NOTE [ Per-snapshot tables ]).
    engines: frozenset[int] = field(init=False, repr=False, compare=False)  # id() of governed engines
    cache: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        engines = (getattr(g, "engine", None) for g in self.groups)
        object.__setattr__(self, "engines", frozenset(id(e) for e in engines if e is not None))
        object.__setattr__(self, "cache", {})

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
        extra, pending = _fsdp_leaves(unique, owner)
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
        """This snapshot, or (NOTE [ FSDP2's backward leaves ]) a new one that
        owns FSDP2 leaves made since, published if this one is still current."""
        if not self.pending or all(_fsdp_unsharded(fp) is None for fp in self.pending):
            return self
        fresh = State.of(self.groups, self.policy)
        with _swap_lock:
            if _current is self:
                set_current(fresh)
        return fresh

    @property
    def raw(self) -> bool:
        """Every unowned leaf must get exactly its plain gradient (policy "plain")."""
        return self.policy == "plain"

    @property
    def policy_index(self) -> int:
        """The policy as the native walker takes it."""
        return UNOWNED_POLICIES.index(self.policy)

    def read_factors(self, scaling: bool = True) -> dict[Group, float]:
        """Every group's pin, read now: its factor (1 when ``not scaling``:
        ``engine.backward(scale_wrt_gas=False)``) times its loss scale (fp16
        engines).  A callable may raise: nothing is touched yet."""
        return {g: g.pin(scaling) for g in self.groups}


_current: State | None = None
_swap_lock = threading.Lock()


def _fsdp_unsharded(fsdp_param: Any) -> Any:
    from ._fsdp import unsharded_of

    return unsharded_of(fsdp_param)


def set_current(state: State | None) -> None:
    """Publish the snapshot later backwards read (``install``/``remove`` only)."""
    global _current
    _current = state


def current() -> State | None:
    """The snapshot of what is installed now, or None."""
    return _current


# ---------------------------------------------------------------- thread-local context
class _Local(threading.local):
    def __init__(self) -> None:
        self.engine_calls: list[tuple[bool, float]] = []  # engine.backward frames, innermost last


_local = _Local()


class _Pushed:
    """``value`` on ``stack`` for the duration of a ``with`` block (a class:
    these run on every backward, and a generator context manager costs ~4x)."""

    __slots__ = ("stack", "value")

    def __init__(self, stack: list[Any], value: Any) -> None:
        self.stack, self.value = stack, value

    def __enter__(self) -> None:
        self.stack.append(self.value)

    def __exit__(self, *exc: object) -> None:
        self.stack.pop()


def engine_backward(scaling: bool, carries: float = 1.0) -> AbstractContextManager[None]:
    """Within this block (an adapter's ``engine.backward``), top-level governed
    backwards on this thread apply the factors only if ``scaling``
    (``scale_wrt_gas``), and their seeds already carry ``carries`` (the
    calling engine's fp16 loss scale, applied by DeepSpeed before it calls
    backward)."""
    return _Pushed(_local.engine_calls, (scaling, carries))


def engine_backward_frame() -> tuple[bool, float]:
    """(scaling, carries) of the innermost :func:`engine_backward` on this thread, or (True, 1.0)."""
    stack = _local.engine_calls
    return stack[-1] if stack else (True, 1.0)


def gas_scaling_enabled() -> bool:
    return engine_backward_frame()[0]


# A tensor that carries a factor already (an fp16 engine's ``engine.scale(loss)``)
# has it in this attribute; a backward from it strips it (NOTE [ fp16 engines ]
# in _deepspeed.py).
CARRIES_ATTR = "_graphscale_carries"


# NOTE [ Which snapshot an output hook obeys ]
# DeepSpeed's output hooks fire in the middle of a backward, long after the
# backward read its State snapshot.  If they asked "is the engine installed
# now?", a remove() in between (from a backward hook, or from another thread)
# would make them divide inside a backward whose plan already scales the
# engine's leaves (scaled twice), and a backward begun ungoverned before an
# install would lose DeepSpeed's division.  So a governed backward that
# governs engines binds its autograd graph task to its snapshot (bound()):
# each root is replaced by a view of itself whose tensor hook, the first hook
# of the task's first node, records torch._C._current_graph_task_id() ->
# snapshot; a nested backward binds its own task the same way (every task
# whose graph may hold an engine's output hook: a plan that saw no tensor
# hook anywhere binds nothing).  The graph task id is what every thread
# running the task's nodes reads, the caller's and autograd's device threads
# (CUDA) alike, and it is the only thing the adapter's hook asks
# (backward_state()): no thread-local, which a device thread would not see
# and which would make a torch.autograd.grad nested in a governed backward on
# the same thread look governed.  An unbound task is an ungoverned backward
# (torch.autograd.grad, or one begun before install): DeepSpeed's own
# division applies there, as without graphscale.


# NOTE [ Once per backward ]
# An adapter may have work that must run once per backward for each engine
# the backward reaches, however many of the engine's outputs it meets
# (DeepSpeed's backward prologue: NOTE [ One lifecycle per backward ] in
# _deepspeed.py).  A top-level governed backward and every backward nested in
# it (reentrant checkpointing) are one backward for this: the binding of a
# nested backward's graph task shares the set ``once`` of the binding of the
# task it runs inside, so a key marked anywhere in it reads as marked
# everywhere in it, on any thread.  A binding made for a reference pass
# (graphscale.audit's plain gradient, ``reference=True``) is not the real
# backward: adapters run none of their once-per-backward work inside it, and
# so do the backwards nested in it.


class Binding:
    """What a running backward's graph task is bound to: its snapshot, and
    (NOTE [ Fast path ]) where no plan of it exists, the factors it read and
    the potential everything in it carries, from which a nested backward is
    planned; ``once``/``reference``: NOTE [ Once per backward ].  Made on the
    thread that calls the backward: a nested backward's binding joins the one
    of the task running there."""

    __slots__ = ("state", "factors", "potential", "once", "reference")

    def __init__(self, state: State, factors: Mapping[Group, float] | None = None,
                 potential: float | None = None, reference: bool = False) -> None:
        self.state, self.factors, self.potential = state, factors, potential
        enclosing = task_binding()
        self.once: set[Any] = set() if enclosing is None else enclosing.once
        self.reference: bool = reference or (enclosing is not None and enclosing.reference)


_by_task: dict[int, Binding] = {}  # graph task id -> binding, while that backward runs


def _output_hooked(t: torch.Tensor) -> bool:
    from ._deepspeed import is_output_hooked  # an engine's output hook on this very tensor?

    return is_output_hooked(t)


class bound:
    """Bind the graph task of a backward of ``roots`` to ``state`` while it
    runs (NOTE [ Which snapshot an output hook obeys ]); ``with`` yields the
    roots to hand to torch.  The binding hook must run before any output hook
    that asks for the binding: a node pre-hook on a root's node comes after
    that node's tensor hooks, so a root that is itself an engine's output
    (such as a Hugging Face model's ``loss``) is replaced by a view of itself,
    whose node is new; other roots keep their node and get the pre-hook."""

    __slots__ = ("roots", "binding", "tasks", "handles")

    def __init__(self, roots: Sequence[Any], binding: Binding) -> None:
        self.roots, self.binding = roots, binding
        self.tasks: list[int] = []
        self.handles: list[Any] = []

    def _bind(self, *_: Any) -> None:
        tid = torch._C._current_graph_task_id()
        if tid >= 0 and tid not in _by_task:
            _by_task[tid] = self.binding
            self.tasks.append(tid)

    def __enter__(self) -> tuple[Any, ...]:
        out = []
        grad_was = torch.is_grad_enabled()
        torch._C._set_grad_enabled(True)  # a backward may run under no_grad; a view must join the graph
        try:
            for t in self.roots:
                node = None
                if isinstance(t, GradientEdge):
                    node = t.node
                elif isinstance(t, torch.Tensor):
                    if t._backward_hooks and _output_hooked(t) and t.layout == torch.strided and not t.is_nested:
                        t = t.view_as(t)  # its node dies with the graph: no handle to keep
                        t.grad_fn.register_prehook(self._bind)  # type: ignore[union-attr]
                    else:
                        node = t.grad_fn if t.grad_fn is not None else get_gradient_edge(t).node
                if node is not None:
                    self.handles.append(node.register_prehook(self._bind))
                out.append(t)
        finally:
            torch._C._set_grad_enabled(grad_was)
        return tuple(out)

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        for tid in self.tasks:
            _by_task.pop(tid, None)


def task_binding() -> Binding | None:
    """The binding of the graph task this thread is running a node of."""
    return _by_task.get(torch._C._current_graph_task_id()) if _by_task else None


def task_state() -> State | None:
    """The snapshot bound to the graph task this thread is running a node of."""
    binding = task_binding()
    return None if binding is None else binding.state


def governing_binding(engine: Any) -> Binding | None:
    """The binding of the running graph task if it governs ``engine`` (a
    reference pass governs every engine: NOTE [ Once per backward ]), else
    None: an ungoverned backward, where the engine's own bookkeeping applies."""
    binding = task_binding()
    if binding is None or not (binding.reference or id(engine) in binding.state.engines):
        return None
    return binding


def backward_state() -> State | None:
    """The snapshot governing the backward this code runs inside (an output
    hook): the one bound to the running graph task, or None (ungoverned)."""
    return task_state()


# ---------------------------------------------------------------- running plans
class Running:
    """A walked plan whose backward is running, with what it was planned with
    (compares by identity)."""

    __slots__ = ("plan", "factors", "state")

    def __init__(self, plan: Any, factors: Mapping[Group, float], state: State) -> None:
        self.plan = plan  # PyPlan or the native walker's NativePlan: phi_of(node) -> float | None
        self.factors = factors
        self.state = state


# Walked plans whose backward is running, any thread, innermost last.  Each
# change is one list operation (append, remove) and each reader takes a
# snapshot with tuple(): each is atomic, so no lock is taken on the hot path.
# Keyed by node, not by thread: CUDA backward runs nodes on autograd worker
# threads (NOTE [ Nested backward ] in _backward.py).
_running: list[Running] = []


class running_plan:
    """Register ``entry`` for nested backwards while its backward runs."""

    __slots__ = ("entry",)

    def __init__(self, entry: Running) -> None:
        self.entry = entry

    def __enter__(self) -> None:
        _running.append(self.entry)

    def __exit__(self, *exc: object) -> None:
        try:
            _running.remove(self.entry)  # by identity (Running compares so)
        except ValueError:
            pass


def running() -> tuple[Running, ...]:
    """The running plans, innermost last (a snapshot)."""
    return tuple(_running)


def find_enclosing(node: Any) -> tuple[Running, float] | None:
    """The innermost running plan that walked ``node``, and the potential it gave it."""
    for entry in reversed(tuple(_running)):
        p = entry.plan.phi_of(node)
        if p is not None:
            return entry, p
    return None


def enclosing_phi(node: Any) -> float | None:
    """The potential a running plan gave ``node``, or None where none saw it."""
    found = find_enclosing(node)
    return None if found is None else found[1]
