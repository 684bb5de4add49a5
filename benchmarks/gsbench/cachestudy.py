"""``python benchmarks/overhead.py --cache-study``: the counted rows under
callgrind's cache simulation (``--cache-sim=yes``: the first-level
instruction and data caches and the last level, as valgrind reads this CPU's).
A cache miss costs tens to hundreds of instructions' worth of time and the
counted rows (NOTE [ Counted rows ] in gsbench/rowcounts.py) do not see it:
per row and implementation, the instructions, the misses per level, and
callgrind's cycle estimate, each over DeepSpeed alone's.  The figures and
what they say: docs/benchmark.md, "Cache misses"."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from .report import render
from .spec import IMPLS, PROG

L1_MISSES = ("I1mr", "D1mr", "D1mw")
LL_MISSES = ("ILmr", "DLmr", "DLmw")


def cycles(events: dict[str, float]) -> float:
    """callgrind's cycle estimate without branch simulation: Ir + 10 x
    first-level misses + 100 x last-level misses."""
    return (events.get("Ir", 0) + 10 * sum(events.get(e, 0) for e in L1_MISSES)
            + 100 * sum(events.get(e, 0) for e in LL_MISSES))


def figures(events: list[dict[str, int]]) -> dict[str, float]:
    """One implementation's medians over its counted backwards: instructions,
    first- and last-level misses, the cycle estimate."""
    def med(f: Any) -> float:
        return float(statistics.median(f(e) for e in events))

    return {"Ir": med(lambda e: e["Ir"]), "L1 misses": med(lambda e: sum(e.get(k, 0) for k in L1_MISSES)),
            "LL misses": med(lambda e: sum(e.get(k, 0) for k in LL_MISSES)), "cycles est.": med(cycles)}


def table(rows: dict[str, dict[str, Any]]) -> str:
    head = ["row", "impl", "Ir", "L1 misses", "LL misses", "cycles est.", "Ir ratio", "L1 ratio", "LL ratio",
            "cycles ratio"]
    out = []
    for label, impls in rows.items():
        base = figures(impls["deepspeed"]["events"])
        for impl in IMPLS:
            if impl not in impls:
                continue
            f = figures(impls[impl]["events"])
            out.append([label if impl == IMPLS[0] else "", impl, f"{f['Ir']:,.0f}", f"{f['L1 misses']:,.0f}",
                        f"{f['LL misses']:,.0f}", f"{f['cycles est.']:,.0f}",
                        *(f"{f[k] / base[k]:.4f}" if base[k] else "-"
                          for k in ("Ir", "L1 misses", "LL misses", "cycles est."))])
    return render(head, out)


def run(names: list[str], sizes: str, quick: bool, layers: int, keep: Path | None) -> int:
    """``overhead.py --cache-study``: the rows ``names`` at ``sizes``, counted
    as the main job counts them (``quick``: one backward per implementation),
    under the cache simulation; the table printed."""
    from . import rowcounts

    rows, why = rowcounts.try_count_rows(sizes, quick, names, layers, cache_sim=True, keep=keep)
    if rows is None:
        print(f"{PROG} --cache-study: {why}")
        return 2
    print(f"{PROG} --cache-study: one process under callgrind --cache-sim=yes, the rows as the main job counts "
          f"them ({'--quick' if quick else 'default'} shapes); medians per implementation")
    print(table(rows))
    if keep is not None:
        print(f"callgrind's files: {keep} (rows.json lists each file's row and implementation, in order)")
    return 0
