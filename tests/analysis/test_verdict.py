"""The verdict in words, the regime check, and the grouping of gaps into stall events.

Expected sentences are written from the rules in `tracekit/verdict.py`'s docstring and
the figures given here (no log involved); stall events from hand-built logs whose gaps
are obvious by construction."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from logbuilder import LogBuilder

from tracekit.analysis.compare import Comparison, GroupSummary, Spread, regime_misses
from tracekit.analysis.gaps import itl_series, stall_events, worst_stalls
from tracekit.analysis.verdict import verdict
from tracekit.attribution.itl import partition

SHARE_BASE = {"preempt": 0.46, "prefill": 0.26, "gc": 0.04, "forward": 0.20, "residual": 0.04}
SHARE_WM = {"preempt": 0.02, "prefill": 0.20, "gc": 0.0, "forward": 0.70, "residual": 0.08}


def group(key, p999, ttft, share, *, pre=0.0, eager=0.0, runs=3, misses=()):
    med, lo, hi = p999
    figures = {
        n: Spread(1.0, 1.0, 1.0, runs) for n in ("itl_p50", "itl_p99", "itl_max", "tok_per_s")
    }
    figures["itl_p999"] = Spread(med, lo, hi, runs)
    figures["ttft_p50"] = Spread(ttft, ttft, ttft, runs)
    counts = {
        "preemptions": Spread(pre, pre, pre, runs),
        "eager_steps": Spread(eager, eager, eager, runs),
    }
    return GroupSummary(key, ("x",) * runs, figures, share, {}, counts, tuple(misses))


def cmp(*groups):
    return Comparison(
        "rung", ("preempt", "gc", "tok", "prefill", "graph", "forward", "residual"), groups
    )


BASE = group("baseline", (986, 549, 1117), 26, SHARE_BASE, pre=117, eager=580)
WM = group("+admit watermark", (56, 50, 70), 62, SHARE_WM)


def test_two_groups_diagnosis_then_change_with_ttft():
    v = verdict(cmp(BASE, WM))
    # diagnosis: causes by tail share, those >= 5% named (gc 4% is not; forward and
    # residual are not causes), counts as medians
    assert v.findings[0] == (
        "baseline: preemption owns 46% of tail time, prefill 26% (117 preemptions, "
        "580 eager steps, medians); median p99.9 986 ms."
    )
    # change: p99.9 986 -> 56 with ranges [549-1117] and [50-70] apart (no overlap note);
    # the largest fall in share is preempt 46 -> 2 (prefill fell only 26 -> 20); two
    # groups, so TTFT p50 26 -> 62 is in the same sentence
    assert v.findings[1] == (
        "+admit watermark: cut median p99.9 from 986 to 56 ms; preemption 46% -> 2% of "
        "tail time; TTFT p50 rose 26 -> 62 ms."
    )
    assert len(v.findings) == 2
    # 1117 / 549 = 2.03 >= 2: the baseline's runs disagree; 70 / 50 = 1.4: the fix's do not
    assert v.caveats == ("baseline: runs disagree: p99.9 549-1117 ms across 3 runs (2.0x).",)


def test_three_groups_mark_overlaps_and_end_to_end():
    mid = group("+gc.freeze", (900, 600, 1000), 30, SHARE_BASE, pre=100, eager=500)
    v = verdict(cmp(BASE, mid, WM))
    # [549-1117] and [600-1000] overlap; no cause fell by 5 points (same shares), so the
    # cause holding the most of +gc.freeze's tail is named (preemption, 46%); TTFT p50
    # rose 26 -> 30, which a change names in any comparison
    assert v.findings[1] == (
        "+gc.freeze: cut median p99.9 from 986 to 900 ms (the runs' ranges overlap); "
        "preemption holds 46% of tail time; TTFT p50 rose 26 -> 30 ms."
    )
    # 900 -> 56, ranges [600-1000] and [50-70] apart: a clear cut names no holder; TTFT
    # p50 rose 30 -> 62
    assert v.findings[2] == (
        "+admit watermark: cut median p99.9 from 900 to 56 ms; preemption 46% -> 2% of "
        "tail time; TTFT p50 rose 30 -> 62 ms."
    )
    # first against last: 986 / 56 = 17.6x lower
    assert v.findings[3] == (
        "+admit watermark against baseline: median p99.9 986 -> 56 ms (17.6x lower); "
        "TTFT p50 rose 26 -> 62 ms."
    )


def test_caveats_name_a_missing_cause_one_run_groups_and_regime_misses():
    quiet = group("baseline", (40, 35, 45), 20, {"prefill": 0.3, "forward": 0.7}, runs=1,
                  misses=("b.npz: 0 preemptions (the run needs >= 1): raise --load",))  # fmt: skip
    v = verdict(cmp(quiet))
    assert v.findings == (
        "baseline: prefill owns 30% of tail time (0 preemptions, 0 eager steps); "
        "median p99.9 40 ms.",
    )
    assert v.caveats == (
        "baseline: one run, so no spread to judge the figures by.",
        "baseline: no preemption in the median run: a fix aimed at preemption has nothing "
        "to act on here.",
        "baseline: no eager step in the median run: a fix aimed at graph misses has nothing "
        "to act on here.",
        "regime not reached: b.npz: 0 preemptions (the run needs >= 1): raise --load.",
    )


def test_regime_misses_read_the_runs_expectations():
    run = SimpleNamespace(
        path="a.npz",
        config={"expect": {"preemptions": 1, "eager_steps": 1}, "expect_hint": "raise --load"},
        preemptions=0,
        eager_steps=5,
    )
    assert regime_misses(run) == ["a.npz: 0 preemptions (the run needs >= 1): raise --load"]
    run.preemptions = 3
    assert regime_misses(run) == []
    assert regime_misses(SimpleNamespace(path="b", config={}, preemptions=0)) == []


def stall_log():
    """Three requests emit at the end of every 10 ms step, except step 5, which holds a
    100 ms GC pause (110 ms long), and step 8, which holds a 50 ms tokenizer call (60 ms).
    So the gaps closed by step 5 are 110 ms each (primary gc), by step 8 60 ms (primary
    tok), all others 10 ms (clean). A 0.5 ms GC pause in step 2 is too short to mark."""
    b = LogBuilder()
    t = 0.0
    for k in range(10):
        dur = {5: 110.0, 8: 60.0}.get(k, 10.0)
        s = b.step(t, t + dur, n_decode=3, graph=4)
        if k == 5:
            b.gc(t + 5, t + 105, 2)
        if k == 8:
            b.seg(s, "tok", t, t + 50)
        b.seg(s, "decode", t + dur - 10 + (0.5 if k == 2 else 0), t + dur)
        if k == 2:
            b.gc(t, t + 0.5, 0)
        for r in range(3):
            b.emit(r, t + dur, s)
        t += dur
    return b.build(config={"rung": "x"})


def test_gaps_closed_by_one_step_with_one_cause_are_one_stall():
    log = stall_log()
    p = partition(log)
    events = stall_events(p, np.arange(len(p)))
    # 9 steps close gaps (steps 1..9), each an event of its three requests' gaps
    assert len(events) == 9 and all(len(e) == 3 for e in events)
    first, second = events[0], events[1]
    assert set(p.step1[first].tolist()) == {5} and set(p.primary_names()[first]) == {"gc"}
    assert np.allclose(p.gap_ms[first], 110.0)
    assert set(p.step1[second].tolist()) == {8} and set(p.primary_names()[second]) == {"tok"}
    # worst_stalls keeps the tail (>= p99 of 27 gaps: the three 110 ms gaps): one event
    stalls = worst_stalls(log, p, 5)
    assert len(stalls) == 1
    s = stalls[0]
    assert s["num_requests"] == 3 and sorted(s["requests"]) == sorted(
        log.request_ids or ["0", "1", "2"]
    )
    assert s["primary"] == "gc" and abs(s["gap_ms"] - 110.0) < 1e-9 and s["num_steps"] == 1


def test_itl_series_keeps_the_tail_and_thins_the_rest():
    log = stall_log()
    s = itl_series(log, max_points=5)
    assert s["num_gaps"] == 27
    # the three tail gaps (110 ms) plus two of the other 24, evenly picked, in time order
    assert len(s["gap_ms"]) == 5 and sum(abs(g - 110.0) < 1e-9 for g in s["gap_ms"]) == 3
    assert s["t_s"] == sorted(s["t_s"])
    # GC marks: only the 100 ms pause (the 0.5 ms one is under 1 ms)
    assert s["gc_generation"] == [2] and abs(s["gc_ms"][0] - 100.0) < 1e-9
    assert len(itl_series(log)["gap_ms"]) == 27  # a short run keeps every gap


def test_a_change_too_small_to_print_names_no_direction():
    # 429.9 and 430.3 both print as 430 (ms >= 10: no decimals), TTFT 9.51 and 9.49 both
    # as 9.5 (one decimal under 10 ms): "raised from 430 to 430" would read as a change
    same = group("+same", (430.3, 420, 440), 9.49, SHARE_BASE, pre=100, eager=500)
    base = group("baseline", (429.9, 420, 440), 9.51, SHARE_BASE, pre=100, eager=500)
    v = verdict(cmp(base, same))
    # not a clear cut: the holder of the tail is named (preemption 46%)
    assert v.findings[1] == (
        "+same: left median p99.9 at 430 ms (the runs' ranges overlap); "
        "preemption holds 46% of tail time; TTFT p50 unchanged at 9.5 ms."
    )


def test_a_rung_that_does_not_cut_p999_names_what_holds_the_tail():
    # gc fell 10% -> 0% (the largest fall), p99.9 rose 500 -> 510 with ranges overlapping:
    # the fallen cause is named, then the holder of the later tail (prefill 60%); TTFT
    # p50 fell 30 -> 28, so no TTFT clause in a three-group comparison
    base = group("baseline", (500, 450, 560), 30, {"prefill": 0.55, "gc": 0.10, "forward": 0.35})
    fix = group("+gc.freeze", (510, 460, 570), 28, {"prefill": 0.60, "gc": 0.0, "forward": 0.40})
    v = verdict(cmp(base, fix, WM))
    assert v.findings[1] == (
        "+gc.freeze: raised median p99.9 from 500 to 510 ms (the runs' ranges overlap); "
        "gc 10% -> 0% of tail time; prefill holds 60% of tail time."
    )


def test_a_fallen_cause_that_still_holds_the_tail_is_named_as_its_holder():
    # prefill fell 70% -> 60% (the only fall), p99.9 overlapping 500 -> 490: prefill is
    # both the cause that fell and the one that holds the most of the later tail
    base = group("baseline", (500, 450, 560), 30, {"prefill": 0.70, "forward": 0.30})
    fix = group("+budget", (490, 440, 550), 30, {"prefill": 0.60, "forward": 0.40})
    v = verdict(cmp(base, fix, WM))
    assert v.findings[1] == (
        "+budget: cut median p99.9 from 500 to 490 ms (the runs' ranges overlap); "
        "prefill 70% -> 60% of tail time; prefill holds 60% of tail time."
    )
