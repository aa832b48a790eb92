"""Property tests: random layouts always reconcile, and the vectorised partitioner equals the
slow reference one to 1e-9 ms."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from logbuilder import LogBuilder

from tracekit.partition import partition, partition_reference

EXTRA = ["schedule", "sample"]


@st.composite
def random_logs(draw):
    b = LogBuilder()
    n_req = draw(st.integers(1, 4))
    n_steps = draw(st.integers(1, 12))
    t = draw(st.floats(0, 5))
    for _ in range(n_steps):
        dur = draw(st.floats(0.5, 30))
        graph = draw(st.sampled_from([-1, 0, 1, 2, 4, 8]))
        n_dec = draw(st.integers(0, 9)) if graph != -1 else 0
        s = b.step(t, t + dur, n_decode=n_dec, graph=graph)
        # sequential segments inside the step, some with idle between
        cur = t
        for label in draw(st.lists(st.sampled_from(["tok", "swap", "prefill", "decode", *EXTRA]),
                                   max_size=4)):  # fmt: skip
            a = cur + draw(st.floats(0, dur / 4))
            e = min(t + dur, a + draw(st.floats(0, dur / 2)))
            if e < a:
                break
            b.seg(s, label, a, e)
            if label in ("decode", "prefill") and draw(st.booleans()):
                # its device execution, lagging the host launch (async) by a random delay
                lag = draw(st.floats(0, 20))
                b.seg(s, label, a + lag, e + lag + draw(st.floats(0, 5)), device=True)
            cur = e
        emitters = draw(st.lists(st.integers(0, n_req - 1), unique=True, max_size=n_req))
        reads = s - 1 if (s and draw(st.booleans())) else s  # async: the previous step's work
        for r in emitters:
            b.emit(r, cur if draw(st.booleans()) else t + dur, s, reads=reads)
        t += dur + draw(st.floats(0, 3))
    # another thread's windows, overlapping anything
    for _ in range(draw(st.integers(0, 3))):
        a = draw(st.floats(0, t))
        b.seg(-1, draw(st.sampled_from(["tok", "schedule"])), a, a + draw(st.floats(0, 10)), 1)
    for _ in range(draw(st.integers(0, 4))):
        a = draw(st.floats(0, t))
        b.gc(a, a + draw(st.floats(0, 15)), draw(st.integers(0, 2)))
    for _ in range(draw(st.integers(0, 4))):
        a = draw(st.floats(0, t))
        readmit = a + draw(st.floats(0, 40)) if draw(st.booleans()) else float("nan")
        b.evict(draw(st.integers(0, n_req - 1)), a, readmit)
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
