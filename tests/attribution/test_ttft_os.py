"""TTFT OS causes (docs/ttft.md, "OS evidence"): hand cases for both partitioners.

Every expectation is worked out by hand in the comment above it, from the written rules
(times in ms): an OS interval of length L between two samples of the loop thread counted R
of run-queue wait and C of CPU; B = L - C - R is off-CPU. At every instant of the interval
outside its explicit waits (W: their time), R / (L - W) is `os_runqueue` and
(B - W) / (L - W) is `os_blocked`, taken from whichever of TTFT rules 2, 4 and 5 owns it
(gc, a segment's cause, residual); evicted time (preempt) and held time (wait_<reason>)
give none. Prefill splits into own and other on what the OS left of each instant.
"""

from __future__ import annotations

import pytest
from logbuilder import LogBuilder

from tracekit.attribution.reference import ttft_partition_reference
from tracekit.attribution.ttft import PHASES, ttft_partition
from tracekit.log.rawlog import OS_SEGMENT_END, OS_SEGMENT_START, OS_STEP_END, OS_STEP_START

IMPLS = [ttft_partition, ttft_partition_reference]


def _parts(p, row: int = 0) -> dict[str, float]:
    return {lb: float(v) for lb, v in zip(p.labels, p.parts_ms[row], strict=True) if abs(v) > 1e-9}


def _ctx(p, row: int = 0) -> dict[str, float]:
    return {
        lb: float(v) for lb, v in zip(p.labels, p.context_ms[row], strict=True) if abs(v) > 1e-9
    }


def _close(got: dict[str, float], want: dict[str, float]) -> None:
    assert set(got) == set(want), (got, want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-9), (k, got, want)


def _samples(b: LogBuilder, *points: tuple[float, float, float]) -> None:
    """Loop-thread samples (t, cpu total, run-queue total), alternately step start and end."""
    for k, (t, cpu, runq) in enumerate(points):
        b.os_sample(t, cpu, runq, kind=OS_STEP_START if k % 2 == 0 else OS_STEP_END)


@pytest.mark.parametrize("impl", IMPLS)
def test_own_prefill_gives_its_share(impl):
    # one request, arrived and admitted at 0, prefilled alone in step [0, 10] (its chunk is
    # all of the step's tokens), first token at 10. L = 10, C = 6, R = 3: B = 1; shares
    # 0.3 and 0.1 of every instant: os_runqueue 3, os_blocked 1, prefill_own 10 * 0.6 = 6.
    b = LogBuilder()
    b.step(0, 10)
    b.admit(0, 0)
    b.prefill(0, 0, 16)
    b.seg(0, "prefill", 0, 10)
    b.emit(0, 10, 0)
    _samples(b, (0, 0, 0), (10, 6, 3))
    p = impl(b.build(arrivals_ms=[0]))
    _close(_parts(p), {"prefill_own": 6.0, "os_runqueue": 3.0, "os_blocked": 1.0})
    assert p.phases_ms[0, PHASES.index("prefilling")] == pytest.approx(10.0)
    assert p.primary_names()[0] == "os_runqueue"  # 3 >= 1 ms and >= 25% of 10


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_splits_own_and_other_on_what_the_os_left(impl):
    # r0 and r1 admitted at 0 prefill together in step [0, 10]: 30 and 10 tokens (shares
    # 0.75, 0.25). L = 10, C = 7, R = 2: B = 1, shares 0.2 and 0.1, so 10 * 0.7 = 7 ms of
    # prefill is left. r0 (first token at 10): prefill_own 0.75 * 7 = 5.25, prefill_other
    # 7 - 5.25 = 1.75, os_runqueue 2, os_blocked 1.
    b = LogBuilder()
    b.step(0, 10)
    b.admit(0, 0)
    b.admit(1, 0)
    b.prefill(0, 0, 30)
    b.prefill(0, 1, 10)
    b.seg(0, "prefill", 0, 10)
    b.emit(0, 10, 0)
    b.emit(1, 10, 0)
    _samples(b, (0, 0, 0), (10, 7, 2))
    p = impl(b.build(arrivals_ms=[0, 0]))
    _close(
        _parts(p, 0),
        {"prefill_own": 5.25, "prefill_other": 1.75, "os_runqueue": 2.0, "os_blocked": 1.0},
    )
    # r1: own 0.25 * 7 = 1.75, other 5.25
    _close(
        _parts(p, 1),
        {"prefill_own": 1.75, "prefill_other": 5.25, "os_runqueue": 2.0, "os_blocked": 1.0},
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_held_time_stays_the_stated_reason(impl):
    # r1 arrives at 0; step 0 [0, 10] decodes r0 and states kv_blocks for r1 (its window:
    # [0, 10), to step 1's start); step 1 [10, 20] admits r1 at 10 and prefills it alone;
    # first token at 20. Interval [0, 10]: C = 6, R = 3 (shares 0.3, 0.1), interval
    # [10, 20]: C = 8, R = 2 (shares 0.2, 0). Held [0, 10): wait_kv_blocks 10, no OS share
    # (the scheduler held r1 whether or not the thread ran); [10, 20): prefill_own
    # 10 * 0.8 = 8, os_runqueue 2. The context (what ran while held) is r0's decode, 10,
    # without OS labels.
    b = LogBuilder()
    b.step(0, 10)
    b.wait(0, 1, "kv_blocks")
    b.seg(0, "decode", 0, 10)
    b.emit(0, 10, 0)
    b.step(10, 20)
    b.admit(1, 10)
    b.prefill(1, 1, 8)
    b.seg(1, "prefill", 10, 20)
    b.emit(1, 20, 1)
    _samples(b, (0, 0, 0), (10, 6, 3), (10, 6, 3), (20, 14, 5))
    p = impl(b.build(arrivals_ms=[0, 0]))
    i = int(list(p.request).index(1))
    _close(_parts(p, i), {"wait_kv_blocks": 10.0, "prefill_own": 8.0, "os_runqueue": 2.0})
    _close(_ctx(p, i), {"decode_other": 10.0})


@pytest.mark.parametrize("impl", IMPLS)
def test_gc_in_held_time_keeps_its_part_and_gives_its_share(impl):
    # as above with a GC pause [2, 4] in the held window: gc is not held time (rule 3), so
    # it is live and gives the interval's shares: gc 2 * 0.6 = 1.2, os_runqueue
    # 2 * 0.3 = 0.6, os_blocked 2 * 0.1 = 0.2; wait_kv_blocks 10 - 2 = 8. Then [10, 20):
    # prefill_own 8, os_runqueue 2. Sum: 8 + 1.2 + 0.6 + 0.2 + 8 + 2 = 20.
    b = LogBuilder()
    b.step(0, 10)
    b.wait(0, 1, "kv_blocks")
    b.seg(0, "decode", 0, 10)
    b.gc(2, 4)
    b.emit(0, 10, 0)
    b.step(10, 20)
    b.admit(1, 10)
    b.prefill(1, 1, 8)
    b.seg(1, "prefill", 10, 20)
    b.emit(1, 20, 1)
    _samples(b, (0, 0, 0), (10, 6, 3), (10, 6, 3), (20, 14, 5))
    p = impl(b.build(arrivals_ms=[0, 0]))
    i = int(list(p.request).index(1))
    want = {
        "wait_kv_blocks": 8.0,
        "gc": 1.2,
        "os_runqueue": 2.6,
        "os_blocked": 0.2,
        "prefill_own": 8.0,
    }
    _close(_parts(p, i), want)
    # context: the decode outside the pause, 8 (the pause is not held time)
    _close(_ctx(p, i), {"decode_other": 8.0})


@pytest.mark.parametrize("impl", IMPLS)
def test_evicted_time_stays_preempt(impl):
    # r0 admitted at 0, evicted [2, 5] (readmitted at 5), first token at 10; the engine
    # decodes others over the step [0, 10] (C = 6, R = 3: shares 0.3, 0.1). Evicted 3 ms:
    # preempt 3, no OS share. The 7 live ms: decode_other 7 * 0.6 = 4.2, os_runqueue 2.1,
    # os_blocked 0.7. Context: the decode while evicted, 3.
    b = LogBuilder()
    b.step(0, 10)
    b.admit(0, 0)
    b.evict(0, 2, 5)
    b.seg(0, "decode", 0, 10)
    b.emit(0, 10, 0)
    _samples(b, (0, 0, 0), (10, 6, 3))
    p = impl(b.build(arrivals_ms=[0]))
    _close(
        _parts(p),
        {"preempt": 3.0, "decode_other": 4.2, "os_runqueue": 2.1, "os_blocked": 0.7},
    )
    _close(_ctx(p), {"decode_other": 3.0})


@pytest.mark.parametrize("impl", IMPLS)
def test_an_explicit_wait_explains_off_cpu_time_first(impl):
    # step [0, 10]: prefill [0, 6] (r0 alone), wait for the device [6, 10] (W = 4); first
    # token at 10. C = 2, R = 3: B = 5; the wait explains 4, 1 is left. Over the 6 non-wait
    # ms: run-queue share 3 / 6, blocked 1 / 6: prefill_own 6 * (1 - 1/2 - 1/6) = 2,
    # os_runqueue 3, os_blocked 1, wait 4 whole.
    b = LogBuilder()
    b.step(0, 10)
    b.admit(0, 0)
    b.prefill(0, 0, 8)
    b.seg(0, "prefill", 0, 6)
    b.seg(0, "wait", 6, 10)
    b.emit(0, 10, 0)
    _samples(b, (0, 0, 0), (10, 2, 3))
    p = impl(b.build(arrivals_ms=[0]))
    _close(
        _parts(p),
        {"prefill_own": 2.0, "wait": 4.0, "os_runqueue": 3.0, "os_blocked": 1.0},
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_between_steps_and_unsplit(impl):
    # no admission rows (unsplit). r0 arrives at 0; steps [0, 4] and [6, 10] prefill
    # (the `prefill` label, unsplit requests keep it); first token at 10. CPU 4 in each
    # step, between them (2 ms, residual) R = 1.5, C = 0: B = 0.5. prefill 8,
    # os_runqueue 1.5, os_blocked 0.5, residual 0.
    b = LogBuilder()
    b.step(0, 4)
    b.step(6, 10)
    b.seg(0, "prefill", 0, 4)
    b.seg(1, "prefill", 6, 10)
    b.emit(0, 10, 1)
    _samples(b, (0, 0, 0), (4, 4, 0), (6, 4, 1.5), (10, 8, 1.5))
    p = impl(b.build(arrivals_ms=[0]))
    _close(_parts(p), {"prefill": 8.0, "os_runqueue": 1.5, "os_blocked": 0.5})


@pytest.mark.parametrize("impl", IMPLS)
def test_no_evidence_no_os_labels(impl):
    # a run-queue counter of -1 (no schedstat): the interval is not used, and the log has no
    # OS interval at all, so the partition has no OS labels: prefill_own 10.
    b = LogBuilder()
    b.step(0, 10)
    b.admit(0, 0)
    b.prefill(0, 0, 8)
    b.seg(0, "prefill", 0, 10)
    b.emit(0, 10, 0)
    b.os_sample(0, 0, -1e-6, kind=OS_STEP_START)
    b.os_sample(10, 6, -1e-6, kind=OS_STEP_END)
    p = impl(b.build(arrivals_ms=[0]))
    assert "os_runqueue" not in p.labels and "os_blocked" not in p.labels
    _close(_parts(p), {"prefill_own": 10.0})


@pytest.mark.parametrize("impl", IMPLS)
def test_a_tokenizer_threads_blocked_read_is_os_blocked(impl):
    # r0 arrives at 0, queued (no wait row) while step 0 [0, 10] decodes others on the loop
    # thread (C = 10: no share); a tokenizer thread's tok [2, 6] (thread 1, sampled at both
    # ends: C = 1, R = 0, so B = 3 of its 4 ms) owns [2, 6] and takes its own thread's
    # shares (docs/partition.md, OS rule 7): tok 1, os_blocked 3. Step 1 [10, 20] admits
    # r0 at 10 and prefills it alone (C = 10): prefill_own 10. decode_other 6.
    b = LogBuilder()
    b.step(0, 10)
    b.seg(0, "decode", 0, 10)
    b.emit(1, 10, 0)
    b.seg(-1, "tok", 2, 6, thread=1)
    b.os_sample(2, 0, 0, kind=OS_SEGMENT_START, thread=1)
    b.os_sample(6, 1, 0, kind=OS_SEGMENT_END, thread=1)
    b.step(10, 20)
    b.admit(0, 10)
    b.prefill(1, 0, 8)
    b.seg(1, "prefill", 10, 20)
    b.emit(0, 20, 1)
    _samples(b, (0, 0, 0), (10, 10, 0), (10, 10, 0), (20, 20, 0))
    p = impl(b.build(arrivals_ms=[0, 0]))
    i = int(list(p.request).index(0))
    _close(
        _parts(p, i),
        {"decode_other": 6.0, "tok": 1.0, "os_blocked": 3.0, "prefill_own": 10.0},
    )
