"""Live TTFT at the client boundary (`tracekit.live.client_ttft`): an API server's own
rows, arrival to its first chunk's write (docs/live.md, "TTFT at the client boundary").
Expected values are derived by hand from that rule; the real server's live = offline check
is in tests/adapters/test_adapters_vllm_serve_live.py."""

from __future__ import annotations

import socket
from urllib.request import urlopen

import numpy as np
import pytest

pytest.importorskip("prometheus_client")

import tracekit  # noqa: E402
from tracekit.live.client_ttft import ClientTtftLive  # noqa: E402

BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)  # seconds; +Inf added
LABELS = {"run": "r", "engine": "vllm", "model": "m", "process": "api_server-1"}


def _flush(flush_tick, requests=(), emissions=()):
    """One flushed batch (ticks are ms): requests (index, arrival), emissions (index, t)."""
    rq = [[i, a, -1, -1] for i, a in requests]
    em = [[i, t, -1, 1, -1] for i, t in emissions]
    return {
        "requests": np.array(rq, dtype=np.int64).reshape(-1, 4),
        "emissions": np.array(em, dtype=np.int64).reshape(-1, 5),
        "flush_tick": np.array(flush_tick),
    }


def _scrape(port: int) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        body = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            assert {k: s.labels[k] for k in LABELS} == LABELS
            out[(s.name, s.labels.get("le", ""))] = s.value
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_first_chunk_write_less_arrival_across_flushes_served_from_the_start():
    live = ClientTtftLive(const_labels=LABELS, buckets_s=BOUNDS, max_wait_s=2.0)
    port = live.serve(_free_port())
    try:
        before = _scrape(port)  # served at 0 before the recorder starts
        assert before[("tracekit_ttft_client_seconds_count", "")] == 0
        assert before[("tracekit_ttft_client_seconds_bucket", "+Inf")] == 0
        assert before[("tracekit_live_final", "")] == 0
        live.open({"seconds_per_tick": 1e-3})
        # request 0: arrival 0, chunks written at 30, 50 (same flush): TTFT 0.030 s
        # request 1: arrival 10, first chunk at 1200, in the next flush: 1.190 s
        # request 2: arrival 100, chunk at 150: 0.050 s, on a bound (le counts <=)
        # request 3: arrival 20, never a chunk (not streamed): no TTFT
        # request 4: arrival 1100, first chunk at 3500: by the flush at 3200 it waited
        #   2.1 s > max_wait_s with no chunk and is forgotten: no TTFT
        # the chunks in a flush are in any order: request 0's at 50 comes before its 30
        live.write(_flush(1000, [(0, 0), (1, 10), (2, 100), (3, 20)],
                          [(0, 50), (0, 30), (2, 150)]))  # fmt: skip
        live.write(_flush(2000, [(4, 1100)], [(1, 1200), (0, 1210), (1, 1220)]))
        live.write(_flush(3200))
        live.write(_flush(4000, [], [(4, 3500)]))
        s = _scrape(port)
        # TTFTs 0.030, 1.190, 0.050 s: <= 0.05: 2; <= 1.0: 2; <= 2.5: 3
        want = {0.01: 0, 0.025: 0, 0.05: 2, 0.1: 2, 0.25: 2, 0.5: 2, 1.0: 2, 2.5: 3}
        for b, n in want.items():
            assert s[("tracekit_ttft_client_seconds_bucket", repr(b))] == n, b
        assert s[("tracekit_ttft_client_seconds_bucket", "+Inf")] == 3
        assert s[("tracekit_ttft_client_seconds_count", "")] == 3
        assert s[("tracekit_ttft_client_seconds_sum", "")] == pytest.approx(1.27, abs=1e-12)
        assert s[("tracekit_live_final", "")] == 0
        live.close({})
        assert _scrape(port)[("tracekit_live_final", "")] == 1
    finally:
        live.shutdown()


def test_a_recorders_own_rows_feed_it():
    # the API server's path: request() with its HTTP receipt as arrival, emit_chunk() per
    # chunk written; a fake clock in ms
    now = [0]
    rec = tracekit.Recorder(None, clock=lambda: now[0], seconds_per_tick=1e-3,
                            flush_interval_s=60.0, gc=False, handle_signals=False)  # fmt: skip
    live = ClientTtftLive(const_labels=LABELS, buckets_s=BOUNDS)
    rec.add_sink(live)
    with rec:
        now[0] = 5
        a = rec.request("cmpl-a", arrival_tick=2)
        b = rec.request("cmpl-b", arrival_tick=4)
        now[0] = 300
        rec.emit_chunk(b, 290, 297)  # b: 297 - 4 = 293 ms
        rec.emit_chunk(a, 298, 300)  # a: 300 - 2 = 298 ms
        now[0] = 320
        rec.emit_chunk(a, 310, 320)
    snap = live.snapshot()
    assert snap["final"] and snap["count"] == 2
    assert snap["sum_s"] == pytest.approx(0.293 + 0.298, abs=1e-12)
    # both in (0.25, 0.5]
    assert snap["counts"].tolist() == [0, 0, 0, 0, 0, 2, 0, 0, 0]


def test_bad_buckets_and_wait_are_refused():
    with pytest.raises(ValueError, match="buckets_s"):
        ClientTtftLive(const_labels=LABELS, buckets_s=(0.1, 0.05))
    with pytest.raises(ValueError, match="max_wait_s"):
        ClientTtftLive(const_labels=LABELS, max_wait_s=0)
