"""Groups: sets of leaves that share one gradient-accumulation factor.

A group owns parameters (autograd leaves) and knows its GAS.  Its factor is
``1 / GAS``, read once at the start of every governed backward, so a ``gas``
callable may change between steps.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Union

import torch

from ._errors import GraphscaleError

__all__ = ["Group"]

GasSpec = Union[int, Callable[[], int]]

_counter = itertools.count()


def _check_gas_value(value: object, where: str) -> int:
    """Return ``value`` if it is a positive int, else raise ValueError naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"graphscale: {where} must be a positive int (the gradient-accumulation steps), "
            f"got {value!r} of type {type(value).__name__}."
        )
    if value < 1:
        raise ValueError(f"graphscale: {where} must be a positive int, got {value}.")
    return value


class Group:
    """Parameters whose gradients get one factor, ``1 / gas``, in every backward.

    Args:
        module_or_params: an ``nn.Module`` (its ``parameters()`` as they are
            now) or an iterable of tensors that require grad.
        gas: gradient-accumulation steps, a positive int, or a zero-argument
            callable returning one.  A callable is read at the start of every
            governed backward; if it raises or returns a bad value, that
            backward raises before any gradient is touched.
        name: used in messages and plans; defaults to the module's class name.

    The parameter set is taken when the group is made: parameters added to the
    module later are not owned.  A group holds strong references to its
    parameters, and nothing else.

    Example::

        >>> import torch, graphscale
        >>> g = graphscale.Group(torch.nn.Linear(2, 2), gas=4, name="actor")
        >>> g.factor()
        0.25
        >>> len(g.parameters)
        2
    """

    __slots__ = ("name", "_gas", "_params", "_param_names", "_factor_key", "__weakref__")

    def __init__(
        self,
        module_or_params: torch.nn.Module | Iterable[torch.Tensor],
        gas: GasSpec = 1,
        name: str | None = None,
    ) -> None:
        named: list[tuple[str, torch.Tensor]]
        if isinstance(module_or_params, torch.nn.Module):
            named = list(module_or_params.named_parameters())
            default_name = type(module_or_params).__name__
        elif isinstance(module_or_params, torch.Tensor):
            named = [("0", module_or_params)]
            default_name = "tensor"
        elif isinstance(module_or_params, Iterable) and not isinstance(module_or_params, (str, bytes)):
            named = []
            for i, p in enumerate(module_or_params):
                if not isinstance(p, torch.Tensor):
                    raise TypeError(
                        "graphscale: Group(params) takes an nn.Module or an iterable of tensors; "
                        f"item {i} is a {type(p).__name__}."
                    )
                named.append((str(i), p))
            default_name = "params"
        else:
            raise TypeError(
                "graphscale: Group takes an nn.Module or an iterable of parameters as its first "
                f"argument, got {type(module_or_params).__name__}. For a DeepSpeed engine, pass the "
                "engine itself to graphscale.install()."
            )
        if callable(gas):
            self._factor_key: object = ("callable", id(gas))
        else:
            _check_gas_value(gas, "Group(gas=...)")
            self._factor_key = ("int", gas)
        self._gas = gas
        self.name = name if name is not None else f"{default_name}#{next(_counter)}"
        seen: set[int] = set()
        params: list[torch.Tensor] = []
        names: list[str] = []
        for pname, p in named:
            if id(p) in seen:
                continue
            seen.add(id(p))
            params.append(p)
            names.append(pname)
        self._params = tuple(params)
        self._param_names = tuple(names)

    @property
    def parameters(self) -> tuple[torch.Tensor, ...]:
        """The leaves this group owns, in module order, without duplicates."""
        return self._params

    def gas(self) -> int:
        """Read the gradient-accumulation steps now (calls ``gas`` if callable)."""
        spec = self._gas
        if callable(spec):
            try:
                value = spec()
            except Exception as exc:
                raise GraphscaleError(
                    f"graphscale: the gas callable of group {self.name!r} raised "
                    f"{type(exc).__name__}: {exc}. No gradient was touched."
                ) from exc
            return _check_gas_value(value, f"the gas callable of group {self.name!r}")
        return spec  # type: ignore[return-value]

    def factor(self) -> float:
        """``1 / gas()``: what every owned leaf's gradient is multiplied by."""
        return 1.0 / self.gas()

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

    def __repr__(self) -> str:
        gas = self._gas if not callable(self._gas) else getattr(self._gas, "__name__", "callable")
        return f"Group({self.name!r}, gas={gas}, params={len(self._params)})"
