"""Property tests: random layouts always reconcile, and the vectorised partitioner equals the
slow reference one to 1e-9 ms."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from logbuilder import LogBuilder

from tracekit.attribution.itl import partition
from tracekit.attribution.reference import partition_reference

EXTRA = ["schedule", "sample", "wait"]  # `wait`: host idle for the device rule


def _samples(b, times, draw, *, kind, thread):
    """A thread's OS counters at `times` (sorted): random run-queue wait and CPU time in
    each interval, within its length; kinds alternate start/end from `kind`."""
    cpu = runq = 0.0
    prev = times[0]
    for k, x in enumerate(times):
        width = x - prev
        wait = draw(st.floats(0, 1)) * width
        runq += wait
        cpu += draw(st.floats(0, 1)) * (width - wait)
        b.os_sample(x, cpu, runq, kind=kind + k % 2, thread=thread)
        prev = x


@st.composite
def random_logs(draw):
    b = LogBuilder()
    n_req = draw(st.integers(1, 4))
    n_steps = draw(st.integers(1, 12))
    t = draw(st.floats(0, 5))
    bounds: list[float] = []  # every step's start and end
    for _ in range(n_steps):
        dur = draw(st.floats(0.5, 30))
        graph = draw(st.sampled_from([-1, 0, 1, 2, 4, 8]))
        n_dec = draw(st.integers(0, 9)) if graph != -1 else 0
        s = b.step(t, t + dur, n_decode=n_dec, graph=graph)
        # sequential segments inside the step, some with idle between
        cur = t
        labels = ["tok", "swap", "recompute", "prefill", "decode", *EXTRA]
        for label in draw(st.lists(st.sampled_from(labels), max_size=4)):
            a = cur + draw(st.floats(0, dur / 4))
            e = min(t + dur, a + draw(st.floats(0, dur / 2)))
            if e < a:
                break
            b.seg(s, label, a, e)
            if label == "recompute" and draw(st.booleans()):  # a victim back by its start
                b.evict(draw(st.integers(0, n_req - 1)), a - draw(st.floats(0, 10)), a, mode=1)
            if label == "recompute" and draw(st.booleans()):  # the victims' re-prefill tokens
                b.prefill(s, draw(st.integers(0, n_req - 1)), draw(st.integers(0, 64)))
            if label in ("decode", "prefill", "recompute") and draw(st.booleans()):
                # its device execution, lagging the host launch (async) by a random delay
                lag = draw(st.floats(0, 20))
                b.seg(s, label, a + lag, e + lag + draw(st.floats(0, 5)), device=True)
            cur = e
        emitters = draw(st.lists(st.integers(0, n_req - 1), unique=True, max_size=n_req))
        reads = s - 1 if (s and draw(st.booleans())) else s  # async: the previous step's work
        for r in emitters:
            b.emit(r, cur if draw(st.booleans()) else t + dur, s, reads=reads)
        bounds.extend([t, t + dur])
        t += dur + draw(st.floats(0, 3))
    if draw(st.booleans()):  # OS evidence at every step boundary (os_runqueue, os_blocked)
        _samples(b, bounds, draw, kind=0, thread=0)
    # another thread's windows, overlapping anything
    side = []
    for _ in range(draw(st.integers(0, 3))):
        a = draw(st.floats(0, t))
        side.extend([a, a + draw(st.floats(0, 10))])
        b.seg(-1, draw(st.sampled_from(["tok", "schedule"])), side[-2], side[-1], 1)
    if side and draw(st.booleans()):  # its OS samples at its windows' ends (OS rule 7)
        _samples(b, sorted(side), draw, kind=2, thread=1)
    for _ in range(draw(st.integers(0, 4))):
        a = draw(st.floats(0, t))
        b.gc(a, a + draw(st.floats(0, 15)), draw(st.integers(0, 2)))
    for _ in range(draw(st.integers(0, 4))):
        a = draw(st.floats(0, t))
        readmit = a + draw(st.floats(0, 40)) if draw(st.booleans()) else float("nan")
        # swap, recompute (a victim re-prefilling where it is back and has not emitted) or
        # unknown
        b.evict(draw(st.integers(0, n_req - 1)), a, readmit, mode=draw(st.sampled_from([0, 1, -1])))
    return b.build(wall_ms=t + 1)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_logs())
def test_random_layouts_reconcile_and_match_reference(log):
    fast = partition(log)  # raises ReconcileError if any gap's parts do not sum to it
    ref = partition_reference(log)
    assert fast.labels == ref.labels
    assert fast.reconcile_max_err_ms <= 1e-9
    assert ref.reconcile_max_err_ms <= 1e-9
    assert (fast.parts_ms >= -1e-9).all()
    np.testing.assert_allclose(fast.gap_ms, ref.gap_ms, rtol=0, atol=1e-12)
    np.testing.assert_allclose(fast.parts_ms, ref.parts_ms, rtol=0, atol=1e-9)
    np.testing.assert_allclose(fast.context_ms, ref.context_ms, rtol=0, atol=1e-9)
    np.testing.assert_allclose(fast.reprefill_own_ms, ref.reprefill_own_ms, rtol=0, atol=1e-9)
    np.testing.assert_allclose(fast.reprefill_other_ms, ref.reprefill_other_ms, rtol=0, atol=1e-9)
    np.testing.assert_array_equal(fast.num_evictions, ref.num_evictions)
    np.testing.assert_array_equal(fast.primary, ref.primary)


@settings(max_examples=50, deadline=None)
@given(st.floats(1e3, 1e5), st.integers(1, 50))
def test_late_in_a_long_run_parts_keep_gap_precision(offset_s, n):
    # many steps far from engine start: a gap's parts carry rounding of the gap, not the run
    b = LogBuilder()
    t = offset_s * 1e3
    b.emit(0, t, -1)
    for _ in range(n):
        s = b.step(t, t + 7.3)
        b.seg(s, "prefill", t + 0.1, t + 2.2)
        b.seg(s, "decode", t + 2.2, t + 7.1)
        b.emit(0, t + 7.1, s)
        t += 7.3
    p = partition(b.build())
    assert p.reconcile_max_err_ms <= 1e-9


def _shift_device(log, e_ms):
    import dataclasses

    sg = log.segments
    dev = sg.is_device == 1
    a, b = sg.t_start_s.copy(), sg.t_end_s.copy()
    a[dev] += e_ms * 1e-3
    b[dev] += e_ms * 1e-3
    return dataclasses.replace(log, segments=dataclasses.replace(sg, t_start_s=a, t_end_s=b))


def _measure(intervals):
    """Total length of a union of (a, b) intervals."""
    total, end = 0.0, -np.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _eligible_and_busy(log, r, t0, t1, step1):
    """docs/gpu.md's terms for one gap, computed the obvious way: the number of device
    windows on its path (ended by the read step's device work, overlapping the gap) and the
    loop thread's own work inside them (ms)."""
    em, sg = log.emissions, log.segments
    (row,) = np.flatnonzero((em.request == r) & (em.t_s == t1) & (em.step == step1))[:1]
    ds = int(em.device_step[row])
    dev = np.flatnonzero((sg.is_device == 1) & (sg.step >= 0))
    mine = dev[sg.step[dev] == ds]
    if ds < 0 or len(mine) == 0:
        return 0, 0.0
    read_end = sg.t_end_s[mine].max()
    # disjoint over the run, the earlier start owning an overlap (as the partition does)
    wins, busy_until = [], -np.inf
    for i in sorted(dev.tolist(), key=lambda i: (sg.t_start_s[i], sg.step[i], sg.t_end_s[i])):
        a, b = max(sg.t_start_s[i], busy_until), sg.t_end_s[i]
        if b > a:
            wins.append((a, b))
        busy_until = max(busy_until, b)
    on_path = [
        (max(a, t0), min(b, t1)) for a, b in wins if b <= read_end and min(b, t1) > max(a, t0)
    ]
    # the loop thread's own work: its host segments other than wait/sync (the loop thread is
    # 0 in these layouts; GC pauses and thread 1's windows never count)
    host_busy = [
        (sg.t_start_s[i], sg.t_end_s[i])
        for i in np.flatnonzero((sg.is_device == 0) & (sg.thread == 0)).tolist()
        if log.labels[sg.label[i]] not in ("wait", "sync")
    ]
    inside = [
        (max(a, wa), min(b, wb))
        for wa, wb in on_path
        for a, b in host_busy
        if min(b, wb) > max(a, wa)
    ]
    return len(on_path), _measure(inside) * 1e3


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(random_logs(), st.floats(-2.0, 2.0))
def test_moving_device_windows_moves_at_most_the_documented_bound(log, e_ms):
    # docs/gpu.md: moving a gap's device windows by e changes its parts (L1) by at most 4e
    # per window on its path plus twice the loop thread's own work inside them (before or
    # after)
    # the bound is the device rule's: with OS evidence, a gap whose parts the device path
    # changes takes no OS share (docs/partition.md), so a move can flip that as a whole
    assume(not len(log.os_samples))
    moved_log = _shift_device(log, e_ms)
    before, after = partition(log), partition(moved_log)
    assert len(before) == len(after)
    for i in range(len(before)):
        if before.num_evictions[i]:
            continue  # host rules only: device windows play no part
        args = (int(before.request[i]), before.t0_s[i], before.t1_s[i], int(before.step1[i]))
        k0, b0 = _eligible_and_busy(log, *args)
        k1, b1 = _eligible_and_busy(moved_log, *args)
        bound = 4 * abs(e_ms) * max(k0, k1) + 2 * max(b0, b1)
        moved = float(np.abs(after.parts_ms[i] - before.parts_ms[i]).sum())
        assert moved <= bound + 1e-6, (i, moved, bound, k0, k1, b0, b1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_logs(), st.data())
def test_a_selection_of_gaps_is_each_gap_as_partitioned(log, data):
    """`Partition.take` (docs/reports.md, "Windows": a selection, never a new partition):
    by mask or by indices, row k of the selection is the k-th chosen gap, every column."""
    from tracekit.attribution.itl import _GAP_COLUMNS

    p = partition(log)
    mask = np.array(data.draw(st.lists(st.booleans(), min_size=len(p), max_size=len(p))), bool)
    idx = np.array(data.draw(st.lists(st.integers(0, max(len(p) - 1, 0)), max_size=len(p)
                                      if len(p) else 0)), dtype=np.int64)  # fmt: skip
    for rows, chosen in ((mask, np.flatnonzero(mask)), (idx, idx)):
        cut = p.take(rows)
        assert len(cut) == len(chosen) and cut.labels == p.labels
        for f in _GAP_COLUMNS:
            want = getattr(p, f)
            for k, g in enumerate(chosen.tolist()):
                assert np.array_equal(getattr(cut, f)[k], want[g]), (f, k)
    assert cut.parts_ms.shape == (len(idx), len(p.labels))
