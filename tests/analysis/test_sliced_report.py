"""The HTML report of a long run read in slices (docs/reports.md, "Reading a long run in
slices"): the page's parts (figures, worst stalls, ITL over time, the tail over time) equal
the whole run's, whatever the slices' size."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_sliced import FakeClock, _differences, _wait_for_parts
from test_sliced_listing import _differences as record_differences

import tracekit
import tracekit.analysis.stream_report as stream_report
from tracekit.analysis.figures import analyze
from tracekit.analysis.gaps import even_picks, itl_series, thin_marks, worst_stalls
from tracekit.analysis.overtime import report_buckets
from tracekit.analysis.stream_index import PARTS_PER_TASK
from tracekit.analysis.stream_overtime import over_time_sliced
from tracekit.analysis.stream_report import report_sliced, report_whatif_sliced
from tracekit.attribution.itl import partition
from tracekit.log.slices import SlicedRun

REPO = Path(__file__).resolve().parents[2]
TICK_S = 2.0**-4  # a power of two: every time and gap below is exact in binary
LONG_STEPS = (3, 8)  # 3 s steps; the others 1 s


def _stall_differences(whole: list[dict], sliced: list[dict]) -> list[str]:
    """Where the page's worst stalls differ from the whole run's: every field exactly but
    a gap's parts and context (and its eviction pieces' ms), to float rounding
    (docs/reports.md: a slice's prefix sums start at the slice); in any key order."""
    norm = lambda recs: json.loads(json.dumps(recs, sort_keys=True))  # noqa: E731
    return record_differences(norm(whole), norm(sliced))


def _hand_run(out: Path) -> None:
    """12 steps, each one `decode` segment of 1 s (steps 3 and 8: 3 s); "x" and "y" emit at
    each step's end inside it, "a" and "b" right after it, outside any step (their
    emissions name no step: -1). A part per step (as in test_sliced's hand run)."""
    clock = FakeClock()
    rec = tracekit.Recorder(str(out), clock=clock, seconds_per_tick=TICK_S, gc=False,
                            handle_signals=False, flush_interval_s=3600.0)  # fmt: skip
    with rec:
        for r in ("a", "b", "x", "y"):
            rec.request(r)
        for k in range(12):
            with rec.step():
                with rec.segment("decode"):
                    clock.t += 48 if k in LONG_STEPS else 16  # ticks: 3 s or 1 s
                rec.emit(["x", "y"])
            rec.emit(["a", "b"])
            rec.flush_soon()
            _wait_for_parts(out, k + 1)


def _step_record(k: int, t_start_s: float, dur_ms: float) -> dict:
    return {"step": k, "t_start_s": t_start_s, "dur_ms": dur_ms, "num_decode": 2,
            "num_prefill_tokens": 0, "graph_size": 2, "num_preempted": 0,
            "num_swapped_in": 0, "segments_ms": {"decode": dur_ms}}  # fmt: skip


def _stall(request: str, t0_s: float, steps: tuple[int, int], requests: list[str]) -> dict:
    """A 3,000 ms stall (docs/partition.md: all decode, so forward; primary clean) over one
    step, the one that ends with it: `steps[1]`, or for emissions outside steps step 3."""
    parts = {"preempt": 0.0, "gc": 0.0, "tok": 0.0, "prefill": 0.0, "graph": 0.0,
             "forward": 3000.0, "residual": 0.0}  # fmt: skip
    return {"request": request, "t0_s": t0_s, "t1_s": t0_s + 3.0, "gap_ms": 3000.0,
            "parts": parts, "context": {}, "primary": "clean", "step0": steps[0],
            "step1": steps[1], "num_requests": len(requests), "requests": requests,
            "gap_ms_min": 3000.0, "num_steps": 1,
            "steps": [_step_record(max(steps[1], 3), t0_s, 3000.0)]}  # fmt: skip


def test_a_stall_across_slices_and_the_series_stride_by_hand(tmp_path):
    """Each request emits at the steps' ends, 1, 2, 3, 6, 7, 8, 9, 10, 13, 14, 15, 16 s:
    11 gaps each, 44 in all, 36 of 1,000 ms and 8 of 3,000 ms (ending at 6 and 13 s).
    p99: numpy's linear rank 0.99 x 43 = 42.57 lies among the 3,000 ms values: the tail is
    the 8 long gaps. Stall events (gaps closed by one step with one primary cause): "a" and
    "b"'s long gaps name no step (-1), so the four of them are one event, closed at 6 s and
    at 13 s, in two slices; "x" and "y"'s are an event at step 3 and one at step 8. All
    heads are 3,000 ms; ties go to the whole run's partition order (by request, then
    time: a, b, x, y), so: a's at 6 s [a, a, b, b], x's at step 3 [x, y], x's at step 8.
    The series with 14 points: the 8 long gaps, and 6 of the 36 others at
    linspace(0, 35, 6) -> ranks 0, 7, 14, 21, 28, 35 in partition order (9 a piece, a's
    first): a's 1st and 8th (ending 2 s, 15 s), b's 6th (10 s), x's 4th (8 s), y's 2nd
    (3 s) and 9th (16 s). Then by end time (ties: partition order)."""
    out = tmp_path / "run.npz"
    _hand_run(out)
    parts = str(out) + ".parts"
    run = SlicedRun(parts)
    run.index()
    assert all(b == a + 1 for _, a, b in run.bounds(1))  # a slice a part: 6 s, 13 s apart
    log = tracekit.load(out)
    part = partition(log)
    stalls = [
        _stall("a", 3.0, (-1, -1), ["a", "a", "b", "b"]),
        _stall("x", 3.0, (2, 3), ["x", "y"]),
        _stall("x", 10.0, (7, 8), ["x", "y"]),
    ]
    ends = [2.0, 3.0, *[6.0] * 4, 8.0, 10.0, *[13.0] * 4, 15.0, 16.0]
    series = {"num_gaps": 44, "t_s": ends,
              "gap_ms": [1000.0, 1000.0, *[3000.0] * 4, 1000.0, 1000.0, *[3000.0] * 4,
                         1000.0, 1000.0],
              "primary": ["clean"] * 14, "evict_t_s": [], "gc_t_s": [], "gc_ms": [],
              "gc_generation": []}  # fmt: skip
    assert worst_stalls(log, part, 10) == stalls  # the written rules, on the whole run
    assert itl_series(log, part, max_points=14) == series
    whole_buckets = _records(report_buckets(log, part))
    assert len(whole_buckets) == 17  # 0-16 s: 1 s buckets (<= 60 of them), 10 or more
    for budget in (1, 5, 10**6):
        page = report_sliced(parts, 10, max_emissions=budget, max_points=14, path=str(out))
        assert page["worst_stalls"] == stalls, budget
        assert page["series"] == series, budget
        assert _records(page["buckets"]) == whole_buckets, budget
        assert page["analysis"].gaps == 44 and page["analysis"].itl_p99 == 3000.0
    by_start = {b["bucket_start_s"]: b for b in whole_buckets}
    # a tail (8 gaps) longer than the series' 6 points (docs/reports.md, "ITL over time"):
    # its 6 // 2 = 3 worst, all 3,000 ms, so the earliest in partition order (a@6, a@13,
    # b@6), and an even stride over the 8 for the other 3: linspace(0, 7, 3) -> 0, 3, 7
    # (a@6, b@13, y@13); none of the others. Five points, by end time, then partition order.
    thinned = {**series, "t_s": [6.0, 6.0, 13.0, 13.0, 13.0], "gap_ms": [3000.0] * 5,
               "primary": ["clean"] * 5}  # fmt: skip
    assert itl_series(log, part, max_points=6) == thinned
    for budget in (1, 5, 10**6):
        page = report_sliced(parts, 10, max_emissions=budget, max_points=6, path=str(out))
        assert page["series"] == thinned, budget
    assert by_start[6.0]["gaps"] == 4 and by_start[6.0]["run_tail_gaps"] == 4
    assert by_start[2.0]["gaps"] == 4 and by_start[2.0]["run_tail_gaps"] == 0
    assert by_start[4.0]["gaps"] == 0 and by_start[1.0]["gaps"] == 0


def _records(buckets) -> list[dict]:
    return [b.to_record() for b in buckets]


@pytest.fixture(scope="module")
def whole_page(demo_run) -> tuple:
    log = tracekit.load(demo_run)
    return log, partition(log)


@settings(max_examples=6, deadline=None, derandomize=True)
@example(budget=700, max_points=40, n=12)  # a tail (79 gaps, 8 lengths) thinned; marks not
@example(budget=50, max_points=5, n=3)  # the GC (7) and eviction (12) marks thinned too
@given(
    budget=st.integers(min_value=1, max_value=9_000),
    max_points=st.integers(min_value=0, max_value=3_000),
    n=st.integers(min_value=0, max_value=40),
)
def test_any_slice_size_gives_the_whole_runs_page(demo_run, whole_page, budget, max_points, n):
    """Worst stalls, the series (its stride too: `max_points` below the run's gaps), the
    buckets: equal; the figures as `analyze_sliced`'s (sums and shares to float rounding)."""
    log, part = whole_page
    page = report_sliced(demo_run + ".parts", n, max_emissions=budget, max_points=max_points,
                         path=demo_run)  # fmt: skip
    assert _stall_differences(worst_stalls(log, part, n), page["worst_stalls"]) == []
    assert page["series"] == itl_series(log, part, max_points=max_points)
    assert _differences(_records(report_buckets(log, part)), _records(page["buckets"])) == []
    assert _differences(analyze(log, part).to_dict(), page["analysis"].to_dict()) == []


def test_the_demo_run_has_what_the_page_reads_in_slices(whole_page):
    """What the property test above covers: stalls with eviction pieces (victims and
    evictors named, their steps numbered in the run), of many requests and of one; GC
    and eviction marks on the series."""
    stalls = worst_stalls(*whole_page, 40)
    assert any("preempt_causes" in r and "recompute_causes" in r for r in stalls)
    assert {r["num_requests"] > 1 for r in stalls} == {True, False}
    series = itl_series(*whole_page)
    assert series["gc_t_s"] and series["evict_t_s"]


NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def test_report_of_a_run_read_in_slices_writes_the_whole_runs_page(demo_run, tmp_path):
    """The command: the same page, byte for byte but for the last digits of shares and sums
    (they add in another order in slices): every number equal to float rounding, the rest
    of the file identical; it says on stderr that it read the run in slices."""

    def report(budget: str) -> tuple[str, str]:
        out = tmp_path / f"report-{budget}.html"
        env = {**os.environ, "TRACEKIT_SLICE_EMISSIONS": budget}
        r = subprocess.run([sys.executable, "-m", "tracekit", "report", demo_run, "-o", str(out)],
                           capture_output=True, text=True, cwd=REPO, env=env,
                           timeout=600)  # fmt: skip
        assert r.returncode == 0, r.stderr
        return out.read_text(encoding="utf-8"), r.stderr

    whole, err_whole = report("1000000000")
    sliced, err_sliced = report("500")
    assert "read in slices (bounded memory)" in err_sliced and "in slices" not in err_whole
    assert NUMBER.sub("#", whole) == NUMBER.sub("#", sliced)
    a, b = NUMBER.findall(whole), NUMBER.findall(sliced)
    assert len(a) == len(b)
    off = [(x, y) for x, y in zip(a, b, strict=True)
           if x != y and abs(float(x) - float(y)) > 1e-9 * max(1.0, abs(float(x)))]  # fmt: skip
    assert off == []


def test_the_series_marks_beyond_its_points_by_hand():
    """docs/reports.md, "ITL over time": beyond the series' points, the longest GC pauses
    (ties: the earlier) in their order, and an even stride of the evictions."""
    t = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    assert thin_marks(t, np.array([3.0, 1.0, 3.0, 2.0, 1.0]), 2).tolist() == [0, 2]
    assert thin_marks(t, np.array([3.0, 1.0, 3.0, 2.0, 1.0]), 3).tolist() == [0, 2, 3]
    assert thin_marks(t, np.array([1.0, 2.0, 1.0, 1.0, 1.0]), 2).tolist() == [0, 1]
    assert thin_marks(t, None, 2).tolist() == [0, 4]  # linspace(0, 4, 2)
    assert thin_marks(t, None, 3).tolist() == [0, 2, 4]
    assert thin_marks(t, None, 5).tolist() == [0, 1, 2, 3, 4]
    assert thin_marks(t, None, 0).tolist() == []
    assert even_picks(10, 4).tolist() == [0, 3, 6, 9]  # linspace(0, 9, 4): 0, 3, 6, 9


@pytest.mark.parametrize(("budget", "n"), [(1, 0), (50, 3), (700, 5), (3_000, 8)])
def test_worst_stalls_keep_the_worst_complete_events_only(
    demo_run, whole_page, monkeypatch, budget, n
):  # fmt: skip
    """Folded after every slice, the stall events no later slice can add a gap to are cut
    to the `n` worst (a day's tail has millions of events): the page's worst stalls are
    still the whole run's, and what the heads hold is those `n` and the open ones."""
    log, part = whole_page
    held: list[int] = []
    fold = stream_report.StallHeads.fold

    def counted(self, now=None):
        out = fold(self, now)
        if now is not None:  # complete: all gaps two slices back or more, step known
            done = (out["last"] < now - 1) & (out["step"] >= 0)
            held.append(int(done.sum()))
        return out

    monkeypatch.setattr(stream_report, "HEAD_FOLD_ROWS", -(10**9))  # fold every slice
    monkeypatch.setattr(stream_report.StallHeads, "fold", counted)
    page = report_sliced(demo_run + ".parts", n, max_emissions=budget, path=demo_run)
    assert _stall_differences(worst_stalls(log, part, n), page["worst_stalls"]) == []
    assert held and max(held) <= n


def _page_json(page: dict, w) -> str:
    """A page and its what-if as text, every float's digits (NaN too)."""
    out = {"analysis": page["analysis"].to_dict(), "worst_stalls": page["worst_stalls"],
           "series": page["series"], "buckets": _records(page["buckets"]),
           "whatif": w.to_records()}  # fmt: skip
    return json.dumps(out, sort_keys=True)


def test_a_mapper_runs_the_slices_of_every_pass_of_the_report(demo_run):
    """`report -j N` / `--ray` of one long run: the index pass's parts and the slices of
    the analysis, the stall pass, the what-if (two reads) and the tail over time are run
    by the mapper, each slice once a pass; what they give back is folded in slice order,
    so the page and the what-if are the in-process ones exactly. (The demo run is too
    short for the page's tail over time: `analyze --by`'s rows, at a width it has.)"""
    ran: dict[str, int] = {}

    def mapper(fn, items):
        name = getattr(fn, "func", fn).__name__
        for x in items:
            ran[name] = ran.get(name, 0) + 1
            yield fn(x)

    parts = demo_run + ".parts"
    plain = report_whatif_sliced(parts, 10, max_emissions=500, path=demo_run)
    mapped = report_whatif_sliced(parts, 10, max_emissions=500, path=demo_run, mapper=mapper)
    assert _page_json(*mapped) == _page_json(*plain)
    run = SlicedRun(parts)
    run.index()
    slices, index_tasks = len(run.bounds(500)), -(-len(run.parts) // PARTS_PER_TASK)
    assert slices > 2
    assert ran.pop("run_slice") == ran.pop("slice_gaps") == slices
    assert ran.pop("run_whatif_slice") == 2 * slices  # its two reads
    assert ran == {"part_facts": index_tasks}
    ran.clear()
    by = over_time_sliced(parts, 0.25, path=demo_run, max_emissions=500)
    assert len(by) > 4
    mapped_by = over_time_sliced(parts, 0.25, path=demo_run, max_emissions=500, mapper=mapper)
    assert json.dumps(_records(mapped_by)) == json.dumps(_records(by))
    assert ran == {"part_facts": index_tasks, "_slice_buckets": slices}


@pytest.mark.parametrize("spread", [("-j", "2"), ("--ray", "auto")])
def test_report_hands_one_long_runs_slices_to_the_workers(demo_run, tmp_path, monkeypatch,
                                                          spread):  # fmt: skip
    """`report RUN -j 2` (or `--ray ADDRESS`) of one run read in slices gives every pass's
    slices to `slice_mapper(2, None)` (or its Ray address), not the run as one task."""
    from click.testing import CliRunner

    from tracekit.analysis import workers
    from tracekit.cli import main

    asked, ran = [], set()

    def recording(jobs, address):
        asked.append((jobs, address))

        def each(fn, items):
            ran.add(getattr(fn, "func", fn).__name__)
            return (fn(x) for x in items)

        return each

    monkeypatch.setattr(workers, "slice_mapper", recording)
    monkeypatch.setenv("TRACEKIT_SLICE_EMISSIONS", "2000")
    r = CliRunner().invoke(main, ["report", demo_run, "-o", str(tmp_path / "p.html"), *spread])
    assert r.exit_code == 0, r.output
    assert asked == [(2, None)] if spread[0] == "-j" else [(1, "auto")]
    assert {"part_facts", "run_slice", "slice_gaps", "run_whatif_slice"} <= ran
