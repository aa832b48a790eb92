"""The Chrome trace for Perfetto: format, nesting, partitions in args, filters, the live
writer, determinism, and a validator that catches what Perfetto would misdraw."""

from __future__ import annotations

import json
import math
import time
from collections import Counter, defaultdict
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner
from logbuilder import LogBuilder
from synthlog import synthetic_log

from tracekit.attribution.itl import partition
from tracekit.capture.recorder import Recorder
from tracekit.cli import main
from tracekit.errors import UsageError
from tracekit.live.trace import ChromeTraceSink
from tracekit.render.perfetto import (
    PID_ENGINE,
    PID_REQUESTS,
    TID_LOOP,
    TID_REQUESTS,
    chrome_trace_events,
    engine_start_us,
    parse_window,
    read_trace,
    request_tid,
    validate_trace,
)


@pytest.fixture(scope="module")
def run():
    log = synthetic_log(duration_s=4.0, seed=3)
    return log, partition(log)


@pytest.fixture(scope="module")
def events(run):
    log, part = run
    return chrome_trace_events(log, part)


def slices(events, pid=None, name=None):
    return [
        e
        for e in events
        if e["ph"] == "X"
        and (pid is None or e["pid"] == pid)
        and (name is None or e["name"] == name)
    ]


def test_generated_trace_is_valid(run, events):
    log, _ = run
    assert validate_trace(events, max_ts_us=log.wall_s * 1e6 + 1) == []
    phases = Counter(e["ph"] for e in events)
    assert set(phases) == {"M", "X", "C"}
    json.dumps(events, allow_nan=False)  # plain JSON, no NaN


def test_every_gap_is_a_slice_named_by_its_primary_cause(run, events):
    log, part = run
    gaps = [e for e in slices(events, PID_REQUESTS) if e["name"] not in ("ttft", "evicted")]
    assert len(gaps) == len(part)
    assert Counter(e["name"] for e in gaps) == Counter(part.primary_names().tolist())
    # ordered like the partition (request, then time); parts sum to the slice (ms vs µs)
    by_start = sorted(gaps, key=lambda e: (e["tid"], e["ts"]))
    for e, g_ms in zip(by_start, part.gap_ms.tolist(), strict=True):
        assert e["args"]["gap_ms"] == pytest.approx(g_ms)
        assert sum(e["args"]["parts"].values()) * 1000 == pytest.approx(e["dur"], abs=0.01)
        assert e["dur"] == pytest.approx(g_ms * 1000, abs=0.002)


def test_steps_hold_their_segments(run, events):
    log, _ = run
    loop = [e for e in slices(events, PID_ENGINE) if e["tid"] == TID_LOOP]
    steps = {e["args"]["step"]: e for e in loop if e["name"] == "step"}
    assert len(steps) == len(log.steps)
    segs = [e for e in loop if e["name"] != "step"]
    assert len(segs) == len(log.segments)  # none overlaps another without nesting here
    for s in segs:
        st = steps[s["args"]["step"]]
        assert st["ts"] <= s["ts"] and s["ts"] + s["dur"] <= st["ts"] + st["dur"] + 1e-6
    assert {s["name"] for s in segs} <= set(log.labels)
    swap = [s for s in segs if s["name"] == "swap"]
    assert swap and all(s["args"]["cause"] == "preempt" for s in swap)


def test_tracks_are_named_and_gc_and_counters_are_there(run, events):
    log, _ = run
    names = {
        (e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["name"].endswith("_name")
    }
    assert names[(PID_ENGINE, None)] == "engine"
    assert names[(PID_ENGINE, TID_LOOP)] == "engine loop"
    assert sum(
        1 for (pid, _), n in names.items() if pid == PID_REQUESTS and n.startswith("req ")
    ) == len(log.requests)
    gcs = slices(events, PID_ENGINE, "gc")
    assert len(gcs) == len(log.gc_pauses)
    assert sorted(e["args"]["generation"] for e in gcs) == sorted(log.gc_pauses.generation.tolist())
    counters = Counter(e["name"] for e in events if e["ph"] == "C")
    assert counters == {"batch_size": len(log.steps), "kv_free_blocks": len(log.steps)}


def test_evictions_nest_inside_the_gaps_they_stall(run, events):
    """An eviction lies inside the gap it stalls (it is that gap's preempt time); the
    validator checks nesting, here the amounts: evicted time inside gaps <= preempt parts
    (preempt also holds swap segments)."""
    _, part = run
    evicted = slices(events, PID_REQUESTS, "evicted")
    assert evicted, "the synthetic run has evictions"
    gaps = defaultdict(list)
    for e in slices(events, PID_REQUESTS):
        if e["name"] not in ("evicted", "ttft"):
            gaps[e["tid"]].append(e)
    inside = 0.0
    for ev in evicted:
        host = [
            g
            for g in gaps[ev["tid"]]
            if g["ts"] <= ev["ts"] and ev["ts"] + ev["dur"] <= g["ts"] + g["dur"] + 1e-6
        ]
        if host:
            inside += ev["dur"]
            assert host[0]["args"]["parts"]["preempt"] * 1000 >= ev["dur"] - 0.01
    assert inside > 0
    assert inside <= part.column("preempt").sum() * 1000 + 0.01


def test_requests_and_window_cut_the_trace(run):
    log, part = run
    ids = log.request_ids[:2]
    ev = chrome_trace_events(log, part, requests=ids)
    assert validate_trace(ev) == []
    req_names = {
        e["args"]["name"] for e in ev if e["name"] == "thread_name" and e["pid"] == PID_REQUESTS
    }
    assert req_names == {f"req {i}" for i in ids}
    assert len(slices(ev, PID_ENGINE, "step")) == len(log.steps)  # the engine stays whole
    w = (1.0, 1.5)
    ev = chrome_trace_events(log, part, window_s=w)
    assert validate_trace(ev) == []
    for e in ev:
        if e["ph"] == "X":
            assert e["ts"] <= w[1] * 1e6 + 0.01 and e["ts"] + e["dur"] >= w[0] * 1e6 - 0.01
        elif e["ph"] == "C":
            assert w[0] * 1e6 - 0.01 <= e["ts"] <= w[1] * 1e6 + 0.01
    assert 0 < len(slices(ev, PID_ENGINE, "step")) < len(log.steps)
    with pytest.raises(UsageError, match="no request with id 'nope'"):
        chrome_trace_events(log, part, requests=["nope"])
    assert parse_window("1:2.5") == (1.0, 2.5)
    assert parse_window(":3") == (-math.inf, 3.0)
    for bad in ("3", "a:b", "5:1"):
        with pytest.raises(UsageError):
            parse_window(bad)


def test_overlapping_segments_go_to_overlap_tracks():
    """Segments on one thread that overlap without nesting (async work) must not break
    the nesting of the loop track: they move to an overlap track."""
    b = LogBuilder()
    s = b.step(0, 20)
    b.seg(s, "decode", 1, 12)
    b.seg(s, "tok", 8, 16)  # starts inside decode, ends after it
    b.seg(-1, "tok", 18, 25)  # crosses the step's end
    b.emit(0, 12, s)
    s2 = b.step(20, 40)
    b.seg(s2, "decode", 21, 35)
    b.emit(0, 35, s2)
    log = b.build()
    ev = chrome_trace_events(log, partition(log))
    assert validate_trace(ev) == []
    tids = {e["tid"] for e in slices(ev, PID_ENGINE)}
    assert len(tids) >= 2
    assert len(slices(ev, PID_ENGINE)) == 2 + 4


def test_cli_trace_is_deterministic_and_gzips(tmp_path):
    raw = tmp_path / "run.npz"
    synthetic_log(duration_s=2.0, seed=5).save(raw)
    runner = CliRunner()
    outs = {}
    for name in ("a.json", "b.json", "a.json.gz", "b.json.gz"):
        res = runner.invoke(main, ["trace", str(raw), "-o", str(tmp_path / name)])
        assert res.exit_code == 0, res.output
        outs[name] = (tmp_path / name).read_bytes()
    assert outs["a.json"] == outs["b.json"]
    assert outs["a.json.gz"] == outs["b.json.gz"]
    assert outs["a.json.gz"][:2] == b"\x1f\x8b"
    doc = json.loads(outs["a.json"])
    assert doc["displayTimeUnit"] == "ms"
    assert read_trace(str(tmp_path / "a.json.gz")) == doc["traceEvents"]
    assert validate_trace(doc["traceEvents"]) == []
    res = runner.invoke(main, ["trace", str(raw), "-o", str(tmp_path / "c.json"),
                               "--requests", "req-0,req-1", "--window", "0.5:1.0"])  # fmt: skip
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["trace", str(raw), "-o", str(tmp_path / "d.json"),
                               "--requests", "nope"])  # fmt: skip
    assert res.exit_code == 2 and "no request with id 'nope'" in res.output
    res = runner.invoke(main, ["trace", str(raw), "-o", str(tmp_path / "d.json"),
                               "--window", "x"])  # fmt: skip
    assert res.exit_code == 2 and "--window" in res.output


# -- the validator catches what it claims to -------------------------------------------


def _named(pid=1, tid=1):
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": "t"}}


def test_validator_rejects_broken_traces():
    def x(ts, dur, tid=1, **kw):
        return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": "s", **kw}

    ok = [_named(), x(0, 10), x(1, 2), x(3, 7), x(10, 5)]
    assert validate_trace(ok) == []
    cases = {
        "overlaps": [_named(), x(0, 10), x(5, 10)],
        "parts sum": [_named(), x(0, 10, args={"parts": {"a": 0.004, "b": 0.004}})],
        "negative part": [_named(), x(0, 10, args={"parts": {"a": 0.011, "b": -0.001}})],
        "no thread_name": [x(0, 10, tid=7)],
        "dur must be": [_named(), x(0, -1)],
        "ts must be": [_named(), x("0", 1)],
        "unsupported phase": [_named(), {"ph": "B", "pid": 1, "tid": 1, "ts": 0, "name": "s"}],
        "name must be": [_named(), {**x(0, 1), "name": ""}],
        "counter args": [{"ph": "C", "pid": 1, "ts": 0, "name": "c", "args": {"v": "1"}}],
        "unknown metadata": [{"ph": "M", "pid": 1, "name": "bogus", "args": {}}],
        "used by pid": [_named(), _named(pid=2), x(0, 1), {**x(0, 1), "pid": 2}],
    }
    for what, evs in cases.items():
        errs = validate_trace(evs)
        assert errs and any(what in e for e in errs), (what, errs)
    # seconds passed as µs, or ns: caught against the run's length
    assert any("wrong unit" in e for e in validate_trace([_named(), x(5e12, 1)], max_ts_us=6e7))


# -- the live trace ------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 1_000_000

    def __call__(self) -> int:
        return self.t

    def advance_ms(self, ms: float) -> None:
        self.t += int(ms * 1e6)


def _serve(rec: Recorder, clock: FakeClock, steps: int, live_check=None) -> None:
    for i in range(4):
        rec.request(f"r{i}", prompt_tokens=8)
    for s in range(steps):
        with rec.step():
            with rec.segment("decode"):
                clock.advance_ms(5)
            if s == 5:
                rec.evict("r1")
            if s == 9:
                rec.readmit("r1")
            ids = [f"r{i}" for i in range(4) if not (i == 1 and 5 <= s < 9)]
            rec.emit(ids)
            rec.counter("batch_size", len(ids))
            clock.advance_ms(1)
        if live_check is not None and s == steps // 2:
            live_check()


def test_live_trace_while_recording(tmp_path):
    clock = FakeClock()
    path = tmp_path / "live.json"
    live = ChromeTraceSink(path)
    rec = Recorder(tmp_path / "run.npz", clock=clock, gc=False, flush_interval_s=0.02,
                   sinks=[live])  # fmt: skip
    seen = {}

    def mid_run():
        # a run killed now leaves an array without its closing bracket: still readable
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            text = path.read_text()
            if '"name":"gap"' in text:
                break
            time.sleep(0.01)
        assert not text.rstrip().endswith("]")
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)
        seen["mid"] = read_trace(str(path))

    with rec:
        _serve(rec, clock, 30, mid_run)
    assert any(e["name"] == "gap" for e in seen["mid"])
    text = path.read_text()
    events = json.loads(text)  # closed on stop: strict JSON
    assert isinstance(events, list)
    assert validate_trace(events) == []
    names = Counter(e["name"] for e in events if e["ph"] == "X")
    assert names["step"] == 30 and names["decode"] == 30
    assert names["gap"] == 4 * 29 - 4  # r1 misses 4 steps while evicted: 4 fewer gaps
    assert names["evicted"] == 1
    assert Counter(e["name"] for e in events if e["ph"] == "C")["batch_size"] == 30
    # the live trace agrees with the log it was recorded with
    log = rec.log()
    gaps = sorted(e["args"]["gap_ms"] for e in events if e["name"] == "gap")
    assert gaps == pytest.approx(sorted(partition(log).gap_ms.tolist()))
    # the slices sit where the log has them (µs from engine start)
    steps = sorted((e["ts"], e["dur"]) for e in events if e["name"] == "step")
    dur_us = (log.steps.t_end_s - log.steps.t_start_s) * 1e6
    want = sorted(zip(log.steps.t_start_s * 1e6, dur_us, strict=True))
    assert np.allclose(steps, want, atol=2e-3)
    live.close({})  # idempotent


def _slices(events, *, live: bool):
    """Every complete slice as (pid, tid, name, ts µs, dur µs, args): a post-run gap is
    named by its cause and carries ``parts``, which need the whole run; the live trace
    names every gap ``gap``, so the comparison does too and leaves ``parts`` out."""
    out = []
    for e in events:
        if e["ph"] != "X":
            continue
        name = e["name"]
        args = {k: v for k, v in e["args"].items() if k != "parts"}
        if not live and e["pid"] == PID_REQUESTS and name not in ("ttft", "evicted"):
            name = "gap"
        args = {k: round(v, 6) if isinstance(v, float) else v for k, v in args.items()}
        out.append((e["pid"], e["tid"], name, round(e["ts"], 3), round(e["dur"], 3), args))
    return sorted(out, key=repr)


def _tracks(events):
    return {(e["pid"], e.get("tid"), e["name"]): e["args"] for e in events if e["ph"] == "M"}


def test_live_and_post_run_traces_show_one_layout(tmp_path):
    """The trace written while the run records and ``tracekit trace`` of its log: the same
    tracks (names, places), the same slices on them, the same args (but what needs the
    whole run: a gap's cause and parts)."""
    import threading

    clock = FakeClock()
    path = tmp_path / "live.json"
    rec = Recorder(None, clock=clock, gc=False, flush_interval_s=0.02,
                   sinks=[ChromeTraceSink(path)])  # fmt: skip

    def side():  # a segment on another thread: its own track, `thread 1`
        with rec.segment("tok"):
            clock.advance_ms(2)

    with rec:
        _serve(rec, clock, 12)
        t = threading.Thread(target=side)
        t.start()
        t.join()
        with rec.step():
            with rec.segment("swap"):  # a label whose cause is not its name: args.cause
                clock.advance_ms(3)
            rec.evict("r2")  # never readmitted: evicted to the stop
            rec.emit(["r0"])
        clock.advance_ms(4)
    log = rec.log()
    live = json.loads(path.read_text())
    post = chrome_trace_events(log, partition(log))
    assert validate_trace(live) == []
    assert _tracks(live) == _tracks(post)
    assert _slices(live, live=True) == _slices(post, live=False)
    # the layout, by hand: request r on track TID_REQUESTS + r, its evictions on it too
    tid_r1 = TID_REQUESTS + 1
    r1 = [e for e in live if e["ph"] == "X" and e["tid"] == tid_r1]
    (ev,) = [e for e in r1 if e["name"] == "evicted"]
    # evicted 5 ms into step 5, readmitted 5 ms into step 9: 4 steps of 6 ms
    assert ev["args"] == {"evicted_ms": 24.0}
    (gap,) = [e for e in r1 if e["name"] == "gap" and e["ts"] <= ev["ts"] < e["ts"] + e["dur"]]
    assert (gap["args"]["step0"], gap["args"]["step1"]) == (4, 9)  # the eviction nests in it
    (ttft,) = [e for e in r1 if e["name"] == "ttft"]
    assert ttft["args"] == {"ttft_ms": 5.0}  # arrived at 0, first token at step 0's emit
    swap = [e for e in live if e["name"] == "swap"]
    assert swap[0]["args"] == {"step": 12, "cause": "preempt"}
    (ev2,) = [e for e in live if e["name"] == "evicted" and e["tid"] == TID_REQUESTS + 2]
    assert ev2["args"] == {"evicted_ms": 4.0}  # from the evict to the stop, 4 ms later


def test_live_trace_is_gc_quiet(tmp_path):
    """The live sink formats whole columns with numpy, so it allocates no GC-tracked
    object per row: formatting 20,000 emissions (10,000 gaps) with the collector enabled
    runs no collection of generation 0, where one per 2,000 container allocations (the
    default threshold) would run 10 or more if each gap row made even one container."""
    import gc

    live = ChromeTraceSink(tmp_path / "live.json")
    live.open({"t0_tick": 0, "seconds_per_tick": 1e-9})
    rows = {
        k: np.zeros(0, dtype=np.int64)
        for k in ("steps", "segments", "gc_pauses", "emissions", "events", "requests")
    }
    rows["emissions"] = np.array([[0, 10, 1, 1, 1], [0, 20, 2, 1, 2]] * 10_000,
                                 dtype=np.int64).ravel()  # fmt: skip
    chunk = {**rows, "counters": np.zeros(0), "labels": np.array(["decode"]),
             "counter_names": np.array([], dtype=str), "request_ids": np.array(["a"]),
             "request_ids_start": np.array(0)}  # fmt: skip
    live.write(chunk)  # warm up (imports, first-use caches)
    assert gc.isenabled() and gc.get_threshold()[0] <= 2000
    gc.collect()
    before = gc.get_stats()[0]["collections"]
    live.write(chunk)
    ran = gc.get_stats()[0]["collections"] - before
    live.close({})
    assert ran <= 1, ran
    events = json.loads((tmp_path / "live.json").read_text())
    assert sum(e["name"] == "gap" for e in events) == 2 * 20_000 - 1  # all but the first


def test_live_trace_escapes_names(tmp_path):
    """Request ids and labels with JSON-special characters are escaped in the live file."""
    clock = FakeClock()
    path = tmp_path / "live.json"
    rec = Recorder(None, clock=clock, gc=False, flush_interval_s=1e9, sinks=[ChromeTraceSink(path)])
    with rec:
        rec.request('a"b\\c</script>')
        for _ in range(3):
            with rec.step():
                with rec.segment('lab"el'):
                    clock.advance_ms(2)
                rec.emit(['a"b\\c</script>'])
    events = json.loads(path.read_text())
    assert validate_trace(events) == []
    assert any(e["name"] == 'lab"el' for e in events)
    assert any(e.get("args", {}).get("name") == 'req a"b\\c</script>' for e in events)


def test_trace_of_a_log_without_requests_or_counters():
    b = LogBuilder()
    b.step(0, 10, n_decode=0, graph=-1)
    log = replace(b.build(), request_ids=())
    log = replace(log, emissions=log.emissions.take(np.zeros(0, dtype=int)))
    ev = chrome_trace_events(log, partition(log))
    assert validate_trace(ev) == []


def test_evictions_before_between_and_after_tokens():
    """Evicted while waiting for its first token (inside the ttft slice), inside a gap,
    and never readmitted (inside the gaps it stalls, then on its own to the run's end)."""
    b = LogBuilder()
    for i in range(6):
        s = b.step(10 * i, 10 * i + 9)
        b.seg(s, "decode", 10 * i, 10 * i + 8)
        if i not in (2, 3):
            b.emit(0, 10 * i + 8, s)  # tokens at 8, 18, 48, 58 ms
    b.evict(0, 1.0, 4.0)  # before the first token
    b.evict(0, 19.0, 35.0)  # inside the gap 18 -> 48
    b.evict(0, 50.0)  # never readmitted: runs to the end
    log = b.build(wall_ms=60.0)
    ev = chrome_trace_events(log, partition(log))
    assert validate_trace(ev, max_ts_us=60_000) == []
    req = [(e["ts"], e["dur"], e["name"]) for e in slices(ev, PID_REQUESTS)]
    assert req == [
        (0.0, 8000.0, "ttft"),
        (1000.0, 3000.0, "evicted"),
        (8000.0, 10000.0, "clean"),
        (18000.0, 30000.0, "preempt"),
        (19000.0, 16000.0, "evicted"),
        (48000.0, 10000.0, "preempt"),
        (50000.0, 8000.0, "evicted"),
        (58000.0, 2000.0, "evicted"),
    ]
    # a window shows the slices that overlap it, of the gaps those that end in it, with
    # what nests in them: here the gap 18 -> 48 and its eviction; the ttft (0 -> 8) and the
    # eviction inside it lie outside
    ev = chrome_trace_events(log, partition(log), window_s=(0.040, 0.049))
    req = [(e["ts"], e["dur"], e["name"]) for e in slices(ev, PID_REQUESTS)]
    assert req == [(18000.0, 30000.0, "preempt"), (19000.0, 16000.0, "evicted")]
    # the gap 48 -> 58 ends after 55 ms: not the window's; its eviction (from 50 ms, never
    # readmitted: to the run's end at 60) is drawn on its own, whole
    ev = chrome_trace_events(log, partition(log), window_s=(0.040, 0.055))
    req = [(e["ts"], e["dur"], e["name"]) for e in slices(ev, PID_REQUESTS)]
    assert req == [(18000.0, 30000.0, "preempt"), (19000.0, 16000.0, "evicted"),
                   (50000.0, 10000.0, "evicted")]  # fmt: skip


def test_a_stretched_window_draws_only_its_own_gaps_and_ttfts():
    """`trace --window 40..49` (ms here): the engine tracks go back to the start of the
    earliest gap ending in the window (18 ms: `trace_span_s`), the request tracks show
    only the window's own gaps (ending in [40, 49)) and the TTFTs overlapping it. Request
    0 emits at 8, 18, 48 (evicted 19 -> 35), request 1 every 10 ms from 8, request 2
    arrives at 20 and emits at 28 and 38. Its gaps: 0's 18 -> 48 (preempt: 16 of 30 ms)
    and 1's 38 -> 48 (clean). Not 1's 18 -> 28 and 28 -> 38, 2's TTFT 20 -> 28 or its gap
    28 -> 38: they end inside the stretch, before the window (a window read in slices
    partitions only its own gaps and TTFTs)."""
    b = LogBuilder()
    for i in range(6):
        s = b.step(10 * i, 10 * i + 9)
        b.seg(s, "decode", 10 * i, 10 * i + 8)
        if i not in (2, 3):
            b.emit(0, 10 * i + 8, s)
        b.emit(1, 10 * i + 8, s)
        if i in (2, 3):
            b.emit(2, 10 * i + 8, s)
    b.evict(0, 19.0, 35.0)
    log = b.build(wall_ms=60.0, arrivals_ms=[0.0, 0.0, 20.0])
    ev = chrome_trace_events(log, partition(log), window_s=(0.018, 0.049),
                             own_s=(0.040, 0.049))  # fmt: skip
    req = [(e["tid"], e["ts"], e["dur"], e["name"]) for e in slices(ev, PID_REQUESTS)]
    t0, t1 = request_tid(0), request_tid(1)
    assert req == [(t0, 18000.0, 30000.0, "preempt"), (t0, 19000.0, 16000.0, "evicted"),
                   (t1, 38000.0, 10000.0, "clean")]  # fmt: skip
    steps = [e["args"]["step"] for e in slices(ev, PID_ENGINE) if e["name"] == "step"]
    assert steps == [1, 2, 3, 4]  # the engine from 18 ms: steps 1 (10-19) to 4 (40-49)


def test_a_request_that_arrived_before_engine_start_shifts_the_trace():
    """Perfetto wants ts >= 0: a run with an arrival at -5 ms is shifted by whole µs, and
    the shift is recorded (engine_start_us), so engine-clock times can be read back."""
    b = LogBuilder()
    for i in range(3):
        s = b.step(10 * i, 10 * i + 9)
        b.seg(s, "decode", 10 * i, 10 * i + 8)
        b.emit(0, 10 * i + 8, s)
    log = b.build(arrivals_ms=[-5.0])
    ev = chrome_trace_events(log, partition(log))
    assert validate_trace(ev) == []
    assert engine_start_us(ev) == 5000.0
    ttft = slices(ev, PID_REQUESTS, "ttft")[0]
    assert (ttft["ts"], ttft["dur"]) == (0.0, 13000.0)
    first_step = min(e["ts"] for e in slices(ev, PID_ENGINE, "step"))
    assert first_step - engine_start_us(ev) == 0.0
    assert engine_start_us(chrome_trace_events(*_plain())) == 0.0


def _plain():
    b = LogBuilder()
    s = b.step(0, 9)
    b.emit(0, 8, s)
    log = b.build()
    return log, partition(log)


def test_an_eviction_with_a_cause_is_an_arrow_from_its_step_to_its_victim():
    """r1's decode evicts r0 at 12 ms in step 1 [10, 20] (kv_full, 50 tokens lost); r2 is
    evicted at 15 ms with no cause told. One arrow: its start on the engine loop at 12 ms
    (inside step 1's slice), its end on r0's track at 12 ms (where its `evicted` slice
    begins), the cause in the start's args; none for r2."""
    b = LogBuilder()
    for i, (t0, t1) in enumerate(((0, 10), (10, 20), (20, 40))):
        b.step(t0, t1)
        b.seg(i, "decode", t0, t1)
    for r in (0, 1, 2):
        b.emit(r, 10, 0)
        b.emit(r, 40, 2)
    b.emit(1, 20, 1)
    b.evict(0, 12, 21, mode=1)
    b.cause(0, 12, 1, "kv_full", by=(1,), lost=50, free=0, used=4)
    b.evict(2, 15, 22, mode=1)
    log = b.build()
    events = chrome_trace_events(log, partition(log))
    assert validate_trace(events) == []
    flows = [e for e in events if e["ph"] in ("s", "f")]
    assert [(e["ph"], e["pid"], e["tid"], e["ts"], e["id"]) for e in flows] == [
        ("s", PID_ENGINE, TID_LOOP, 12000.0, 0),
        ("f", PID_REQUESTS, TID_REQUESTS + 0, 12000.0, 0),
    ]
    assert flows[1]["bp"] == "e" and {e["name"] for e in flows} == {"eviction"}
    assert flows[0]["args"] == {
        "victim": "r0", "evictors": ["r1"], "reason": "kv_full", "step": 1,
        "num_computed_tokens_lost": 50,
    }  # fmt: skip
    (step1,) = [e for e in slices(events, PID_ENGINE, "step") if e["ts"] == 10000.0]
    assert step1["ts"] <= flows[0]["ts"] <= step1["ts"] + step1["dur"]
    (evicted,) = [e for e in slices(events, PID_REQUESTS, "evicted") if e["tid"] == TID_REQUESTS]
    assert evicted["ts"] == flows[1]["ts"]
    assert validate_trace([*events, {"ph": "s", "pid": 1, "tid": 0, "ts": 1.0, "name": "x"}])
