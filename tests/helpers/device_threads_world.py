"""The modules, inputs and oracle of the tests in tests/device_threads/: three
``Linear(4, 4)`` on the device thread's device (tests/helpers/device_threads.py),
A and B governed as plain ``graphscale.Group``s (GAS 2 and 4: factors 1/2 and
1/4, exact in floating point) and U owned by no group, and the check every
gradient test makes: run the same backward plainly, then governed, and
compare bit for bit with plain x each parameter's factor."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

import graphscale

from helpers import device_threads as dt

GAS = {"A": 2, "B": 4}


class World:
    """A, B, U on the device; ``x``, ``y`` inputs there (leaves that need no
    gradient unless a test asks); ``groups``: which of A, B are installed,
    with ``gas`` (default :data:`GAS`)."""

    def __init__(self, groups: str = "AB", seed: int = 0, gas: dict[str, int] | None = None) -> None:
        torch.manual_seed(seed)
        self.mods = {name: dt.to_device(torch.nn.Linear(4, 4)) for name in "ABU"}
        g = torch.Generator().manual_seed(seed + 1)
        self.x = dt.to_device(torch.randn(3, 4, generator=g))
        self.y = dt.to_device(torch.randn(3, 4, generator=g))
        self.groups = groups
        self.gas = dict(GAS if gas is None else gas)
        self.reached: list[str] = []

    @property
    def A(self) -> torch.nn.Module:
        return self.mods["A"]

    @property
    def B(self) -> torch.nn.Module:
        return self.mods["B"]

    @property
    def U(self) -> torch.nn.Module:
        return self.mods["U"]

    def params(self) -> dict[str, torch.nn.Parameter]:
        return {f"{m}.{n}": p for m, mod in self.mods.items() for n, p in mod.named_parameters()}

    def factor(self, name: str) -> float:
        """The contract's factor of a parameter: 1/GAS of its group, 1 unowned."""
        owner = name.split(".")[0]
        return 1.0 / self.gas[owner] if owner in self.groups else 1.0

    def install(self) -> graphscale.Installation:
        return graphscale.install(*(graphscale.Group(self.mods[n], gas=self.gas[n]) for n in self.groups))

    def take_grads(self) -> dict[str, torch.Tensor | None]:
        """Every parameter's gradient (a CPU copy), then cleared."""
        out = {}
        for name, p in self.params().items():
            out[name] = dt.on_cpu(p.grad)
            p.grad = None
        return out

    def watch(self, threads: dt.ThreadLog) -> None:
        """A tensor hook on every parameter that records its thread in ``threads``."""
        for name, p in self.params().items():
            p.register_hook(threads.hook(name))

    @contextmanager
    def governed(self, route: str) -> Iterator[dt.RouteLog]:
        """Installed, every governed backward recorded (checked on exit: at least one, all on ``route``)."""
        with self.install(), dt.RouteLog() as routes:
            yield routes
        routes.assert_took(route)

    def mismatches(self, run: Callable[[], None], route: str, times: int = 1) -> list[str]:
        """``run()`` plainly, then governed: the parameters whose governed
        gradient is not exactly plain x factor (each reached one checked).
        ``times``: the governed backwards ``run`` makes, at least."""
        run()
        plain = self.take_grads()
        with self.install(), dt.RouteLog() as routes:
            run()
        routes.assert_took(route, at_least=times)
        got = self.take_grads()
        want = {n: g * self.factor(n) for n, g in plain.items() if g is not None}
        extra = [f"{n}: a gradient where plain PyTorch gives none" for n, g in got.items()
                 if g is not None and n not in want]
        assert want, "the backward reached no parameter: the case checks nothing"
        self.reached = sorted(want)  # the parameters whose hooks must have run
        return dt.exact_mismatches(got, want) + extra

