"""Groups: sets of leaves that share one factor.

A group owns parameters (autograd leaves) and knows its factor: ``1 / gas``
(gradient accumulation), or a factor given directly.  The factor is read
once at the start of every governed backward, so a ``gas`` or ``factor``
callable may change between steps.
"""
from __future__ import annotations

import itertools
import math
import threading
import weakref
from collections.abc import Callable, Iterable
from numbers import Real
from typing import Any, Union

import torch

from . import registry as _registry
from .errors import GraphscaleError

__all__ = ["Group", "spec_reads", "read_pins"]

GasSpec = Union[int, Callable[[], int]]
FactorSpec = Union[float, Callable[[], float]]


class _Unset:
    def __repr__(self) -> str:
        return "<not given>"


UNSET: Any = _Unset()  # "not given" (gas= and factor= both default to it)
_counter = itertools.count()


def _refuse(where: str, want: str, value: object, name: str | None, typed: bool = True) -> ValueError:
    got = f"{value!r} of type {type(value).__name__}" if typed else repr(value)
    return ValueError(f"graphscale: {where} must be {want}, got {got}.{_named(name)}")


def _check_gas_value(value: object, where: str, name: str | None = None) -> int:
    """Return ``value`` if it is a positive int, else raise ValueError naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refuse(where, "a positive int (the gradient-accumulation steps)", value, name)
    if value < 1:
        raise _refuse(where, "a positive int", value, name, typed=False)
    return value


def _check_factor_value(value: object, where: str, name: str | None = None) -> float:
    """Return ``value`` as a float if it is a positive finite real number (or a
    one-element tensor holding one, e.g. Hugging Face's ``num_items_in_batch``;
    read with ``.item()``, a device sync on a GPU), else raise ValueError
    naming ``where``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, Real):
        raise _refuse(where, "a positive finite number (what the group's gradients are multiplied by)", value, name)
    f = float(value)
    if not (math.isfinite(f) and f > 0.0):
        raise _refuse(where, "a positive finite number", value, name, typed=False)
    return f


def _named(name: str | None) -> str:
    return f" (group {name!r})" if name is not None else ""


# The values graphscale.audit read for this backward (spec_reads).
_frame = threading.local()


class spec_reads:
    """Within the block, :meth:`Group.read_spec` of the groups in ``reads``
    returns the value read there (graphscale.audit reads each group's
    configuration once, for its own expectation and for the backward)."""

    __slots__ = ("reads", "saved")

    def __init__(self, reads: dict[Group, tuple[str, float]]) -> None:
        self.reads, self.saved = reads, None

    def __enter__(self) -> None:
        self.saved = getattr(_frame, "reads", None)
        _frame.reads = self.reads

    def __exit__(self, *exc: object) -> None:
        _frame.reads = self.saved


def _raised(exc: Exception, what: str, group: str) -> GraphscaleError:
    """The error of a group's ``what`` callable (gas or factor) that raised ``exc``."""
    return GraphscaleError(
        f"graphscale: the {what} callable of group {group!r} raised "
        f"{type(exc).__name__}: {exc}. No gradient was touched."
    )


def _named_leaves(module_or_params: Any) -> tuple[list[tuple[str, torch.Tensor]], str]:
    """(name, tensor) pairs of a module or an iterable of tensors, and a default group name."""
    if isinstance(module_or_params, torch.nn.Module):
        return list(module_or_params.named_parameters()), type(module_or_params).__name__
    if isinstance(module_or_params, torch.Tensor):
        return [("0", module_or_params)], "tensor"
    if isinstance(module_or_params, Iterable) and not isinstance(module_or_params, (str, bytes)):
        named = []
        for i, p in enumerate(module_or_params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    "graphscale: Group(params) takes an nn.Module or an iterable of tensors; "
                    f"item {i} is a {type(p).__name__}."
                )
            named.append((str(i), p))
        return named, "params"
    raise TypeError(
        "graphscale: Group takes an nn.Module, an iterable of parameters or a DeepSpeed engine as its "
        f"first argument, got {type(module_or_params).__name__}."
    )


class Group:
    """Parameters whose gradients get one factor in every backward: ``1 / gas``,
    or ``factor``.

    Args:
        module_or_params: an ``nn.Module`` (its ``parameters()`` as they are
            now), an iterable of tensors that require grad, or a DeepSpeed
            engine (the group of its ``module.parameters()``, with the engine's
            own GAS; the same as passing the engine to ``install``, and the way
            to give an engine a ``factor``).
        gas: gradient-accumulation steps, a positive int, or a zero-argument
            callable returning one; the factor is ``1 / gas``.  Default 1
            (for an engine: the engine's own).
        factor: instead of ``gas``: the factor itself, a positive finite
            number or a zero-argument callable returning one.  E.g. 1 for a
            loss already normalised over the whole accumulation window (token
            counts, ``num_items_in_batch``) beside ``1 / gas`` groups in the
            same loss.
        name: used in messages and plans; defaults to the module's class name.

    A callable is read at the start of every governed backward; if it raises
    or returns a bad value, that backward raises before any gradient is
    touched.  The parameter set is taken when the group is made: parameters
    added to the module later are not owned.  A group holds strong references
    to its parameters (an engine's group also to its engine), and nothing else.

    Raises:
        TypeError: a first argument that is none of the above, or both
            ``gas`` and ``factor``, or ``gas`` for an engine.
        ValueError: a ``gas`` that is not a positive int, a ``factor`` that is
            not a positive finite number.

    Example::

        >>> import torch, graphscale
        >>> g = graphscale.Group(torch.nn.Linear(2, 2), gas=4, name="actor")
        >>> g.factor()
        0.25
        >>> len(g.parameters)
        2
        >>> graphscale.Group(torch.nn.Linear(2, 2), factor=1.0, name="lm").factor()
        1.0
    """

    __slots__ = ("name", "_gas", "_factor", "_scale", "_params", "_param_names", "_factor_key", "_module",
                 "__weakref__")

    def __new__(cls, module_or_params: Any, gas: GasSpec = UNSET, *, factor: FactorSpec = UNSET,
                name: str | None = None) -> Group:
        if cls is Group and not isinstance(module_or_params, torch.Tensor):
            made = _registry.group_type(module_or_params)  # e.g. Group(engine, factor=...): the engine's group
            if made is not None:
                return super().__new__(made)
        return super().__new__(cls)

    def __init__(
        self,
        module_or_params: torch.nn.Module | Iterable[torch.Tensor],
        gas: GasSpec = UNSET,
        *,
        factor: FactorSpec = UNSET,
        name: str | None = None,
    ) -> None:
        named, default_name = _named_leaves(module_or_params)
        # Weakly: a group holds its parameters and nothing else (NOTE [ FSDP2's backward leaves ] reads it).
        self._module = weakref.ref(module_or_params) if isinstance(module_or_params, torch.nn.Module) else None
        self._scale: Callable[[], Any] | None = None  # an adapter's loss-scale source (pin)
        if gas is not UNSET and factor is not UNSET:
            raise TypeError("graphscale: Group takes gas= or factor=, not both (factor is what 1 / gas would be).")
        if factor is None:
            raise ValueError("graphscale: Group(factor=None): factor must be a positive finite number or a callable "
                             f"returning one; leave it out for 1 / gas.{_named(name)}")
        self._gas: Any = 1 if gas is UNSET and factor is UNSET else gas
        self._factor: Any = None if factor is UNSET else factor
        if self._factor is not None:
            if callable(factor):
                self._factor_key: object = ("factor-callable", id(factor))
            else:
                self._factor_key = ("factor", _check_factor_value(factor, "Group(factor=...)", name))
        elif callable(self._gas):
            self._factor_key = ("callable", id(self._gas))
        else:
            self._factor_key = ("int", _check_gas_value(self._gas, "Group(gas=...)", name))
        self.name = name if name is not None else f"{default_name}#{next(_counter)}"
        unique: dict[int, tuple[str, torch.Tensor]] = {}
        for pname, p in named:
            unique.setdefault(id(p), (pname, p))
        self._params = tuple(p for _, p in unique.values())
        self._param_names = tuple(n for n, _ in unique.values())

    @property
    def module(self) -> torch.nn.Module | None:
        """The module the group was made from, while it is alive (None for a list of parameters)."""
        return self._module() if self._module is not None else None

    @property
    def parameters(self) -> tuple[torch.Tensor, ...]:
        """The leaves this group owns, in module order, without duplicates."""
        return self._params

    def read_spec(self) -> tuple[str, float]:
        """The group's configuration read now: ``("gas", GAS)`` or
        ``("factor", factor)``; a callable is called once and its value
        checked.  Inside :func:`spec_reads` (graphscale.audit) the value it
        read for this backward is returned instead, so a callable is called
        once per backward, audited or not."""
        reads = getattr(_frame, "reads", None)
        if reads is not None:
            hit = reads.get(self)
            if hit is not None:
                return hit  # type: ignore[no-any-return]
        spec = self._factor
        if spec is not None:
            if callable(spec):
                try:
                    value = spec()
                except Exception as exc:
                    raise _raised(exc, "factor", self.name) from exc
            else:
                value = spec
            if type(value) is float and 0.0 < value < math.inf:  # the usual value: checked without the message
                return "factor", value
            where = f"the factor callable of group {self.name!r}" if callable(spec) else "Group(factor=...)"
            return "factor", _check_factor_value(value, where)
        spec = self._gas
        if callable(spec):
            try:  # (inline, not through a helper: read once per group per backward)
                value = spec()
            except Exception as exc:
                raise _raised(exc, "gas", self.name) from exc
            if type(value) is int and value >= 1:  # the usual value: checked without the message
                return "gas", value
            return "gas", _check_gas_value(value, f"the gas callable of group {self.name!r}")
        return "gas", spec

    def gas(self) -> int | None:
        """Read the gradient-accumulation steps now (calls ``gas`` if callable);
        None for a group made with ``factor=``."""
        kind, value = self.read_spec()
        return int(value) if kind == "gas" else None

    def factor(self) -> float:
        """What every owned leaf's gradient is multiplied by, read now:
        ``factor`` if given (called if callable), else ``1 / gas()``."""
        kind, value = self.read_spec()
        return 1.0 / value if kind == "gas" else value

    def pin(self, scaling: bool = True) -> float:
        """What this backward multiplies the group's leaves by: ``factor()``
        (1 when ``not scaling``, i.e. ``engine.backward(scale_wrt_gas=False)``),
        times the loss scale an adapter's group reads (an fp16 engine's:
        ``_scale``, a callable the adapter set, or None)."""
        f = self.factor() if scaling else 1.0
        scale = self._scale
        return f if scale is None else f * float(scale())

    @property
    def factor_key(self) -> object:
        """Identifies where the factor comes from: groups with equal keys always
        have equal factors (the same int gas, the same callable, the same
        engine), so they may share a leaf."""
        return self._factor_key

    def param_name(self, p: torch.Tensor) -> str:
        """The name of ``p`` in this group (its module's parameter name), or ``"?"``."""
        for q, n in zip(self._params, self._param_names):
            if q is p:
                return n
        return "?"

    def _spec_repr(self) -> str:
        key, spec = ("factor", self._factor) if self._factor is not None else ("gas", self._gas)
        return f"{key}={getattr(spec, '__name__', 'callable') if callable(spec) else spec}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self._spec_repr()}, params={len(self._params)})"


_PIN, _FACTOR, _READ_SPEC = Group.pin, Group.factor, Group.read_spec


def read_pins(groups: Iterable[Group], scaling: bool = True) -> list[float]:
    """:meth:`Group.pin` of each of ``groups``, in order, read now (what a
    snapshot's :meth:`~graphscale._core.snapshot.State.read` asks once per backward).

    A ``gas=`` group's pin is read here without the three calls of
    ``pin() -> factor() -> read_spec()`` (the same value, the same checks and
    errors); through them for a ``factor=`` group, inside :func:`spec_reads`,
    and where a group's type has its own ``pin``, ``factor`` or ``read_spec``
    (or a test put one there).  A copy kept for speed (style convention 17):
    through the three calls, ``benchmarks/cost.py --calls-only`` counted 3
    more Python calls per group and backward (issue 49: mixed-loss 42 -> 48,
    one-engine 20 -> 23, past the gate's margin of 3 % + 2)."""
    if getattr(_frame, "reads", None) is not None:
        return [g.pin(scaling) for g in groups]
    pins = []
    for g in groups:
        t = type(g)
        if g._factor is not None or t.pin is not _PIN or t.factor is not _FACTOR or t.read_spec is not _READ_SPEC:
            pins.append(g.pin(scaling))
            continue
        f = 1.0
        if scaling:
            gas = g._gas
            if callable(gas):  # (read_spec's callable gas, inline)
                try:
                    gas = gas()
                except Exception as exc:
                    raise _raised(exc, "gas", g.name) from exc
                if type(gas) is not int or gas < 1:
                    gas = _check_gas_value(gas, f"the gas callable of group {g.name!r}")
            f = 1.0 / gas
        scale = g._scale
        pins.append(f if scale is None else f * float(scale()))
    return pins
