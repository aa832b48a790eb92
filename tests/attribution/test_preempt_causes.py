"""Who evicted whom, gap by gap (docs/partition.md, "Who evicted whom"): every gap's
`preempt` part split into pieces that each name an eviction, summing to the part.

Hand cases: expected values derived from the rules on small logs (times in ms)."""

from __future__ import annotations

import pytest
from logbuilder import LogBuilder

from tracekit.attribution.evictions import eviction_causes, preempt_causes
from tracekit.attribution.itl import partition
from tracekit.log.validate import validate_log


def recompute_case() -> LogBuilder:
    """r1's decode evicts r0 (recompute, step 1, at 12 ms; 50 tokens lost); r0 is readmitted
    at 21 and re-prefills its 50 tokens in a `recompute` segment [21, 31] of step 2."""
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
    b.prefill(2, 0, 50)
    b.emit(0, 40, 2)
    b.emit(1, 40, 2)
    b.evict(0, 12, 21, mode=1)
    b.cause(0, 12, 1, "kv_full", by=(1,), lost=50, free=0, used=4)
    return b


def _pieces(log, request, t0_ms):
    p = partition(log)
    rows = [
        i
        for i in range(len(p))
        if p.request[i] == request and abs(p.t0_s[i] - t0_ms * 1e-3) < 1e-12
    ]
    (g,) = rows
    return p, g, preempt_causes(log, p).get(g, [])


def test_the_victims_own_gap_names_its_evicted_time_and_its_recompute():
    """r0's gap [10, 40]: evicted 12-21 (9 ms, rule 1) and its re-prefill 21-31 (10 ms,
    a `recompute` segment: preempt by the cause map) are its preempt part, 19 ms; both
    pieces name the eviction of r0 at step 1 by r1 (kv_full)."""
    log = validate_log(recompute_case().build())
    p, g, pieces = _pieces(log, 0, 10)
    assert p.column("preempt")[g] == pytest.approx(19.0, abs=1e-9)
    assert [(x["kind"], round(x["ms"], 9)) for x in pieces] == [
        ("evicted", 9.0),
        ("recompute", 10.0),
    ]
    for x in pieces:
        assert (x["victim"], x["step"], x["reason"], x["evictors"]) == ("r0", 1, "kv_full", ["r1"])
        assert x["evicted_at_s"] == pytest.approx(0.012)


def test_anothers_gap_names_the_recompute_it_sat_through():
    """r1's gap [20, 40] holds r0's re-prefill 21-31: 10 ms of preempt, named by the
    eviction that caused it (r0, evicted by r1 itself at step 1); its gap [10, 20] none."""
    log = validate_log(recompute_case().build())
    p, g, pieces = _pieces(log, 1, 20)
    assert p.column("preempt")[g] == pytest.approx(10.0, abs=1e-9)
    assert [(x["kind"], x["victim"], x["evictors"], round(x["ms"], 9)) for x in pieces] == [
        ("recompute", "r0", ["r1"], 10.0)
    ]
    _, g0, none = _pieces(log, 1, 10)
    assert none == []


def test_two_victims_re_prefilling_in_one_step_share_its_segment_by_tokens():
    """Step 2's `recompute` segment [21, 31] re-prefills r0 (30 tokens) and r2 (10 tokens):
    r1's gap [20, 40] gets 7.5 ms named r0's eviction and 2.5 ms named r2's (swap mode
    would be `swap`; both are recompute here); r2's eviction has no recorded cause."""
    b = recompute_case()
    b.prefills[-1] = (2, 0, 30)
    b.prefill(2, 2, 10)
    b.emit(2, 5, 0)
    b.emit(2, 40, 2)
    b.evict(2, 15, 21, mode=1)
    log = validate_log(b.build())
    _, g, pieces = _pieces(log, 1, 20)
    got = {(x["victim"], x["reason"], round(x["ms"], 9)) for x in pieces}
    assert got == {("r0", "kv_full", 7.5), ("r2", None, 2.5)}


def test_a_swap_segment_goes_to_the_eviction_in_its_step_and_unexplained_time_to_none():
    """A `swap` segment [12, 14] in step 1, where r0 was evicted (swap) at 12: r1's gap
    [10, 20] has 2 ms preempt named r0's eviction (kind swap). A second `swap` segment in
    step 2 [22, 23] with no eviction or readmission in that step: 1 ms, victim None."""
    b = LogBuilder()
    b.step(0, 10)
    b.emit(0, 10, 0)
    b.emit(1, 10, 0)
    b.step(10, 20)
    b.seg(1, "swap", 12, 14)
    b.emit(1, 20, 1)
    b.step(20, 30)
    b.seg(2, "swap", 22, 23)
    b.emit(1, 30, 2)
    b.evict(0, 12, mode=0)
    b.cause(0, 12, 1, "priority", by=(1,))
    log = validate_log(b.build())
    _, g, pieces = _pieces(log, 1, 10)
    assert [(x["kind"], x["victim"], x["reason"], round(x["ms"], 9)) for x in pieces] == [
        ("swap", "r0", "priority", 2.0)
    ]
    _, g2, pieces2 = _pieces(log, 1, 20)
    assert [(x["kind"], x["victim"], round(x["ms"], 9)) for x in pieces2] == [
        ("preempt", None, 1.0)
    ]


def test_the_eviction_table_joins_each_cause_and_the_victims_next_emission():
    log = validate_log(recompute_case().build())
    c = eviction_causes(log)
    assert c.request.tolist() == [0] and c.step.tolist() == [1] and c.reason.tolist() == [0]
    assert c.evictors == ((1,),) and c.num_computed_tokens_lost.tolist() == [50]
    assert c.t_next_s.tolist() == [pytest.approx(0.040)]


def test_pieces_sum_to_every_gaps_preempt_part_on_overlapping_evictions():
    """Two overlapping evictions of r0 (12-21 and 15-25): the union (12-25, 13 ms) is
    its evicted time; the earlier owns the overlap: 9 ms and 4 ms."""
    b = recompute_case()
    b.evict(0, 15, 25, mode=1)
    log = validate_log(b.build())
    p, g, pieces = _pieces(log, 0, 10)
    own = [(x["evicted_at_s"], round(x["ms"], 9)) for x in pieces if x["kind"] == "evicted"]
    assert own == [(pytest.approx(0.012), 9.0), (pytest.approx(0.015), 4.0)]
    assert sum(x["ms"] for x in pieces) == pytest.approx(p.column("preempt")[g], abs=1e-9)
