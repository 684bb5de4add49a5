"""The Python planner, the reference: one module per step, each the twin of
the C++ header of the same name in ``_native/planner/`` (nodes, walk, pins,
potentials, probe, plan).  Imports nothing of graphscale but ``_core``."""
