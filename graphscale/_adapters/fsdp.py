"""The FSDP2 adapter: the only module that knows ``torch.distributed.fsdp``
internals.  A group made from a fully_shard-ed module owns the unsharded
parameters its backward reaches.  Registered with graphscale's adapter
registry (``_core/registry.py``) at import.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._core import registry as _registry

__all__ = ["fsdp_params", "unsharded_of", "ADAPTER"]

# NOTE [ FSDP2's backward leaves ]
# A fully_shard-ed module's parameters() are its *sharded* parameters
# (nn.Parameter DTensors, FSDPParam.sharded_param): what a Group made from
# the module owns and what its optimizer steps.  Forward does not use them:
# it swaps in FSDPParam._unsharded_param, an nn.Parameter made at the first
# unshard (first forward, or FSDPModule.unshard()) and the same object on
# every later iteration (torch 2.13, read and tested: init_unsharded_param returns
# early once it exists; only its storage is freed and re-allocated).  So the
# backward's leaves are the unsharded parameters, and FSDP2 reduce-scatters
# their gradient into the sharded parameters' .grad after backward.
# graphscale therefore gives each unsharded parameter the group of its
# sharded one: State.of adds them to the owner map (the snapshot holds them;
# this adapter's backward_leaves names them),
# and FSDPParams whose unsharded parameter does not exist yet (installed
# before the first forward, the usual order) stay pending in the snapshot;
# the first governed backward after they appear rebuilds the snapshot once.
# The scaled unsharded gradient is what FSDP2 reduces, so the sharded .grad
# carries the factor.  Found from the group's module (a Group made from a
# list of parameters has none: make it from the module); nothing here runs
# unless torch.distributed.fsdp has been imported.  No public API maps a
# module to its FSDPParams: FSDPModule._get_fsdp_state()._fsdp_param_groups
# (_fsdp_param_group before torch 2.6) is read.


def _fsdp_module_type() -> type | None:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", None)


def fsdp_params(module: torch.nn.Module) -> Iterator[Any]:
    """The FSDPParams of every fully_shard-ed module in ``module`` (nothing
    when FSDP2 is not in use)."""
    fsdp_module = _fsdp_module_type()
    if fsdp_module is None:
        return
    for m in module.modules():
        if not isinstance(m, fsdp_module):
            continue
        state = m._get_fsdp_state()  # type: ignore[operator]
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            single = getattr(state, "_fsdp_param_group", None)
            groups = [single] if single is not None else []
        for param_group in groups:
            yield from param_group.fsdp_params


def unsharded_of(fsdp_param: Any) -> torch.Tensor | None:
    """The unsharded parameter (the backward's leaf) of ``fsdp_param``, once made."""
    return fsdp_param.__dict__.get("_unsharded_param")


def _sharded_of(fsdp_param: Any) -> torch.Tensor:
    return fsdp_param.sharded_param  # type: ignore[no-any-return]


def _made(fsdp_param: Any) -> Callable[[], bool]:
    return lambda: unsharded_of(fsdp_param) is not None


class _FSDPAdapter(_registry.Adapter):
    """What the core asks about FSDP2 modules (``_core/registry.py``)."""

    name = "fsdp2"

    def backward_leaves(self, group: Any, owns: Callable[[Any], bool]) -> tuple[
            list[tuple[Any, str]], list[Callable[[], bool]]]:
        """The unsharded parameters of the group's FSDP2 modules whose
        sharded parameter the group owns, and a check for each not made yet."""
        module = group.module if "torch.distributed.fsdp" in sys.modules else None
        if module is None:
            return [], []
        leaves: list[tuple[Any, str]] = []
        pending: list[Callable[[], bool]] = []
        for fp in fsdp_params(module):
            sharded = _sharded_of(fp)
            if not owns(sharded):
                continue
            leaf = unsharded_of(fp)
            if leaf is None:
                pending.append(_made(fp))
            else:
                leaves.append((leaf, f"{group.param_name(sharded)} (unsharded)"))
        return leaves, pending


ADAPTER = _registry.register(_FSDPAdapter())
