"""The cost gate's judgement: the figures a run gives, the baseline stored in
the repository (``benchmarks/cost_baseline.json``), the margin, and the
commit-message trailers that explain a growth.  No torch, no valgrind here:
plain data in, findings out (tests/project/test_cost_gate.py).

NOTE [ The cost margin ]
A case fails when what graphscale adds per backward, in instructions or in
Python calls, exceeds ``baseline + |baseline| x RELATIVE + slack``: RELATIVE 3 %,
slack 20 000 instructions or 2 calls.  Python calls repeat exactly from run
to run.  Instructions do not, quite: over eleven runs of the same graphscale
(the benchmark's own code edited between some, the heap shifted on purpose
before anything was imported in four) a tiny case's addition moved by up to
7.8 % (nested: 208-224 thousand), the large walk's by 1.5 %.  That noise is
absolute, not relative: it is the ~1 million instructions of DeepSpeed's own
backward moving by 0.5-1 % with the process's memory layout (CPython's
attribute cache picks its slots by the names' addresses; malloc's searches),
which is as large beside an addition of 160 thousand as beside one of 3
million.  So the slack carries it: a tiny case may move by 24-27 thousand,
1.6 times the widest range seen (16 thousand; 15 000 would have left 1.3
times, too little for eleven runs' worth of knowledge of the tails); the
3 % is the large walk's, 2.5 times its range.  The regressions the gate is
for are larger: between a049ee1 and 036ca8d (issue 40) the tiny cases'
fixed cost grew by 40-150 %; a tiny case must grow by 13-19 % to fail.  A
case that shrinks past the same margin passes with a note to run
``--update``.

NOTE [ Explaining a growth ]
A growth that is meant (a feature that costs) is said in the commit that
makes it: a trailer ``Cost-Change: <case>: <why>`` (``all`` for every case)
in the message of any commit after the baseline's (``git log
<baseline>..HEAD``, git's own trailer parsing: the last paragraph's
``Key: value`` lines).  The gate then passes that case and prints the
reason; the next ``--update`` makes the new figure the baseline, and the
trailer stops mattering (its commit is no longer after the baseline's).
"""
from __future__ import annotations

import json
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

RELATIVE = 0.03
SLACK = {"instructions": 20000.0, "calls": 2.0}
ROW_PREFIX = "row-"  # the main job's counted rows (NOTE [ The rows in the gate ] in gsbench/rowcounts.py)
ROW_SLACK_OF_ALONE = 0.008  # a row's slack: this much of DeepSpeed alone's counted backward (the same NOTE)
METRICS = {"instructions": "instructions added per backward", "calls": "Python calls added per backward"}
TRAILER = "Cost-Change"
ALL_CASES = "all"
BASELINE = Path(__file__).resolve().parent.parent / "cost_baseline.json"
UPDATE = "python benchmarks/cost.py --update"


# ----------------------------------------------------------------------------- figures
def _med(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def run_figures(raw: Mapping[str, Any], metric: str) -> dict[str, dict[str, float]]:
    """One run's figures per case: ``{metric}`` added per backward (the
    with-arm's median minus the without-arm's) and ``{metric}_without``.
    ``raw[case]`` holds ``{metric}_without`` and ``{metric}_with``, per counted
    backward (NOTE [ Deterministic cost ] in gsbench/counts.py)."""
    out = {}
    for case, arms in raw.items():
        without, with_ = _med(arms[f"{metric}_without"]), _med(arms[f"{metric}_with"])
        out[case] = {metric: with_ - without, f"{metric}_without": without}
    return out


def combine(runs: Sequence[Mapping[str, Mapping[str, float]]], metric: str) -> dict[str, dict[str, Any]]:
    """Several runs' figures: per case the median over runs, and
    ``{metric}_spread``: (max - min) / |median| of the added figure."""
    out = {}
    for case in runs[0]:
        added = [r[case][metric] for r in runs]
        mid = _med(added)
        out[case] = {metric: mid, f"{metric}_without": _med([r[case][f"{metric}_without"] for r in runs]),
                     f"{metric}_spread": (max(added) - min(added)) / abs(mid) if mid else 0.0,
                     f"{metric}_runs": added}
    return out


# ----------------------------------------------------------------------------- the baseline
def load(path: Path = BASELINE) -> dict[str, Any] | None:
    """The stored baseline, or None where there is none yet."""
    if not path.exists():
        return None
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return data


def save(baseline: Mapping[str, Any], path: Path = BASELINE) -> None:
    with open(path, "w") as f:
        json.dump(baseline, f, indent=1, sort_keys=False)
        f.write("\n")


# ----------------------------------------------------------------------------- trailers
def trailers(since: str, repo: Path) -> tuple[dict[str, list[str]], str | None]:
    """``Cost-Change`` trailers on the commits after ``since`` up to HEAD:
    case -> ["<short sha>: <why>", ...] (NOTE [ Explaining a growth ]), and
    a warning where they cannot be read (``since`` not in this clone's
    history, no git), else None."""
    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)

    try:
        known = git("cat-file", "-e", f"{since}^{{commit}}")
    except OSError:
        return {}, "git is not available: Cost-Change trailers were not read"
    if known.returncode != 0:
        return {}, (f"the baseline's commit {since[:12]} is not in this clone's history (a shallow clone?): "
                    f"Cost-Change trailers were not read")
    log = git("log", f"--format=%h%x1f%(trailers:key={TRAILER},valueonly,separator=%x1d)%x1e", f"{since}..HEAD")
    if log.returncode != 0:
        return {}, f"git log {since[:12]}..HEAD failed: {log.stderr.strip()}"
    return parse_trailers(log.stdout), None


def parse_trailers(log: str) -> dict[str, list[str]]:
    """What :func:`trailers` reads from ``git log``'s output (records ended by
    0x1e: a short sha, 0x1f, the trailers' values separated by 0x1d)."""
    found: dict[str, list[str]] = {}
    for record in log.split("\x1e"):
        if "\x1f" not in record:
            continue
        sha, values = record.strip("\n").split("\x1f", 1)
        for value in values.split("\x1d"):
            case, sep, why = value.strip().partition(":")
            if sep and case.strip() and why.strip():
                found.setdefault(case.strip(), []).append(f"{sha.strip()}: {why.strip()}")
    return found


# ----------------------------------------------------------------------------- the comparison
@dataclass(frozen=True)
class Finding:
    """One case and metric against the baseline.  ``verdict``: "ok" (within
    the margin), "grew" (past it, unexplained: the gate fails), "explained"
    (past it, a trailer says why), "shrank" (below it: --update), "new" (no
    baseline figure)."""

    case: str
    metric: str
    base: float | None
    now: float
    verdict: str
    why: tuple[str, ...] = ()
    alone: float | None = None  # the baseline's figure without graphscale (a row's slack is relative to it)

    @property
    def ratio(self) -> float | None:
        return self.now / self.base if self.base else None


def slack(metric: str, case: str = "", alone: float | None = None) -> float:
    """The absolute part of the margin: a row's instructions have their own,
    :data:`ROW_SLACK_OF_ALONE` of ``alone`` (DeepSpeed alone's counted
    backward in the baseline; NOTE [ The rows in the gate ] in
    gsbench/rowcounts.py), every other figure :data:`SLACK`'s."""
    if metric == "instructions" and case.startswith(ROW_PREFIX) and alone:
        return ROW_SLACK_OF_ALONE * abs(alone)
    return SLACK[metric]


def limit(base: float, metric: str, case: str = "", alone: float | None = None) -> float:
    """The most ``base`` may grow to (NOTE [ The cost margin ]; the relative
    part of a negative baseline, a row graphscale makes cheaper than
    DeepSpeed alone, widens the margin as a positive one does)."""
    return base + abs(base) * RELATIVE + slack(metric, case, alone)


def floor(base: float, metric: str, case: str = "", alone: float | None = None) -> float:
    """Below this, ``base`` shrank (NOTE [ The cost margin ])."""
    return base - abs(base) * RELATIVE - slack(metric, case, alone)


def compare(base_cases: Mapping[str, Mapping[str, Any]], now_cases: Mapping[str, Mapping[str, Any]],
            explained: Mapping[str, Sequence[str]], metrics: Iterable[str] = tuple(METRICS)) -> list[Finding]:
    """Every case and metric measured now against the baseline's."""
    out = []
    for case, now in now_cases.items():
        for metric in metrics:
            if metric not in now:
                continue
            base = base_cases.get(case, {}).get(metric)
            alone = base_cases.get(case, {}).get(f"{metric}_without")
            value = float(now[metric])
            if base is None:
                out.append(Finding(case, metric, None, value, "new"))
            elif value > limit(base, metric, case, alone):
                why = tuple(explained.get(case, ())) + tuple(explained.get(ALL_CASES, ()))
                out.append(Finding(case, metric, base, value, "explained" if why else "grew", why, alone))
            elif value < floor(base, metric, case, alone):
                out.append(Finding(case, metric, base, value, "shrank", (), alone))
            else:
                out.append(Finding(case, metric, base, value, "ok", (), alone))
    return out


def margin_text(metric: str, case: str = "", alone: float | None = None) -> str:
    return f"{RELATIVE:.0%} + {slack(metric, case, alone):,.0f}"


def _times(f: Finding) -> str:
    """The ratio now / baseline as text ("from 0" where the baseline is 0)."""
    return "from 0" if f.ratio is None else f"{f.ratio:.3f}x"


def messages(findings: Sequence[Finding], since: str) -> tuple[list[str], list[str]]:
    """(failures, notes): one line each, naming the case, the baseline, the
    figure now and the ratio."""
    failures, notes = [], []
    for f in findings:
        what = f"{f.case}: {METRICS[f.metric]}"
        if f.verdict == "grew":
            failures.append(
                f"benchmarks/cost.py: {what} grew past the margin: baseline {f.base:,.0f} (at {since[:12]}), "
                f"now {f.now:,.0f}, {_times(f)} (margin {margin_text(f.metric, f.case, f.alone)}).  If it is meant, "
                f"say why in a trailer '{TRAILER}: {f.case}: <why>' on a commit after {since[:12]} and run {UPDATE}; "
                f"else find what it added (--raw keeps callgrind's files for callgrind_annotate)")
        elif f.verdict == "explained":
            notes.append(f"note: {what} grew, {f.base:,.0f} -> {f.now:,.0f} ({_times(f)}), explained by "
                         + "; ".join(f.why) + f": run {UPDATE} to make it the baseline")
        elif f.verdict == "shrank":
            notes.append(f"note: {what} shrank, {f.base:,.0f} -> {f.now:,.0f} ({_times(f)}): "
                         f"run {UPDATE} to make it the baseline")
        elif f.verdict == "new":
            notes.append(f"note: {what}: no baseline figure (a new case): run {UPDATE}")
    return failures, notes
