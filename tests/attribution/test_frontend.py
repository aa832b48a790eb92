"""Client-boundary gaps (`tracekit.attribution.client`): hand-derived cases from the written rules
(the module docstring), and the fast partition against the loop reference."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from logbuilder import LogBuilder

from tracekit.attribution.client import client_partition, itl_conventions
from tracekit.attribution.itl import partition
from tracekit.attribution.reference import client_partition_reference
from tracekit.log.rawlog import ClientEmissions, Deliveries, ProcOs, ProcSegments

PROCS = [{"role": "engine_core"}, {"role": "api_server"}, {"role": "worker"}]


def serve_log(b: LogBuilder, chunks, windows=(), deliveries=(), os_intervals=()):
    """The engine log `b` plus the client boundary, all times in ms.

    chunks: (request, t_write, tokens[, t_ready]); windows: (process, label, t0, t1);
    deliveries: (step, t_out, t_recv); os_intervals: `proc_os` rows."""
    log = b.build()
    labels = list(log.labels)
    for _, lb, _, _ in windows:
        if lb not in labels:
            labels.append(lb)
    s = 1e-3
    ce = ClientEmissions.from_columns(
        request=[c[0] for c in chunks],
        t_s=[c[1] * s for c in chunks],
        t_ready_s=[(c[3] if len(c) > 3 else c[1]) * s for c in chunks],
        num_tokens=[c[2] for c in chunks],
        process=[1] * len(chunks),
    )
    ps = ProcSegments.from_columns(
        process=[w[0] for w in windows],
        label=[labels.index(w[1]) for w in windows],
        t_start_s=[w[2] * s for w in windows],
        t_end_s=[w[3] * s for w in windows],
    )
    dl = Deliveries.from_columns(
        step=[d[0] for d in deliveries],
        t_out_s=[d[1] * s for d in deliveries],
        t_recv_s=[d[2] * s for d in deliveries],
        process=[1] * len(deliveries),
    )
    return replace(log, labels=tuple(labels), client_emissions=ce, proc_segments=ps,
                   deliveries=dl, proc_os=proc_os(os_intervals),
                   meta={**log.meta, "processes": PROCS})  # fmt: skip


def proc_os(rows) -> ProcOs:
    """API servers' OS intervals from (process, t0, t1, runqueue, offcpu[, in_segment]), ms;
    in_segment 1 unless given."""
    s = 1e-3
    return ProcOs.from_columns(
        process=[o[0] for o in rows],
        t_start_s=[o[1] * s for o in rows],
        t_end_s=[o[2] * s for o in rows],
        runqueue_s=[o[3] * s for o in rows],
        offcpu_s=[o[4] * s for o in rows],
        in_segment=[o[5] if len(o) > 5 else 1 for o in rows],
    )


def _hand_log():
    b = LogBuilder()
    # engine core: five captured decode steps of request 0, one GC pause in step 1
    for k, (t0, t1) in enumerate([(0, 10), (10, 20), (20, 30), (30, 40), (40, 40.9)]):
        b.step(t0, t1)
        b.seg(k, "decode", t0, t1)
        b.emit(0, t1, k)
    b.gc(12, 14)
    chunks = [(0, 11, 1), (0, 25, 1), (0, 41, 2), (0, 43, 1)]  # the 3rd carries 2 tokens
    windows = [
        (1, "output", 21.0, 22.0),
        (1, "gc", 22.5, 23.0),
        (1, "sse_write", 23.5, 24.0),  # another request's chunk: the loop was busy
        (1, "sse_write", 24.5, 25.0),
        (2, "forward", 20.5, 24.0),  # a worker's window: never a frontend cause
    ]
    deliveries = [(0, 10, 10.4), (1, 20, 21.0), (2, 30, 30.3), (3, 40, 40.2), (4, 40.9, 41.5)]
    return serve_log(b, chunks, windows, deliveries)


def _row(cp, i):
    return {lb: round(float(v), 9) for lb, v in zip(cp.labels, cp.parts_ms[i], strict=True) if v}


def test_hand_derived_client_gaps():
    cp = client_partition(_hand_log())
    assert len(cp) == 3
    # gap 0 = [11, 25]: the chunk's token left the engine at 20 (step 1).
    #  engine part [11, 20], as an engine gap: decode [10, 20] minus the GC [12, 14]:
    #    gc 2, forward 7;
    #  frontend part [20, 25]: output [21, 22] 1; frontend GC [22.5, 23] 0.5; the two
    #    writes [23.5, 24] + [24.5, 25] 1; hop [20, recv 21] 1; the rest ([22, 22.5],
    #    [23, 23.5], [24, 24.5]) frontend_other 1.5. The worker's window counts for nothing.
    assert _row(cp, 0) == {"gc": 2.0, "forward": 7.0, "output": 1.0, "frontend_gc": 0.5,
                           "sse_write": 1.0, "hop": 1.0, "frontend_other": 1.5}  # fmt: skip
    # gap 1 = [25, 41], a chunk of 2 tokens whose last left the engine at 40:
    #  engine part [25, 40]: decode [25, 30] + [30, 40] = forward 15;
    #  frontend part [40, 41]: hop [40, 40.2] 0.2, other 0.8
    assert _row(cp, 1) == {"forward": 15.0, "hop": 0.2, "frontend_other": 0.8}
    assert cp.num_tokens[1] == 2
    # gap 2 = [41, 43]: its token left the engine at 40.9, before the previous write, so
    #  the engine part is empty; hop [41, 41.5] 0.5, other 1.5
    assert _row(cp, 2) == {"hop": 0.5, "frontend_other": 1.5}
    assert np.allclose(cp.gap_ms, [14, 16, 2])
    assert np.allclose(cp.engine_s * 1e3, [20, 40, 41])


def test_hand_derived_client_gaps_with_the_api_servers_os_evidence():
    """docs/partition.md, "Unrecorded windows", rule 5: inside an OS interval of the API
    server, the interval's run-queue share (R / L) of each instant of the frontend part is
    the OS's and, inside a segment, its off-CPU share (B / L), taken from whichever label
    owns the instant."""
    log = replace(_hand_log(), proc_os=proc_os([
        (1, 21.0, 22.0, 0.2, 0.3),  # in the output segment: R/L 0.2, B/L 0.3
        (1, 22.0, 23.5, 0.3, 0.6, 0),  # between segments: R/L 0.2; B not evidence (idle?)
        (1, 24.5, 25.5, 0.5, 0.0),  # the second write and 0.5 ms of gap 1's engine part
        (1, 40.0, 41.0, 0.1, 0.2),  # gap 1's frontend part: R/L 0.1, B/L 0.2
    ]))  # fmt: skip
    cp = client_partition(log)
    assert cp.labels[-2:] == ("frontend_os_runqueue", "frontend_os_blocked")
    # gap 0 = [11, 25], frontend part [20, 25] (test_hand_derived_client_gaps) with:
    #  output [21, 22]: 1 ms, of which 0.2 run queue and 0.3 off CPU -> output 0.5;
    #  [22, 23.5] at R/L 0.2: other [22, 22.5] and [23, 23.5] 1 ms -> 0.8, frontend GC
    #    [22.5, 23] 0.5 -> 0.4, run queue 0.3; its off-CPU time is no one's;
    #  the write [24.5, 25]: 0.5 ms at R/L 0.5 -> sse_write 0.5 + 0.25, run queue 0.25;
    #  other [24, 24.5] 0.5 stays; the engine part is the engine core's (gc 2, forward 7).
    assert _row(cp, 0) == {"gc": 2.0, "forward": 7.0, "output": 0.5, "frontend_gc": 0.4,
                           "sse_write": 0.75, "hop": 1.0, "frontend_other": 1.3,
                           "frontend_os_runqueue": 0.75, "frontend_os_blocked": 0.3}  # fmt: skip
    # gap 1 = [25, 41]: the engine part [25, 40] stays forward 15 (the API server's interval
    #  over [25, 25.5] is not its time); frontend part [40, 41]: hop 0.2 and other 0.8,
    #  each 0.1 run queue and 0.2 off CPU -> hop 0.14, other 0.56, 0.1 and 0.2
    assert _row(cp, 1) == {"forward": 15.0, "hop": 0.14, "frontend_other": 0.56,
                           "frontend_os_runqueue": 0.1, "frontend_os_blocked": 0.2}  # fmt: skip
    # gap 2 = [41, 43]: no interval over it
    assert _row(cp, 2) == {"hop": 0.5, "frontend_other": 1.5}
    assert np.allclose(cp.frontend_ms(), [5.0, 1.0, 2.0])
    ref = client_partition_reference(log)
    assert ref.labels == cp.labels
    assert np.allclose(ref.parts_ms, cp.parts_ms, atol=1e-9)
    # without the evidence there are no OS columns
    assert "frontend_os_runqueue" not in client_partition(_hand_log()).labels


def test_hand_derived_itl_conventions():
    log = _hand_log()
    cp = client_partition(log)
    itl = itl_conventions(log, cp, partition(log).gap_ms)
    # per chunk: gaps 14, 16, 2 -> median 14
    assert itl["per_chunk"]["p50"] == pytest.approx(14)
    # per token: 14 (1 token), 16 / 2 = 8 twice, 2 -> [2, 8, 8, 14], median 8
    assert itl["per_token"]["p50"] == pytest.approx(8)
    assert itl["per_token"]["n"] == 4
    # per engine step: emissions at 10, 20, 30, 40, 40.9 -> 10, 10, 10, 0.9, median 10
    assert itl["per_engine_step"]["p50"] == pytest.approx(10)


def test_reference_agrees_on_the_hand_case():
    log = _hand_log()
    fast, ref = client_partition(log), client_partition_reference(log)
    assert fast.labels == ref.labels
    assert np.allclose(fast.parts_ms, ref.parts_ms, atol=1e-9)


def test_an_evicted_request_is_preempt_in_the_engine_part():
    b = LogBuilder()
    b.step(0, 10)
    b.seg(0, "decode", 0, 10)
    b.emit(0, 10, 0)
    b.step(10, 30)
    b.seg(1, "decode", 10, 30)
    b.emit(0, 30, 1)
    b.evict(0, 12, 25, mode=1)
    log = serve_log(b, [(0, 11, 1), (0, 31, 1)], deliveries=[(1, 30, 30.5)])
    cp = client_partition(log)
    # engine part [11, 30]: evicted [12, 25] is preempt 13; decode [11, 12] + [25, 30] = 6;
    # frontend part [30, 31]: hop 0.5, other 0.5
    assert _row(cp, 0) == {"preempt": 13.0, "forward": 6.0, "hop": 0.5, "frontend_other": 0.5}


@st.composite
def _random_serve_log(draw):
    b = LogBuilder()
    n_req = draw(st.integers(1, 3))
    t = 0.0
    em_times: dict[int, list[float]] = {r: [] for r in range(n_req)}
    deliveries = []
    for k in range(draw(st.integers(2, 8))):
        dur = draw(st.floats(0.5, 10))
        b.step(t, t + dur, graph=draw(st.sampled_from([0, 1])))
        b.seg(k, draw(st.sampled_from(["decode", "prefill", "schedule"])), t, t + dur)
        for r in range(n_req):
            if draw(st.booleans()):
                b.emit(r, t + dur, k, n=draw(st.integers(1, 3)))
                em_times[r].append(t + dur)
        deliveries.append((k, t + dur, t + dur + draw(st.floats(0.0, 2.0))))
        t += dur
    if draw(st.booleans()):
        g0 = draw(st.floats(0, t))
        b.gc(g0, g0 + draw(st.floats(0, 3)))
    if draw(st.booleans()):
        e0 = draw(st.floats(0, t))
        b.evict(0, e0, e0 + draw(st.floats(0, 5)), mode=1)
    log = b.build()
    chunks = []
    for r in range(n_req):
        em = log.emissions
        mine = np.flatnonzero(em.request == r)
        w = t * 0.0
        for i in mine:  # one chunk per emission, some merged with the next
            w = max(w, float(em.t_s[i]) * 1e3) + draw(st.floats(0.01, 3))
            chunks.append((r, w, int(em.num_tokens[i])))
        if len(chunks) >= 2 and draw(st.booleans()) and chunks[-1][0] == chunks[-2][0] == r:
            last, prev = chunks.pop(), chunks.pop()
            chunks.append((r, last[1], prev[2] + last[2]))
    windows = []
    for _ in range(draw(st.integers(0, 6))):
        w0 = draw(st.floats(0, t + 10))
        lb = draw(st.sampled_from(["gc", "sse_write", "output", "input", "forward"]))
        windows.append((draw(st.sampled_from([1, 2])), lb, w0, w0 + draw(st.floats(0, 4))))
    # the API server's OS intervals (sometimes none: no OS columns), one process's never
    # overlapping; a worker's (process 2) are never the frontend's
    os_rows = []
    for proc in (1, 2):
        o = draw(st.floats(0, t / 2 + 1))
        for _ in range(draw(st.integers(0, 4))):
            o0 = o + draw(st.floats(0, 5))
            length = draw(st.sampled_from([0.0, draw(st.floats(0.01, 6))]))
            rq = length * draw(st.floats(0, 1))
            off = (length - rq) * draw(st.floats(0, 1))
            os_rows.append((proc, o0, o0 + length, rq, off, draw(st.sampled_from([0, 1]))))
            o = o0 + length
    return serve_log(b, chunks, windows, deliveries, os_rows)


@settings(max_examples=60, deadline=None)
@given(_random_serve_log())
def test_fast_equals_reference_and_every_gap_reconciles(log):
    fast = client_partition(log)  # check=True: raises if a gap's parts miss its length
    ref = client_partition_reference(log)
    assert fast.labels == ref.labels
    assert np.allclose(fast.parts_ms, ref.parts_ms, atol=1e-6)
    assert np.all(fast.parts_ms >= -1e-9)
    assert np.allclose(ref.parts_ms.sum(axis=1), ref.gap_ms, atol=1e-6)


def test_spec_acceptance_hand_derived():
    from tracekit.attribution.client import spec_acceptance
    from tracekit.log.rawlog import Counters

    b = LogBuilder()
    b.step(0, 10)
    b.emit(0, 10, 0, n=3)
    b.step(10, 20)
    b.emit(0, 20, 1, n=1)
    log = b.build()
    assert spec_acceptance(log) is None  # no speculative decoding recorded
    # a log with only the totals (recorded before drafts and positions were counted):
    # step 0: 3 drafts, 2 accepted (3 tokens emitted); step 1: 3 drafts, none accepted
    log = replace(log, counter_names=("spec.drafted", "spec.accepted"),
                  counters=Counters.from_columns(name=[0, 1, 0, 1], t_s=[0.01, 0.01, 0.02, 0.02],
                                                 value=[3, 2, 3, 0]))  # fmt: skip
    acc = spec_acceptance(log)
    # accepted 2 of 6 drafted; tokens per emission (3 + 1) / 2 = 2; no drafts count: no
    # mean accepted length, no positions
    totals = ("drafted", "accepted", "acceptance", "tokens_per_emission")
    assert {k: acc[k] for k in totals} == {"drafted": 6.0, "accepted": 2.0, "acceptance": 2 / 6,
                                           "tokens_per_emission": 2.0}  # fmt: skip
    assert math.isnan(acc["mean_accepted_length"]) and acc["acceptance_per_pos"] == []


def test_spec_acceptance_per_position_hand_derived():
    """Step 0 checks two drafts of 3 tokens: A accepted 2 (positions 1 and 2), B accepted 1
    (position 1); step 1 checks A's next draft of 3, none accepted."""
    from tracekit.attribution.client import spec_acceptance
    from tracekit.log.rawlog import Counters

    b = LogBuilder()
    b.step(0, 10)
    b.emit(0, 10, 0, n=3)
    b.step(10, 20)
    b.emit(0, 20, 1, n=1)
    names = ("spec.drafts", "spec.drafted", "spec.accepted",
             "spec.accepted_pos.0", "spec.accepted_pos.1", "spec.accepted_pos.2")  # fmt: skip
    # per step: drafts, drafted, accepted, then positions 0..2
    step0, step1 = [2, 6, 3, 2, 1, 0], [1, 3, 0, 0, 0, 0]
    log = replace(b.build(), counter_names=names, counters=Counters.from_columns(
        name=[*range(6), *range(6)], t_s=[0.01] * 6 + [0.02] * 6, value=step0 + step1))  # fmt: skip
    acc = spec_acceptance(log)
    # 3 drafts checked, 3 of 9 draft tokens accepted: mean accepted length 1 + 3 / 3 = 2;
    # position 1 accepted in 2 of 3 drafts, position 2 in 1, position 3 in none
    assert acc["drafts"] == 3.0 and acc["drafted"] == 9.0 and acc["accepted"] == 3.0
    assert acc["mean_accepted_length"] == pytest.approx(2.0)
    assert acc["accepted_per_pos"] == [2.0, 1.0, 0.0]
    assert acc["acceptance_per_pos"] == pytest.approx([2 / 3, 1 / 3, 0.0])
    from tracekit.analysis.results import SpecAcceptance
    from tracekit.render.client import spec_positions_html, spec_positions_text

    assert "1: 66.7%, 2: 33.3%, 3: 0.0%" in spec_positions_text(SpecAcceptance.of(acc))
    assert "<th>position 3</th>" in spec_positions_html([("run", SpecAcceptance.of(acc))])
    # beside ITL in analyze's figures, its text and the report's section
    from tracekit.analysis.figures import analyze
    from tracekit.render.client import spec_html
    from tracekit.render.text import analyze_report

    a = analyze(log)
    assert a.to_dict()["spec"]["acceptance_per_pos"] == pytest.approx([2 / 3, 1 / 3, 0.0])
    assert "mean accepted length 2.00, acceptance by position 1: 66.7%" in analyze_report([a])
    page = spec_html([("run", a)])
    assert "<td>66.7% (2)</td><td>33.3% (1)</td><td>0.0% (0)</td>" in page

    # a name that claims a huge position costs nothing: positions are read as far as the
    # log names them without a hole (0, 1, 2 here), never up to a number a name claims
    hostile = replace(log, counter_names=(*names[:5], "spec.accepted_pos.99999999999"))
    assert spec_acceptance(hostile)["accepted_per_pos"] == [2.0, 1.0]


def test_count_acceptance_counts_like_vllm_per_position():
    """The adapters' per-step counting, on hand-built scheduler outputs: request a drafted
    3 and got 3 tokens (2 drafts accepted, the third token is the forward pass's own), b
    drafted 3 (1 discarded as invalid before checking) and got 2, c drafted 1 and got 1,
    d drafted nothing, e drafted 2 and got no tokens (not checked)."""
    from engine_adapters.vllm_v1 import count_acceptance

    class Rec:
        def __init__(self) -> None:
            self.rows: list[tuple[str, float]] = []

        def counter(self, name: str, value: float) -> None:
            self.rows.append((name, value))

    rec = Rec()
    drafts = {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7], "e": [8, 9]}
    count_acceptance(rec, drafts, ["a", "b", "c", "d", "e"],
                     [[1, 2, 9], [4, 9], [5], [3], []], {"b": 1})  # fmt: skip
    assert dict(rec.rows) == {
        "spec.drafts": 3.0,  # a, b, c
        "spec.drafted": 6.0,  # 3 + (3 - 1) + 1
        "spec.accepted": 3.0,  # 2 + 1 + 0
        "spec.accepted_pos.0": 2.0,  # a, b
        "spec.accepted_pos.1": 1.0,  # a
        "spec.accepted_pos.2": 0.0,  # nobody; sampled up to the longest draft (3)
    }
    rec = Rec()
    count_acceptance(rec, {}, ["a"], [[1]])
    assert rec.rows == []  # no draft checked: nothing recorded


def test_process_tracks_are_a_valid_trace_even_with_overlapping_windows():
    from tracekit.render.client import process_events
    from tracekit.render.perfetto import chrome_trace_events, validate_trace

    b = LogBuilder()
    b.step(0, 10)
    b.seg(0, "decode", 0, 10)
    b.emit(0, 10, 0)
    b.step(10, 20)
    b.seg(1, "decode", 10, 20)
    b.emit(0, 20, 1)
    windows = [(1, "tokenize", 1, 5), (1, "tokenize", 2, 6), (1, "tokenize", 3, 4),
               (1, "output", 10.5, 11), (2, "forward", 12, 19)]  # fmt: skip
    log = serve_log(b, [(0, 11, 1), (0, 21, 1)], windows, [(0, 10, 10.2), (1, 20, 20.3)])
    extra = process_events(log)
    events = chrome_trace_events(log, partition(log)) + extra
    assert validate_trace(events) == []
    names = {e["args"]["name"] for e in extra if e.get("name") == "thread_name"}
    # three overlapping tokenize windows need three lanes; chunks and deliveries have theirs
    assert {"tokenize", "tokenize (2)", "tokenize (3)", "output", "forward"} <= names
    assert {"client chunks written", "step outputs received"} <= names
    procs = {e["args"]["name"] for e in extra if e.get("name") == "process_name"}
    assert procs == {"api_server (pid ?)", "worker (pid ?)"}


def test_window_lanes_by_hand():
    from tracekit.render.client import window_lanes, window_lanes_reference

    # by start (longest first at a tie): [0, 10) lane 0; [0, 4) lane 1; [2, 3) lane 2;
    # [4, 6): lane 1 has ended at 4 (lane 2 too; the lowest wins) -> 1; [5, 7): lane 2
    # (ended at 3); [10, 11): lane 0 ended at 10 -> 0; [12, nan): every lane free -> 0,
    # and a window without an end never frees its lane: [13, 14) -> 1
    a = np.array([0, 2, 0, 4, 5, 10, 12, 13], dtype=float)
    b = np.array([10, 3, 4, 6, 7, 11, np.nan, 14], dtype=float)
    for impl in (window_lanes, window_lanes_reference):
        lane_of, n = impl(a, b)
        assert lane_of.tolist() == [0, 2, 1, 1, 2, 0, 0, 1] and n == 3, impl


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 12)), max_size=60))
def test_window_lanes_equal_the_reference(windows):
    """Random windows with ties and zero lengths: the heap layout is the reference's, and no
    lane holds two windows that overlap."""
    from tracekit.render.client import window_lanes, window_lanes_reference

    a = np.array([w[0] for w in windows], dtype=float)
    b = a + np.array([w[1] for w in windows], dtype=float)
    got, want = window_lanes(a, b), window_lanes_reference(a, b)
    assert got[1] == want[1] and got[0].tolist() == want[0].tolist()
    for j in range(got[1]):
        w = np.flatnonzero(got[0] == j)
        o = w[np.argsort(a[w], kind="stable")]
        assert (a[o][1:] >= b[o][:-1]).all()


def test_process_tracks_of_a_run_whose_requests_carry_no_ids_name_them_by_index():
    # a merged run whose processes recorded no request ids: each client chunk's instant
    # names its request by index (the trace of such a run raised IndexError)
    import dataclasses

    from tracekit.render.client import process_events
    from tracekit.render.perfetto import chrome_trace_events, validate_trace

    b = LogBuilder()
    b.step(0, 10)
    b.seg(0, "decode", 0, 10)
    b.emit(0, 10, 0)
    b.step(10, 20)
    b.seg(1, "decode", 10, 20)
    b.emit(0, 20, 1)
    log = serve_log(b, [(0, 11, 1), (0, 21, 1)], [(1, "output", 10.5, 11)])
    log = dataclasses.replace(log, request_ids=())
    extra = process_events(log)
    chunks = [e for e in extra if e.get("name") == "chunk"]
    assert [c["args"]["request"] for c in chunks] == ["0", "0"]
    assert validate_trace(chrome_trace_events(log, partition(log)) + extra) == []
