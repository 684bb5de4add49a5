"""The DeepSpeed adapter: an engine's group (:class:`EngineGroup`, with its fp16
loss scale), registered with graphscale's adapter registry (``_core/registry.py``)
at import.  Only this folder knows about deepspeed, and none of it imports it:
it reads ``sys.modules``.  Beside this module: ``engine.py`` (what graphscale
changes on an engine), ``failed.py`` (an engine's part of a backward that
raised), ``checks.py`` (the drift checks), ``compiled.py`` (compiled autograd),
``watch.py`` (the diagnosis' watch), ``hooks.py`` and ``reads.py``.
"""
from __future__ import annotations

import itertools
import sys
import threading
import weakref
from typing import Any, Callable

from ..._core import registry as _registry
from ..._core.errors import GraphscaleError
from ..._core.group import UNSET, Group
from ..._core.releases import newer_than_tested
from .checks import TESTED, check_installed
from .engine import after_epilogue, attach
from .hooks import is_output_hooked
from .reads import is_engine, scale_reader, scale_source
from .watch import observe

__all__ = ["EngineGroup", "loss_scale", "ADAPTER"]

# NOTE [ fp16 engines ]
# An fp16 engine's optimizer expects its gradients multiplied by its own
# loss scale (it unscales by it, and checks them for overflow).  DeepSpeed
# multiplies the whole loss by the scale of the engine whose backward (or
# scale()) is called, so in one loss over two fp16 engines the other
# engine's gradients carry the wrong scale once the dynamic scales differ.
# graphscale places loss_scale(G) x factor(G) at each engine's boundary
# (EngineGroup.pin, which reads and changes nothing) and strips what the seed
# already carries:
#   * engine.backward(loss): DeepSpeed scales the loss by the calling
#     engine's scale before backward; the adapter says so
#     (adapter_backward(carries=...)), and the plan divides it out;
#   * engine.scale(loss).backward(): the adapter's scale() tags the scaled
#     loss with the scale it applied (_backward/frames.py CARRIES_ATTR), stripped alike;
#   * loss.backward() directly: nothing to strip; graphscale applies every
#     engine's scale, and tells DeepSpeed that this direct backward was
#     scaled (its check at the epilogue would otherwise refuse it) when the
#     engine's prologue runs in it (_EngineAdapter.prologue_starts).
# bf16 and fp32 engines have scale 1: nothing changes for them.


def _is_pipeline(engine: Any) -> bool:
    pipe = sys.modules.get("deepspeed.runtime.pipe.engine")
    return pipe is not None and isinstance(engine, pipe.PipelineEngine)

_numbers: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # engine -> its default name's number
_next_number = itertools.count(1)
_numbers_lock = threading.Lock()


def _default_name(engine: Any) -> str:
    """``engine:<module type>#<n>``: n counts the engines this process has
    named, so two engines never share a default name (an audit or a
    diagnosis reports per name), and one engine keeps its name across installs."""
    with _numbers_lock:
        n = _numbers.get(engine)
        if n is None:
            n = _numbers[engine] = next(_next_number)
    return f"engine:{type(engine.module).__name__}#{n}"


def loss_scale(engine: Any) -> float:
    """The factor DeepSpeed's engine.backward multiplies the loss by, now (see :func:`scale_reader`)."""
    return scale_reader(engine)()

class EngineGroup(Group):
    """The group of a DeepSpeed engine: its module's parameters, its GAS (or a
    ``factor`` in its place), its fp16 loss scale.  Made by
    ``graphscale.Group(engine, factor=...)`` or by passing the engine to
    ``install``.

    ``engine``: the engine (its bound ``gradient_accumulation_steps`` is the
    group's gas callable, which holds it anyway).
    """

    __slots__ = ("engine",)

    def __init__(self, engine: Any, gas: Any = UNSET, *, factor: Any = UNSET, name: str | None = None) -> None:
        if gas is not UNSET:
            raise TypeError(
                "graphscale: Group(engine, gas=...): an engine's gradient-accumulation steps are its own "
                "(its config's gradient_accumulation_steps); give factor= to put another factor in place of "
                "1 / GAS."
            )
        if _is_pipeline(engine):
            raise TypeError(
                "graphscale.install: PipelineEngine schedules its own micro-batches and calls backward "
                "itself; graphscale does not govern it. Install the non-pipeline engines only."
            )
        name = name or _default_name(engine)
        if factor is UNSET:
            super().__init__(engine.module, gas=engine.gradient_accumulation_steps, name=name)
            self._factor_key = ("engine", id(engine))
        else:
            super().__init__(engine.module, factor=factor, name=name)
            self._factor_key = ("engine", id(engine), self._factor_key)
        self.engine: Any = engine
        self._scale = scale_source(engine)  # pin() multiplies the loss scale in: NOTE [ fp16 engines ]

# ---------------------------------------------------------------- the registered adapter
class _DeepSpeedAdapter(_registry.Adapter):
    """What the core asks about DeepSpeed engines (``_core/registry.py``)."""

    name = "deepspeed"

    def group_type(self, obj: Any) -> type | None:
        return EngineGroup if is_engine(obj) else None

    def attach(self, group: Any) -> Callable[[], None] | None:
        return attach(group.engine, group.name) if isinstance(group, EngineGroup) else None

    def observe(self, group: Any) -> Callable[[], None] | None:
        return observe(group.engine) if isinstance(group, EngineGroup) else None

    def hook_owner(self, group: Any) -> Any:
        return group.engine if isinstance(group, EngineGroup) else None

    def output_hooked(self, tensor: Any) -> bool:
        return is_output_hooked(tensor)

    def audit_scale(self, group: Any) -> float:
        return loss_scale(group.engine) if isinstance(group, EngineGroup) else 1.0

    def audit_replay(self, group: Any) -> str | None:
        if not isinstance(group, EngineGroup) or int(group.engine.zero_optimization_stage()) < 3:
            return None
        return (f"group {group.name!r} is a DeepSpeed engine at ZeRO stage 3, where a graph can be "
                "backpropagated only once (ZeRO-3 gathers each module's parameters for one backward pass per "
                "forward; DeepSpeed alone raises on a second pass), and the plain reference over the same graph "
                "is a second pass (at ZeRO stage 2 the same model and ranks, whose gradients take the same "
                "scaling, need no replay).")

    def audit_window(self, group: Any) -> Any:
        return _EngineWindow(group.engine) if isinstance(group, EngineGroup) else None

    def environment(self) -> list[tuple[str, str, bool]]:
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            return [("DeepSpeed", "not installed", True)]
        try:
            import deepspeed  # noqa: F401 - the report imports what a user's script would
            import deepspeed.runtime.engine  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - a DeepSpeed that does not import is the finding
            return [("DeepSpeed", f"does not import: {type(exc).__name__}: {exc}", False)]
        version = sys.modules["deepspeed"].__version__
        newer = ", newer: the drift checks decide" if newer_than_tested("DeepSpeed", version) else ""
        rows = [("DeepSpeed", f"{version} (tested: {TESTED}{newer})", True)]
        try:
            check_installed()
        except GraphscaleError as exc:
            return [*rows, ("DeepSpeed drift checks", f"FAILED: {exc}", False)]
        return [*rows, ("DeepSpeed drift checks", "passed (hook manager, engine class)", True)]


class _EngineWindow:
    """An engine's accumulation window as the audit reads it (``_registry.Adapter.audit_window``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def steps(self) -> int:
        return int(self.engine.global_steps)

    def starts(self) -> bool:
        return int(self.engine.micro_steps) % int(self.engine.gradient_accumulation_steps()) == 0

    def boundary(self) -> bool:
        return bool(self.engine.is_gradient_accumulation_boundary())

    def after_reduction(self, fn: Callable[[], None]) -> bool:
        return after_epilogue(self.engine, fn)  # DeepSpeed reduces in its backward epilogue

    def reduced(self, p: Any) -> Any:
        return sys.modules["deepspeed.utils"].safe_get_full_grad(p)

    def average(self, t: Any) -> Any:
        dist = sys.modules["torch.distributed"]
        engine = self.engine
        group = (getattr(engine.optimizer, "dp_process_group", None) or getattr(engine, "seq_data_parallel_group", None)
                 or engine.data_parallel_group)
        world = dist.get_world_size(group)
        if world > 1:
            dist.all_reduce(t, group=group)
            t /= world
        return t


ADAPTER = _registry.register(_DeepSpeedAdapter())
