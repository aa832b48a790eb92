"""OS evidence: the loop thread's run-queue wait and off-CPU time as `os_runqueue` and
`os_blocked` (docs/partition.md, "OS evidence"), hand cases for both partitioners, the
recorder's samples, the raw log and its validation.

Each expectation is worked out by hand in the comment above it (times in ms). The rule:
between two consecutive samples of the loop thread (an OS interval of length L) the kernel
counted R ms of run-queue wait and C ms of CPU; the off-CPU rest is B = L - C - R. The
shares R / L (run queue) and (B - W) / (L - W) (blocked; W: time an explicit wait owns in
the interval, off-CPU by what it is) are taken from every instant of the interval (wait
instants give no blocked share), ahead of every label there, except the request's own
evicted time."""

from __future__ import annotations

import numpy as np
import pytest
from logbuilder import LogBuilder
from logfiles import one_file_arrays

from tracekit.attribution.itl import partition
from tracekit.attribution.reference import partition_reference
from tracekit.attribution.timeline import os_intervals
from tracekit.log.rawlog import OS_SEGMENT_END, OS_SEGMENT_START, OS_STEP_END, OS_STEP_START

IMPLS = [partition, partition_reference]


def parts_of(p, i=0):
    return {
        lb: round(float(v), 9)
        for lb, v in zip(p.labels, p.parts_ms[i], strict=True)
        if abs(v) > 1e-9
    }


def one_step(b: LogBuilder, cpu_ms: float, runq_ms: float, t1=10.0) -> int:
    """A step [0, t1] on a captured size, its OS samples at both ends, request 0 emitting
    at 0 and at t1 (one gap [0, t1])."""
    s = b.step(0, t1, n_decode=1, graph=1)
    b.os_sample(0, 0, 0, kind=OS_STEP_START)
    b.os_sample(t1, cpu_ms, runq_ms, kind=OS_STEP_END)
    b.emit(0, 0, s)
    b.emit(0, t1, s)
    return s


@pytest.mark.parametrize("impl", IMPLS)
def test_runqueue_and_blocked_shares_of_a_decode_step(impl):
    # L = 10, C = 6, R = 3: B = 1. Shares 0.3 and 0.1 of every instant of the decode:
    # os_runqueue 3, os_blocked 1, forward 10 * 0.6 = 6.
    b = LogBuilder()
    s = one_step(b, cpu_ms=6, runq_ms=3)
    b.seg(s, "decode", 0, 10)
    p = impl(b.build())
    assert parts_of(p) == {"forward": 6.0, "os_runqueue": 3.0, "os_blocked": 1.0}
    assert p.reconcile_err_ms.max() < 1e-9


@pytest.mark.parametrize("impl", IMPLS)
def test_gc_gives_its_share_too(impl):
    # gc [2, 4] inside the decode: gc owns 2 ms and gives 0.3 + 0.1 of each instant:
    # gc 2 * 0.6 = 1.2; decode owns 8, keeps 8 * 0.6 = 4.8; os_runqueue 3, os_blocked 1.
    b = LogBuilder()
    s = one_step(b, cpu_ms=6, runq_ms=3)
    b.seg(s, "decode", 0, 10)
    b.gc(2, 4)
    p = impl(b.build())
    assert parts_of(p) == {"gc": 1.2, "forward": 4.8, "os_runqueue": 3.0, "os_blocked": 1.0}


@pytest.mark.parametrize("impl", IMPLS)
def test_an_explicit_wait_explains_off_cpu_time(impl):
    # decode [0, 6], wait [6, 10] (W = 4). C = 6, R = 3: B = 1 <= W, all explained:
    # no os_blocked. A thread in a wait is not runnable: R is spread over the other
    # L - W = 6 ms, share 3 / 6 = 0.5: forward 6 * 0.5 = 3, os_runqueue 3, wait 4 whole.
    b = LogBuilder()
    s = one_step(b, cpu_ms=6, runq_ms=3)
    b.seg(s, "decode", 0, 6)
    b.seg(s, "wait", 6, 10)
    p = impl(b.build())
    assert parts_of(p) == {"forward": 3.0, "wait": 4.0, "os_runqueue": 3.0}


@pytest.mark.parametrize("impl", IMPLS)
def test_off_cpu_time_beyond_the_waits_is_blocked(impl):
    # as above but C = 2: B = 10 - 2 - 3 = 5, W = 4 explains 4; 1 ms left, spread over the
    # 6 non-wait ms (share 1/6), as the run-queue wait is (share 3/6): forward
    # 6 * (1 - 0.5 - 1/6) = 2, wait 4 whole (no OS share in a wait), os_runqueue 3,
    # os_blocked 1.
    b = LogBuilder()
    s = one_step(b, cpu_ms=2, runq_ms=3)
    b.seg(s, "decode", 0, 6)
    b.seg(s, "wait", 6, 10)
    p = impl(b.build())
    assert parts_of(p) == {"forward": 2.0, "wait": 4.0, "os_runqueue": 3.0, "os_blocked": 1.0}


@pytest.mark.parametrize("impl", IMPLS)
def test_evicted_time_stays_preempt(impl):
    # request 0 evicted [2, 5] (3 ms of preempt, no OS share). The 7 live ms give the
    # shares: os_runqueue 7 * 0.3 = 2.1, os_blocked 0.7, forward 4.2. The context (what
    # ran while evicted) is the engine's decode, 3 ms, unchanged.
    b = LogBuilder()
    s = one_step(b, cpu_ms=6, runq_ms=3)
    b.seg(s, "decode", 0, 10)
    b.evict(0, 2, 5)
    p = impl(b.build())
    assert parts_of(p) == {"preempt": 3.0, "forward": 4.2, "os_runqueue": 2.1, "os_blocked": 0.7}
    assert abs(float(p.context_ms[0].sum()) - 3.0) < 1e-9


@pytest.mark.parametrize("impl", IMPLS)
def test_between_steps_the_shares_come_from_residual(impl):
    # steps [0, 4] and [6, 10], decode in each; samples at 0, 4, 6, 10. CPU 4 ms in each
    # step (none lost there); between them (2 ms, uncovered: residual) the thread waited
    # 1.5 ms on the run queue and ran 0: B = 0.5. Gap [0, 10]: forward 8, residual 0,
    # os_runqueue 1.5, os_blocked 0.5.
    b = LogBuilder()
    s0 = b.step(0, 4, n_decode=1, graph=1)
    s1 = b.step(6, 10, n_decode=1, graph=1)
    b.seg(s0, "decode", 0, 4)
    b.seg(s1, "decode", 6, 10)
    b.os_sample(0, 0, 0, kind=OS_STEP_START)
    b.os_sample(4, 4, 0, kind=OS_STEP_END)
    b.os_sample(6, 4, 1.5, kind=OS_STEP_START)
    b.os_sample(10, 8, 1.5, kind=OS_STEP_END)
    b.emit(0, 0, s0)
    b.emit(0, 10, s1)
    p = impl(b.build())
    assert parts_of(p) == {"forward": 8.0, "os_runqueue": 1.5, "os_blocked": 0.5}


@pytest.mark.parametrize("impl", IMPLS)
def test_a_gap_over_part_of_an_interval_takes_its_share_of_that_part(impl):
    # one step [0, 10] (R = 4, C = 6, B = 0), request 0 emits at 0 and 5, request 1 at 5
    # and 10: each gap gets half: os_runqueue 2, forward 3.
    b = LogBuilder()
    s = b.step(0, 10, n_decode=1, graph=1)
    b.seg(s, "decode", 0, 10)
    b.os_sample(0, 0, 0, kind=OS_STEP_START)
    b.os_sample(10, 6, 4, kind=OS_STEP_END)
    b.emit(0, 0, s)
    b.emit(0, 5, s)
    b.emit(1, 5, s)
    b.emit(1, 10, s)
    p = impl(b.build())
    assert parts_of(p, 0) == {"forward": 3.0, "os_runqueue": 2.0}
    assert parts_of(p, 1) == {"forward": 3.0, "os_runqueue": 2.0}


@pytest.mark.parametrize("impl", IMPLS)
def test_no_evidence_no_attribution(impl):
    # run-queue wait unknown (-1: no schedstat) at one end: the interval is not used, the
    # partition is the one without OS evidence (forward 10), and no OS label appears.
    b = LogBuilder()
    s = b.step(0, 10, n_decode=1, graph=1)
    b.seg(s, "decode", 0, 10)
    b.os_sample(0, 0, 0, kind=OS_STEP_START)
    b.os_rows.append((0, OS_STEP_END, 10, 6_000_000, -1, 0, 0, 0))
    b.emit(0, 0, s)
    b.emit(0, 10, s)
    p = impl(b.build())
    assert parts_of(p) == {"forward": 10.0}
    assert "os_runqueue" not in p.labels


def side_tok(b: LogBuilder, cpu_ms: float, runq_ms: float, a=2.0, z=6.0) -> None:
    """A `tok` segment [a, z] on thread 1 (a tokenizer thread), sampled at both ends: it
    ran `cpu_ms` and waited `runq_ms` on the run queue in it."""
    b.seg(-1, "tok", a, z, thread=1)
    b.os_sample(a, 0, 0, kind=OS_SEGMENT_START, thread=1)
    b.os_sample(z, cpu_ms, runq_ms, kind=OS_SEGMENT_END, thread=1)


@pytest.mark.parametrize("impl", IMPLS)
def test_another_threads_segment_takes_that_threads_shares(impl):
    # rule 7: the loop decodes [0, 10] on the CPU all along (C = 10: no share); thread 1's
    # tok [2, 6] owns [2, 6] (tok before decode) and its own interval says L = 4, C = 1,
    # R = 0: B = 3, blocked share 3/4 of each of its instants: tok 4 * 1/4 = 1,
    # os_blocked 3; forward 6 (the decode outside the tok).
    b = LogBuilder()
    s = one_step(b, cpu_ms=10, runq_ms=0)
    b.seg(s, "decode", 0, 10)
    side_tok(b, cpu_ms=1, runq_ms=0)
    p = impl(b.build())
    assert parts_of(p) == {"forward": 6.0, "tok": 1.0, "os_blocked": 3.0}


@pytest.mark.parametrize("impl", IMPLS)
def test_each_instant_takes_its_owners_threads_shares(impl):
    # as above with the loop waiting R = 2 on the run queue (C = 8): its share 0.2 of the
    # instants its own evidence covers (the decode's 6 ms: forward 4.8, os_runqueue 1.2);
    # the tok instants take thread 1's shares (tok 1, os_blocked 3). 4.8+1.2+1+3 = 10.
    b = LogBuilder()
    s = one_step(b, cpu_ms=8, runq_ms=2)
    b.seg(s, "decode", 0, 10)
    side_tok(b, cpu_ms=1, runq_ms=0)
    p = impl(b.build())
    assert parts_of(p) == {"forward": 4.8, "os_runqueue": 1.2, "tok": 1.0, "os_blocked": 3.0}


@pytest.mark.parametrize("impl", IMPLS)
def test_where_the_loop_has_a_segment_of_the_cause_its_evidence_holds(impl):
    # the loop's own tok [3, 5] covers part of thread 1's tok [2, 6]: there the loop's
    # evidence holds (C = 10: no share, tok 2); on [2, 3] and [5, 6] thread 1's does:
    # 2 ms * (1 - 3/4) = 0.5 tok, os_blocked 1.5 (its interval's shares are spread over
    # all of its 4 ms; the part the loop's evidence holds gives none). forward 6.
    b = LogBuilder()
    s = one_step(b, cpu_ms=10, runq_ms=0)
    b.seg(s, "decode", 0, 10)
    b.seg(s, "tok", 3, 5)
    side_tok(b, cpu_ms=1, runq_ms=0)
    p = impl(b.build())
    assert parts_of(p) == {"forward": 6.0, "tok": 2.5, "os_blocked": 1.5}


def test_os_intervals_clamp_what_the_counters_cannot_mean():
    # [0, 10]: 12 ms of run-queue wait claimed in 10 ms: R is the interval (10), B = 0;
    # [10, 12]: 5 ms of CPU in 2 ms: R = 0, B = 0 (never negative);
    # [12, 14]: the CPU counter went back (6 -> 5): the interval is left out.
    b = LogBuilder()
    b.os_sample(0, 0, 0, kind=OS_STEP_START)
    b.os_sample(10, 1, 12, kind=OS_STEP_END)
    b.os_sample(12, 6, 12, kind=OS_STEP_START)
    b.os_sample(14, 5, 12, kind=OS_STEP_END)
    osi = os_intervals(b.build(wall_ms=14))
    assert osi.t0_s.tolist() == [0.0, 0.010]
    assert np.allclose(osi.runqueue_s, [0.010, 0.0])
    assert np.allclose(osi.offcpu_s, [0.0, 0.0])


# -- the raw log -------------------------------------------------------------------------


def _recorded(tmp_path, **kw):
    import tracekit

    out = tmp_path / "run.npz"
    rec = tracekit.Recorder(out, gc=False, handle_signals=False, **kw)
    with rec:
        for s in range(4):
            rec.request(f"r{s}")
            with rec.step():
                with rec.segment("decode"):
                    pass
                rec.emit([f"r{i}" for i in range(s + 1)])
    return str(out)


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="Linux only")
def test_recorder_samples_the_loop_thread_at_every_step_boundary(tmp_path):
    import tracekit

    log = tracekit.load(_recorded(tmp_path))
    os_ = log.os_samples
    assert log.meta["os_evidence"]["recorded"] is True
    # 4 steps: a start and an end sample each, on thread 0, each stamped right after its
    # counters were read (docs/partition.md, "When the counters are read"): a start sample
    # after its step's start and before the step's first segment; an end sample after its
    # step's end and before the next step's start
    assert os_.kind.tolist() == [OS_STEP_START, OS_STEP_END] * 4
    assert set(os_.thread.tolist()) == {0}
    st, sg = log.steps, log.segments
    assert (st.t_start_s <= os_.t_s[0::2]).all() and (os_.t_s[0::2] <= sg.t_start_s).all()
    assert (st.t_end_s <= os_.t_s[1::2]).all()
    assert (os_.t_s[1::2][:-1] <= st.t_start_s[1:]).all()
    for c in ("cpu_ns", "runqueue_ns"):
        col = getattr(os_, c)
        assert (col >= 0).all() and (np.diff(col) >= 0).all(), c  # totals never go back
    # switches and faults at step ends only (-1 at starts: not read there)
    for c in ("num_voluntary_switches", "num_involuntary_switches", "num_major_faults"):
        col = getattr(os_, c)
        assert (col[0::2] == -1).all(), c
        assert (col[1::2] >= 0).all() and (np.diff(col[1::2]) >= 0).all(), c


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="Linux only")
def test_a_side_threads_segments_are_sampled_and_the_loops_are_not(tmp_path):
    import threading

    import tracekit

    rec = tracekit.Recorder(tmp_path / "run.npz", gc=False, handle_signals=False)
    with rec:

        def worker():
            for _ in range(3):
                with rec.segment("tok"):
                    pass

        for s in range(2):
            rec.request(f"r{s}")
            with rec.step():
                with rec.segment("decode"):
                    pass
                rec.emit([f"r{i}" for i in range(s + 1)])
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    log = tracekit.load(str(tmp_path / "run.npz"))
    os_, sg = log.os_samples, log.segments
    tok = sg.label == log.labels.index("tok")
    side = int(sg.thread[tok][0])
    assert side != 0
    # the loop (thread 0): its steps' boundaries only, never its segments'
    assert os_.kind[os_.thread == 0].tolist() == [OS_STEP_START, OS_STEP_END] * 2
    # the tokenizer thread: both ends of each of its 3 segments, at the segments' times
    mine = os_.thread == side
    assert os_.kind[mine].tolist() == [OS_SEGMENT_START, OS_SEGMENT_END] * 3
    # each stamped right after its counters, and that one tick is its segment's start
    # (end): the segment's window and its OS interval are one (docs/partition.md, "When
    # the counters are read")
    assert os_.t_s[mine][0::2].tolist() == sg.t_start_s[tok].tolist()
    assert os_.t_s[mine][1::2].tolist() == sg.t_end_s[tok].tolist()
    assert "segment boundaries (other threads)" in log.meta["os_evidence"]["at"]


def test_os_evidence_off_is_said_so(tmp_path):
    import itertools

    import tracekit

    log = tracekit.load(_recorded(tmp_path, os_evidence=False))
    assert len(log.os_samples) == 0
    assert log.meta["os_evidence"] == {
        "recorded": False,
        "reason": "switched off (Recorder(os_evidence=False))",
    }
    # a clock that is not wall time: off by default, with the reason
    clock = itertools.count(0, 1000).__next__
    (tmp_path / "b").mkdir()
    log = tracekit.load(_recorded(tmp_path / "b", clock=clock))
    assert len(log.os_samples) == 0 and "not wall time" in log.meta["os_evidence"]["reason"]


def test_a_version_2_log_loads_with_no_os_evidence(tmp_path):
    import tracekit

    path = _recorded(tmp_path)
    arrays = {k: v for k, v in one_file_arrays(path).items() if not k.startswith("os_samples.")}
    arrays["schema_version"] = np.array(2, dtype=np.int64)
    v2 = tmp_path / "v2.npz"
    np.savez(v2, **arrays)
    log = tracekit.load(str(v2))
    assert len(log.os_samples) == 0
    p = partition(log)
    assert "os_runqueue" not in p.labels and "os_blocked" not in p.labels


def test_bad_os_samples_are_refused_naming_the_field(tmp_path):
    import tracekit
    from tracekit.errors import LogError

    path = _recorded(tmp_path)
    arrays = one_file_arrays(path)
    if not len(arrays["os_samples.kind"]):
        pytest.skip("no OS evidence on this platform")
    arrays["os_samples.kind"] = arrays["os_samples.kind"].copy()
    arrays["os_samples.kind"][1] = 9
    bad = tmp_path / "bad.npz"
    np.savez(bad, **arrays)
    with pytest.raises(LogError, match=r"os_samples\.kind: row 1: 9 is absurd"):
        tracekit.load(str(bad))
