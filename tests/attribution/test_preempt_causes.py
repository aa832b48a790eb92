"""Who evicted whom, gap by gap (docs/partition.md, "Who evicted whom"): every gap's
`preempt` part split into pieces that each name an eviction, summing to the part.

Hand cases: expected values derived from the rules on small logs (times in ms)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from logbuilder import LogBuilder

from tracekit.attribution.evictions import (
    NamedWindows,
    eviction_causes,
    name_preempt,
    name_reprefill,
    preempt_causes,
    recompute_causes,
)
from tracekit.attribution.itl import partition
from tracekit.attribution.reprefill import stating_next_emissions
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
    """r0's gap [10, 40]: evicted 12-21 (9 ms, rule 1) and its own re-prefill 21-31 (10 ms,
    a `recompute` segment of step 2, where r0 re-prefills) are its preempt part, 19 ms;
    both pieces name the eviction of r0 at step 1 by r1 (kv_full); no prefill."""
    log = validate_log(recompute_case().build())
    p, g, pieces = _pieces(log, 0, 10)
    assert p.column("preempt")[g] == pytest.approx(19.0, abs=1e-9)
    assert p.column("prefill")[g] == pytest.approx(0.0, abs=1e-9)
    assert p.reprefill_own_ms[g] == pytest.approx(10.0, abs=1e-9)
    assert [(x["kind"], round(x["ms"], 9)) for x in pieces] == [
        ("evicted", 9.0),
        ("recompute", 10.0),
    ]
    for x in pieces:
        assert (x["victim"], x["step"], x["reason"], x["evictors"]) == ("r0", 1, "kv_full", ["r1"])
        assert x["evicted_at_s"] == pytest.approx(0.012)


def _named(log, request, t0_ms):
    """(partition, gap row, preempt pieces, recompute pieces) of one gap."""
    p, g, pieces = _pieces(log, request, t0_ms)
    return p, g, pieces, recompute_causes(log, p).get(g, [])


def test_anothers_gap_has_the_re_prefill_it_sat_through_as_its_prefill_named():
    """r1's gap [20, 40] holds r0's re-prefill 21-31: not r1's own (r0 re-prefills there:
    recompute mode, back at 21 by the step's end 40, no emission between 21 and the
    step's start 20), so it is r1's `prefill`, 10 ms, and its preempt part is 0; the
    recompute piece names the eviction that caused it (r0, evicted by r1 itself at step 1,
    kv_full). Its gap [10, 20] has neither."""
    log = validate_log(recompute_case().build())
    p, g, pieces, rc = _named(log, 1, 20)
    assert p.column("preempt")[g] == pytest.approx(0.0, abs=1e-9)
    assert p.column("prefill")[g] == pytest.approx(10.0, abs=1e-9)
    assert p.column("residual")[g] == pytest.approx(1.0, abs=1e-9)  # 20-21
    assert pieces == []
    assert [(x["kind"], x["victim"], x["step"], x["reason"], x["evictors"], round(x["ms"], 9))
            for x in rc] == [("recompute", "r0", 1, "kv_full", ["r1"], 10.0)]  # fmt: skip
    assert p.reprefill_other_ms[g] == pytest.approx(10.0, abs=1e-9)
    _, _, none, rc0 = _named(log, 1, 10)
    assert none == [] and rc0 == []


def test_two_victims_re_prefilling_in_one_step_share_its_segment_by_tokens():
    """Step 2's `recompute` segment [21, 31] re-prefills r0 (30 tokens) and r2 (10 tokens,
    evicted 15-21 with no recorded cause): shares 3/4 and 1/4.
    - r1 (no victim): its gap [20, 40] has the 10 ms as prefill, named 7.5 ms r0's eviction
      and 2.5 ms r2's.
    - r0: its gap [10, 40] has 9 ms evicted (12-21) and its own 7.5 ms re-prefill as
      preempt (16.5 ms), and r2's 2.5 ms as prefill.
    - r2: its gap [5, 40] has 6 ms evicted (15-21) and its own 2.5 ms as preempt (8.5 ms),
      r0's 7.5 ms as prefill."""
    b = recompute_case()
    b.prefills[-1] = (2, 0, 30)
    b.prefill(2, 2, 10)
    b.emit(2, 5, 0)
    b.emit(2, 40, 2)
    b.evict(2, 15, 21, mode=1)
    log = validate_log(b.build())
    p, g, pieces, rc = _named(log, 1, 20)
    assert pieces == [] and p.column("prefill")[g] == pytest.approx(10.0, abs=1e-9)
    assert {(x["victim"], x["reason"], round(x["ms"], 9)) for x in rc} == {
        ("r0", "kv_full", 7.5),
        ("r2", None, 2.5),
    }
    p, g, pieces, rc = _named(log, 0, 10)
    assert p.column("preempt")[g] == pytest.approx(16.5, abs=1e-9)
    assert p.column("prefill")[g] == pytest.approx(2.5, abs=1e-9)
    assert [(x["kind"], x["victim"], round(x["ms"], 9)) for x in pieces] == [
        ("evicted", "r0", 9.0),
        ("recompute", "r0", 7.5),
    ]
    assert [(x["victim"], round(x["ms"], 9)) for x in rc] == [("r2", 2.5)]
    p, g, pieces, rc = _named(log, 2, 5)
    assert p.column("preempt")[g] == pytest.approx(8.5, abs=1e-9)
    assert p.column("prefill")[g] == pytest.approx(7.5, abs=1e-9)
    assert [(x["kind"], x["victim"], round(x["ms"], 9)) for x in pieces] == [
        ("evicted", "r2", 6.0),
        ("recompute", "r2", 2.5),
    ]
    assert [(x["victim"], round(x["ms"], 9)) for x in rc] == [("r0", 7.5)]


def test_an_old_log_without_causes_still_knows_whose_re_prefill_it_is():
    """No `preemptions` table (a log before eviction causes): the eviction row (recompute
    mode, readmitted at 21) still says r0 re-prefills in step 2, so the split is as with
    causes (r0's gap: 19 ms preempt; r1's: 10 ms prefill), and its pieces name r0 with no
    step, reason or evictors."""
    b = recompute_case()
    b.causes.clear()
    b.evictor_rows.clear()
    log = validate_log(b.build())
    p, g, pieces, rc = _named(log, 0, 10)
    assert p.column("preempt")[g] == pytest.approx(19.0, abs=1e-9) and rc == []
    p, g, pieces, rc = _named(log, 1, 20)
    assert p.column("prefill")[g] == pytest.approx(10.0, abs=1e-9) and pieces == []
    assert [(x["victim"], x["step"], x["reason"], x["evictors"], round(x["ms"], 9))
            for x in rc] == [("r0", None, None, [], 10.0)]  # fmt: skip


def test_a_re_prefill_no_eviction_explains_is_everyones_prefill():
    """No eviction table at all (the published layout has none): no request is known to
    re-prefill in step 2, so the `recompute` segment is others' prefill in every gap over
    it, r0's included (r0's gap [10, 40]: 10 ms prefill, 0 preempt), named by no eviction."""
    b = recompute_case()
    b.evs.clear()
    b.causes.clear()
    b.evictor_rows.clear()
    log = validate_log(b.build())
    for r, t0 in ((0, 10), (1, 20)):
        p, g, pieces, rc = _named(log, r, t0)
        assert p.column("preempt")[g] == pytest.approx(0.0, abs=1e-9) and pieces == []
        assert p.column("prefill")[g] == pytest.approx(10.0, abs=1e-9)
        assert [(x["victim"], round(x["ms"], 9)) for x in rc] == [(None, 10.0)]


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


def _after_r0_readmitted() -> LogBuilder:
    """`recompute_case` with r2 emitting at 40 and a step 3 [41, 80] (its segments by the
    caller) that emits r1's token at 70."""
    b = recompute_case()
    b.emit(2, 40, 2)
    b.step(41, 80)
    b.emit(1, 70, 3)
    return b


def _without_r0(log):
    """The log cut to all but r0's emissions, without and with them stated first."""
    keep = np.flatnonzero(log.emissions.request != 0)
    cut = dataclasses.replace(log, emissions=log.emissions.take(keep))
    stated = stating_next_emissions(log)
    return cut, dataclasses.replace(stated, emissions=stated.emissions.take(keep))


def test_a_log_that_states_its_victims_next_emissions_keeps_its_split_without_them():
    """r0 re-prefills in step 2 and emits at 40 (its first emission since); r2, evicted
    45-51 (recompute), re-prefills in step 3's `recompute` segment [51, 61] and emits at
    70. In step 3 only r2 re-prefills (r0 emitted at 40, before the step's start 41), so
    r2's gap [40, 70] has 6 ms evicted and its 10 ms re-prefill as preempt (16 ms) and r1's
    gap [40, 70] the 10 ms as prefill, named r2. A log cut to the emissions those two gaps
    need (r0's rows dropped) would take r0 for a victim still re-prefilling (no emission
    since its readmission: half of it); stated before the cut, the split is the whole
    log's."""
    b = _after_r0_readmitted()
    b.seg(3, "recompute", 51, 61)
    b.seg(3, "decode", 61, 70)
    b.emit(2, 70, 3)
    b.evict(2, 45, 51, mode=1)
    log = validate_log(b.build())
    cut, stated = _without_r0(log)
    for lg, own in ((log, 10.0), (cut, 5.0), (stated, 10.0)):
        p, g, _, _ = _named(lg, 2, 40)
        assert p.reprefill_own_ms[g] == pytest.approx(own, abs=1e-9)
        assert p.column("preempt")[g] == pytest.approx(6.0 + own, abs=1e-9)
    p, g, _, rc = _named(stated, 1, 40)
    assert [(x["victim"], round(x["ms"], 9)) for x in rc] == [("r2", 10.0)]


def test_a_log_that_states_its_victims_next_emissions_names_its_preempt_segments_alike():
    """Rule 2 reads the same stated next emissions as the split above. r0 re-prefills in
    step 2 and emits at 40; in step 3 [41, 80] the engine evicts r2 (recompute, at 45,
    never readmitted) in a `preempt` segment [45, 47]. r1's gap [40, 70] holds those 2 ms
    as preempt: of the victims re-prefilling in step 3 there is none (r0 emitted at 40,
    before the step's start), so the eviction inside the step names them: r2. A log cut
    to the emissions that gap needs (r0's dropped) but stating them names r2 too; cut
    without stating, r0 (still re-prefilling, as far as it knows)."""
    b = _after_r0_readmitted()
    b.seg(3, "preempt", 45, 47)
    b.seg(3, "decode", 47, 70)
    b.evict(2, 45, mode=1)
    log = validate_log(b.build())
    cut, stated = _without_r0(log)
    for lg, victim in ((log, "r2"), (stated, "r2"), (cut, "r0")):
        p, g, pieces = _pieces(lg, 1, 40)
        assert p.column("preempt")[g] == pytest.approx(2.0, abs=1e-9)
        assert [(x["victim"], x["kind"], round(x["ms"], 9)) for x in pieces] == [
            (victim, "recompute", 2.0)
        ]


def test_each_victims_next_emission_is_its_first_strictly_after_the_asked_instant():
    """`next_emission` (the victim's first token after its readmission, docs/partition.md
    "Who evicted whom") against the rule spelled out: of the request's emissions, the
    earliest strictly after the instant; NaN where none is, or the instant is NaN. Seeded
    random logs with ties of time and requests asked twice or never seen; emissions in time
    order (as recorders append them) or not, request indices small or past 16 bits."""
    from types import SimpleNamespace

    from tracekit.attribution.reprefill import next_emission

    rng = np.random.default_rng(35)
    for _ in range(2000):
        n_em, n_q = int(rng.integers(0, 30)), int(rng.integers(0, 8))
        em_r = rng.integers(0, 5, n_em).astype(np.int32)
        em_t = rng.integers(0, 10, n_em).astype(np.float64)  # many equal instants
        req = rng.integers(0, 6, n_q).astype(np.int32)  # request 5 never emits
        if rng.random() < 0.5:
            em_t.sort()
        if rng.random() < 0.25:
            em_r, req = em_r + 70_000, req + 70_000
        after = rng.integers(-1, 11, n_q).astype(np.float64)
        after[rng.random(n_q) < 0.2] = np.nan
        want = [
            min((t for r, t in zip(em_r, em_t, strict=True) if r == q and t > a), default=np.nan)
            for q, a in zip(req, after, strict=True)
        ]  # NaN after: no `t > nan`, so NaN
        log = SimpleNamespace(emissions=SimpleNamespace(request=em_r, t_s=em_t))
        got = next_emission(log, req, after)  # type: ignore[arg-type]
        assert np.array_equal(got, np.array(want, dtype=np.float64), equal_nan=True)


def test_a_part_that_float_rounding_left_a_hair_from_zero_is_not_named():
    """A `preempt` part or others' re-prefill that float rounding left at +-1e-17 ms (its
    sign set by the order the partition added in) is no time: no pieces and no key either
    way, so the run read whole and read in slices name the same gaps and TTFTs. r1's gap
    [10, 20] has neither; r0's gap [10, 40] keeps its 19 ms of preempt pieces."""
    log = validate_log(recompute_case().build())
    p = partition(log)
    w = NamedWindows.of_gaps(p)
    (g,) = [i for i in range(len(p)) if p.request[i] == 1 and abs(p.t0_s[i] - 0.010) < 1e-12]
    (v,) = [i for i in range(len(p)) if p.request[i] == 0 and abs(p.t0_s[i] - 0.010) < 1e-12]
    assert w.preempt_ms[g] == 0.0 and w.other_ms[g] == 0.0
    for hair in (1e-17, -1e-17):
        pre, other = w.preempt_ms.copy(), w.other_ms.copy()
        pre[g] = other[g] = hair
        named = dataclasses.replace(w, preempt_ms=pre, other_ms=other)
        assert g not in name_preempt(log, named) and g not in name_reprefill(log, named)
        assert sum(x["ms"] for x in name_preempt(log, named)[v]) == pytest.approx(19.0)
