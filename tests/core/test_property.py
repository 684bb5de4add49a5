"""Random programs over 1-4 groups with different GAS (tests/helpers/programs.py),
each run plain and governed: owned leaves must get exactly plain/gas, unowned
leaves exactly plain under unowned="plain" (the unowned Parameters also under
"plain_params") and plain times one factor in play otherwise.
"""
from __future__ import annotations

import warnings

from hypothesis import HealthCheck, given, settings
from torch import nn

import graphscale

from helpers.grads import grad_mismatches
from helpers.programs import Program, World, programs


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(prog=programs)
def test_random_programs_match_the_plain_oracle_scaled_per_group(prog: Program) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reentrant checkpoint of an input without grad warns
        plain = World(prog.gas).run(prog)
        for unowned in ("any", "plain_params", "plain"):
            world = World(prog.gas)
            groups = [graphscale.Group(m, gas=s, name=f"g{i}") for i, (m, s) in enumerate(zip(world.g, world.gas))]
            with graphscale.install(*groups, unowned=unowned):
                got = world.run(prog)
            for n, (want_pass, got_pass) in enumerate(zip(plain, got, strict=True)):
                params = {k for k, t in world.leaves().items() if isinstance(t, nn.Parameter)}
                bad = grad_mismatches(want_pass, got_pass, world.factor_of(), unowned, params=params)
                assert not bad, f"unowned={unowned!r}, backward #{n + 1}:\n  " + "\n  ".join(bad)
