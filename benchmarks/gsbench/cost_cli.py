"""The cost gate's command line: ``python benchmarks/cost.py [--check |
--update]``.  It runs the measuring processes (gsbench/counts.py: one
counting Python calls, one under callgrind counting instructions, per run),
prints what graphscale adds per backward beside the stored baseline, and
judges (gsbench/gate.py).

NOTE [ A still heap ]
The measuring processes run with a fixed environment: PYTHONHASHSEED=0, one
OpenMP thread, DeepSpeed's CPU accelerator, no inherited rank variables, and
glibc's malloc without fast bins, with fixed trim and mmap thresholds
(GLIBC_TUNABLES): with fast bins on, which backward pays to consolidate them
depends on the heap's layout, and the plain-torch chain's backward moved by
1 % between runs (0.13 % without them).  Both arms run under the same
settings, so what graphscale adds is measured as it would be without them.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

from . import gate
from .report import render

PROG = "benchmarks/cost.py"
SCRIPT = Path(__file__).resolve().parent.parent / "cost.py"
REPO = SCRIPT.parent.parent
STILL_HEAP = "glibc.malloc.mxfast=0:glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_threshold=33554432"
DROPPED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def parse_args(argv: list[str] | None, description: str | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=PROG, description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="fail (exit 1) where a case grew past the margin without a Cost-Change trailer")
    mode.add_argument("--update", action="store_true",
                      help=f"measure (2 runs unless --runs), write the baseline ({gate.BASELINE.name}) at this commit")
    ap.add_argument("--runs", type=int, default=None,
                    help="measuring runs (median over them, spread reported; default 1, --update 2)")
    ap.add_argument("--baseline", type=Path, default=gate.BASELINE, help="the baseline file (default %(default)s)")
    ap.add_argument("--calls-only", action="store_true",
                    help="count Python calls only (no valgrind; not with --update)")
    ap.add_argument("--cases", metavar="ID,...", type=lambda v: tuple(x for x in v.split(",") if x),
                    help="measure these cases only, not the rows (a quicker look while working; not with --update)")
    rows = ap.add_mutually_exclusive_group()
    rows.add_argument("--no-rows", action="store_true",
                      help="leave out the main job's counted rows (NOTE [ The rows in the gate ]; not with --update)")
    rows.add_argument("--rows-from", metavar="PATH",
                      help="the rows only, their counts read from PATH, the JSON of a "
                           "`benchmarks/overhead.py --quick --json PATH` run, instead of counted again")
    ap.add_argument("--json", metavar="PATH", help="write this run's figures to PATH")
    ap.add_argument("--raw", metavar="DIR", type=Path,
                    help="keep callgrind's files (one per counted backward) under DIR, for callgrind_annotate")
    ap.add_argument("--child", choices=["calls", "instructions"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.update and args.calls_only:
        ap.error("--update measures instructions too: drop --calls-only")
    if args.update and (args.cases or args.no_rows or args.rows_from):
        ap.error("--update measures every case and row: drop --cases, --no-rows and --rows-from")
    if args.calls_only and args.rows_from:
        ap.error("--rows-from reads instructions: drop --calls-only")
    if args.cases:
        from .counts import CASE_IDS

        unknown = [c for c in args.cases if c not in CASE_IDS]
        if unknown:
            ap.error(f"--cases: no case {', '.join(unknown)}; the cases are {', '.join(CASE_IDS)}")
    if args.runs is not None and args.runs < 1:
        ap.error("--runs must be at least 1")
    return args


# ----------------------------------------------------------------------------- the measuring processes
def child_env() -> dict[str, str]:
    """NOTE [ A still heap ]."""
    env = {k: v for k, v in os.environ.items() if k not in DROPPED}
    env.update(PYTHONHASHSEED="0", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               GLIBC_TUNABLES=STILL_HEAP)
    return env


def run_measuring(cmd: list[str], what: str) -> None:
    """Run a measuring process (NOTE [ A still heap ]); a RuntimeError with
    its last 40 lines of output if it fails."""
    run = subprocess.run(cmd, env=child_env(), cwd=REPO, capture_output=True, text=True)
    if run.returncode != 0:
        tail = "\n".join((run.stdout + run.stderr).splitlines()[-40:])
        raise RuntimeError(f"{what} failed (exit {run.returncode}):\n{tail}")


def run_child(kind: str, work: Path, only: tuple[str, ...] = ()) -> dict[str, Any]:
    """One measuring process (under callgrind for "instructions"); its JSON,
    and for instructions ``parts``: callgrind's count of each counted backward."""
    from . import region

    out = work / f"{kind}.json"
    cmd = [sys.executable, str(SCRIPT), "--child", kind, "--out", str(out)]
    if only:
        cmd += ["--cases", ",".join(only)]
    if kind == "instructions":
        cg_out = work / "callgrind.out"
        cmd = [*region.callgrind_command(cg_out, instrument_late=region.Region().can_instrument), *cmd]
    run_measuring(cmd, f"{PROG}: the {kind} run")
    with open(out) as f:
        result: dict[str, Any] = json.load(f)
    if kind == "instructions":
        parts = region.counted_parts(cg_out, len(result["regions"]), PROG)
        for case in result["cases"].values():
            case["instructions_without"], case["instructions_with"] = [], []
        for (case_id, arm), count in zip(result["regions"], parts):
            result["cases"][case_id][f"instructions_{arm}"].append(count)
    return result


def measure_rows(runs: int) -> dict[str, dict[str, Any]]:
    """The main job's --quick rows, counted ``runs`` times (NOTE [ The rows in
    the gate ] in gsbench/rowcounts.py): per row the combined figures."""
    from .rowcounts import count_gate_rows

    figures = []
    for n in range(runs):
        t = time.perf_counter()
        figures.append(count_gate_rows())
        print(f"{PROG}: rows run {n + 1}/{runs}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    return titled_rows(gate.combine(figures, "instructions"))


def titled_rows(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The rows' figures as the gate's cases (a title; no Python calls: the rows count instructions only)."""
    return {rid: {"title": f"the main job's row {rid[len(gate.ROW_PREFIX):].replace('-', ' ')} (--quick)",
                  "route": "", **fig} for rid, fig in rows.items()}


def measure(runs: int, calls_only: bool, raw: Path | None, only: tuple[str, ...] = ()) -> dict[str, Any]:
    """``runs`` runs of each kind; per case the combined figures
    (:func:`gate.combine`), nodes, route; and the wall time."""
    kinds = ("calls",) if calls_only else ("calls", "instructions")
    figures: dict[str, list[dict[str, dict[str, float]]]] = {k: [] for k in kinds}
    info: dict[str, Any] = {}
    t0 = time.perf_counter()
    for n in range(runs):
        for kind in kinds:
            t = time.perf_counter()
            work = Path(tempfile.mkdtemp(prefix=f"gs-cost-{kind}-"))
            try:
                result = run_child(kind, work, only)
                if raw is not None and kind == "instructions":
                    shutil.copytree(work, raw / f"run{n + 1}", dirs_exist_ok=True)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            # The calls run comes first: it builds or loads graphscale's native walker (waited for).
            info = {"walker": result["walker"], "cases": result["cases"]}
            metric = "calls" if kind == "calls" else "instructions"
            figures[kind].append(gate.run_figures(result["cases"], metric))
            print(f"{PROG}: {kind} run {n + 1}/{runs}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    cases: dict[str, dict[str, Any]] = {}
    from .counts import SPECS

    titles = {s.id: s.title for s in SPECS}
    for case_id, case in info["cases"].items():
        cases[case_id] = {"title": titles[case_id], "nodes": case["nodes"], "reps": case["reps"],
                          "route": case.get("route", "")}
    for kind in kinds:
        metric = "calls" if kind == "calls" else "instructions"
        for case_id, fig in gate.combine(figures[kind], metric).items():
            cases[case_id].update(fig)
    for case in cases.values():
        if "instructions" in case and "nodes" in case:
            case["instructions_per_node"] = case["instructions"] / case["nodes"]
    return {"walker": info["walker"], "runs": runs, "wall_s": time.perf_counter() - t0, "cases": cases}


# ----------------------------------------------------------------------------- what is recorded
def git_out(*args: str) -> str:
    try:
        run = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    except OSError:
        return ""
    return run.stdout.strip() if run.returncode == 0 else ""


def versions() -> dict[str, str]:
    """What the figures depend on, besides graphscale's code."""
    from . import region

    out = {"python": platform.python_version(), "valgrind": region.valgrind_version(),
           "glibc": "-".join(platform.libc_ver())}
    for module in ("torch", "deepspeed", "graphscale"):
        probe = subprocess.run([sys.executable, "-c", f"import {module}; print({module}.__version__)"],
                               env=child_env(), capture_output=True, text=True)
        out[module] = probe.stdout.strip().splitlines()[-1] if probe.returncode == 0 and probe.stdout else "absent"
    return out


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.machine()}, {model or platform.processor() or 'unknown CPU'}, {os.cpu_count()} cores"


def baseline_of(measured: Mapping[str, Any]) -> dict[str, Any]:
    commit = git_out("rev-parse", "HEAD")
    dirty = bool(git_out("status", "--porcelain", "--untracked-files=no"))
    keep = ("title", "nodes", "reps", "route", "instructions", "instructions_without", "instructions_per_node",
            "instructions_spread", "instructions_runs", "calls", "calls_without", "calls_spread")
    return {
        "about": ("What graphscale adds per backward, counted (instructions under callgrind, Python calls), "
                  f"at the commit below; {PROG} --check compares with it, {gate.UPDATE} rewrites it "
                  "(docs/benchmark.md, 'Deterministic counts')."),
        "commit": commit,
        "commit_subject": git_out("log", "-1", "--format=%s", commit) if commit else "",
        "dirty": dirty,
        "measured": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "versions": versions(),
        "machine": machine(),
        "walker": measured["walker"],
        "runs": measured["runs"],
        "cases": {cid: {k: case[k] for k in keep if k in case} for cid, case in measured["cases"].items()},
    }


# ----------------------------------------------------------------------------- what is printed
def _cells(case: Mapping[str, Any], base: Mapping[str, Any], metric: str) -> tuple[str, str, str]:
    """(now, baseline, ratio) of one metric; the large graph's instructions also per node."""
    if metric not in case:
        return "-", "-", "-"
    now = f"{case[metric]:,.0f}"
    if metric == "instructions" and case.get("nodes", 0) > 100:
        now += f" ({case['instructions_per_node']:,.0f}/node)"
    old = base.get(metric)
    return now, "-" if old is None else f"{old:,.0f}", "-" if not old else f"{case[metric] / old:.3f}"


def table(cases: Mapping[str, Mapping[str, Any]], base: Mapping[str, Mapping[str, Any]] | None) -> str:
    head = ["case", "what runs", "route", "instr/bwd alone", "gs adds instr/bwd", "spread", "baseline", "ratio",
            "gs adds py calls/bwd", "baseline", "ratio"]
    rows = []
    for cid, c in cases.items():
        b = (base or {}).get(cid, {})
        instr = _cells(c, b, "instructions")
        rows.append([cid, c["title"], c.get("route", ""),
                     f"{c['instructions_without']:,.0f}" if "instructions_without" in c else "-",
                     instr[0], f"{c['instructions_spread']:.2%}" if len(c.get("instructions_runs", ())) > 1 else "-",
                     instr[1], instr[2], *_cells(c, b, "calls")])
    return render(head, rows)


def version_notes(base: Mapping[str, Any]) -> list[str]:
    now = versions()
    return [f"note: the baseline was measured with {k} {base['versions'].get(k)}, this run has {v}: "
            f"figures may differ for that reason alone" for k, v in now.items()
            if k != "graphscale" and base.get("versions", {}).get(k) not in (None, v)]


def shown(path: Path) -> str:
    """``path`` relative to the repository where it is inside it."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None, description: str | None = None) -> int:
    args = parse_args(argv, description)
    if args.child:
        from .counts import child_main

        return child_main(args.child, args.out, args.cases or ())
    from . import region

    if not args.calls_only and region.valgrind() is None:
        print(f"{PROG}: valgrind is not installed (apt-get install valgrind), and the instruction counts need it; "
              "--calls-only counts Python calls alone", file=sys.stderr)
        return 2
    runs = args.runs or (2 if args.update else 1)
    t0_all = time.perf_counter()
    try:
        if args.rows_from:  # the rows only, as a main job counted them
            from .rowcounts import gate_rows_from

            measured: dict[str, Any] = {"walker": "-", "runs": 1,
                                        "cases": titled_rows(gate_rows_from(args.rows_from))}
        else:
            measured = measure(runs, args.calls_only, args.raw, args.cases or ())
            if not (args.calls_only or args.cases or args.no_rows):
                measured["cases"].update(measure_rows(runs))
        measured["wall_s"] = time.perf_counter() - t0_all
    except (RuntimeError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 2
    base = gate.load(args.baseline)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(measured, f, indent=1)
    print(f"\ngraphscale's cost per backward, counted ({runs} run(s), walker {measured['walker']}; "
          f"{measured['wall_s']:.0f} s):")
    print(table(measured["cases"], None if args.update or base is None else base["cases"]))
    if args.update:
        new = baseline_of(measured)
        gate.save(new, args.baseline)
        print(f"\nwrote {shown(args.baseline)} (at {new['commit'][:12]})")
        if new["dirty"]:
            print("note: the tree has uncommitted changes to tracked files: the baseline names a commit "
                  "that is not all of what was measured; commit first, then --update, for a baseline that is")
        return 0
    if base is None:
        print(f"\nno baseline at {shown(args.baseline)}: run {gate.UPDATE}")
        return 1 if args.check else 0
    for line in version_notes(base):
        print(line)
    explained, warning = gate.trailers(base["commit"], REPO)
    if warning:
        print(f"note: {warning}")
    metrics = ("calls",) if args.calls_only else tuple(gate.METRICS)
    findings = gate.compare(base["cases"], measured["cases"], explained, metrics)
    failures, notes = gate.messages(findings, base["commit"])
    explained_n = sum(f.verdict == "explained" for f in findings)
    for line in notes:
        print(line)
    for line in failures:
        print(line, file=sys.stderr)
    if failures and args.check:
        print(f"\n{PROG} --check: FAILED, {len(failures)} figure(s) grew past the margin", file=sys.stderr)
        return 1
    verdict = f"{len(failures)} figure(s) grew past the margin" if failures else "within the margin of the baseline"
    if explained_n:
        verdict += f" ({explained_n} figure(s) grew, each explained by a {gate.TRAILER} trailer)"
    print(f"\n{PROG}{' --check' if args.check else ''}: {verdict}")
    return 0
