"""Hand-built TTFT windows with their parts worked out by hand from docs/ttft.md.

Every expected number below is derived in the comment above it, from the rules (numbered
as in docs/ttft.md), never from what the code printed. Both implementations are checked.
Times are ms; all steps in these logs ran on a captured size, so no decode time is `graph`.
"""

from __future__ import annotations

import numpy as np
import pytest
from logbuilder import LogBuilder

from tracekit.attribution.reference import ttft_partition_reference
from tracekit.attribution.ttft import PHASES, ttft_partition

IMPLS = [ttft_partition, ttft_partition_reference]


def _parts(p, row: int) -> dict[str, float]:
    return {lb: float(v) for lb, v in zip(p.labels, p.parts_ms[row], strict=True) if abs(v) > 1e-9}


def _phases(p, row: int) -> dict[str, float]:
    return {ph: float(v) for ph, v in zip(PHASES, p.phases_ms[row], strict=True) if abs(v) > 1e-9}


def _ctx(p, row: int) -> dict[str, float]:
    return {
        lb: float(v) for lb, v in zip(p.labels, p.context_ms[row], strict=True) if abs(v) > 1e-9
    }


def _close(got: dict[str, float], want: dict[str, float]) -> None:
    assert set(got) == set(want), (got, want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-9), (k, got, want)


def _row(p, req: int) -> int:
    return int(np.flatnonzero(p.request == req)[0])


def queued_behind_kv_then_chunked():
    """r0 decodes throughout; r1 arrives at 5, waits for KV, is admitted in step 2 and
    prefills in two chunks with r0's decode between them; r2 shares r1's second chunk."""
    b = LogBuilder()
    b.step(0, 10)
    b.seg(0, "decode", 1, 8)
    b.emit(0, 8, 0)
    b.step(10, 20)
    b.wait(1, 1, "kv_blocks")
    b.seg(1, "decode", 11, 19)
    b.emit(0, 19, 1)
    b.step(20, 30)
    b.admit(1, 21)
    b.prefill(2, 1, 4)
    b.seg(2, "prefill", 22, 26)
    b.seg(2, "decode", 26, 29)
    b.emit(0, 29, 2)
    b.step(30, 40)
    b.prefill(3, 1, 4)
    b.prefill(3, 2, 4)
    b.seg(3, "prefill", 31, 35)
    b.seg(3, "decode", 35, 38)
    b.emit(0, 39, 3)
    b.emit(1, 39, 3)
    return b.build(arrivals_ms=[0, 5, 30])


@pytest.mark.parametrize("impl", IMPLS)
def test_queued_behind_kv_then_chunked_prefill(impl):
    p = impl(queued_behind_kv_then_chunked())
    i = _row(p, 1)
    # TTFT = first token 39 - arrival 5 = 34 ms
    assert p.ttft_ms[i] == pytest.approx(34.0)
    # phases: queued 5 -> 21 (admission) = 16; prefilling 21 -> 39 = 18; no eviction
    _close(_phases(p, i), {"queued": 16.0, "prefilling": 18.0})
    # queued, [5, 10): no wait row in step 0 -> rule 4: r0's decode [5, 8) = 3 decode_other,
    #   [8, 10) = 2 residual (rule 5)
    # queued, [10, 20): step 1 stated kv_blocks; its window runs to step 2's start (20):
    #   10 ms wait_kv_blocks (rule 3); the decode [11, 19) = 8 ms is context
    # queued, [20, 21): step 2 admitted it, no wait row: 1 residual
    # prefilling: [21, 22) 1 residual; [22, 26) step 2's prefill, r1 has all 4 of its 4
    #   tokens -> 4 prefill_own; [26, 29) 3 decode_other; [29, 31) 2 residual;
    #   [31, 35) step 3's prefill, r1 has 4 of 8 tokens -> 2 prefill_own, 2 prefill_other;
    #   [35, 38) 3 decode_other; [38, 39) 1 residual
    # decode_other 3 + 3 + 3 = 9; residual 2 + 1 + 1 + 2 + 1 = 7; own 4 + 2 = 6; other 2
    want = {
        "decode_other": 9.0,
        "residual": 7.0,
        "wait_kv_blocks": 10.0,
        "prefill_own": 6.0,
        "prefill_other": 2.0,
    }
    _close(_parts(p, i), want)
    assert sum(want.values()) == 34.0
    # context of the 10 ms held: the decode [11, 19) = 8, and [10, 11) + [19, 20) = 2 that
    # nothing covered (residual context): it sums to the held time
    _close(_ctx(p, i), {"decode_other": 8.0, "residual": 2.0})
    # primary: the largest part other than prefill_own/residual is wait_kv_blocks = 10,
    # >= 1 ms and >= 25% of 34 (8.5)
    assert p.primary_names()[i] == "wait_kv_blocks"


def evicted_and_recomputed():
    """r0 is admitted at 1, prefills a first chunk, is evicted (recompute) at 11 while r1
    decodes, readmitted at 21, recomputes (a `recompute` segment), then prefills its
    second chunk and emits its first token at 39."""
    b = LogBuilder()
    b.step(0, 10)
    b.admit(0, 1)
    b.prefill(0, 0, 8)
    b.seg(0, "prefill", 2, 8)
    b.step(10, 20)
    b.evict(0, 11, 21, mode=1)
    b.seg(1, "decode", 12, 19)
    b.emit(1, 19, 1)
    b.step(20, 30)
    b.seg(2, "recompute", 22, 28)
    b.step(30, 40)
    b.prefill(3, 0, 8)
    b.seg(3, "prefill", 31, 37)
    b.emit(0, 39, 3)
    return b.build(arrivals_ms=[0, 0])


@pytest.mark.parametrize("impl", IMPLS)
def test_evicted_before_first_token_and_recomputed(impl):
    p = impl(evicted_and_recomputed())
    i = _row(p, 0)
    assert p.ttft_ms[i] == pytest.approx(39.0)
    # phases: queued 0 -> 1 = 1; evicted 11 -> 21 = 10; prefilling (1 -> 39) - 10 = 28
    _close(_phases(p, i), {"queued": 1.0, "evicted": 10.0, "prefilling": 28.0})
    # [0, 2) 2 residual; [2, 8) prefill, all 8 tokens its own: 6 prefill_own; [8, 11) 3
    # residual; [11, 21) evicted: 10 preempt (rule 1), r1's decode [12, 19) = 7 is context;
    # [21, 22) 1 residual; [22, 28) recompute -> cause preempt (cause map): 6 preempt;
    # [28, 31) 3 residual; [31, 37) 6 prefill_own; [37, 39) 2 residual
    # preempt 16; prefill_own 12; residual 2 + 3 + 1 + 3 + 2 = 11; total 39
    _close(_parts(p, i), {"preempt": 16.0, "prefill_own": 12.0, "residual": 11.0})
    # context of the 10 ms evicted: [11, 12) + [19, 21) = 3 residual, the decode 7: sums to 10
    _close(_ctx(p, i), {"decode_other": 7.0, "residual": 3.0})
    # primary: preempt 16 >= 1 ms and >= 25% of 39 (9.75)
    assert p.primary_names()[i] == "preempt"


def gc_during_queue():
    """r1 arrives at 10 and waits (max_num_seqs) through step 1, in which a GC pause
    [12, 15) lands inside r0's decode; admitted in step 2 at 20.5."""
    b = LogBuilder()
    b.step(0, 10)
    b.seg(0, "decode", 1, 9)
    b.emit(0, 9, 0)
    b.step(10, 20)
    b.wait(1, 1, "max_num_seqs")
    b.seg(1, "decode", 11, 19)
    b.gc(12, 15)
    b.emit(0, 19, 1)
    b.step(20, 30)
    b.admit(1, 20.5)
    b.prefill(2, 1, 5)
    b.seg(2, "prefill", 21, 25)
    b.seg(2, "decode", 25, 28)
    b.emit(0, 29, 2)
    b.emit(1, 29, 2)
    return b.build(arrivals_ms=[0, 10])


@pytest.mark.parametrize("impl", IMPLS)
def test_gc_during_the_queue(impl):
    p = impl(gc_during_queue())
    i = _row(p, 1)
    assert p.ttft_ms[i] == pytest.approx(19.0)
    # phases: queued 10 -> 20.5 = 10.5; prefilling 20.5 -> 29 = 8.5
    _close(_phases(p, i), {"queued": 10.5, "prefilling": 8.5})
    # [10, 20) is step 1's wait window: the GC pause [12, 15) keeps its 3 ms (rule 2 is
    # above rule 3); the other 7 are wait_max_num_seqs; context: the decode [11, 19) less
    # the pause = 5 decode_other
    # [20, 21) 1 residual (no wait row in step 2); [21, 25) 4 prefill_own (5 of 5 tokens);
    # [25, 28) 3 decode_other; [28, 29) 1 residual
    _close(
        _parts(p, i),
        {"gc": 3.0, "wait_max_num_seqs": 7.0, "residual": 2.0, "prefill_own": 4.0,
         "decode_other": 3.0},
    )  # fmt: skip
    # held 7 ms: decode 5 and [10, 11) + [19, 20) = 2 residual (the pause is not held time)
    _close(_ctx(p, i), {"decode_other": 5.0, "residual": 2.0})
    # primary: wait_max_num_seqs 7 >= 25% of 19 (4.75)
    assert p.primary_names()[i] == "wait_max_num_seqs"


def tokenised_on_loop():
    """r1 arrives at 10 and is tokenised on the loop [10, 14) while r0 decodes in the same
    steps; admitted at 14.5, one prefill chunk, first token at 19.5."""
    b = LogBuilder()
    b.step(0, 10)
    b.seg(0, "decode", 1, 9)
    b.emit(0, 9, 0)
    b.step(10, 20)
    b.seg(1, "tok", 10, 14)
    b.admit(1, 14.5)
    b.prefill(1, 1, 3)
    b.seg(1, "prefill", 15, 17)
    b.seg(1, "decode", 17, 19)
    b.emit(0, 19.5, 1)
    b.emit(1, 19.5, 1)
    return b.build(arrivals_ms=[0, 10])


@pytest.mark.parametrize("impl", IMPLS)
def test_tokenised_on_the_loop_while_others_decode(impl):
    p = impl(tokenised_on_loop())
    i = _row(p, 1)
    assert p.ttft_ms[i] == pytest.approx(9.5)
    # phases: queued 10 -> 14.5 = 4.5; prefilling 14.5 -> 19.5 = 5
    _close(_phases(p, i), {"queued": 4.5, "prefilling": 5.0})
    # [10, 14) tok 4; [14, 15) 1 residual; [15, 17) 2 prefill_own; [17, 19) 2 decode_other;
    # [19, 19.5) 0.5 residual
    _close(_parts(p, i), {"tok": 4.0, "residual": 1.5, "prefill_own": 2.0, "decode_other": 2.0})
    # primary: tok 4 >= 25% of 9.5 (2.375)
    assert p.primary_names()[i] == "tok"


def admitted_at_once():
    b = LogBuilder()
    b.step(0, 10)
    b.admit(0, 0)
    b.prefill(0, 0, 16)
    b.seg(0, "prefill", 1, 9)
    b.emit(0, 9.5, 0)
    return b.build(arrivals_ms=[0])


@pytest.mark.parametrize("impl", IMPLS)
def test_admitted_at_once(impl):
    p = impl(admitted_at_once())
    # queued 0 (admitted at its arrival); prefilling 9.5
    _close(_phases(p, 0), {"prefilling": 9.5})
    # [0, 1) 1 residual; [1, 9) 8 prefill_own (16 of 16 tokens); [9, 9.5) 0.5 residual
    _close(_parts(p, 0), {"residual": 1.5, "prefill_own": 8.0})
    # no cause at all: clean
    assert p.primary_names()[0] == "clean"
    assert p.notes == ()


@pytest.mark.parametrize("impl", IMPLS)
def test_log_without_admissions_is_unsplit_and_says_so(impl):
    b = LogBuilder()
    b.step(0, 10)
    b.seg(0, "prefill", 1, 9)
    b.emit(0, 9.5, 0)
    p = impl(b.build(arrivals_ms=[0]))
    # no admission: one unsplit phase; prefill cannot be told own or other -> `prefill`
    _close(_phases(p, 0), {"unsplit": 9.5})
    _close(_parts(p, 0), {"residual": 1.5, "prefill": 8.0})
    assert len(p.notes) == 1 and "no admission events" in p.notes[0]


@pytest.mark.parametrize("impl", IMPLS)
def test_first_token_before_arrival_without_admissions_is_left_out_and_said(impl):
    # a log without TTFT events loads with a warning (an engine that recorded the arrival
    # late); the TTFT partition cannot use a reversed window: it leaves the request out
    b = LogBuilder()
    b.step(0, 10)
    b.emit(0, 5, 0)
    b.emit(1, 9, 0)
    p = impl(b.build(arrivals_ms=[0, 20]))
    assert p.request.tolist() == [0]
    assert any("1 request(s) left out: first token before arrival" in n for n in p.notes)


def many_rows_many_segments():
    """One step [0, 50] prefills 20 requests (1 token each: share 1/20) in 20 prefill
    segments of 1 ms, [2k + 1, 2k + 2) for k = 0..19. Every request arrives and is admitted
    at 0; request i's first token is at 2i + 1.5, halfway through segment i. Request 19 is
    evicted over [10, 20.5]. 20 x 20 pieces is more than the row-by-segment join takes."""
    b = LogBuilder()
    b.step(0, 50)
    for k in range(20):
        b.seg(0, "prefill", 2 * k + 1, 2 * k + 2)
    for i in range(20):
        b.admit(i, 0)
        b.prefill(0, i, 1)
        b.emit(i, 2 * i + 1.5, 0)
    b.evict(19, 10, 20.5)
    return b.build(arrivals_ms=[0] * 20)


@pytest.mark.parametrize("join_factor", [8, 10**6])
@pytest.mark.parametrize("impl", IMPLS)
def test_many_prefill_rows_and_segments_in_one_step(impl, join_factor, monkeypatch):
    import tracekit.attribution.ttft as ttft

    monkeypatch.setattr(ttft, "_JOIN_FACTOR", join_factor)  # 8: no join; 10**6: the join
    p = impl(many_rows_many_segments())
    for i in (0, 1, 7, 18):
        r = _row(p, i)
        # rule 4: [0, 2i + 1.5] holds segments 0..i-1 whole and half of segment i: i + 0.5
        # ms of prefill, 1/20 of it own; the rest of the window is residual:
        # 2i + 1.5 - (i + 0.5) = i + 1
        own = (i + 0.5) / 20
        want = {"prefill_own": own, "prefill_other": i + 0.5 - own, "residual": i + 1.0}
        _close(_parts(p, r), want)
    r = _row(p, 19)
    # rule 1: [10, 20.5] is preempt, 10.5 ms; the segments inside it, [11, 12) .. [19, 20),
    # 5 ms, ran meanwhile (context: others' prefill). Prefill in [0, 39.5] outside it:
    # 19.5 - 5 = 14.5, own 14.5 / 20 = 0.725; residual 39.5 - 10.5 - 14.5 = 14.5
    _close(
        _parts(p, r),
        {"preempt": 10.5, "prefill_own": 0.725, "prefill_other": 14.5 - 0.725, "residual": 14.5},
    )
    # context sums to the evicted time (docs/ttft.md rule 1): the 5 ms of others' prefill,
    # and the 10.5 - 5 = 5.5 ms nothing covered as residual context
    _close(_ctx(p, r), {"prefill_other": 5.0, "residual": 5.5})
