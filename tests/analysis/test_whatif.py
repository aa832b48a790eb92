"""The what-if models of docs/whatif.md on hand-built logs, and the fast implementations
against the slow ones.

Every expected number is derived in the comment above it from docs/whatif.md (times in ms;
percentiles are numpy's linear ones: with n sorted values, p at position (n-1)*p/100)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from logbuilder import LogBuilder
from test_partition_properties import random_logs

from tracekit.analysis import fix_first as F
from tracekit.analysis import whatif as W
from tracekit.analysis.compare import Spread
from tracekit.attribution.itl import partition
from tracekit.attribution.ttft import ttft_partition


def run(log):
    """The what-if of every removal; on these small logs also checks that the second-order
    model equals its slow reference."""
    p, t = partition(log), ttft_partition(log)
    w = W.whatif(log, p, t)
    for r in W.removals(p, t):
        ref = W.second_order_reference(log, p, t, r).figures
        fast = w.get(r.name, W.SECOND).figures
        assert fast == pytest.approx(ref, abs=1e-9, nan_ok=True), r.name
    return w, p, t


def fig(w, name, model):
    return w.get(name, model).figures


def test_gc_pause_over_a_whole_batch():
    # Three requests decode together. Steps: [0,10] decode, all emit at 10; [10,70] decode
    # [10,20] then a GC pause [20,70], all emit at 70; [70,80] decode, all emit at 80.
    # Gaps: three of [10,70] = 60 (gc 50, forward 10), three of [70,80] = 10.
    # Measured: sorted 10,10,10,60,60,60: p50 at 2.5 -> 35; p99 at 4.95 -> 60; max 60.
    # Removing gc. First order: each 60 loses its 50 -> six gaps of 10. Second order: the
    # pause is removable at rate 1 (no device window holds it), so R jumps by 50 over
    # [20,70]: the step [10,70] replays as 10 ms, each gap across it loses 50, the gaps after
    # it lose nothing (R(80) - R(70) = 0): six gaps of 10 again. One step shorter, not each gap
    # independently: the replayed emission times are 10, 20, 30.
    # TTFT: request 3 arrives at 30 (inside the pause) and gets its first token at 80:
    # TTFT 50, gc part 40 (pause after arrival); both models: 50 - 40 = 10.
    b = LogBuilder()
    s0 = b.step(0, 10, n_decode=3)
    b.seg(s0, "decode", 0, 10)
    s1 = b.step(10, 70, n_decode=3)
    b.seg(s1, "decode", 10, 20)
    b.gc(20, 70)
    s2 = b.step(70, 80, n_decode=4)
    b.seg(s2, "decode", 70, 80)
    for r in range(3):
        b.emit(r, 10, s0)
        b.emit(r, 70, s1)
        b.emit(r, 80, s2)
    b.emit(3, 80, s2)
    w, p, t = run(b.build(arrivals_ms=[0, 0, 0, 30]))
    assert w.measured["itl_p50_ms"] == pytest.approx(35.0)
    assert w.measured["itl_p99_ms"] == pytest.approx(60.0)
    for model in W.MODELS:
        f = fig(w, "gc", model)
        assert f["itl_p50_ms"] == pytest.approx(10.0)
        assert f["itl_p99_ms"] == pytest.approx(10.0)
        assert f["itl_max_ms"] == pytest.approx(10.0)
        assert f["ttft_p99_ms"] == pytest.approx(10.0)
        assert w.get("gc", model).removed_ms == pytest.approx(150.0)
    bounds, cum = W.replay_removed(W.removable_windows(b.build(), p, ("gc",)), True)
    replayed = np.array([10, 70, 80]) * 1e-3 - np.interp(np.array([10, 70, 80]) * 1e-3, bounds, cum)
    np.testing.assert_allclose(replayed * 1e3, [10, 20, 30], atol=1e-9)


def test_stall_hidden_under_a_longer_one():
    # Two requests. Steps [0,10] decode (both emit at 10); [10,40]: prefill [10,30] on the
    # loop thread, a tokenizer call [12,18] on thread 1 under it, decode [30,40], both emit
    # at 40; [40,50] decode, both emit at 50.
    # Partition of each [10,40] gap (30): tok owns [12,18] by precedence = 6, prefill 14,
    # forward 10. Gaps: 30, 30, 10, 10; max 30.
    # Removing tok. First order: 30 - 6 = 24 (max 24). Second order: [12,18] is also covered
    # by the prefill (f = 0), so nothing is removable: max stays 30.
    # Removing prefill. First order: 30 - 14 = 16. Second order: [10,12] and [18,30] are
    # prefill alone (f = 1): 14 removable; [12,18] has the tokenizer (f = 0): 16 as well.
    b = LogBuilder()
    s0 = b.step(0, 10, n_decode=2)
    b.seg(s0, "decode", 0, 10)
    s1 = b.step(10, 40, n_decode=2)
    b.seg(s1, "prefill", 10, 30)
    b.seg(s1, "tok", 12, 18, thread=1)
    b.seg(s1, "decode", 30, 40)
    s2 = b.step(40, 50, n_decode=2)
    b.seg(s2, "decode", 40, 50)
    for r in range(2):
        b.emit(r, 10, s0)
        b.emit(r, 40, s1)
        b.emit(r, 50, s2)
    w, p, _ = run(b.build())
    assert p.column("tok")[p.gap_ms > 20] == pytest.approx([6.0, 6.0])
    assert fig(w, "tok", W.FIRST)["itl_max_ms"] == pytest.approx(24.0)
    assert fig(w, "tok", W.SECOND)["itl_max_ms"] == pytest.approx(30.0)
    assert fig(w, "prefill", W.FIRST)["itl_max_ms"] == pytest.approx(16.0)
    assert fig(w, "prefill", W.SECOND)["itl_max_ms"] == pytest.approx(16.0)
    # the host family (gc, tok, graph) is tok alone here
    assert fig(w, "host", W.SECOND)["itl_max_ms"] == pytest.approx(30.0)


def test_preemption_victim_waits_for_readmission():
    # Requests A (0) and B (1); B is preempted and re-prefilled on readmission.
    # step 0 [0,10]: decode; A and B emit at 10.
    # step 1 [10,25]: swap [10,15] (B's KV out; B evicted at 15), decode [15,25]; A emits 25.
    # step 2 [25,35]: decode; A emits at 35.
    # step 3 [35,58]: swap [35,40], B readmitted at 40, prefill [40,48] of B (8 tokens: its
    #   readmission prefill), decode [48,58]; A and B emit at 58.
    # Partition. A: [10,25] 15 = preempt 5 (swap) + forward 10; [25,35] 10; [35,58] 23 =
    # preempt 5 + prefill 8 + forward 10. B: [10,58] 48 = evicted [15,40] 25 + swap [10,15] 5
    # -> preempt 30; prefill 8; forward 10.
    # Measured gaps 15, 10, 23, 48: sorted 10,15,23,48: max 48, p50 at 1.5 -> 19.
    # Removing preempt, first order: A 10, 10, 18; B 48 - 30 = 18: max 18, p50 at 1.5 -> 14.
    # Second order: removable windows: both swaps (f = 1) and the prefill of step 3 (its only
    # chunk is B's, after B's eviction: f = 1). R(15) = R(25) = R(35) = 5, R(40) = 10,
    # R(48) = R(58) = 18. A: 15 - 5 = 10; 10 - 0 = 10; 23 - (18 - 5) = 10.
    # B is split at the ends of the steps that ended while it was out (15, 40): 25 and 35:
    # points 10, 25, 35, 58 replay to 10, 20, 30, 40: gaps 10, 10, 10.
    # So 6 gaps, all 10: max 10, p50 10. The second model sees the victim's missed tokens and
    # its readmission prefill; the first keeps B's gap at 18.
    b = LogBuilder()
    s0 = b.step(0, 10, n_decode=2)
    b.seg(s0, "decode", 0, 10)
    s1 = b.step(10, 25, n_decode=1, preempted=1)
    b.seg(s1, "swap", 10, 15)
    b.seg(s1, "decode", 15, 25)
    b.evict(1, 15, 40)
    s2 = b.step(25, 35, n_decode=1)
    b.seg(s2, "decode", 25, 35)
    s3 = b.step(35, 58, n_decode=2, n_prefill=8, swapped=1)
    b.seg(s3, "swap", 35, 40)
    b.seg(s3, "prefill", 40, 48)
    b.prefill(s3, 1, 8)
    b.seg(s3, "decode", 48, 58)
    b.emit(0, 10, s0)
    b.emit(1, 10, s0)
    b.emit(0, 25, s1)
    b.emit(0, 35, s2)
    b.emit(0, 58, s3)
    b.emit(1, 58, s3)
    w, p, _ = run(b.build())
    assert sorted(p.gap_ms.tolist()) == pytest.approx([10, 15, 23, 48])
    assert w.measured["itl_max_ms"] == pytest.approx(48.0)
    assert w.measured["itl_p50_ms"] == pytest.approx(19.0)
    first = w.get("preempt", W.FIRST)
    assert first.figures["itl_max_ms"] == pytest.approx(18.0)
    assert first.figures["itl_p50_ms"] == pytest.approx(14.0)
    assert first.num_gaps == 4
    second = w.get("preempt", W.SECOND)
    assert second.num_gaps == 6
    assert second.figures["itl_max_ms"] == pytest.approx(10.0)
    assert second.figures["itl_p50_ms"] == pytest.approx(10.0)
    # the memory family is preempt's ITL labels: the same ITL figures
    assert fig(w, "memory", W.SECOND)["itl_max_ms"] == pytest.approx(10.0)


def test_a_wait_behind_preempted_requests_goes_with_preemption_in_the_second_model():
    # One request arrives at 0; the step [0,10] states it waits (preempted_first), it is
    # admitted at 10 and its first token comes at 20 (step [10,20], prefill [10,20]).
    # TTFT 20 = wait_preempted_first 10 (the wait window [0,10]) + prefill_own 10.
    # First order, preempt: the TTFT's preempt part is 0 -> 20. Second order also removes
    # the wait behind preempted requests: 20 - 10 = 10 (no engine time in [0,20] is
    # removable: step 0 has no window, the prefill is f = 0).
    b = LogBuilder()
    s0 = b.step(0, 10, n_decode=0, graph=-1)
    b.wait(s0, 0, "preempted_first")
    b.admit(0, 10)
    s1 = b.step(10, 20, n_decode=0, n_prefill=10, graph=-1)
    b.seg(s1, "prefill", 10, 20)
    b.prefill(s1, 0, 10)
    b.emit(0, 20, s1)
    w, _, t = run(b.build())
    assert t.ttft_ms == pytest.approx([20.0])
    assert fig(w, "preempt", W.FIRST)["ttft_p50_ms"] == pytest.approx(20.0)
    assert fig(w, "preempt", W.SECOND)["ttft_p50_ms"] == pytest.approx(10.0)


def test_only_causes_with_time_are_listed_but_any_label_can_be_named():
    # one step, decode only: no cause has time, so nothing is listed by default; `gc` (a
    # standard label with 0 ms) can still be asked for, and changes nothing
    b = LogBuilder()
    s0 = b.step(0, 10)
    b.seg(s0, "decode", 0, 10)
    b.emit(0, 10, s0)
    b.emit(0, 20, b.step(10, 20))
    log = b.build()
    p, t = partition(log), ttft_partition(log)
    assert W.removals(p, t) == []
    w = W.whatif(log, p, t, names=["gc"])
    assert w.get("gc", W.SECOND).figures["itl_max_ms"] == pytest.approx(10.0)


def test_unknown_removal_is_a_one_line_error_naming_the_choices():
    b = LogBuilder()
    s0 = b.step(0, 10)
    b.seg(s0, "decode", 0, 10)
    b.emit(0, 10, s0)
    log = b.build()
    with pytest.raises(W.WhatIfError, match="no cause or family 'swap'.*preempt"):
        W.whatif(log, partition(log), ttft_partition(log), names=["swap"])


def test_records_are_json_and_name_their_model_and_assumptions():
    b = LogBuilder()
    s0 = b.step(0, 10)
    b.seg(s0, "decode", 0, 10)
    b.emit(0, 10, s0)
    s1 = b.step(10, 20)
    b.gc(12, 14)
    b.emit(0, 20, s1)
    w, _, _ = run(b.build())
    recs = w.to_records()
    json.dumps(recs)
    # gc, and its family (host): one record per model each
    assert [(r["removal"], r["model"]) for r in recs] == [
        ("gc", "first"),
        ("gc", "second"),
        ("host", "first"),
        ("host", "second"),
    ]
    assert all(r["assumptions"] for r in recs)


def test_ladder_check_error_and_spread():
    # group a: runs of seeds 1 and 2 whose prediction of removing gc gives p99.9 10 and 20
    # (median 15); group b (fixes gc) measures 30 (seed 1) and 40 (seed 2): error
    # 15 - 35 = -20 ms, -20/35 of the measured median, outside [30, 40]. By seed:
    # (10 - 30)/30 = -2/3 and (20 - 40)/40 = -1/2: median -7/12.
    def wi(seed, measured_p999, pred_p999, fixes=None):
        m = {k: 1.0 for k in W.FIGURE_NAMES} | {"itl_p999_ms": measured_p999}
        r = W.Removal("gc", "cause", ("gc",), ("gc",))
        preds = tuple(
            W.Prediction(r, model, m | {"itl_p999_ms": pred_p999}, 0.0, 1) for model in W.MODELS
        )
        cfg = {"seed": seed} | ({"fixes": fixes} if fixes else {})
        return W.WhatIf("x", cfg, m, 1, preds)

    a = [wi(1, 50, 10), wi(2, 60, 20)]
    checks = W.ladder_checks([("a", a), ("b", [wi(1, 30, 0, "gc"), wi(2, 40, 0, "gc")])])
    c = next(c for c in checks if c.figure == "itl_p999_ms" and c.model == W.SECOND)
    assert (c.predicted.median, c.measured.median) == (15.0, 35.0)
    assert c.error_ms == pytest.approx(-20.0)
    assert c.error_frac == pytest.approx(-20 / 35)
    assert c.is_outside_spread
    assert c.paired_error_frac.median == pytest.approx(-7 / 12)
    assert (c.paired_error_frac.lo, c.paired_error_frac.hi) == pytest.approx((-2 / 3, -1 / 2))
    # a group whose runs name no fix is not checked
    assert W.ladder_checks([("a", a), ("b", [wi(1, 30, 0)])]) == []
    # a fix of a standard cause the runs before it had no time in: predicted unchanged
    # (p99.9 50 and 60: median 55, against 30 and 40 measured)
    c = W.ladder_checks([("a", a), ("b", [wi(1, 30, 0, "preempt"), wi(2, 40, 0, "preempt")])])
    c = next(x for x in c if x.figure == "itl_p999_ms" and x.model == W.FIRST)
    assert (c.fixes, c.predicted.median, c.measured.median) == ("preempt", 55.0, 35.0)
    # a name no run knows is not checked
    assert W.ladder_checks([("a", a), ("b", [wi(1, 30, 0, "nosuch")])]) == []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_logs(), st.integers(0, 2**31 - 1))
def test_fast_equals_reference(log, seed):
    # every removal of each random log: the vectorised first order against its loop
    # version, and the replayed timeline R(x) against the interval-by-interval walk
    p, t = partition(log), ttft_partition(log)
    rng = np.random.default_rng(seed)
    for r in W.removals(p, t, only_present=False):
        fast = W.first_order(p, t, r)
        ref = W.first_order_reference(p, t, r)
        for k in W.FIGURE_NAMES:
            a, b_ = fast.figures[k], ref.figures[k]
            assert (np.isnan(a) and np.isnan(b_)) or a == pytest.approx(b_, abs=1e-9)
        assert fast.removed_ms == pytest.approx(ref.removed_ms, abs=1e-9)
        w = W.removable_windows(log, p, r.itl_labels)
        is_gc = "gc" in r.itl_labels
        bounds, cum = W.replay_removed(w, is_gc)
        hi = float(max(w.end_s.max(initial=0.0), 1e-3))
        xs = np.concatenate([rng.uniform(-1e-3, hi + 1e-3, 8), p.t0_s, p.t1_s])
        got = np.interp(xs, bounds, cum)
        np.testing.assert_allclose(got, W.replay_removed_reference(w, is_gc, xs.tolist()),
                                   atol=1e-12)  # fmt: skip
        # removable time is never more than the time that passed
        assert (np.diff(got[np.argsort(xs)]) <= np.diff(np.sort(xs)) + 1e-12).all()
        second = W.second_order(log, p, t, r)
        second_ref = W.second_order_reference(log, p, t, r)
        assert second.num_gaps == second_ref.num_gaps
        assert second.removed_ms == pytest.approx(second_ref.removed_ms, abs=1e-6)
        for k in W.FIGURE_NAMES:
            a, b_ = second.figures[k], second_ref.figures[k]
            assert (np.isnan(a) and np.isnan(b_)) or a == pytest.approx(b_, abs=1e-6), k
        if len(p) and "preempt" not in r.itl_labels:  # (victims' gaps are split, not shrunk)
            assert second.figures["itl_max_ms"] <= float(p.gap_ms.max()) + 1e-9


# -- the CLI: whatif, and the what-if in compare and report ----------------------------------


def _gc_batch_log(with_gc: bool, config: dict):
    """test_gc_pause_over_a_whole_batch's run (without its late request), with or without
    the pause: without it the middle step is [10,20] and every later time 50 ms earlier."""
    b = LogBuilder()
    s0 = b.step(0, 10, n_decode=3)
    b.seg(s0, "decode", 0, 10)
    end = 70 if with_gc else 20
    s1 = b.step(10, end, n_decode=3)
    b.seg(s1, "decode", 10, 20)
    if with_gc:
        b.gc(20, 70)
    s2 = b.step(end, end + 10, n_decode=3)
    b.seg(s2, "decode", end, end + 10)
    for r in range(3):
        b.emit(r, 10, s0)
        b.emit(r, end, s1)
        b.emit(r, end + 10, s2)
    return b.build(config=config)


@pytest.fixture
def ladder(tmp_path):
    """Two rungs x two seeds: `base` has a 50 ms GC pause over a whole batch; `+no gc`
    (config fixes: gc) is the same run without it."""
    paths = []
    for seed in (1, 2):
        for i, (rung, gc) in enumerate((("base", True), ("+no gc", False))):
            cfg = {"rung": rung, "rung_index": i, "seed": seed} | ({} if gc else {"fixes": "gc"})
            paths.append(str(_gc_batch_log(gc, cfg).save(tmp_path / f"r{i}s{seed}.npz")))
    return paths


def test_cli_whatif_table_jsonl_and_help(ladder):
    from click.testing import CliRunner

    from tracekit.cli import main

    runner = CliRunner()
    h = runner.invoke(main, ["whatif", "--help"])
    assert h.exit_code == 0 and "First order" in h.output and "Second order" in h.output
    r = runner.invoke(main, ["whatif", ladder[0]])
    assert r.exit_code == 0, r.output
    assert "(as measured)" in r.stdout and "ASSUMPTIONS" in r.stdout
    # the measured p99.9 of gaps 10,10,10,60,60,60 is 60; without gc every gap is 10: -83%
    row = next(x for x in r.stdout.splitlines() if x.startswith("gc ") and " second " in x)
    assert "10.0 (-83%)" in row
    j = runner.invoke(main, ["whatif", ladder[0], "--format", "jsonl", "--remove", "gc"])
    recs = [json.loads(x) for x in j.stdout.splitlines()]
    assert [(x["removal"], x["model"]) for x in recs] == [("gc", "first"), ("gc", "second")]
    assert recs[1]["itl_p999_ms"] == pytest.approx(10.0)
    assert recs[1]["change_itl_p999_ms"] == pytest.approx(-50.0)
    bad = runner.invoke(main, ["whatif", ladder[0], "--remove", "nosuch"])
    assert bad.exit_code == 2
    assert "no cause or family 'nosuch'" in bad.output and len(bad.output.splitlines()) == 1


def test_cli_compare_checks_each_rung_against_the_prediction(ladder):
    from click.testing import CliRunner

    from tracekit.cli import main

    runner = CliRunner()
    r = runner.invoke(main, ["compare", *ladder, "--order-by", "rung_index"])
    assert r.exit_code == 0, r.output
    assert "WHAT-IF AGAINST THE LADDER" in r.stdout
    # predicted from base (every gap 10 without gc) against +no gc's runs (every gap 10)
    row = next(x for x in r.stdout.splitlines() if x.startswith("base -> +no gc") and "p99.9" in x)
    assert "10.0 [10.0-10.0]" in row and "yes" in row
    verdict = r.stdout.split("VERDICT")[1].splitlines()[1]
    assert verdict.startswith("- What to fix first in base: gc.")
    assert "10 ms instead of 60 (-83%" in verdict
    j = runner.invoke(main, ["compare", *ladder, "--order-by", "rung_index", "--format", "jsonl"])
    recs = [json.loads(x) for x in j.stdout.splitlines()]
    assert recs[0]["whatif_check"] == []
    checks = recs[1]["whatif_check"]
    assert {(c["figure"], c["model"]) for c in checks} == {
        (f, m) for f in W.LADDER_FIGURES for m in W.MODELS
    }
    assert all(
        c["error_ms"] == pytest.approx(0.0, abs=1e-9) for c in checks if "itl" in c["figure"]
    )


def test_report_opens_its_verdict_with_what_to_fix_first(ladder, tmp_path):
    from click.testing import CliRunner

    from tracekit.cli import main

    out = tmp_path / "r.html"
    r = CliRunner().invoke(main, ["report", *ladder, "--order-by", "rung_index", "-o", str(out)])
    assert r.exit_code == 0, r.output
    page = out.read_text()
    first = page.split("<ul class=verdict><li>")[1]
    assert first.startswith("What to fix first in base: gc.")
    assert '<section id="tk-whatif">' in page
    assert page.index('id="tk-verdict"') < page.index('id="tk-whatif"') < page.index("<h2>Runs")


def test_fix_first_ranks_by_gain_and_quotes_the_ladder_error_of_the_cause_or_its_family():
    # one run at p99.9 100 ms: without tok 40 (gain 60%), without gc 90 (10%). The ladder
    # checked gc (error +20%) and nothing else: tok, a host cause like gc, gets gc's error
    # as "host causes"; gc gets its own.
    m = {k: 1.0 for k in W.FIGURE_NAMES} | {"itl_p999_ms": 100.0}

    def pred(name, v):
        r = W.Removal(name, "cause", (name,), (name,))
        return W.Prediction(r, W.SECOND, m | {"itl_p999_ms": v}, 0.0, 1)

    w = W.WhatIf("x", {}, m, 1, (pred("tok", 40.0), pred("gc", 90.0)))
    check = W.LadderCheck(
        "a", "b", "gc", "itl_p999_ms", W.SECOND, Spread.of([120.0]), Spread.of([100.0])
    )
    tok, gc = F.fix_first([w], [check])
    assert (tok.name, tok.gain_frac.median, tok.ladder_basis) == ("tok", 0.6, "host causes")
    assert gc.ladder_basis == "gc" and gc.ladder_error_frac.median == pytest.approx(0.2)
    s = F.fix_first_sentence([tok, gc], "base")
    assert s.startswith("What to fix first in base: tok. Without it p99.9 would be 40 ms ")
    assert "instead of 100 (-60%; second-order model)" in s
    assert "predictions for host causes were off by +20% (1 rung)" in s
    assert s.endswith("Next: gc (-10%).")
    # nothing that lowers p99.9: said so
    assert "no removable cause" in F.fix_first_sentence([])


def test_removing_prefill_never_removes_an_unsplit_ttfts_prefill():
    # docs/whatif.md, "What is removed": the ITL cause `prefill` is others' prefill in a
    # TTFT (`prefill_other`); an unsplit TTFT's `prefill` (own and others' mixed) is never
    # removed. Requests 0 and 1 (no admission rows: unsplit) arrive at 0. Step [0,30]:
    # prefill [0,20], decode [20,30]; both emit at 30 (their first tokens). Steps [30,40]
    # and [40,50]: decode; both emit at 40 and 50. Gaps: four of 10, all `forward`.
    # TTFTs: two of [0,30] = 30, each prefill 20 (unsplit) and decode_other 10
    # (docs/ttft.md). First order, removing `prefill`: no gap has prefill time (every gap
    # keeps 10) and no TTFT has `prefill_other`, so both TTFTs keep 30: p50 30, p99 30
    # (taking the unsplit `prefill` off too would give 10).
    b = LogBuilder()
    s0 = b.step(0, 30, n_decode=0, n_prefill=8)
    b.seg(s0, "prefill", 0, 20)
    b.seg(s0, "decode", 20, 30)
    s1 = b.step(30, 40, n_decode=2)
    b.seg(s1, "decode", 30, 40)
    s2 = b.step(40, 50, n_decode=2)
    b.seg(s2, "decode", 40, 50)
    for r in range(2):
        b.emit(r, 30, s0)
        b.emit(r, 40, s1)
        b.emit(r, 50, s2)
    log = b.build(arrivals_ms=[0, 0])
    p, t = partition(log), ttft_partition(log)
    np.testing.assert_allclose(t.ttft_ms, [30.0, 30.0])
    np.testing.assert_allclose(t.parts_ms[:, t.labels.index("prefill")], [20.0, 20.0])
    r = W.find_removal(p, t, "prefill")
    assert "prefill" not in r.ttft_labels  # others' prefill (`prefill_other`) only
    first = W.first_order(p, t, r).figures
    assert first["ttft_p50_ms"] == pytest.approx(30.0)
    assert first["ttft_p99_ms"] == pytest.approx(30.0)
    assert first["itl_max_ms"] == pytest.approx(10.0)


def test_markdown_whatif_writes_a_cause_name_as_literal_text():
    # a cause label from the log with a pipe, a newline and markdown's specials: every row
    # of the markdown table keeps the header's column count (no unescaped `|`) and one line
    from tracekit.render.whatif import whatif_table

    b = LogBuilder()
    s0 = b.step(0, 10, n_decode=1)
    b.seg(s0, "decode", 0, 10)
    s1 = b.step(10, 40, n_decode=1)
    b.seg(s1, "evil|cause\n| x | *y*", 10, 30)
    b.seg(s1, "decode", 30, 40)
    b.emit(0, 10, s0)
    b.emit(0, 40, s1)
    log = b.build(arrivals_ms=[0])
    p, t = partition(log), ttft_partition(log)
    md = whatif_table([W.whatif(log, p, t)], md=True)
    table = [ln for ln in md.splitlines() if ln.startswith("|")]
    cols = len(W.FIGURE_NAMES) + 3
    unescaped = [ln.replace("\\|", "") for ln in table]
    assert len(table) >= 4  # header, rule, as measured, the cause's rows
    assert all(ln.count("|") == cols + 1 for ln in unescaped), table
    assert any("evil\\|cause" in ln for ln in table)


def test_the_verdict_quotes_the_worst_figures_ladder_error_too():
    # the ladder checked gc on two figures: p99.9 predicted 120 against 100 measured
    # (+20%), TTFT p50 predicted 6 against 100 (-94%). The sentence quotes p99.9's error,
    # then the worst figure's: TTFT p50, -94%.
    m = {k: 100.0 for k in W.FIGURE_NAMES}
    r = W.Removal("gc", "cause", ("gc",), ("gc",))
    w = W.WhatIf("x", {}, m, 1, (W.Prediction(r, W.SECOND, m | {"itl_p999_ms": 50.0}, 0.0, 1),))
    checks = [
        W.LadderCheck("a", "b", "gc", fig, W.SECOND, Spread.of([p]), Spread.of([100.0]))
        for fig, p in (("itl_p999_ms", 120.0), ("ttft_p50_ms", 6.0), ("itl_p99_ms", 60.0))
    ]
    (gc,) = F.fix_first([w], checks)
    assert gc.worst_figure == "ttft_p50_ms"
    assert gc.worst_error_frac.median == pytest.approx(-0.94)
    s = F.fix_first_sentence([gc])
    assert (
        "predictions for gc were off by +20% (1 rung). Its worst figure there: TTFT p50, "
        "off by -94%." in s
    )


def test_the_os_is_a_family_and_the_verdict_says_when_it_holds_the_tail():
    # a run with OS evidence: every OS label of the ITL and TTFT partitions (the loop's,
    # a rank's, the API server's) is in the `os` family, each removable by itself
    m = {k: 100.0 for k in W.FIGURE_NAMES}
    for lb in ("os_runqueue", "os_blocked", "rank1:os_runqueue", "frontend_os_blocked"):
        assert W.family_of(lb) == "os", lb
    assert W.family_of("forward") is None and W.family_of("rank1:forward") is None
    r = W.Removal("os_runqueue", "cause", ("os_runqueue",), ("os_runqueue",))
    w = W.WhatIf("x", {}, m, 1, (W.Prediction(r, W.SECOND, m | {"itl_p999_ms": 40.0}, 0.0, 1),))
    (f,) = F.fix_first([w])
    assert f.family == "os"
    s = F.fix_first_sentence([f])
    assert s.startswith("What to fix first: os_runqueue.")
    assert "The OS, not the engine, holds this tail" in s


def test_removing_the_os_family_takes_the_os_time_out_of_each_gap():
    # Steps [0,10] and [10,20], one decode segment each, request 0 emits at 10 and 20:
    # one gap [10,20] = 10. The loop thread's counters at the steps' ends (CPU, run-queue
    # wait, ms totals): 0/0 at 0, 10/0 at 10 (step start and end), 16/4 at 20: the second
    # step ran 6 ms on the CPU and waited 4 ms for one (docs/partition.md, "OS evidence",
    # rule 1: os_runqueue 4, the rest forward 6). First order without `os`: 10 - 4 = 6.
    # Second order (docs/whatif.md, "Removing the OS"): the run-queue share of [10,20] is
    # 4/10, no window is removed (f = 0), so R(20) - R(10) = 10 * 0.4 = 4: the gap 6 too, and
    # the replayed emission times are 10 and 16.
    from tracekit.log.rawlog import OS_STEP_END, OS_STEP_START

    b = LogBuilder()
    s0 = b.step(0, 10, n_decode=1)
    b.seg(s0, "decode", 0, 10)
    s1 = b.step(10, 20, n_decode=1)
    b.seg(s1, "decode", 10, 20)
    b.emit(0, 10, s0)
    b.emit(0, 20, s1)
    for t, cpu, rq, kind in ((0, 0, 0, OS_STEP_START), (10, 10, 0, OS_STEP_END),
                             (10, 10, 0, OS_STEP_START), (20, 16, 4, OS_STEP_END)):  # fmt: skip
        b.os_sample(t, cpu, rq, kind=kind)
    log = b.build(arrivals_ms=[0])
    p, t = partition(log), ttft_partition(log)
    assert p.parts_ms[0, p.labels.index("os_runqueue")] == pytest.approx(4.0)
    fam = next(r for r in W.removals(p, t) if r.name == "os")
    assert fam.kind == "family" and "os_runqueue" in fam.itl_labels
    assert W.first_order(p, t, fam).figures["itl_max_ms"] == pytest.approx(6.0)
    assert W.first_order(p, t, W.find_removal(p, t, "os_runqueue")).figures[
        "itl_max_ms"
    ] == pytest.approx(6.0)
    w, _, _ = run(log)  # the second order, checked against its slow reference
    for name in ("os", "os_runqueue"):
        assert fig(w, name, W.SECOND)["itl_max_ms"] == pytest.approx(6.0), name
    assert w.get("os_blocked", W.SECOND) is None  # no time in any gap: not listed
    second = W.second_order(log, p, t, W.find_removal(p, t, "os_blocked")).figures
    assert second["itl_max_ms"] == pytest.approx(10.0)  # nothing of it to take
    bounds, cum = W.os_removed(log, ("os_runqueue",))
    replayed = np.array([10.0, 20.0]) - np.interp([10e-3, 20e-3], bounds, cum) * 1e3
    np.testing.assert_allclose(replayed, [10.0, 16.0], atol=1e-9)


def test_removing_preemption_takes_others_re_prefill_from_their_prefill_too():
    """A recompute eviction's re-prefill is its victim's `preempt` and others' `prefill`
    (docs/partition.md, "Who evicted whom"); without the eviction neither happens. r0 is
    evicted 12-21 and re-prefills [21, 31]; r1 runs beside it. Gaps: r0 [10, 40] (preempt
    9 + 10), r1 [10, 20] and [20, 40] (prefill 10: r0's re-prefill). First order without
    preempt: 30 - 19 = 11, 10, and 20 - 10 = 10: max 11, 29 ms removed. Without prefill:
    r1's [20, 40] loses its 10, r0's gap keeps its own re-prefill: max 30."""
    b = LogBuilder()
    b.step(0, 10)
    b.seg(0, "decode", 0, 10)
    b.emit(0, 10, 0)
    b.emit(1, 10, 0)
    b.step(10, 20)
    b.seg(1, "decode", 12, 20)
    b.emit(1, 20, 1)
    b.step(20, 40)
    b.seg(2, "recompute", 21, 31)
    b.seg(2, "decode", 31, 40)
    b.emit(0, 40, 2)
    b.emit(1, 40, 2)
    b.evict(0, 12, 21, mode=1)
    log = b.build()
    p, t = partition(log), ttft_partition(log)
    rm = {r.name: r for r in W.removals(p, t, only_present=False)}
    for fn in (W.first_order, W.first_order_reference):
        pre = fn(p, t, rm["preempt"])
        assert pre.figures["itl_max_ms"] == pytest.approx(11.0, abs=1e-9)
        assert pre.removed_ms == pytest.approx(29.0, abs=1e-9)
        assert fn(p, t, rm["prefill"]).figures["itl_max_ms"] == pytest.approx(30.0, abs=1e-9)


def test_a_cause_that_float_rounding_left_a_hair_from_zero_is_not_listed():
    # docs/whatif.md: the removals listed are the causes with more than 1e-9 ms in some gap
    # or TTFT. A TTFT of a window read in slices had tok at +4.3e-19 ms where the whole
    # run's had 0: both list no `tok`. Two rows: tok +4.3e-19 and -1.3e-17, gc 0 and
    # 2e-9 (above the threshold), prefill 5 and 0.
    parts = np.array([[4.3e-19, 0.0, 5.0], [-1.3e-17, 2e-9, 0.0]])
    assert W.labels_with_time(["tok", "gc", "prefill"], parts) == {"gc", "prefill"}
    assert W.labels_with_time(["tok"], np.zeros((0, 1))) == set()
