"""The table's rows, counted: the instructions of one warm backward of every
row under each implementation, in a process under callgrind.

NOTE [ Counted rows ]
The timed ratio of a row swings by more than the 0.5-2 % its target allows
(the same code minutes apart reads 0.72x then 0.92x on the tiny cases, and a
row's min-max spans 0.6-1.8 on a shared 2-core machine).  What a backward
executes does not move with the machine's load: one process, run under
callgrind (the cost gate's counted region, NOTE [ The counted region ] in
gsbench/region.py, and its still heap, NOTE [ A still heap ] in
gsbench/cost_cli.py), builds the rows' engines as the timed table does
(gsbench/workloads.py, seed 0), and for each row and implementation runs
:data:`WARM` uncounted forward + backward pairs, then :data:`REPS` backwards
of fresh forwards, each backward alone inside the counted region (the forward
outside it).  A row's figure per implementation is the median over its
counted backwards; its counted ratio is graphscale's (or leaf-hooks') over
DeepSpeed alone's.  The verdicts of the main job are taken on these ratios
(gsbench/report.py); the timed ratios stay beside them, as what a clock
shows.

Instructions are not time: a cache miss or a page fault costs hundreds of
instructions' worth, and the counted ratio does not see them (the cache
simulation, ``--cache-sim=yes``, is a separate study: docs/benchmark.md).
"""
from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from .spec import DEFAULT_LAYERS, DEFAULT_SIZES, HF_SHAPES, HF_WORKLOADS, PROG, QUICK_COUNTED, Size

WARM = 2  # uncounted forward + backward pairs per row and implementation (the first install builds tables)
REPS = 3  # counted backwards per row and implementation; the median is the figure
QUICK = (1, 1)  # --quick: WARM, REPS (a row's counts repeat within ~0.1 %; every pair runs ~50x slower here)
SCRIPT = Path(__file__).resolve().parent.parent / "overhead.py"


def row_key(workload: str, hidden: int) -> str:
    """How a row is named in the counts: its label in the table ("W5 h32")."""
    return f"{workload} h{hidden}"


# ----------------------------------------------------------------------------- the process under callgrind
def _count_rows(wls: dict[str, Any], hidden: int, names: list[str], region: Any, regions: list[list[str]],
                warm: int, reps: int) -> None:
    """Every row of ``names`` over one family's engines: per implementation
    ``warm`` uncounted pairs, then ``reps`` counted backwards."""
    import torch

    from .impls import ALL
    from .workloads import zero_grads

    gen = torch.Generator().manual_seed(1234)
    for name in names:
        wl = wls[name]
        wl.checkpoint(True)
        for cls in ALL:
            impl = cls(wl)
            with impl.round():
                for _ in range(warm):
                    impl.backward(wl.loss(wl.batch(gen), False))
                for _ in range(reps):
                    loss = wl.loss(wl.batch(gen), False)
                    region.region(lambda loss=loss, impl=impl: impl.backward(loss))
                    del loss
                    regions.append([row_key(name, hidden), cls.name])
        wl.checkpoint(False)
        zero_grads(wl.engines)


def child_main(out_path: str, sizes: str, quick: bool, names: list[str], layers: int) -> int:
    """``overhead.py --count-child PATH ...``: every requested row, each
    implementation's counted backwards (NOTE [ Counted rows ]); writes which
    row and implementation each counted region was, in order.  Every
    family's engines are built before callgrind's instrumentation starts
    (DeepSpeed's set-up runs several times faster uninstrumented)."""
    import gc

    from . import env
    from .region import Region
    from .spec import make_sizes
    from .workloads import family_workloads

    if not env.setup("cpu", threads=1):
        return 2
    walker = env.wait_for_walker()
    region = Region()
    tower = [w for w in names if w not in HF_WORKLOADS]
    hf = [w for w in names if w in HF_WORKLOADS and env.have_transformers()]
    built = []
    for size in make_sizes(sizes, quick):
        if tower:
            built.append((family_workloads("tower", layers, size, "cpu"), size.hidden, tower))
        if hf:
            shape = HF_SHAPES[size.label]
            hf_size = Size(shape["width"], size.batch, size.seq, size.label)
            built.append((family_workloads("hf", shape["layers"], hf_size, "cpu"), hf_size.hidden, hf))
    regions: list[list[str]] = []
    gc.collect()
    gc.freeze()
    gc.disable()  # a collection inside one arm's counted backward and not the other's: ~100k instructions
    region.instrument()
    for wls, hidden, rows in built:
        _count_rows(wls, hidden, rows, region, regions, *(QUICK if quick else (WARM, REPS)))
    with open(out_path, "w") as f:
        json.dump({"walker": walker, "regions": regions}, f)
    return 0


# ----------------------------------------------------------------------------- the parent
def available() -> str | None:
    """None where rows can be counted here, else why not (what to install)."""
    from . import region

    if region.valgrind() is None:
        return "valgrind is not installed (apt-get install valgrind)"
    if region.compiler() is None:
        return "no C compiler (cc, gcc or clang) to build the counted region"
    return None


def count_rows(sizes: str, quick: bool, names: list[str], layers: int, cache_sim: bool = False,
               keep: Path | None = None) -> dict[str, dict[str, Any]]:
    """Row label -> per implementation ``{"instructions": [...], "median": n}``
    and ``ratio`` (its median over DeepSpeed alone's), from one process under
    callgrind (NOTE [ Counted rows ]).  ``cache_sim``: callgrind's cache
    simulation too, each counted backward's events (misses per level) in
    ``"events"``; ``keep``: callgrind's files and the regions' list are
    copied there (for callgrind_annotate)."""
    from . import region
    from .cost_cli import run_measuring

    with tempfile.TemporaryDirectory(prefix="gs-rows-") as tmp:
        work = Path(tmp)
        out, cg_out = work / "rows.json", work / "callgrind.out"
        cmd = [*region.callgrind_command(cg_out, instrument_late=region.Region().can_instrument,
                                         cache_sim=cache_sim),
               sys.executable, str(SCRIPT), "--count-child", str(out), "--sizes", sizes,
               "--workloads", ",".join(names), "--layers", str(layers), *(["--quick"] if quick else [])]
        run_measuring(cmd, f"{PROG}: the counted run")
        got = json.loads(out.read_text())
        parts = region.counted_parts(cg_out, len(got["regions"]), PROG)
        events = [region.read_events(p) for p in region.part_files(cg_out)] if cache_sim else None
        if keep is not None:
            shutil.copytree(work, keep, dirs_exist_ok=True)
    rows: dict[str, dict[str, Any]] = {}
    for k, ((label, impl), count) in enumerate(zip(got["regions"], parts)):
        figures = rows.setdefault(label, {}).setdefault(impl, {"instructions": []})
        figures["instructions"].append(count)
        if events is not None:
            figures.setdefault("events", []).append(events[k])
    for row in rows.values():
        for impl in row.values():
            impl["median"] = statistics.median(impl["instructions"])
        base = row["deepspeed"]["median"]
        for impl in row.values():
            impl["ratio"] = impl["median"] / base
    return rows


def try_count_rows(sizes: str, quick: bool, names: list[str], layers: int, cache_sim: bool = False,
                   keep: Path | None = None) -> tuple[dict[str, dict[str, Any]] | None, str | None]:
    """:func:`count_rows`, or why not: ``(rows, None)``, or ``(None, why)``
    where valgrind or a compiler is missing (what to install) or the counted
    run failed (its error, printed to stderr)."""
    why = available()
    if why is not None:
        return None, why
    try:
        return count_rows(sizes, quick, names, layers, cache_sim=cache_sim, keep=keep), None
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return None, "the counted run failed (above)"


def attach(summaries: list[dict[str, Any]], rows: dict[str, dict[str, Any]]) -> None:
    """Each summary gets its row's counts: ``summary["counted"][impl]``."""
    for s in summaries:
        counted = rows.get(row_key(s["workload"], s["hidden"]))
        if counted is not None:
            s["counted"] = counted


# ----------------------------------------------------------------------------- the cost gate's rows
# NOTE [ The rows in the gate ]
# benchmarks/cost.py holds the rows the main job's --quick run counts
# (:data:`QUICK_COUNTED` at the first default size, one backward each), beside
# its tiny cases, as cases ``row-W1-h32`` ...: what graphscale adds to DeepSpeed
# alone's counted backward, in instructions.  --update and a plain --check count
# them (one more process under callgrind, 2-4 minutes here); --rows-from reads
# them from the JSON of an ``overhead.py --quick --json`` run instead, so that CI
# does not count the same backwards twice.
# Their margin: the tiny cases' 3 % of the addition, and a slack of
# gate.ROW_SLACK_OF_ALONE (0.8 %) of DeepSpeed alone's counted backward, not a
# fixed number.  Three runs of the same code (ed80663, 2026-12-07, one process
# each, a second job on the machine) read the addition as W1 172k / 191k /
# 209k on a 30.5M backward, W2 602k / 666k / 699k on 61.0M, W5 -663k / -585k /
# -320k on 92.2-92.4M and HF1 178k / 172k / 169k on 15.0M: ranges of 0.12 %,
# 0.16 %, 0.37 % and 0.06 % of DeepSpeed alone's backward.  The two runs of
# the baseline's --update (7999c98, the collector off in the counting
# process) read W1 157k / 124k, W2 655k / 650k, W5 -936k / -494k and HF1
# 184k / 168k: W5's range is 0.48 %.  The noise grows with the backward (its
# memory layout moves the interpreter's and malloc's work, as in NOTE [ The
# cost margin ] in gate.py; W5's 24 nested backwards each run a recompute and,
# under DeepSpeed alone, torch's Python backward()), and with one backward per
# implementation nothing averages it out; 0.8 % is 1.7 times the widest range
# seen (W5's).  So the rows' gate catches what is large beside a backward, not
# what is large beside graphscale's addition (W1's slack, 244k, is more than
# its addition): the functorch state left on the thread cost W1 3.5 %
# (fd219ef), a walk twice as costly would add 1 % to W2; the tiny cases and
# the 2000-op walk above gate graphscale's own cost finely.  A baseline below
# zero (W5: graphscale's backward runs fewer instructions than DeepSpeed
# alone's, docs/benchmark.md "Counted rows") widens by 3 % of its size as a
# positive one does.
def gate_row_id(label: str) -> str:
    """The cost gate's case of a counted row ("W1 h32" -> "row-W1-h32")."""
    return "row-" + label.replace(" ", "-")


def gate_figures(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per row, the gate's figures: ``instructions`` graphscale adds to
    DeepSpeed alone's counted backward, ``instructions_without`` (DeepSpeed
    alone's)."""
    out = {}
    for label, impls in rows.items():
        alone = float(impls["deepspeed"]["median"])
        out[gate_row_id(label)] = {"instructions": float(impls["graphscale"]["median"]) - alone,
                                   "instructions_without": alone}
    return out


def counted_setting(quick: bool, sizes: str, layers: int) -> dict[str, Any]:
    """How a run counts its rows (its JSON's ``meta.counted_setting``):
    ``--quick`` counts :data:`QUICK_COUNTED` at its first size, a default run
    every row at every size."""
    return {"quick": quick, "sizes": sizes.split(",")[0] if quick else sizes, "layers": layers}


GATE_SETTING = counted_setting(True, DEFAULT_SIZES, DEFAULT_LAYERS)  # the gate's rows: the main job's --quick ones


def count_gate_rows() -> dict[str, dict[str, float]]:
    """Count the gate's rows as the main job's --quick run does."""
    return gate_figures(count_rows(GATE_SETTING["sizes"], True, list(QUICK_COUNTED), GATE_SETTING["layers"]))


def gate_rows_from(path: str) -> dict[str, dict[str, float]]:
    """The gate's rows from an ``overhead.py --quick --json PATH`` run; a
    ValueError that says what to run where the file holds no such counts."""
    with open(path) as f:
        data = json.load(f)
    setting = data.get("meta", {}).get("counted_setting")
    if setting != GATE_SETTING:
        raise ValueError(f"{path}: its rows were not counted as the gate's are (counted: {setting}; the gate's: "
                         f"{GATE_SETTING}): run python benchmarks/overhead.py --quick --json {path} with the "
                         "default --sizes and --layers, valgrind installed")
    rows = {f"{s['workload']} h{s['hidden']}": s["counted"] for s in data.get("rows", []) if "counted" in s}
    missing = [w for w in QUICK_COUNTED if not any(label.split()[0] == w for label in rows)]
    if missing:
        raise ValueError(f"{path}: no counts of {', '.join(missing)} (was the run given --workloads?): run "
                         f"python benchmarks/overhead.py --quick --json {path}")
    return gate_figures(rows)
