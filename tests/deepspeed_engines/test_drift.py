"""A DeepSpeed that changed an internal graphscale relies on is refused at
install() with a GraphscaleError naming the version, the piece and the fix,
before any engine is touched (NOTE [ DeepSpeed drift ] in
graphscale/_adapters/deepspeed/checks.py).

Each test simulates one upstream change on the real classes (monkeypatched,
undone after the test) and installs a real engine: without the checks, each
of these changes would make some gradient silently wrong or the step raise.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import graphscale
from graphscale._adapters.deepspeed import checks as _deepspeed_checks
from graphscale._entry import entry as _backward

from helpers.engines import require_deepspeed

pytestmark = [pytest.mark.deepspeed, require_deepspeed]


@pytest.fixture
def engine(make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh ZeRO-1 engine, with the checks' per-class memo emptied for the test."""
    monkeypatch.setattr(_deepspeed_checks, "_passed", set())
    return make_engine(torch.nn.Linear(4, 4), gas=2, stage=1)


def _refused(engine: Any, *needles: str) -> None:
    import deepspeed

    with pytest.raises(graphscale.GraphscaleError) as err:
        graphscale.install(engine)
    msg = str(err.value)
    for needle in (f"DeepSpeed {deepspeed.__version__}", "No engine was installed", "deepspeed==", *needles):
        assert needle in msg, msg
    assert not {"backward", "scale", "_backward_epilogue"} & engine.__dict__.keys(), "the engine was touched"
    assert torch.autograd.backward is _backward.ORIGINAL_BACKWARD


def _hook_manager() -> type:
    from deepspeed.runtime.utils import OutputBackwardHookManager

    return OutputBackwardHookManager


def test_real_deepspeed_passes_the_checks(engine: Any) -> None:
    with graphscale.install(engine):
        pass
    assert type(engine) in _deepspeed_checks._passed and _hook_manager() in _deepspeed_checks._passed


def test_a_removed_engine_method_is_refused(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(type(engine), "_backward_prologue_per_tensor")
    _refused(engine, "DeepSpeedEngine._backward_prologue_per_tensor is missing")


def test_a_removed_hook_manager_is_refused(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import deepspeed.runtime.utils as utils

    monkeypatch.delattr(utils, "OutputBackwardHookManager")
    _refused(engine, "OutputBackwardHookManager is missing")


def test_a_prologue_run_once_per_graph_task_as_in_pr_8135_is_refused(engine: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook decides "once" by the graph task it runs in, not by preprocess_done."""

    def make_hook(self: Any, tensor: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            task = torch._C._current_graph_task_id()
            if getattr(self, "_task", None) != task:
                self._task = task
                self.preprocess_done = True
                self.preprocess_once_fn()
            fn = self.preprocess_per_tensor_fn
            return grad if fn is None else fn(grad)

        return hook

    monkeypatch.setattr(_hook_manager(), "_make_backward_hook", make_hook)
    _refused(engine, "something other than preprocess_done")


def test_a_per_tensor_function_captured_at_registration_is_refused(engine: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A refactor that binds the per-tensor function when the hook is made:
    graphscale's redirect would never be asked, and loss.backward() would
    divide by GAS twice."""

    def make_hook(self: Any, tensor: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        fn = self.preprocess_per_tensor_fn

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if not self.preprocess_done:
                self.preprocess_done = True
                self.preprocess_once_fn()
            return grad if fn is None else fn(grad)

        return hook

    monkeypatch.setattr(_hook_manager(), "_make_backward_hook", make_hook)
    _refused(engine, "preprocess_per_tensor_fn is not read from the manager when its hook fires")


def test_a_hook_that_calls_its_per_tensor_function_unchecked_is_refused(engine: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a governed backward an engine's managers read their per-tensor
    function as None: a hook that calls it without asking would raise there."""

    def make_hook(self: Any, tensor: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if not self.preprocess_done:
                self.preprocess_done = True
                self.preprocess_once_fn()
            return self.preprocess_per_tensor_fn(grad)  # type: ignore[no-any-return]

        return hook

    monkeypatch.setattr(_hook_manager(), "_make_backward_hook", make_hook)
    _refused(engine, "does not pass the gradient on unchanged when preprocess_per_tensor_fn is None")


def test_a_per_tensor_prologue_that_stopped_dividing_is_refused(engine: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(engine), "_backward_prologue_per_tensor", lambda self, grad: grad)
    _refused(engine, "_backward_prologue_per_tensor no longer divides")


def test_output_hooks_registered_another_way_are_refused(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def forward(self: Any, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

    monkeypatch.setattr(type(engine), "forward", forward)
    _refused(engine, "DeepSpeedEngine.forward no longer registers its output hooks")


def test_a_loss_scale_moved_as_in_pr_8393_is_refused(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.backward would multiply the loss by a scale kept somewhere
    graphscale does not read (PR 8393 moves ZeRO 0's fp16 scale into
    FP16_Optimizer.backward): every engine's factor would carry it wrongly."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    monkeypatch.setattr(ZeROOptimizer, "scale_if_loss", lambda self, value: value * 1024.0)
    _refused(engine, "scale_if_loss multiplies the loss by 1024", "the fp16 loss scale moved")
