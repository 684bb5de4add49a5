"""What DeepSpeed alone does to the training-parity cases (tests/helpers/training.py), as measured:
pinned by tests/deepspeed_engines/test_training_parity*.py so that an upstream change is noticed."""
from __future__ import annotations

from helpers.training import CHECKPOINTED_TWICE, SHAPES, Case


def generation() -> str:
    """'tracker' for DeepSpeed >= 0.19.6 (PR 8245), 'hooks' before it."""
    import deepspeed.runtime.engine as eng

    return "tracker" if hasattr(eng, "_ENGINE_BACKWARD_GRAPH_TRACKER") else "hooks"


def deepspeed_alone(case: Case, gen: str, world: int) -> str:
    """What DeepSpeed alone does to a case's training: "exact", "wrong" (it
    trains, with some engine's factor wrong) or "raises" (step() fails).

    * an engine's module called directly, or an engine nested in another
      (whichever engine's backward is called),
      gets the wrong factor in both generations (NOTE [ DeepSpeed's two
      generations ]), and so does every other engine under one engine's
      backward on the tracker generation (the whole loss divided by the
      caller's GAS);
    * on the tracker generation a direct loss.backward() over two forwards of
      one engine runs its prologue twice and its epilogue never (NOTE [ One
      lifecycle per backward ]): step() raises.  A reentrant checkpoint
      around an engine runs its forward under no_grad (no output hook) and
      again in the nested backward: once, so that alone is exact.  Forwarded
      outside the checkpoint too, its prologue runs in the outer and in the
      nested graph task, each queueing an epilogue: on the hooks generation
      the second epilogue fails (IndexError in ZeRO's partition epilogue);
    * a ZeRO-0 engine reached by any backward but its own engine.backward
      (loss.backward(), or another engine's engine.backward over a shared
      loss) raises: DeepSpeed refuses a direct backward at ZeRO 0;
    * on the hooks generation, two ranks, ZeRO 3, a reentrant checkpoint inside
      each engine under loss.backward() trains wrong in some runs and exactly
      in others (measured: weight-change error 0.067, reduced gradient 0.27,
      and 0.0 in another run; exact on one rank; not traced further:
      graphscale is exact there in every run): "exact or wrong".
    """
    if (gen, case.shape, case.call, case.stage, world) == ("hooks", "checkpointed", "loss", 3, 2):
        return "exact or wrong"
    caller = case.call.split(":")[1] if case.call.startswith("engine:") else None
    if any(case.stage_of(n) == 0 and n != caller for n in SHAPES[case.shape].engines):
        return "raises"  # "Direct calls to tensor.backward() are not supported ... using ZeRO stage 0"
    twice = case.shape in ("engine_twice", "nested_engine_twice", "three_engines", "one_engine_twice",
                           *CHECKPOINTED_TWICE)
    if case.call == "loss" and (gen == "tracker" and twice or case.shape == "checkpoint_around_engine_twice"):
        return "raises"
    wrong = {"engine_plus_module", "nested", "nested_engine_twice"}
    if gen == "tracker" and caller is not None and len(SHAPES[case.shape].engines) > 1:
        wrong |= {"sum", "engine_twice", "three_engines", "checkpointed", "checkpoint_around_engines",
                  *CHECKPOINTED_TWICE}
    return "wrong" if case.shape in wrong else "exact"
