"""The main job's verdicts (benchmarks/gsbench/report.py): a counted row is
judged on its counted ratio, whatever its timed one says; a row not counted
is judged on time and says so (NOTE [ Counted rows ] in
benchmarks/gsbench/rowcounts.py)."""
from __future__ import annotations

import sys
from typing import Any

from helpers.paths import REPO

BENCH = REPO / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from gsbench import report  # noqa: E402


def _row(timed: float, counted: float | None, leaf_timed: float = 1.2, leaf_counted: float = 1.1) -> dict[str, Any]:
    impl = {name: {"ratio_median": r} for name, r in
            (("deepspeed", 1.0), ("leaf-hooks", leaf_timed), ("graphscale", timed))}
    row: dict[str, Any] = {"workload": "W2", "hidden": 32, "size": "launch", "expected_multiplications": 2,
                           "impl": impl}
    if counted is not None:
        row["counted"] = {"deepspeed": {"ratio": 1.0, "median": 1e6},
                          "leaf-hooks": {"ratio": leaf_counted, "median": 1e6 * leaf_counted},
                          "graphscale": {"ratio": counted, "median": 1e6 * counted}}
    return row


def test_a_counted_row_is_judged_on_its_counted_ratio_not_its_timed_one() -> None:
    met = dict((msg.split(" <=")[0], ok) for ok, msg in report.ratio_checks(_row(timed=1.5, counted=1.004)))
    assert met == {"counted ratio 1.0040": True, "counted below leaf-hooks (1.1000)": True}
    over = report.ratio_checks(_row(timed=0.9, counted=1.006))
    assert [ok for ok, _ in over] == [False, True]


def test_a_row_not_counted_is_judged_on_time_and_says_so() -> None:
    checks = report.ratio_checks(_row(timed=1.03, counted=None))
    assert [ok for ok, _ in checks] == [False, True]
    assert all("timed" in msg for _, msg in checks) and "(not counted)" in checks[0][1]


def test_the_nested_block_is_judged_in_instructions_where_both_rows_were_counted() -> None:
    w2, w5 = _row(1.0, 1.01), _row(1.0, 1.02)
    w5["workload"], w5["layers"] = "W5", 12
    for s in (w2, w5):
        s["impl"]["graphscale"]["times_s"] = [0.0011]
        s["impl"]["deepspeed"]["times_s"] = [0.001]
    (line,) = report.nested_cost([w2, w5])
    # (W5 adds 20,000 - W2 adds 10,000) / 24 blocks = 417 instructions a block
    assert "417 instructions <= 10,000: met" in line
