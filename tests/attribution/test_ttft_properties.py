"""Random logs: the vectorised TTFT partition equals the reference to 1e-9 ms, and both
reconcile (parts and phases sum to every TTFT)."""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from logbuilder import LogBuilder

from tracekit.attribution.reference import ttft_partition_reference
from tracekit.attribution.ttft import check_ttft_reconciled, ttft_partition
from tracekit.log.rawlog import WAIT_REASONS, ClientEmissions, ProcOs
from tracekit.log.validate import validate_log

LABELS = ("tok", "prefill", "decode", "swap", "recompute", "schedule")


def random_log(seed: int):
    """A run of 3-12 steps with overlapping segments of every kind (some device windows),
    GC pauses, requests that queue (some with stated reasons), get admitted, prefill in
    chunks, are evicted before their first token, or have no admission row (unsplit). Half
    the runs have the loop thread's OS samples at every step boundary (os_runqueue,
    os_blocked), some with explicit waits for the device."""
    rng = np.random.default_rng(seed)
    b = LogBuilder()
    n_steps = int(rng.integers(3, 12))
    t = 0.0
    bounds = []
    for s in range(n_steps):
        dur = float(rng.uniform(2, 15))
        graph = int(rng.choice([0, 4, 8]))
        b.step(t, t + dur, n_decode=int(rng.integers(1, 9)), graph=graph)
        bounds.extend([t, t + dur])
        for _ in range(int(rng.integers(0, 5))):
            a = t + float(rng.uniform(-1, dur))
            b.seg(s, str(rng.choice(LABELS)), a, a + float(rng.uniform(0, dur / 2)),
                  device=bool(rng.random() < 0.15))  # device windows: not charged  # fmt: skip
        if rng.random() < 0.2:  # a window outside any step (another thread)
            a = t + float(rng.uniform(0, dur))
            b.seg(-1, str(rng.choice(LABELS)), a, a + float(rng.uniform(0, 3)))
        if rng.random() < 0.3:
            a = t + float(rng.uniform(0, dur))
            b.gc(a, a + float(rng.uniform(0, 4)))
        t += dur + float(rng.choice([0.0, rng.uniform(0, 3)]))
    end = t
    n_req = int(rng.integers(1, 6))
    arrivals = []
    for r in range(n_req):
        arrival = float(rng.uniform(-2, end * 0.7))
        first = float(rng.uniform(arrival, end + 2))
        arrivals.append(arrival)
        b.emit(r, first, int(rng.integers(0, n_steps)))
        if rng.random() < 0.5:
            b.emit(r, first + float(rng.uniform(0, 5)), n_steps - 1)
        if rng.random() < 0.8:  # admitted (else: unsplit)
            adm = float(rng.uniform(arrival, first)) if rng.random() < 0.9 else arrival
            b.admit(r, adm)
            if rng.random() < 0.4:
                ev = float(rng.uniform(adm, first + 3))
                b.evict(r, ev, ev + float(rng.uniform(0, 8)) if rng.random() < 0.8 else np.nan)
        elif rng.random() < 0.3:
            ev = float(rng.uniform(arrival, first + 3))
            b.evict(r, ev, ev + float(rng.uniform(0, 8)))
        for s in rng.choice(n_steps, size=int(rng.integers(0, n_steps)), replace=False):
            b.wait(int(s), r, str(rng.choice(WAIT_REASONS)))
        for s in rng.choice(n_steps, size=int(rng.integers(0, 4)), replace=False):
            b.prefill(int(s), r, int(rng.integers(0, 64)))
    os_rng = np.random.default_rng([seed, 20])  # its own draws: the rest stays as it was
    if os_rng.random() < 0.5:
        cpu = runq = 0.0
        prev = bounds[0]
        for k, x in enumerate(bounds):
            width = x - prev
            wait = float(os_rng.uniform(0, 1)) * width
            runq += wait
            cpu += float(os_rng.uniform(0, 1)) * (width - wait)
            b.os_sample(x, cpu, runq, kind=k % 2)
            prev = x
        if os_rng.random() < 0.5:  # a tokenizer thread, sampled at its windows' ends
            ends = []
            for _ in range(int(os_rng.integers(1, 4))):
                a = float(os_rng.uniform(0, end))
                ends += [a, a + float(os_rng.uniform(0, 6))]
                b.seg(-1, str(os_rng.choice(["tok", "prefill", "wait"])), ends[-2], ends[-1],
                      thread=1)  # fmt: skip
            cpu = runq = 0.0
            ends.sort()
            prev = ends[0]
            for k, x in enumerate(ends):
                wait = float(os_rng.uniform(0, 1)) * (x - prev)
                runq += wait
                cpu += float(os_rng.uniform(0, 1)) * (x - prev - wait)
                b.os_sample(x, cpu, runq, kind=2 + k % 2, thread=1)
                prev = x
        for _ in range(int(os_rng.integers(0, 3))):  # waits for the device: off-CPU by what
            a = float(os_rng.uniform(0, end))  # they are
            s = int(np.searchsorted(bounds[1::2], a))
            b.seg(min(s, n_steps - 1), str(os_rng.choice(["wait", "sync"])), a,
                  a + float(os_rng.uniform(0, 4)))  # fmt: skip
    _recompute(b, np.random.default_rng([seed, 22]))
    log = b.build(arrivals_ms=arrivals, wall_ms=end + 10)
    return _served(log, np.random.default_rng([seed, 21]), end)


def _recompute(b, rng) -> None:
    """Recompute evictions, with their own draws (the rest stays as it was): each eviction
    drawn above is in recompute mode half the time, and before some `recompute` segments
    an admitted request is evicted and back at the segment's start (it re-prefills there,
    in its TTFT window or after it)."""
    b.evs[:] = [(r, x, y, int(rng.random() < 0.5)) for r, x, y, _ in b.evs]
    rc = b.labels.index("recompute") if "recompute" in b.labels else -1
    for step, lab, a, _, _, dev in list(b.segs):
        if lab != rc or dev or step < 0 or not b.admits or rng.random() < 0.4:
            continue
        r, adm = b.admits[int(rng.integers(0, len(b.admits)))]
        ev = float(rng.uniform(adm, a)) if a > adm else None
        if ev is not None:
            b.evict(r, ev, a, mode=1)


def _served(log, rng, end):
    """Half the runs a server's: per request, its handler and engine-core add stamps after
    arrival, its first chunk written by one of two API servers, and each API server's OS
    intervals (proc_os: disjoint, inside a segment or not)."""
    if rng.random() < 0.5:
        return log
    rq, ms = log.requests, 1e-3
    n = len(rq)
    handler = rq.arrival_s + rng.uniform(0, 4, n) * ms
    engine = handler + rng.uniform(0, 4, n) * ms
    # the engine core adds a request before its scheduler admits it (validation rejects
    # the other order)
    adm = np.full(n, np.inf)
    adm[log.admissions.request] = log.admissions.t_s
    engine = np.minimum(engine, adm)
    handler = np.minimum(handler, engine)
    gone = rng.random(n) < 0.2  # a stage not recorded lasts 0
    handler[gone] = np.nan
    procs = rng.integers(1, 3, n)
    rows = []
    for p in (1, 2):
        t = float(rng.uniform(-3, 3))
        for _ in range(int(rng.integers(0, 8))):
            t0 = t + float(rng.choice([0.0, rng.uniform(0, 3)]))
            t1 = t0 + float(rng.choice([0.0, rng.uniform(0, 4)]))
            runq = (t1 - t0) * float(rng.uniform(0, 1))
            off = (t1 - t0 - runq) * float(rng.uniform(0, 1))
            rows.append((p, t0 * ms, t1 * ms, runq * ms, off * ms, int(rng.integers(0, 2))))
            t = t1
    cols = np.array(rows, dtype=np.float64).reshape(-1, 6)
    has_chunk = rng.random(n) < 0.9  # a request with no chunk: no API server, no OS share
    return replace(
        log,
        requests=replace(rq, handler_s=handler, engine_s=engine),
        client_emissions=ClientEmissions.from_columns(
            request=np.flatnonzero(has_chunk),
            t_s=rq.first_token_s[has_chunk],
            t_ready_s=rq.first_token_s[has_chunk],
            num_tokens=np.ones(int(has_chunk.sum())),
            process=procs[has_chunk],
        ),  # fmt: skip
        proc_os=ProcOs.from_columns(**{k: cols[:, i] for i, k in enumerate(ProcOs.DTYPES)}),
        meta={
            **log.meta,
            "processes": [{"role": "engine_core"}, {"role": "api_server"}, {"role": "api_server"}],
        },  # fmt: skip
    )


def _agree(seed: int) -> None:
    log = validate_log(random_log(seed))
    fast = ttft_partition(log)  # raises ReconcileError if it does not sum
    ref = check_ttft_reconciled(ttft_partition_reference(log), "reference")
    assert fast.labels == ref.labels
    np.testing.assert_array_equal(fast.request, ref.request)
    np.testing.assert_allclose(fast.parts_ms, ref.parts_ms, rtol=0, atol=1e-9)
    np.testing.assert_allclose(fast.phases_ms, ref.phases_ms, rtol=0, atol=1e-9)
    np.testing.assert_allclose(fast.context_ms, ref.context_ms, rtol=0, atol=1e-9)
    np.testing.assert_allclose(fast.reprefill_own_ms, ref.reprefill_own_ms, rtol=0, atol=1e-9)
    np.testing.assert_allclose(fast.reprefill_other_ms, ref.reprefill_other_ms, rtol=0, atol=1e-9)
    assert fast.reconcile_max_err_ms < 1e-9 and ref.reconcile_max_err_ms < 1e-9
    # same primary cause, except where two candidates tie to float rounding
    differ = fast.primary != ref.primary
    for i in np.flatnonzero(differ):
        a, b = fast.parts_ms[i], ref.parts_ms[i]
        ia = fast.labels.index(fast.causes[fast.primary[i]]) if fast.primary[i] >= 0 else None
        ib = ref.labels.index(ref.causes[ref.primary[i]]) if ref.primary[i] >= 0 else None
        assert ia is not None and ib is not None and abs(a[ia] - b[ib]) < 1e-9


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_vectorised_equals_reference_and_reconciles(seed):
    _agree(seed)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_prefill_without_the_row_by_segment_join_equals_reference(seed):
    """Every step through the prefix-sum path of the prefill join (no piece per row and
    segment): still the reference's partition."""
    import tracekit.attribution.ttft as ttft

    with mock.patch.object(ttft, "_JOIN_FACTOR", 0):
        _agree(seed)


def test_random_logs_exercise_every_rule():
    """The generator is not vacuous: over 200 seeds every rule owns some time."""
    seen: dict[str, float] = {}
    for seed in range(200):
        p = ttft_partition(validate_log(random_log(seed)))
        for lb, v in zip(p.labels, p.parts_ms.sum(axis=0), strict=True):
            seen[lb] = seen.get(lb, 0.0) + float(v)
        seen["<own re-prefill>"] = seen.get("<own re-prefill>", 0.0) + p.reprefill_own_ms.sum()
        seen["<others' re-prefill>"] = (
            seen.get("<others' re-prefill>", 0.0) + p.reprefill_other_ms.sum()
        )
    assert seen["<own re-prefill>"] > 0 and seen["<others' re-prefill>"] > 0
    for lb in ("preempt", "gc", "wait_kv_blocks", "tok", "prefill_own", "prefill_other",
               "decode_other", "graph", "prefill", "residual", "schedule", "os_runqueue",
               "os_blocked", "wait", "http", "frontend", "frontend_os_runqueue",
               "frontend_os_blocked"):  # fmt: skip
        assert seen.get(lb, 0.0) > 0, lb
