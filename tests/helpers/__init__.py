"""What the tests share, by concern; imported by the tests as ``helpers.<module>``
(pyproject's ``pythonpath = ["tests"]``; spawned workers get tests/ on their
PYTHONPATH from :mod:`helpers.ranks`).  conftest.py holds only pytest's hooks
and fixtures.

- :mod:`helpers.paths`: the repository's folders.
- :mod:`helpers.models`: the small model of the engine tests.
- :mod:`helpers.engines`: DeepSpeed present or not, its config, its device.
- :mod:`helpers.grads`: the gradient readers and the oracle comparisons.
- :mod:`helpers.hooks`: the hooks a backward made and left.
- :mod:`helpers.routes`: which route governs here.
- :mod:`helpers.ranks`: two (or more) gloo ranks, each a spawned worker.
- :mod:`helpers.functions`, :mod:`helpers.programs`: custom autograd Functions
  and the random programs of the property and route tests.
- :mod:`helpers.seams`: the native module's test build.
- What one family's files share, named for it: :mod:`helpers.worlds` and
  :mod:`helpers.untouched` (tests/core/); :mod:`helpers.engine_pool`,
  :mod:`helpers.engine_shapes`, :mod:`helpers.training`, :mod:`helpers.fp16`,
  :mod:`helpers.hf` and :mod:`helpers.hf_engines` (tests/deepspeed_engines/);
  :mod:`helpers.thread_rig` and :mod:`helpers.thread_scenarios`
  (tests/hardening/, tests/stacks/test_cuda.py); :mod:`helpers.factors`
  (tests/factors/); :mod:`helpers.audit` (tests/tools/); :mod:`helpers.package`
  (tests/project/).
- ``helpers/workers/``: the scripts tests run in a child process.

This file imports nothing: a worker that needs only :mod:`helpers.ranks`
loads neither torch nor graphscale through it.
"""
