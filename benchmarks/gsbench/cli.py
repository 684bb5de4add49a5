"""The command line: ``python benchmarks/overhead.py [options]``."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from .spec import DEFAULT_LAYERS, DEFAULT_SIZES, PROG, QUICK_COUNTED, WORKLOADS, make_sizes

DEFAULT_PLOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "overhead.png")


def parse_args(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=os.path.basename(PROG), description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few repetitions, small sizes: under 3 minutes on 2 cores")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the engines run (default cpu)")
    ap.add_argument("--reps", type=int, default=None,
                    help="timed interleaved rounds per row (default 61, half that compute-bound; quick 7)")
    ap.add_argument("--layers", type=int, default=DEFAULT_LAYERS,
                    help="transformer blocks per engine in W1-W6 (default %(default)s)")
    ap.add_argument("--sizes", default=DEFAULT_SIZES,
                    help="hidden sizes of W1-W6, comma separated (default %(default)s); below 128 is launch-bound, "
                    "and HF rows follow the labels (launch: GPT-2 2 layers x 64, compute: 6 layers x 256)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="which workloads (default all)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: steadier on a shared machine)")
    ap.add_argument("--no-fixed-costs", action="store_true",
                    help="skip the sections after the table (per-backward breakdown, install() cost)")
    ap.add_argument("--json", metavar="PATH", help="write every number to PATH as JSON")
    ap.add_argument("--plot", metavar="PATH", default=None,
                    help="PNG bar chart of the overhead ratios (default benchmarks/overhead.png)")
    ap.add_argument("--no-plot", action="store_true", help="skip the plot")
    ap.add_argument("--no-count", action="store_true",
                    help="skip counting the rows' instructions under callgrind (verdicts then on the timed ratios)")
    ap.add_argument("--cache-study", action="store_true",
                    help="instead of the table: the rows counted under callgrind's cache simulation, misses per "
                         "level and a cycle estimate per implementation (with --quick: the rows --quick counts)")
    ap.add_argument("--keep", metavar="DIR", help="with --cache-study: keep callgrind's files in DIR")
    ap.add_argument("--count-child", metavar="PATH", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.keep and not args.cache_study:
        ap.error("--keep keeps the cache study's files: add --cache-study")
    return args


def workload_names(spec: str) -> list[str] | None:
    """``--workloads`` as a list; None (after a message) when it names one that does not exist."""
    names = [w.strip() for w in spec.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        print(f"{PROG}: unknown workloads {unknown}; choose from {list(WORKLOADS)}", file=sys.stderr)
        return None
    return names


def title_of(meta: dict[str, Any], layers: int) -> str:
    return (f"graphscale overhead: {meta['device']}\ntorch {meta['torch']}, deepspeed {meta['deepspeed']}"
            + (f", transformers {meta['transformers']}" if "transformers" in meta else "")
            + f", {layers} blocks/engine (W1-W6), ZeRO 1, walker {meta['walker']}")


def print_table(title: str, summaries: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    from . import report

    print()
    print(title)
    print(report.table(summaries))
    print()
    print(meta["counted"])
    for line in report.targets(summaries):
        print(line)
    if "hf_checkpoint_use_reentrant" in meta:
        print(f"HF2: transformers' gradient checkpointing with its default arguments: "
              f"use_reentrant={meta['hf_checkpoint_use_reentrant']}")


def counted_rows(args: argparse.Namespace, wl_names: list[str]) -> tuple[list[str], dict[str, Any]]:
    """The rows counted and how (gsbench/rowcounts.py counted_setting): every
    row, or --quick's (:data:`QUICK_COUNTED` at the first size)."""
    from .rowcounts import counted_setting

    names = [w for w in wl_names if not args.quick or w in QUICK_COUNTED]
    return names, counted_setting(args.quick, args.sizes, args.layers)


def run_counts(args: argparse.Namespace, wl_names: list[str], summaries: list[dict[str, Any]],
               meta: dict[str, Any]) -> str:
    """Count the rows' instructions under callgrind (NOTE [ Counted rows ] in
    gsbench/rowcounts.py) into ``summaries`` (and how, into ``meta``); what
    was counted, or why not."""
    from . import rowcounts

    if args.no_count:
        return "rows not counted (--no-count): verdicts on the timed ratios"
    if args.device != "cpu":
        return f"rows not counted on {args.device} (callgrind counts CPU instructions): verdicts on the timed ratios"
    names, setting = counted_rows(args, wl_names)
    t0 = time.perf_counter()
    rows, why = rowcounts.try_count_rows(setting["sizes"], args.quick, names, args.layers)
    if rows is None:
        return f"rows not counted: {why}; verdicts on the timed ratios"
    rowcounts.attach(summaries, rows)
    meta["counted_setting"] = setting  # (the gate's rows)
    reps = rowcounts.QUICK[1] if args.quick else rowcounts.REPS
    return (f"counted: {len(rows)} row(s), instructions of one warm backward under callgrind, median of "
            f"{reps} per implementation ({time.perf_counter() - t0:.0f} s); the verdicts below are "
            "taken on the counted ratios, the timed ones are what a clock shows")


def run_fixed_costs(sizes: list[Any], quick: bool, device: str) -> dict[str, Any]:
    """The sections after the table, measured and printed."""
    from . import fixed, report

    t0 = time.perf_counter()
    out = fixed.fixed_costs(sizes, quick, device)
    out["wall_s"] = time.perf_counter() - t0
    print("\ngraphscale's fixed cost per walked backward (median over "
          f"{out['breakdown'][0]['rounds']} interleaved rounds; {out['breakdown'][0]['source']}):")
    print(report.breakdown_table(out))
    for line in report.breakdown_targets(out):
        print(line)
    if out.get("tiny"):
        rounds = next(iter(out["tiny"].values()))["rounds"]
        print(f"\ngraphscale's fixed cost per governed backward, walk negligible (median over {rounds} "
              "interleaved rounds of blocks with and without it):")
        print(report.tiny_table(out))
    print(f"\ninstall({out['install_engines']}) + remove(), median ms:")
    print(report.install_table(out))
    return out


def write_outputs(args: argparse.Namespace, meta: dict[str, Any], summaries: list[dict[str, Any]],
                  fixed: dict[str, Any] | None, title: str) -> None:
    """--json and the plot."""
    from . import report

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": summaries, "targets": report.targets(summaries), "fixed_costs": fixed},
                      f, indent=1)
        print(f"wrote {args.json}")
    if not args.no_plot:
        from .plot import plot

        path = args.plot or DEFAULT_PLOT
        plot(summaries, path, title)
        print(f"wrote {path}")


def main(argv: list[str] | None = None, description: str | None = None) -> int:
    args = parse_args(argv, description)
    if args.count_child:
        from .rowcounts import child_main

        names = workload_names(args.workloads)
        return 2 if names is None else child_main(args.count_child, args.sizes, args.quick, names, args.layers)
    t_start = time.perf_counter()
    # Imported here, not at the top: --help answers without importing torch, and
    # nothing imports deepspeed before env.setup has checked its accelerator.
    from . import env, timing

    if not env.setup(args.device, args.threads):
        return 2
    wl_names = workload_names(args.workloads)
    if wl_names is None:
        return 2
    if args.cache_study:
        from pathlib import Path

        from .cachestudy import run

        rows, setting = counted_rows(args, wl_names)
        return run(rows, setting["sizes"], args.quick, args.layers, Path(args.keep) if args.keep else None)
    t0 = time.perf_counter()
    walker = env.wait_for_walker()  # a background build on a fresh machine: wait for it before timing
    build_s = time.perf_counter() - t0

    sizes = make_sizes(args.sizes, args.quick)
    reps = args.reps if args.reps is not None else (7 if args.quick else 61)
    meta = env.run_meta(args.device, args.threads, walker, build_s, sizes, reps, args.layers)
    summaries = timing.run_table(sizes, wl_names, reps, args.layers, args.device, meta)
    table_s = time.perf_counter() - t_start
    meta["counted"] = run_counts(args, wl_names, summaries, meta)

    title = title_of(meta, args.layers)
    print_table(title, summaries, meta)
    fixed = None if args.no_fixed_costs else run_fixed_costs(sizes, args.quick, args.device)
    meta["wall_s"] = time.perf_counter() - t_start
    meta["table_wall_s"] = table_s
    print(f"\nwall time {meta['wall_s']:.0f} s (table {table_s:.0f} s); walker {walker} "
          f"(built/loaded in {build_s:.1f} s); peak memory: {meta['memory_measure']}")
    write_outputs(args, meta, summaries, fixed, title)
    return 0
