"""Windows of a run and the tail over time (docs/reports.md, "Windows" and "The tail over
time"): partition the whole run, then select. Expected values come from those rules: a
window's gaps are the whole run's gaps whose end lies in ``[FROM, TO)``, part for part;
a bucket's percentiles are numpy's linear percentiles of its gaps, worked out by hand."""

from __future__ import annotations

import math
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracekit.analysis.figures import analyze
from tracekit.analysis.gaps import gap_records
from tracekit.analysis.overtime import bucket_of, over_time
from tracekit.analysis.window import (
    Window,
    WindowOptions,
    around,
    parse_duration,
    parse_window,
    select_gaps,
    select_ttfts,
)
from tracekit.attribution.itl import partition
from tracekit.attribution.ttft import ttft_partition
from tracekit.errors import UsageError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from logbuilder import LogBuilder  # noqa: E402
from synthlog import synthetic_log  # noqa: E402

# -- parsing ---------------------------------------------------------------------------------


def test_window_forms():
    assert (parse_window("10..12.5").t0_s, parse_window("10..12.5").t1_s) == (10.0, 12.5)
    assert parse_window("..30").t0_s == -math.inf and parse_window("..30").t1_s == 30.0
    assert parse_window("600..").t1_s == math.inf
    w = parse_window("10:12.5")  # trace's older spelling
    assert (w.t0_s, w.t1_s) == (10.0, 12.5)


def test_wall_clock_ends_count_from_the_runs_wall_clock_start():
    start = 1764892800.0  # 2025-12-05T00:00:00 UTC
    w = parse_window("2025-12-05T00:00:03..2025-12-05T00:00:06.5", start)
    assert (w.t0_s, w.t1_s) == (3.0, 6.5)  # no offset: UTC
    w = parse_window("2025-12-05T01:00:03+01:00..", start)
    assert w.t0_s == 3.0 and w.t1_s == math.inf


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("5..3", "FROM must be before TO"),
        ("5..5", "FROM must be before TO"),
        ("a..b", "neither seconds"),
        ("5", "expected FROM..TO"),
        ("2025-12-05T00:00:03..", "records no wall-clock start"),
    ],
)
def test_bad_windows_say_why(text, says):
    with pytest.raises(UsageError, match=says):
        parse_window(text, None)


def test_durations():
    assert [parse_duration(x) for x in ("90", "30s", "1m", "0.5h", "2.5s", "250ms", "1d")] == [
        90.0,
        30.0,
        60.0,
        1800.0,
        2.5,
        0.25,
        86400.0,
    ]
    for bad in ("0", "-1m", "1w", "m", "", "1e400", "0ms", "1 mss"):
        with pytest.raises(UsageError):
            parse_duration(bad)


# -- a hand-built run with known gaps ------------------------------------------------------


def hand_log():
    """One request emitting at 100, 300, 700, 1000, 1500 and 3200 ms, each emission at the
    end of a 50 ms decode step: gaps (ms, by their end) 200 @ 0.3 s, 400 @ 0.7 s, 300 @
    1.0 s, 500 @ 1.5 s, 1700 @ 3.2 s."""
    b = LogBuilder()
    for t in (100, 300, 700, 1000, 1500, 3200):
        s = b.step(t - 50, t)
        b.seg(s, "decode", t - 50, t)
        b.emit(0, t, s)
    return b.build()


def test_a_window_selects_the_gaps_ending_in_it_half_open():
    log = hand_log()
    part = partition(log)
    sel = select_gaps(part, parse_window("0.7..1.5"))
    # ends 0.7 (in: FROM is in the window) and 1.0; 1.5 is TO (not in)
    assert sel.gap_ms.tolist() == pytest.approx([400.0, 300.0])


def test_around_worst_centres_on_the_worst_gaps_end():
    part = partition(hand_log())
    w = around(part, "worst", 2.0)
    assert (w.t0_s, w.t1_s) == pytest.approx((2.2, 4.2))  # the 1700 ms gap ends at 3.2 s
    assert "1700.0 ms gap ending at 3.200 s" in w.how
    # p50 of [200, 300, 400, 500, 1700] is 400: the shortest gap at or above it ends at 0.7
    w = around(part, "p50", 1.0)
    assert (w.t0_s, w.t1_s) == pytest.approx((0.2, 1.2))
    for bad in ("p101", "worse", "99"):
        with pytest.raises(UsageError):
            around(part, bad)


def test_buckets_hand_case():
    log = hand_log()
    rows = over_time(log, partition(log), 1.0)
    # [0,1): 200, 400 -> p50 300, p99 200 + 0.99*200, p99.9 200 + 0.999*200
    # [1,2): 300 (ends on the edge 1.0: the later bucket), 500 -> 400, 498, 499.8
    # [2,3): none, listed; [3,4): 1700
    assert [(r.start_s, r.end_s, r.gaps) for r in rows] == [
        (0.0, 1.0, 2),
        (1.0, 2.0, 2),
        (2.0, 3.0, 0),
        (3.0, 4.0, 1),
    ]
    got = [(r.itl_p50, r.itl_p99, r.itl_p999) for r in rows]
    assert got[0] == pytest.approx((300.0, 398.0, 399.8))
    assert got[1] == pytest.approx((400.0, 498.0, 499.8))
    assert all(math.isnan(x) for x in got[2])
    assert got[3] == pytest.approx((1700.0, 1700.0, 1700.0))
    # each bucket's own tail (>= its p99) is its longest gap
    assert [r.tail_gaps for r in rows] == [1, 1, 0, 1]
    # the run's p99 over [200, 300, 400, 500, 1700] is 500 + 0.96 * 1200 = 1652: one gap
    assert [r.run_tail_gaps for r in rows] == [0, 0, 0, 1]
    for r in (rows[0], rows[1], rows[3]):
        assert sum(r.tail_share.values()) == pytest.approx(1.0)
    assert sum(rows[2].tail_share.values()) == 0.0
    rec = rows[2].to_record()
    assert rec["gaps"] == 0 and rec["itl_p50"] is None


def test_buckets_of_a_window_are_cut_to_it():
    log = hand_log()
    rows = over_time(log, partition(log), 1.0, parse_window("0.5..2.5"))
    assert [(r.start_s, r.end_s, r.gaps) for r in rows] == [
        (0.5, 1.0, 1),  # 0.7
        (1.0, 2.0, 2),  # 1.0, 1.5
        (2.0, 2.5, 0),
    ]


def test_bucket_edges_are_exact_for_awkward_widths():
    # 0.3 / 0.1 is 2.9999999999999996 in floats; 0.3 still lies in [3*0.1, 4*0.1)? No:
    # 3*0.1 = 0.30000000000000004 > 0.3, so 0.3 is in bucket 2 = [0.2, 0.30000000000000004)
    t = np.array([0.3, 0.2, 0.1 * 3, 0.0, 0.1])
    k = bucket_of(t, 0.1)
    for ti, ki in zip(t, k, strict=True):
        assert ki * 0.1 <= ti < (ki + 1) * 0.1


# -- equality with the whole run: random logs, random windows --------------------------------


@cache
def synth(seed: int):
    log = synthetic_log(seed=seed, duration_s=3.0, rate_per_s=15.0)
    return log, partition(log), ttft_partition(log)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    seed=st.integers(1, 3),
    a=st.floats(-1.0, 4.0, allow_nan=False),
    width=st.floats(0.01, 4.0, allow_nan=False),
    open_end=st.sampled_from(["none", "from", "to"]),
)
def test_a_windows_gaps_are_the_whole_runs_gaps_ending_in_it(seed, a, width, open_end):
    log, part, tpart = synth(seed)
    lo = -math.inf if open_end == "from" else a
    hi = math.inf if open_end == "to" else a + width
    win = Window(lo, hi, "test")
    sel = select_gaps(part, win)
    keep = [i for i in range(len(part)) if lo <= part.t1_s[i] < hi]
    assert len(sel) == len(keep)
    for name in ("request", "t0_s", "t1_s", "gap_ms", "primary", "step0", "step1"):
        assert np.array_equal(getattr(sel, name), getattr(part, name)[keep])
    assert np.array_equal(sel.parts_ms, part.parts_ms[keep])  # part for part
    assert np.array_equal(sel.context_ms, part.context_ms[keep])
    whole = gap_records(log, part)
    assert gap_records(log, sel) == [r for r in whole if lo <= r["t1_s"] < hi]
    tsel = select_ttfts(tpart, win)
    tkeep = [i for i in range(len(tpart)) if lo <= tpart.first_token_s[i] < hi]
    assert np.array_equal(tsel.ttft_ms, tpart.ttft_ms[tkeep])
    assert np.array_equal(tsel.parts_ms, tpart.parts_ms[tkeep])


@pytest.mark.parametrize("seed", [1, 2])
def test_analyze_of_a_window_per_gap_from_the_window_per_run_from_the_run(seed):
    log, part, tpart = synth(seed)
    win = Window(1.0, 2.0, "test")
    a = analyze(log, part, tpart, window=win)
    whole = analyze(log, part, tpart)
    g = part.gap_ms[(part.t1_s >= 1.0) & (part.t1_s < 2.0)]
    assert a.gaps == len(g)
    assert a.itl_p99 == pytest.approx(float(np.percentile(g, 99)))
    assert a.itl_max == pytest.approx(float(g.max()))
    assert sum(a.tail_count.values()) == int((g >= np.percentile(g, 99)).sum())
    assert sum(h.count for h in a.hist) == len(g)
    assert a.reconcile_max_err_ms < 1e-6  # the reconciliation check on the selected gaps
    rq = log.requests
    f = rq.first_token_s
    ok = np.isfinite(f) & np.isfinite(rq.arrival_s) & (f >= 1.0) & (f < 2.0)
    t = (f[ok] - rq.arrival_s[ok]) * 1e3
    assert a.ttft_p50 == pytest.approx(float(np.percentile(t, 50)))
    assert a.ttft is not None and a.ttft.requests == int(ok.sum())
    for per_run in ("requests", "tokens", "steps", "gc_counts", "preemptions", "wall_s"):
        assert getattr(a, per_run) == getattr(whole, per_run)
    assert a.to_dict()["window"] == {"from_s": 1.0, "to_s": 2.0, "how": "test"}
    assert "window" not in whole.to_dict()  # the whole run's record is as it was


def test_buckets_partition_the_runs_gaps():
    log, part, _ = synth(1)
    rows = over_time(log, part, 0.5)
    assert sum(r.gaps for r in rows) == len(part)
    starts = [r.start_s for r in rows]
    assert starts == sorted(starts) and all(r.end_s - r.start_s == pytest.approx(0.5) for r in rows)
    p99 = np.percentile(part.gap_ms, 99)
    assert sum(r.run_tail_gaps for r in rows) == int((part.gap_ms >= p99).sum())


def test_window_options_refuse_both_and_a_window_outside_the_run():
    log, part, _ = synth(1)
    with pytest.raises(UsageError, match="both given"):
        WindowOptions(window="1..2", around="worst").resolve(log, part)
    with pytest.raises(UsageError, match="outside the run"):
        WindowOptions(window="100..200").resolve(log, part)
