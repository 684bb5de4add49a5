"""The overhead benchmark as a package; ``benchmarks/overhead.py`` runs it.

* :mod:`.spec`: what runs (workload names, implementations, expected
  multiplications, the GPT-2 shapes); no heavy imports.
* :mod:`.env`: the process: DeepSpeed's accelerator, distributed init, quiet
  libraries, engines, the device, the versions.
* :mod:`.models`, :mod:`.workloads`: the towers and GPT-2 models, the rows'
  graphs, and the plain-PyTorch oracle.
* :mod:`.impls`: the three implementations, one class each.
* :mod:`.timing`: interleaved rounds, peak memory, the table's rows.
* :mod:`.fixed`: graphscale's fixed cost per backward, by phase, and what
  ``install()`` costs.
* :mod:`.stats`, :mod:`.report`, :mod:`.plot`: medians, tables, targets, the
  chart.
* :mod:`.cli`: the command line.

graphscale is reached only through its public API and ``graphscale.observe``.
"""
