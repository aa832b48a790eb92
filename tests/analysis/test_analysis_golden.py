"""Every per-run figure of design.md's table on one small hand-built run, derived by hand.

The run (times in ms; three requests r0, r1, r2; arrivals 0, 2, 5; wall time 100 ms):

    step  span      graph  n_decode  segments                     emits
    s0    [0, 10]   2      2         decode [1, 9]                r0 r1 r2 at 9
    s1    [10, 24]  4      3         decode [11, 23]              r0 r1    at 23
    s2    [24, 36]  4      4         decode [26, 34]              r0 r1 r2 at 34
    s3    [40, 60]  eager  5         tok [40, 43], decode [43, 58] r0      at 58   (preempted 1)
    s4    [62, 75]  2      2         swap [62, 64], decode [65, 73] r0 r1  at 73.5 (swapped in 1)

    GC pauses: gen 2 [-50, -20] (before the first step), gen 0 [25, 35] (covers all of s2's
    decode), gen 2 [58.5, 59.5].
    r1 is evicted at 41 and readmitted at 64: its eviction holds s3's work and uncovered time.

The graph baseline (design.md: a least-squares line of GC-free decode ms against the padded
batch size, over the steps that ran on a captured size):
    captured points (graph, GC-free decode ms): s0 (2, 8), s1 (4, 12), s2 (4, 0: its decode lies
    wholly inside the GC pause), s4 (2, 8).
    mean x = 3, mean y = 7; Sxx = 1+1+1+1 = 4; Sxy = (-1)(1) + (1)(5) + (1)(-7) + (-1)(1) = -4
    -> slope -1, intercept 7 - (-1)(3) = 10: decode_ms = 10 - n.
    s3 (eager) at its decode row count 5: predicted 5, GC-free decode 15
    -> excess fraction (15 - 5) / 15 = 2/3: of its 15 ms, graph 10, forward 5.

The gaps (rules 1-5 of design.md):
    r0 [9, 23]  = 14: residual 9..11 = 2, forward 11..23 = 12                      -> clean
    r0 [23, 34] = 11: residual 23..25 = 2, gc 25..34 = 9 (over s2's decode)         -> gc
    r0 [34, 58] = 24: gc 34..35 = 1, residual 35..40 = 5, tok 40..43 = 3,
                      decode 43..58: graph 10, forward 5                           -> graph
    r0 [58, 73.5] = 15.5: residual 58..58.5 + 59.5..62 + 64..65 + 73..73.5 = 4.5,
                      gc 58.5..59.5 = 1, preempt (swap) 62..64 = 2, forward 65..73 = 8 -> clean
                      (largest cause preempt 2 < 25% of 15.5 = 3.875)
    r1 [9, 23]  = 14: as r0's                                                      -> clean
    r1 [23, 34] = 11: as r0's                                                      -> gc
    r1 [34, 73.5] = 39.5: evicted 41..64 = preempt 23. Live 34..41: gc 1, residual 5,
                      tok 1; live 64..73.5: residual 1 + 0.5, forward 8.
                      parts: preempt 23, gc 1, tok 1, residual 6.5, forward 8        -> preempt
                      context (what ran during 41..64): tok 41..43 = 2, decode 43..58 =
                      graph 10 + forward 5, residual 58..58.5 + 59.5..62 = 3, gc 1,
                      preempt (swap) 62..64 = 2; sums to 23
    r2 [9, 34]  = 25: residual 2 + 2, forward 12, gc 9                             -> gc
                      (steps 0 -> 2 with no eviction: a skipped step)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from logbuilder import LogBuilder

from tracekit.analysis.figures import analyze
from tracekit.attribution.itl import FIT_MEASURED_CAPTURED, partition
from tracekit.attribution.reference import partition_reference

IMPLS = [partition, partition_reference]


def golden_log():
    b = LogBuilder()
    b.gc(-50, -20, gen=2)
    s0 = b.step(0, 10, n_decode=2, graph=2)
    b.seg(s0, "decode", 1, 9)
    for r in (0, 1, 2):
        b.emit(r, 9, s0)
    s1 = b.step(10, 24, n_decode=3, graph=4)
    b.seg(s1, "decode", 11, 23)
    for r in (0, 1):
        b.emit(r, 23, s1)
    s2 = b.step(24, 36, n_decode=4, graph=4)
    b.seg(s2, "decode", 26, 34)
    b.gc(25, 35, gen=0)
    for r in (0, 1, 2):
        b.emit(r, 34, s2)
    s3 = b.step(40, 60, n_decode=5, graph=0, preempted=1)
    b.seg(s3, "tok", 40, 43)
    b.seg(s3, "decode", 43, 58)
    b.evict(1, 41, 64)
    b.emit(0, 58, s3)
    b.gc(58.5, 59.5, gen=2)
    s4 = b.step(62, 75, n_decode=2, graph=2, swapped=1)
    b.seg(s4, "swap", 62, 64)
    b.seg(s4, "decode", 65, 73)
    for r in (0, 1):
        b.emit(r, 73.5, s4)
    return b.build(wall_ms=100, arrivals_ms=[0, 2, 5])


def _row(p, req, t0_ms):
    i = np.flatnonzero((p.request == req) & np.isclose(p.t0_s, t0_ms * 1e-3))
    assert len(i) == 1
    return int(i[0])


def _nonzero(labels, row):
    return {lb: round(float(v), 9) for lb, v in zip(labels, row, strict=True) if abs(v) > 1e-12}


@pytest.mark.parametrize("impl", IMPLS)
def test_golden_partition(impl):
    p = impl(golden_log())
    assert p.baseline.slope_ms_per_row == pytest.approx(-1.0)
    assert p.baseline.intercept_ms == pytest.approx(10.0)
    assert p.baseline.num_fit_steps == 4  # s2, wholly inside a GC pause, is a fitted point
    expected = {
        (0, 9): {"residual": 2.0, "forward": 12.0},
        (0, 23): {"residual": 2.0, "gc": 9.0},
        (0, 34): {"gc": 1.0, "residual": 5.0, "tok": 3.0, "graph": 10.0, "forward": 5.0},
        (0, 58): {"residual": 4.5, "gc": 1.0, "preempt": 2.0, "forward": 8.0},
        (1, 9): {"residual": 2.0, "forward": 12.0},
        (1, 23): {"residual": 2.0, "gc": 9.0},
        (1, 34): {"preempt": 23.0, "gc": 1.0, "tok": 1.0, "residual": 6.5, "forward": 8.0},
        (2, 9): {"residual": 4.0, "forward": 12.0, "gc": 9.0},
    }
    assert len(p) == len(expected)
    for (req, t0), parts in expected.items():
        assert _nonzero(p.labels, p.parts_ms[_row(p, req, t0)]) == parts, (req, t0)
    evicted = _row(p, 1, 34)
    assert _nonzero(p.labels, p.context_ms[evicted]) == {
        "tok": 2.0, "graph": 10.0, "forward": 5.0, "residual": 3.0, "gc": 1.0, "preempt": 2.0
    }  # fmt: skip
    assert p.context_ms[evicted].sum() == pytest.approx(23.0)  # the evicted time, all of it
    prim = p.primary_names()
    assert [prim[_row(p, r, t)] for r, t in expected] == [
        "clean", "gc", "graph", "clean", "clean", "gc", "preempt", "gc"
    ]  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
def test_measured_captured_fit_drops_the_step_gc_covered(impl):
    # FIT_MEASURED_CAPTURED leaves s2 out: points (2, 8), (4, 12), (2, 8). mean x = 8/3,
    # mean y = 28/3; Sxx = 4/9 + 16/9 + 4/9 = 24/9; Sxy = (-2/3)(-4/3) + (4/3)(8/3) +
    # (-2/3)(-4/3) = 48/9 -> slope 2, intercept 28/3 - 2 * 8/3 = 4: decode_ms = 2n + 4.
    # s3 at n = 5: predicted 14, excess (15 - 14) / 15 = 1/15: graph 1, forward 14.
    p = impl(golden_log(), baseline_fit=FIT_MEASURED_CAPTURED)
    assert p.baseline.slope_ms_per_row == pytest.approx(2.0)
    assert p.baseline.intercept_ms == pytest.approx(4.0)
    assert p.baseline.num_fit_steps == 3
    i = _row(p, 0, 34)
    assert _nonzero(p.labels, p.parts_ms[i]) == {
        "gc": 1.0, "residual": 5.0, "tok": 3.0, "graph": 1.0, "forward": 14.0
    }  # fmt: skip
    assert p.primary_names()[i] == "clean"  # tok 3 < 25% of 24 = 6


def test_unknown_baseline_fit_is_refused():
    with pytest.raises(ValueError, match="all-captured"):
        partition(golden_log(), baseline_fit="captured")


@pytest.mark.parametrize("impl", IMPLS)
def test_golden_run_figures(impl):
    log = golden_log()
    a = analyze(log, impl(log))
    assert (a.requests, a.tokens, a.gaps) == (3, 11, 8)  # 5 + 4 + 2 emissions; 4 + 3 + 1 gaps
    assert a.tok_per_s == pytest.approx(11 / 0.1)
    # sorted gaps: 11 11 14 14 15.5 24 25 39.5 (n = 8); numpy's linear percentile at q sits
    # at position 7q: p50 3.5 -> 14.75; p90 6.3 -> 25 + 0.3 * 14.5 = 29.35; p99 6.93 -> 25 +
    # 0.93 * 14.5 = 38.485; p99.9 6.993 -> 25 + 0.993 * 14.5 = 39.3985
    assert a.itl_p50 == pytest.approx(14.75)
    assert a.itl_p90 == pytest.approx(29.35)
    assert a.itl_p99 == pytest.approx(38.485)
    assert a.itl_p999 == pytest.approx(39.3985)
    assert a.itl_max == pytest.approx(39.5)
    # TTFT: 9 - 0, 9 - 2, 9 - 5 = 9, 7, 4: p50 7; p99 at position 1.98 -> 7 + 0.98 * 2 = 8.96
    assert a.ttft_p50 == pytest.approx(7.0)
    assert a.ttft_p99 == pytest.approx(8.96)
    # the tail (>= 38.485) is r1's 39.5 ms gap alone
    tail = {"preempt": 23, "gc": 1, "tok": 1, "residual": 6.5, "forward": 8}
    for lb in a.labels:
        assert a.tail_share[lb] == pytest.approx(tail.get(lb, 0) / 39.5, abs=1e-12), lb
    assert a.tail_count == {"preempt": 1, "gc": 0, "tok": 0, "prefill": 0, "graph": 0, "clean": 0}
    # all gaps, 154 ms: forward 12+5+8+12+8+12 = 57, residual 2+2+5+4.5+2+2+6.5+4 = 28,
    # gc 9+1+1+9+1+9 = 30, tok 3+1 = 4, graph 10, preempt 2+23 = 25, prefill 0
    every = {"forward": 57, "residual": 28, "gc": 30, "tok": 4, "graph": 10, "preempt": 25}
    for lb in a.labels:
        assert a.all_share[lb] == pytest.approx(every.get(lb, 0) / 154, abs=1e-12), lb
    assert a.all_count == {"preempt": 1, "gc": 3, "tok": 0, "prefill": 0, "graph": 1, "clean": 3}
    # clean gaps: r0 [9,23] 12/14, r0 [58,73.5] 8/15.5, r1 [9,23] 12/14 -> median 6/7;
    # tail: 8/39.5
    assert a.fwd_share_clean_median == pytest.approx(6 / 7)
    assert a.fwd_share_tail_median == pytest.approx(8 / 39.5)
    # the eviction's context, uncovered time (residual 3) included
    ctx = {"tok": 2, "graph": 10, "forward": 5, "residual": 3, "gc": 1, "preempt": 2}
    for lb in a.labels:
        assert a.evicted_context_ms[lb] == pytest.approx(ctx.get(lb, 0), abs=1e-9), lb
    assert a.reconcile_max_err_ms < 1e-9
    # r2 goes from step 0 to step 2 with no eviction; r1's step 2 -> 4 gap has one
    assert a.skipped_steps_without_eviction == 1
    assert (a.preemptions, a.eager_steps, a.max_decode_B, a.steps) == (1, 1, 5, 5)
    assert a.gc_counts == {"0": 1, "1": 0, "2": 2}
    # gen-2 pauses: 30 ms ending at -20 (before the first step starts at 0); 1 ms at 59.5
    assert a.gen2_startup_ms == [30.0]
    assert a.gen2_serving_ms == [1.0]
    assert a.graph_baseline["slope_ms_per_row"] == pytest.approx(-1.0)
    assert a.graph_baseline["intercept_ms"] == pytest.approx(10.0)
    # hist: [10,15) holds 14 14 (clean) and 11 11 (gc); [15,20) 15.5 (clean);
    # [20,30) 24 (graph) and 25 (gc); [30,50) 39.5 (preempt); every other bin empty
    want = {10: {"clean": 2, "gc": 2}, 15: {"clean": 1}, 20: {"graph": 1, "gc": 1},
            30: {"preempt": 1}}  # fmt: skip
    edges = [0, 5, 10, 15, 20, 30, 50, 80, 120, 200, 400, 800, math.inf]
    assert [(h.lo_ms, h.hi_ms) for h in a.hist] == list(zip(edges[:-1], edges[1:], strict=True))
    for h in a.hist:
        w = want.get(int(h.lo_ms), {})
        assert h.count == sum(w.values()), h.lo_ms
        assert {k: v for k, v in h.by_primary.items() if v} == w, h.lo_ms


def test_hist_bins_are_closed_below_open_above():
    # gaps of exactly 5, 10 and 800 ms (each from t = 0, so the float difference is exact)
    # fall in [5,10), [10,15) and [800,inf)
    b = LogBuilder()
    s = b.step(0, 800)
    b.seg(s, "decode", 0, 800)
    for r, d in enumerate((5.0, 10.0, 800.0)):
        b.emit(r, 0, -1)
        b.emit(r, d, s)
    a = analyze(b.build())
    assert sorted(a.hist[i].count for i in range(len(a.hist))) == [0] * 9 + [1, 1, 1]
    counts = {h.lo_ms: h.count for h in a.hist if h.count}
    assert counts == {5.0: 1, 10.0: 1, 800.0: 1}


def test_golden_run_in_the_published_layout_gives_the_same_figures(tmp_path):
    # the same run written in the published method's .npz layout loads and analyses to the
    # same figures (the hand-derived ones above)
    from test_rawlog import to_published

    import tracekit

    log = golden_log()
    path = tmp_path / "golden.npz"
    to_published(log, path)
    pub = tracekit.load(path)
    assert pub.source == "published"
    a, b = analyze(log).to_dict(), analyze(pub).to_dict()
    for key in a:
        if key not in ("path", "warnings", "evictions"):
            assert a[key] == b[key], key
    # who evicted whom: the same figures; the published layout names requests by number
    for w in (*a["evictions"]["worst"], *b["evictions"]["worst"]):
        w.pop("victim")
    assert a["evictions"] == b["evictions"]
