"""The client-boundary TTFT (docs/ttft.md, "The client boundary"): a hand-derived case from
the written rules, and the vectorised partition against the loop reference on random server
logs (every client TTFT reconciles)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from logbuilder import LogBuilder
from test_frontend import serve_log
from test_ttft_properties import random_log

from tracekit.attribution.client_ttft import (
    check_client_ttft_reconciled,
    client_ttft_figures,
    client_ttft_partition,
)
from tracekit.attribution.reference import client_ttft_reference
from tracekit.attribution.ttft import ttft_partition
from tracekit.log.rawlog import ClientEmissions, Coverage, Deliveries, ProcSegments
from tracekit.log.validate import validate_log


def _hand_log(api_span_ms=None):
    """Two requests, both arriving at 0 ms (the request table's default here).

    Request 0: handler 1, engine core add 2, admitted 3; step 0 [2, 5] computes its whole
    prompt in a prefill segment [3, 5] (10 of the step's 10 prefill tokens) and emits its
    first token at 5; the API server (process 1) received step 0's outputs at 6 and wrote
    the first chunk at 9 (a second one at 11, listed first). Request 1: first token at 10,
    its chunk written at 9.5 (before: clocks that disagree). API server windows: output
    [5.5, 6.5], GC [7, 7.5], input [8, 8.8], a write [8.5, 9]. Its OS intervals: [0.5, 1.5]
    between segments (run queue 0.4, off-CPU 0.5), [6.5, 7.5] inside a segment (run queue
    0.2, off-CPU 0.4)."""
    b = LogBuilder()
    b.step(2, 5, n_decode=0, n_prefill=1)
    b.seg(0, "prefill", 3, 5)
    b.prefill(0, 0, 10)
    b.admit(0, 3)
    b.emit(0, 5, 0)
    b.step(5, 10)
    b.seg(1, "decode", 5, 10)
    b.emit(0, 10, 1)
    b.emit(1, 10, 1)
    chunks = [(0, 11, 1), (0, 9, 1), (1, 9.5, 1)]
    windows = [(1, "output", 5.5, 6.5), (1, "gc", 7, 7.5), (1, "input", 8, 8.8),
               (1, "sse_write", 8.5, 9), (2, "forward", 5, 9)]  # fmt: skip
    deliveries = [(0, 5, 6), (1, 10, 10.5)]
    os_rows = [(1, 0.5, 1.5, 0.4, 0.5, 0), (1, 6.5, 7.5, 0.2, 0.4, 1)]
    log = serve_log(b, chunks, windows, deliveries, os_rows)
    rq = log.requests
    log = replace(log, requests=replace(rq, handler_s=np.array([1e-3, np.nan]),
                                        engine_s=np.array([2e-3, np.nan])))  # fmt: skip
    if api_span_ms is not None:
        lo, hi = api_span_ms
        cov = Coverage.from_columns(process=[1], t_start_s=[lo * 1e-3], t_end_s=[hi * 1e-3],
                                    is_clean_stop=[1])  # fmt: skip
        log = replace(log, coverage=cov)
    return log


def _row(p, i):
    return {lb: round(float(v), 9) for lb, v in zip(p.labels, p.parts_ms[i], strict=True) if v}


# Request 0, by the rules (ms). Engine part [0, x], x = clip(first token 5, 0, write 9) = 5:
#   rule 0: http [0, 1] = 1, frontend [1, 2] = 1; the OS interval [0.5, 1.5] (between
#     segments: its run-queue share only, 0.4 / 1 per ms) takes 0.5 * 0.4 = 0.2 of each:
#     http 0.8, frontend 0.8, frontend_os_runqueue 0.4;
#   [2, 3] no segment: residual 1; [3, 5] prefill in the prefilling phase, the request's
#     share 10/10: prefill_own 2.
# Frontend part [5, 9] (the client gap's rules, e = 5, received at 6):
#   hop [5, 6] less the output window's [5.5, 6]: 0.5; output [5.5, 6.5]: 1;
#   [6.5, 7] no window, after the hop: frontend_other 0.5, [7, 7.5] frontend_gc 0.5; both
#     inside the OS interval [6.5, 7.5] (in a segment: run queue 0.2 / 1, off-CPU 0.4 / 1
#     per ms): each gives 0.1 to frontend_os_runqueue and 0.2 to frontend_os_blocked,
#     keeping 0.2;
#   [7.5, 8] frontend_other 0.5; [8, 8.5] input 0.5; [8.5, 9] sse_write (over input) 0.5.
# Sums: frontend_other 0.2 + 0.5 = 0.7, frontend_os_runqueue 0.4 + 0.2 = 0.6,
#   frontend_os_blocked 0.4; all parts 0.8+0.8+0.6+0.4+1+2+0.5+1+0.7+0.2+0.5+0.5 = 9 =
#   the write 9 - arrival 0. The worker's window counts for nothing.
HAND = {"http": 0.8, "frontend": 0.8, "frontend_os_runqueue": 0.6, "frontend_os_blocked": 0.4,
        "residual": 1.0, "prefill_own": 2.0, "hop": 0.5, "output": 1.0,
        "frontend_other": 0.7, "frontend_gc": 0.2, "input": 0.5, "sse_write": 0.5}  # fmt: skip


def test_hand_derived_client_ttft():
    log = _hand_log()
    p = client_ttft_partition(log)
    # request 1's chunk was written before its first token: left out, and said
    assert p.request.tolist() == [0]
    assert any("first chunk written before" in n for n in p.notes)
    assert _row(p, 0) == HAND
    assert np.allclose([p.ttft_ms[0], p.engine_ttft_ms[0], p.frontend_ms()[0]], [9, 5, 4])
    assert np.allclose([p.first_token_s[0] * 1e3, p.write_s[0] * 1e3], [5, 9])
    # the engine part is the engine boundary's TTFT partition, part for part
    e = ttft_partition(log)
    for lb, v in zip(e.labels, e.parts_ms[list(e.request).index(0)], strict=True):
        if v:
            assert lb in ("http", "frontend", "frontend_os_runqueue", "residual", "prefill_own")
    # output 1 ms is < 25% of 9 ms: no cause is primary (frontend_other is not a cause)
    assert p.primary_names().tolist() == ["clean"]
    f = client_ttft_figures(p)
    assert np.allclose([f["p50_ms"], f["engine_p50_ms"], f["frontend_share"]], [9, 5, 4 / 9])


def test_hand_derived_client_ttft_where_the_api_server_recorded_nothing():
    """Its span ends at 8.8: the frontend part's [8.8, 9] is unrecorded:api_server (0.2),
    taken from the write that owned it (sse_write 0.5 -> 0.3); nothing else moves."""
    p = client_ttft_partition(_hand_log(api_span_ms=(-100.0, 8.8)))
    assert _row(p, 0) == {**HAND, "sse_write": 0.3, "unrecorded:api_server": 0.2}


def test_reference_agrees_on_the_hand_cases():
    for span in (None, (-100.0, 8.8)):
        log = _hand_log(span)
        fast, ref = client_ttft_partition(log), client_ttft_reference(log)
        assert fast.labels == ref.labels and fast.notes == ref.notes
        np.testing.assert_allclose(fast.parts_ms, ref.parts_ms, rtol=0, atol=1e-9)


def served_log(seed: int):
    """`random_log(seed)` (tests/test_ttft_properties.py) as a server run (None if that
    seed's is not one), its first chunks written 0-4 ms after the first token (one in ten
    0-1 ms before: left out), some requests with a later chunk, each API server's windows,
    deliveries of some steps, and half the time API server spans that start or end
    mid-run (unrecorded:api_server)."""
    log = random_log(seed)
    ce = log.client_emissions
    if not len(ce):
        return None
    rng, ms = np.random.default_rng([seed, 34]), 1e-3
    n = len(ce)
    first = log.requests.first_token_s[ce.request]
    delay = np.where(rng.random(n) < 0.2, 0.0, rng.uniform(0, 4, n))
    delay = np.where(rng.random(n) < 0.1, -rng.uniform(0, 1, n), delay)
    t = first + delay * ms
    more = rng.random(n) < 0.5
    req = np.concatenate([ce.request, ce.request[more]])
    t_all = np.concatenate([t, t[more] + rng.uniform(0, 5, int(more.sum())) * ms])
    proc = np.concatenate([ce.process, ce.process[more]])
    end = float(np.nanmax(np.concatenate([t_all, log.steps.t_end_s]))) / ms
    labels = list(log.labels)
    names = ["gc", "sse_write", "output", "input", "forward"]
    labels += [lb for lb in names if lb not in labels]
    wins = []
    for p in (1, 2):
        for _ in range(int(rng.integers(0, 8))):
            w0 = float(rng.uniform(-3, end + 2))
            wins.append((p, labels.index(str(rng.choice(names))), w0, w0 + rng.uniform(0, 3)))
    w = np.array(wins, dtype=np.float64).reshape(-1, 4)
    dl = [(s, float(log.steps.t_end_s[s]), float(log.steps.t_end_s[s]) + rng.uniform(0, 2) * ms, p)
          for s in range(len(log.steps)) for p in (1, 2) if rng.random() < 0.7]  # fmt: skip
    d = np.array(dl, dtype=np.float64).reshape(-1, 4)
    cov = Coverage.empty()
    if rng.random() < 0.5:
        lo, hi = rng.uniform(-3, end / 2, 2), rng.uniform(end / 2, end + 3, 2)
        cov = Coverage.from_columns(process=[1, 2], t_start_s=lo * ms, t_end_s=hi * ms,
                                    is_clean_stop=[1, 0])  # fmt: skip
    return replace(
        log,
        labels=tuple(labels),
        client_emissions=ClientEmissions.from_columns(
            request=req, t_s=t_all, t_ready_s=t_all, num_tokens=np.ones(len(req)), process=proc),
        proc_segments=ProcSegments.from_columns(
            process=w[:, 0], label=w[:, 1], t_start_s=w[:, 2] * ms, t_end_s=w[:, 3] * ms),
        deliveries=Deliveries.from_columns(step=d[:, 0], t_out_s=d[:, 1], t_recv_s=d[:, 2],
                                           process=d[:, 3]),
        coverage=cov,
    )  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_fast_equals_reference_and_every_client_ttft_reconciles(seed):
    log = served_log(seed)
    assume(log is not None)
    log = validate_log(log)
    fast = client_ttft_partition(log)  # check=True: raises if a TTFT's parts miss its length
    ref = check_client_ttft_reconciled(client_ttft_reference(log), "reference")
    assert fast.labels == ref.labels and fast.notes == ref.notes
    np.testing.assert_array_equal(fast.request, ref.request)
    np.testing.assert_allclose(fast.ttft_ms, ref.ttft_ms, rtol=0, atol=1e-9)
    np.testing.assert_allclose(fast.parts_ms, ref.parts_ms, rtol=0, atol=1e-9)
    assert np.all(fast.parts_ms >= -1e-9)
    # the engine part is the engine boundary's partition, its frontend part the rest
    eng = ttft_partition(log)
    rows = np.searchsorted(eng.request, fast.request)
    ne = len(eng.labels)
    np.testing.assert_allclose(fast.engine_ttft_ms, eng.ttft_ms[rows], rtol=0, atol=1e-9)
    front_os = [j for j, lb in enumerate(eng.labels) if lb.startswith("frontend_os_")]
    own = np.delete(fast.parts_ms[:, :ne] - eng.parts_ms[rows], front_os, axis=1)
    np.testing.assert_allclose(own, 0.0, rtol=0, atol=1e-9)


def test_random_server_logs_exercise_the_frontend_rules():
    """The generator is not vacuous: over 100 seeds every frontend label owns some time,
    some request is left out, some chunk goes to an API server outside its span."""
    seen: dict[str, float] = {}
    left_out = 0
    for seed in range(100):
        log = served_log(seed)
        if log is None:
            continue
        p = client_ttft_partition(validate_log(log))
        left_out += any("before" in n for n in p.notes)
        for lb, v in zip(p.labels, p.parts_ms.sum(axis=0), strict=True):
            seen[lb] = seen.get(lb, 0.0) + float(v)
    for lb in ("hop", "frontend_other", "sse_write", "output", "input", "frontend_gc",
               "frontend_os_runqueue", "frontend_os_blocked", "unrecorded:api_server",
               "http", "prefill_own"):  # fmt: skip
        assert seen.get(lb, 0.0) > 0, lb
    assert left_out


def test_ttft_command_at_the_client_boundary(tmp_path):
    """`tracekit ttft --boundary client`: the hand case's figures and records in every
    format; an engine-only log is refused with one line."""
    path = str(_hand_log().save(tmp_path / "serve.npz"))

    def tk(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tracekit", *args], capture_output=True,
                              text=True, timeout=300)  # fmt: skip

    r = tk("ttft", path, "--boundary", "client")
    assert r.returncode == 0, r.stderr
    assert "client-boundary TTFT" in r.stdout and "p50 9.0" in r.stdout
    assert "engine boundary (to the first token) p50 5.0" in r.stdout
    assert "first chunk written before" in r.stderr  # request 1, left out and said
    r = tk("ttft", path, "--boundary", "client", "--format", "jsonl")
    (rec,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert rec["request"] == "r0" and rec["ttft_ms"] == pytest.approx(9.0)
    assert rec["engine_ttft_ms"] == pytest.approx(5.0) and rec["frontend_ms"] == pytest.approx(4)
    assert {k: round(v, 9) for k, v in rec["parts"].items() if v} == HAND
    r = tk("ttft", path, "--boundary", "client", "--format", "csv")
    assert r.returncode == 0 and "parts.hop" in r.stdout.splitlines()[0]
    out = tmp_path / "c.parquet"
    r = tk("ttft", path, "--boundary", "client", "--format", "parquet", "-o", str(out))
    assert r.returncode == 0, r.stderr
    import pandas as pd  # only this test reads parquet

    assert pd.read_parquet(out)["ttft_ms"].tolist() == pytest.approx([9.0])
    b = LogBuilder()
    b.step(0, 1)
    b.emit(0, 1, 0)
    r = tk("ttft", str(b.build().save(tmp_path / "engine.npz")), "--boundary", "client")
    assert r.returncode == 2 and "client_emissions" in r.stderr


def test_analyze_and_the_report_show_both_boundaries():
    """analyze's client block carries the client-boundary TTFT (the hand case: one request,
    9 ms; 5 ms to the first token) after its older keys; the terminal block and the HTML
    report's client section show it beside the engine boundary's."""
    from tracekit.analysis.figures import analyze  # the analysis stage, for this test only
    from tracekit.render.client import client_html, client_text

    c = analyze(_hand_log()).client
    assert c is not None
    rec = c.to_record()
    assert list(rec)[-5:] == ["ttft_p50_ms", "ttft_p99_ms", "ttft_engine_p50_ms",
                              "ttft_engine_p99_ms", "ttft_share"]  # fmt: skip
    assert np.allclose([rec["ttft_p50_ms"], rec["ttft_p99_ms"], rec["ttft_engine_p50_ms"],
                        rec["ttft_engine_p99_ms"]], [9, 9, 5, 5])  # fmt: skip
    got = {k: round(v * 9, 9) for k, v in rec["ttft_share"].items() if v}
    assert got == HAND
    line = next(x for x in client_text(c).splitlines() if x.startswith("TTFT ms"))
    assert "p50 9.00 p99 9.00" in line and "p50 5.00 p99 5.00" in line
    page = client_html([("serve", c)])
    assert ("client boundary (arrival to the first chunk's write)</td><td>9.00</td><td>9.00"
            in page)  # fmt: skip
    assert "engine boundary (arrival to the first token)</td><td>5.00</td><td>5.00" in page
