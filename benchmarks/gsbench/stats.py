"""A row's raw numbers (:class:`Row`), medians and quartiles, and the
summary of a row that the table, the targets, the plot and the JSON read."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from .spec import EXPECTED_MULTS, IMPLS


@dataclass
class Row:
    workload: str
    size: str
    hidden: int
    layers: int
    nodes: int = 0
    times: dict[str, list[float]] = field(default_factory=lambda: {i: [] for i in IMPLS})
    ratios: dict[str, list[float]] = field(default_factory=lambda: {i: [] for i in IMPLS})
    peak: dict[str, list[int]] = field(default_factory=lambda: {i: [] for i in IMPLS})
    err: dict[str, float] = field(default_factory=dict)
    walked: list[int] = field(default_factory=list)
    walk_s: list[float] = field(default_factory=list)
    mults: list[int] = field(default_factory=list)
    leaf_hooks: int = 0
    py_walk_ns: float = float("nan")
    wall_s: float = 0.0  # the whole row: oracle, rounds, memory


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def median_notch(xs: list[float]) -> float:
    """Half-width of the usual ~95 % interval of a median: 1.58 IQR / sqrt(n)."""
    q1, q3 = quartiles(xs)
    return 1.58 * (q3 - q1) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")


def quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (float("nan"), float("nan"))
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def summarize(row: Row) -> dict[str, Any]:
    """The row as the report and the JSON have it: graphscale's walk, and per
    implementation its times, ratios, peak memory and error."""
    walked = med([float(w) for w in row.walked])
    walk_us = med(row.walk_s) * 1e6
    out: dict[str, Any] = {
        "workload": row.workload,
        "size": row.size,
        "hidden": row.hidden,
        "layers": row.layers,
        "graph_nodes": row.nodes,
        "nodes_walked": walked,
        "walk_us": walk_us,
        "walk_ns_per_node": (walk_us * 1e3 / walked) if walked else None,
        "walk_ns_per_node_min": (min(s / n for s, n in zip(row.walk_s, row.walked) if n) * 1e9
                                 if any(row.walked) else None),
        "python_walker_ns_per_node": row.py_walk_ns,
        "multiplications": med([float(m) for m in row.mults]),
        "expected_multiplications": EXPECTED_MULTS[row.workload],
        "leaf_hooks": row.leaf_hooks,
        "row_wall_s": row.wall_s,
        "walked_per_round": row.walked,
        "walk_s_per_round": row.walk_s,
        "multiplications_per_round": row.mults,
        "impl": {name: summarize_impl(row, name) for name in IMPLS},
    }
    return out


def summarize_impl(row: Row, name: str) -> dict[str, Any]:
    r = row.ratios[name]
    q1, q3 = quartiles(r)
    return {
        "backward_ms_median": med(row.times[name]) * 1e3,
        "ratio_median": med(r),
        "ratio_min": min(r) if r else float("nan"),
        "ratio_max": max(r) if r else float("nan"),
        "ratio_q1": q1,
        "ratio_q3": q3,
        "peak_bytes_median": med([float(p) for p in row.peak[name]]),
        "max_rel_err": row.err[name],
        "times_s": row.times[name],
        "ratios": r,
    }
