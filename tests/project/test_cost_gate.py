"""The cost gate's logic (benchmarks/cost.py, gsbench/gate.py and
gsbench/region.py): growth past the margin fails naming the case, a
Cost-Change trailer explains it, shrinking only notes, and callgrind's
output is read from a real file.  Nothing here is timed; the one test that
runs valgrind skips cleanly without it or without a C compiler."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers.paths import REPO

BENCH = REPO / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from gsbench import cost_cli, gate, region  # noqa: E402

BASE = {"nested": {"instructions": 200_000.0, "calls": 130.0},
        "walk-chain": {"instructions": 1_500_000.0, "calls": 42.0}}


def now_of(**cases: tuple[float, float]) -> dict[str, dict[str, float]]:
    return {case: {"instructions": i, "calls": c} for case, (i, c) in cases.items()}


def verdicts(findings: list[gate.Finding]) -> dict[tuple[str, str], str]:
    return {(f.case, f.metric): f.verdict for f in findings}


@pytest.mark.parametrize("instructions, calls, want", [
    pytest.param(200_000.0, 130.0, "ok", id="unchanged"),
    pytest.param(gate.limit(200_000.0, "instructions"), 130.0, "ok", id="at the limit"),
    pytest.param(gate.limit(200_000.0, "instructions") + 1, 130.0, "grew", id="one instruction past it"),
    pytest.param(400_000.0, 130.0, "grew", id="doubled"),
    pytest.param(150_000.0, 130.0, "shrank", id="shrank"),
], )
def test_instructions_past_the_margin_fail_and_shrinking_only_notes(instructions: float, calls: float,
                                                                    want: str) -> None:
    got = verdicts(gate.compare(BASE, now_of(nested=(instructions, calls)), {}))
    assert got == {("nested", "instructions"): want, ("nested", "calls"): "ok"}


def test_python_calls_have_their_own_margin() -> None:
    got = verdicts(gate.compare(BASE, now_of(nested=(200_000.0, 130.0 * 1.03 + 2)), {}))
    assert got[("nested", "calls")] == "ok"
    got = verdicts(gate.compare(BASE, now_of(nested=(200_000.0, 130.0 * 1.03 + 3)), {}))
    assert got[("nested", "calls")] == "grew"


def test_the_margin_is_relative_plus_a_slack() -> None:
    assert gate.limit(100_000.0, "instructions") == pytest.approx(100_000 * (1 + gate.RELATIVE) + gate.SLACK[
        "instructions"])
    assert gate.floor(100_000.0, "calls") == pytest.approx(100_000 * (1 - gate.RELATIVE) - gate.SLACK["calls"])


@pytest.mark.parametrize("explained, want", [
    pytest.param({}, "grew", id="no trailer"),
    pytest.param({"nested": ["abc1234: a check per nested plan"]}, "explained", id="this case"),
    pytest.param({"all": ["abc1234: every backward reads the clock"]}, "explained", id="all"),
    pytest.param({"walk-chain": ["abc1234: another case"]}, "grew", id="another case"),
])
def test_a_trailer_naming_the_case_explains_a_growth(explained: dict[str, list[str]], want: str) -> None:
    got = gate.compare(BASE, now_of(nested=(300_000.0, 130.0)), explained)
    assert verdicts(got)[("nested", "instructions")] == want
    failures, notes = gate.messages(got, "0123456789abcdef")
    assert bool(failures) is (want == "grew")
    if want == "explained":
        assert any("a check" in n or "clock" in n for n in notes)


def test_a_failure_names_the_case_the_baseline_the_figure_now_and_the_ratio() -> None:
    failures, notes = gate.messages(gate.compare(BASE, now_of(nested=(300_000.0, 130.0)), {}), "0123456789abcdef")
    assert len(failures) == 1 and not notes
    line = failures[0]
    for part in ("nested", "instructions added per backward", "200,000", "300,000", "1.500x", "0123456789ab",
                 "Cost-Change: nested:", "--update"):
        assert part in line, (part, line)


def test_a_growth_from_a_baseline_of_zero_fails_with_a_message() -> None:
    """A figure may be 0 (the large walk's Python calls once graphscale's
    matched torch's own): a growth from it fails, and the line says so."""
    base = {"walk": {"instructions": 1_000_000.0, "calls": 0.0}}
    failures, _ = gate.messages(gate.compare(base, now_of(walk=(1_000_000.0, 28.0)), {}), "0123456789abcdef")
    assert len(failures) == 1 and "from 0" in failures[0] and "Python calls" in failures[0], failures


def test_shrinking_and_new_cases_note_the_update() -> None:
    findings = gate.compare(BASE, now_of(nested=(100_000.0, 130.0), fresh=(5.0, 1.0)), {})
    assert verdicts(findings)[("fresh", "instructions")] == "new"
    failures, notes = gate.messages(findings, "0123456789abcdef")
    assert not failures
    assert any("nested" in n and "shrank" in n and "--update" in n for n in notes)
    assert any("fresh" in n and "--update" in n for n in notes)


def test_trailers_are_parsed_from_git_log() -> None:
    log = ("abc1234\x1fnested: a check per nested plan\x1dall: the clock\x1e\n"
           "def5678\x1f\x1e\n"
           "0a1b2c3\x1fnot a trailer value\x1dwalk-chain:  the walk keeps a seen set \x1e\n")
    assert gate.parse_trailers(log) == {
        "nested": ["abc1234: a check per nested plan"], "all": ["abc1234: the clock"],
        "walk-chain": ["0a1b2c3: the walk keeps a seen set"]}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def test_trailers_are_read_from_the_commits_after_the_baseline(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    for key, value in (("user.name", "t"), ("user.email", "t@example.invalid"), ("commit.gpgsign", "false")):
        _git(tmp_path, "config", key, value)
    _git(tmp_path, "commit", "-q", "--allow-empty", "-m", "before\n\nCost-Change: nested: too old to count")
    base = _git(tmp_path, "rev-parse", "HEAD")
    _git(tmp_path, "commit", "-q", "--allow-empty", "-m",
         "nested plans checked\n\nWhy it costs.\n\nCost-Change: nested: one check per nested plan")
    _git(tmp_path, "commit", "-q", "--allow-empty", "-m",
         "body mentions Cost-Change: walk-chain: in the middle\n\nof a paragraph, not a trailer\n\nmore text")
    found, warning = gate.trailers(base, tmp_path)
    assert warning is None
    assert list(found) == ["nested"] and found["nested"][0].endswith(": one check per nested plan")
    found, warning = gate.trailers("0" * 40, tmp_path)
    assert found == {} and warning is not None and "not in this clone's history" in warning


def test_figures_are_medians_and_the_spread_is_over_runs() -> None:
    raw = {"nested": {"instructions_without": [100, 101, 500], "instructions_with": [150, 152, 151]}}
    figures = gate.run_figures(raw, "instructions")
    assert figures == {"nested": {"instructions": 50.0, "instructions_without": 101.0}}
    combined = gate.combine([figures, {"nested": {"instructions": 60.0, "instructions_without": 99.0}}],
                            "instructions")["nested"]
    assert combined["instructions"] == 55.0 and combined["instructions_spread"] == pytest.approx(10 / 55)


def test_check_exits_1_on_a_growth_and_0_within_the_margin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    head = cost_cli.git_out("rev-parse", "HEAD") or "0" * 40
    baseline = tmp_path / "baseline.json"
    gate.save({"commit": head, "versions": {}, "cases": {"nested": {"instructions": 200_000.0, "calls": 130.0}}},
              baseline)

    def measured(instructions: float) -> Any:
        case = {"title": "one nested", "route": "native", "nodes": 11, "instructions": instructions,
                "instructions_without": 1_400_000.0, "instructions_spread": 0.0, "instructions_per_node": 0.0,
                "calls": 130.0}
        return lambda runs, calls_only, raw, only=(): {"walker": "native", "runs": 1, "wall_s": 0.0,
                                                       "cases": {"nested": case}}

    monkeypatch.setattr(cost_cli, "versions", lambda: {})
    monkeypatch.setattr(region, "valgrind", lambda: "/usr/bin/valgrind")
    monkeypatch.setattr(cost_cli, "measure", measured(201_000.0))
    assert cost_cli.main(["--check", "--no-rows", "--baseline", str(baseline)]) == 0
    monkeypatch.setattr(cost_cli, "measure", measured(420_000.0))
    assert cost_cli.main(["--check", "--no-rows", "--baseline", str(baseline)]) == 1
    err = capsys.readouterr().err
    assert "nested: instructions added per backward grew past the margin" in err and "2.100x" in err


ROW = "row-W1-h32"


def test_a_rows_slack_is_a_share_of_deepspeed_alones_backward() -> None:
    alone = 30_000_000.0
    base = {ROW: {"instructions": 200_000.0, "instructions_without": alone},
            "nested": {"instructions": 200_000.0, "instructions_without": alone}}
    at_row_limit = gate.limit(200_000.0, "instructions", ROW, alone)
    assert at_row_limit == pytest.approx(200_000 * (1 + gate.RELATIVE) + gate.ROW_SLACK_OF_ALONE * alone)
    got = verdicts(gate.compare(base, {ROW: {"instructions": at_row_limit},
                                       "nested": {"instructions": at_row_limit}}, {}))
    assert got == {(ROW, "instructions"): "ok", ("nested", "instructions"): "grew"}
    got = verdicts(gate.compare(base, {ROW: {"instructions": at_row_limit + 1}}, {}))
    assert got == {(ROW, "instructions"): "grew"}
    failures, _ = gate.messages(gate.compare(base, {ROW: {"instructions": 1_000_000.0}}, {}), "0" * 40)
    assert f"margin 3% + {gate.ROW_SLACK_OF_ALONE * alone:,.0f}" in failures[0]


def test_a_negative_baseline_widens_the_margin_as_a_positive_one() -> None:
    alone = 90_000_000.0  # W5: graphscale's backward counts fewer instructions than DeepSpeed alone's
    base = {"row-W5-h32": {"instructions": -600_000.0, "instructions_without": alone}}
    width = 600_000 * gate.RELATIVE + gate.ROW_SLACK_OF_ALONE * alone
    assert gate.limit(-600_000.0, "instructions", "row-W5-h32", alone) == pytest.approx(-600_000 + width)
    assert gate.floor(-600_000.0, "instructions", "row-W5-h32", alone) == pytest.approx(-600_000 - width)
    got = verdicts(gate.compare(base, {"row-W5-h32": {"instructions": -600_000.0 + width - 1}}, {}))
    assert got == {("row-W5-h32", "instructions"): "ok"}
    got = verdicts(gate.compare(base, {"row-W5-h32": {"instructions": -600_000.0 + width + 1}}, {}))
    assert got == {("row-W5-h32", "instructions"): "grew"}


def main_job_json(path: Path, setting: dict[str, Any] | None, workloads: tuple[str, ...]) -> str:
    """A main job's --json as gsbench/cli.py writes it: counted rows under ``meta.counted_setting``."""
    from gsbench.spec import HF_WORKLOADS

    rows = []
    for k, w in enumerate(workloads):
        ds, gs = 30_000_000.0 + k, 30_150_000.0 + 7 * k
        rows.append({"workload": w, "hidden": 64 if w in HF_WORKLOADS else 32,
                     "counted": {"deepspeed": {"median": ds}, "leaf-hooks": {"median": 2 * ds},
                                 "graphscale": {"median": gs}}})
    meta: dict[str, Any] = {} if setting is None else {"counted_setting": setting}
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    return str(path)


def test_the_rows_read_from_a_quick_main_job_are_what_graphscale_adds_to_deepspeed_alone(tmp_path: Path) -> None:
    from gsbench import rowcounts
    from gsbench.spec import QUICK_COUNTED

    quick = {"quick": True, "sizes": "32", "layers": 12}
    got = rowcounts.gate_rows_from(main_job_json(tmp_path / "quick.json", quick, QUICK_COUNTED))
    assert set(got) == {"row-W1-h32", "row-W2-h32", "row-W5-h32", "row-HF1-h64"}
    for k, w in enumerate(QUICK_COUNTED):
        fig = next(v for rid, v in got.items() if rid.startswith(f"row-{w}-"))
        assert fig == {"instructions": 150_000.0 + 6 * k, "instructions_without": 30_000_000.0 + k}


def test_a_quick_run_counts_at_its_first_size_and_that_is_the_gates_setting() -> None:
    from gsbench import rowcounts

    assert rowcounts.counted_setting(True, "32,256", 12) == {"quick": True, "sizes": "32", "layers": 12}
    assert rowcounts.counted_setting(False, "32,256", 12) == {"quick": False, "sizes": "32,256", "layers": 12}
    assert rowcounts.GATE_SETTING == rowcounts.counted_setting(True, rowcounts.DEFAULT_SIZES,
                                                               rowcounts.DEFAULT_LAYERS)


def test_rows_not_counted_say_why_missing_valgrind_or_a_failed_run(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from gsbench import rowcounts

    monkeypatch.setattr(rowcounts, "available", lambda: "valgrind is not installed (apt-get install valgrind)")
    assert rowcounts.try_count_rows("32", True, ["W1"], 12) == (
        None, "valgrind is not installed (apt-get install valgrind)")

    def failed(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("overhead.py: the counted run exited 1")

    monkeypatch.setattr(rowcounts, "available", lambda: None)
    monkeypatch.setattr(rowcounts, "count_rows", failed)
    assert rowcounts.try_count_rows("32", True, ["W1"], 12) == (None, "the counted run failed (above)")
    assert "the counted run exited 1" in capsys.readouterr().err


@pytest.mark.parametrize("setting, workloads, says", [
    pytest.param(None, ("W1", "W2", "W5", "HF1"), "were not counted as the gate's are", id="not counted"),
    pytest.param({"quick": False, "sizes": "32,256", "layers": 12}, ("W1", "W2", "W5", "HF1"),
                 "were not counted as the gate's are", id="the default run"),
    pytest.param({"quick": True, "sizes": "32", "layers": 12}, ("W1", "W2"), "no counts of W5, HF1",
                 id="some rows"),
])
def test_rows_read_from_a_run_not_counted_as_the_gates_are_refused_with_the_command(
        tmp_path: Path, setting: dict[str, Any] | None, workloads: tuple[str, ...], says: str) -> None:
    from gsbench import rowcounts

    path = main_job_json(tmp_path / "run.json", setting, workloads)
    with pytest.raises(ValueError, match=says) as err:
        rowcounts.gate_rows_from(path)
    assert f"python benchmarks/overhead.py --quick --json {path}" in str(err.value)
    assert cost_cli.main(["--check", "--rows-from", path]) == 2


REGION_SCRIPT = """
import sys
sys.path.insert(0, {bench!r})
from gsbench.region import Region
r = Region()
r.instrument()
def work(n):
    def run():
        s = 0
        for i in range(n):
            s += i
    return run
r.region(work(1000))
r.region(work(20000))
"""


@pytest.mark.skipif(region.valgrind() is None or region.compiler() is None,
                    reason="needs valgrind and a C compiler")
@pytest.mark.parametrize("cache_sim", [False, True], ids=["instructions", "with the cache simulation"])
def test_callgrind_counts_each_region_in_a_file_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           cache_sim: bool) -> None:
    monkeypatch.setenv(region.CACHE_ENV, str(tmp_path / "cache"))
    out = tmp_path / "callgrind.out"
    script = tmp_path / "regions.py"
    script.write_text(REGION_SCRIPT.format(bench=str(BENCH)))
    late = region.Region().can_instrument
    run = subprocess.run([*region.callgrind_command(out, instrument_late=late, cache_sim=cache_sim),
                          sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    parts = region.read_parts(out)
    assert len(parts) == 2, parts  # one file per region; the program's own file (nothing counted) left out
    small, large = parts
    assert 0 < small < large, parts  # twenty times the loop: more counted, and only inside the region
    assert region.read_total(out) == 0
    events = [region.read_events(p) for p in region.part_files(out)]
    assert [e["Ir"] for e in events] == parts
    if cache_sim:  # the misses per level, beside the instructions
        assert all({"I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw"} <= set(e) for e in events), events
        assert all(0 <= e["DLmr"] <= e["D1mr"] for e in events), events
    else:
        assert all(set(e) == {"Ir"} for e in events), events
    bogus = tmp_path / "not-callgrind.txt"
    bogus.write_text("events: Ir\n")
    with pytest.raises(ValueError, match="not a callgrind output file"):
        region.read_total(bogus)
